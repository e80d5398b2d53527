"""Block-sparse FlexAttention backward: two Pallas (Triton) kernels, FlashAttention-2 style.

With P = softmax(mask(score_mod(S))) recomputed per tile from the saved lse, and
delta = rowsum(dO * O) - dlse:

  dV = P^T dO          dP = dO V^T          dS' = P * (dP - delta)
  dS = dS' * d score_mod / d score         dQ = dS K * scale      dK = dS^T Q * scale

* The dK/dV kernel owns one KV tile and walks the BlockMask's transposed tables (the
  query blocks of its KV block: full ones without the mask_mod, then partial ones).
  It writes dK/dV per *query* head; GQA groups are summed outside.
* The dQ kernel owns one query tile and walks the KV tables, like the forward.
  It also accumulates the gradients of arrays the score_mod captured (learnable
  biases): each read `table[i, j]` inside the mod is a *site*, its cotangent comes from
  `jax.vjp` of the mod on the tile, summed over the tile dimensions its indices do not
  vary along, and is scatter-added into a float32 buffer. On the GPU the scatter is a
  Triton atomic add: a second pass would have to recompute the whole attention tile
  again, while the atomics touch one address per distinct index (one per tile for
  `slopes[h]`). The order of atomic adds is not fixed, so these gradients can differ
  in the last bits from run to run; dQ, dK, dV are deterministic.

The score_mod's own derivative is `jax.vjp` of the mod traced on the tile: no
hand-written rules.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flex.kernels import online_softmax
from pallas_flex.kernels.block_walk import walk_listed_tiles
from pallas_flex.kernels.config import KernelOptions
from pallas_flex.kernels.padding import pad_axis, padded_head_dim
from pallas_flex.kernels.tile_mods import (
    apply_mask_on_tile, captured_inputs, captured_read_positions, score_vjp_on_tile,
    split_captured_refs)


def _tile_gradients(q, k, v, d_out, lse_log2, delta, *, q_idx, kv_idx, batch, head, masked,
                    mask_program, mask_refs, score_program, score_refs, scale, kv_len,
                    precision, transposed=False):
    """Recomputes one tile's probabilities and returns (P, dS, score_vjp, sites).

    q [bq, D], k [bk, D], v [bk, Dv], d_out [bq, Dv], lse_log2/delta [bq, 1];
    q_idx [bq, 1], kv_idx [1, bk] (unclamped). dS includes the score_mod's derivative
    but not `scale`: the callers multiply their dQ/dK accumulators by it once, after the
    loop, instead of every tile. `score_vjp`/`sites` give the captured-array cotangents.

    transposed=True computes P^T and dS^T [bk, bq] instead (lse_log2/delta [1, bq],
    q_idx [1, bq], kv_idx [bk, 1]): the dK/dV kernel then feeds them to its matmuls as
    they are, where transposing a [bq, bk] accumulator would go through shared memory.
    """
    q_idx_in_range = q_idx  # the caller clamps query indices; padded rows have P = 0
    kv_idx_in_range = jnp.minimum(kv_idx, kv_len - 1)
    rows, columns = (k, q) if transposed else (q, k)
    scores = lax.dot_general(rows, columns, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32, precision=precision)
    score_vjp, sites = None, ()
    if score_program is None:
        logits = scores * (scale * online_softmax.LOG2_E)  # one multiply per score
    else:
        scores, score_vjp, sites = score_vjp_on_tile(score_program, score_refs, scores * scale,
                                                     batch, head, q_idx_in_range,
                                                     kv_idx_in_range)
        logits = scores * online_softmax.LOG2_E
    if masked:
        keep = apply_mask_on_tile(mask_program, mask_refs, batch, head, q_idx_in_range,
                                  kv_idx_in_range) & (kv_idx < kv_len)
        logits = jnp.where(keep, logits, -jnp.inf)
    probabilities = jnp.exp2(logits - lse_log2)  # lse_log2 = +inf on rows to ignore
    rows, columns = (v, d_out) if transposed else (d_out, v)
    d_probabilities = lax.dot_general(rows, columns, (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32, precision=precision)
    d_modded = probabilities * (d_probabilities - delta)
    site_cotangents = ()
    if score_vjp is not None:
        d_scores, site_cotangents = score_vjp(d_modded)
    else:
        d_scores = d_modded
    return probabilities, d_scores, site_cotangents, sites


def _scatter_add(target_ref, indices, value, interpret):
    """target[indices] += value, with repeated indices accumulating."""
    if interpret:
        # Interpret mode runs programs one after another; a whole-array scatter-add is
        # exact where the atomic's interpret rule would drop repeated indices.
        full = target_ref[...]
        target_ref[...] = full.at[indices if indices else (0,)].add(value)
    else:
        plgpu.atomic_add(target_ref, indices if indices else (0,), value)


def _dq_kernel(q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, kv_num_blocks_ref,
               kv_indices_ref, full_kv_num_blocks_ref, full_kv_indices_ref, *, mask_refs,
               score_refs, dq_ref, grad_refs, mask_program, score_program,
               differentiable_sites, scale, q_len, kv_len, block_q, block_kv, mask_block_q,
               mask_block_kv, broadcast_batch, broadcast_heads, interpret):
    """grad_refs: per captured score array, its float32 gradient buffer (or None)."""
    q_tile = pl.num_programs(0) - 1 - pl.program_id(0)
    head, batch = pl.program_id(1), pl.program_id(2)
    table_batch = 0 if broadcast_batch else batch
    table_head = 0 if broadcast_heads else head
    mask_row = lax.div(q_tile, jnp.int32(mask_block_q // block_q))
    precision = online_softmax.dot_precision(q_ref.dtype)

    q = q_ref[...]
    d_out = d_out_ref[...]
    lse_log2 = lse_ref[...][:, None]
    delta = delta_ref[...][:, None]
    q_idx = jnp.minimum(q_tile * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0),
                        q_len - 1)
    def visit_tile(kv_start, d_q, masked):
        k = k_ref[pl.ds(kv_start, block_kv), :]
        v = v_ref[pl.ds(kv_start, block_kv), :]
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        _, d_scores, site_cotangents, sites = _tile_gradients(
            q, k, v, d_out, lse_log2, delta, q_idx=q_idx, kv_idx=kv_idx, batch=batch,
            head=head, masked=masked, mask_program=mask_program, mask_refs=mask_refs,
            score_program=score_program, score_refs=score_refs, scale=scale, kv_len=kv_len,
            precision=precision)
        for site in differentiable_sites:
            position, indices = sites[site]
            _scatter_add(grad_refs[position], indices,
                         site_cotangents[site].astype(jnp.float32), interpret)
        return d_q + lax.dot_general(d_scores.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32, precision=precision)

    def walk(num_blocks_ref, indices_ref, d_q, masked):
        return walk_listed_tiles(
            num_blocks_ref, indices_ref, (table_batch, table_head, mask_row),
            mask_block=mask_block_kv, tile=block_kv,
            visit=lambda start, d_q: visit_tile(start, d_q, masked), state=d_q)

    d_q = jnp.zeros(q.shape, jnp.float32)
    d_q = walk(full_kv_num_blocks_ref, full_kv_indices_ref, d_q, masked=False)
    d_q = walk(kv_num_blocks_ref, kv_indices_ref, d_q, masked=True)
    dq_ref[...] = (d_q * scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_num_blocks_ref,
                 q_indices_ref, full_q_num_blocks_ref, full_q_indices_ref, *refs,
                 mask_program, score_program, scale, q_len, kv_len, block_q, block_kv,
                 mask_block_q, mask_block_kv, broadcast_batch, broadcast_heads):
    mask_refs, score_refs, (dk_ref, dv_ref) = split_captured_refs(refs, mask_program,
                                                                  score_program)
    kv_tile = pl.program_id(0)
    head, batch = pl.program_id(1), pl.program_id(2)
    table_batch = 0 if broadcast_batch else batch
    table_head = 0 if broadcast_heads else head
    mask_column = lax.div(kv_tile, jnp.int32(mask_block_kv // block_kv))
    precision = online_softmax.dot_precision(q_ref.dtype)

    k = k_ref[...]
    v = v_ref[...]
    # Tiles are computed transposed, [block_kv, block_q]: P^T and dS^T are then the left
    # operands of dV += P^T dO and dK += dS^T Q as they come out of the dots.
    kv_idx = kv_tile * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
    def visit_tile(q_start, state, masked):
        d_k, d_v = state
        rows = pl.ds(q_start, block_q)
        q = q_ref[rows, :]
        d_out = d_out_ref[rows, :]
        lse_log2 = lse_ref[rows][None, :]
        delta = delta_ref[rows][None, :]
        q_idx = jnp.minimum(q_start + lax.broadcasted_iota(jnp.int32, (1, block_q), 1),
                            q_len - 1)
        probabilities_t, d_scores_t, _, _ = _tile_gradients(
            q, k, v, d_out, lse_log2, delta, q_idx=q_idx, kv_idx=kv_idx, batch=batch,
            head=head, masked=masked, mask_program=mask_program, mask_refs=mask_refs,
            score_program=score_program, score_refs=score_refs, scale=scale, kv_len=kv_len,
            precision=precision, transposed=True)
        d_v = d_v + lax.dot_general(probabilities_t.astype(d_out.dtype), d_out,
                                    (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32, precision=precision)
        d_k = d_k + lax.dot_general(d_scores_t.astype(q.dtype), q, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32, precision=precision)
        return d_k, d_v

    def walk(num_blocks_ref, indices_ref, state, masked):
        return walk_listed_tiles(
            num_blocks_ref, indices_ref, (table_batch, table_head, mask_column),
            mask_block=mask_block_q, tile=block_q,
            visit=lambda start, state: visit_tile(start, state, masked), state=state)

    state = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    state = walk(full_q_num_blocks_ref, full_q_indices_ref, state, masked=False)
    state = walk(q_num_blocks_ref, q_indices_ref, state, masked=True)
    dk_ref[...] = (state[0] * scale).astype(dk_ref.dtype)
    dv_ref[...] = state[1].astype(dv_ref.dtype)


def _differentiable_sites(score_program, wanted=None):
    """(indices of the score_mod's reads that need gradients, positions of the captured
    arrays they read): reads of floating captured arrays that are differentiated."""
    if score_program is None:
        return (), ()
    positions = captured_read_positions(score_program)
    wanted = wanted if wanted is not None else [True] * len(score_program.consts)
    floating = [jnp.issubdtype(c.dtype, jnp.floating) and want
                for c, want in zip(score_program.consts, wanted)]
    sites = tuple(i for i, position in enumerate(positions) if floating[position])
    return sites, tuple(sorted({positions[i] for i in sites}))


@dataclasses.dataclass(frozen=True)
class _Launch:
    """What both backward launches share: padded operands, tables, static settings."""
    q: jax.Array          # [B, Sq_padded, Hq, D_padded]
    k: jax.Array          # [B, Skv_padded, Hkv, D_padded]
    v: jax.Array          # [B, Skv_padded, Hkv, Dv_padded]
    d_out: jax.Array      # [B, Sq_padded, Hq, Dv_padded], q's dtype
    lse_log2: jax.Array   # [B, Hq, Sq_padded], +inf on rows with no probability mass
    delta: jax.Array      # [B, Hq, Sq_padded]
    block_mask: object
    score_program: object
    kernel_settings: dict  # the keyword arguments both kernels take


def _prepare(q, k, v, out, lse, d_out, d_lse, block_mask, score_program, scale):
    num_q_blocks, num_kv_blocks = block_mask.num_blocks
    mask_block_q, mask_block_kv = block_mask.block_size
    # delta = rowsum(dO * O) - dlse: the lse output's own gradient folds in here.
    delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse
    # Rows with lse = -inf (nothing attended) and padded rows get +inf: P = exp2(s - inf) = 0.
    lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * online_softmax.LOG2_E)

    head_dim, value_dim = q.shape[3], v.shape[3]
    padded_dim, padded_value_dim = padded_head_dim(head_dim), padded_head_dim(value_dim)
    padded_q_len, padded_kv_len = num_q_blocks * mask_block_q, num_kv_blocks * mask_block_kv
    q_len = q.shape[1]
    return _Launch(
        q=pad_axis(pad_axis(q, 3, padded_dim), 1, padded_q_len),
        k=pad_axis(pad_axis(k, 3, padded_dim), 1, padded_kv_len),
        v=pad_axis(pad_axis(v, 3, padded_value_dim), 1, padded_kv_len),
        d_out=pad_axis(pad_axis(d_out.astype(q.dtype), 3, padded_value_dim), 1, padded_q_len),
        lse_log2=jnp.pad(lse_log2, ((0, 0), (0, 0), (0, padded_q_len - q_len)),
                         constant_values=jnp.inf),
        delta=pad_axis(delta, 2, padded_q_len),
        block_mask=block_mask, score_program=score_program,
        kernel_settings=dict(
            mask_program=block_mask.mask_mod, score_program=score_program, scale=scale,
            q_len=q_len, kv_len=k.shape[1], mask_block_q=mask_block_q,
            mask_block_kv=mask_block_kv,
            broadcast_batch=block_mask.kv_num_blocks.shape[0] == 1,
            broadcast_heads=block_mask.kv_num_blocks.shape[1] == 1))


def _dq_launch(launch: _Launch, *, options: KernelOptions, interpret: bool,
               wanted_const_grads=None):
    """dQ [B, Sq_padded, Hq, D_padded] and the float32 gradient of each captured score
    array that gets one, as {position among the score_mod's captured arrays: gradient}."""
    q, k, v, d_out = launch.q, launch.k, launch.v, launch.d_out
    batch, padded_q_len, q_heads, padded_dim = q.shape
    padded_kv_len, kv_heads, padded_value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    block_mask, score_program = launch.block_mask, launch.score_program
    mask_block_q, mask_block_kv = block_mask.block_size
    block_q = min(options.backward_block_q, mask_block_q)
    block_kv = min(options.backward_block_kv, mask_block_kv)
    num_q_tiles = padded_q_len // block_q

    mask_inputs = captured_inputs(block_mask.mask_mod)
    score_inputs = captured_inputs(score_program)
    sites, grad_positions = _differentiable_sites(score_program, wanted_const_grads)
    # Gradient buffers, one per captured array that gets one, zero-initialised through
    # input/output aliasing (kernel outputs start uninitialised). Sites index the buffers
    # by the captured array's position among the score consts; map positions to slots.
    grad_buffers = [jnp.zeros(score_inputs[position].shape, jnp.float32)
                    for position in grad_positions]
    slot_of = {position: slot for slot, position in enumerate(grad_positions)}
    num_tables = 10

    def kernel(*refs):
        tables = refs[:num_tables]
        mask_refs = refs[num_tables:num_tables + len(mask_inputs)]
        score_refs = refs[num_tables + len(mask_inputs):
                          num_tables + len(mask_inputs) + len(score_inputs)]
        dq_ref, *buffer_refs = refs[num_tables + len(mask_inputs) + len(score_inputs)
                                    + len(grad_buffers):]
        grad_refs = [None] * len(score_inputs)
        for position, slot in slot_of.items():
            grad_refs[position] = buffer_refs[slot]
        _dq_kernel(*tables, mask_refs=mask_refs, score_refs=score_refs, dq_ref=dq_ref,
                   grad_refs=grad_refs, differentiable_sites=sites, interpret=interpret,
                   block_q=block_q, block_kv=block_kv, **launch.kernel_settings)

    def reverse(tile):
        return num_q_tiles - 1 - tile

    q_row_spec = pl.BlockSpec((None, block_q, None, padded_dim),
                              lambda i, h, b: (b, reverse(i), h, 0))
    d_out_row_spec = pl.BlockSpec((None, block_q, None, padded_value_dim),
                                  lambda i, h, b: (b, reverse(i), h, 0))
    vector_row_spec = pl.BlockSpec((None, None, block_q), lambda i, h, b: (b, h, reverse(i)))
    k_whole_spec = pl.BlockSpec((None, padded_kv_len, None, padded_dim),
                                lambda i, h, b: (b, 0, h // group, 0))
    v_whole_spec = pl.BlockSpec((None, padded_kv_len, None, padded_value_dim),
                                lambda i, h, b: (b, 0, h // group, 0))
    kv_tables = (block_mask.kv_num_blocks, block_mask.kv_indices,
                 block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    whole = pl.no_block_spec
    num_inputs = num_tables + len(mask_inputs) + len(score_inputs)
    d_q, *grads = pl.pallas_call(
        kernel,
        grid=(num_q_tiles, q_heads, batch),
        in_specs=[q_row_spec, k_whole_spec, v_whole_spec, d_out_row_spec, vector_row_spec,
                  vector_row_spec] + [whole] * (4 + len(mask_inputs) + len(score_inputs)
                                                + len(grad_buffers)),
        out_specs=[q_row_spec] + [whole] * len(grad_buffers),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)]
        + [jax.ShapeDtypeStruct(b.shape, jnp.float32) for b in grad_buffers],
        input_output_aliases={num_inputs + slot: 1 + slot for slot in range(len(grad_buffers))},
        compiler_params=plgpu.CompilerParams(num_warps=options.backward_num_warps,
                                             num_stages=options.backward_num_stages),
        interpret=interpret,
        name="flex_attention_backward_dq",
    )(q, k, v, d_out, launch.lse_log2, launch.delta, *kv_tables, *mask_inputs, *score_inputs,
      *grad_buffers)
    return d_q, {position: grads[slot] for position, slot in slot_of.items()}


def _dkdv_launch(launch: _Launch, *, options: KernelOptions, interpret: bool):
    """dK [B, Skv_padded, Hq, D_padded] and dV [..., Dv_padded] per *query* head (in k's
    dtype without GQA, else float32 for the caller to sum over each group)."""
    q, k, v, d_out = launch.q, launch.k, launch.v, launch.d_out
    batch, padded_q_len, q_heads, padded_dim = q.shape
    padded_kv_len, kv_heads, padded_value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    block_mask = launch.block_mask
    mask_block_q, mask_block_kv = block_mask.block_size
    block_q = min(options.backward_dkdv_block_q, mask_block_q)
    block_kv = min(options.backward_dkdv_block_kv, mask_block_kv)
    mask_inputs = captured_inputs(block_mask.mask_mod)
    score_inputs = captured_inputs(launch.score_program)

    # Without GQA each program's result is final: store it in the input dtype. With GQA
    # the query heads of a group are summed afterwards, in float32.
    dkdv_dtype = k.dtype if group == 1 else jnp.float32
    q_whole_spec = pl.BlockSpec((None, padded_q_len, None, padded_dim),
                                lambda j, h, b: (b, 0, h, 0))
    d_out_whole_spec = pl.BlockSpec((None, padded_q_len, None, padded_value_dim),
                                    lambda j, h, b: (b, 0, h, 0))
    vector_whole_spec = pl.BlockSpec((None, None, padded_q_len), lambda j, h, b: (b, h, 0))
    k_tile_spec = pl.BlockSpec((None, block_kv, None, padded_dim),
                               lambda j, h, b: (b, j, h // group, 0))
    v_tile_spec = pl.BlockSpec((None, block_kv, None, padded_value_dim),
                               lambda j, h, b: (b, j, h // group, 0))
    q_tables = (block_mask.q_num_blocks, block_mask.q_indices,
                block_mask.full_q_num_blocks, block_mask.full_q_indices)
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=block_q, block_kv=block_kv,
                          **launch.kernel_settings),
        grid=(padded_kv_len // block_kv, q_heads, batch),
        in_specs=[q_whole_spec, k_tile_spec, v_tile_spec, d_out_whole_spec, vector_whole_spec,
                  vector_whole_spec] + [whole] * (4 + len(mask_inputs) + len(score_inputs)),
        out_specs=[pl.BlockSpec((None, block_kv, None, padded_dim),
                                lambda j, h, b: (b, j, h, 0)),
                   pl.BlockSpec((None, block_kv, None, padded_value_dim),
                                lambda j, h, b: (b, j, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch, padded_kv_len, q_heads, padded_dim), dkdv_dtype),
                   jax.ShapeDtypeStruct((batch, padded_kv_len, q_heads, padded_value_dim),
                                        dkdv_dtype)],
        compiler_params=plgpu.CompilerParams(
            num_warps=options.backward_dkdv_num_warps or options.backward_num_warps,
            num_stages=options.backward_dkdv_num_stages or options.backward_num_stages),
        interpret=interpret,
        name="flex_attention_backward_dkdv",
    )(q, k, v, d_out, launch.lse_log2, launch.delta, *q_tables, *mask_inputs, *score_inputs)


def flex_attention_backward(q, k, v, out, lse, d_out, d_lse, block_mask, score_program, *,
                            scale: float, options: KernelOptions, interpret: bool,
                            wanted_const_grads=None):
    """Gradients (dq, dk, dv, d_score_consts) of FlexAttention.

    d_score_consts has one entry per captured array of `score_program`: None for arrays
    that are not floating point or not in `wanted_const_grads` (one bool per captured
    array; None = all), which get no gradient.
    """
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    launch = _prepare(q, k, v, out, lse, d_out, d_lse, block_mask, score_program, scale)
    d_q, grads = _dq_launch(launch, options=options, interpret=interpret,
                            wanted_const_grads=wanted_const_grads)
    d_k, d_v = _dkdv_launch(launch, options=options, interpret=interpret)

    def sum_groups(x):  # [B, S, Hq, D] -> [B, S, Hkv, D]
        if group == 1:
            return x
        return x.reshape(batch, x.shape[1], kv_heads, group, x.shape[3]).sum(axis=3)

    d_q = d_q[:, :q_len, :, :head_dim].astype(q.dtype)
    d_k = sum_groups(d_k[:, :kv_len, :, :head_dim]).astype(k.dtype)
    d_v = sum_groups(d_v[:, :kv_len, :, :value_dim]).astype(v.dtype)
    const_grads = [None] * len(captured_inputs(score_program))
    for position, gradient in grads.items():
        original = score_program.consts[position]
        const_grads[position] = gradient.reshape(jnp.shape(original)).astype(original.dtype)
    return d_q, d_k, d_v, const_grads
