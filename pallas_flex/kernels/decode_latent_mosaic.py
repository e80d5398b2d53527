"""Latent-attention (MLA) decode for Hopper: a Pallas Mosaic GPU kernel.

DeepSeek's multi-head latent attention decodes with many query heads (128) on one KV
head of a wide latent (D 576 for q·kᵀ, Dv 512 for p·v). Per cached token that is
~280 kFLOP against 2176 bytes: at the H100's bandwidth the tensor cores must run
wgmma near their peak, which the Triton decode (`decode.py`, mma.sync on 32-row
programs) cannot (0.54-0.79 TB/s on the H100; this kernel 1.76-2.51, 2.9-4.1x faster:
`pallas-flex bench latent`, benchmarks/results/h100/latent.json). Here, after FlashMLA:

* A program owns 64 query heads (the wgmma M) of one batch row and one split of the
  keys the BlockMask row lists.
* Its two compute warpgroups share the work without sharing an accumulator: warpgroup
  w computes the partial scores Q[:, half w] · K[:, half w]ᵀ over its half of the 576
  columns, the two halves are added through shared memory (a [64, T] float32 tile
  each, two named-barrier rendezvous a tile), both run the same online softmax on the
  same sums, and warpgroup w accumulates P · V[:, half w] into its half of the output:
  [64, 256] float32, 128 registers a thread. No matmul is done twice.
* The memory warpgroup streams each warpgroup's halves of the K/V tiles (T keys) with
  TMA, `_STAGES` ahead, each of the four copies of a tile from a warp of its own; each
  compute warpgroup waits for and releases only its own halves. The two head blocks of
  a (batch row, split) run as a cluster and load each tile once between them, TMA
  multicast into both blocks' shared memory; a stage is refilled once the warpgroups of
  both blocks have released it (cluster barriers).
* Each program writes its normalized [64, Dv] output in float32 and its lse; the splits
  merge exactly afterwards (`online_softmax.merge_partials`), as in the Triton decode.

Masks run on partial tiles as in the other kernels (rows are heads here, so the mask
may not read h, nor captured arrays at q_idx: `unsupported_reason`).

Paged caches (pages [num_pages, 1, page_size, D] through a page table, as
`paged_flex_attention` passes them, its BlockMask clipped to the row lengths): a tile
comes from one page (pages of a multiple of T rows) or two (pages of 16); the tiles
past a row's length are left out, the one that crosses it is masked there and its V
rows past the length are zeroed before p·v (a reused page holds whatever it held, and
0 * NaN is NaN), a [64, 64] column piece at a time (`latent_tiles.ZEROED_COLUMNS`):
pages of 64 run as fast as a contiguous cache (docs/gpu-notes.md, Decode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels import decode_latent_stage_mosaic, online_softmax
from pallas_flex.kernels.block_walk import split_walk
from pallas_flex.kernels.device import multiprocessor_count
from pallas_flex.kernels.forward_mosaic import named_barrier, tile_transforms
from pallas_flex.kernels.mosaic_eligibility import (
    EXACT_FLOAT32_INTEGERS, device_unsupported_reason, mod_unsupported_reason, tile_reads)
from pallas_flex.kernels.latent_tiles import (
    copies_per_tile, mask_partial_tile, normalizers, softmax_step, tile_sources,
    zero_rows_past_length)
from pallas_flex.kernels.mosaic_tiles import (
    ROWS_PER_WARPGROUP, matmul, run_per_element_under_vmap, split_tile_refs, tile_inputs)
from pallas_flex.kernels.padding import pad_axis

COMPUTE_WARPGROUPS = 2
HEADS_PER_PROGRAM = ROWS_PER_WARPGROUP
# Keys per K/V tile and tiles in flight: 64 x 576 queries (72 KiB), two stages of 32
# keys of K and V (2 x 68 KiB) and the score halves' exchange tile (2 x 8 KiB) fill the
# H100's 227 KiB of shared memory (the output tiles reuse the stages). 16-key tiles at 4
# stages lost (H100, ms a step: B8 S8192 0.155 against 0.113, B64 S4096 0.373 / 0.300).
# The copies of a tile issued from one thread instead of four warps: 0.131 / 0.113 at B8
# S8192, 0.114 / 0.105 at B1 S32768, alike at B64 (docs/gpu-notes.md, Decode).
TILE = 32
# Pages smaller than a tile: two copies fill it. (8-row pages would need 4 copies of 8
# rows, which a cluster's multicast cannot split in two.)
PAGE_ROWS = 16
_STAGES = 2
_REGISTERS = (232, 40)
# Latent calls whose values are the keys' first columns (v is k) run
# `decode_latent_stage_mosaic` (one stage of 64-key latent tiles serving q·kᵀ and p·v)
# where it takes them. H200, DeepSeek's shape, 8 chained steps, paired rounds of
# AOT-compiled calls, ms a step, split-column / key-stage kernel (outputs within 5e-4):
# B16 S4096 0.0708 / 0.0525 (1.35x), B64 0.2386 / 0.1558 (1.53x), B128 0.477 / 0.309
# (1.54x); S32768 B16 0.456 / 0.291 (1.57x), B64 1.794 / 1.182 (1.52x), B128 3.539 / 2.486
# (1.42x, 330 -> 470 TFLOP/s); pages of 64 alike (1.36-1.60x).
VALUES_FROM_KEY_STAGE = True
# Head blocks of one (batch row, split) run as a cluster of this many blocks, which load
# each K/V tile once between them (TMA multicast) instead of each from L2: H100, B64
# S4096, ms a step, cluster of 2 / none: D 576 0.253 / 0.258, D 512 0.236 / 0.253.
# What bounds the kernel is its two-stage stream (docs/gpu-notes.md, Decode): the loads
# alone, compute left out, take 0.236 ms either way (2.41 TB/s).
_CLUSTER = 2
# Named barriers (Mosaic GPU takes the low ids): the scores' halves written / read.
_WRITTEN_BARRIER, _READ_BARRIER = 8, 9


def unsupported_reason(q, k, v, block_mask, score_program, *, paged: bool, with_max: bool,
                       interpret: bool):
    """None if this kernel takes the decode call, else why not (a short phrase)."""
    batch, q_len, q_heads, head_dim = q.shape
    if not interpret and (reason := device_unsupported_reason()) is not None:
        return reason
    if with_max:
        return "the row max asked for"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (it takes 16-bit q, k, v of one dtype)"
    if q_len != 1:
        return f"Sq = {q_len} (it takes one query position)"
    kv_heads = k.shape[1 if paged else 2]
    if kv_heads != 1:
        return f"{kv_heads} KV heads (it takes latent attention's one)"
    if paged and k.shape[2] != PAGE_ROWS and k.shape[2] % TILE:
        return (f"pages of {k.shape[2]} rows (it takes {PAGE_ROWS} or a multiple of "
                f"{TILE})")
    if q_heads % HEADS_PER_PROGRAM:
        return f"{q_heads} query heads (it takes a multiple of {HEADS_PER_PROGRAM})"
    value_dim = v.shape[3]
    if head_dim % 64 or not 128 <= head_dim <= 640:
        return f"head dim {head_dim} (it takes multiples of 64 from 128 to 640)"
    if value_dim % 128 or not 128 <= value_dim <= 512:
        return f"value dim {value_dim} (it takes multiples of 128 up to 512)"
    if block_mask.shape[3] > EXACT_FLOAT32_INTEGERS:
        return f"KV length {block_mask.shape[3]} above {EXACT_FLOAT32_INTEGERS}"
    if block_mask.block_size[1] % TILE:
        return f"BlockMask KV blocks of {block_mask.block_size[1]} (a multiple of {TILE})"
    if score_program is not None:
        return "a score_mod"
    mask_program = block_mask.mask_mod
    reason = mod_unsupported_reason(mask_program)
    if reason is not None:
        return reason
    if mask_program is not None and mask_program.uses_head:
        return "a mask_mod that reads h (rows are heads here)"
    reads = tile_reads(mask_program).values()
    if any(kind != "kv" for _, _, kind in reads):
        return "a mask_mod reading a captured array at q_idx"
    # A 32-key tile's column vector holds 2 elements a thread: Mosaic GPU loads no fewer
    # than 8 bits, which 2 booleans are not.
    if any(jnp.dtype(mask_program.consts[position].dtype) == jnp.bool_
           for position, _, _ in reads):
        return "a mask_mod reading a boolean captured array at kv_idx (give it as int8)"
    return None


def _float32_transforms(columns: int):
    """A float32 tile's shared-memory layout (the score halves, the output tiles)."""
    swizzle = min(128, columns * 4)
    return (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))


def _kernel(q_ref, k_ref, v_ref, full_num_ref, full_indices_ref, partial_num_ref,
            partial_indices_ref, *refs, mask_program, mask_reads, scale, num_splits,
            head_blocks, cluster, kv_len, tiles_per_block, broadcast_batch, page_size,
            interpret):
    """page_size: None for a contiguous cache k_ref [B, Skv, 1, D], else k_ref / v_ref are
    pages [num_pages, 1, page_size, D] read through page_table_ref [B, max_pages] up to
    lengths_ref [B], with the BlockMask clipped to those lengths
    (`BlockMask.clip_to_lengths`: only the last listed block may cross a row's length)."""
    paged = page_size is not None
    if paged:
        page_table_ref, lengths_ref, *refs = refs
    mask_refs, _, (out_ref, lse_ref, scratch) = split_tile_refs(
        refs, mask_program, mask_reads, None, {})
    q_smem, ((k_smem, v_smem), (o_smem, lse_smem)), s_smem, barriers = scratch
    (q_barriers, k_barriers, v_barriers, k_consumed, v_consumed, written, read) = barriers
    qk_half, value_half = q_smem.shape[2], v_smem.shape[2]
    dtype = q_ref.dtype

    # A cluster's blocks are neighbouring head blocks of one (batch row, split).
    program = lax.axis_index("programs")
    head_clusters = head_blocks // cluster
    head_block = (lax.rem(program, jnp.int32(head_clusters)) * cluster
                  + lax.axis_index("cluster"))
    rest = lax.div(program, jnp.int32(head_clusters))
    split = lax.rem(rest, jnp.int32(num_splits))
    batch = lax.div(rest, jnp.int32(num_splits))
    low, high, middle, kv_length, key_start_of = split_walk(
        (full_num_ref, full_indices_ref, partial_num_ref, partial_indices_ref),
        lengths_ref if paged else None, batch=batch, split=split, num_splits=num_splits,
        tile=TILE, tiles_per_block=tiles_per_block, kv_len=kv_len,
        broadcast_batch=broadcast_batch)

    def slot_of(step):
        return lax.rem(step, jnp.int32(_STAGES))

    warpgroup = lax.axis_index("warpgroup")

    def rendezvous(named_id, barrier):
        if interpret:
            plgpu.barrier_arrive(barrier)
            plgpu.barrier_wait(barrier)
        else:
            named_barrier("sync", named_id)

    @pl.when(warpgroup < COMPUTE_WARPGROUPS)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[0], action="increase")
        half = warpgroup
        heads = pl.ds(head_block * HEADS_PER_PROGRAM, HEADS_PER_PROGRAM)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, 0, heads, pl.ds(half * qk_half, qk_half)],
                                q_smem.at[half], q_barriers.at[half])
        plgpu.barrier_wait(q_barriers.at[half])
        tile = (HEADS_PER_PROGRAM, TILE)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        running_max = plgpu.layout_cast(
            jnp.full((HEADS_PER_PROGRAM,), -jnp.inf, jnp.float32), row_layout)
        running_sum = plgpu.layout_cast(
            jnp.full((HEADS_PER_PROGRAM,), 0.0, jnp.float32), row_layout)
        accumulator = plgpu.layout_cast(
            jnp.full((HEADS_PER_PROGRAM, value_half), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        logit_scale = scale * online_softmax.LOG2_E
        other = 1 - half
        own_rows = pl.ds(half * TILE, TILE)  # this half's T keys in a stage

        def zero_values_past_length(slot, kv_start):
            """Zeroes the V rows at or past the row's length in both halves of a stage
            ([2 T, Dv / 2]: half w's T rows, then the other's, the same keys). Their
            weights are 0, but a page reused from an earlier request holds whatever it
            held, and 0 * NaN is NaN in p·v. Each warpgroup has waited for its own half
            only: they meet before (both halves landed) and after (both written; the
            same zeros, so neither waits for the other's stores to its half)."""
            rendezvous(_WRITTEN_BARRIER, written)
            zero_rows_past_length(v_smem.at[slot], kv_start, kv_length, period=TILE,
                                  interpret=interpret)
            plgpu.commit_smem()  # before the wgmma reads the tile
            rendezvous(_READ_BARRIER, read)

        def scores(partial, step, masked):
            """The tile's logits: this half's partial scores plus the other half's
            (through shared memory), masked on partial tiles; (logits, kv_start)."""
            local = step - low
            # The other half may still read this tile's last contents.
            pl.when(local > 0)(lambda: rendezvous(_READ_BARRIER, read))
            s_smem.at[half][...] = partial
            rendezvous(_WRITTEN_BARRIER, written)
            # a + b == b + a: both warpgroups hold the same sums, bit for bit.
            logits = partial + plgpu.load(s_smem.at[other], layout=plgpu.Layout.WGMMA)
            kv_start = None
            if masked:
                kv_start = key_start_of(step)
                logits = mask_partial_tile(
                    logits, kv_start, mask_program=mask_program, mask_reads=mask_reads,
                    mask_refs=mask_refs, batch=batch, kv_len=kv_len, kv_length=kv_length,
                    interpret=interpret)
            return logits, kv_start

        def values_ready(step, masked, kv_start):
            """Waits for the tile's V half; zeroes a paged tile's rows past the length."""
            slot = slot_of(step - low)
            plgpu.barrier_wait(v_barriers.at[slot * COMPUTE_WARPGROUPS + half])
            if paged and masked:
                # Before p·v reads them: the tile's rows at or past the row's length.
                pl.when(kv_start + TILE > kv_length)(
                    functools.partial(zero_values_past_length, slot, kv_start))
            return v_smem.at[slot, own_rows]

        def release(barriers, step):
            plgpu.barrier_arrive(barriers.at[slot_of(step - low) * COMPUTE_WARPGROUPS + half])

        def keys_of(step):
            slot = slot_of(step - low)
            plgpu.barrier_wait(k_barriers.at[slot * COMPUTE_WARPGROUPS + half])
            return k_smem.at[slot, own_rows]

        def after_scores(partial, step, carry, masked):
            """The tile's softmax and p·v from this half's partial scores; the new carry."""
            accumulator, running_max, running_sum = carry
            logits, kv_start = scores(partial, step, masked)
            p, correction, running_max, running_sum = softmax_step(
                logits, running_max, running_sum, logit_scale)
            accumulator = accumulator * lax.broadcast_in_dim(correction, accumulator.shape, [0])
            accumulator = matmul(p.astype(dtype), values_ready(step, masked, kv_start),
                                 shape=accumulator.shape, interpret=interpret,
                                 accumulator=accumulator)
            release(v_consumed, step)
            return accumulator, running_max, running_sum

        def visit(step, carry, masked):
            """One tile: q·kᵀ, the exchange, the softmax, p·v, each waited for in turn.
            Walking two tiles at a time with both q·kᵀ issued first (the second's under
            the first's exchange and softmax) was slower: 3-7 % at every shape of
            `bench latent` (H200), ptxas spilling 344-356 B beside the second tile's
            in-flight accumulator (12 B one tile at a time; docs/gpu-notes.md, Decode)."""
            partial = matmul(q_smem.at[half], keys_of(step), shape=tile,
                             interpret=interpret, transpose_b=True)
            release(k_consumed, step)
            return after_scores(partial, step, carry, masked)

        carry = (accumulator, running_max, running_sum)
        carry = lax.fori_loop(low, middle, functools.partial(visit, masked=False), carry)
        carry = lax.fori_loop(middle, high, functools.partial(visit, masked=True), carry)
        accumulator, running_max, running_sum = carry
        # Both halves are done with the K/V stages, which the output tiles reuse.
        rendezvous(_READ_BARRIER, read)
        inverse_sum, lse = normalizers(running_max, running_sum)
        out = accumulator * lax.broadcast_in_dim(inverse_sum, accumulator.shape, [0])
        o_smem.at[half][...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem.at[half],
            out_ref.at[batch, head_block, split, :, pl.ds(half * value_half, value_half)])

        @pl.when(half == 0)
        def _():
            lse_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head_block, split])

        plgpu.wait_smem_to_gmem(0)

    @pl.when(warpgroup == COMPUTE_WARPGROUPS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[1], action="decrease")
        # Four copies a tile (K and V, a half each), one from each warp: from one thread,
        # one after another, they were slower (see TILE).
        copies = ((k_ref, k_smem, k_barriers, k_consumed, qk_half),
                  (v_ref, v_smem, v_barriers, v_consumed, value_half))

        def each_warp(body, step):
            def per_warp(warp):
                for copy_index in range(4):
                    pl.when(warp == copy_index)(functools.partial(body, step, copy_index))
            plgpu.warp_map(per_warp)

        def issue(step, copy_index):
            source, destination, ready, consumed, columns = copies[copy_index // 2]
            half = copy_index % 2
            local = step - low
            slot = slot_of(local)
            barrier = slot * COMPUTE_WARPGROUPS + half
            # The table reads (BlockMask, page table) before the wait, which hides them.
            sources = tile_sources(source, page_table_ref if paged else None, batch,
                                   key_start_of(step), tile=TILE, page_size=page_size)

            @pl.when(local >= _STAGES)
            def _():
                plgpu.barrier_wait(consumed.at[barrier])

            # With a cluster, each block copies its share of the tile into every block
            # of the cluster (multicast), and all the blocks' ready barriers see it whole.
            stage = destination.at[slot, pl.ds(half * TILE, TILE)]
            for rows, view in sources:
                plgpu.copy_gmem_to_smem(
                    view.at[:, pl.ds(half * columns, columns)], stage.at[rows],
                    ready.at[barrier], collective_axes="cluster" if cluster > 1 else None)

        def drain(step, copy_index):
            consumed = copies[copy_index // 2][3]
            slot = slot_of(step - low)
            plgpu.barrier_wait(consumed.at[slot * COMPUTE_WARPGROUPS + copy_index % 2])

        pl.loop(low, high)(functools.partial(each_warp, issue))
        # Observe the last releases, so that every phase is waited on once (the
        # interpreter checks it), by the warp that waited on the earlier ones.
        pl.loop(jnp.maximum(high - _STAGES, low), high)(functools.partial(each_warp, drain))


def _launch(q, k, v, tables, paging, captured, *, kernel, num_splits, head_blocks, cluster,
            page_size, value_dim, interpret):
    """The kernel's partial outputs [B, head blocks, splits, 64, Dv] and lse [B, head
    blocks, splits, 64] (float32) for each split of each row's keys, Dv = value_dim (v's
    first columns). paging: () or a paged cache's (page_table, lengths)."""
    # TMA copies filling a tile's half: one, or one per page of pages under a tile.
    copies_per_half = copies_per_tile(TILE, page_size)
    batch, qk_half = q.shape[0], q.shape[3] // 2
    value_half = value_dim // 2
    halves = COMPUTE_WARPGROUPS
    # A stage is refilled (in every block of the cluster) once the warpgroups of every
    # block have released it.
    if cluster > 1:
        released = functools.partial(plgpu.ClusterBarrier, collective_axes=("cluster",))
    else:
        released = plgpu.Barrier

    def entry(*refs):
        def scoped(q_smem, union, s_smem, *barriers):
            kernel(*refs, (q_smem, tuple(union), s_smem, barriers))

        pl.run_scoped(
            scoped,
            plgpu.SMEM((halves, HEADS_PER_PROGRAM, qk_half), q.dtype,
                       transforms=tile_transforms(qk_half)),
            # The output tiles (and lse) reuse the K/V stages' memory once the walk is over.
            plgpu.RefUnion(
                # A stage: half 0's T keys, then half 1's (the same keys).
                (plgpu.SMEM((_STAGES, halves * TILE, qk_half), q.dtype,
                            transforms=tile_transforms(qk_half)),
                 plgpu.SMEM((_STAGES, halves * TILE, value_half), q.dtype,
                            transforms=tile_transforms(value_half, TILE))),
                (plgpu.SMEM((halves, HEADS_PER_PROGRAM, value_half), jnp.float32,
                            transforms=_float32_transforms(value_half)),
                 plgpu.SMEM((HEADS_PER_PROGRAM,), jnp.float32))),
            plgpu.SMEM((halves, HEADS_PER_PROGRAM, TILE), jnp.float32,
                       transforms=_float32_transforms(TILE)),
            plgpu.Barrier(num_barriers=halves),
            plgpu.Barrier(num_barriers=_STAGES * halves, num_arrivals=copies_per_half),
            plgpu.Barrier(num_barriers=_STAGES * halves, num_arrivals=copies_per_half),
            released(num_barriers=_STAGES * halves),
            released(num_barriers=_STAGES * halves),
            plgpu.Barrier(num_arrivals=halves),
            plgpu.Barrier(num_arrivals=halves),
            collective_axes="warpgroup",
        )

    out_type = (
        jax.ShapeDtypeStruct((batch, head_blocks, num_splits, HEADS_PER_PROGRAM, value_dim),
                             jnp.float32),
        jax.ShapeDtypeStruct((batch, head_blocks, num_splits, HEADS_PER_PROGRAM), jnp.float32))
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(batch * head_blocks * num_splits // cluster,),
        grid_names=("programs",),
        cluster=(cluster,),
        cluster_names=("cluster",),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="warpgroup",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, v, *tables, *paging, *captured)


def choose_splits(batch: int, head_blocks: int, num_tiles: int, requested: int = 0) -> int:
    """Splits of a row's KV tiles: as many as keep the programs within one wave (at
    most one per SM), at least 1, at most the tiles."""
    if requested:
        return max(1, min(requested, num_tiles))
    return max(1, min(num_tiles, multiprocessor_count() // (batch * head_blocks)))


def latent_decode(q, k, v, block_mask, *, scale: float, interpret: bool, num_splits: int = 0,
                  out_dtype=None, page_table=None, lengths=None, value_dim=None):
    """out [B, 1, Hq, Dv] (q's dtype) and lse [B, Hq, 1] float32 of decode attention on a
    contiguous cache k [B, Skv, 1, D], v [B, Skv, 1, Dv], or with page_table [B,
    max_pages] and lengths [B] on pages k [num_pages, 1, page_size, D] (v likewise) with
    the BlockMask clipped to the lengths (`BlockMask.clip_to_lengths`, as the paged
    calls do). value_dim: None (all of v's columns), or the values are v's first
    value_dim columns, read in place: v may be k itself, a latent cache whose first Dv
    columns are the values (DeepSeek's), with no [.., :Dv] copy. `unsupported_reason`
    (given the values' shape) says which calls."""
    batch, _, q_heads, head_dim = q.shape
    value_dim = v.shape[3] if value_dim is None else value_dim
    kv_len = block_mask.shape[3]
    mask_block = block_mask.block_size[1]
    num_kv_blocks = block_mask.num_blocks[1]
    values_in_keys = v is k
    page_size, paging = None, ()
    if page_table is not None:
        page_size = k.shape[2]
        paging = (page_table.astype(jnp.int32), lengths.astype(jnp.int32))
    else:
        k = pad_axis(k, 1, num_kv_blocks * mask_block)
        v = k if values_in_keys else pad_axis(v, 1, num_kv_blocks * mask_block)
    head_blocks = q_heads // HEADS_PER_PROGRAM
    # The values read from the key tiles (`decode_latent_stage_mosaic`), where asked.
    from_key_stage = (values_in_keys and VALUES_FROM_KEY_STAGE
                      and decode_latent_stage_mosaic.unsupported_reason(
                          head_dim, value_dim, page_size, mask_block) is None)
    cluster = _CLUSTER if head_blocks % _CLUSTER == 0 and not from_key_stage else 1
    tiles_per_block = mask_block // (decode_latent_stage_mosaic.TILE if from_key_stage
                                     else TILE)
    requested_splits = num_splits
    num_splits = choose_splits(batch, head_blocks, num_kv_blocks * tiles_per_block,
                               num_splits)
    if interpret and not requested_splits:  # one wave's splits would crawl there
        num_splits = min(num_splits, 2)
    mask_program = block_mask.mask_mod
    mask_reads = tile_reads(mask_program)
    captured = tile_inputs(mask_program, mask_reads, None, {}, batch=batch, heads=q_heads,
                           q_length=mask_block, kv_length=num_kv_blocks * mask_block)
    tables = tuple(t.astype(jnp.int32) for t in (
        block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
        block_mask.kv_num_blocks, block_mask.kv_indices))
    settings = dict(mask_program=mask_program, mask_reads=mask_reads, scale=scale,
                    kv_len=kv_len, tiles_per_block=tiles_per_block,
                    broadcast_batch=tables[0].shape[0] == 1, page_size=page_size)
    if from_key_stage:
        def launch(q, k, v, tables, paging, captured):
            del v  # k's first value_dim columns
            return decode_latent_stage_mosaic.launch(
                q, k, tables, paging, captured, kernel_settings=settings,
                num_splits=num_splits, head_blocks=head_blocks, value_dim=value_dim,
                interpret=interpret)
    else:
        kernel = functools.partial(_kernel, num_splits=num_splits, head_blocks=head_blocks,
                                   cluster=cluster, interpret=interpret, **settings)
        launch = functools.partial(
            _launch, kernel=kernel, num_splits=num_splits, head_blocks=head_blocks,
            cluster=cluster, page_size=page_size, value_dim=value_dim, interpret=interpret)
    partial_out, partial_lse = run_per_element_under_vmap(launch)(q, k, v, tables, paging,
                                                                  tuple(captured))
    out, lse = online_softmax.merge_partials(partial_out, partial_lse, axis=2)
    out = out.reshape(batch, 1, q_heads, value_dim).astype(out_dtype or q.dtype)
    return out, lse.reshape(batch, q_heads, 1)
