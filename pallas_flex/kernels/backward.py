"""Block-sparse FlexAttention backward: one Pallas (Triton) launch, FlashAttention-2 style.

With P = softmax(mask(score_mod(S))) recomputed per tile from the saved lse, and
delta = rowsum(dO * O) - dlse:

  dV = P^T dO          dP = dO V^T          dS' = P * (dP - delta)
  dS = dS' * d score_mod / d score         dQ = dS K * scale      dK = dS^T Q * scale

The launch has two kinds of programs (as PyTorch's FlexAttention backward has):
* A dK/dV program owns one KV tile and walks the BlockMask's transposed tables (the
  query blocks of its KV block: full ones without the mask_mod, then partial ones), once
  per query head of its GQA group, summing the group in registers.
* A dQ program owns one query tile of one query head and walks the KV tables, like the
  forward. It also accumulates the gradients of arrays the score_mod captured (learnable
  biases): each read `table[i, j]` inside the mod is a *site*, its cotangent comes from
  `jax.vjp` of the mod on the tile, summed over the tile dimensions its indices do not
  vary along. How a site's cotangents reach the gradient depends on its indices:
  - indices of b and h only (`slopes[h]`): one scalar per tile, summed in registers over
    the program's walk and written once, with its table index, to the program's own
    slot of a partial-sum buffer; the slots are reduced afterwards by a fixed-order sum
    (no atomics: bitwise reproducible);
  - indices that vary over the tile into a small table (a T5 bucket: at most
    DETERMINISTIC_MAX_ENTRIES entries along the varying axes): a register row per
    program over those entries, each tile adding its cotangent per entry for the
    entries it reaches (a one-hot reduction), written and reduced like the scalar sums;
  - larger tables (a relative table [H, 2S-1], a pair bias [H, S, S]): the cotangent
    tile is scatter-added into a float32 buffer with Triton atomics (a second pass
    would recompute the whole attention tile, while the atomics touch one address per
    element; a read at exactly q_idx / kv_idx, loaded as a block of the array
    (`tile_mods.block_reads`), adds its cotangent tile as one block: vectorized
    atomics); the order of the adds is not fixed, so these differ in their last bits
    from run to run (`backward_deterministic` refuses them with a ValueError). On the
    H100 atomics into a T5 table (32 addresses a head, hit by every element) took
    fwd+bwd from 18 to 262 ms at B4 H16 S4096 D128; the one-hot rows are what it
    takes instead;
  - large tables whose entries many batch rows share (issue 21's Evoformer pair bias
    [B, H, S, S] read at b // rows by 256 folded MSA rows, a bias [H, S, S] shared by
    the batch): there every row's atomics hit the same addresses. These go to a launch
    of their own instead (`backward_batch_loop.py`, KernelOptions.backward_batch_sum):
    a program owns one table tile and walks a run of rows, recomputing their P and dS
    on it and summing in registers, one scatter-add per program.

The score_mod's own derivative is `jax.vjp` of the mod traced on the tile: no
hand-written rules. What both launches compute on a tile is in `backward_tiles.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flex import sharding
from pallas_flex.kernels import online_softmax, shared_memory
from pallas_flex.kernels.block_walk import loop_value, walk_listed_tiles
from pallas_flex.kernels.backward_batch_loop import batch_loop_gradients
from pallas_flex.kernels.backward_tiles import (
    SitePlan, flat_index, scatter_add, tile_probabilities, tile_score_gradients)
from pallas_flex.kernels.config import (
    BATCH_LOOP_MIN_SHARING, DETERMINISTIC_MAX_ENTRIES, KernelOptions, planned_shared_memory)
from pallas_flex.kernels.padding import pad_axis, padded_head_dim
from pallas_flex.kernels.tile_mods import (
    CaptureLog, TileFrame, captured_inputs, captured_read_batch_axes,
    captured_read_positions, captured_read_varying_axes, padded_for_blocks,
    split_captured_refs, unpadded_gradient)


@dataclasses.dataclass(frozen=True)
class _Refs:
    """One (batch, KV head)'s operands, whole sequences: each program slices its own
    tile out of them (programs of both kinds share one launch, so BlockSpecs cannot cut
    the tiles). q, d_out, dq are [S, group, D] and lse_log2, delta [group, S]: the query
    heads of the KV head's GQA group. dq/dk/dv and grads are None where the launch does
    not produce them."""
    q: object
    k: object
    v: object
    d_out: object
    lse_log2: object
    delta: object
    kv_tables: tuple   # kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices
    q_tables: tuple    # q_num_blocks, q_indices, full_q_num_blocks, full_q_indices
    mask: tuple        # captured arrays of the mask_mod
    score: tuple       # captured arrays of the score_mod
    dq: object
    dk: object
    dv: object
    grads: list        # per captured score array, its float32 gradient buffer or None
    partials: list     # per summed site (SitePlan mode "sum"/"one_hot"): (values, bases)


def _walk_order(full_tables, masked_tables, masked_first: bool):
    """((num_blocks_ref, indices_ref, masked), ...) in the order a program walks them."""
    walks = [(*full_tables, False), (*masked_tables, True)]
    return walks[::-1] if masked_first else walks


def _one_hot_row(plan: SitePlan, cotangent, indices, row):
    """row [width] plus, per table entry, the sum of `cotangent` (a tile) over the
    elements whose varying indices reach it. Only the entries between the tile's least
    and greatest are visited: a T5 bucket or a clipped relative position takes one or
    two values on most tiles, a few dozen on the diagonal's."""
    entry = jnp.zeros(jnp.shape(cotangent), jnp.int32)
    for axis, varies in enumerate(plan.varying):
        if varies:
            entry = entry * jnp.int32(plan.table_shape[axis]) + indices[axis]
    slots = lax.broadcasted_iota(jnp.int32, (plan.width,), 0)

    def add_entry(value, row):
        total = jnp.sum(jnp.where(entry == value, cotangent, 0.0))
        return jnp.where(slots == value, row + total, row)

    return lax.fori_loop(jnp.min(entry), jnp.max(entry) + 1, add_entry, row)


def _dq_program(q_tile, member, kv_head, batch, refs: _Refs, *, mask_program, score_program,
                site_plans, scale, q_len, kv_len, block_q, block_kv, mask_block_q,
                mask_block_kv, broadcast_batch, broadcast_heads, group, masked_first,
                partial_slot, interpret):
    """dQ of one query tile of query head `member` of the KV head's group, walking the
    KV tables like the forward; also accumulates the gradients of captured score arrays
    (see the module docstring), writing register sums to row `partial_slot` of the
    partial-sum buffers."""
    head = kv_head * group + member
    table_batch = 0 if broadcast_batch else batch
    table_head = 0 if broadcast_heads else head
    mask_row = lax.div(q_tile, jnp.int32(mask_block_q // block_q))
    precision = online_softmax.dot_precision(refs.q.dtype, interpret)
    summed = [plan for plan in site_plans if plan.mode != "atomic"]

    rows = pl.ds(q_tile * block_q, block_q)
    q = refs.q[rows, member, :]
    d_out = refs.d_out[rows, member, :]
    lse_log2 = refs.lse_log2[member, rows][:, None]
    delta = refs.delta[member, rows][:, None]
    q_idx = jnp.minimum(q_tile * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0),
                        q_len - 1)

    def visit_tile(kv_start, carry, masked):
        d_q, sums, bases = carry
        k = refs.k[pl.ds(kv_start, block_kv), :]
        v = refs.v[pl.ds(kv_start, block_kv), :]
        kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        log = CaptureLog()
        probabilities, score_vjp, sites = tile_probabilities(
            q, k, lse_log2, q_idx=q_idx, kv_idx=kv_idx, batch=batch, head=head,
            masked=masked, mask_program=mask_program, mask_refs=refs.mask,
            score_program=score_program, score_refs=refs.score, scale=scale, q_len=q_len,
            kv_len=kv_len, mask_block_kv=mask_block_kv, precision=precision,
            capture_log=log, frame=TileFrame(q_tile * block_q, kv_start, block_q, block_kv))
        d_scores, site_cotangents = tile_score_gradients(
            probabilities, v, d_out, delta, score_vjp, precision=precision)
        new_sums, new_bases = [], []
        for plan in site_plans:
            _, indices = sites[plan.site]
            cotangent = site_cotangents[plan.site].astype(jnp.float32)
            if plan.mode == "atomic":
                block = log.blocks[plan.site]
                if block is not None:  # a read at q_idx / kv_idx: one block's atomic add
                    block.scatter_add(refs.grads[plan.position], cotangent)
                else:
                    scatter_add(refs.grads[plan.position], indices, cotangent, interpret)
                continue
            fixed_axes = [axis for axis, varies in enumerate(plan.varying) if not varies]
            new_bases.append(loop_value(flat_index(indices, plan.table_shape, fixed_axes),
                                        kv_start))
            if plan.mode == "sum":
                new_sums.append(sums[len(new_sums)] + jnp.sum(cotangent))
            else:
                new_sums.append(_one_hot_row(plan, cotangent, indices, sums[len(new_sums)]))
        d_q = d_q + lax.dot_general(d_scores.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32, precision=precision)
        return d_q, tuple(new_sums), tuple(new_bases)

    def walk(num_blocks_ref, indices_ref, carry, masked):
        return walk_listed_tiles(
            num_blocks_ref, indices_ref, (table_batch, table_head, mask_row),
            mask_block=mask_block_kv, tile=block_kv,
            visit=lambda start, carry: visit_tile(start, carry, masked), state=carry)

    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = refs.kv_tables
    carry = (jnp.zeros(q.shape, jnp.float32),
             tuple(jnp.float32(0) if plan.mode == "sum" else
                   jnp.zeros((plan.width,), jnp.float32) for plan in summed),
             tuple(jnp.int32(0) for _ in summed))
    for num_blocks_ref, indices_ref, masked in _walk_order(
            (full_kv_num_blocks, full_kv_indices), (kv_num_blocks, kv_indices), masked_first):
        carry = walk(num_blocks_ref, indices_ref, carry, masked=masked)
    d_q, sums, bases = carry
    refs.dq[rows, member, :] = (d_q * scale).astype(refs.dq.dtype)
    for slot, (total, base) in enumerate(zip(sums, bases)):
        values_ref, bases_ref = refs.partials[slot]
        values_ref[partial_slot, :] = jnp.reshape(total, (values_ref.shape[1],))
        bases_ref[partial_slot, :] = jnp.full((1,), base, jnp.int32)


def _dkdv_program(kv_tile, kv_head, batch, refs: _Refs, *, mask_program, score_program, scale,
                  q_len, kv_len, block_q, block_kv, mask_block_q, mask_block_kv,
                  broadcast_batch, broadcast_heads, group, masked_first, interpret):
    """dK and dV of one KV tile, summed over the query heads of its GQA group: for each
    of them, walks the transposed tables (the query blocks of its KV block). Summing
    here, in float32 registers, spares a [B, S, Hq, D] float32 output and its sum."""
    table_batch = 0 if broadcast_batch else batch
    mask_column = lax.div(kv_tile, jnp.int32(mask_block_kv // block_kv))
    precision = online_softmax.dot_precision(refs.q.dtype, interpret)

    rows = pl.ds(kv_tile * block_kv, block_kv)
    k = refs.k[rows, :]
    v = refs.v[rows, :]
    # Tiles are computed transposed, [block_kv, block_q]: P^T and dS^T are then the left
    # operands of dV += P^T dO and dK += dS^T Q as they come out of the dots.
    kv_idx = kv_tile * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)

    def visit_tile(q_start, state, masked, member):
        d_k, d_v = state
        q_rows = pl.ds(q_start, block_q)
        q = refs.q[q_rows, member, :]
        d_out = refs.d_out[q_rows, member, :]
        lse_log2 = refs.lse_log2[member, q_rows][None, :]
        delta = refs.delta[member, q_rows][None, :]
        q_idx = jnp.minimum(q_start + lax.broadcasted_iota(jnp.int32, (1, block_q), 1),
                            q_len - 1)
        probabilities_t, score_vjp, _ = tile_probabilities(
            q, k, lse_log2, q_idx=q_idx, kv_idx=kv_idx, batch=batch,
            head=kv_head * group + member, masked=masked, mask_program=mask_program,
            mask_refs=refs.mask, score_program=score_program, score_refs=refs.score,
            scale=scale, q_len=q_len, kv_len=kv_len, mask_block_kv=mask_block_kv,
            precision=precision, transposed=True,
            frame=TileFrame(q_start, kv_tile * block_kv, block_q, block_kv, transposed=True))
        d_scores_t, _ = tile_score_gradients(probabilities_t, v, d_out, delta, score_vjp,
                                              precision=precision, transposed=True)
        # dV's dot issued here, next to dK's, rather than before dP's as PyTorch orders
        # them: that was 2-3 % slower on the H100 (noop 3.67 vs 3.60 ms).
        d_v = d_v + lax.dot_general(probabilities_t.astype(d_out.dtype), d_out,
                                    (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32, precision=precision)
        d_k = d_k + lax.dot_general(d_scores_t.astype(q.dtype), q, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32, precision=precision)
        return d_k, d_v

    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices = refs.q_tables

    def walk_member(member, state):
        table_head = 0 if broadcast_heads else kv_head * group + member
        for num_blocks_ref, indices_ref, masked in _walk_order(
                (full_q_num_blocks, full_q_indices), (q_num_blocks, q_indices), masked_first):
            state = walk_listed_tiles(
                num_blocks_ref, indices_ref, (table_batch, table_head, mask_column),
                mask_block=mask_block_q, tile=block_q,
                visit=functools.partial(visit_tile, masked=masked, member=member),
                state=state)
        return state

    state = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    if group == 1:
        state = walk_member(0, state)
    else:
        state = lax.fori_loop(0, group, walk_member, state)
    refs.dk[rows, :] = (state[0] * scale).astype(refs.dk.dtype)
    refs.dv[rows, :] = state[1].astype(refs.dv.dtype)


def _backward_kernel(*refs, num_kv_tiles, num_q_tiles, group, first_program, unpack,
                     dq_settings, dkdv_settings):
    """Grid (program, KV head, batch). Programs [0, num_kv_tiles) of the whole launch own
    a KV tile (dK/dV); the next num_q_tiles * group own a (query tile, query head of the
    group) pair (dQ), longest causal rows first and the group's heads side by side (they
    read the same K/V). A launch covers programs [first_program, first_program + grid
    size); `unpack` maps the flat refs to a `_Refs`."""
    refs = unpack(refs)
    # Program ids are read here, outside the branches: interpret mode substitutes them
    # in the kernel body only.
    program = pl.program_id(0) + first_program
    kv_head, batch = pl.program_id(1), pl.program_id(2)
    if dkdv_settings is not None:
        pl.when(program < num_kv_tiles)(
            lambda: _dkdv_program(program, kv_head, batch, refs, **dkdv_settings))
    if dq_settings is not None:
        dq_program = program - num_kv_tiles
        q_tile = num_q_tiles - 1 - lax.div(dq_program, jnp.int32(group))
        member = lax.rem(dq_program, jnp.int32(group))
        # This dQ program's row of the partial-sum buffers.
        partial_slot = dq_program + (num_q_tiles * group) * (kv_head
                                                             + pl.num_programs(1) * batch)
        pl.when(program >= num_kv_tiles)(
            lambda: _dq_program(q_tile, member, kv_head, batch, refs,
                                partial_slot=partial_slot, **dq_settings))


def _site_plans(score_program, wanted=None, deterministic=False, batch=1,
                batch_sum="atomic") -> tuple:
    """A SitePlan per read of a captured array that needs a gradient: reads of floating
    captured arrays that are differentiated (`wanted`: one bool per captured array, None
    = all). Large tables read per element are "atomic", or "batch_loop" (summed over the
    batch by `batch_loop_gradients`) as `batch_sum` (KernelOptions.backward_batch_sum)
    says, for `batch` rows."""
    if score_program is None:
        return ()
    positions = captured_read_positions(score_program)
    varying_axes = captured_read_varying_axes(score_program)
    batch_axes = None  # traced only if a table is large
    wanted = wanted if wanted is not None else [True] * len(score_program.consts)
    plans = []
    for site, (position, varying) in enumerate(zip(positions, varying_axes)):
        array = score_program.consts[position]
        if not (jnp.issubdtype(array.dtype, jnp.floating) and wanted[position]):
            continue
        shape = tuple(jnp.shape(array)) or (1,)
        varying = tuple(varying) or (False,)
        if not any(varying):
            plans.append(SitePlan(site, position, "sum", varying, shape))
            continue
        entries = int(np.prod([size for size, v in zip(shape, varying) if v]))
        if entries <= DETERMINISTIC_MAX_ENTRIES:
            plans.append(SitePlan(site, position, "one_hot", varying, shape, entries,
                                   max(1, 1 << (entries - 1).bit_length())))
        elif not deterministic:
            if batch_axes is None:
                batch_axes = captured_read_batch_axes(score_program)
            plans.append(SitePlan(site, position, _large_table_mode(
                shape, varying, batch_axes[site] or (False,), batch, batch_sum),
                varying, shape))
        else:
            raise ValueError(
                f"kernel_options['backward_deterministic'] is True, but score_mod "
                f"{score_program.name!r} reads its captured array #{position} (shape "
                f"{shape}) at a per-element index reaching {entries} entries, more than "
                f"the {DETERMINISTIC_MAX_ENTRIES} a deterministic gradient handles (those "
                "are scatter-added with atomics); leave backward_deterministic off")
    return tuple(plans)


def batch_loop_positions(score_program, wanted, batch: int,
                         deterministic: bool = False) -> tuple:
    """The positions of the score_mod's captured arrays whose gradients (`wanted`: one
    bool per captured array, None for all) the batch loop sums under
    KernelOptions.backward_batch_sum "loop", every read of them a "batch_loop" site
    (`_site_plans`, `batch_loop_gradients`) for `batch` rows: the Mosaic GPU backward
    hands these to `batch_loop_only`."""
    if score_program is None:
        return ()
    plans = _site_plans(score_program, wanted, deterministic, batch=batch,
                        batch_sum="loop")
    looped = {plan.position for plan in plans if plan.mode == "batch_loop"}
    return tuple(sorted(position for position in looped
                        if all(plan.mode == "batch_loop" for plan in plans
                               if plan.position == position)))


def batch_loop_only(q, k, v, out, lse, d_out, d_lse, block_mask, score_program, *,
                    scale: float, options: KernelOptions, interpret: bool, positions):
    """{position: float32 flat gradient} of the captured arrays at `positions`
    (`batch_loop_positions`) from the batch loop alone, on the Triton backward's padded
    operands: the Mosaic GPU backward's companion for a pair bias's gradient."""
    launch = prepare_operands(q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                              scale)
    wanted = [position in positions for position in range(len(score_program.consts))]
    plans = tuple(plan for plan in _site_plans(
        score_program, wanted, batch=q.shape[0], batch_sum="loop")
        if plan.mode == "batch_loop")
    return batch_loop_gradients(launch, plans, options=options, interpret=interpret)


def _large_table_mode(shape, varying, batch_dependent, batch, batch_sum) -> str:
    """"atomic" or "batch_loop" for a large table read per element (see
    KernelOptions.backward_batch_sum). The batch loop sums the tiles of consecutive rows
    elementwise, so the per-element indices must not depend on b; the rows sharing an
    entry are estimated as the batch over the table's extent along the other axes b
    indexes (a pair bias [B, H, S, S] read at b // rows: rows)."""
    if batch_sum == "atomic" or any(v and d for v, d in zip(varying, batch_dependent)):
        return "atomic"
    if batch_sum == "loop":
        return "batch_loop"
    reached = int(np.prod([size for size, v, d in zip(shape, varying, batch_dependent)
                           if d and not v]))
    sharing = batch // max(1, min(batch, reached))
    return "batch_loop" if sharing >= BATCH_LOOP_MIN_SHARING else "atomic"


def _reduce_partials(plan: SitePlan, values, bases, size: int):
    """The flat [size] gradient from per-program partial rows: values [P, width] at flat
    indices bases [P, 1] + plan.offsets. A fixed-order sum (a compare-and-select reduce,
    no scatter: XLA's scatter-add on the GPU uses atomics)."""
    flat = (bases + jnp.asarray(plan.offsets, jnp.int32)[None, :]).reshape(-1)
    values = values.reshape(-1)
    if plan.width != plan.entries:  # padded slots hold zeros
        keep = np.tile(np.arange(plan.width) < plan.entries, values.shape[0] // plan.width)
        values = jnp.where(jnp.asarray(keep), values, 0.0)
    return fixed_order_scatter_sum(flat, values, size)


def fixed_order_scatter_sum(flat, values, size: int):
    """[size] with values [N] summed at flat indices [N]: a compare-and-select reduce in
    a fixed order, no scatter (XLA's scatter-add on the GPU uses atomics, whose order,
    and so whose last bits, vary from run to run)."""
    return jnp.sum(jnp.where(flat[:, None] == jnp.arange(size, dtype=jnp.int32)[None, :],
                             values[:, None], 0.0), axis=0)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """The backward's padded operands and the static settings of both program kinds."""
    q: jax.Array          # [B, Sq_padded, Hq, D_padded]
    k: jax.Array          # [B, Skv_padded, Hkv, D_padded]
    v: jax.Array          # [B, Skv_padded, Hkv, Dv_padded]
    d_out: jax.Array      # [B, Sq_padded, Hq, Dv_padded], q's dtype
    lse_log2: jax.Array   # [B, Hq, Sq_padded], +inf on rows with no probability mass
    delta: jax.Array      # [B, Hq, Sq_padded]
    block_mask: object
    score_program: object
    kernel_settings: dict  # keyword arguments of _dq_program and _dkdv_program


def prepare_operands(q, k, v, out, lse, d_out, d_lse, block_mask, score_program, scale,
                     pad_head_dims=True):
    """The padded operands, delta and lse_log2 of a backward (`_Launch`); the Mosaic GPU
    backward starts from them too, with its head dims as they are (pad_head_dims=False:
    Triton's tiles take powers of two, wgmma takes 80 and 96)."""
    num_q_blocks, num_kv_blocks = block_mask.num_blocks
    mask_block_q, mask_block_kv = block_mask.block_size
    # delta = rowsum(dO * O) - dlse: the lse output's own gradient folds in here.
    # An elementwise product summed over D in the arrays' own layout (one fused read of
    # dO and O), then the small [B, S, H] result transposed: as an einsum this lowered
    # to a batched dot_general over transposed float32 copies of both.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=3)
    delta = jnp.transpose(delta, (0, 2, 1))
    if d_lse is not None:
        delta = delta - d_lse
    # Rows with lse = -inf (nothing attended) and padded rows get +inf: P = exp2(s - inf) = 0.
    lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * online_softmax.LOG2_E)

    head_dim, value_dim = q.shape[3], v.shape[3]
    padded_dim, padded_value_dim = ((padded_head_dim(head_dim), padded_head_dim(value_dim))
                                    if pad_head_dims else (head_dim, value_dim))
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


# Without GQA, one launch for both program kinds (as PyTorch's FlexAttention backward
# does): the last wave of one kind overlaps the other's, and one launch has one tail
# (H100, B4 H16 S4096 D128 noop: 3.60 ms, two launches 3.65). With GQA, two: a dK/dV
# program sums `group` heads and runs that many times longer than a dQ program, and in
# one launch those started last leave SMs idle at the end (32:8 heads: 8.08 ms in one
# launch, 7.13 in two).


def _launch_parameters(warps: int, stages: int, owned_rows: int):
    """(num_warps, num_stages) for programs that own `owned_rows`-row tiles. 8 warps
    split a tile's rows into two 64-row warpgroups; on 64 rows they split its columns
    instead, which ran 2x slower on the H100, and 64-row tiles with 3 stages leave room
    for one program per SM instead of two (f908cd9:benchmarks/results/*backward-tuning*.json)."""
    if owned_rows < 128:
        return min(warps, 4), min(stages, 2)
    return warps, stages


def _fit_to_shared_memory(options: KernelOptions, launch: _Launch, site_plans):
    """options with the backward's tiles and stages fitted to the shared-memory budget,
    counting the scratch of captured arrays read (and differentiated) per element."""
    block_mask, score_program = launch.block_mask, launch.score_program
    differentiated = {plan.position for plan in site_plans
                      if plan.mode in ("one_hot", "atomic")}
    reads = shared_memory.mod_reads(block_mask.mask_mod, score_program, differentiated)
    estimate = functools.partial(
        shared_memory.backward_options_bytes, dtype=launch.q.dtype,
        head_dim=launch.q.shape[3], value_dim=launch.v.shape[3],
        mask_block=block_mask.block_size, reads=reads)
    return shared_memory.fit(options, estimate, planned_shared_memory(options),
                             kernel="backward", inputs=f"{launch.q.dtype} inputs at a head "
                             f"dim padded to {launch.q.shape[3]}")


def _backward_launches(launch: _Launch, *, options: KernelOptions, interpret: bool,
                       wanted_const_grads=None):
    """(dQ [B, Sq_padded, Hq, D_padded], {position among the score_mod's captured
    arrays: float32 flat gradient}, dK [B, Skv_padded, Hkv, D_padded], dV [..., Dv_padded])."""
    q, k, v, d_out = launch.q, launch.k, launch.v, launch.d_out
    batch, padded_q_len, q_heads, padded_dim = q.shape
    padded_kv_len, kv_heads, padded_value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    block_mask, score_program = launch.block_mask, launch.score_program
    site_plans = _site_plans(score_program, wanted_const_grads,
                             deterministic=options.backward_deterministic, batch=batch,
                             batch_sum=options.backward_batch_sum)
    # Sites summed over the batch by a launch of their own: the dQ programs skip them.
    loop_plans = tuple(plan for plan in site_plans if plan.mode == "batch_loop")
    site_plans = tuple(plan for plan in site_plans if plan.mode != "batch_loop")
    loop_grads = (batch_loop_gradients(launch, loop_plans, options=options,
                                        interpret=interpret) if loop_plans else {})
    options = _fit_to_shared_memory(options, launch, site_plans)
    mask_block_q, mask_block_kv = block_mask.block_size
    dq_block_q = min(options.backward_block_q, mask_block_q)
    dq_block_kv = min(options.backward_block_kv, mask_block_kv)
    dkdv_block_q = min(options.backward_dkdv_block_q, mask_block_q)
    dkdv_block_kv = min(options.backward_dkdv_block_kv, mask_block_kv)
    num_q_tiles, num_kv_tiles = padded_q_len // dq_block_q, padded_kv_len // dkdv_block_kv

    # Arrays the mods read as blocks reach every tile (edge-padded where they do not).
    mask_inputs = padded_for_blocks(block_mask.mask_mod, padded_q_len, padded_kv_len)
    score_inputs = padded_for_blocks(score_program, padded_q_len, padded_kv_len)
    atomic_positions = tuple(sorted({plan.position for plan in site_plans
                                     if plan.mode == "atomic"}))
    summed_plans = [plan for plan in site_plans if plan.mode != "atomic"]
    # Gradient buffers of the atomically accumulated arrays, zero-initialised through
    # input/output aliasing (kernel outputs start uninitialised).
    grad_buffers = [jnp.zeros(score_inputs[position].shape, jnp.float32)
                    for position in atomic_positions]
    # Partial sums: every dQ program writes its own row, so no initialisation.
    num_dq_programs = num_q_tiles * group * kv_heads * batch
    partial_shapes = []
    for plan in summed_plans:
        partial_shapes += [jax.ShapeDtypeStruct((num_dq_programs, plan.width), jnp.float32),
                           jax.ShapeDtypeStruct((num_dq_programs, 1), jnp.int32)]

    # Grid (program, KV head, batch): a program sees its KV head's K/V and the query
    # rows of the heads of its group.
    def kv_head_spec(length, dim):
        return pl.BlockSpec((None, length, None, dim), lambda i, h, b: (b, 0, h, 0))

    def group_spec(length, dim):
        return pl.BlockSpec((None, length, group, dim), lambda i, h, b: (b, 0, h, 0))

    vector_spec = pl.BlockSpec((None, group, padded_q_len), lambda i, h, b: (b, h, 0))
    whole = pl.no_block_spec
    inputs = (q, k, v, d_out, launch.lse_log2, launch.delta,
              block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
              block_mask.full_q_num_blocks, block_mask.full_q_indices,
              *mask_inputs, *score_inputs)
    in_specs = [group_spec(padded_q_len, padded_dim), kv_head_spec(padded_kv_len, padded_dim),
                kv_head_spec(padded_kv_len, padded_value_dim),
                group_spec(padded_q_len, padded_value_dim), vector_spec, vector_spec
                ] + [whole] * (8 + len(mask_inputs) + len(score_inputs))
    # Which blocks of a row both program kinds walk first is a tuning choice
    # (KernelOptions.backward_masked_first, by head dim in kernels/config.py).
    settings = dict(launch.kernel_settings, group=group,
                    masked_first=options.backward_masked_first, interpret=interpret)
    dq_settings = dict(settings, block_q=dq_block_q, block_kv=dq_block_kv,
                       site_plans=site_plans)
    dkdv_settings = dict(settings, block_q=dkdv_block_q, block_kv=dkdv_block_kv)

    def run(first_program, num_programs, with_dq, with_dkdv, warps, stages, name):
        out_shape, out_specs = [], []
        if with_dq:
            out_shape.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
            out_specs.append(group_spec(padded_q_len, padded_dim))
        if with_dkdv:
            out_shape += [jax.ShapeDtypeStruct(k.shape, k.dtype),
                          jax.ShapeDtypeStruct(v.shape, v.dtype)]
            out_specs += [kv_head_spec(padded_kv_len, padded_dim),
                          kv_head_spec(padded_kv_len, padded_value_dim)]
        buffers = grad_buffers if with_dq else []
        partials = partial_shapes if with_dq else []
        num_outputs_before_buffers = len(out_shape)
        out_shape += [jax.ShapeDtypeStruct(b.shape, jnp.float32) for b in buffers] + partials
        out_specs += [whole] * (len(buffers) + len(partials))

        def unpack(refs):
            (q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref), rest = refs[:6], refs[6:]
            kv_tables, q_tables, rest = rest[:4], rest[4:8], rest[8:]
            mask_refs, score_refs, rest = split_captured_refs(rest, block_mask.mask_mod,
                                                              score_program)
            outputs = rest[len(buffers):]  # skip the aliased input buffers
            dq_ref = outputs[0] if with_dq else None
            dk_ref, dv_ref = outputs[int(with_dq):int(with_dq) + 2] if with_dkdv else (None,
                                                                                       None)
            grads = [None] * len(score_inputs)
            for slot, position in enumerate(atomic_positions if with_dq else ()):
                grads[position] = outputs[num_outputs_before_buffers + slot]
            partial_refs = outputs[num_outputs_before_buffers + len(buffers):]
            return _Refs(q=q_ref, k=k_ref, v=v_ref, d_out=d_out_ref, lse_log2=lse_ref,
                         delta=delta_ref, kv_tables=kv_tables, q_tables=q_tables,
                         mask=mask_refs, score=score_refs, dq=dq_ref, dk=dk_ref, dv=dv_ref,
                         grads=grads, partials=[partial_refs[i:i + 2] for i in
                                                range(0, len(partial_refs), 2)])

        kernel = functools.partial(
            _backward_kernel, num_kv_tiles=num_kv_tiles, num_q_tiles=num_q_tiles,
            group=group, first_program=first_program, unpack=unpack,
            dq_settings=dq_settings if with_dq else None,
            dkdv_settings=dkdv_settings if with_dkdv else None)
        first_buffer = len(inputs)
        return pl.pallas_call(
            kernel,
            grid=(num_programs, kv_heads, batch),
            in_specs=in_specs + [whole] * len(buffers),
            out_specs=out_specs,
            out_shape=sharding.typed_like(out_shape, inputs, buffers),
            input_output_aliases={first_buffer + slot: num_outputs_before_buffers + slot
                                  for slot in range(len(buffers))},
            compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
            interpret=interpret,
            name=name,
        )(*inputs, *buffers)

    def gradients(outputs):
        """{position: flat float32 gradient} from the atomic buffers, partial sums and
        the batch loop's buffers."""
        buffers, partials = outputs[:len(grad_buffers)], outputs[len(grad_buffers):]
        grads = dict(loop_grads)
        for position, buffer in zip(atomic_positions, buffers):
            # (a padded copy's buffer for arrays read as blocks: folded back)
            buffer = unpadded_gradient(buffer, jnp.shape(score_program.consts[position])
                                       ).reshape(-1)
            grads[position] = grads[position] + buffer if position in grads else buffer
        for plan, values, bases in zip(summed_plans, partials[0::2], partials[1::2]):
            size = int(np.prod(plan.table_shape))
            total = _reduce_partials(plan, values, bases, size)
            grads[plan.position] = grads[plan.position] + total if plan.position in grads \
                else total
        return grads

    if group == 1:
        warps, stages = _launch_parameters(options.backward_num_warps,
                                           options.backward_num_stages,
                                           min(dq_block_q, dkdv_block_kv))
        d_q, d_k, d_v, *outputs = run(0, num_kv_tiles + num_q_tiles, True, True, warps,
                                      stages, "flex_attention_backward")
        return d_q, gradients(outputs), d_k, d_v
    d_k, d_v = run(0, num_kv_tiles, False, True, *_launch_parameters(
        options.backward_dkdv_num_warps or options.backward_num_warps,
        options.backward_dkdv_num_stages or options.backward_num_stages, dkdv_block_kv),
        "flex_attention_backward_dkdv")
    d_q, *outputs = run(num_kv_tiles, num_q_tiles * group, True, False, *_launch_parameters(
        options.backward_num_warps, options.backward_num_stages, dq_block_q),
        "flex_attention_backward_dq")
    return d_q, gradients(outputs), d_k, d_v


def flex_attention_backward(q, k, v, out, lse, d_out, d_lse, block_mask, score_program, *,
                            scale: float, options: KernelOptions, interpret: bool,
                            wanted_const_grads=None):
    """Gradients (dq, dk, dv, d_score_consts) of FlexAttention.

    d_score_consts has one entry per captured array of `score_program`: None for arrays
    that are not floating point or not in `wanted_const_grads` (one bool per captured
    array; None = all), which get no gradient. `out` is best given unrounded (float32)
    when captured arrays are differentiated: their gradients sum dS over whole rows,
    and delta = rowsum(dO * out) from a rounded `out` leaves each row's dS summing to
    the rounding error instead of 0, which sums over positions in the thousands for an
    ALiBi slope (see `pallas_flex.api`).
    """
    q_len, head_dim = q.shape[1], q.shape[3]
    kv_len, value_dim = k.shape[1], v.shape[3]
    launch = prepare_operands(q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                              scale)
    d_q, grads, d_k, d_v = _backward_launches(launch, options=options, interpret=interpret,
                                              wanted_const_grads=wanted_const_grads)
    d_q = d_q[:, :q_len, :, :head_dim]
    d_k = d_k[:, :kv_len, :, :head_dim]
    d_v = d_v[:, :kv_len, :, :value_dim]
    const_grads = [None] * len(captured_inputs(score_program))
    for position, gradient in grads.items():
        original = score_program.consts[position]
        const_grads[position] = gradient.reshape(jnp.shape(original)).astype(original.dtype)
    return d_q, d_k, d_v, const_grads
