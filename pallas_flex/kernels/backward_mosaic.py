"""Block-sparse FlexAttention backward for Hopper: two Pallas Mosaic GPU kernels.

The math is the Triton backward's (`backward.py`): P recomputed per tile from the saved
lse, delta = rowsum(dO * O) - dlse, dS = P * (dP - delta) times the score_mod's
derivative (the mod and its derivative traced together on scalars by
`mod_program.with_score_derivative`, then run on the tile like the mod),
dQ = dS K, dK = dS^T Q, dV = P^T dO.
Each kernel is warp-specialized as the forward (`forward_mosaic.py`): a memory
warpgroup streams the tiles a BlockMask row (or column) lists into shared memory with
TMA, `num_stages` ahead of use, and two compute warpgroups run wgmma and the
elementwise work on their own 64 rows.

* The dK/dV kernel: one program per (KV head, 128-key block, batch); each compute
  warpgroup owns 64 keys, keeps K and V in shared memory and dK, dV in float32
  registers. It walks the BlockMask's transposed tables (the query blocks of its key
  block: full ones without the mask_mod, then partial ones) for every query head of the
  KV head's GQA group, in 64-row query tiles: S^T = K Q^T and dP^T = V dO^T [64, 64],
  then dV += P^T dO and dK += dS^T Q. The group's heads are summed in registers, so GQA
  needs no [B, S, Hq, D] output and no reduction after it. Tiles put keys on the rows:
  the mods see kv_idx along the rows and q_idx along the columns
  (`mosaic_tiles.Vector`).
* The dQ kernel: one program per (query head, 128-row query block, batch), each
  compute warpgroup 64 query rows, walking the KV tables as the forward: S = Q K^T and
  dP = dO V^T [64, 128], dQ += dS K.

Apart from the fused dQ below, every gradient is written by exactly one program, in a
fixed order: the result is bitwise reproducible run to run.

At head dim 64 (`mosaic_eligibility.fuses_dq`: no gradients of captured arrays read at
kv_idx - q_idx, not `backward_deterministic`) the dK/dV kernel computes dQ too,
FlashAttention-3's scheme:
dS^T goes to shared memory (dK's wgmma reads it there), dQ += dS K over the warpgroup's
64 keys (wgmma with A transposed), and the float32 [64, 64] tile is TMA-reduce-added
into a zeroed dQ (a `jax.new_ref`) from a double-buffered staging tile: 5 matmuls per
tile pair instead of 7, and no dQ kernel. Elsewhere dQ stays in a kernel of its own,
which recomputes S and dP: at D 128 the fused kernel spilled registers and lost at every
variant measured (the figures are in `fuses_dq`'s docstring); the dQ kernel and the dK/dV
kernel run at ~780 and ~680 TFLOP/s there (B4 H16 S4096 noop on the H100, 1.06 and 1.61
ms), so the two-kernel scheme's 7 matmuls keep its fwd+bwd ~5 % behind cuDNN's 5.

Bias tensors the score_mod reads at (q_idx, kv_idx) (a pair bias, `scores.bias_lookup`)
are copied by the memory warpgroups as blocks, as in the forward
(`bias_blocks_mosaic.bias_block_reads`): the dQ kernel's [128, keys] beside each K/V stage
(at D 128 on 64-key tiles: `BackwardLayout`),
the dK/dV kernel's [128 keys, 64 queries] of the array transposed (one XLA transpose
before the launch) beside each query stage, so each compute warpgroup loads its 64 rows
in its tiles' layout; their rings take stages from the tiles
(`stages_beside_bias_blocks`). A bias's gradient is the dK/dV kernel's: each tile's dS' g
(keys on rows) is TMA-reduce-added in float32 into the transposed gradient at the
read's place, so rows and heads that share the bias (Evoformer's pair bias, read at
b // rows) are summed by the reduce-adds (not bitwise reproducible: not with
`backward_deterministic`); with KernelOptions.backward_batch_sum "loop" a bias shared by
many batch rows is summed by the Triton backward's batch loop after the kernels instead
(`backward.batch_loop_only`).

Relative reads (T5 buckets) take their values from runs (`mosaic_tiles.RunsTile`), or
where `relative_reads.diagonal_blocks` covers them and `dense_diagonals_in_backward`
says so (head dim 64), from their dense block diagonals' tiles, loaded straight from
global memory in both kernels (`mosaic_tiles.diagonal_loads`; the dK/dV kernel's
transposed outside), and one side value elsewhere.

What it covers is the forward kernel's set
(`mosaic_eligibility.unsupported_reason`), with gradients of the captured arrays read once
(`mosaic_eligibility.captured_gradient_unsupported_reason`): at indices of b and h only,
which the dQ kernel sums per query row (`accumulate_rows`, `captured_gradients`; from
the forward's row sums at head dim 64, `mosaic_eligibility.captured_row_sums`,
`accumulate_rows_from_forward`) or, fused, the dK/dV kernel per key from those row sums
(`accumulate_pair`, `pair_gradients`), or at
indices of kv_idx - q_idx (T5 tables), which the dK/dV kernel sums per key and table
entry (`accumulate_runs`, `relative_gradient`) with each row's exact delta from the dQ
kernel's row sums (`exact_delta`: the dQ kernel then runs first; for a bias read whose
tiles near the diagonal are dumped, the far tiles' share from the rows' totals,
`relative_totals`, so the dK/dV kernel skips their sums);
`pallas_flex.dispatch.choose_backward` sends the others to the Triton backward.
Accumulating those row sums after dQ's wgmma issue (P and dS' live beside its 16-bit
operand) cost 29 % at B4 S4096 D128 ALiBi (2.98 ms against 2.30 without the slopes'
gradient); before it, with the query-only part of the derivative on row sums, 10 %.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels import online_softmax
from pallas_flex.kernels.backward import batch_loop_only, prepare_operands
from pallas_flex.kernels.captured_gradients_mosaic import (
    TILES_PER_BLOCK, accumulate_pair, accumulate_rows, accumulate_rows_from_forward,
    ReducedDump, accumulate_runs, captured_gradients, clear_rows, exact_delta, over_keys,
    pair_gradients, relative_gradient, relative_totals)
from pallas_flex.kernels.bias_blocks_mosaic import (
    bias_block_reads, bias_block_sources, block_at, copy_block, ring, with_ring_readers)
from pallas_flex.kernels.forward_mosaic import (
    SHARED_MEMORY_BYTES, diagonal_inputs, tile_transforms)
from pallas_flex.kernels.mosaic_eligibility import (
    BLOCK, block_dtypes, block_positions, fuses_dq, relative_positions, tile_reads)
from pallas_flex.kernels.mosaic_tiles import (
    ROWS_PER_WARPGROUP, Affine, Vector, apply_mask, constant_value, diagonal_readers,
    evaluate, index_vector, issue, load_vector, materialize, padded_for_slices,
    reads_index, result,
    run_per_element_under_vmap, score_parts, split_tile_refs, tile_inputs, to_tile,
    vector_layout, with_accumulators)
from pallas_flex.kernels.padding import pad_axis
from pallas_flex.kernels.relative_reads import TILE, entry_count, entry_tables
from pallas_flex.kernels.tile_mods import unpadded_gradient
from pallas_flex.masks.mod_program import (
    constant_output, with_read_derivatives, with_score_derivative)

COMPUTE_WARPGROUPS = BLOCK // ROWS_PER_WARPGROUP
# Query rows of one dK/dV step: two [64, 64] float32 tiles (S^T, dP^T) next to the
# [64, D] dK and dV accumulators fit the compute warpgroups' registers at D 128, where
# 128 query rows would not.
Q_TILE = 64
# The run spans of a table's gradient are listed for 64 x 64 dK/dV tiles.
assert Q_TILE == ROWS_PER_WARPGROUP == TILE
# Tiles in flight per program by head dim, within the shared memory left next to each
# kernel's resident tiles (dQ: Q and dO [128, D], then K and V [128, D] per stage; dK/dV:
# K and V [128, D], then Q and dO [64, D] per stage): D 96 dQ 48 + 3 x 48 KiB, dK/dV
# 48 + 4 x 24 KiB. Tiles of D 32, 80 and 96 take a narrower swizzle
# (`forward_mosaic.tile_transforms`), as in the forward.
_DQ_STAGES = {32: 4, 64: 4, 80: 3, 96: 3, 128: 2}
# The dK/dV kernel that computes dQ too (`mosaic_eligibility.fuses_dq`) keeps dS^T and
# DQ_STAGING float32 [64, 64] dQ tiles per warpgroup in shared memory as well.
_FUSED_STAGES = {64: 4}
DQ_STAGING = 2
_FLOAT32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _float32_staging(buffers: int):
    """Per compute warpgroup, `buffers` float32 [64, 64] tiles that TMA reduce-adds read
    (the fused dQ's, a bias gradient's)."""
    return plgpu.SMEM((COMPUTE_WARPGROUPS, buffers, Q_TILE, Q_TILE), jnp.float32,
                      transforms=_FLOAT32_TRANSFORMS)
# Registers a thread of a compute / the memory warpgroup (setmaxnreg): 8 more for the
# compute warpgroups than the forward's (232, 40). H100, paired rounds, ms, 240 / 232:
# fused D 64 fwd+bwd (B8 H16 S2048) 1.235 / 1.287; two kernels at D 128 B4 H16 S4096
# 3.954 / 3.971 (ptxas spills 36 / 100 B), B1 S16384 14.91 / 14.98 (24 / 76 B). The
# forward lost with 240 (B4 D128 0.952 / 0.936, D64 0.350 / 0.343).
_REGISTERS = (240, 24)
# At D 128 the dK/dV kernel's stages hardly matter (H100, fwd+bwd, paired rounds, ms, 3 /
# 4 / 2 stages: B4 S4096 noop 4.017 / 4.023 / 4.024, causal 2.243 / 2.248 / 2.233; B1
# S16384 noop 15.20 / 15.24 / 15.22, causal 8.30 / 8.24 / 8.22): the stream is ahead.
_DKV_STAGES = {32: 4, 64: 4, 80: 4, 96: 4, 128: 3}
# A T5 table's dumped tiles summed by TMA reduce-adds in the dK/dV kernel, one [64, 64]
# tile a (batch, head, offset) (`captured_gradients_mosaic.ReducedDump`), instead of one
# a key tile summed after the kernel (~200 MB written and read at B8 H16 S2048 D64). The
# adds' order varies, so not with `backward_deterministic` (nor in interpret mode).
# H100, causal one-way T5, fwd+bwd, paired rounds, ms, reduced / per-tile dumps / no
# table gradient: B4 H16 S4096 D128 3.139 / 3.250 / 2.827; B8 S2048 D64 1.111 / 1.212 /
# 0.920; GQA 32:8 6.128 / 6.359 / 5.517; B1 S16384 9.703 / 9.699 / 8.706; table
# gradients within 8e-7 (relative) of the per-tile dumps'.
REDUCED_DUMPS = True


# Shared memory the kernels' row sums and captured-gradient sums may take beside the
# tiles and bias rings that `stages_beside_bias_blocks` counts.
_SUMS_MARGIN = 4 * 1024


class BackwardLayout(typing.NamedTuple):
    """How the backward kernels' shared memory is spent (`stages_beside_bias_blocks`):
    dQ kernel stages (None where the dK/dV kernel computes dQ), K/V tiles a BlockMask
    block is walked in by the dQ kernel (its tiles then [128 / parts, D]), dK/dV kernel
    stages, and staging buffers per bias gradient in the dK/dV kernel."""
    dq_stages: int | None
    dq_parts: int
    dkv_stages: int
    gradient_buffers: int


def stages_beside_bias_blocks(head_dim: int, dtype, dq_block_dtypes=(),
                              dkv_block_dtypes=(), *, fused: bool = False,
                              gradient_tiles: int = 0):
    """The kernels' `BackwardLayout`: `_DQ_STAGES` and `_DKV_STAGES` (fused:
    `_FUSED_STAGES`) of whole blocks, fewer where the rings of bias tensors read at
    (q_idx, kv_idx) (`bias_blocks_mosaic.bias_block_reads`; one dtype per read) take
    shared memory beside the tiles: a [128, keys] block per dQ stage (at D 128, 64-key
    tiles: 128-key K and V tiles leave no room for two stages beside 128-key blocks), a
    [128 keys, 64 queries] one per dK/dV stage, and `gradient_tiles` bias gradients'
    float32 [64, 64] staging tiles per dK/dV compute warpgroup (double-buffered, or single
    where two stages would not fit beside two buffers). At least two stages each; None
    if nothing fits."""
    itemsize = jnp.dtype(dtype).itemsize
    budget = SHARED_MEMORY_BYTES - _SUMS_MARGIN

    def fitted(planned, fixed, per_stage):
        for stages in range(planned, 1, -1):
            if fixed + stages * per_stage <= budget:
                return stages
        return None

    def ring_bytes(dtypes, rows, columns):
        return sum(rows * columns * jnp.dtype(t).itemsize for t in dtypes)

    dq_stages, dq_parts = (None if fused else _DQ_STAGES[head_dim]), 1
    if not fused and dq_block_dtypes:
        for dq_parts in (1, 2):
            keys = BLOCK // dq_parts  # Q and dO, lse and delta; K, V and blocks per stage
            dq_stages = fitted(_DQ_STAGES[head_dim] * dq_parts,
                               2 * BLOCK * head_dim * itemsize + 2 * BLOCK * 4,
                               2 * keys * head_dim * itemsize
                               + ring_bytes(dq_block_dtypes, BLOCK, keys))
            if dq_stages is not None:
                break
        if dq_stages is None:
            return None
    dkv_stages = (_FUSED_STAGES if fused else _DKV_STAGES)[head_dim]
    buffers = 2
    if dkv_block_dtypes:  # K and V (fused: dS^T, dQ staging); Q, dO, lse, delta per stage
        fixed = 2 * BLOCK * head_dim * itemsize
        if fused:
            fixed += (COMPUTE_WARPGROUPS * ROWS_PER_WARPGROUP * Q_TILE
                      * (itemsize + DQ_STAGING * 4))
        per_stage = (2 * Q_TILE * head_dim * itemsize + 2 * Q_TILE * 4
                     + ring_bytes(dkv_block_dtypes, BLOCK, Q_TILE))
        for buffers in (2, 1):
            staging = (gradient_tiles * COMPUTE_WARPGROUPS * buffers * ROWS_PER_WARPGROUP
                       * Q_TILE * 4)
            stages = fitted(dkv_stages, fixed + staging, per_stage)
            if stages is not None:
                break
        if stages is None:
            return None
        dkv_stages = stages
    return BackwardLayout(dq_stages, dq_parts, dkv_stages, buffers)


def _scores_to_logits(raw, *, score_program, score_reads, score_refs, scale, batch, head,
                      q_idx, kv_idx, tile, q_axis, q_start, kv_start, interpret,
                      block_readers=None):
    """(base-2 logits of a tile, d score_mod / d score or None where it is 1, the mod's
    base-2 term that depends on the query only, left out of the logits, or None: the
    caller subtracts it from the lse instead, once per query, as the forward added it,
    the derivatives of the values the mod read from the differentiated captured arrays,
    as they came out: `mosaic_tiles.split_rows` takes them apart). score_program computes
    the mod and its derivatives (`with_score_derivative` or `with_read_derivatives`);
    block_readers: its relative reads' dense block diagonals (`diagonal_loads`)."""
    if score_program is None:
        return raw * (scale * online_softmax.LOG2_E), None, None, []
    scores, derivative, *read_derivatives = evaluate(
        score_program, score_reads, score_refs,
        (Affine(raw, scale), batch, head, q_idx, kv_idx), tile=tile, q_axis=q_axis,
        q_start=q_start, kv_start=kv_start, interpret=interpret, keep_affine=True,
        block_readers=block_readers)
    scores, factor, query_term = score_parts(scores, tile, q_axis)
    if query_term is not None:
        query_term = query_term.value * online_softmax.LOG2_E
    logits = scores.astype(jnp.float32) * (factor * online_softmax.LOG2_E)
    derivative = materialize(derivative, tile)
    if constant_value(derivative) == 1.0:
        return logits, None, query_term, read_derivatives  # a bias: dS passes through
    return logits, to_tile(derivative, tile), query_term, read_derivatives


def dense_diagonals_in_backward(head_dim) -> bool:
    """Whether the backward kernels read relative reads' dense block diagonals
    (`mosaic_tiles.diagonal_loads`: tiles loaded from global memory there, one side value
    elsewhere) rather than their runs on every tile: not at head dim 128, where the
    dense tiles' gain on the band near the main diagonal is lost to the other tiles
    once the rows are long, and with a table's gradient everywhere (the suspect: each
    tile's branch between the dense tile and the side value, with dP's wgmma in flight
    across it; untested: walking the band apart from the other tiles, each walk with a
    static tile kind, would tell).
    H200, causal one-way T5 fwd+bwd, paired rounds, ms, dense / runs: a fixed table B4
    H16 S4096 D128 2.729 / 2.756 (an earlier host 2.684 / 2.839), GQA 32:8 5.297 / 5.316,
    B1 S16384 9.76 / 9.03; with the table's gradient B4 3.564 / 3.338 (in the dQ kernel
    only 3.474 / 3.228), B1 S16384 12.35 / 10.68 (dQ kernel only 11.91 / 10.56); at D64
    B8 H16 S2048 with the table's gradient 1.232 / 1.634, fixed 0.944 / 1.191. The side
    values loaded once a program instead of on every tile (in the dQ kernel and the
    forward) changed nothing: B1 S16384 fixed table 9.762 / 9.764, D64 with the table's
    gradient 1.277 / 1.279."""
    return head_dim != 128


def _dkdv_kernel(q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, full_num_ref,
                 full_indices_ref, partial_num_ref, partial_indices_ref, *refs, mask_program,
                 score_program, scale, group, num_stages, q_len, kv_len, broadcast_batch,
                 broadcast_heads, mask_reads, score_reads, masked_first, relative_entries,
                 dump_offsets, interpret, fuse_dq=False, pair_sites=0, diagonal_reads=(),
                 before_from_totals=(), reduced_dump=None, bias_blocks=(),
                 block_gradients=(), gradient_buffers=2):
    """relative_entries: per captured array read at indices of kv_idx - q_idx whose
    gradient is wanted (the score program's read derivatives g, in order), how many
    entries a (b, h) pair reaches: per key, dS' g summed by entry over the walk
    (`accumulate_runs`) and written per query head to its run_sums_ref
    [B, Hq, 2 num_kv_blocks, entries, 64]. dump_offsets: per such array, None or the
    (first, count) of its `relative_reads.Dump`, whose tiles go to its dump_ref
    [B Hq 2 num_kv_blocks count, 64 keys, 64 queries] instead. delta_ref then holds each
    row's exact delta (`exact_delta`). before_from_totals: per such array, whether
    `relative_gradient` takes its sums before the dump's offsets from the rows' totals
    (`relative_totals`), so the kernel skips them. reduced_dump: None, or the
    `ReducedDump` of the one dumped array, whose tiles are reduce-added into the float32
    accumulator after the outputs (in place of its dump output).
    fuse_dq: dQ too, added into the float32 dq_ref after the outputs (`_fused_dq`).
    pair_sites (with fuse_dq only): how many captured arrays read at indices of b and h
    (their read derivatives after those above) the kernel sums P dP (g - C) of per key,
    in registers, written per query head to their run_sums_ref [B, Hq, 2 num_kv_blocks,
    1, 64] (`accumulate_pair`); C, each row's sum P g from the forward, comes in
    row_sums_ref [B, Hq, pair_sites, S] (the last input).
    bias_blocks: the score program's reads of bias tensors at (q_idx, kv_idx)
    (`bias_blocks_mosaic.bias_block_reads`), whose arrays, their q and kv axes swapped,
    follow the dense diagonals' inputs: with each stage's query tile the memory
    warpgroup copies each one's [128 keys, 64 queries] block (two copies, one per compute
    warpgroup's keys, on the stage's barrier) into a ring of its own ([stages, 2, 64,
    64], the last shared-memory buffers), which each compute warpgroup loads keys on
    rows, as its tiles are.
    block_gradients: per bias block read whose gradient is wanted (not with fuse_dq),
    (its number among bias_blocks, its read derivative's among the score program's
    derivatives): each tile's dS' g (keys on rows) goes to a float32 staging tile (one of
    `gradient_buffers` in turn: the shared-memory buffers before the rings) and is
    TMA-reduce-added
    into the read's place of its float32 accumulator, the array transposed (after the
    other accumulators); in interpret mode, which has no reductions, written to the
    (batch, head)'s own slice of it."""
    mask_refs, score_refs, rest = split_tile_refs(
        refs, mask_program, mask_reads, score_program, score_reads)
    readers, rest = diagonal_readers(diagonal_reads, rest, interpret=interpret)
    transposed_biases, rest = rest[:len(bias_blocks)], rest[len(bias_blocks):]
    sites = len(relative_entries)
    # Three entry tables per array that sums its runs, none per dumped one.
    entry_refs, position = [], 0
    for offsets in dump_offsets:
        entry_refs.append(rest[position:position + (3 if offsets is None else 0)])
        position += len(entry_refs[-1])
    summed_sites = sites + pair_sites
    assert fuse_dq or not pair_sites
    row_sums_ref = rest[position] if pair_sites else None
    position += bool(pair_sites)
    # The float32 dQ the kernel adds into comes after its outputs, then the bias blocks'
    # gradients.
    gradient_refs = rest[len(rest) - 1 - len(block_gradients):len(rest) - 1]
    outputs_end = (len(rest) - 1 - fuse_dq - (reduced_dump is not None)
                   - len(block_gradients))
    dq_ref = rest[outputs_end] if fuse_dq else None
    dk_ref, dv_ref = rest[position:position + 2]
    run_sums_refs = rest[position + 2:position + 2 + summed_sites]
    dump_refs, scratch = iter(rest[position + 2 + summed_sites:outputs_end]), rest[-1]
    dump_refs = [None if offsets is None
                 else rest[outputs_end] if reduced_dump is not None else next(dump_refs)
                 for offsets in dump_offsets]
    (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *entry_smem), barriers = scratch
    block_rings = entry_smem[len(entry_smem) - len(bias_blocks):]
    entry_smem = entry_smem[:len(entry_smem) - len(bias_blocks)]
    gradient_staging = entry_smem[len(entry_smem) - len(block_gradients):]
    entry_smem = entry_smem[:len(entry_smem) - len(block_gradients)]
    assert not (fuse_dq and block_gradients)
    if fuse_dq:
        ds_smem, dq_staging, *entry_smem = entry_smem
    if pair_sites:  # per stage, the forward's row sums of the query tile
        row_sums_smem, *entry_smem = entry_smem
    staging = entry_smem.pop() if any(ref is not None for ref in dump_refs) else None
    kv_barriers, ready, consumed = barriers
    head_dim, value_dim = k_ref.shape[3], v_ref.shape[3]
    key_tiles = k_ref.shape[1] // ROWS_PER_WARPGROUP
    dtype = q_ref.dtype
    kv_head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    kv_block = lax.axis_index("kv_seq")  # block 0 has the longest causal column: first
    table_batch = 0 if broadcast_batch else batch
    last_listed = full_indices_ref.shape[-1] - 1
    walks = [(full_num_ref, full_indices_ref, False),
             (partial_num_ref, partial_indices_ref, True)]
    if masked_first:
        walks.reverse()

    def walk(visit, carry, after_member=None):
        """visit(step, head, q_start, masked, carry) on every 64-row query tile of the
        key block's column, for each query head of the group; step counts them all;
        carry = after_member(head, carry) after each head's tiles."""
        def member_walk(member, state):
            head = kv_head * group + member
            table = (table_batch, 0 if broadcast_heads else head, kv_block)
            for num_ref, indices_ref, masked in walks:
                def visit_tile(tile_number, state, indices_ref=indices_ref, masked=masked):
                    step, carry = state
                    listed = jnp.minimum(lax.div(tile_number, TILES_PER_BLOCK), last_listed)
                    q_start = (indices_ref[table + (listed,)] * BLOCK
                               + lax.rem(tile_number, TILES_PER_BLOCK) * Q_TILE)
                    return step + 1, visit(step, head, q_start, masked, carry)
                state = lax.fori_loop(0, num_ref[table] * TILES_PER_BLOCK, visit_tile, state)
            if after_member is not None:
                step, carry = state
                state = step, after_member(head, carry)
            return state
        if group == 1:
            return member_walk(0, (jnp.int32(0), carry))
        return lax.fori_loop(0, group, member_walk, (jnp.int32(0), carry))

    warpgroup = lax.axis_index("warpgroup")

    @pl.when(warpgroup < COMPUTE_WARPGROUPS)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[0], action="increase")
        k_smem, v_smem = k_smem2.at[warpgroup], v_smem2.at[warpgroup]
        kv_start = kv_block * BLOCK + warpgroup * ROWS_PER_WARPGROUP
        rows = (batch, pl.ds(kv_start, ROWS_PER_WARPGROUP), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_barriers.at[warpgroup])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_barriers.at[warpgroup])
        plgpu.barrier_wait(kv_barriers.at[warpgroup])

        tile = (ROWS_PER_WARPGROUP, Q_TILE)
        kv_idx = None
        if (reads_index(mask_program, mask_reads, "kv_idx")
                or reads_index(score_program, score_reads, "kv_idx")):
            # Padded key rows' gradients are sliced off.
            kv_idx = index_vector(kv_start, ROWS_PER_WARPGROUP, 0,
                                  below=kv_len if kv_len % BLOCK else None)
        # Per-step index vectors are built only in the steps that read them: an unused
        # one leaves Mosaic GPU's layout inference without a solution.
        needs_q_idx = {
            masked: (reads_index(score_program, score_reads, "q_idx")
                     or (masked and reads_index(mask_program, mask_reads, "q_idx")))
            for masked in (False, True)}
        mods = dict(tile=tile, q_axis=1, kv_start=kv_start, interpret=interpret)

        def visit(step, head, q_start, masked, carry):
            slot = lax.rem(step, jnp.int32(num_stages))
            plgpu.barrier_wait(ready.at[slot])
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            return with_accumulators(
                functools.partial(step_matmuls, q_tile, do_tile, slot, head, q_start, masked,
                                  step=step),
                carry[:2], (tile, tile), interpret=interpret, states=tuple(carry[2:]))

        def step_matmuls(q_tile, do_tile, slot, head, q_start, masked, carried, fresh,
                         states=(), step=None):
            """S^T and dP^T issued together; P^T computed while dP^T runs, then dV's
            wgmma issued; dS^T while dV runs; then dK's. states: per dumped array, the
            key sums of the tiles before and past its offsets."""
            (d_k, d_v), (scores_ref, d_probabilities_ref) = carried, fresh
            issue(scores_ref, k_smem, q_tile, transpose_b=True, interpret=interpret)
            issue(d_probabilities_ref, v_smem, do_tile, transpose_b=True, interpret=interpret)
            scores_t = result(scores_ref, in_flight_after=1, interpret=interpret)
            q_idx = None
            if needs_q_idx[masked]:
                q_idx = index_vector(q_start, Q_TILE, 1,
                                     below=q_len if q_len % BLOCK else None)
            logits, score_derivative, query_term, read_derivatives = _scores_to_logits(
                scores_t, score_program=score_program, score_reads=score_reads,
                score_refs=score_refs, scale=scale, batch=batch, head=head, q_idx=q_idx,
                block_readers=with_ring_readers(readers, bias_blocks, block_rings, slot,
                                                warpgroup, None, interpret),
                kv_idx=kv_idx, q_start=q_start, **mods)
            if masked:
                logits = apply_mask(logits, mask_program, mask_reads, mask_refs,
                                    (batch, head, q_idx, kv_idx), q_start=q_start, **mods)
            # lse_log2 is +inf on rows that attend to nothing and on padded rows: P = 0.
            lse_log2 = load_vector(lse_smem.at[slot], 1, interpret)
            if query_term is not None:
                lse_log2 = lse_log2 - query_term
            delta = load_vector(delta_smem.at[slot], 1, interpret)
            probabilities_t = jnp.exp2(logits - lax.broadcast_in_dim(lse_log2, tile, [1]))
            issue(d_v, probabilities_t.astype(dtype), do_tile, interpret=interpret)
            d_probabilities_t = result(d_probabilities_ref, in_flight_after=1,
                                       interpret=interpret)
            d_scores_t = probabilities_t * (d_probabilities_t
                                            - lax.broadcast_in_dim(delta, tile, [1]))
            if score_derivative is not None:
                d_scores_t_weighted = d_scores_t * score_derivative
            else:
                d_scores_t_weighted = d_scores_t
            sums_of_sites = functools.partial(
                accumulate_sites, d_scores_t, read_derivatives, states, head, q_start,
                pair_terms=(probabilities_t, d_probabilities_t, slot))
            if fuse_dq:
                _fused_dq(d_scores_t_weighted.astype(dtype), d_k, q_tile, step, slot, head,
                          q_start, while_dk_runs=sums_of_sites)
                return
            issue(d_k, d_scores_t_weighted.astype(dtype), q_tile, interpret=interpret)
            # While dK's wgmma runs (after it: 4.64 against 4.58 ms at B4 S4096 D128).
            sums_of_sites()
            add_block_gradients(d_scores_t, read_derivatives, step, head, q_start)
            # The slot is released once dK's wgmma has read it: reading the accumulators
            # at the end of `with_accumulators` waits for every wgmma of the step.
            result(d_k, in_flight_after=0, interpret=interpret)
            plgpu.barrier_arrive(consumed.at[slot])

        def add_block_gradients(d_scores_t, read_derivatives, step, head, q_start):
            """dS' g of each bias block read whose gradient is wanted, reduce-added into
            its place in the transposed gradient (see block_gradients)."""
            if not block_gradients:
                return
            buffer = lax.rem(step, jnp.int32(gradient_buffers))
            # This step's copies reuse the buffers of `gradient_buffers` steps ago: those
            # copies (with two buffers, the previous step's may still run) have read them.
            plgpu.wait_smem_to_gmem(len(block_gradients) * (gradient_buffers - 1),
                                    wait_read_only=True)
            sources = bias_block_sources(
                [bias_blocks[number] for number, _ in block_gradients],
                [ref.at[batch, head] if interpret else ref for ref in gradient_refs],
                batch, head)
            for (_, derivative_number), staging_tile, source in zip(
                    block_gradients, gradient_staging, sources):
                target, index, q_axis, kv_axis = source
                derivative = materialize(read_derivatives[derivative_number], tile)
                gradient = d_scores_t
                if constant_value(derivative) != 1.0:
                    gradient = gradient * to_tile(derivative, tile)
                staging_tile.at[warpgroup, buffer][...] = gradient
                plgpu.commit_smem()
                # (q_axis holds the keys, kv_axis the queries)
                at = block_at(index, (q_axis, kv_axis), kv_start, ROWS_PER_WARPGROUP,
                              q_start, Q_TILE)
                if interpret:  # each (batch, head) its own slice: no reductions there
                    plgpu.copy_smem_to_gmem(staging_tile.at[warpgroup, buffer],
                                            target.at[at])
                else:
                    plgpu.copy_smem_to_gmem(staging_tile.at[warpgroup, buffer],
                                            target.at[at], reduction_op="add")

        def accumulate_sites(d_scores_t, read_derivatives, states, head, q_start,
                             pair_terms):
            """dS' g of each differentiated read at kv_idx - q_idx summed by table entry
            (`accumulate_runs`; the states: two per dumped table), then P dP (g - C) of
            each read at b and h into per-key register sums (one state each,
            `accumulate_pair`; pair_terms: P^T, dP^T and the stage of the tile's C)."""
            states = iter(states)
            for site, derivative in enumerate(read_derivatives[:sites]):
                dump = None
                if dump_refs[site] is not None:
                    first_offset, count = dump_offsets[site]
                    # Slots [B, Hq, key tiles, count] flattened (or a reduced dump's).
                    key_tile = kv_block * COMPUTE_WARPGROUPS + warpgroup
                    if reduced_dump is None:
                        first_slot = ((batch * q_ref.shape[2] + head) * key_tiles
                                      + key_tile) * count
                    else:  # [Bd, Hq, count] flattened
                        dump_batch = 0 if reduced_dump.batch == 1 else batch
                        first_slot = (dump_batch * q_ref.shape[2] + head) * count
                    dump = (dump_refs[site], staging.at[warpgroup], first_offset, count,
                            first_slot, (next(states), next(states)),
                            bool(before_from_totals) and before_from_totals[site],
                            reduced_dump)
                accumulate_runs(entry_smem[site].at[warpgroup], d_scores_t, derivative,
                                 entry_refs[site], dump, batch=batch, head=head,
                                 q_start=q_start, kv_start=kv_start, tile=tile,
                                 interpret=interpret)
            if pair_sites:
                probabilities_t, d_probabilities_t, slot = pair_terms
                products = probabilities_t * d_probabilities_t
                for index, derivative in enumerate(read_derivatives[sites:]):
                    accumulate_pair(next(states), products, derivative,
                                     load_vector(row_sums_smem.at[slot, index], 1, interpret),
                                     tile)

        def _fused_dq(d_scores_t, d_k, q_tile, step, slot, head, q_start, while_dk_runs):
            """dK += dS^T Q, and dQ[q tile] += dS K over this warpgroup's 64 keys (head
            dim 64: one [64, 64] tile): dS^T goes to shared memory, which dK's wgmma
            reads, and dQ's transposed; the float32 dQ tile is added into dq_ref with a
            TMA reduce-add from a staging tile (interpret mode: written to this key
            tile's own partial sums)."""
            d_scores_tile = ds_smem.at[warpgroup]
            d_scores_tile[...] = d_scores_t
            plgpu.commit_smem()  # visible to wgmma (the async proxy)
            issue(d_k, d_scores_tile, q_tile, interpret=interpret)
            while_dk_runs()

            def dq_matmul(_, fresh):
                (d_q,) = fresh
                issue(d_q, d_scores_tile, k_smem, transpose_a=True, interpret=interpret)
                d_q = result(d_q, in_flight_after=0, interpret=interpret)  # and dK, dV's
                plgpu.barrier_arrive(consumed.at[slot])
                buffer = lax.rem(step, jnp.int32(DQ_STAGING))
                # The copy from this buffer DQ_STAGING steps ago has read it.
                plgpu.wait_smem_to_gmem(DQ_STAGING - 1, wait_read_only=True)
                dq_staging.at[warpgroup, buffer][...] = d_q
                plgpu.commit_smem()
                q_rows = (batch, pl.ds(q_start, Q_TILE), head)
                if interpret:  # no TMA reductions there: each key tile sums its own
                    plgpu.copy_smem_to_gmem(dq_staging.at[warpgroup, buffer],
                                            dq_ref.at[(kv_block, warpgroup) + q_rows])
                else:
                    plgpu.copy_smem_to_gmem(dq_staging.at[warpgroup, buffer],
                                            dq_ref.at[q_rows], reduction_op="add")
            with_accumulators(dq_matmul, [], [(Q_TILE, Q_TILE)], interpret=interpret)

        zeros = functools.partial(jnp.full, fill_value=0.0, dtype=jnp.float32)
        carry = (plgpu.layout_cast(zeros((ROWS_PER_WARPGROUP, head_dim)), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(zeros((ROWS_PER_WARPGROUP, value_dim)), plgpu.Layout.WGMMA))
        # Per dumped array, two key sums carried in registers
        # (`captured_gradients_mosaic._dump_or_add`), then one per pair site
        # (`accumulate_pair`).
        no_sums = plgpu.layout_cast(zeros((ROWS_PER_WARPGROUP,)), vector_layout(0))
        carry += (no_sums,) * (2 * sum(ref is not None for ref in dump_refs) + pair_sites)
        for site in range(sites):
            if dump_refs[site] is None:
                clear_rows(entry_smem[site].at[warpgroup])

        def flush(head, carry):
            """The head's entry sums to its slot of run_sums_ref (a dumped array's from
            the carry); the sums zeroed."""
            sums = iter(carry[2:])
            for site in range(sites):
                if dump_refs[site] is not None:
                    for row in range(2):
                        entry_smem[site].at[warpgroup, row][...] = next(sums)
            for site in range(sites, summed_sites):
                entry_smem[site].at[warpgroup, 0][...] = next(sums)
            plgpu.commit_smem()
            for site in range(summed_sites):
                plgpu.copy_smem_to_gmem(
                    entry_smem[site].at[warpgroup],
                    run_sums_refs[site].at[batch, head, kv_block * COMPUTE_WARPGROUPS + warpgroup],
                    commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            for site in range(sites):
                if dump_refs[site] is None:
                    clear_rows(entry_smem[site].at[warpgroup])
            return list(carry[:2]) + [no_sums] * (len(carry) - 2)

        _, (d_k, d_v, *_) = walk(visit, list(carry), flush if summed_sites else None)
        if fuse_dq:
            plgpu.wait_smem_to_gmem(0)
        k_smem[...] = (d_k * scale).astype(dtype)
        v_smem[...] = d_v.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    @pl.when(warpgroup == COMPUTE_WARPGROUPS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[1], action="decrease")

        def fetch(step, head, q_start, masked, carry):
            slot = lax.rem(step, jnp.int32(num_stages))

            @pl.when(step >= num_stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            rows = (batch, pl.ds(q_start, Q_TILE), head)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(d_out_ref.at[rows], do_smem.at[slot], ready.at[slot])
            vector = (batch, head, pl.ds(q_start, Q_TILE))
            plgpu.copy_gmem_to_smem(lse_ref.at[vector], lse_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem.at[slot], ready.at[slot])
            if pair_sites:
                plgpu.copy_gmem_to_smem(
                    row_sums_ref.at[batch, head, :, pl.ds(q_start, Q_TILE)],
                    row_sums_smem.at[slot], ready.at[slot])
            # Each bias block: the transposed array's [keys, queries] rows of both
            # compute warpgroups' keys (its q axis holds the keys, its kv axis the
            # queries).
            for source, ring_ref in zip(
                    bias_block_sources(bias_blocks, transposed_biases, batch, head),
                    block_rings):
                copy_block(source, kv_block * BLOCK, q_start, Q_TILE, ring_ref, slot,
                           ready.at[slot])
            return carry

        num_steps, _ = walk(fetch, ())
        _drain((consumed,), num_steps, num_stages)


def _drain(consumed, num_steps, num_stages):
    """Waits for the last `num_stages` steps' releases, so that every phase of the release
    barriers is waited on once (Mosaic GPU's interpreter checks that; the hardware only
    idles the memory warpgroup until the compute warpgroups finish)."""
    @pl.loop(jnp.maximum(num_steps - num_stages, 0), num_steps)
    def _(step):
        for barrier in consumed:
            plgpu.barrier_wait(barrier.at[lax.rem(step, jnp.int32(num_stages))])


def _dq_kernel(q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, full_num_ref,
               full_indices_ref, partial_num_ref, partial_indices_ref, *refs, mask_program,
               score_program, scale, group, num_stages, num_q_blocks, q_len, kv_len,
               broadcast_batch, broadcast_heads, mask_reads, score_reads, masked_first,
               row_count, interpret, forward_sites=0, diagonal_reads=(), bias_blocks=(),
               parts_per_block=1):
    """row_count: 0; 1 (sum P dP, the exact deltas only); or 2 + 2 n for the n captured
    arrays read at indices of b and h whose gradients the program accumulates (the score
    program's read derivatives g):
    per query row, sums over the row's keys written to rows_ref [row_count, B, Hq, S]
    (`accumulate_rows`, `captured_gradients`, `exact_delta`).
    forward_sites: n > 0 where the forward gave those arrays' row sums C (the last input,
    [B, Hq, n, S]): then the rows are sum P dP if row_count is n + 1, and per array
    sum P dP (g - C) (`accumulate_rows_from_forward`, `pair_gradients`).
    bias_blocks: the score program's reads of bias tensors at (q_idx, kv_idx)
    (`bias_blocks_mosaic.bias_block_reads`): the memory warpgroup copies each K/V tile's
    [128, 128] block of each by TMA into a ring of its own ([stages, 2, 64, 128], the
    last shared-memory buffers; a barrier per stage, the last barriers) after the tile's
    K, whose release follows the mod's read; each compute warpgroup loads its 64 rows.
    parts_per_block: K/V tiles a BlockMask block is walked in (`BackwardLayout.dq_parts`:
    2 beside D 128's bias blocks); the walk's steps are those tiles."""
    mask_refs, score_refs, rest = split_tile_refs(
        refs, mask_program, mask_reads, score_program, score_reads)
    readers, rest = diagonal_readers(diagonal_reads, rest, interpret=interpret)
    forward_sums_ref = rest[0] if forward_sites else None
    dq_ref, *rows_ref, scratch = rest[bool(forward_sites):]
    (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem, *rows_smem), barriers = scratch
    block_rings = rows_smem[len(rows_smem) - len(bias_blocks):]
    rows_smem = rows_smem[:len(rows_smem) - len(bias_blocks)]
    if forward_sites:  # the forward's row sums of the warpgroup's queries
        forward_sums_smem, *rows_smem = rows_smem
    row_barriers, k_ready, v_ready, k_consumed, v_consumed, *block_barriers = barriers
    head_dim = q_ref.shape[3]
    dtype = q_ref.dtype
    q_block = num_q_blocks - 1 - lax.axis_index("q_seq")  # longest causal rows first
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    table = (0 if broadcast_batch else batch, 0 if broadcast_heads else head, q_block)
    last_listed = full_indices_ref.shape[-1] - 1
    first_num, first_indices, second_indices = (
        (partial_num_ref, partial_indices_ref, full_indices_ref) if masked_first
        else (full_num_ref, full_indices_ref, partial_indices_ref))
    num_first = first_num[table]
    num_steps = full_num_ref[table] + partial_num_ref[table]

    def kv_block_of(step):
        first = first_indices[table + (jnp.minimum(step, last_listed),)]
        second = second_indices[table + (jnp.clip(step - num_first, 0, last_listed),)]
        return jnp.where(step < num_first, first, second)

    keys = BLOCK // parts_per_block  # a K/V tile's

    def first_key(tile_step):
        """The first key of the walk's K/V tile `tile_step`."""
        if parts_per_block == 1:
            return kv_block_of(tile_step) * BLOCK
        return (kv_block_of(lax.div(tile_step, jnp.int32(parts_per_block))) * BLOCK
                + lax.rem(tile_step, jnp.int32(parts_per_block)) * keys)

    warpgroup = lax.axis_index("warpgroup")

    @pl.when(warpgroup < COMPUTE_WARPGROUPS)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[0], action="increase")
        q_smem, do_smem = q_smem2.at[warpgroup], do_smem2.at[warpgroup]
        q_start = q_block * BLOCK + warpgroup * ROWS_PER_WARPGROUP
        rows = (batch, pl.ds(q_start, ROWS_PER_WARPGROUP), head)
        vector = (batch, head, pl.ds(q_start, ROWS_PER_WARPGROUP))
        barrier = row_barriers.at[warpgroup]
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, barrier)
        plgpu.copy_gmem_to_smem(d_out_ref.at[rows], do_smem, barrier)
        plgpu.copy_gmem_to_smem(lse_ref.at[vector], lse_smem2.at[warpgroup], barrier)
        plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem2.at[warpgroup], barrier)
        if forward_sites:
            plgpu.copy_gmem_to_smem(
                forward_sums_ref.at[batch, head, :, pl.ds(q_start, ROWS_PER_WARPGROUP)],
                forward_sums_smem.at[warpgroup], barrier)
        plgpu.barrier_wait(barrier)
        tile = (ROWS_PER_WARPGROUP, keys)
        # Row vectors, spread over each tile where used (as tiles they would hold 64
        # registers a thread each for the whole walk).
        lse_log2 = load_vector(lse_smem2.at[warpgroup], 0, interpret)
        delta = load_vector(delta_smem2.at[warpgroup], 0, interpret)
        forward_sums = [load_vector(forward_sums_smem.at[warpgroup, site], 0, interpret)
                        for site in range(forward_sites)]

        q_idx = None
        if (reads_index(mask_program, mask_reads, "q_idx")
                or reads_index(score_program, score_reads, "q_idx")):
            q_idx = index_vector(q_start, ROWS_PER_WARPGROUP, 0,
                                 below=q_len if q_len % BLOCK else None)
        # Keys past a ragged tail sit in partial blocks only: those mask them (their
        # rows of K and V are zeros, but P there is not).
        clamps_key_tail = kv_len % BLOCK != 0
        # Per-step index vectors are built only in the steps that read them: an unused
        # one leaves Mosaic GPU's layout inference without a solution.
        needs_kv_idx = {
            masked: (reads_index(score_program, score_reads, "kv_idx")
                     or (masked and (clamps_key_tail
                                     or reads_index(mask_program, mask_reads, "kv_idx"))))
            for masked in (False, True)}
        mods = dict(tile=tile, q_axis=0, q_start=q_start, interpret=interpret)

        def visit(step, carry, masked):
            slot = lax.rem(step, jnp.int32(num_stages))
            d_q, *rows = carry
            return tuple(with_accumulators(
                functools.partial(step_matmuls, step, slot, masked), [d_q], (tile, tile),
                interpret=interpret, states=rows))

        def step_matmuls(step, slot, masked, carried, fresh, rows=()):
            """S and dP issued together; P computed while dP runs; then dQ's wgmma."""
            (d_q,), (scores_ref, d_probabilities_ref) = carried, fresh
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            plgpu.barrier_wait(k_ready.at[slot])
            issue(scores_ref, q_smem, k_tile, transpose_b=True, interpret=interpret)
            plgpu.barrier_wait(v_ready.at[slot])
            issue(d_probabilities_ref, do_smem, v_tile, transpose_b=True, interpret=interpret)
            scores = result(scores_ref, in_flight_after=1, interpret=interpret)
            kv_start = first_key(step)
            kv_idx = kv_position = None
            if needs_kv_idx[masked]:
                kv_position = index_vector(kv_start, keys, 1)
                # The unclamped positions mask the key tail: one iota for both.
                kv_idx = (Vector(jnp.minimum(kv_position.value, kv_len - 1), 1)
                          if clamps_key_tail else kv_position)
            logits, score_derivative, query_term, read_derivatives = _scores_to_logits(
                scores, score_program=score_program, score_reads=score_reads,
                score_refs=score_refs, scale=scale, batch=batch, head=head, q_idx=q_idx,
                block_readers=with_ring_readers(readers, bias_blocks, block_rings, slot,
                                                warpgroup, block_barriers, interpret),
                kv_idx=kv_idx, kv_start=kv_start, **mods)
            if masked:
                key_tail = (Vector(kv_position.value < kv_len, 1) if clamps_key_tail
                            else None)
                logits = apply_mask(logits, mask_program, mask_reads, mask_refs,
                                    (batch, head, q_idx, kv_idx), extra_keep=key_tail,
                                    kv_start=kv_start, **mods)
            row_lse = lse_log2 if query_term is None else lse_log2 - query_term
            probabilities = jnp.exp2(logits - lax.broadcast_in_dim(row_lse, tile, [0]))
            d_probabilities = result(d_probabilities_ref, in_flight_after=0,
                                     interpret=interpret)
            plgpu.barrier_arrive(v_consumed.at[slot])
            d_scores = probabilities * (d_probabilities
                                        - lax.broadcast_in_dim(delta, tile, [0]))
            if rows and forward_sites:
                accumulate_rows_from_forward(rows, probabilities * d_probabilities,
                                              read_derivatives, forward_sums, tile)
            elif rows:
                # Before dQ's wgmma: after it, P and dS' would stay live next to the
                # 16-bit dS it reads from registers.
                accumulate_rows(rows, probabilities, d_probabilities, d_scores,
                                 read_derivatives, tile)
            if score_derivative is not None:
                d_scores = d_scores * score_derivative
            issue(d_q, d_scores.astype(dtype), k_tile, interpret=interpret)
            result(d_q, in_flight_after=0, interpret=interpret)
            plgpu.barrier_arrive(k_consumed.at[slot])

        d_q = plgpu.layout_cast(jnp.full((ROWS_PER_WARPGROUP, head_dim), 0.0, jnp.float32),
                                plgpu.Layout.WGMMA)
        row_sums = tuple(
            plgpu.layout_cast(jnp.full((ROWS_PER_WARPGROUP,), 0.0, jnp.float32),
                              vector_layout(0))
            for _ in range(row_count))
        carry = (d_q, *row_sums)
        carry = lax.fori_loop(0, num_first * parts_per_block,
                              functools.partial(visit, masked=masked_first), carry)
        d_q, *row_sums = lax.fori_loop(num_first * parts_per_block,
                                       num_steps * parts_per_block,
                                       functools.partial(visit, masked=not masked_first),
                                       carry)
        q_smem[...] = (d_q * scale).astype(dtype)
        for index, row_sum in enumerate(row_sums):
            rows_smem[0].at[warpgroup, index][...] = row_sum
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows], commit_group=False)
        for index in range(len(row_sums)):
            plgpu.copy_smem_to_gmem(rows_smem[0].at[warpgroup, index],
                                    rows_ref[0].at[(index,) + vector], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    @pl.when(warpgroup == COMPUTE_WARPGROUPS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[1], action="decrease")
        kv_head = lax.div(head, jnp.int32(group))
        block_sources = bias_block_sources(
            bias_blocks, [score_refs[position] for _, position, _, _ in bias_blocks],
            batch, head)

        @pl.loop(0, num_steps * parts_per_block)
        def _fetch(step):
            slot = lax.rem(step, jnp.int32(num_stages))
            start = first_key(step)
            rows = (batch, pl.ds(start, keys), kv_head)

            @pl.when(step >= num_stages)
            def _():
                plgpu.barrier_wait(k_consumed.at[slot])

            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            # (the ring's slot is released with K's, after the mod has read it)
            for source, ring_ref, barrier in zip(block_sources, block_rings, block_barriers):
                copy_block(source, q_block * BLOCK, start, keys, ring_ref, slot,
                           barrier.at[slot])

            @pl.when(step >= num_stages)
            def _():
                plgpu.barrier_wait(v_consumed.at[slot])

            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        _drain((k_consumed, v_consumed), num_steps * parts_per_block, num_stages)


def flex_attention_backward_mosaic(q, k, v, out, lse, d_out, d_lse, block_mask,
                                   score_program, *, scale: float, interpret: bool,
                                   masked_first: bool = True, gradient_positions=(),
                                   deterministic: bool = False, row_sums=(),
                                   batch_loop_positions=(), options=None):
    """(dq, dk, dv, const_grads) of FlexAttention, as `backward.flex_attention_backward`,
    only for calls the Mosaic GPU forward takes. const_grads: per captured array of the
    score_mod, its gradient for those at `gradient_positions` (each read once at indices
    of b and h only, of kv_idx - q_idx, or as [q, kv] blocks:
    `mosaic_eligibility.captured_gradient_unsupported_reason`), else None.
    deterministic: every gradient bitwise reproducible run to run (no dQ fused into the
    dK/dV kernel, `mosaic_eligibility.fuses_dq`). row_sums: () or, per position read at
    b and h, the forward's row sums [B, Hq, Sq] (`mosaic_tiles.weighted_row_sums`), with
    which the fused kernel takes those arrays' gradients. batch_loop_positions: captured
    arrays whose gradients the Triton backward's batch loop sums
    (`backward.batch_loop_positions`: a pair bias shared by an MSA's rows, read as
    blocks here) with KernelOptions `options`, after these kernels."""
    launch = prepare_operands(q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                              scale, pad_head_dims=False)
    tables = (block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
              block_mask.kv_num_blocks, block_mask.kv_indices,
              block_mask.full_q_num_blocks, block_mask.full_q_indices,
              block_mask.q_num_blocks, block_mask.q_indices)
    gradient_positions = tuple(gradient_positions)
    relative = relative_positions(score_program, gradient_positions)
    blocks = block_positions(score_program, gradient_positions)
    pair_positions = tuple(p for p in gradient_positions
                           if p not in relative and p not in blocks)
    padded_q_len, padded_kv_len = launch.q.shape[1], launch.k.shape[1]
    entries = [entry_tables(score_program, tile_reads(score_program), position,
                            q.shape[0], q.shape[2], padded_q_len, padded_kv_len)
               for position in relative]
    padded_d_lse = (None if d_lse is None or not relative
                    else pad_axis(d_lse.astype(jnp.float32), 2, padded_q_len))
    dumps = [dump for _, _, dump in entries]
    # Where a dumped read is a bias (its derivative 1), its sums before the dump come from
    # the rows' totals (`relative_totals`), which take the dQ kernel's sum dS' and sum P:
    # not where the forward's row sums of reads at b and h replace those.
    dumped_reads = [dump for dump in dumps if dump is not None]
    before_from_totals = (False,) * len(dumps)
    if dumped_reads and not (pair_positions and row_sums):
        derivatives = with_read_derivatives(score_program, relative)
        before_from_totals = tuple(
            dump is not None and constant_output(derivatives, 2 + i) == 1.0
            for i, dump in enumerate(dumps))
    fuse_dq = fuses_dq(q.shape[3], gradient_positions, deterministic, relative,
                       forward_row_sums=bool(row_sums), block_positions=blocks)
    reduced = None
    if REDUCED_DUMPS and not interpret and not deterministic and len(dumped_reads) == 1:
        reduced = ReducedDump(batch=dumped_reads[0].entries.shape[0],
                              keys_below=k.shape[1] if k.shape[1] % TILE else None)
    stacked_row_sums = None
    if row_sums and pair_positions:
        if len(row_sums) != len(pair_positions):
            raise ValueError(f"{len(row_sums)} row sums for the {len(pair_positions)} "
                             "captured arrays read at b and h whose gradients are wanted")
        stacked_row_sums = pad_axis(jnp.stack([x.astype(jnp.float32) for x in row_sums],
                                              axis=2), 3, padded_q_len)
    run = run_per_element_under_vmap(functools.partial(
        _launch, q_len=q.shape[1], kv_len=k.shape[1], scale=scale, interpret=interpret,
        masked_first=masked_first, pair_positions=pair_positions,
        relative_positions=relative,
        dump_offsets=tuple(None if dump is None else (dump.first_offset, dump.count)
                           for dump in dumps),
        before_from_totals=before_from_totals, fuse_dq=fuse_dq, reduced_dump=reduced,
        block_positions=blocks))
    d_q, d_k, d_v, *sums = run(launch.q, launch.k, launch.v, launch.d_out, launch.lse_log2,
                               launch.delta, padded_d_lse,
                               tuple(t.astype(jnp.int32) for t in tables),
                               # The run counts stay out: each tile's span bounds its loop.
                               tuple(() if tables is None else tables[1:]
                                     for tables, _, _ in entries),
                               block_mask.mask_mod, score_program, stacked_row_sums)
    const_grads = [None] * (len(score_program.consts) if score_program is not None else 0)
    # After dq, dk, dv: the dQ kernel's row sums (two kernels, where the gradient of an
    # array read at b and h or at kv_idx - q_idx is wanted), then the dK/dV kernel's
    # sums per relative read, per read at b and h (fused), then one dump per relative
    # read that has one; last, the bias blocks' gradients.
    axes_of = {position: axes for _, position, axes, _ in bias_block_reads(
        score_program, tile_reads(score_program, blocks=True))}
    for position, gradient in zip(blocks, sums[len(sums) - len(blocks):]):
        original = score_program.consts[position]
        # Past the sequences, the kernel's tiles hold whatever the padded keys' scores
        # gave (the dK/dV kernel does not mask them: their rows are sliced off): zeros
        # there, then the entries past the array's end (clamped reads) fold into its last.
        for axis, length in zip(axes_of[position], (q.shape[1], k.shape[1])):
            if gradient.shape[axis] > length:
                inside = lax.broadcasted_iota(jnp.int32, gradient.shape, axis) < length
                gradient = jnp.where(inside, gradient, 0.0)
        const_grads[position] = unpadded_gradient(gradient, jnp.shape(original)).astype(
            original.dtype)
    sums = sums[:len(sums) - len(blocks)]
    rows = sums.pop(0) if (pair_positions or relative) and not fuse_dq else None
    run_sums = sums[:len(relative)]
    pair_sums = sums[len(relative):len(relative) + len(pair_positions)] if fuse_dq else []
    dumped = iter(sums[len(relative) + len(pair_sums):])
    grads = []
    if pair_positions and stacked_row_sums is not None:
        # Per (b, h), sum P dP (g - C): the fused kernel's per key, the dQ kernel's per row.
        per_pair = ([over_keys(sums, k.shape[1])[..., 0] for sums in pair_sums] if fuse_dq
                    else list(jnp.sum(rows[-len(pair_positions):, :, :, :q.shape[1]],
                                      axis=-1)))
        grads = pair_gradients(per_pair, row_sums, d_lse, score_program, pair_positions)
    elif pair_positions:
        grads = captured_gradients(rows, launch.delta, d_lse, score_program, pair_positions,
                                    q.shape[1])
    for position, grad in zip(pair_positions, grads):
        const_grads[position] = grad
    totals = (relative_totals(rows, launch.delta, padded_d_lse, q.shape[1])
              if any(before_from_totals) else None)
    for position, run_sum, (_, flat, dump), from_totals in zip(
            relative, run_sums, entries, before_from_totals):
        const_grads[position] = relative_gradient(
            run_sum, None if dump is None else next(dumped), flat, dump,
            score_program.consts[position], block_mask, k.shape[1],
            totals=totals if from_totals else None,
            reduced=None if dump is None else reduced)
    if batch_loop_positions:
        looped = batch_loop_only(q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                                 scale=scale, options=options, interpret=interpret,
                                 positions=tuple(batch_loop_positions))
        for position, grad in looped.items():
            original = score_program.consts[position]
            const_grads[position] = grad.reshape(jnp.shape(original)).astype(original.dtype)
    return d_q[:, :q.shape[1]], d_k[:, :k.shape[1]], d_v[:, :k.shape[1]], const_grads


def _launch_fused(call, dkv_scratch, q, k, v, d_out, lse_log2, delta, q_tables,
                  dkv_program, dkv_reads, captured_for, settings, num_kv_blocks, sites,
                  row_sums, stages, bias_blocks):
    """The dK/dV kernel computing dQ too (`mosaic_eligibility.fuses_dq`): (dq, dk, dv, then
    the sums of the captured arrays' reads, `sites`' outputs). dQ is summed in float32
    over the key blocks by TMA reduce-adds into a zeroed array (`jax.new_ref`), in
    whatever order the programs reach it. row_sums: [B, Hq, pair_sites, S] or None."""
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    interpret = settings["interpret"]
    # dS^T and the float32 dQ staging tiles, per compute warpgroup, then the sites' sums.
    extra_smem = (
        plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, Q_TILE), q.dtype,
                   transforms=tile_transforms(Q_TILE)),
        _float32_staging(DQ_STAGING))
    # (The sites' sums take a few KiB: the stages, `stages_beside_bias_blocks`', fit
    # beside them.)
    if sites.pair_sites:  # per stage, the query tile's row sums from the forward
        extra_smem += (plgpu.SMEM((stages, sites.pair_sites, Q_TILE), jnp.float32),)
    extra_smem += sites.smem
    diagonal_reads, captured = captured_for(dkv_program, dkv_reads, keys_on_rows=True)
    dkv = functools.partial(_dkdv_kernel, num_stages=stages, score_program=dkv_program,
                            score_reads=dkv_reads, diagonal_reads=diagonal_reads,
                            relative_entries=sites.relative_entries,
                            dump_offsets=sites.dump_offsets, pair_sites=sites.pair_sites,
                            fuse_dq=True, bias_blocks=bias_blocks, **settings)
    # A stage's copies: Q, dO, lse, delta, and the row sums.
    scratch, num_smem = dkv_scratch(stages, extra_smem,
                                    ready_arrivals=4 + bool(sites.pair_sites))
    # Interpret mode has no TMA reductions: there every key tile (key block and
    # warpgroup) writes partial sums of its own, summed here.
    parts = () if not interpret else (num_kv_blocks, COMPUTE_WARPGROUPS)
    accumulator = jax.new_ref(jnp.zeros(parts + q.shape, jnp.float32))
    d_k, d_v, *site_sums = call(
        dkv, (q, k, v, d_out, lse_log2, delta), q_tables,
        (*captured, *sites.tables, *(() if row_sums is None else (row_sums,))),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
         *sites.out_types),
        {"heads": kv_heads, "kv_seq": num_kv_blocks, "batch": batch},
        scratch, num_smem, accumulators=(accumulator,))
    d_q = accumulator[...]
    if interpret:
        d_q = d_q.sum(axis=(0, 1))
    return ((d_q * settings["scale"]).astype(q.dtype), d_k, d_v, *site_sums)


class _Sites:
    """The dK/dV kernel's sums of differentiated captured reads: per array read at
    kv_idx - q_idx its entry count and dump, the number of arrays read at b and h it
    sums (fused only), their shared-memory buffers, entry tables and outputs."""

    def __init__(self, relative_entries, dump_offsets, pair_sites, batch, q_heads,
                 num_kv_blocks, entry_tables_, reduced=False):
        self.relative_entries, self.dump_offsets = relative_entries, dump_offsets
        self.pair_sites = pair_sites
        # A dumped table's sums have two rows (the tiles before and past its offsets); an
        # array read at b and h one.
        rows = tuple(entries if offsets is None else 2
                     for entries, offsets in zip(relative_entries, dump_offsets))
        rows += (1,) * pair_sites
        self.smem = tuple(plgpu.SMEM((COMPUTE_WARPGROUPS, count, ROWS_PER_WARPGROUP),
                                     jnp.float32) for count in rows)
        self.out_types = tuple(
            jax.ShapeDtypeStruct((batch, q_heads, COMPUTE_WARPGROUPS * num_kv_blocks, count,
                                  ROWS_PER_WARPGROUP), jnp.float32)
            for count in rows)
        dump_counts = [count for _, count in filter(None, dump_offsets)]
        self.out_types += () if reduced else tuple(
            jax.ShapeDtypeStruct((batch * q_heads * COMPUTE_WARPGROUPS * num_kv_blocks * count,
                                  ROWS_PER_WARPGROUP, Q_TILE), jnp.float32)
            for count in dump_counts)
        if dump_counts:  # the staging tile the dumps are copied from, one per warpgroup
            self.smem += (plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, Q_TILE),
                                     jnp.float32),)
        self.tables = tuple(table.astype(jnp.int32) for tables in entry_tables_
                            for table in tables)


def _launch(q, k, v, d_out, lse_log2, delta, d_lse, tables, entry_tables_, mask_program,
            score_program, row_sums, *, q_len, kv_len, scale, interpret, masked_first,
            pair_positions, relative_positions, dump_offsets, fuse_dq=False,
            before_from_totals=(), reduced_dump=None, block_positions=()):
    """The two kernels (or with fuse_dq the dK/dV one computing dQ too, `_launch_fused`) on
    block-padded operands (`backward.prepare_operands`): (dq, dk, dv), then the dQ
    kernel's row sums where any gradient of a captured array is wanted, then per array
    at `relative_positions` the dK/dV kernel's sums per entry (its `entry_tables_`),
    then the tiles dumped for those with `dump_offsets` (`Dump`'s (first_offset,
    count) or None per array), then per array at `block_positions` (bias tensors read as
    blocks) its float32 gradient, of the (edge-padded) array's shape. d_lse: padded, or
    None (zero or no relative positions). row_sums: the forward's row sums of the reads
    at b and h, [B, Hq, n, S] (padded), or None."""
    batch, padded_q_len, q_heads, head_dim = q.shape
    padded_kv_len, kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    num_q_blocks, num_kv_blocks = padded_q_len // BLOCK, padded_kv_len // BLOCK
    group = q_heads // kv_heads
    dq_program = dkv_program = None
    if score_program is not None:
        # The dQ kernel also differentiates the values read at indices of b and h from
        # the arrays whose gradients are wanted, the dK/dV kernel those read at indices
        # of kv_idx - q_idx; else d score_mod / d score only.
        # Fused, the dK/dV kernel takes those at b and h too (`pair_gradients`).
        dq_program = (with_read_derivatives(score_program, pair_positions)
                      if pair_positions else with_score_derivative(score_program))
        # The dK/dV kernel sums the bias blocks' gradients (their derivatives last).
        dkv_positions = (relative_positions + (pair_positions if fuse_dq else ())
                         + block_positions)
        dkv_program = (with_read_derivatives(score_program, dkv_positions)
                       if dkv_positions else with_score_derivative(score_program))
    mask_reads = tile_reads(mask_program)
    # Bias tensors read at (q_idx, kv_idx) are copied as blocks (`bias_block_reads`).
    dq_reads = tile_reads(dq_program, blocks=True)
    dkv_reads = tile_reads(dkv_program, blocks=True)
    dq_blocks = bias_block_reads(dq_program, dq_reads)
    dkv_blocks = bias_block_reads(dkv_program, dkv_reads)
    # Per bias block gradient: its read among dkv_blocks, its derivative's number.
    block_gradients = tuple(
        (next(number for number, (_, position_, _, _) in enumerate(dkv_blocks)
              if position_ == position), len(dkv_positions) - len(block_positions) + index)
        for index, position in enumerate(block_positions))
    layout = stages_beside_bias_blocks(
        head_dim, q.dtype, block_dtypes(dq_program, dq_reads),
        block_dtypes(dkv_program, dkv_reads), fused=fuse_dq,
        gradient_tiles=len(block_gradients))
    if layout is None:
        raise ValueError(f"bias tensors read at (q_idx, kv_idx) whose blocks do not fit "
                         f"the Mosaic backward's shared memory at head dim {head_dim}")
    dq_stages, dq_parts, dkv_stages = layout.dq_stages, layout.dq_parts, layout.dkv_stages

    def captured_for(program, reads, keys_on_rows=False):
        """(the kernel's diagonal_reads, its inputs for the mods followed by the dense
        block diagonals' tiles, keys on their rows for the dK/dV kernel, and side values
        of its relative reads, then for the dK/dV kernel each bias block read's array
        with its q and kv axes swapped)."""
        inputs = tile_inputs(mask_program, mask_reads, program, reads, batch=batch,
                             heads=q_heads, q_length=padded_q_len, kv_length=padded_kv_len)
        transposed = []
        if keys_on_rows and program is not None:
            padded = padded_for_slices(program, reads, padded_q_len, padded_kv_len)
            transposed = [jnp.swapaxes(padded[position], *axes)
                          for _, position, axes, _ in bias_block_reads(program, reads)]
        if not dense_diagonals_in_backward(head_dim):
            return (), (*inputs, *transposed)
        diagonal_reads, tiles, sides = diagonal_inputs(
            program, reads, paged=False, batch=batch, heads=q_heads,
            q_length=padded_q_len, kv_length=padded_kv_len)
        if keys_on_rows:
            tiles = [t.swapaxes(-1, -2) for t in tiles]
        return diagonal_reads, (*inputs, *tiles, *sides, *transposed)
    kv_tables, q_tables = tables[:4], tables[4:]
    settings = dict(mask_program=mask_program, scale=scale, group=group, q_len=q_len,
                    kv_len=kv_len, broadcast_batch=tables[0].shape[0] == 1,
                    broadcast_heads=tables[0].shape[1] == 1, mask_reads=mask_reads,
                    masked_first=masked_first, interpret=interpret)

    def smem(shape, dtype=q.dtype):
        return plgpu.SMEM(shape, dtype, transforms=tile_transforms(head_dim))

    def vectors(*shape):
        return plgpu.SMEM(shape, jnp.float32)

    def rings(program, reads, stages, columns):
        """A [stages, 2, 64, columns] ring per bias block read of the program."""
        return tuple(ring(stages, columns, t) for t in block_dtypes(program, reads))

    def dkv_scratch(stages, extra_smem=(), ready_arrivals=4):
        """The dK/dV kernel's shared memory (K and V of its keys, then Q, dO, lse and
        delta per stage, then `extra_smem`, then the bias blocks' rings) and barriers (a
        stage ready after `ready_arrivals` copies and two per bias block read); the
        count of the former."""
        buffers = (smem((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, head_dim)),
                   smem((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, value_dim)),
                   smem((stages, Q_TILE, head_dim)), smem((stages, Q_TILE, value_dim)),
                   vectors(stages, Q_TILE), vectors(stages, Q_TILE), *extra_smem,
                   *rings(dkv_program, dkv_reads, stages, Q_TILE))
        ready_arrivals += COMPUTE_WARPGROUPS * len(dkv_blocks)
        barriers = (plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WARPGROUPS),
                    plgpu.Barrier(num_arrivals=ready_arrivals, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages))
        return buffers + barriers, len(buffers)

    def call(kernel, operands, kernel_tables, captured, out_type, grid, scratch, num_smem,
             accumulators=()):
        """`kernel` launched on the operands, tables and captured arrays; `accumulators`:
        mutable float32 arrays (`jax.new_ref`) it adds into, after its outputs."""
        num_inputs = len(operands) + len(kernel_tables) + len(captured)
        count = len(accumulators)

        def entry(*refs):
            if count:  # the kernel takes them after its outputs
                refs = (refs[:num_inputs] + refs[num_inputs + count:]
                        + refs[num_inputs:num_inputs + count])

            def scoped(*buffers):
                kernel(*refs, (buffers[:num_smem], buffers[num_smem:]))
            pl.run_scoped(scoped, *scratch, collective_axes="warpgroup")

        names = tuple(grid)
        if not count:
            return plgpu.kernel(
                entry, out_type=out_type, grid=tuple(grid[name] for name in names),
                grid_names=names, num_threads=COMPUTE_WARPGROUPS + 1, thread_name="warpgroup",
                compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=plgpu.InterpretGPUParams() if interpret else None,
            )(*operands, *kernel_tables, *captured)
        # pl.kernel (plgpu.kernel's batching wrapper takes no mutable arrays); `_vmappable`
        # batches the launch.
        mesh = plgpu.Mesh(grid=tuple(grid[name] for name in names), grid_names=names,
                          num_threads=COMPUTE_WARPGROUPS + 1, thread_name="warpgroup")
        return pl.kernel(
            entry, out_type=out_type, mesh=mesh,
            compiler_params=plgpu.CompilerParams(approx_math=True),
            interpret=plgpu.InterpretGPUParams() if interpret else False,
        )(*operands, *kernel_tables, *captured, *accumulators)

    relative_entries = tuple(entry_count(score_program, position)
                             for position in relative_positions)
    sites = _Sites(relative_entries, dump_offsets, len(pair_positions) if fuse_dq else 0,
                   batch, q_heads, num_kv_blocks, entry_tables_,
                   reduced=reduced_dump is not None)
    if fuse_dq:
        return _launch_fused(call, dkv_scratch, q, k, v, d_out, lse_log2, delta, q_tables,
                             dkv_program, dkv_reads, captured_for, settings, num_kv_blocks,
                             sites, row_sums, dkv_stages, dkv_blocks)
    # Without reads at b and h, the exact deltas need sum P dP only; with the forward's
    # row sums of those, one row each (and sum P dP first for the relative reads).
    forward_sites = len(pair_positions) if row_sums is not None else 0
    if forward_sites:
        row_count = forward_sites + bool(relative_positions)
    else:
        row_count = (2 + 2 * len(pair_positions) if pair_positions
                     else 2 if any(before_from_totals) else 1 if relative_positions else 0)
    dq_diagonal_reads, dq_captured = captured_for(dq_program, dq_reads)
    dq = functools.partial(_dq_kernel, num_stages=dq_stages, num_q_blocks=num_q_blocks,
                           score_program=dq_program, score_reads=dq_reads,
                           diagonal_reads=dq_diagonal_reads, bias_blocks=dq_blocks,
                           parts_per_block=dq_parts,
                           row_count=row_count, forward_sites=forward_sites, **settings)
    rows_type = ((jax.ShapeDtypeStruct((row_count, batch, q_heads, padded_q_len),
                                       jnp.float32),) if row_count else ())
    rows_smem = (vectors(COMPUTE_WARPGROUPS, row_count, ROWS_PER_WARPGROUP),) if row_count else ()
    if forward_sites:
        rows_smem = (vectors(COMPUTE_WARPGROUPS, forward_sites, ROWS_PER_WARPGROUP),
                     ) + rows_smem
    d_q, *rows = call(
        dq, (q, k, v, d_out, lse_log2, delta), kv_tables,
        (*dq_captured, *(() if row_sums is None else (row_sums,))),
        (jax.ShapeDtypeStruct(q.shape, q.dtype), *rows_type),
        {"heads": q_heads, "q_seq": num_q_blocks, "batch": batch},
        (smem((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, head_dim)),
         smem((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, value_dim)),
         vectors(COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP),
         vectors(COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP),
         smem((dq_stages, BLOCK // dq_parts, head_dim)),
         smem((dq_stages, BLOCK // dq_parts, value_dim)),
         *rows_smem, *rings(dq_program, dq_reads, dq_stages, BLOCK // dq_parts),
         plgpu.Barrier(num_arrivals=4 + bool(forward_sites), num_barriers=COMPUTE_WARPGROUPS),
         plgpu.Barrier(num_barriers=dq_stages), plgpu.Barrier(num_barriers=dq_stages),
         plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=dq_stages),
         plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=dq_stages),
         *[plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=dq_stages)
           for _ in dq_blocks]),
        num_smem=6 + len(rows_smem) + len(dq_blocks))

    if relative_positions:
        delta = exact_delta(rows[0][:1] if forward_sites else rows[0], delta, d_lse)
    dkv_diagonal_reads, dkv_captured = captured_for(dkv_program, dkv_reads,
                                                    keys_on_rows=True)
    dkv = functools.partial(_dkdv_kernel, num_stages=dkv_stages, score_program=dkv_program,
                            score_reads=dkv_reads,
                            diagonal_reads=dkv_diagonal_reads,
                            relative_entries=relative_entries,
                            dump_offsets=dump_offsets,
                            before_from_totals=before_from_totals,
                            reduced_dump=reduced_dump, bias_blocks=dkv_blocks,
                            block_gradients=block_gradients,
                            gradient_buffers=layout.gradient_buffers, **settings)
    accumulators = []
    if reduced_dump is not None:  # the one dumped array's tiles, reduce-added
        (count,) = [count for _, count in filter(None, dump_offsets)]
        accumulators.append(jax.new_ref(jnp.zeros(
            (reduced_dump.batch * q_heads * count, Q_TILE, Q_TILE), jnp.float32)))
    # Each bias block gradient's, of the transposed array's shape (in interpret mode one
    # per (batch, head), summed here).
    gradient_shapes = [tuple(dkv_captured[len(dkv_captured) - len(dkv_blocks) + number].shape)
                       for number, _ in block_gradients]
    gradient_accumulators = [
        jax.new_ref(jnp.zeros(((batch, q_heads) if interpret else ()) + shape, jnp.float32))
        for shape in gradient_shapes]
    d_k, d_v, *run_sums = call(
        dkv, (q, k, v, d_out, lse_log2, delta), q_tables,
        (*dkv_captured, *sites.tables),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
         *sites.out_types),
        {"heads": kv_heads, "kv_seq": num_kv_blocks, "batch": batch},
        *dkv_scratch(dkv_stages, sites.smem + tuple(
            _float32_staging(layout.gradient_buffers) for _ in block_gradients)),
        accumulators=(*accumulators, *gradient_accumulators))
    if accumulators:
        run_sums.append(accumulators[0][...])
    block_grads = []
    for accumulator, (number, _) in zip(gradient_accumulators, block_gradients):
        gradient = accumulator[...]
        if interpret:
            gradient = gradient.sum(axis=(0, 1))
        block_grads.append(jnp.swapaxes(gradient, *dkv_blocks[number][2]))
    return (d_q, d_k, d_v, *rows, *run_sums, *block_grads)
