"""Reading a tile of KV rows where the cache keeps them: pages through a page table.

A paged cache stores logical position p of batch row b at row p % page_size of page
`page_table[b, p // page_size]` (pages `[num_pages, Hkv, page_size, D]`). A tile of
`tile` logical rows is then one slice of one page when page_size is a multiple of
`tile`, or a gather of rows from the pages it spans otherwise (any page size works).
Entries of -1 (no page) read page 0; the caller masks those positions (they lie past
the row's length). Entries past the pool (a corrupt table, which the wrappers' checks
report) read its last page: whatever a table holds, no load leaves the page pool.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def page_table_row(page_table_ref, batch):
    """`page_of` for row `batch` of a page table [B, max_pages] (-1 = none)."""
    max_pages = page_table_ref.shape[1]
    return lambda slot: page_table_ref[batch, jnp.minimum(slot, max_pages - 1)]


def in_pool(page, num_pages: int):
    """A page-table entry clamped into a pool of `num_pages` pages: -1 (no page) reads
    page 0, an entry past the pool its last page (positions the caller masks, or a
    corrupt table's, never memory outside the pool)."""
    return jnp.clip(page, 0, num_pages - 1)


def page_and_offset(page_of, position, *, page_size: int, num_pages: int):
    """(the physical page holding logical row `position` (a scalar or an index array),
    clamped into the pool (`in_pool`), and the row's offset within it)."""
    page = in_pool(page_of(lax.div(position, jnp.int32(page_size))), num_pages)
    return page, lax.rem(position, jnp.int32(page_size))


def paged_tile_view(pages_ref, page_of, kv_head, tile_start, *, tile: int, page_size: int,
                    column_start: int, width: int):
    """A `[tile, width]` view of logical rows tile_start.. of one KV head's pages.

    `page_of(slot)` maps logical page numbers (a scalar or an index array) to physical
    pages, reading whatever table the caller keeps (a page table row, or a ragged list).
    """
    locate = functools.partial(page_and_offset, page_of, page_size=page_size,
                               num_pages=pages_ref.shape[0])
    if page_size % tile == 0:  # the tile lies inside one page
        page, offset = locate(tile_start)
        return pages_ref.at[page, kv_head, pl.ds(offset, tile), pl.ds(column_start, width)]
    # Indices per row ([tile, 1]) and per column ([1, width]), broadcast by the load:
    # Triton builds the pointers in the copy's own layout. Computed on the whole
    # [tile, width] tile they were built in the page-table gather's layout and converted
    # through shared memory every tile (32 KiB more shared memory: one program per SM
    # instead of two). The page table is read as a [tile] vector and given its column
    # axis afterwards: read as [tile, 1], each thread loaded its rows' entries once per
    # column of the copy layout (8x the loads). H100 results, both forms:
    # f908cd9:benchmarks/results/2026-11-23-h100-paged-small-pages.json.
    pages, offsets = locate(tile_start + lax.iota(jnp.int32, tile))
    columns = column_start + lax.broadcasted_iota(jnp.int32, (1, width), 1)
    return pages_ref.at[pages[:, None], jnp.full((tile, 1), kv_head), offsets[:, None],
                        columns]


def load_rows(view, valid_rows):
    """Loads a `[rows, width]` view; rows where valid_rows [rows, 1] is False read 0 (and
    are not read at all, so a view past the end of an array is safe)."""
    if valid_rows is None:
        return view[...]
    return plgpu.load(view, mask=jnp.broadcast_to(valid_rows, view.shape), other=0)


def shifts_values(quantized, matmul_dtype) -> bool:
    """Whether P.v over a quantized cache's values runs in float16, whose subnormals would
    swallow P's columns times small value scales: the kernels then keep the scales
    relative to a power of two a tile (`online_softmax.initial_state_chunks`'
    value_shift)."""
    return bool(quantized) and jnp.dtype(matmul_dtype) == jnp.dtype(jnp.float16)


def as_int8_bits(k, v, scales):
    """(k, v, quantized) as the kernels take K/V: with scales (an 8-bit cache's pages or
    contiguous K/V), int8 as it is and float8 as int8 of the same bits (a bitcast: no
    copy), and quantized the stored dtype's name, with which `quantized_tiles`
    reinterprets the loaded tiles; without scales, k and v as they are and None.

    Loaded as float8, a tile could not be filled with 0 past the row's length (Pallas's
    Triton lowering casts a load's fill value to 16/32/64-bit floats only), and zeroing
    those rows after the conversion made Triton stage both converted tiles through
    shared memory: the float8 decode kernel (B8 S16384 Hq 32 Hkv
    8 D 128, pages of 64, as pip triton 3.6.0 compiles it for sm_90) took 103424 B of
    shared memory and 197 registers a thread, against int8's 41984 B and 168; read as
    bits, 41984 B and 171 (`python -m benchmarks.inspect_kernels lower --page-size 64
    --q-len 1 --cache-dtype float8_e4m3fn`, then `compile`)."""
    if scales is None:
        return k, v, None
    return (*(x if jnp.dtype(x.dtype) == jnp.dtype(jnp.int8)
              else lax.bitcast_convert_type(x, jnp.int8) for x in (k, v)),
            jnp.dtype(k.dtype).name)


def paged_scale_view(scales_ref, page_of, kv_head, tile_start, *, tile: int, page_size: int):
    """A `[tile]` view of the per-token scales [num_pages, Hkv, page_size] of a quantized
    cache's logical rows tile_start.. (as `paged_tile_view` finds their pages)."""
    locate = functools.partial(page_and_offset, page_of, page_size=page_size,
                               num_pages=scales_ref.shape[0])
    if page_size % tile == 0:
        page, offset = locate(tile_start)
        return scales_ref.at[page, kv_head, pl.ds(offset, tile)]
    pages, offsets = locate(tile_start + lax.iota(jnp.int32, tile))
    return scales_ref.at[pages, jnp.full((tile,), kv_head), offsets]


def first_scale(scales_ref, page_of, kv_head, tile_start, *, page_size: int, batch=None):
    """The scale of logical row tile_start (a scalar load): `paged_scale_view`'s first
    entry, or with page_of None contiguous K/V's scales [B, Skv, Hkv] at row `batch`."""
    if page_of is None:
        return scales_ref[batch, tile_start, kv_head]
    page, offset = page_and_offset(page_of, tile_start, page_size=page_size,
                                   num_pages=scales_ref.shape[0])
    return scales_ref[page, kv_head, offset]


def load_scales(view, valid_rows):
    """A `[1, tile]` row of scales; rows where valid_rows [tile, 1] is False read 0."""
    if valid_rows is None:
        return view[...][None, :]
    return plgpu.load(view, mask=valid_rows[:, 0], other=0.0)[None, :]


def quantized_tiles(keys, values, scale_refs, page_of, kv_head, tile_start, *, tile: int,
                    page_size: int, valid_rows, dtype, cache_dtype, batch=None):
    """A quantized (int8 / float8) cache's tiles ready for the matmuls: (key and value
    column chunks in the queries' 16-bit `dtype`, exact for both formats; the keys'
    scales [1, tile], which multiply the score columns after q.k; the values' scales,
    which multiply P's columns before P.v). keys, values: int8 tiles holding the bits of
    `cache_dtype` (`as_int8_bits`; rows past the length 0, which is 0.0 in both formats).
    scale_refs: (k_scales, v_scales) [num_pages, Hkv, page_size]; or, with page_of None,
    contiguous K/V's scales [B, Skv, Hkv], read at row `batch`."""
    def view(ref):
        if page_of is None:
            return ref.at[batch, pl.ds(tile_start, tile), kv_head]
        return paged_scale_view(ref, page_of, kv_head, tile_start, tile=tile,
                                page_size=page_size)
    key_scale, value_scale = (load_scales(view(ref), valid_rows) for ref in scale_refs)
    def converted(tile):
        if jnp.dtype(cache_dtype) != jnp.dtype(jnp.int8):
            tile = lax.bitcast_convert_type(tile, cache_dtype)
        return tile.astype(dtype)
    return ([converted(key) for key in keys], [converted(value) for value in values],
            key_scale, value_scale)
