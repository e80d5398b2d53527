"""Latent-attention (MLA) decode that reads the values from the key tiles (Hopper).

DeepSeek caches one latent per token whose first Dv columns are the values
(`flex_attention(q, latent, None, value_dim=Dv)`, a latent `PagedKVCache`). The kernel in
`decode_latent_mosaic.py` loads a key tile and a value tile of 32 keys from it and
splits q·kᵀ's columns between its two compute warpgroups, which add their partial
scores through shared memory, rescale and run p·v in lockstep on every tile. Here,
after FlashMLA's layout, one shared-memory stage holds a 64-key tile of the latent once
and serves both products:

* The stage and the queries are kept in column chunks: the values' two halves (Dv / 2
  columns each, 256 at DeepSeek's shape) and the rest of the key (D - Dv, 64: RoPE),
  each chunk a TMA copy and a 128-byte-swizzled tile. q·kᵀ is the sum of one wgmma per
  chunk; p·v reads a value chunk as it is.
* Warpgroup 0 computes the [64 heads, 64 keys] scores over all D columns, the online
  softmax, and p·v into the first half of the output; it hands P (16-bit, shared
  memory) and the rescaling factor of the tile to warpgroup 1, which runs p·v into the
  second half. No partial scores are exchanged and warpgroup 1's matmul runs while
  warpgroup 0 computes the next tile's scores.
* A memory warpgroup streams the tiles the BlockMask row lists, `_STAGES` ahead, the
  copies spread over its four warps; a stage is refilled once both compute warpgroups
  have released it.
* Shared memory: queries 64 x D, two stages of 64 x D, P [64, 64]: 224.5 KiB at D 576,
  within the H100/H200's 227 KiB (the output tiles reuse the stages).

Splits of a row's tiles, partial outputs and their exact merge, masks on partial
tiles, paged caches (a tile from one page, or from 2 / 4 pages of 32 / 16 rows; rows
past a row's length zeroed in the value chunks before p·v): as in
`decode_latent_mosaic.py`, whose `latent_decode` runs this kernel where
`decode_latent_mosaic.VALUES_FROM_KEY_STAGE` is set and `unsupported_reason` here is
None.

On the H200 at DeepSeek's shape it runs 1.35-1.60x faster than the split-column kernel
(up to 500 TFLOP/s; figures where the flag is defined). ptxas spills 100-156 bytes a
thread at the registers below (the split-column kernel 12).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels import online_softmax
from pallas_flex.kernels.block_walk import split_walk
from pallas_flex.kernels.forward_mosaic import tile_transforms
from pallas_flex.kernels.latent_tiles import (
    copies_per_tile, mask_partial_tile, normalizers, softmax_step, tile_sources,
    zero_rows_past_length)
from pallas_flex.kernels.mosaic_tiles import ROWS_PER_WARPGROUP, matmul, split_tile_refs

HEADS_PER_PROGRAM = ROWS_PER_WARPGROUP
TILE = 64
_STAGES = 2
# Shared memory a program may take (bytes): the H100's and H200's 227 KiB.
_SHARED_MEMORY = 232448
# Registers a thread (setmaxnreg; at most 3 x 168 = 504 for the three,
# `mosaic_tiles.registers_fit`: 240 + 232 + 40 hung the GPU in the increase): the scores
# warpgroup (its output half [64, Dv / 2] float32: 128, the [64, 64] score tile: 32, P,
# the row vectors), the values warpgroup (its output half), the memory warpgroup.
# The scores warpgroup holds the most: H200, DeepSeek's latent decode (Hq 128, D 576,
# Dv 512 in place), ptxas spills and ms, (240, 224, 40) / (248, 216, 40) /
# (232, 232, 40): B16 S4096 100 / 36 / 180 B stored, 0.0739 / 0.0737 / 0.0746 ms; B64
# S32768 108 / 40 / 204 B, 1.221 / 1.210 / 1.285 ms (outputs bitwise equal).
_REGISTERS = (248, 216, 40)


def chunk_widths(head_dim: int, value_dim: int):
    """Column chunks of a latent row: the values' two halves, then the rest of the key."""
    half = value_dim // 2
    return (half, half) + ((head_dim - value_dim,) if head_dim > value_dim else ())


def shared_memory_bytes(head_dim: int, itemsize: int = 2) -> int:
    return ((1 + _STAGES) * HEADS_PER_PROGRAM * head_dim * itemsize
            + HEADS_PER_PROGRAM * TILE * itemsize + 2 * HEADS_PER_PROGRAM * 4)


def unsupported_reason(head_dim: int, value_dim: int, page_size, kv_block: int):
    """None if this kernel takes a latent decode that `decode_latent_mosaic` takes, with
    the values read from the keys (head dims, page size, BlockMask block), else why not."""
    rest = head_dim - value_dim
    if rest < 0 or rest > 256 or rest % 64:
        return f"D - Dv = {rest} (it takes 0 to 256 in 64s)"
    if value_dim // 2 > 256:
        return f"value dim {value_dim} (its halves are TMA boxes of at most 256 columns)"
    if shared_memory_bytes(head_dim) > _SHARED_MEMORY:
        return f"head dim {head_dim}: queries and two stages exceed shared memory"
    if page_size is not None and page_size % TILE and page_size not in (16, 32):
        return f"pages of {page_size} rows (it takes 16, 32 or a multiple of {TILE})"
    if kv_block % TILE:
        return f"BlockMask KV blocks of {kv_block} (a multiple of {TILE})"
    return None


def _kernel(q_ref, k_ref, full_num_ref, full_indices_ref, partial_num_ref,
            partial_indices_ref, *refs, mask_program, mask_reads, scale, num_splits,
            head_blocks, kv_len, tiles_per_block, broadcast_batch, page_size, widths,
            interpret):
    """k_ref: the latent [B, Skv, 1, D] (values its first Dv columns), or with page_size
    its pages [num_pages, 1, page_size, D] through page_table_ref [B, max_pages] up to
    lengths_ref [B] (the BlockMask clipped to them)."""
    paged = page_size is not None
    if paged:
        page_table_ref, lengths_ref, *refs = refs
    mask_refs, _, (out_ref, lse_ref, scratch) = split_tile_refs(
        refs, mask_program, mask_reads, None, {})
    q_chunks, (stage_chunks, (o_smem, lse_smem)), p_smem, vectors, barriers = scratch
    q_barrier, ready, consumed, p_ready, p_free = barriers
    starts = [sum(widths[:index]) for index in range(len(widths))]
    half = widths[0]
    dtype = q_ref.dtype

    program = lax.axis_index("programs")
    head_block = lax.rem(program, jnp.int32(head_blocks))
    rest = lax.div(program, jnp.int32(head_blocks))
    split = lax.rem(rest, jnp.int32(num_splits))
    batch = lax.div(rest, jnp.int32(num_splits))
    low, high, middle, kv_length, key_start_of = split_walk(
        (full_num_ref, full_indices_ref, partial_num_ref, partial_indices_ref),
        lengths_ref if paged else None, batch=batch, split=split, num_splits=num_splits,
        tile=TILE, tiles_per_block=tiles_per_block, kv_len=kv_len,
        broadcast_batch=broadcast_batch)

    def slot_of(step):
        return lax.rem(step - low, jnp.int32(_STAGES))

    tile = (HEADS_PER_PROGRAM, TILE)
    warpgroup = lax.axis_index("warpgroup")

    def output(accumulator, inverse_sum, column):
        """Writes a normalized output half (its shared-memory tile reuses the stages)."""
        out = accumulator * lax.broadcast_in_dim(inverse_sum, accumulator.shape, [0])
        o_smem.at[column][...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem.at[column],
            out_ref.at[batch, head_block, split, :, pl.ds(column * half, half)])

    @pl.when(warpgroup == 0)
    def _scores():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[0], action="increase")
        heads = pl.ds(head_block * HEADS_PER_PROGRAM, HEADS_PER_PROGRAM)
        for chunk, (start, width) in enumerate(zip(starts, widths)):
            plgpu.copy_gmem_to_smem(q_ref.at[batch, 0, heads, pl.ds(start, width)],
                                    q_chunks[chunk], q_barrier)
        plgpu.barrier_wait(q_barrier)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        logit_scale = scale * online_softmax.LOG2_E

        def scores_of(slot):
            """q·kᵀ of the stage's tile over every chunk: [64 heads, TILE keys] float32."""
            if interpret:
                return sum(lax.dot_general(q_chunks[chunk][...], stage[slot][...],
                                           (((1,), (1,)), ((), ())),
                                           preferred_element_type=jnp.float32)
                           for chunk, stage in enumerate(stage_chunks))

            def body(accumulator):
                for chunk, stage in enumerate(stage_chunks):
                    plgpu.wgmma(accumulator, q_chunks[chunk],
                                stage.at[slot].transpose((1, 0)))
                return accumulator[...]
            return pl.run_scoped(body, plgpu.ACC(tile, jnp.float32))

        def zero_values_past_length(slot, kv_start):
            """The value chunks' rows at or past the row's length set to 0 (a reused
            page holds whatever it held, and 0 * NaN is NaN), before either p·v."""
            for stage in stage_chunks[:2]:
                zero_rows_past_length(stage.at[slot], kv_start, kv_length, period=TILE,
                                      interpret=interpret)
            plgpu.commit_smem()  # before the wgmmas read them

        def visit(step, carry, masked):
            accumulator, running_max, running_sum = carry
            slot = slot_of(step)
            plgpu.barrier_wait(ready.at[slot])
            logits = scores_of(slot)
            kv_start = None
            if masked:
                kv_start = key_start_of(step)
                logits = mask_partial_tile(
                    logits, kv_start, mask_program=mask_program, mask_reads=mask_reads,
                    mask_refs=mask_refs, batch=batch, kv_len=kv_len, kv_length=kv_length,
                    interpret=interpret)
            p, correction, running_max, running_sum = softmax_step(
                logits, running_max, running_sum, logit_scale)
            p = p.astype(dtype)
            if paged and masked:
                pl.when(kv_start + TILE > kv_length)(
                    functools.partial(zero_values_past_length, slot, kv_start))
            # Warpgroup 1 is done with the last tile's P and factor.
            pl.when(step > low)(lambda: plgpu.barrier_wait(p_free))
            p_smem[...] = p
            vectors.at[0][...] = correction
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)
            accumulator = accumulator * lax.broadcast_in_dim(correction, accumulator.shape, [0])
            accumulator = matmul(p, stage_chunks[0].at[slot], shape=accumulator.shape,
                                 interpret=interpret, accumulator=accumulator)
            plgpu.barrier_arrive(consumed.at[slot])
            return accumulator, running_max, running_sum

        carry = (plgpu.layout_cast(jnp.full((HEADS_PER_PROGRAM, half), 0.0, jnp.float32),
                                   plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.full((HEADS_PER_PROGRAM,), -jnp.inf, jnp.float32),
                                   row_layout),
                 plgpu.layout_cast(jnp.full((HEADS_PER_PROGRAM,), 0.0, jnp.float32),
                                   row_layout))
        carry = lax.fori_loop(low, middle, functools.partial(visit, masked=False), carry)
        accumulator, running_max, running_sum = lax.fori_loop(
            middle, high, functools.partial(visit, masked=True), carry)
        inverse_sum, lse = normalizers(running_max, running_sum)
        # Warpgroup 1 has run its last p·v (the stages are free for the output tiles).
        pl.when(high > low)(lambda: plgpu.barrier_wait(p_free))
        vectors.at[1][...] = inverse_sum
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
        output(accumulator, inverse_sum, 0)
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head_block, split])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(warpgroup == 1)
    def _values():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[1], action="increase")
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def load_row_vector(ref):
            return plgpu.load(ref, layout=row_layout) if not interpret else ref[...]

        def visit(step, accumulator):
            slot = slot_of(step)
            plgpu.barrier_wait(ready.at[slot])  # the tile's copies landed (seen here too)
            plgpu.barrier_wait(p_ready)
            correction = load_row_vector(vectors.at[0])
            accumulator = accumulator * lax.broadcast_in_dim(correction, accumulator.shape, [0])
            accumulator = matmul(p_smem, stage_chunks[1].at[slot], shape=accumulator.shape,
                                 interpret=interpret, accumulator=accumulator)
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed.at[slot])
            return accumulator

        accumulator = lax.fori_loop(
            low, high, visit,
            plgpu.layout_cast(jnp.full((HEADS_PER_PROGRAM, half), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA))
        plgpu.barrier_wait(p_ready)  # the row sums' inverse
        output(accumulator, load_row_vector(vectors.at[1]), 1)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(warpgroup == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[2], action="decrease")
        def per_warp(warp):
            @pl.loop(low, high)
            def _(step):
                slot = slot_of(step)
                # The table reads before the wait, which hides them.
                views = tile_sources(k_ref, page_table_ref if paged else None, batch,
                                     key_start_of(step), tile=TILE, page_size=page_size)

                @pl.when(step - low >= _STAGES)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                # One copy per chunk, or per chunk and page of pages under a tile.
                copies = [(chunk, rows, view) for chunk in range(len(widths))
                          for rows, view in views]
                for index, (chunk, rows, view) in enumerate(copies):
                    @pl.when(warp == index % 4)
                    def _(rows=rows, view=view, chunk=chunk):
                        plgpu.copy_gmem_to_smem(
                            view.at[:, pl.ds(starts[chunk], widths[chunk])],
                            stage_chunks[chunk].at[slot].at[rows], ready.at[slot])

            # Observe the last releases, so that every phase is waited on once.
            @pl.loop(jnp.maximum(high - _STAGES, low), high)
            def _(step):
                plgpu.barrier_wait(consumed.at[slot_of(step)])

        plgpu.warp_map(per_warp)


def launch(q, k, tables, paging, captured, *, kernel_settings, num_splits, head_blocks,
           value_dim, interpret):
    """Partial outputs [B, head blocks, splits, 64, Dv] and lse [B, head blocks, splits,
    64] (float32) of each split of each row's tiles, as `decode_latent_mosaic._launch`.
    k: the latent (contiguous) or its pages; paging: () or (page_table, lengths)."""
    batch, head_dim = q.shape[0], q.shape[3]
    widths = chunk_widths(head_dim, value_dim)
    half = widths[0]
    page_size = kernel_settings["page_size"]
    kernel = functools.partial(_kernel, widths=widths, num_splits=num_splits,
                               head_blocks=head_blocks, interpret=interpret,
                               **kernel_settings)

    def entry(*refs):
        def scoped(q_chunks, union, p_smem, vectors, *barriers):
            kernel(*refs, (q_chunks, tuple(union), p_smem, vectors, barriers))

        pl.run_scoped(
            scoped,
            tuple(plgpu.SMEM((HEADS_PER_PROGRAM, width), q.dtype,
                             transforms=tile_transforms(width)) for width in widths),
            plgpu.RefUnion(
                tuple(plgpu.SMEM((_STAGES, TILE, width), q.dtype,
                                 transforms=tile_transforms(width, TILE)) for width in widths),
                (plgpu.SMEM((2, HEADS_PER_PROGRAM, half), jnp.float32,
                            transforms=(plgpu.TilingTransform((8, 32)),
                                        plgpu.SwizzleTransform(128))),
                 plgpu.SMEM((HEADS_PER_PROGRAM,), jnp.float32))),
            plgpu.SMEM((HEADS_PER_PROGRAM, TILE), q.dtype, transforms=tile_transforms(TILE)),
            plgpu.SMEM((2, HEADS_PER_PROGRAM), jnp.float32),
            plgpu.Barrier(num_arrivals=len(widths)),
            plgpu.Barrier(num_barriers=_STAGES,
                          num_arrivals=len(widths) * copies_per_tile(TILE, page_size)),
            plgpu.Barrier(num_barriers=_STAGES, num_arrivals=2),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
            collective_axes="warpgroup",
        )

    out_type = (
        jax.ShapeDtypeStruct((batch, head_blocks, num_splits, HEADS_PER_PROGRAM, value_dim),
                             jnp.float32),
        jax.ShapeDtypeStruct((batch, head_blocks, num_splits, HEADS_PER_PROGRAM), jnp.float32))
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(batch * head_blocks * num_splits,),
        grid_names=("programs",),
        num_threads=3,
        thread_name="warpgroup",
        # No shared memory for cross-warp reductions: the row max and sum of a wgmma tile
        # reduce within each warp, and the 2 KiB Pallas reserves by default would not fit.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, *tables, *paging, *captured)


__all__ = ["TILE", "chunk_widths", "launch", "unsupported_reason"]
