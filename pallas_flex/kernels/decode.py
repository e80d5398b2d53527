"""Split-KV flash decoding for short query blocks (decode, speculative verification).

With a handful of query rows a forward program per (query tile, head) would leave the
GPU idle and read each KV head once per query head. Here instead:

* One program owns the query rows of a whole GQA group (heads x positions, padded to
  the 16-row tensor-core minimum), so each KV tile is loaded once for the group.
* The KV tiles the BlockMask row lists (full ones, then partial ones) are split between
  `num_splits` programs, enough to fill every SM even at batch 1; each writes a partial
  (out, lse) and the splits are merged exactly afterwards (a tiny jnp reduction).
* K and V are read where they lie, never padded or copied: a contiguous cache
  `[B, Skv, Hkv, D]`, or pages `[num_pages, Hkv, page_size, D]` through a page table
  (logical position p is row p % page_size of page `page_table[b, p // page_size]`).
  Head dims are read as power-of-two column chunks (576 = 512 + 64 for latent attention),
  so no dimension needs padding unless it is not a multiple of 16.

Mods see the same indices as in the forward kernel (b, the query head, q_idx in
[0, Sq), the logical kv_idx), so a decode step runs any mask_mod/score_mod; write the
query's absolute position in with `pallas_flex.masks.offset`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flex import sharding
from pallas_flex.kernels import online_softmax, shared_memory
from pallas_flex.kernels.block_walk import walk_listed_tile_range
from pallas_flex.kernels.config import KernelOptions, planned_shared_memory
from pallas_flex.kernels.device import multiprocessor_count
from pallas_flex.kernels.kv_tiles import (
    as_int8_bits, first_scale, load_rows, page_table_row, paged_tile_view, quantized_tiles,
    shifts_values)
from pallas_flex.kernels.padding import column_chunks, pad_axis, round_up, tile_extent
from pallas_flex.kernels.tile_mods import (
    apply_mask_on_tile, apply_score_on_tile, captured_inputs, split_captured_refs)

# Enough programs to give each of the H100's 132 SMs a few: fewer leaves bandwidth
# unused at batch 1; many more only adds partial results to merge.
_TARGET_PROGRAMS = 528
# Contiguous 16-bit K/V with D, Dv <= 128 run on 64-row tiles and in one wave: as many
# splits as keep the programs within the SM count (H100, Hq 32 Hkv 8 D 128 bf16, 8
# chained steps, ms per step at B8 S16384 / B1 S131072: 2 / 16 splits 0.179 / 0.181,
# 3.00 / 2.96 TB/s; 3 / 17 splits, a second wave, 0.188 / 0.188; 528 programs on
# 128-row tiles 0.193 / 0.194). 8-bit pages run best in two whole waves (pages of 64,
# B8 S16384 / B1 S131072: int8 0.129 / 0.130 ms against 0.138 / 0.133 with ~528
# programs, float8 0.168 / 0.171 against 0.191 / 0.177; one wave 0.171-0.253); 16-bit
# pages keep ~528 (0.191 / 0.200 ms against 0.220 / 0.227 in two waves, 0.349 / 0.356 in
# one). On the H200 the same settings stayed best for 8-bit pages (B8 S16384, pages of 64,
# paired rounds, ms a step; tiles 64 / 128 / 256 rows x 2 / 3 stages x 4 / 8 warps x 1 /
# 2x the splits): int8 0.122-0.127 at 128 or 256 rows, 2 stages, 4 warps (2.2-2.3 TB/s),
# 0.144 at 64 rows, 0.166 with 3 stages, 0.195-0.205 with 8 warps, 2x the splits +1-3 %;
# float8 0.171-0.174 (1.6 TB/s) likewise, the rest 0.178-0.300. Latent attention
# (D 576) lost with fewer programs (B8 S8192: 0.329 ms at 264
# against 0.234 at 528).


def _decode_kernel(q_ref, k_ref, v_ref, kv_num_blocks_ref, kv_indices_ref,
                   full_kv_num_blocks_ref, full_kv_indices_ref, *refs, mask_program,
                   score_program, scale, q_len, kv_len, rows, heads_per_program, group,
                   block_kv, mask_block_kv, broadcast_batch, broadcast_heads, num_splits,
                   dim_chunks, value_chunks, page_size, mask_every_tile, interpret,
                   with_max=False, quantized=None):
    paged = page_size is not None
    if paged:
        page_table_ref, lengths_ref, *refs = refs
    # quantized: None, or an 8-bit cache's dtype name (K/V arrive as int8 bits,
    # `kv_tiles.as_int8_bits`), with per-token scales: [num_pages, Hkv, page_size]
    if quantized:
        scale_refs, refs = refs[:2], refs[2:]  # (paged) or [B, Skv, Hkv] (contiguous)
    mask_refs, score_refs, (out_ref, lse_ref, *max_ref) = split_captured_refs(
        refs, mask_program, score_program)

    batch, program_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first_head = program_head * heads_per_program
    kv_head = lax.div(first_head, jnp.int32(group))
    table_index = (0 if broadcast_batch else batch, 0 if broadcast_heads else program_head, 0)
    precision = online_softmax.dot_precision(q_ref.dtype, interpret)
    padded_rows = q_ref.shape[0]

    # Row r holds query head first_head + r // Sq at position r % Sq; padded rows repeat
    # the last real row (their results are dropped).
    row = jnp.minimum(lax.broadcasted_iota(jnp.int32, (padded_rows, 1), 0), rows - 1)
    if q_len == 1:
        head, q_idx = first_head + row, jnp.zeros_like(row)
    else:
        head = first_head + lax.div(row, jnp.int32(q_len))
        q_idx = lax.rem(row, jnp.int32(q_len))
    q_chunks = [q_ref[:, pl.ds(start, width)] for start, width in dim_chunks]
    # float8 pages under bfloat16 queries: the matmuls run in float16, whose conversion
    # from e4m3 is one instruction a pair (to bfloat16 it took a scalar F2F per element
    # more). The queries are scaled by a power of two that puts their largest magnitude
    # just under 2**15 (up from small queries too: float16's normals end at 6.1e-5),
    # exactly, undone with the keys' scales; P's columns are scaled per tile likewise
    # (`online_softmax.update_chunks`, near each tile's first row's scale).
    matmul_dtype, query_factor = q_ref.dtype, None
    if (quantized and jnp.dtype(quantized) != jnp.dtype(jnp.int8)
            and jnp.dtype(q_ref.dtype) == jnp.dtype(jnp.bfloat16)):
        largest = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(c.astype(jnp.float32)))
                                                 for c in q_chunks])
        shift = jnp.ceil(jnp.log2(jnp.maximum(largest, 2.0 ** -100))) - 15.0
        query_factor = jnp.exp2(shift)
        q_chunks = [(c.astype(jnp.float32) / query_factor).astype(jnp.float16)
                    for c in q_chunks]
        matmul_dtype = jnp.float16
    value_shift = shifts_values(quantized, matmul_dtype)
    kv_length = jnp.minimum(lengths_ref[batch], kv_len) if paged else kv_len

    def load_tile(ref, tile_start, valid, column_start, width):
        """[block_kv, width] rows tile_start.. of one KV head; invalid rows read as 0."""
        if paged:
            view = paged_tile_view(ref, page_table_row(page_table_ref, batch), kv_head,
                                   tile_start, tile=block_kv, page_size=page_size,
                                   column_start=column_start, width=width)
        else:
            view = ref.at[batch, pl.ds(tile_start, block_kv), kv_head,
                          pl.ds(column_start, width)]
        return load_rows(view, valid)

    def visit_tile(tile_start, state, masked):
        kv_position = tile_start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        # Pages: every tile checks the row's length. Contiguous: only partial tiles, and
        # every tile when the length is not a whole number of tiles.
        in_length = kv_position < kv_length if (paged or mask_every_tile or masked) else None
        keys = [load_tile(k_ref, tile_start, in_length, start, width)
                for start, width in dim_chunks]
        values = [load_tile(v_ref, tile_start, in_length, start, width)
                  for start, width in value_chunks]
        value_scale = value_scale_reference = None
        if quantized:
            page_of = page_table_row(page_table_ref, batch) if paged else None
            keys, values, key_scale, value_scale = quantized_tiles(
                keys, values, scale_refs, page_of, kv_head, tile_start, tile=block_kv,
                page_size=page_size, valid_rows=in_length, dtype=matmul_dtype,
                cache_dtype=quantized, batch=batch)
            if value_shift:  # (a first row past the length may hold a stale scale)
                value_scale_reference = jnp.where(
                    tile_start < kv_length,
                    first_scale(scale_refs[1], page_of, kv_head, tile_start,
                                page_size=page_size, batch=batch), 0.0)
        scores = sum(lax.dot_general(q_chunk, key, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32, precision=precision)
                     for q_chunk, key in zip(q_chunks, keys))
        if quantized:
            scores = scores * (key_scale if query_factor is None else key_scale * query_factor)
        kv_idx = tile_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        kv_idx_in_range = jnp.minimum(kv_idx, kv_len - 1)
        if score_program is None:
            scores = scores * (scale * online_softmax.LOG2_E)
        else:
            scores = apply_score_on_tile(score_program, score_refs, scores * scale, batch, head,
                                         q_idx, kv_idx_in_range,
                                         indices_below=max(q_len, kv_len)
                                         ) * online_softmax.LOG2_E
        keep = None
        if in_length is not None:
            keep = kv_idx < kv_length
        if masked:
            mask = apply_mask_on_tile(mask_program, mask_refs, batch, head, q_idx,
                                      kv_idx_in_range, indices_below=max(q_len, kv_len))
            keep = mask if keep is None else mask & keep
        if keep is not None:
            scores = jnp.where(keep, scores, -jnp.inf)
        return online_softmax.update_chunks(state, scores, values, precision,
                                            value_scale=value_scale,
                                            value_scale_reference=value_scale_reference)

    # This program's share of the row's tiles: numbers [low, high) of the list that has
    # the full tiles first, then the partial ones.
    tiles_per_block = mask_block_kv // block_kv
    num_full = full_kv_num_blocks_ref[table_index] * tiles_per_block
    num_tiles = num_full + kv_num_blocks_ref[table_index] * tiles_per_block
    per_split = lax.div(num_tiles + (num_splits - 1), jnp.int32(num_splits))
    low = split * per_split
    high = jnp.minimum(num_tiles, low + per_split)

    walk = functools.partial(walk_listed_tile_range, mask_block=mask_block_kv, tile=block_kv)
    state = online_softmax.initial_state_chunks(
        padded_rows, [w for _, w in value_chunks], value_shift=value_shift)
    state = walk(full_kv_indices_ref, table_index, low, jnp.minimum(high, num_full),
                 visit=lambda start, state: visit_tile(start, state, False), state=state)
    state = walk(kv_indices_ref, table_index, jnp.maximum(low, num_full) - num_full,
                 high - num_full, visit=lambda start, state: visit_tile(start, state, True),
                 state=state)
    outs, lse = online_softmax.finalize_chunks(state)
    for (start, width), out in zip(value_chunks, outs):
        out_ref[batch, program_head, split, :, pl.ds(start, width)] = out
    lse_ref[batch, program_head, split, :] = lse
    if with_max:  # this part's row max; the parts' maximum is the row's
        max_ref[0][batch, program_head, split, :] = online_softmax.row_max(state)


def _fit_to_shared_memory(options: KernelOptions, block_kv: int, num_stages: int, *, dtype,
                          query_rows: int, head_dim: int, value_dim: int, reads):
    """(block_kv, num_stages) fitted to the shared-memory budget, keeping the user's
    decode_block_kv / decode_num_stages."""
    def estimate(block_kv, num_stages):
        return shared_memory.forward_bytes(
            dtype=dtype, head_dim=head_dim, value_dim=value_dim, block_q=query_rows,
            block_kv=block_kv, num_stages=num_stages, reads=reads)

    return shared_memory.fit_streaming(
        block_kv, num_stages, estimate, planned_shared_memory(options), kernel="decode",
        block_kv_given="decode_block_kv" in options.given,
        stages_given="decode_num_stages" in options.given)


def flex_decode(q, k, v, block_mask, score_program, *, scale: float, options: KernelOptions,
                interpret: bool, page_table=None, lengths=None, out_dtype=None,
                with_max=False, k_scales=None, v_scales=None):
    """(out [B, Sq, Hq, Dv] in out_dtype (default q's), lse [B, Hq, Sq] float32), and
    with_max the row max of the logits [B, Hq, Sq] (the split-KV parts' maximum), for
    short Sq. k_scales, v_scales: int8 / float8 K/V's per-token scales, float32
    [num_pages, Hkv, page_size] (paged) or [B, Skv, Hkv] (contiguous).

    Contiguous: k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], Skv = the BlockMask's KV_LEN.
    Paged: k [num_pages, Hkv, page_size, D] (v likewise), page_table [B, max_pages] int32
    (-1 = no page), lengths [B] int32 (positions >= lengths[b] are masked); the
    BlockMask's KV_LEN is the logical length (at most max_pages * page_size).
    The BlockMask must have a single query block (Sq <= its query block size).
    """
    batch, q_len, q_heads, head_dim = q.shape
    paged = page_table is not None
    kv_heads, value_dim = k.shape[1 if paged else 2], v.shape[3]
    page_size = k.shape[2] if paged else None
    group = q_heads // kv_heads
    mask_batch, mask_heads, _, kv_len = block_mask.shape
    broadcast_heads = block_mask.kv_num_blocks.shape[1] == 1
    # A program shares KV loads across its group's query heads when they share one
    # BlockMask row; per-head masks get a program per query head.
    # The accumulator [rows, Dv] lives in registers: at most 64 KiB of it per program
    # (128 query heads of latent attention, Dv 512, become 4 programs of 32 rows).
    padded_dim, padded_value_dim = round_up(head_dim, 16), round_up(value_dim, 16)
    max_rows = (options.decode_max_rows
                or max(16, min(128, 16384 // padded_value_dim)))
    heads_per_program = 1
    if broadcast_heads:
        heads_per_program = max([d for d in range(1, group + 1)
                                 if group % d == 0 and d * q_len <= max_rows], default=1)
    num_head_programs = q_heads // heads_per_program
    rows = heads_per_program * q_len
    padded_rows = tile_extent(rows)

    mask_block_kv = block_mask.block_size[1]
    wide = max(head_dim, value_dim)
    default_tile = 128 if wide <= 128 else 64 if wide <= 256 else 32
    if paged:
        # Tiles gathered across pages spill at 128 rows (800-1200 B at 255 registers);
        # 32-row tiles take 66 registers. H100, B8 S16384 D128: 128-row tiles cost
        # +14 / +13 / +1 % over contiguous at pages 16 / 64 / 128, 32-row tiles
        # -1 / +0 / -1 % (f908cd9:benchmarks/results/2026-11-23-h100-paged-small-pages.json).
        # 8-bit pages (a quantized cache) hold half the registers per row: there 128-row
        # tiles won (H100, Hq 32 Hkv 8 D 128, pages of 64, ms per step, 128 / 32 rows:
        # int8 0.136 / 0.196 at B8 S16384 and 0.129 / 0.144 at B1 S131072; float8
        # 0.187 / 0.256 and 0.171 / 0.187; 64 rows and 3 stages or 8 warps were slower).
        if k.dtype.itemsize > 1:
            default_tile = min(default_tile, 32)
    narrow = not paged and k.dtype.itemsize == 2 and wide <= 128
    if narrow:
        default_tile = 64
    block_kv = options.decode_block_kv or default_tile
    block_kv = min(block_kv, mask_block_kv)

    num_stages = options.decode_num_stages
    if not num_stages:  # measured on the H100: see KernelOptions
        tile_bytes = block_kv * (padded_dim + padded_value_dim) * k.dtype.itemsize
        num_stages = 3 if not paged and 3 * tile_bytes <= 200 * 1024 else 2
    block_kv, num_stages = _fit_to_shared_memory(
        options, block_kv, num_stages, dtype=q.dtype, query_rows=padded_rows,
        head_dim=tile_extent(padded_dim), value_dim=padded_value_dim,
        reads=shared_memory.mod_reads(block_mask.mask_mod, score_program))

    k, v, quantized = as_int8_bits(k, v, k_scales)
    # Column chunks need widths of at least 16: other head dims are padded (a copy).
    k = pad_axis(k, 3, padded_dim)
    v = pad_axis(v, 3, padded_value_dim)
    if narrow or (paged and k.dtype.itemsize == 1):
        waves = 1 if narrow else 2
        default_splits = waves * multiprocessor_count() // (batch * num_head_programs)
    else:
        default_splits = -(-_TARGET_PROGRAMS // (batch * num_head_programs))
    num_splits = options.decode_num_splits or max(1, default_splits)
    if interpret and not options.decode_num_splits:
        num_splits = min(num_splits, 4)  # the interpreter runs programs one by one
    num_splits = max(1, min(num_splits, block_mask.num_blocks[1] * (mask_block_kv // block_kv)))

    # [B, Sq, Hq, D] -> [B, programs, rows, D], rows ordered (head in group, position).
    q_rows = q.reshape(batch, q_len, num_head_programs, heads_per_program, head_dim)
    q_rows = q_rows.transpose(0, 2, 3, 1, 4).reshape(batch, num_head_programs, rows, head_dim)
    q_rows = pad_axis(pad_axis(q_rows, 2, padded_rows), 3, tile_extent(padded_dim))

    mask_program = block_mask.mask_mod
    captured = captured_inputs(mask_program) + captured_inputs(score_program)
    tables = (block_mask.kv_num_blocks, block_mask.kv_indices,
              block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    paging = (page_table.astype(jnp.int32), lengths.astype(jnp.int32)) if paged else ()
    kernel = functools.partial(
        _decode_kernel, mask_program=mask_program, score_program=score_program, scale=scale,
        q_len=q_len, kv_len=kv_len, rows=rows, heads_per_program=heads_per_program,
        group=group, block_kv=block_kv, mask_block_kv=mask_block_kv,
        broadcast_batch=mask_batch == 1, broadcast_heads=broadcast_heads,
        num_splits=num_splits, dim_chunks=column_chunks(padded_dim),
        value_chunks=column_chunks(padded_value_dim), page_size=page_size,
        mask_every_tile=kv_len % block_kv != 0, interpret=interpret, with_max=with_max,
        quantized=quantized)
    scales = () if k_scales is None else (k_scales, v_scales)
    whole = pl.no_block_spec
    row_shape = jax.ShapeDtypeStruct((batch, num_head_programs, num_splits, padded_rows),
                                     jnp.float32)
    partial_out, partial_lse, *partial_max = pl.pallas_call(
        kernel,
        grid=(batch, num_head_programs, num_splits),
        in_specs=[pl.BlockSpec((None, None) + q_rows.shape[2:], lambda b, p, s: (b, p, 0, 0)),
                  whole, whole] + [whole] * (len(tables) + len(paging) + len(scales) +
                                             len(captured)),
        out_specs=[whole] * (3 if with_max else 2),
        out_shape=sharding.typed_like([
            jax.ShapeDtypeStruct((batch, num_head_programs, num_splits, padded_rows,
                                  padded_value_dim), jnp.float32),
            row_shape] + [row_shape] * with_max, q_rows, k, v, tables, paging, scales,
            captured),
        compiler_params=plgpu.CompilerParams(num_warps=options.decode_num_warps,
                                             num_stages=num_stages),
        interpret=interpret,
        name="flex_attention_decode",
    )(q_rows, k, v, *tables, *paging, *scales, *captured)

    out, lse = online_softmax.merge_partials(partial_out[:, :, :, :rows, :value_dim],
                                             partial_lse[:, :, :, :rows], axis=2)
    out = out.reshape(batch, num_head_programs, heads_per_program, q_len, value_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, q_heads, value_dim)
    lse = lse.reshape(batch, q_heads, q_len)
    if with_max:
        row_max = jnp.max(partial_max[0][:, :, :, :rows], axis=2).reshape(batch, q_heads,
                                                                           q_len)
        return out.astype(out_dtype or q.dtype), lse, row_max
    return out.astype(out_dtype or q.dtype), lse
