"""The tile steps both latent-attention decodes share (`decode_latent_mosaic.py`, whose
compute warpgroups split a tile's columns, and `decode_latent_stage_mosaic.py`, which
reads the values from the key tiles): where a tile's rows come from in the cache, the
mask of a partial tile, the online softmax of a tile of [64 heads, T keys] logits, the
final normalizers, and zeroing a paged tile's value rows past the row's length. Rows are
query heads, columns keys (kv_idx along axis 1)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels import online_softmax
from pallas_flex.kernels.kv_tiles import in_pool, page_table_row
from pallas_flex.kernels.mosaic_tiles import Vector, apply_mask, index_vector


def copies_per_tile(tile: int, page_size) -> int:
    """TMA copies filling a tile of `tile` rows (`tile_sources`): one from a contiguous
    cache or a page holding the tile, else one per page."""
    return tile // page_size if page_size is not None and page_size < tile else 1


def tile_sources(source, page_table_ref, batch, key_start, *, tile: int, page_size):
    """[(stage rows, [rows, D] view of the cache)] filling a tile of `tile` keys from
    row `batch`: one copy from a contiguous cache source [B, S, 1, D] (page_size None),
    or from pages [num_pages, 1, page_size, D] through page_table_ref one copy of a page
    holding the whole tile, else one per page. Page-table entries are clamped into the
    pool (`kv_tiles.in_pool`): rows past a length read some page, which the kernels
    mask."""
    if page_size is None:
        return [(slice(None), source.at[batch, pl.ds(key_start, tile), 0])]
    page_of = page_table_row(page_table_ref, batch)
    first_page = lax.div(key_start, jnp.int32(page_size))
    if page_size >= tile:
        page = in_pool(page_of(first_page), source.shape[0])
        return [(slice(None), source.at[page, 0, pl.ds(
            lax.rem(key_start, jnp.int32(page_size)), tile)])]
    return [(pl.ds(index * page_size, page_size),
             source.at[in_pool(page_of(first_page + index), source.shape[0]), 0])
            for index in range(copies_per_tile(tile, page_size))]


def mask_partial_tile(logits, kv_start, *, mask_program, mask_reads, mask_refs, batch, kv_len,
                      kv_length, interpret):
    """The logits of a partial tile whose first key is kv_start, masked by the mask_mod
    (read at in-range indices; rows are heads, so h and q_idx are 0) and at the keys at or
    past kv_length (the row's length on a paged cache, else the cache's)."""
    keys = logits.shape[1]
    kv_position = index_vector(kv_start, keys, 1)
    kv_idx = Vector(jnp.minimum(kv_position.value, kv_len - 1), 1)
    return apply_mask(logits, mask_program, mask_reads, mask_refs,
                      (batch, jnp.int32(0), jnp.int32(0), kv_idx),
                      extra_keep=Vector(kv_position.value < kv_length, 1), tile=logits.shape,
                      q_axis=0, q_start=0, kv_start=kv_start, interpret=interpret)


def softmax_step(logits, running_max, running_sum, logit_scale):
    """(p, the output's correction factor, the new row max, the new row sum) of a tile's
    logits in base 2 (`logit_scale` = scale * log2(e)); rows that have seen no key keep a
    max of -inf and give p = 0."""
    new_max = jnp.maximum(running_max, logits.max(axis=1) * logit_scale)
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # exp2(-inf - -inf) = NaN
    correction = jnp.exp2(running_max - safe_max)
    p = jnp.exp2(logits * logit_scale - lax.broadcast_in_dim(safe_max, logits.shape, [0]))
    return p, correction, new_max, running_sum * correction + p.sum(axis=1)


def normalizers(running_max, running_sum):
    """(1 / the row sum, the natural-log lse) at a walk's end: rows without mass (no key
    seen) get 1 and -inf, so their output is 0."""
    has_mass = running_sum > 0.0
    inverse_sum = 1.0 / jnp.where(has_mass, running_sum, 1.0)
    safe_max = jnp.where(running_max == -jnp.inf, 0.0, running_max)
    lse = (safe_max + jnp.log2(jnp.where(has_mass, running_sum, 1.0))) * online_softmax.LN_2
    return inverse_sum, jnp.where(has_mass, lse, -jnp.inf)


# Columns of a value tile zeroed at a time past a row's length (paged caches). In the
# split-column kernel the whole [64, 256] half tile at once (its values and key indices,
# 192 registers beside the 128 of the accumulator) spilled 252 B and made every paged
# call 1.5x slower than a contiguous one, even where no tile crosses a length; in
# [64, 64] pieces it spills 12 B and paged runs as fast as contiguous (H100, pages of 64,
# ms a step, paged / contiguous, whole tile in brackets: B64 S4096 0.252 / 0.247
# (0.368), B16 S32768 0.469 / 0.474 (0.702)). Neither pages in order (TLB) nor page-table
# reads a tile ahead nor TMA prefetches into L2 2-6 tiles ahead changed it
# (docs/gpu-notes.md, Decode).
ZEROED_COLUMNS = 64


def zero_rows_past_length(values, first_key, kv_length, *, period: int, interpret: bool):
    """Sets the rows of a shared-memory value tile values [n, columns] whose key is at or
    past kv_length to 0 (a reused page holds whatever it held, and 0 * NaN is NaN in
    p·v): row r holds key first_key + r % period (a stage of two halves of the same keys
    repeats them). A [n, ZEROED_COLUMNS] piece at a time, loaded in the wgmma layout."""
    for column in range(0, values.shape[1], ZEROED_COLUMNS):
        rows = values.at[:, pl.ds(column, ZEROED_COLUMNS)]
        if interpret:
            piece = rows[...]
            row = lax.broadcasted_iota(jnp.int32, piece.shape, 0)
        else:
            piece = plgpu.load(rows, layout=plgpu.Layout.WGMMA)
            row = plgpu.broadcasted_iota(jnp.int32, piece.shape, 0,
                                         layout=plgpu.Layout.WGMMA)
        if period != piece.shape[0]:
            row = lax.rem(row, jnp.int32(period))
        rows[...] = jnp.where(first_key + row < kv_length, piece, jnp.zeros_like(piece))


__all__ = ["ZEROED_COLUMNS", "copies_per_tile", "mask_partial_tile", "normalizers",
           "softmax_step", "tile_sources", "zero_rows_past_length"]
