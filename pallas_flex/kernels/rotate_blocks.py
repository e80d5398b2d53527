"""Re-rotating the RoPE of cached keys in place: the OpenVINO PagedAttention spec's inputs
13-15 (`paged.paged_attention`'s `rotated_block_indices`, `rotation_deltas`,
`rotation_trig_lut`), as a Pallas kernel over the listed blocks alone.

After cache eviction a kept block's keys sit at new positions, and their rotary
embedding has to move with them: the key at slot `off` of listed block i is rotated by
LUT row `deltas[i, off]`, feature pairs (2j, 2j + 1) by (cos, sin) = (lut[row, j],
lut[row, D / 2 + j]). A program rotates one listed block, every KV head at once (one
head a program where the head count is not a power of two): it reads the block's even
and odd features (strided loads), the LUT rows of its slots (a gather, shared by the
heads), and writes the rotated pairs back where it read them (the cache is the kernel's
output, aliased to its input), so the call moves the listed blocks' bytes once each way
and nothing else. The arithmetic is `paged.ragged._rotate_blocks`' (float32, then the
cache's dtype), which the XLA backend and quantized caches keep: there the gather of
the blocks, the LUT gather and the scatter back are separate XLA kernels.

`rotation_in_cache=False` (opt-in) rotates in the ragged kernel's key reads instead
(`scores_of_rotated_keys`; 8-bit caches too, their stored values rotated before the scale)
and leaves the cache as it was: nothing is written, and a listed
block costs its LUT rows (from L2, shared by the heads) and the rotation in registers,
only on the tiles that hold one (a branch per tile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flex.kernels.kv_tiles import in_pool, page_and_offset


def supported(key_cache) -> bool:
    """Whether the kernel takes the cache [num_blocks, Hkv, block_size, D]: 16- or 32-bit
    values (quantized caches are rotated dequantized, by XLA), and a block size and half
    head size that are powers of two (Triton's block shapes)."""
    _, _, block_size, head_dim = key_cache.shape
    half = head_dim // 2

    def power_of_two(n):
        return n >= 1 and n & (n - 1) == 0

    return (jnp.dtype(key_cache.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                           jnp.dtype(jnp.float32))
            and head_dim % 2 == 0 and power_of_two(block_size) and power_of_two(half))


def rotate_blocks(key_cache, indices, deltas, lut, *, interpret: bool):
    """key_cache [num_blocks, Hkv, block_size, D] with blocks `indices` [R] (distinct;
    entries outside the pool are left out) rotated by LUT rows `deltas` [R, block_size]
    (clamped into lut [rows, D], float32), in place where XLA can reuse the buffer (a
    donated cache); `supported(key_cache)` must hold."""
    num_blocks, kv_heads, block_size, head_dim = key_cache.shape
    half = head_dim // 2
    rows = lut.shape[0]
    listed = indices.shape[0]

    # All heads of a block in one program (the LUT rows gathered once for them), which
    # measured as one program per (block, head): H200, the ragged op's decode step of 64
    # sequences of 4096 tokens (Hkv 8, D 128, blocks of 16, 10 % of them listed), ms with
    # the rotation / without, paired rounds: 0.381 / 0.335 (1.14x) and 0.380 / 0.329
    # (1.16x); XLA's gather, rotation and scatter 1.22x. The listed blocks' 108 MB move
    # at ~2.3 TB/s there.
    heads = kv_heads if kv_heads & (kv_heads - 1) == 0 else 1

    def kernel(indices_ref, deltas_ref, lut_ref, _, cache_ref):
        # cache_ref is the output, aliased to the input cache (the ignored 4th ref).
        entry, head_group = pl.program_id(0), pl.program_id(1)
        block = indices_ref[entry]

        @pl.when((block >= 0) & (block < num_blocks))
        def _():
            lut_rows = jnp.clip(deltas_ref[entry, :], 0, rows - 1)[:, None]  # [slots, 1]
            columns = jnp.arange(half, dtype=jnp.int32)[None, :]
            cos = lut_ref[lut_rows, columns][None]  # [1, slots, half]: every head
            sin = lut_ref[lut_rows, columns + half][None]
            head_rows = pl.ds(head_group * heads, heads)
            evens = (block, head_rows, slice(None), pl.ds(0, half, stride=2))
            odds = (block, head_rows, slice(None), pl.ds(1, half, stride=2))
            even = cache_ref[evens].astype(jnp.float32)
            odd = cache_ref[odds].astype(jnp.float32)
            cache_ref[evens] = (even * cos - odd * sin).astype(cache_ref.dtype)
            cache_ref[odds] = (even * sin + odd * cos).astype(cache_ref.dtype)

    if listed == 0:
        return key_cache
    # No block specs: every ref is its whole array, indexed in the kernel.
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
        grid=(listed, kv_heads // heads),
        input_output_aliases={3: 0},
        interpret=interpret,
        name="rotate_cached_keys",
    )(indices.astype(jnp.int32), deltas.astype(jnp.int32), lut.astype(jnp.float32),
      key_cache)


def slot_of_block(indices, num_blocks: int):
    """int32 [num_blocks]: each block's entry in `indices` [R] (its row of the deltas),
    -1 where it is not listed (entries outside the pool left out)."""
    listed = jnp.arange(indices.shape[0], dtype=jnp.int32)
    return jnp.full((num_blocks,), -1, jnp.int32).at[indices].set(listed, mode="drop")


def listed_entries_before(slots, block_indices):
    """int32 [E + 1]: how many of the first e entries of the ragged block list
    `block_indices` [E] name a listed block (`slot_of_block` >= 0), so that a tile over
    entries [e0, e1) holds one where the counts at e1 and e0 differ: two scalar reads a
    tile, no reduction over its rows."""
    listed = (slots[in_pool(block_indices, slots.shape[0])] >= 0).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(listed, dtype=jnp.int32)])


def scores_of_rotated_keys(scores_of, keys, rotation_refs, page_of, tile_start, *,
                           tile: int, page_size: int, num_pages: int, dim_chunks,
                           half: int, rotate_below, tile_entries):
    """`scores_of(keys)` for the key tile's column chunks `keys` ([tile, width] each, as
    loaded) with the rows of listed blocks rotated by their LUT rows, for the rows at
    logical positions below `rotate_below` (the cached history; the new tokens written
    this call are not rotated). rotation_refs: (`slot_of_block` [num_blocks], deltas
    [R, block_size], lut [rows, 2 * half] float32, `listed_entries_before` [E + 1]);
    tile_entries: the tile's entries [e0, e1) of the ragged block list (scalars).
    Arithmetic as `rotate_blocks`': float32, then the keys' dtype, so the scores are
    those of the keys rotated in the cache.

    Chunks are even-aligned, so each feature pair (2j, 2j + 1) lies in one chunk: the
    chunk is split into its even and odd columns in registers ([tile, width / 2, 2],
    Triton's split and join), rotated by (c, s) = (lut[row, j], lut[row, half + j]) and
    joined back. The LUT rows are read (contiguous along j, so vector loads) only where
    the tile holds a listed row, and only for those rows (masked loads). A 8-bit cache's
    keys arrive converted but not scaled: each row's scale multiplies its scores after
    q.k, and a rotation within the row commutes with it, so the stored values rotate as
    they are.

    The scores are taken inside each branch: a tile with no listed row feeds its keys to
    the q.k matmul straight from shared memory, as the kernel without rotation does;
    with the matmul after the branch, Triton brought every tile's keys to registers and
    stored them back to shared memory for the wgmma.

    H100, `bench ragged` (10 % of blocks of 16 listed, paired rounds, ms, plain kernel /
    rotated in the cache / in the reads): decode 64 x 4096 0.396 / 0.452 / 0.471, 4
    prefills of 1024 + 60 decodes 0.756 / 0.807 / 0.956, 2 prefills of 4096 1.03 / 1.05
    / 1.18. Reading each pair's partner again from the cache with per-element LUT
    gathers instead took 0.717, 1.460 and 1.611 (docs/gpu-notes.md, Paged and ragged).
    The rows' page and slot gathers stay outside the branch: inside it (only tiles with a
    listed row would run them), H100, `bench ragged` in two processes, in the reads,
    against here: 0.494 / 0.480, 0.953 / 0.956, 1.093 / 1.163 ms; the decode lost what
    the long prefills gained."""
    slot_ref, deltas_ref, lut_ref, before_ref = rotation_refs
    positions = tile_start + lax.iota(jnp.int32, tile)
    pages, offsets = page_and_offset(page_of, positions, page_size=page_size,
                                     num_pages=num_pages)
    slots = slot_ref[pages]
    rotated_rows = (slots >= 0) & (positions < rotate_below)

    def rotate(keys):
        lut_rows = deltas_ref[jnp.maximum(slots, 0), offsets][:, None]  # [tile, 1]
        rows = rotated_rows[:, None]
        out = []
        for (start, width), key in zip(dim_chunks, keys):
            pairs = width // 2
            pair = start // 2 + lax.broadcasted_iota(jnp.int32, (1, pairs), 1)
            shape = (tile, pairs)
            mask = jnp.broadcast_to(rows & (pair < half), shape)  # padded columns stay 0
            lut_index = jnp.broadcast_to(lut_rows, shape)
            cos = plgpu.load(lut_ref.at[lut_index, jnp.broadcast_to(pair, shape)],
                             mask=mask, other=1.0)
            sin = plgpu.load(lut_ref.at[lut_index, jnp.broadcast_to(pair + half, shape)],
                             mask=mask, other=0.0)
            even, odd = jnp.unstack(key.astype(jnp.float32).reshape(tile, pairs, 2),
                                    axis=-1)
            rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
            rotated = rotated.reshape(tile, width).astype(key.dtype)
            out.append(jnp.where(jnp.broadcast_to(rows, (tile, width)), rotated, key))
        return out

    # Two scalar reads, where the largest of the rows' flags took a reduction across the
    # warps (two barriers a tile): H100, ms a call, entry counts / reduction, decode 64 x
    # 4096 0.481 / 0.499, 4 prefills + 60 decodes 0.968 / 1.053, 2 prefills of 4096 1.189
    # / 1.320. A tile past the sequence's end may say yes: harmless (rows are masked).
    first, last = (jnp.clip(e, 0, before_ref.shape[0] - 1) for e in tile_entries)
    listed = (before_ref[last] > before_ref[first]) & (tile_start < rotate_below)
    return lax.cond(listed, lambda keys: scores_of(rotate(keys)), scores_of, list(keys))


__all__ = ["listed_entries_before", "rotate_blocks", "scores_of_rotated_keys", "slot_of_block",
           "supported"]
