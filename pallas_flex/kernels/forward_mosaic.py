"""Block-sparse FlexAttention forward for Hopper: a Pallas Mosaic GPU kernel.

Warp-specialized, after FlashAttention-3. A work item is one 128-row BlockMask query
block of one head and batch row; a program walks `items_per_program` consecutive items
(KernelOptions.forward_items_per_program; `choose_items_per_program`: 2, more where all
of a head's query blocks walk the same blocks). Its memory warpgroup streams the K/V
tiles of the blocks that each item's BlockMask row lists into shared memory with TMA,
`num_stages` tiles ahead of use and on from one item into the next; its two compute
warpgroups (64 query rows each) run wgmma for q·kᵀ and p·v and the online softmax, and
load the next item's queries while they store the current item's output. A schedule
barrier makes the compute warpgroups take turns on the tensor cores, so one's softmax
runs under the other's matmuls.

The walk is the Triton kernel's (`forward.py`): the row's full blocks without the
mask_mod, then its partial blocks with it; blocks the mask leaves empty are never
loaded. Mods run on [64, 128] tiles of scores and indices in the wgmma register layout
(`tile_mods.evaluate_jaxpr_on_tiles`, as in the Triton kernels).

What it covers (`mosaic_eligibility.unsupported_reason` says why not; the dispatcher
then runs the Triton kernel): 16-bit q/k/v, D = Dv in `mosaic_eligibility.HEAD_DIMS`
(64 to 256), a 128x128 BlockMask (ragged lengths are zero-padded to whole blocks, as for
the Triton kernel), contiguous K/V or a paged cache (`_tile_pages`, D 64 and 128), and
mods built from elementwise operations whose captured arrays are read at indices that
depend on b and h only (a per-head ALiBi slope, a soft-cap value), at exactly q_idx or
kv_idx (document ids: `mosaic_eligibility.contiguous_reads` loads those as one vector
per tile), at exactly (q_idx, kv_idx) on contiguous K/V (a bias tensor: the memory
warpgroup copies its [128, keys] blocks by TMA into a ring beside the K/V stages), or at
indices of kv_idx - q_idx (T5 buckets: `relative_reads`, built from per-diagonal
tables; the block diagonals near the main one read as dense tiles straight from global
memory, `mosaic_tiles.diagonal_loads`).
Reads at other indices are per-element gathers, which the Triton kernel does and this
one does not. Attention sinks (one logit per query head,
`pallas_flex/sinks.py`) join each row's softmax in the final normalization, as in the
Triton kernel. Inputs that vary over the manual axes of a shard_map checking them go to
the Triton kernel (`dispatch.mosaic_unsupported_reason`).

CPU tests run it in Mosaic GPU's interpret mode, where wgmma has no rule: there the two
matmuls are plain dots on the shared-memory tiles (`mosaic_tiles.matmul`), and all
the rest (TMA copies, barriers, the three warpgroups) is simulated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels import fma_exp2, online_softmax
from pallas_flex.kernels.bias_blocks_mosaic import (
    bias_block_reads, bias_block_sources, copy_block, ring as bias_ring, with_ring_readers)
from pallas_flex.kernels.config import SHORT_KEYS
from pallas_flex.kernels.mosaic_eligibility import (
    BLOCK, BLOCK_DTYPES, block_dtypes, exp2_fma_share, hand_over_early,
    named_turn_barriers, tile_reads)
from pallas_flex.kernels.device import multiprocessor_count
from pallas_flex.kernels.kv_tiles import in_pool, page_table_row
from pallas_flex.kernels.mosaic_tiles import (
    ROWS_PER_WARPGROUP, Affine, Vector, apply_mask, diagonal_readers, evaluate, index_vector,
    map_each_element, matmul, reads_index, score_parts, split_rows, split_tile_refs,
    tile_inputs, weighted_row_sums)
from pallas_flex.kernels.relative_reads import diagonal_blocks, numbered
from pallas_flex.kernels.padding import pad_axis
from pallas_flex.masks.mod_program import score_bounds, with_read_derivatives

# BLOCK (128): the BlockMask block on both axes, a program's query rows and one K/V
# tile's rows. Pages of a paged cache are copied whole (or 128 rows of one page) into a
# K/V tile in shared memory, whose tiling transform groups PAGE_ROWS_MULTIPLE (8) rows.
COMPUTE_WARPGROUPS = BLOCK // ROWS_PER_WARPGROUP
# Registers a thread of a compute / the memory warpgroup (setmaxnreg).
_REGISTERS = (232, 40)
# Issue the copies of pages smaller than a tile from the memory warpgroup's four warps
# (each arriving on the tile's barrier from its own lanes) instead of from the whole
# warpgroup one copy after another: Pallas arrives on a copy's barrier from every thread
# that issues it (after a warpgroup barrier), so 16-row pages (8 copies per tile) were
# bound by the copies' issue rate. H100 prefill at 16-row pages, paired rounds: +7.2 %
# over contiguous from the whole warpgroup, +3.2 % from four warps (D 64: +14 / +6.3 %);
# f908cd9:benchmarks/results/2026-11-23-h100-paged-warp-copies.json.
WARPS_PER_WARPGROUP = 4
# K/V tiles in flight per program by head dim: as many as shared memory holds next to
# the query/output tiles (2 x 64 KiB of K and V at D 128, 4 x 32 KiB at D 64). At D 64
# neither this nor the items a program moves the forward: H200, B8 H16 S2048 D64 bf16,
# 20 paired rounds in both orders, ms, defaults / 5 stages / 4 items where rows are
# equal / both: noop 0.3335 / 0.3349 / 0.3364 / 0.3334 (the defaults again 0.3358),
# prefix-LM 1024 0.2665 / 0.2665 / 0.2664 / 0.2662; 3 stages and 2 -> 4 items where rows
# are not equal no faster either (causal 0.2300 / 0.2300 / 0.2582 with 4 items).
_STAGES = {32: 4, 64: 4, 80: 4, 96: 3, 128: 2, 192: 2, 256: 2}
# K/V tiles per BlockMask block by head dim (the rest: 1, a tile of 128 keys). At D 192
# and 256 one 128-row K and V stage is all shared memory holds next to the queries: with
# 64-row tiles two are in flight, and the [64, 64] float32 score tile leaves registers
# next to the [64, D] accumulator. H200, B4 H16 S4096 bf16, paired rounds of AOT-compiled
# calls, ms, 128-key tiles at 1 stage / 64-key tiles at 2: D256 noop 2.212 / 1.983 (cuDNN
# 1.677), causal 1.108 / 1.024 (0.975); D192 noop 1.502 / 1.465 (1.328), causal
# 0.784 / 0.775 (0.771).
_PARTS_PER_BLOCK = {192: 2, 256: 2}
# Items per program (`choose_items_per_program`; KernelOptions.forward_items_per_program
# has the 1 -> 2 figures). Where every query block of a head walks the same blocks (a
# mask that does not read q_idx: no mask, key padding) and the cache is contiguous, and
# the items fit one wave of programs (at most one per SM) of at most one query block's
# heads each, they are spread over that wave (at least the default a program): the
# programs running together walk one head at a time (heads vary fastest), so they read
# that head's K/V from L2, and no partial wave trails. H100, forward, paired rounds, ms,
# 2048 items (B1 H16 S16384 D128 / B4 H16 S4096 D128 / B8 H16 S2048 D64) at 2 / 4 / 8 /
# 16 items a program: 3.693 / 3.677 / 3.631 / 3.575 (cuDNN 3.522), 0.9375 / 0.958 / 0.952
# / 0.9405 (0.920); D64 at 8 / 16 / 32: 0.3377 / 0.3345 / 0.642 (0.3234), and 12 (171
# programs: a second wave of 39) 0.494; against the old defaults on another host 3.665 /
# 3.805, 0.969 / 0.971, 0.3357 / 0.3371, GQA 32:8 B4 S4096 (32 a program) 1.867 / 1.860,
# and on a third 3.645 / 3.654, 0.9555 / 0.9664, 0.3427 / 0.3451 (the gain varies by
# host). More items than heads lose: B32 H16 S4096 D128 at 125 a program 11.78 against
# 7.19 with 2, B64 H32 S1024 3.31 / 2.03 (the programs running together then span every
# batch row's K/V), and so do programs of 1 item on small calls (B2 H8 S1000 D64 0.0758 /
# 0.0723 with 2). Masks that read q_idx keep 2: rows of unequal length in one wave leave
# SMs idle (causal lost up to 26 % with 4 or 8), and so do paged calls, whose rows end at
# each sequence's length.
_ITEMS_PER_PROGRAM = 2
# Where rows are equal at D 64 (also where the items do not fit one such wave, and on
# pages): 1 / 2 / 4 / 8 items 0.354 / 0.347 / 0.341 / 0.330 ms (B8 H16 S2048 D64 noop).
_ITEMS_PER_PROGRAM_EQUAL_ROWS_D64 = 8
# Where rows are equal on a contiguous cache, keys are few (at most config.SHORT_KEYS)
# and there are more items than one wave of programs of num_heads each spreads (many
# batch rows: the Evoformer's MSA rows), a program walks up to 8 of them, no more than
# the heads (one query block of one batch row): its prologue and epilogue are a large
# part of a short walk. H200, paired rounds,
# ms, D128, at 2 / 4 / 8 items a program: Evoformer gated row attention R256 S256 H8
# (4096 items, its pair bias as blocks) 0.279 / 0.261 / 0.253 (1: 0.325; XLA 1.325);
# plain B128 H8 S256 0.1059 / 0.1034 / 0.1013 (cuDNN 0.1229); B256 H4 S256 0.1056 /
# 0.101 / 0.1164 (8 spans two batch rows; cuDNN 0.1046). B32 H8 S384 (768 items: one
# wave of 6, the rule above) 0.1207 / 0.1209 / 0.1234. At D64 8 was already the default
# (Evoformer 0.164 against 0.235 with 1).
_ITEMS_PER_PROGRAM_SHORT_KEYS = 8
# Head dims where the one-wave spread was measured; the others keep 2.
_ONE_WAVE_HEAD_DIMS = (64, 128)
# Work items (`_kernel`) vary heads fastest, then query blocks, then batch rows: heads
# first (as JAX's own Mosaic GPU attention) measured faster than query blocks first, the
# Triton kernel's order: B4 H16 S4096 D128 noop 0.936 against 1.000 ms, causal 0.489
# against 0.542; B8 S2048 D64 noop 0.358 against 0.429.
# tanh runs as tanh.approx.f32 (what `approx_math=True` makes of it): one transcendental
# instruction, where the exact form (`softcap.tanh_with_exp2`: an exp2 and a division)
# costs two, and the softmax's exp2 already keeps that unit busy. Causal + soft-cap 30 at
# B4 H16 S4096 D128 bf16 on the H100: 0.573 ms against 0.870 (causal alone 0.491,
# tokamax's soft-cap 0.553). Its relative error (about 2**-11, PTX ISA) moves a capped
# logit by at most cap * 4.9e-4 (0.015 at cap 30); the largest output error against
# float64 at B1 H4 S2048 D128 causal stayed the bf16 rounding's (7.6e-3 with either form),
# and tests/kernels/test_forward_mosaic.py bounds it with scores driven into saturation.
# At head dim 64 a tanh and the softmax's exp2 per score keep that unit the bottleneck:
# there 5 of every 8 registers of a tile take exp2 on the FMA units instead
# (`fma_exp2`, `mosaic_eligibility.exp2_fma_share`: B8 S2048 D64 0.260 -> 0.236 ms).
# The kernel takes 16-bit inputs only; float32 runs on the Triton kernel (exact tanh).
def _kernel(q_ref, k_ref, v_ref, full_num_ref, full_indices_ref, partial_num_ref,
            partial_indices_ref, *refs, mask_program, score_program, scale, group,
            num_stages, num_q_blocks, num_heads, num_items, items_per_program, q_len, kv_len,
            broadcast_batch, broadcast_heads, mask_reads, score_reads, paged, interpret,
            with_max=False, with_sinks=False, with_gate=False, fixed_max=None,
            parts_per_block=1, row_sum_sites=0, mod_program=None, bias_blocks=(),
            diagonal_reads=()):
    """mask_reads, score_reads: the mods' `tile_reads`. with_max: a third output,
    the row max of the logits (and a shared-memory row buffer for it). row_sum_sites:
    that many outputs more (each with a row buffer), per derivative g of a captured read
    that score_program (then `with_read_derivatives` of the score_mod's own program,
    mod_program, which the kernel's choices go by) computes, the row's sum P g under the
    softmax's probabilities (`weighted_row_sums`). paged: whether k_ref / v_ref
    are pages [num_pages, Hkv, page_size, D], read through a page table [B, max_pages]
    and per-row lengths [B] (the refs after the BlockMask tables). with_sinks: a float32
    ref [Hq] of sink logits (natural units) follows (after the paging refs).
    with_gate: then an output gate [B, Sq, Hq, D] in the inputs' dtype: each warpgroup
    copies its tile into its output staging buffer (its own barrier, the last of the
    scratch barriers): a persistent program's before the walk, into the buffer of its
    own; else once the walk is done, into q_smem; then multiplies the output by its
    sigmoid (`pallas_flex/output_gate.py`).
    parts_per_block: K/V tiles a BlockMask block is walked in (`_PARTS_PER_BLOCK`); a
    block's tiles take consecutive slots.
    bias_blocks: per score_mod read of a bias tensor at [.., q_idx, kv_idx] (a "block"
    of `tile_reads`), (read key, captured position, (q axis, kv axis), its other
    indices as a function of (b, h): `block_indices`): the memory warpgroup copies each
    K/V tile's [128, keys] block of it by TMA into a ring of its own beside the K/V
    stages (a shared-memory [stages, 2, 64, keys] buffer and a barrier per stage, the
    last scratch buffers and barriers), after the tile's V (whose release, after p·v,
    follows the mod's read); each compute warpgroup reads its 64 rows when the mod runs.
    diagonal_reads: per relative read of the score_mod that is dense on some block
    diagonals (`relative_reads.diagonal_blocks`: T5 buckets near the main diagonal),
    (read key, first block diagonal, count): its dense tiles [Bm, H, count, 128, 128]
    follow the mods' inputs, then (after all reads' tiles) its side values [Bm, H, 2];
    on those block diagonals a compute warpgroup loads its rows of the tile straight
    from global memory in the wgmma layout (`mosaic_tiles.diagonal_loads`, as the
    backward does; the same tiles for every query block of a head, so L2 holds them),
    elsewhere the read is the side's value (`DiagonalTile`).

    Work items are (head, query block, batch) triples, heads varying fastest and the
    query blocks from the last (a causal mask's longest rows first). Program p runs
    items p * items_per_program onwards, `items_per_program` of them (fewer in the last
    program). Tile `t` of a program's whole walk, over all its items, sits in K/V slot
    t % num_stages, so the memory warpgroup fetches the next item's first tiles while
    the compute warpgroups finish the current one."""
    if paged:
        page_table_ref, lengths_ref, *refs = refs
    if with_sinks:
        sinks_ref, *refs = refs
    if with_gate:
        gate_ref, *refs = refs
    mask_refs, score_refs, rest = split_tile_refs(refs, mask_program, mask_reads,
                                                  score_program, score_reads)
    dense_readers, rest = diagonal_readers(diagonal_reads, rest, interpret=interpret)
    out_ref, lse_ref, *row_refs, scratch = rest
    max_ref, sum_refs = row_refs[:with_max], row_refs[with_max:]
    # Shared memory: queries, K/V stages, lse rows, then the row max's rows (with_max),
    # the row sums' and a persistent program's output tiles (see `_launch`).
    (q_smem2, k_smem, v_smem, lse_smem2, *extra_smem), barriers = scratch
    block_rings = extra_smem[len(extra_smem) - len(bias_blocks):]
    extra_smem = extra_smem[:len(extra_smem) - len(block_rings)]
    persistent = items_per_program > 1
    max_smem2 = extra_smem[:1] if with_max else []
    sum_smem2 = extra_smem[with_max:with_max + row_sum_sites]
    o_smem2 = extra_smem[-1] if persistent else None
    policy_program = score_program if mod_program is None else mod_program
    (q_barriers, k_barriers, v_barriers, k_consumed, v_consumed, schedule_barrier,
     *rest) = barriers
    gate_barriers, rest = rest[:with_gate], rest[with_gate:]
    block_barriers = rest
    head_dim = q_ref.shape[3]
    tile_rows = BLOCK // parts_per_block  # keys of a K/V tile
    dtype = q_ref.dtype
    early_hand_over = hand_over_early(head_dim, policy_program)
    exp2_share = exp2_fma_share(head_dim, policy_program)
    first_item = lax.axis_index("programs") * items_per_program
    num_local_items = jnp.minimum(items_per_program, num_items - first_item)
    last_listed = full_indices_ref.shape[-1] - 1

    def item_at(local):
        """(head, query block, batch, number of full blocks, of all blocks, kv_block_of)
        of this program's item `local`."""
        item = first_item + local
        head = lax.rem(item, jnp.int32(num_heads))
        rest = lax.div(item, jnp.int32(num_heads))
        q_block = num_q_blocks - 1 - lax.rem(rest, jnp.int32(num_q_blocks))
        batch = lax.div(rest, jnp.int32(num_q_blocks))
        table = (0 if broadcast_batch else batch, 0 if broadcast_heads else head, q_block)
        num_full = full_num_ref[table]
        num_steps = num_full + partial_num_ref[table]

        def kv_block_of(step):
            """The K/V block that step `step` of the walk visits (full blocks, then
            partial)."""
            full = full_indices_ref[table + (jnp.minimum(step, last_listed),)]
            partial = partial_indices_ref[table + (jnp.clip(step - num_full, 0, last_listed),)]
            return jnp.where(step < num_full, full, partial)

        return head, q_block, batch, num_full, num_steps, kv_block_of

    def slot_of(tile):
        return lax.rem(tile, jnp.int32(num_stages))

    warpgroup = lax.axis_index("warpgroup")

    turns = _Turns(warpgroup, schedule_barrier,
                   named=not interpret and named_turn_barriers(head_dim, policy_program))

    def _item(load_queries, q_smem, o_smem, lse_smem, local, consumed):
        """One work item of a compute warpgroup; returns the tiles consumed after it."""
        head, q_block, batch, num_full, num_steps, kv_block_of = item_at(local)
        q_start = q_block * BLOCK + warpgroup * ROWS_PER_WARPGROUP

        def load_gate():
            plgpu.copy_gmem_to_smem(
                gate_ref.at[batch, pl.ds(q_start, ROWS_PER_WARPGROUP), head], o_smem,
                gate_barriers[0].at[warpgroup])

        if with_gate and persistent:
            # A persistent program's output staging buffer is its own: the gate's tile
            # loads into it under the walk, once the previous item's stores have read it
            # (and the row buffers, which this wait covers for the epilogue below). On
            # the H200 this took causal B4 H16 S4096 D128 from 0.559 ms (loaded after
            # the walk) to 0.543 (0.534 ungated); noop 0.942 to 0.918.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            load_gate()
        plgpu.barrier_wait(q_barriers.at[warpgroup])
        tile = (ROWS_PER_WARPGROUP, tile_rows)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        running_max = plgpu.layout_cast(
            jnp.full((ROWS_PER_WARPGROUP,),
                     -jnp.inf if fixed_max is None else fixed_max, jnp.float32), row_layout)
        running_sum = plgpu.layout_cast(
            jnp.full((ROWS_PER_WARPGROUP,), 0.0, jnp.float32), row_layout)
        accumulator = plgpu.layout_cast(
            jnp.full((ROWS_PER_WARPGROUP, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        # The score_mod's term that depends on the query only (ALiBi's -slope * q_idx):
        # left out of the scores (the softmax is the same without it) and added to the
        # row's lse at the end. Zeros where the mod has none; None without a mod.
        row_term = None if score_program is None else plgpu.layout_cast(
            jnp.full((ROWS_PER_WARPGROUP,), 0.0, jnp.float32), row_layout)
        # Per read derivative g, the row's sum of p g, rescaled with the running sum.
        row_sums = tuple(plgpu.layout_cast(jnp.full((ROWS_PER_WARPGROUP,), 0.0, jnp.float32),
                                           row_layout) for _ in range(row_sum_sites))
        # Indices are vectors in the layouts of a tile's rows and columns (a mod's index
        # arithmetic, and ALiBi's int->float conversions, then run once per row or
        # column); `mosaic_tiles.to_tile` spreads them over the tile where they meet.
        # Only built where a mod reads them: an unused index vector leaves Mosaic GPU's
        # layout inference without a solution.
        q_idx = None
        if (reads_index(mask_program, mask_reads, "q_idx")
                or reads_index(score_program, score_reads, "q_idx")):
            # Mods see in-range indices; padded rows are sliced off.
            q_idx = index_vector(q_start, ROWS_PER_WARPGROUP, 0,
                                 below=q_len if q_len % BLOCK else None)
        # Keys past a ragged tail sit in partial blocks only (BlockMask never lists a
        # block reaching past the keys as full): those mask them. On a paged cache the
        # row's own length bounds its keys (the caller clipped the BlockMask to it, so
        # full blocks lie below it).
        clamps_key_tail = kv_len % BLOCK != 0
        masks_key_tail = clamps_key_tail or paged
        key_limit = jnp.minimum(lengths_ref[batch], kv_len) if paged else kv_len

        def slices_at_kv(reads):  # (a relative read needs the tile's first key too)
            return any(kind in ("kv", "relative", "block") for _, _, kind in reads.values())

        # What a tile of each loop (masked or not) needs: the kv_idx vector (only where
        # it is used, as for q_idx) and the tile's first key (also for slice reads).
        score_kv = reads_index(score_program, score_reads, "kv_idx")
        mask_kv = reads_index(mask_program, mask_reads, "kv_idx") or masks_key_tail
        kv_needs = {
            masked: (score_kv or (masked and mask_kv),
                     score_kv or slices_at_kv(score_reads)
                     or (masked and (mask_kv or slices_at_kv(mask_reads))))
            for masked in (False, True)}

        @pl.when(num_steps > 0)
        def _():
            plgpu.barrier_wait(k_barriers.at[slot_of(consumed * parts_per_block)])

        turns.start()

        def zero_values_past_length(v_tile, kv_start):
            """Zeroes the rows of a V tile at or past the row's length. Their weights are
            0, but a page reused from an earlier request holds whatever it held, and
            0 * NaN is NaN in p·v. Both compute warpgroups write the same zeros (the tile
            is theirs until both release it), so neither waits for the other; a row's
            one tile that crosses its length pays for it, 64 rows at a time."""
            for half in range(BLOCK // ROWS_PER_WARPGROUP):
                first_row = half * ROWS_PER_WARPGROUP
                rows = v_tile.at[pl.ds(first_row, ROWS_PER_WARPGROUP)]

                @pl.when(kv_start + first_row + ROWS_PER_WARPGROUP > key_limit)
                def _():
                    values = plgpu.load(rows, layout=plgpu.Layout.WGMMA)
                    position = kv_start + first_row + plgpu.broadcasted_iota(
                        jnp.int32, values.shape, 0, layout=plgpu.Layout.WGMMA)
                    rows[...] = jnp.where(position < key_limit, values,
                                          jnp.zeros_like(values))
                    plgpu.commit_smem()  # before the wgmma reads the tile

        def block_readers(slot):
            """The bias blocks' readers on the tile in `slot` (this warpgroup's 64 rows
            of the block its ring holds there, once its copy has landed) and the dense
            relative reads' wrappers of their runs (`diagonal_loads`)."""
            return with_ring_readers(dense_readers, bias_blocks, block_rings, slot,
                                     warpgroup, block_barriers, interpret)

        def visit(step, carry, masked):
            block_start = None
            if any(kv_needs[masked]):
                block_start = kv_block_of(step) * BLOCK
            for part in range(parts_per_block):
                carry = visit_part(part, block_start, step, carry, masked)
            return carry

        def visit_part(part, block_start, step, carry, masked):
            """Keys [part * tile_rows, (part + 1) * tile_rows) of the step's block: the K/V
            tile in slot `slot_of((consumed + step) * parts_per_block + part)`."""
            accumulator, running_max, running_sum, row_term, row_sums = carry
            last_part = part == parts_per_block - 1
            tile_number = (consumed + step) * parts_per_block + part
            slot = slot_of(tile_number)
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            # Then the other warpgroup's q·kᵀ goes next.
            raw = matmul(q_smem, k_tile, shape=tile, interpret=interpret,
                         transpose_b=True,
                         after_issue=turns.scores_issued if early_hand_over else None)
            if not early_hand_over:
                turns.scores_issued()
            plgpu.barrier_arrive(k_consumed.at[slot])

            kv_idx = kv_position = kv_start = None
            needs_kv_vector, needs_kv_start = kv_needs[masked]
            if needs_kv_start:
                kv_start = block_start + part * tile_rows
            if needs_kv_vector:
                kv_position = index_vector(kv_start, tile_rows, 1)
                # The unclamped positions mask the key tail: one iota for both.
                kv_idx = (Vector(jnp.minimum(kv_position.value, kv_len - 1), 1)
                          if clamps_key_tail else kv_position)

            # Base-2 logits are `raw * logit_scale`, applied inside the exponent below
            # (one FMA per score) with the max taken on the unscaled values (exact for a
            # positive factor).
            read_derivatives = ()
            if score_program is None:
                logits, logit_scale = raw, scale * online_softmax.LOG2_E
            else:
                # The scale and the mod's own constant factors (a soft-cap's cap) fold
                # into one multiplication or into the exponent (`Affine`).
                # (With row sums: the score's derivative, unused, then the reads'.)
                modded, *derivatives = evaluate(
                    score_program, score_reads, score_refs,
                    (Affine(raw, scale), batch, head, q_idx, kv_idx), tile=tile, q_axis=0,
                    q_start=q_start, kv_start=kv_start, interpret=interpret,
                    keep_affine=True, block_readers=block_readers(slot))
                read_derivatives = derivatives[1:]
                logits, factor, query_term = score_parts(modded, tile, 0)
                if query_term is not None:
                    row_term = query_term.value
                logits = logits.astype(jnp.float32)
                logit_scale = factor * online_softmax.LOG2_E
            if logit_scale <= 0:
                logits, logit_scale = logits * logit_scale, 1.0
            if masked:
                key_tail = (Vector(kv_position.value < key_limit, 1) if masks_key_tail
                            else None)
                logits = apply_mask(logits, mask_program, mask_reads, mask_refs,
                                    (batch, head, q_idx, kv_idx), extra_keep=key_tail,
                                    tile=tile, q_axis=0, q_start=q_start, kv_start=kv_start,
                                    interpret=interpret)

            def weighted_by_reads(p, row_mass):  # each read's row sums P g
                return [weighted_row_sums(p, row_mass, split_rows(derivative, tile, q_axis=0))
                        for derivative in read_derivatives]

            if fixed_max is not None:  # a bounded score_mod: no max, no rescaling
                new_max = running_max
                p = fma_exp2.exp2(logits * logit_scale - fixed_max, exp2_share,
                                  interpret=interpret)
                row_mass = p.sum(axis=1)
                running_sum = running_sum + row_mass
                row_sums = tuple(total + weighted for total, weighted in
                                 zip(row_sums, weighted_by_reads(p, row_mass)))
            else:
                new_max = jnp.maximum(running_max, logits.max(axis=1) * logit_scale)
                # A row that has seen only masked scores keeps max -inf: subtract 0
                # instead, so its exponentials are exp2(-inf) = 0, never
                # exp2(-inf - -inf) = NaN.
                safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                correction = jnp.exp2(running_max - safe_max)
                p = fma_exp2.exp2(
                    logits * logit_scale - lax.broadcast_in_dim(safe_max, tile, [0]),
                    exp2_share, interpret=interpret)
                accumulator = accumulator * lax.broadcast_in_dim(correction, accumulator.shape,
                                                                 [0])
                scaled_sum = running_sum * correction
                row_mass = p.sum(axis=1)
                running_sum = scaled_sum + row_mass
                row_sums = tuple(total * correction + weighted for total, weighted in
                                 zip(row_sums, weighted_by_reads(p, row_mass)))
            p = p.astype(dtype)
            # The ordering barrier keeps the softmax ahead of the turn handover below
            # (without it the compiler may sink work past it, serializing the two
            # warpgroups), as in JAX's Mosaic GPU attention.
            accumulator, running_sum, new_max, p, row_sums = lax.optimization_barrier(
                (accumulator, running_sum, new_max, p, row_sums))
            turns.softmax_done()
            plgpu.barrier_wait(v_barriers.at[slot])
            if masked and paged:  # (pages: one part a block)
                zero_values_past_length(v_smem.at[slot], kv_start)
            turns.wait_for_tensor_cores()

            def wait_for_next_keys():
                next_keys = k_barriers.at[slot_of(tile_number + 1)]
                if not last_part:  # the block's next part
                    plgpu.barrier_wait(next_keys)
                    return

                @pl.when(step + 1 < num_steps)
                def _():
                    plgpu.barrier_wait(next_keys)

            accumulator = matmul(p, v_tile, shape=accumulator.shape,
                                 interpret=interpret, accumulator=accumulator,
                                 after_issue=wait_for_next_keys)
            plgpu.barrier_arrive(v_consumed.at[slot])
            return accumulator, new_max, running_sum, row_term, row_sums

        carry = (accumulator, running_max, running_sum, row_term, row_sums)
        carry = lax.fori_loop(0, num_full, functools.partial(visit, masked=False), carry)
        carry = lax.fori_loop(num_full, num_steps, functools.partial(visit, masked=True), carry)
        accumulator, running_max, running_sum, row_term, row_sums = carry
        turns.end()
        if persistent:  # q_smem is free: the next item's queries load under the epilogue
            pl.when(local + 1 < num_local_items)(lambda: load_queries(local + 1))

        if with_gate and not persistent:
            # The output's staging buffer is q_smem, which the walk's last q.k has read:
            # the gate's tile lands there while the row is normalized.
            load_gate()
        normalizing_max, correction = running_max, None
        if with_sinks:
            # The sink is one more logit of the row, which the scores here leave the row
            # term out of: in their base-2 units it is (sink - row term) * log2(e).
            sink = sinks_ref[head]
            if row_term is not None:
                sink = sink - row_term
            normalizing_max, running_sum, correction = online_softmax.with_sink(
                running_max, running_sum, sink * online_softmax.LOG2_E)
        has_mass = running_sum > 0.0
        inverse_sum = 1.0 / jnp.where(has_mass, running_sum, 1.0)
        if correction is not None:
            inverse_sum = inverse_sum * correction
        out = accumulator * lax.broadcast_in_dim(inverse_sum, accumulator.shape, [0])
        safe_max = jnp.where(normalizing_max == -jnp.inf, 0.0, normalizing_max)
        lse = (safe_max + jnp.log2(jnp.where(has_mass, running_sum, 1.0))) * online_softmax.LN_2
        if row_term is not None:
            lse = lse + row_term
        if persistent and not with_gate:  # the previous item's output has left the
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging buffers
        if with_gate:  # (its copy was issued before the walk or the normalization)
            plgpu.barrier_wait(gate_barriers[0].at[warpgroup])
            out = out * jax.nn.sigmoid(o_smem[...].astype(jnp.float32))
        lse_smem[...] = jnp.where(has_mass, lse, -jnp.inf)
        if with_max:  # the running max, in the exponent's base-2 units, plus the row term
            row_max = running_max * online_softmax.LN_2
            if row_term is not None:
                row_max = row_max + row_term
            max_smem2[0].at[warpgroup][...] = row_max
        for total, buffer in zip(row_sums, sum_smem2):
            buffer.at[warpgroup][...] = jnp.where(has_mass, total * inverse_sum, 0.0)
        o_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem,
                                out_ref.at[batch, pl.ds(q_start, ROWS_PER_WARPGROUP), head])
        plgpu.copy_smem_to_gmem(lse_smem,
                                lse_ref.at[batch, head, pl.ds(q_start, ROWS_PER_WARPGROUP)])
        if with_max:
            plgpu.copy_smem_to_gmem(
                max_smem2[0].at[warpgroup],
                max_ref[0].at[batch, head, pl.ds(q_start, ROWS_PER_WARPGROUP)])
        for buffer, sum_ref in zip(sum_smem2, sum_refs):
            plgpu.copy_smem_to_gmem(buffer.at[warpgroup],
                                    sum_ref.at[batch, head, pl.ds(q_start, ROWS_PER_WARPGROUP)])
        return consumed + num_steps

    @pl.when(warpgroup < COMPUTE_WARPGROUPS)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[0], action="increase")
        q_smem, lse_smem = q_smem2.at[warpgroup], lse_smem2.at[warpgroup]
        # A persistent program stages its output in a buffer of its own, so that the
        # next item's queries load into q_smem while this one's output is stored.
        o_smem = o_smem2.at[warpgroup] if persistent else q_smem

        def load_queries(local):
            head, q_block, batch, *_ = item_at(local)
            q_start = q_block * BLOCK + warpgroup * ROWS_PER_WARPGROUP
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, ROWS_PER_WARPGROUP), head],
                                    q_smem, q_barriers.at[warpgroup])

        load_queries(0)
        # `consumed`: the K/V tiles this program's earlier items walked.
        lax.fori_loop(0, num_local_items, functools.partial(_item, load_queries, q_smem,
                                                            o_smem, lse_smem), jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(warpgroup == COMPUTE_WARPGROUPS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(_REGISTERS[1], action="decrease")

        def fetch_item(local, fetched):
            """Streams item `local`'s tiles; `fetched`: tiles of the earlier items."""
            head, q_block, batch, _, num_steps, kv_block_of = item_at(local)
            kv_head = lax.div(head, jnp.int32(group))
            # Each bias block's indices on its other axes: the item's, for every tile.
            block_sources = bias_block_sources(
                bias_blocks, [score_refs[position] for _, position, _, _ in bias_blocks],
                batch, head)

            def copy_blocks(location, part, slot):
                """The K/V tile's [128, keys] block of each bias tensor."""
                for source, ring, barrier in zip(block_sources, block_rings, block_barriers):
                    copy_block(source, q_block * BLOCK, location * BLOCK + part * tile_rows,
                               tile_rows, ring, slot, barrier.at[slot])

            def copy_tile(source_ref, location, part, destination, barrier):
                if paged:
                    _copy_pages(source_ref, location, kv_head, destination, barrier)
                else:
                    rows = (batch, pl.ds(location * BLOCK + part * tile_rows, tile_rows),
                            kv_head)
                    plgpu.copy_gmem_to_smem(source_ref.at[rows], destination, barrier)

            @pl.loop(0, num_steps)
            def _fetch(step):
                # The tables (and a paged cache's page table) are read once for K and V,
                # before the release waits (reading them after each wait measured the
                # same on the H100's paged prefill:
                # f908cd9:benchmarks/results/2026-11-23-h100-paged-mosaic.json).
                block = kv_block_of(step)
                location = (_tile_pages(page_table_ref, batch, block, k_ref.shape[2],
                                        k_ref.shape[0]) if paged else block)
                for part in range(parts_per_block):
                    tile = (fetched + step) * parts_per_block + part
                    slot = slot_of(tile)
                    reuses_slot = tile >= num_stages  # its earlier tile must be released

                    @pl.when(reuses_slot)
                    def _():
                        plgpu.barrier_wait(k_consumed.at[slot])

                    copy_tile(k_ref, location, part, k_smem.at[slot], k_barriers.at[slot])

                    @pl.when(reuses_slot)
                    def _():
                        plgpu.barrier_wait(v_consumed.at[slot])

                    copy_tile(v_ref, location, part, v_smem.at[slot], v_barriers.at[slot])
                    # (The slot's blocks were read before its V tile was released.)
                    copy_blocks(block, part, slot)

            return fetched + num_steps

        total = lax.fori_loop(0, num_local_items, fetch_item, jnp.int32(0)) * parts_per_block

        # Observe the last tiles' releases too, so that every phase of the release
        # barriers is waited on once (Mosaic GPU's interpreter checks that; the hardware
        # only idles this warpgroup until the compute warpgroups finish).
        @pl.loop(jnp.maximum(total - num_stages, 0), total)
        def _drain(tile):
            plgpu.barrier_wait(k_consumed.at[slot_of(tile)])
            plgpu.barrier_wait(v_consumed.at[slot_of(tile)])


# Mosaic GPU takes the low named-barrier ids for its own warpgroup synchronizations.
_FIRST_TURN_BARRIER = 8


class _Turns:
    """The two compute warpgroups take turns on the tensor cores: one's softmax runs
    under the other's matmuls. A warpgroup hands the turn over after its q·kᵀ (issued,
    or read: `hand_over_early`); before its p·v it waits for the other's hand-over (or,
    at an item's end, for the other to finish). Warpgroup 1 starts by waiting for
    warpgroup 0's first q·kᵀ.

    named: warpgroup w signals on named barrier 9 - w (`bar.arrive`, which does not
    block) and waits on 8 + w (`bar.sync`), 256 threads each: the two alternate strictly,
    as a warpgroup signals again only after it waited for the other's signal. Otherwise
    one mbarrier both arrive on (a rendezvous at each hand-over)."""

    def __init__(self, warpgroup, barrier, *, named: bool):
        self.warpgroup, self.barrier, self.named = warpgroup, barrier, named

    def _rendezvous(self):
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    def _signal(self):
        named_barrier("arrive", _FIRST_TURN_BARRIER + 1 - self.warpgroup)

    def _wait(self):
        named_barrier("sync", _FIRST_TURN_BARRIER + self.warpgroup)

    def start(self):
        pl.when(self.warpgroup == 1)(self._wait if self.named else self._rendezvous)

    def scores_issued(self):
        (self._signal if self.named else self._rendezvous)()

    def softmax_done(self):
        if not self.named:
            plgpu.barrier_arrive(self.barrier)

    def wait_for_tensor_cores(self):
        (self._wait if self.named else lambda: plgpu.barrier_wait(self.barrier))()

    def end(self):
        pl.when(self.warpgroup == 0)(self._signal if self.named else self._rendezvous)


def named_barrier(operation: str, barrier_id):
    """`bar.{operation} barrier_id, 256`: both compute warpgroups' 128 threads each."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def run(_, identifier):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [identifier.registers[()]],
                        f"bar.{operation} $0, {COMPUTE_WARPGROUPS * 128};", "r", has_side_effects=True)

    run(jnp.asarray(barrier_id, jnp.int32))


def copies_per_tile(page_size: int) -> int:
    """TMA copies filling one 128-row K or V tile from pages of `page_size` rows."""
    return max(BLOCK // page_size, 1)


def _tile_pages(page_table_ref, batch, block, page_size, num_pages):
    """[(page, first row)] of logical KV rows block*128.. of row `batch`: one entry when a
    page holds whole tiles, else one per page. Entries of -1 (no page), and pages past
    the table's end, read page 0: those rows lie past the row's length and are masked.
    Entries past the pool of `num_pages` (a corrupt table) read its last page: no copy
    leaves the pool."""
    page_of = page_table_row(page_table_ref, batch)

    def page_at(logical_page):
        return in_pool(page_of(logical_page), num_pages)

    if page_size >= BLOCK:
        start = block * BLOCK
        return [(page_at(lax.div(start, jnp.int32(page_size))),
                 lax.rem(start, jnp.int32(page_size)))]
    pages_per_tile = copies_per_tile(page_size)
    return [(page_at(block * pages_per_tile + index), 0) for index in range(pages_per_tile)]


def _copy_pages(pages_ref, tile_pages, kv_head, destination, barrier):
    """TMA copies of one head's rows from pages [num_pages, Hkv, page_size, D] into a
    [128, D] tile, per `_tile_pages` entry; the tile's barrier expects one arrival per
    copy (`copies_per_tile`)."""
    rows = min(pages_ref.shape[2], BLOCK)

    def copy(index):
        page, first_row = tile_pages[index]
        plgpu.copy_gmem_to_smem(pages_ref.at[page, kv_head, pl.ds(first_row, rows)],
                                destination.at[pl.ds(index * rows, rows)], barrier)

    if len(tile_pages) == 1:
        for index in range(len(tile_pages)):
            copy(index)
        return

    def per_warp(warp):
        for index in range(len(tile_pages)):
            pl.when(warp == index % WARPS_PER_WARPGROUP)(functools.partial(copy, index))

    plgpu.warp_map(per_warp)


# A score_mod whose results lie within this much of a centre (natural units) runs with
# the centre as a fixed shift of its exponentials (`fixed_softmax_shift`): e**60 times a
# row of 2**20 keys stays far below float32's and bfloat16's largest value, e**-60 far
# above their smallest normal one.
FIXED_SHIFT_MAX_HALF_WIDTH = 60.0


def fixed_softmax_shift(score_program, dtype, with_max: bool):
    """The fixed shift (base-2 units) of the exponentials where the score_mod's results
    are bounded (`mod_program.score_bounds`: a soft-cap's (-cap, cap)), else None.

    A softmax is the same whatever shift its exponentials take; the running row max is
    there only to keep them in range, and bounded logits are in range already. Without
    it a tile saves the row max (a maximum per score and a shuffle reduction per row), its
    exp2 per row and the rescaling of the [64, D] accumulator. bfloat16 only: the
    exponentials, up to e**60, are cast to the input type for p @ v, and float16's
    range ends at 65504. Not with the row max asked for (`with_max`), which this leaves
    uncomputed."""
    if with_max or dtype != jnp.bfloat16:
        return None
    bounds = score_bounds(score_program)
    if bounds is None:
        return None
    low, high = bounds
    if (high - low) / 2 > FIXED_SHIFT_MAX_HALF_WIDTH:
        return None
    return (low + high) / 2 * online_softmax.LOG2_E


def tile_transforms(head_dim: int, contraction_rows: int | None = None):
    """The shared-memory layout of a [rows, head_dim] 16-bit tile: rows of 8 x
    swizzle / 2 elements, swizzled by the widest of 128, 64 and 32 bytes that divides a
    row (wgmma reads the contraction in groups of that width: D 80 in 16s, 96 in 32s),
    and for a tile wgmma contracts along its rows (V in p·v), their count too (wgmma's K
    is a multiple of swizzle / 2: a tile of 32 keys takes 64 bytes)."""
    swizzle = next(width for width in (128, 64, 32) if head_dim * 2 % width == 0
                   and (contraction_rows is None or contraction_rows * 2 % width == 0))
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


# Whether relative reads that `diagonal_blocks` covers take their dense block diagonals
# from their tiles and one side value elsewhere (`diagonal_inputs`); False: the runs
# everywhere (what the tests compare with). H200, paired rounds, ms, dense + sides /
# dense + runs elsewhere / runs everywhere / no mod: causal one-way T5 B4 H16 S4096 D128
# 0.683 / 0.742 / 0.943 / 0.501; B8 S2048 D64 0.342 / 0.362 / 0.634 / 0.227; two-way T5
# noop 1.173 / 1.333 / 1.357 / 0.838; a table clipped to [-64, 64] 0.643 / 0.738 / 1.273;
# B1 S16384 causal 2.770 / 3.040 / 2.972 / 2.216 (docs/gpu-notes.md). The runs' scalar
# table loads, which every tile pays, are what the side values save off the diagonals.
# The dense tiles are loaded by the compute warpgroups from global memory rather than
# copied by TMA into rings beside the K/V stages (whose float32 ring took D 128 to 64-key
# tiles): H200, paired rounds, ms, loads / rings / no mod: causal one-way T5 B4 H16
# S4096 D128 0.678 / 0.704 / 0.511, B8 S2048 D64 0.346 / 0.355 / 0.236, two-way T5 noop
# B4 1.109 / 1.240 / 0.880, bf16 table 0.695 / 0.695, B1 S16384 causal 2.589 / 2.825 /
# 2.272.
DENSE_DIAGONALS = True


def diagonal_inputs(score_program, score_reads, *, paged, batch, heads, q_length,
                    kv_length):
    """(`_kernel`'s diagonal_reads, their dense tiles, their side values) for the
    score_mod's relative reads of float tables that `diagonal_blocks` covers; none on
    pages (not measured there: their relative reads keep the runs)."""
    if paged or score_program is None or not DENSE_DIAGONALS:
        return (), [], []
    found = diagonal_blocks(score_program, score_reads, batch, heads, q_length, kv_length)
    reads = [(key, found[number]) for key, number in numbered(score_reads).items()
             if number in found and jnp.dtype(found[number].tiles.dtype) in BLOCK_DTYPES]
    return (tuple((key, blocks.first, blocks.count) for key, blocks in reads),
            [blocks.tiles for _, blocks in reads], [blocks.sides for _, blocks in reads])


# What the forward's shared memory holds at most (the H100's and H200's 227 KiB, less a
# margin for the barriers and the buffers' alignment: D 64 with 3 stages of 128-key
# 16-bit blocks and a persistent program's output buffer, counted here as 229888 bytes,
# took 232592).
SHARED_MEMORY_BYTES = 227 * 1024 - 6 * 1024


def stages_and_parts(head_dim: int, dtype, block_dtypes, *, persistent: bool,
                     row_buffers: int):
    """(K/V tiles a BlockMask block is walked in, K/V stages): `_PARTS_PER_BLOCK` and
    `_STAGES` where they fit beside the bias blocks' rings (`block_dtypes`: one per bias
    tensor read as blocks, each a [stages, 128, keys] ring); with rings, the most stages
    (at least 2, at most `_STAGES`' keys in flight) that fit, 128-key tiles first, then
    64-key ones; None if none fits."""
    base_parts = _PARTS_PER_BLOCK.get(head_dim, 1)
    if not block_dtypes:
        return base_parts, _STAGES[head_dim]
    itemsize = jnp.dtype(dtype).itemsize
    fixed = (COMPUTE_WARPGROUPS * ROWS_PER_WARPGROUP * head_dim * itemsize * (1 + persistent)
             + row_buffers * COMPUTE_WARPGROUPS * ROWS_PER_WARPGROUP * 4)
    for parts in sorted({base_parts, 2}):
        rows = BLOCK // parts
        per_stage = (2 * rows * head_dim * itemsize
                     + sum(BLOCK * rows * jnp.dtype(t).itemsize for t in block_dtypes))
        # (as many keys in flight as `_STAGES` at most: twice the stages of half tiles)
        for stages in range(_STAGES[head_dim] * parts // base_parts, 1, -1):
            if fixed + stages * per_stage <= SHARED_MEMORY_BYTES:
                return parts, stages
    return None


def choose_items_per_program(requested: int, head_dim: int, mask_program, num_items: int,
                             num_heads: int, *, paged: bool = False,
                             kv_len: int | None = None) -> int:
    """The items a program walks: `requested` (KernelOptions.forward_items_per_program),
    or where that is 0, by head dim, whether the mask reads q_idx, whether the cache is
    paged, the key length (None: long) and how the num_items (head, query block, batch)
    items compare with one wave of programs of at most num_heads (query heads) each: see
    `_ITEMS_PER_PROGRAM` and `_ITEMS_PER_PROGRAM_SHORT_KEYS`."""
    if head_dim == 256:  # a persistent program's output buffer would not fit
        return 1
    if requested:
        return requested
    equal_rows = not reads_index(mask_program, {}, "q_idx")
    default = (_ITEMS_PER_PROGRAM_EQUAL_ROWS_D64 if head_dim == 64 and equal_rows
               else _ITEMS_PER_PROGRAM)
    one_wave = pl.cdiv(num_items, multiprocessor_count())
    if not (equal_rows and head_dim in _ONE_WAVE_HEAD_DIMS and not paged):
        return default
    if one_wave <= num_heads:
        return max(default, one_wave)
    # Here num_items > num_heads * programs: a program of up to num_heads items still
    # leaves a whole wave.
    if kv_len is not None and kv_len <= SHORT_KEYS:
        return max(default, min(_ITEMS_PER_PROGRAM_SHORT_KEYS, num_heads))
    return default


def flex_attention_forward_mosaic(q, k, v, block_mask, score_program, *, scale: float,
                                  interpret: bool, num_stages: int = 0, page_table=None,
                                  lengths=None, with_max: bool = False, sinks=None,
                                  items_per_program: int = 1, row_sums_of=(),
                                  output_gate=None):
    """out [B, Sq, Hq, D] and lse [B, Hq, Sq] (float32), and with_max the row max of the
    logits [B, Hq, Sq], as `forward.flex_attention_forward` (also on a paged cache:
    page_table given, k / v pages; and with sinks [Hq]); only for calls
    `unsupported_reason` accepts. items_per_program: how many consecutive (head, query
    block, batch) items one program walks with one K/V pipeline (`_kernel`; the
    dispatcher's is `choose_items_per_program`'s).
    row_sums_of: positions of captured arrays the score_mod reads once each (as
    `with_read_derivatives` takes them): then per array one more float32 [B, Hq, Sq]
    output, each row's sum over its keys of P g, P the softmax's probabilities (sinks
    included) and g the score's derivative with respect to the value read (0 on rows
    without keys). The fused Mosaic backward takes a captured array's gradient from
    them (`captured_gradients_mosaic.pair_gradients`). output_gate: None or [B, Sq, Hq, D]:
    the output times its sigmoid, in the kernel's epilogue (the gate read in q's dtype)."""
    tables = (block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
              block_mask.kv_num_blocks, block_mask.kv_indices)
    paging = (() if page_table is None
              else (page_table.astype(jnp.int32), lengths.astype(jnp.int32)))
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)
    if output_gate is not None:
        output_gate = output_gate.astype(q.dtype)
    launch = functools.partial(_launch, num_blocks=block_mask.num_blocks,
                               kv_len=block_mask.shape[3], scale=scale, interpret=interpret,
                               num_stages=num_stages, with_max=with_max,
                               items_per_program=items_per_program,
                               row_sums_of=tuple(row_sums_of))
    return _vmappable(launch)(q, k, v, tables, paging, block_mask.mask_mod, score_program,
                              sinks, output_gate)


def _vmappable(launch):
    """`launch` with a batching rule of its own.

    Pallas batches a Mosaic GPU kernel by batching its body, which the compiled kernel
    (wgmma, TMA copies) cannot run. Instead, the vmapped axis folds into the batch axis
    when only q, k, v carry it and no mod reads `b` (the BlockMask tables repeat along
    the new batch); otherwise the kernel runs once per element with `lax.map`.
    """

    @jax.custom_batching.custom_vmap
    def run(q, k, v, tables, paging, mask_program, score_program, sinks, gate):
        return launch(q, k, v, tables, paging, mask_program, score_program, sinks, gate)

    @run.def_vmap
    def rule(axis_size, in_batched, q, k, v, tables, paging, mask_program, score_program,
             sinks, gate):
        args = (q, k, v, tables, paging, mask_program, score_program, sinks, gate)
        # Pages have no batch axis to fold into: paged calls map. Sinks [Hq] fold along
        # with q, k, v where they are not vmapped, an output gate as q does.
        only_qkv = not paging and not any(jax.tree.leaves(in_batched[3:8]))
        reads_batch = mask_program.uses_batch or (score_program is not None
                                                  and score_program.uses_batch)
        batch = q.shape[1] if in_batched[0] else q.shape[0]  # vmapped axes come first
        if only_qkv and not reads_batch:
            q, k, v = (x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
                       for x, batched in zip((q, k, v), in_batched[:3]))
            merged = [x.reshape((axis_size * batch,) + x.shape[2:]) for x in (q, k, v)]
            tables = tuple(t if t.shape[0] == 1
                           else jnp.tile(t, (axis_size,) + (1,) * (t.ndim - 1))
                           for t in tables)
            if gate is not None:
                gate = gate if in_batched[8] else jnp.broadcast_to(gate, (axis_size,)
                                                                   + gate.shape)
                gate = gate.reshape((axis_size * batch,) + gate.shape[2:])
            results = run(*merged, tables, paging, mask_program, score_program, sinks, gate)
            return (tuple(x.reshape((axis_size, batch) + x.shape[1:]) for x in results),
                    tuple(True for _ in results))

        return map_each_element(run, axis_size, in_batched, args)

    return run


def _launch(q, k, v, tables, paging, mask_program, score_program, sinks, gate, *,
            num_blocks, kv_len, scale, interpret, num_stages, items_per_program,
            with_max=False, row_sums_of=()):
    """paging: () or (page_table, lengths), with k / v pages; kv_len: the BlockMask's
    (logical) key length; sinks: None or float32 [Hq]; gate: None or [B, Sq, Hq, D] in
    q's dtype; row_sums_of as `flex_attention_forward_mosaic`'s."""
    batch, q_len, q_heads, head_dim = q.shape
    paged = bool(paging)
    kv_heads = k.shape[1] if paged else k.shape[2]
    num_q_blocks, num_kv_blocks = num_blocks
    # Ragged lengths: zero-pad to whole blocks (as the Triton kernel's wrapper does); the
    # kernel masks the padded keys and the padded query rows are sliced off. Pages are
    # read in place.
    q = pad_axis(q, 1, num_q_blocks * BLOCK)
    if gate is not None:
        gate = pad_axis(gate, 1, num_q_blocks * BLOCK)
    if not paged:
        k = pad_axis(k, 1, num_kv_blocks * BLOCK)
        v = pad_axis(v, 1, num_kv_blocks * BLOCK)
    padded_q_len = q.shape[1]
    fixed_max = fixed_softmax_shift(score_program, q.dtype, with_max)
    mod_program = score_program
    if row_sums_of:  # the kernel evaluates the reads' derivatives beside the mod
        score_program = with_read_derivatives(score_program, row_sums_of)
    mask_reads = tile_reads(mask_program)
    score_reads = tile_reads(score_program, blocks=not paged)
    bias_blocks = bias_block_reads(score_program, score_reads)
    num_items = q_heads * num_q_blocks * batch
    items_per_program = max(1, min(items_per_program, num_items))
    persistent = items_per_program > 1
    row_buffers = 1 + with_max + len(row_sums_of)  # lse (and the row max, the row sums)
    # Pages are copied into 128-row tiles (`_tile_pages`); the paged head dims have one
    # tile a block.
    bias_dtypes = block_dtypes(score_program, score_reads)
    diagonal_reads, diagonal_tiles, diagonal_sides = diagonal_inputs(
        score_program, score_reads, paged=paged, batch=batch, heads=q_heads,
        q_length=num_q_blocks * BLOCK, kv_length=num_kv_blocks * BLOCK)
    fitted = (1, _STAGES[head_dim]) if paged else stages_and_parts(
        head_dim, q.dtype, bias_dtypes, persistent=persistent, row_buffers=row_buffers)
    parts_per_block, planned_stages = fitted
    num_stages = num_stages or planned_stages
    captured = tile_inputs(mask_program, mask_reads, score_program, score_reads,
                           batch=batch, heads=q_heads, q_length=num_q_blocks * BLOCK,
                           kv_length=num_kv_blocks * BLOCK)
    tables = tuple(t.astype(jnp.int32) for t in tables)
    # Each TMA copy into a K/V tile arrives once on its barrier.
    arrivals_per_tile = copies_per_tile(k.shape[2]) if paged else 1
    transforms = tile_transforms(head_dim)

    programs = pl.cdiv(num_items, items_per_program)
    kernel = functools.partial(
        _kernel, mask_program=mask_program, score_program=score_program, scale=scale,
        group=q_heads // kv_heads, num_stages=num_stages, num_q_blocks=num_q_blocks,
        num_heads=q_heads, num_items=num_items, items_per_program=items_per_program,
        q_len=q_len, kv_len=kv_len,
        broadcast_batch=tables[0].shape[0] == 1, broadcast_heads=tables[0].shape[1] == 1,
        mask_reads=mask_reads, score_reads=score_reads, paged=paged, interpret=interpret,
        with_max=with_max, with_sinks=sinks is not None, with_gate=gate is not None,
        fixed_max=fixed_max, parts_per_block=parts_per_block,
        row_sum_sites=len(row_sums_of), mod_program=mod_program, bias_blocks=bias_blocks,
        diagonal_reads=diagonal_reads)
    # (and a persistent program's output, and the bias blocks' rings)
    smem_buffers = 3 + row_buffers + persistent + len(bias_blocks)
    tile_rows = BLOCK // parts_per_block

    def entry(*refs):
        inputs_and_outputs = refs

        def scoped(*scratch):
            smem, barriers = scratch[:smem_buffers], scratch[smem_buffers:]
            kernel(*inputs_and_outputs, (smem, barriers))

        pl.run_scoped(
            scoped,
            plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, head_dim), q.dtype,
                       transforms=transforms),
            plgpu.SMEM((num_stages, BLOCK // parts_per_block, head_dim), q.dtype,
                       transforms=transforms),
            plgpu.SMEM((num_stages, BLOCK // parts_per_block, head_dim), q.dtype,
                       transforms=transforms),
            *[plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP), jnp.float32)
              for _ in range(row_buffers)],
            *([plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, head_dim), q.dtype,
                          transforms=transforms)] if persistent else []),
            *[bias_ring(num_stages, tile_rows, dtype) for dtype in bias_dtypes],
            plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),
            plgpu.Barrier(num_arrivals=arrivals_per_tile, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=arrivals_per_tile, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
            *([plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS)] if gate is not None else []),
            *[plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=num_stages)
              for _ in range(len(bias_blocks))],
            collective_axes="warpgroup",
        )

    out_type = (jax.ShapeDtypeStruct((batch, padded_q_len, q_heads, head_dim), q.dtype),
                ) + (jax.ShapeDtypeStruct((batch, q_heads, padded_q_len), jnp.float32),
                     ) * row_buffers
    out, *rows = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(programs,),
        grid_names=("programs",),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="warpgroup",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, v, *tables, *paging, *([] if sinks is None else [sinks]),
      *([] if gate is None else [gate]), *captured, *diagonal_tiles, *diagonal_sides)
    return (out[:, :q_len],) + tuple(row[:, :, :q_len] for row in rows)
