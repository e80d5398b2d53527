"""Block-sparse FlexAttention forward: a Pallas (Triton) kernel.

Grid (query tile, query head, batch), query tiles fastest so that programs running at
the same time share one head's K/V in L2, and in reverse order so that the longest rows
of a causal mask start first. Each program loads its query tile once, then
walks the BlockMask row of its query block: first the *full* KV blocks (no mask_mod
call), then the *partial* ones (mask_mod on the tile, plus the sequence-tail mask).
Blocks the mask leaves empty are never visited. GQA: query head h reads KV head
h // (Hq // Hkv). Attention sinks (one logit per query head, `pallas_flex/sinks.py`) join
each row's softmax in the final normalization (`online_softmax.finalize`'s sink_log2).
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
from pallas_flex.kernels.block_walk import walk_listed_tiles
from pallas_flex.kernels.config import KernelOptions, paged_forward_stages, planned_shared_memory
from pallas_flex.kernels.kv_tiles import (
    as_int8_bits, load_rows, page_table_row, paged_tile_view, quantized_tiles, shifts_values)
from pallas_flex.kernels.padding import column_chunks, pad_axis, padded_head_dim, round_up
from pallas_flex.kernels.tile_mods import (
    TileFrame, apply_mask_on_tile, apply_score_on_tile, padded_for_blocks, split_captured_refs)


def _forward_kernel(q_ref, k_ref, v_ref, kv_num_blocks_ref, kv_indices_ref,
                    full_kv_num_blocks_ref, full_kv_indices_ref, *refs,
                    mask_program, score_program, scale, q_len, kv_len, block_q, block_kv,
                    mask_block_q, mask_block_kv, broadcast_batch, broadcast_heads,
                    interpret, group=1, paged=None, with_max=False, quantized=None,
                    with_sinks=False, with_gate=False, select_small_tables=False):
    """paged: None (k_ref/v_ref hold this head's whole padded K/V), or
    (page_size, dim_chunks, value_chunks): k_ref/v_ref are all the pages, and a page
    table and per-row lengths follow the BlockMask tables. with_sinks: a float32 ref
    [Hq] of sink logits (natural units) follows them (and a quantized cache's scales).
    with_gate: then the output gate's [block_q, Dv] tile (`pallas_flex/output_gate.py`):
    the output is multiplied by its sigmoid before it is stored.
    quantized: None, or a quantized cache's dtype name: its pages arrive as int8 bits
    (`kv_tiles.as_int8_bits`)."""
    if paged is not None:
        page_table_ref, lengths_ref, *refs = refs
    if quantized:  # int8 / float8 pages with per-token scales [num_pages, Hkv, page_size]
        scale_refs, refs = refs[:2], refs[2:]
    if with_sinks:
        sinks_ref, *refs = refs
    if with_gate:
        gate_ref, *refs = refs
    mask_refs, score_refs, (out_ref, lse_ref, *max_ref) = split_captured_refs(
        refs, mask_program, score_program)

    q_tile = pl.num_programs(0) - 1 - pl.program_id(0)
    head, batch = pl.program_id(1), pl.program_id(2)
    table_batch = 0 if broadcast_batch else batch
    table_head = 0 if broadcast_heads else head
    mask_row = lax.div(q_tile, jnp.int32(mask_block_q // block_q))
    precision = online_softmax.dot_precision(q_ref.dtype, interpret)

    q = q_ref[...] if paged is None else None  # [block_q, D]
    q_idx = q_tile * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    # Mods always see in-range indices; padded query rows are sliced off afterwards.
    q_idx = jnp.minimum(q_idx, q_len - 1)

    if paged is not None:
        page_size, dim_chunks, value_chunks = paged
        kv_head = lax.div(head, jnp.int32(group))
        kv_length = jnp.minimum(lengths_ref[batch], kv_len)
        q_chunks = [q_ref[:, pl.ds(start, width)] for start, width in dim_chunks]

    def load_paged(ref, kv_start, valid, start, width):
        view = paged_tile_view(ref, page_table_row(page_table_ref, batch), kv_head, kv_start,
                               tile=block_kv, page_size=page_size, column_start=start,
                               width=width)
        return load_rows(view, valid)

    def visit_tile(kv_start, state, masked):
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        if paged is None:
            k = k_ref[pl.ds(kv_start, block_kv), :]  # [block_kv, D]
            v = v_ref[pl.ds(kv_start, block_kv), :]  # [block_kv, Dv]
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32, precision=precision)
        else:
            # Full tiles lie inside the row's length (paged_flex_attention clips the
            # BlockMask to it): only partial tiles check the length, as the mask does.
            valid = None
            if masked:
                valid = (kv_start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
                         ) < kv_length
            keys = [load_paged(k_ref, kv_start, valid, *chunk) for chunk in dim_chunks]
            v = [load_paged(v_ref, kv_start, valid, *chunk) for chunk in value_chunks]
            value_scale = None
            if quantized:
                keys, v, key_scale, value_scale = quantized_tiles(
                    keys, v, scale_refs, page_table_row(page_table_ref, batch), kv_head,
                    kv_start, tile=block_kv, page_size=page_size, valid_rows=valid,
                    dtype=q_ref.dtype, cache_dtype=quantized)
            scores = sum(lax.dot_general(q_chunk, key, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32,
                                         precision=precision)
                         for q_chunk, key in zip(q_chunks, keys))
            if quantized:
                scores = scores * key_scale
        kv_idx_in_range = jnp.minimum(kv_idx, kv_len - 1)
        # Mod reads at exactly q_idx / kv_idx load this tile's block of their array.
        frame = TileFrame(q_tile * block_q, kv_start, block_q, block_kv)
        # The factor that turns scores into base-2 logits (the scale without a score_mod,
        # log2(e) after one) is applied inside the softmax's exponent, one FMA per score,
        # rather than by a multiply of its own.
        logit_scale = None
        if score_program is None and scale > 0:
            logit_scale = scale * online_softmax.LOG2_E
        elif score_program is None:
            scores = scores * (scale * online_softmax.LOG2_E)
        else:
            scores = apply_score_on_tile(score_program, score_refs, scores * scale, batch,
                                         head, q_idx, kv_idx_in_range,
                                         indices_below=max(q_len, kv_len), frame=frame,
                                         select_small_tables=select_small_tables)
            logit_scale = online_softmax.LOG2_E
        if masked:
            keep = apply_mask_on_tile(mask_program, mask_refs, batch, head, q_idx,
                                      kv_idx_in_range, indices_below=max(q_len, kv_len),
                                      frame=frame, select_small_tables=select_small_tables)
            if kv_len % mask_block_kv:  # else no tile reaches past the keys
                keep = keep & (kv_idx < kv_len)
            if paged is not None:
                keep = keep & (kv_idx < kv_length)
            scores = jnp.where(keep, scores, -jnp.inf)
        if paged is not None:
            return online_softmax.update_chunks(state, scores, v, precision,
                                                logit_scale=logit_scale,
                                                value_scale=value_scale)
        return online_softmax.update(state, scores, v, precision, logit_scale=logit_scale)

    def walk(num_blocks_ref, indices_ref, state, masked):
        return walk_listed_tiles(
            num_blocks_ref, indices_ref, (table_batch, table_head, mask_row),
            mask_block=mask_block_kv, tile=block_kv,
            visit=lambda start, state: visit_tile(start, state, masked), state=state)

    if paged is None:
        state = online_softmax.initial_state(block_q, out_ref.shape[-1])
    else:
        state = online_softmax.initial_state_chunks(
            block_q, [w for _, w in value_chunks],
            value_shift=shifts_values(quantized, q_ref.dtype))
    state = walk(full_kv_num_blocks_ref, full_kv_indices_ref, state, masked=False)
    state = walk(kv_num_blocks_ref, kv_indices_ref, state, masked=True)
    # The sink in the running max's units: base-2 logits (the scale is in the scores).
    sink_log2 = sinks_ref[head] * online_softmax.LOG2_E if with_sinks else None
    if paged is None:
        out, lse = online_softmax.finalize(state, sink_log2)
        if with_gate:
            out = out * jax.nn.sigmoid(gate_ref[...].astype(jnp.float32))
        out_ref[...] = out.astype(out_ref.dtype)
    else:
        outs, lse = online_softmax.finalize_chunks(state, sink_log2)
        for (start, width), out in zip(value_chunks, outs):
            out_ref[:, pl.ds(start, width)] = out.astype(out_ref.dtype)
    lse_ref[...] = lse
    if with_max:  # the running max is in registers already: one more row store
        max_ref[0][...] = online_softmax.row_max(state)


def _fit_to_shared_memory(options: KernelOptions, q, v, block_mask, score_program, *,
                          page_size):
    """options with the Triton forward's tiles and stages fitted to the shared-memory
    budget (on a paged cache, num_stages is the paged depth for its page size)."""
    if page_size is not None:
        given = options.given | ({"num_stages"} if "paged_num_stages" in options.given
                                 else set())
        options = options.replace(num_stages=paged_forward_stages(options, page_size),
                                  given=frozenset(given))
    reads = shared_memory.mod_reads(block_mask.mask_mod, score_program)
    estimate = functools.partial(
        shared_memory.forward_options_bytes, dtype=q.dtype,
        head_dim=padded_head_dim(q.shape[3]), value_dim=padded_head_dim(v.shape[3]),
        mask_block=block_mask.block_size, reads=reads)
    return shared_memory.fit(options, estimate, planned_shared_memory(options),
                             kernel="forward",
                             inputs=f"{q.dtype} inputs at head dim {q.shape[3]}")


def _reverse(tile, num_tiles):
    return num_tiles - 1 - tile


def flex_attention_forward(q, k, v, block_mask, score_program, *, scale: float,
                           options: KernelOptions, interpret: bool, page_table=None,
                           lengths=None, out_dtype=None, with_max=False, k_scales=None,
                           v_scales=None, sinks=None, output_gate=None):
    """out [B, Sq, Hq, Dv] (out_dtype, default q's dtype) and lse [B, Hq, Sq] (float32),
    and with_max the row max of the logits [B, Hq, Sq] (float32, -inf where masked).
    k_scales, v_scales: a quantized paged cache's per-token scales [num_pages, Hkv,
    page_size] (its pages int8 / float8; q stays 16-bit). sinks: None, or a logit per
    query head [Hq] in every row's softmax with no value (the lse includes it; the row
    max does not). output_gate: None, or [B, Sq, Hq, Dv]: the output is multiplied by
    its sigmoid in the kernel's epilogue (not on pages: `dispatch.run_forward`).

    Shapes are validated by the caller (`pallas_flex.api`); the BlockMask's lengths
    equal Sq and Skv, and its batch/head dims are the real ones or 1.
    Paged (page_table given): k/v are pages [num_pages, Hkv, page_size, D/Dv] read in
    place through page_table [B, max_pages] (-1 = none), positions >= lengths[b] masked;
    Skv is the BlockMask's (logical) KV_LEN. Its *full* blocks must lie below lengths[b]
    (`paged_flex_attention` clips the BlockMask so): only partial tiles check lengths.
    out_dtype: float32 keeps the output unrounded (the backward's residual when a
    captured array is differentiated; only the Triton kernel writes it).
    This is the Triton kernel; `pallas_flex.dispatch` decides when it runs.
    """
    paged = page_table is not None
    if paged and output_gate is not None:
        raise ValueError("the paged Triton forward takes no output gate (applied after it)")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    options = _fit_to_shared_memory(options, q, v, block_mask, score_program,
                                    page_size=k.shape[2] if paged else None)
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, value_dim = k.shape[1 if paged else 2], v.shape[3]
    kv_len = block_mask.shape[3]
    mask_block_q, mask_block_kv = block_mask.block_size
    num_q_blocks, num_kv_blocks = block_mask.num_blocks
    block_q = min(options.block_q, mask_block_q)
    block_kv = min(options.block_kv, mask_block_kv)
    group = q_heads // kv_heads

    # Triton tiles need power-of-two extents: pad head dims with zeros (which add nothing
    # to q.k or to the output), and sequences up to whole mask blocks. Pages are read in
    # place instead, as power-of-two column chunks (only dims not a multiple of 16 pad).
    padded_dim, padded_value_dim = padded_head_dim(head_dim), padded_head_dim(value_dim)
    q = pad_axis(pad_axis(q, 3, padded_dim), 1, num_q_blocks * mask_block_q)
    k, v, quantized = as_int8_bits(k, v, k_scales)
    if paged:
        chunk_dim, chunk_value_dim = round_up(head_dim, 16), round_up(value_dim, 16)
        k, v = pad_axis(k, 3, chunk_dim), pad_axis(v, 3, chunk_value_dim)
        paging = (page_table.astype(jnp.int32), lengths.astype(jnp.int32))
        paged_config = (k.shape[2], column_chunks(chunk_dim), column_chunks(chunk_value_dim))
        kv_specs = [pl.no_block_spec, pl.no_block_spec]
    else:
        k = pad_axis(pad_axis(k, 3, padded_dim), 1, num_kv_blocks * mask_block_kv)
        v = pad_axis(pad_axis(v, 3, padded_value_dim), 1, num_kv_blocks * mask_block_kv)
        paging, paged_config = (), None
        padded_kv_len = k.shape[1]
        kv_specs = [pl.BlockSpec((None, padded_kv_len, None, padded_dim),
                                 lambda i, h, b: (b, 0, h // group, 0)),
                    pl.BlockSpec((None, padded_kv_len, None, padded_value_dim),
                                 lambda i, h, b: (b, 0, h // group, 0))]
    padded_q_len = q.shape[1]

    mask_program = block_mask.mask_mod
    # Arrays the mods read as blocks reach every tile (edge-padded where they do not).
    limits = (num_q_blocks * mask_block_q, num_kv_blocks * mask_block_kv)
    captured = padded_for_blocks(mask_program, *limits) + padded_for_blocks(score_program,
                                                                            *limits)
    tables = (block_mask.kv_num_blocks, block_mask.kv_indices,
              block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    kernel = functools.partial(
        _forward_kernel, mask_program=mask_program, score_program=score_program,
        scale=scale, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv,
        mask_block_q=mask_block_q, mask_block_kv=mask_block_kv,
        broadcast_batch=block_mask.kv_num_blocks.shape[0] == 1,
        broadcast_heads=block_mask.kv_num_blocks.shape[1] == 1, group=group,
        paged=paged_config, interpret=interpret, with_max=with_max,
        quantized=quantized, with_sinks=sinks is not None,
        with_gate=output_gate is not None,
        select_small_tables=options.forward_selects_small_tables)
    scales = () if k_scales is None else (k_scales, v_scales)
    sink_inputs = () if sinks is None else (sinks.astype(jnp.float32),)
    # The gate's tile is the output's: padded as the output is.
    gate_inputs = () if output_gate is None else (
        pad_axis(pad_axis(output_gate, 3, padded_value_dim), 1, q.shape[1]),)

    num_q_tiles = padded_q_len // block_q
    whole = pl.no_block_spec
    # The output's [block_q, Dv] tile, and the output gate's.
    output_spec = pl.BlockSpec((None, block_q, None, padded_value_dim),
                               lambda i, h, b: (b, _reverse(i, num_q_tiles), h, 0))
    in_specs = [
        pl.BlockSpec((None, block_q, None, padded_dim), lambda i, h, b: (b, _reverse(i, num_q_tiles), h, 0)),
    ] + kv_specs + [whole] * (len(tables) + len(paging) + len(scales) + len(sink_inputs)) + [
        output_spec] * len(gate_inputs) + [whole] * len(captured)
    row_spec = pl.BlockSpec((None, None, block_q),
                            lambda i, h, b: (b, h, _reverse(i, num_q_tiles)))
    row_shape = jax.ShapeDtypeStruct((batch, q_heads, padded_q_len), jnp.float32)
    out_specs = [output_spec] + [row_spec] * (2 if with_max else 1)
    out_shape = [
        jax.ShapeDtypeStruct((batch, padded_q_len, q_heads, padded_value_dim), out_dtype),
    ] + [row_shape] * (2 if with_max else 1)
    out, *rows = pl.pallas_call(
        kernel,
        grid=(num_q_tiles, q_heads, batch),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=sharding.typed_like(out_shape, q, k, v, tables, paging, scales,
                                      sink_inputs, gate_inputs, captured),
        compiler_params=plgpu.CompilerParams(
            num_warps=options.num_warps,
            num_stages=options.num_stages),
        interpret=interpret,
        name="flex_attention_forward_paged" if paged else "flex_attention_forward",
    )(q, k, v, *tables, *paging, *scales, *sink_inputs, *gate_inputs, *captured)
    return (out[:, :q_len, :, :value_dim],) + tuple(row[:, :, :q_len] for row in rows)

