"""The ragged paged-attention kernel: many sequences' new tokens, packed token-major,
each attending causally (optionally within a sliding window, with ALiBi) to its own
sequence's positions in a paged cache.

Work is cut into *work items*: a run of up to `tokens_per_item` consecutive new tokens
of one sequence. Their number depends on the metadata, so the grid has the static upper
bound `min(ceil(T / tokens_per_item) + num_seqs, T)` (every item holds at least one
token) and unused items do nothing. One program owns one work item and one KV head (and
one split, below): its rows are (token, query head of the group) pairs, so a GQA group
reads each KV tile once, and a decode token (one row per head) costs one pass over its
sequence's pages, like the decode kernel's programs.

The KV walk covers positions [first visible position of the item's first token, position
of its last token]; every tile is masked elementwise (causal, window, cache length), so
tokens of different positions in one item each see exactly their own range. Pages are
read in place through `block_indices[block_indices_begins[s] + p // block_size]`.

Split-KV: a third grid axis cuts each item's tiles into `num_splits` consecutive shares
(split j walks tiles [j * per_split, (j + 1) * per_split) of the item's range, with
per_split = ceil(num_tiles / num_splits)), as the decode kernel does, so that a batch of
few work items with long histories (decode steps) still puts enough programs on the
GPU. Each split writes a normalized float32 partial output [T, splits, Hq, Dv] and its
lse [T, splits, Hq]; an exact log-sum-exp merge in jnp combines them afterwards (empty
splits carry lse = -inf and weigh nothing). With one split the kernel writes the output
and lse directly, with no partials and no merge. `choose_num_splits` picks the count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flex import sharding
from pallas_flex.kernels import device, online_softmax, shared_memory
from pallas_flex.kernels.kv_tiles import (
    as_int8_bits, load_rows, paged_tile_view, quantized_tiles, shifts_values)
from pallas_flex.kernels.padding import column_chunks, pad_axis, round_up, tile_extent
from pallas_flex.kernels.rotate_blocks import listed_entries_before, scores_of_rotated_keys

_ROWS = 64  # rows (token x head-of-group pairs) per program
# Programs to aim for when choosing num_splits automatically. H100, kernel alone, decode
# steps on 4096-token histories: 64 sequences (512 programs unsplit) 0.453 ms unsplit,
# 0.462 in 2 splits; 16 sequences (128 programs) 0.187 / 0.176 / 0.207 ms in 1 / 2 / 4
# splits (f908cd9:benchmarks/results/2026-11-23-h100-ragged-kernel.json).
_TARGET_PROGRAMS = 256


def work_items(subsequence_begins, tokens_per_item: int, num_items: int):
    """(sequence [W], first token [W]) of each work item; items past the last one get
    first token = T (no rows)."""
    new_lens = jnp.diff(subsequence_begins)
    items_per_seq = (new_lens + tokens_per_item - 1) // tokens_per_item
    ends = jnp.cumsum(items_per_seq)
    item = jnp.arange(num_items, dtype=jnp.int32)
    # "scan_unrolled": a fixed number of vectorized steps. The default method is a while
    # loop, and on a GPU each of its iterations waits for the host to read the loop
    # condition (a decode call spent 0.6 ms there against 0.2 ms in the kernel).
    seq = jnp.clip(jnp.searchsorted(ends, item, side="right", method="scan_unrolled"), 0,
                   new_lens.shape[0] - 1)
    index_in_seq = item - (ends[seq] - items_per_seq[seq])
    first = subsequence_begins[seq] + index_in_seq * tokens_per_item
    num_tokens = subsequence_begins[-1]
    first = jnp.where(item < ends[-1], first, num_tokens)
    return seq.astype(jnp.int32), first.astype(jnp.int32)


def _ragged_kernel(work_seq_ref, work_first_ref, past_lens_ref, begins_ref, block_indices_ref,
                   block_begins_ref, scale_ref, window_ref, slopes_ref, q_ref, k_ref, v_ref,
                   *refs, group, tokens_per_item, rows, block_kv, page_size,
                   dim_chunks, value_chunks, num_splits, interpret, quantized=None,
                   rotation_half=0):
    """refs: (k_scales, v_scales: a quantized cache's [num_blocks, Hkv, block_size],)
    (slot_of_block, deltas, lut, listed_entries_before: keys rotated in the reads,
    `rotation_half` > 0,)
    out, lse. quantized: None, or a quantized cache's dtype name: its blocks arrive as
    int8 bits (`kv_tiles.as_int8_bits`)."""
    rotation_refs = refs[-6:-2] if rotation_half else None
    scale_refs, (out_ref, lse_ref) = refs[:-6 if rotation_half else -2], refs[-2:]
    item, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = work_seq_ref[item]
    first = work_first_ref[item]
    seq_begin, end = begins_ref[seq], begins_ref[seq + 1]
    num_listed = block_indices_ref.shape[0]
    past = past_lens_ref[seq]
    block_begin = block_begins_ref[seq]
    precision = online_softmax.dot_precision(q_ref.dtype, interpret)

    # Row r: token first + r // group, query head kv_head * group + r % group.
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    token_offset = lax.div(row, jnp.int32(group)) if group > 1 else row
    real = (token_offset < tokens_per_item) & (first + token_offset < end)
    token = jnp.minimum(first + token_offset, end - 1)
    token = jnp.maximum(token, 0)
    head = kv_head * group + (lax.rem(row, jnp.int32(group)) if group > 1 else 0 * row)
    q_position = past + token - seq_begin  # [rows, 1]
    window = window_ref[0]
    first_visible = jnp.where(window > 0, jnp.maximum(q_position + 1 - window, 0), 0)

    def q_chunk(start, width):
        columns = start + lax.broadcasted_iota(jnp.int32, (rows, width), 1)
        shape = (rows, width)
        return q_ref[jnp.broadcast_to(token, shape), jnp.broadcast_to(head, shape), columns]

    q_chunks = [q_chunk(*chunk) for chunk in dim_chunks]
    scale_log2 = scale_ref[0] * online_softmax.LOG2_E
    slope_log2 = slopes_ref[head] * online_softmax.LOG2_E  # [rows, 1]

    def page_of(slot):
        entry = jnp.clip(block_begin + slot, 0, num_listed - 1)
        return block_indices_ref[entry]

    last_position = past + jnp.minimum(first + tokens_per_item, end) - 1 - seq_begin
    item_first_visible = jnp.where(
        window > 0, jnp.maximum(past + first - seq_begin + 1 - window, 0), 0)
    first_tile = lax.div(item_first_visible, jnp.int32(block_kv))
    num_tiles = jnp.where(first < end,
                          lax.div(last_position, jnp.int32(block_kv)) + 1 - first_tile, 0)

    def visit(step, state):
        tile_start = (first_tile + step) * block_kv
        kv_position = tile_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        valid_rows = (tile_start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
                      ) <= last_position

        def load(ref, start, width):
            return load_rows(paged_tile_view(ref, page_of, kv_head, tile_start, tile=block_kv,
                                             page_size=page_size, column_start=start,
                                             width=width), valid_rows)

        keys = [load(k_ref, *chunk) for chunk in dim_chunks]
        values = [load(v_ref, *chunk) for chunk in value_chunks]
        value_scale = None
        if quantized:
            keys, values, key_scale, value_scale = quantized_tiles(
                keys, values, scale_refs, page_of, kv_head, tile_start, tile=block_kv,
                page_size=page_size, valid_rows=valid_rows, dtype=q_ref.dtype,
                cache_dtype=quantized)

        def scores_of(keys):
            return sum(lax.dot_general(q, key, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32,
                                       precision=precision)
                       for q, key in zip(q_chunks, keys))

        if rotation_half:  # the history's listed blocks, rotated as read
            scores = scores_of_rotated_keys(
                scores_of, keys, rotation_refs, page_of, tile_start, tile=block_kv,
                page_size=page_size, num_pages=k_ref.shape[0], dim_chunks=dim_chunks,
                half=rotation_half, rotate_below=past,
                tile_entries=(block_begin + lax.div(tile_start, jnp.int32(page_size)),
                              block_begin + lax.div(tile_start + block_kv - 1,
                                                    jnp.int32(page_size)) + 1))
        else:
            scores = scores_of(keys)
        if quantized:
            scores = scores * key_scale
        distance = (kv_position - q_position).astype(jnp.float32)
        scores = scores * scale_log2 + slope_log2 * distance
        visible = (kv_position <= q_position) & (kv_position >= first_visible) & real
        scores = jnp.where(visible, scores, -jnp.inf)
        return online_softmax.update_chunks(state, scores, values, precision,
                                            value_scale=value_scale)

    # This split's share of the item's tiles: [low, high).
    per_split = lax.div(num_tiles + (num_splits - 1), jnp.int32(num_splits))
    low = split * per_split
    high = jnp.minimum(num_tiles, low + per_split)
    state = online_softmax.initial_state_chunks(
        rows, [w for _, w in value_chunks],
        value_shift=shifts_values(quantized, q_ref.dtype))
    state = lax.fori_loop(low, high, visit, state)
    outs, lse = online_softmax.finalize_chunks(state)
    # With splits the outputs carry a split axis after the token axis: [T, splits, ...].
    split_index = () if num_splits == 1 else (jnp.broadcast_to(split, token.shape),)
    for (start, width), out in zip(value_chunks, outs):
        shape = (rows, width)
        columns = start + lax.broadcasted_iota(jnp.int32, shape, 1)
        indices = (token,) + split_index + (head, columns)
        _masked_scatter(out_ref, tuple(jnp.broadcast_to(i, shape) for i in indices),
                        out.astype(out_ref.dtype), jnp.broadcast_to(real, shape), interpret)
    _masked_scatter(lse_ref, tuple(i[:, 0] for i in (token,) + split_index + (head,)), lse,
                    real[:, 0], interpret)


def _masked_scatter(ref, indices, value, mask, interpret):
    """ref[indices] = value where mask. Padded rows repeat a real row's indices: on the GPU
    a masked store skips them; interpret mode's store would write the old value back for
    them in any order, so there they are sent out of range and dropped instead."""
    if interpret:
        dropped = (jnp.where(mask, indices[0], ref.shape[0]),) + tuple(indices[1:])
        ref[...] = ref[...].at[dropped].set(value, mode="drop")
    else:
        plgpu.store(ref.at[indices], value, mask=mask)


def choose_num_splits(num_items: int, kv_heads: int, max_tiles: int, *, interpret: bool,
                      requested: int = 0) -> int:
    """Programs sharing one work item's tiles. Automatic (requested = 0): enough to reach
    `_TARGET_PROGRAMS` programs, at most the tiles an item can have. When the items alone
    reach the target (long prefills, or many sequences), one: the GPU is already full,
    and more splits would only add [T, splits, Hq, Dv] float32 partials (T x Hq x Dv x 4
    bytes each, large exactly when T is) and a merge pass. In interpret mode one: the
    interpreter runs programs one after another, so splits only cost time."""
    if requested:
        return max(1, min(requested, max_tiles))
    if interpret:
        return 1
    return max(1, min(-(-_TARGET_PROGRAMS // (num_items * kv_heads)), max_tiles))


def _work_layout(num_tokens: int, q_heads: int, kv_heads: int, num_seqs: int):
    """(group, tokens_per_item, rows, num_items): a program's rows hold tokens_per_item
    tokens x the group's query heads; num_items bounds the work items of any metadata
    (each sequence adds at most one partial item, and each item holds a token)."""
    group = q_heads // kv_heads
    tokens_per_item = max(1, _ROWS // group)
    rows = tile_extent(tokens_per_item * group)
    num_items = min(-(-num_tokens // tokens_per_item) + num_seqs, num_tokens)
    return group, tokens_per_item, rows, num_items


def _max_tiles(num_listed_blocks: int, block_size: int, block_kv: int) -> int:
    """Tiles an item can walk: every listed block's positions, plus one tile of
    misalignment (the walk starts at a tile boundary)."""
    return -(-max(num_listed_blocks, 1) * block_size // block_kv) + 1


def planned_num_splits(query_shape, key_cache_shape, num_seqs: int, num_listed_blocks: int,
                       *, interpret: bool = False, requested: int = 0,
                       block_kv: int = 64) -> int:
    """The num_splits `ragged_paged_attention` uses for these static shapes (query
    [T, Hq, D], key_cache [num_blocks, Hkv, block_size, D]); benchmarks record it."""
    num_tokens, q_heads = query_shape[0], query_shape[1]
    kv_heads, block_size = key_cache_shape[1], key_cache_shape[2]
    num_items = _work_layout(num_tokens, q_heads, kv_heads, num_seqs)[3]
    return choose_num_splits(num_items, kv_heads,
                             _max_tiles(num_listed_blocks, block_size, block_kv),
                             interpret=interpret, requested=requested)


def ragged_paged_attention(query, key_cache, value_cache, past_lens, subsequence_begins,
                           block_indices, block_indices_begins, scale, sliding_window,
                           alibi_slopes, *, interpret: bool, block_kv: int = 64,
                           num_warps: int = 4, num_stages: int = 2, num_splits: int = 0,
                           cache_scales=None, read_rotation=None):
    """(out [T, Hq, Dv] in query's dtype, lse [T, Hq] float32) from caches that already
    hold the new tokens. query [T, Hq, D]; caches [num_blocks, Hkv, block_size, D/Dv];
    scale, sliding_window: scalars (may be traced); alibi_slopes float [Hq].
    num_splits: programs per work item (0 = automatic, see `choose_num_splits`; a larger
    request than an item's possible tiles is capped). cache_scales: a quantized (int8 /
    float8) cache's (k_scales, v_scales) [num_blocks, Hkv, block_size]. read_rotation:
    None, or the listed blocks rotated in the key reads, positions below past_lens only
    (`rotate_blocks.scores_of_rotated_keys`; 8-bit caches' stored values before their
    scales): (`rotate_blocks.slot_of_block` [num_blocks], deltas [R, block_size] within
    the LUT's rows, lut [rows, D] float32)."""
    num_tokens, q_heads, head_dim = query.shape
    kv_heads, block_size, value_dim = key_cache.shape[1], key_cache.shape[2], value_cache.shape[3]
    if num_tokens == 0:
        return (jnp.zeros((0, q_heads, value_dim), query.dtype),
                jnp.zeros((0, q_heads), jnp.float32))
    group, tokens_per_item, rows, num_items = _work_layout(num_tokens, q_heads, kv_heads,
                                                           past_lens.shape[0])

    def shared_bytes(block_kv, num_stages):
        return shared_memory.forward_bytes(
            dtype=query.dtype, head_dim=tile_extent(round_up(head_dim, 16)),
            value_dim=round_up(value_dim, 16), block_q=tile_extent(rows), block_kv=block_kv,
            num_stages=num_stages)

    block_kv, num_stages = shared_memory.fit_streaming(
        block_kv, num_stages, shared_bytes, device.shared_memory_budget(), kernel="ragged")
    num_splits = planned_num_splits(query.shape, key_cache.shape, past_lens.shape[0],
                                    block_indices.shape[0], interpret=interpret,
                                    requested=num_splits, block_kv=block_kv)
    work_seq, work_first = work_items(subsequence_begins, tokens_per_item, num_items)

    key_cache, value_cache, quantized = as_int8_bits(key_cache, value_cache, cache_scales)
    padded_dim, padded_value_dim = round_up(head_dim, 16), round_up(value_dim, 16)
    query = pad_axis(query, 2, padded_dim)
    key_cache = pad_axis(key_cache, 3, padded_dim)
    value_cache = pad_axis(value_cache, 3, padded_value_dim)
    block_indices = block_indices if block_indices.shape[0] else jnp.zeros((1,), jnp.int32)
    scalars = (jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)),
               jnp.reshape(jnp.asarray(sliding_window, jnp.int32), (1,)),
               jnp.asarray(alibi_slopes, jnp.float32))
    kernel = functools.partial(
        _ragged_kernel, group=group, tokens_per_item=tokens_per_item, rows=rows,
        block_kv=block_kv, page_size=block_size, dim_chunks=column_chunks(padded_dim),
        value_chunks=column_chunks(padded_value_dim), num_splits=num_splits,
        interpret=interpret, quantized=quantized,
        rotation_half=0 if read_rotation is None else head_dim // 2)
    scales = tuple(cache_scales or ())
    if read_rotation is not None:
        slots, deltas, lut = read_rotation
        slots = slots.astype(jnp.int32)
        scales += (slots, deltas.astype(jnp.int32), lut.astype(jnp.float32),
                   listed_entries_before(slots, block_indices))
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((num_tokens, q_heads, padded_value_dim), query.dtype),
                     jax.ShapeDtypeStruct((num_tokens, q_heads), jnp.float32)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_tokens, num_splits, q_heads, padded_value_dim),
                                          jnp.float32),
                     jax.ShapeDtypeStruct((num_tokens, num_splits, q_heads), jnp.float32)]
    whole = pl.no_block_spec
    inputs = (work_seq, work_first, past_lens.astype(jnp.int32),
              subsequence_begins.astype(jnp.int32), block_indices.astype(jnp.int32),
              block_indices_begins.astype(jnp.int32), *scalars, query, key_cache,
              value_cache, *scales)
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_items, kv_heads, num_splits),
        in_specs=[whole] * (12 + len(scales)),
        out_specs=[whole, whole],
        out_shape=sharding.typed_like(out_shape, inputs),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*inputs)
    if num_splits > 1:
        out, lse = online_softmax.merge_partials(out, lse, axis=1)
        out = out.astype(query.dtype)
    return out[:, :, :value_dim], lse
