"""The Triton backward's batch-loop launch (KernelOptions.backward_batch_sum "loop"):
gradients of large captured tables whose entries many batch rows share (issue 21's
Evoformer pair bias [B, H, S, S] read at b // rows by 256 folded MSA rows, a bias
[H, S, S] shared by the batch). Scatter-added from the dQ programs of every row, their
atomics would all hit the same addresses; here a program owns one table tile and walks a
run of rows, recomputing their P and dS on it (`backward_tiles`) and summing in
registers: one scatter-add per program and change of entry. `backward.py` runs it beside
its dQ and dK/dV programs, which then skip those reads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flex import sharding
from pallas_flex.kernels import online_softmax, shared_memory
from pallas_flex.kernels.backward_tiles import (
    SitePlan, flat_index, scatter_add, tile_probabilities, tile_score_gradients)
from pallas_flex.kernels.block_walk import loop_value
from pallas_flex.kernels.config import (
    BATCH_LOOP_TARGET_PROGRAMS, KernelOptions, planned_shared_memory)
from pallas_flex.kernels.tile_mods import (
    CaptureLog, TileFrame, apply_mask_on_tile, captured_read_blocks, captured_read_sites,
    padded_for_blocks, score_vjp_on_tile, split_captured_refs, unpadded_gradient)


def _batch_loop_kernel(q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, state_ref, *refs,
                       plans, site_shapes, positions, mask_program, score_program, scale,
                       q_len, kv_len, block_q, block_kv, mask_block_q, mask_block_kv,
                       num_kv_tiles, group, batch, rows_per_program, broadcast_batch,
                       broadcast_heads, interpret, block_positions=frozenset()):
    """Grid (tile, query head, row chunk): the program owns the [block_q, block_kv] tile
    `tile` of one query head and walks the rows [chunk * rows_per_program, ...) in order,
    recomputing each row's P and dS on the tile (as a dQ program does) and summing the
    cotangents of the `plans` sites elementwise in registers. While the table entries
    the tile reaches stay the same from row to row (the flat index of the axes the site
    does not vary along: b // rows, h), the sum goes on; it is scatter-added into the
    site's float32 buffer when they change and after the last row. The buffers of the
    positions in `block_positions` have the table's shape, and their sites (all reads at
    exactly q_idx / kv_idx, `tile_mods.block_reads`) add the tile as one block; the
    others are flat, added per element."""
    mask_refs, score_refs, rest = split_captured_refs(refs, mask_program, score_program)
    buffers = dict(zip(positions, rest[len(positions):]))  # after the aliased inputs
    tile, head, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_tile, kv_tile = lax.div(tile, jnp.int32(num_kv_tiles)), lax.rem(
        tile, jnp.int32(num_kv_tiles))
    q_start, kv_start = q_tile * block_q, kv_tile * block_kv
    q_block = lax.div(q_start, jnp.int32(mask_block_q))
    kv_block = lax.div(kv_start, jnp.int32(mask_block_kv))
    table_head = 0 if broadcast_heads else head
    kv_head = lax.div(head, jnp.int32(group))
    precision = online_softmax.dot_precision(q_ref.dtype, interpret)
    q_idx = jnp.minimum(q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0), q_len - 1)
    kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    first = chunk * rows_per_program
    last = jnp.minimum(first + rows_per_program, batch)
    q_rows, kv_rows = pl.ds(q_start, block_q), pl.ds(kv_start, block_kv)
    kv_idx_in_range = jnp.minimum(kv_idx, kv_len - 1)  # as tile_probabilities clamps
    indices_below = max(q_len, kv_len)

    def row_inputs(b):
        """What row b reads besides its q, k, v and dO tiles (which Triton's pipeliner
        copies a row ahead): its lse and delta, its block state and the blocks of the
        mods' reads at exactly q_idx / kv_idx (a pair bias at b // rows). The loop loads
        them one row ahead, their latency behind a row's work (H200, Evoformer R256 S256
        H8 fwd+bwd, against loading them in the row: D32 -0.9 %, D64 -2.6 %). The blocks
        come from a run of the mods on a tile of zeros whose values are dropped (the
        compiler removes its arithmetic), recording each block read's load in the order
        the row's own run of the mods asks for them."""
        blocks = []

        def record(ref, read):
            blocks.append(ref[read.index()])
            return blocks[-1]

        frame = TileFrame(q_start, kv_start, block_q, block_kv, load=record)
        if score_program is not None:
            score_vjp_on_tile(score_program, score_refs, jnp.zeros((block_q, block_kv),
                                                                   jnp.float32),
                              b, head, q_idx, kv_idx_in_range, indices_below=indices_below,
                              frame=frame)
        apply_mask_on_tile(mask_program, mask_refs, b, head, q_idx, kv_idx_in_range,
                           indices_below=indices_below, frame=frame)
        return (lse_ref[b, head, q_rows][:, None], delta_ref[b, head, q_rows][:, None],
                state_ref[0 if broadcast_batch else b, table_head, q_block, kv_block],
                tuple(blocks))

    def row(b, carry):
        sums, bases, (lse_log2, delta, block_state, blocks) = carry
        ahead = row_inputs(jnp.minimum(b + 1, last - 1))
        q = q_ref[b, q_rows, head, :]
        d_out = d_out_ref[b, q_rows, head, :]
        k = k_ref[b, kv_rows, kv_head, :]
        v = v_ref[b, kv_rows, kv_head, :]
        loaded = iter(blocks)
        log = CaptureLog()
        probabilities, score_vjp, _ = tile_probabilities(
            q, k, lse_log2, q_idx=q_idx, kv_idx=kv_idx, batch=b, head=head, masked=True,
            mask_program=mask_program, mask_refs=mask_refs, score_program=score_program,
            score_refs=score_refs, scale=scale, q_len=q_len, kv_len=kv_len,
            mask_block_kv=mask_block_kv, precision=precision, block_state=block_state,
            capture_log=log, frame=TileFrame(q_start, kv_start, block_q, block_kv,
                                             load=lambda ref, read: next(loaded)))
        _, cotangents = tile_score_gradients(probabilities, v, d_out, delta, score_vjp,
                                              precision=precision)
        new_sums, new_bases = [], []
        for plan, shape, total, previous in zip(plans, site_shapes, sums, bases):
            indices = log.unbroadcast[plan.site]
            fixed = [axis for axis, varies in enumerate(plan.varying) if not varies]
            base = flat_index(indices, plan.table_shape, fixed)
            cotangent = jnp.broadcast_to(cotangents[plan.site].astype(jnp.float32), shape)
            buffer = buffers[plan.position]
            changed = (b > first) & (base != previous)
            if plan.position in block_positions:
                block = log.blocks[plan.site]

                def flush(total, lead=None, buffer=buffer, block=block):
                    block.scatter_add(buffer, total, lead=lead)
                flush_previous = functools.partial(
                    flush, lead=_unflat_index(previous, plan.table_shape, fixed))
                flush_current = flush
            else:
                offsets = jnp.broadcast_to(_flat_offsets(indices, plan), shape)

                def flush(total, target, buffer=buffer):
                    scatter_add(buffer, (target,), total, interpret)
                flush_previous = functools.partial(flush, target=previous + offsets)
                flush_current = functools.partial(flush, target=base + offsets)

            @pl.when(changed)
            def _(flush_previous=flush_previous, total=total):
                flush_previous(total)

            total = jnp.where(changed, 0.0, total) + cotangent

            @pl.when(b == last - 1)
            def _(flush_current=flush_current, total=total):
                flush_current(total)

            new_sums.append(total)
            new_bases.append(loop_value(base, b))
        return tuple(new_sums), tuple(new_bases), ahead

    carry = (tuple(jnp.zeros(shape, jnp.float32) for shape in site_shapes),
             tuple(jnp.int32(0) for _ in plans), row_inputs(first))
    lax.fori_loop(first, last, row, carry)


def _unflat_index(flat, shape, axes):
    """The indices on `axes` of the flat offset `flat` (`flat_index`'s inverse; None on
    the other axes)."""
    strides = np.cumprod((1,) + tuple(shape[::-1][:-1]))[::-1]
    indices = [None] * len(shape)
    for axis in axes:
        indices[axis] = lax.rem(lax.div(flat, jnp.int32(strides[axis])), jnp.int32(shape[axis]))
    return tuple(indices)


def _flat_offsets(indices, plan: SitePlan):
    """The flat offset of a read's indices along the axes it varies on (a tile)."""
    strides = np.cumprod((1,) + tuple(plan.table_shape[::-1][:-1]))[::-1]
    offsets = jnp.int32(0)
    for axis, varies in enumerate(plan.varying):
        if varies:
            offsets = offsets + indices[axis].astype(jnp.int32) * jnp.int32(strides[axis])
    return offsets


def _batch_loop_bytes(dtype, head_dim, value_dim, block_q, block_kv, num_stages, reads):
    """Shared memory of a batch-loop program: every operand tile is streamed (q and dO
    [block_q, D / Dv], K and V [block_kv, D / Dv]), plus the layout-conversion scratch of
    per-element reads and scatter-adds (kernels/shared_memory.py)."""
    size = jnp.dtype(dtype).itemsize
    copies = 2 if jnp.dtype(dtype) == jnp.float32 else 1
    streamed = (block_q + block_kv) * (head_dim + value_dim) * size * copies
    scratch = 4 * block_q * block_kv * (2 * reads.tile_reads + reads.tile_gradients)
    return max(num_stages, 1) * streamed + scratch + 1024


def _fit_batch_loop(options: KernelOptions, launch, differentiated):
    """(block_q, block_kv, num_stages) of the batch-loop launch within the shared-memory
    budget: stages down to 1, then the tiles down to 16 rows, fields the user gave kept
    (a ValueError if they cannot fit)."""
    block_mask = launch.block_mask
    reads = shared_memory.mod_reads(block_mask.mask_mod, launch.score_program,
                                    differentiated)
    settings = {"backward_batch_block_q": min(options.backward_batch_block_q,
                                              block_mask.block_size[0]),
                "backward_batch_block_kv": min(options.backward_batch_block_kv,
                                               block_mask.block_size[1]),
                "backward_batch_num_stages": options.backward_batch_num_stages}

    def estimate():
        return _batch_loop_bytes(launch.q.dtype, launch.q.shape[3], launch.v.shape[3],
                                 settings["backward_batch_block_q"],
                                 settings["backward_batch_block_kv"],
                                 settings["backward_batch_num_stages"], reads)

    budget = planned_shared_memory(options)
    steps = (("backward_batch_num_stages", 1), ("backward_batch_block_kv", 16),
             ("backward_batch_block_q", 16))
    while estimate() > budget:
        for field, floor in steps:
            if field not in options.given and settings[field] > floor:
                settings[field] = (settings[field] - 1 if field.endswith("stages")
                                   else settings[field] // 2)
                break
        else:
            raise ValueError(
                f"the backward's batch-loop launch needs about {estimate() // 1024} KiB of "
                f"shared memory with {settings}, more than the {budget // 1024} KiB this "
                "GPU has: give smaller backward_batch_* tiles, or backward_batch_sum "
                "'atomic'")
    return (settings["backward_batch_block_q"], settings["backward_batch_block_kv"],
            settings["backward_batch_num_stages"])


def batch_loop_gradients(launch, plans, *, options: KernelOptions, interpret: bool):
    """{position among the score_mod's captured arrays: float32 flat gradient} of the
    "batch_loop" sites `plans` (see `_batch_loop_kernel`): one launch for all of them,
    apart from the dQ and dK/dV programs, which then skip those sites."""
    q, k, v, d_out = launch.q, launch.k, launch.v, launch.d_out
    batch, padded_q_len, q_heads, _ = q.shape
    padded_kv_len, kv_heads = k.shape[1], k.shape[2]
    block_mask, score_program = launch.block_mask, launch.score_program
    block_q, block_kv, num_stages = _fit_batch_loop(
        options, launch, {plan.position for plan in plans})
    num_q_tiles, num_kv_tiles = padded_q_len // block_q, padded_kv_len // block_kv
    tiles = num_q_tiles * num_kv_tiles
    rows = options.backward_batch_rows
    if not rows:
        chunks = max(1, -(-BATCH_LOOP_TARGET_PROGRAMS // (tiles * q_heads)))
        rows = -(-batch // chunks)
    rows = min(rows, batch)
    num_chunks = -(-batch // rows)

    # Each site's cotangent tile: the dummy tile's [4, 8] axes are the kernel's
    # [block_q, block_kv] (a read varying along the keys only has [1, block_kv]).
    dummy_sites = captured_read_sites(score_program)
    site_shapes = []
    for plan in plans:
        shape = np.broadcast_shapes(*(jnp.shape(i) for i in dummy_sites[plan.site][1]))
        site_shapes.append(tuple({4: block_q, 8: block_kv}.get(size, size) for size in shape))
    # Arrays the mods read as blocks reach every tile (edge-padded where they do not).
    score_inputs = padded_for_blocks(score_program, padded_q_len, padded_kv_len)
    mask_inputs = padded_for_blocks(block_mask.mask_mod, padded_q_len, padded_kv_len)
    positions = tuple(sorted({plan.position for plan in plans}))
    # Tables all of whose sites here are reads at exactly q_idx / kv_idx take their
    # tiles' sums as blocks, into a buffer of the (padded) table's shape; the others flat.
    blocks = captured_read_blocks(score_program)
    block_positions = frozenset(
        position for position in positions
        if all(blocks[plan.site] is not None for plan in plans if plan.position == position))
    buffers = [jnp.zeros(score_inputs[position].shape if position in block_positions
                         else int(np.prod(jnp.shape(score_program.consts[position]))),
                         jnp.float32)
               for position in positions]
    state = block_mask.block_state().astype(jnp.int32)
    inputs = (q, k, v, d_out, launch.lse_log2, launch.delta, state, *mask_inputs,
              *score_inputs)
    settings = launch.kernel_settings
    kernel = functools.partial(
        _batch_loop_kernel, plans=plans, site_shapes=site_shapes, positions=positions,
        mask_program=settings["mask_program"], score_program=score_program,
        scale=settings["scale"], q_len=settings["q_len"], kv_len=settings["kv_len"],
        block_q=block_q, block_kv=block_kv, mask_block_q=settings["mask_block_q"],
        mask_block_kv=settings["mask_block_kv"], num_kv_tiles=num_kv_tiles,
        group=q_heads // kv_heads, batch=batch, rows_per_program=rows,
        broadcast_batch=state.shape[0] == 1, broadcast_heads=state.shape[1] == 1,
        interpret=interpret, block_positions=block_positions)
    whole = pl.no_block_spec
    outputs = pl.pallas_call(
        kernel,
        # Tiles fastest: programs running together share a head's rows in L2.
        grid=(tiles, q_heads, num_chunks),
        in_specs=[whole] * (len(inputs) + len(buffers)),
        out_specs=[whole] * len(buffers),
        out_shape=sharding.typed_like(
            [jax.ShapeDtypeStruct(b.shape, jnp.float32) for b in buffers], inputs, buffers),
        input_output_aliases={len(inputs) + slot: slot for slot in range(len(buffers))},
        compiler_params=plgpu.CompilerParams(num_warps=options.backward_batch_num_warps,
                                             num_stages=num_stages),
        interpret=interpret,
        name="flex_attention_backward_batch_loop",
    )(*inputs, *buffers)
    return {position: unpadded_gradient(output, jnp.shape(score_program.consts[position])
                                        if position in block_positions else output.shape
                                        ).reshape(-1)
            for position, output in zip(positions, outputs)}
