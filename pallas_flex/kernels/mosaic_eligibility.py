"""Which calls the Mosaic GPU forward (`forward_mosaic.py`) takes, apart from the kernel.

`unsupported_reason` is what `pallas_flex.dispatch` asks; `tile_reads` and
`hand_over_early` are analyses of the mods that the kernel also uses when it is built.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend import core as jex_core

from pallas_flex.kernels import device
# BLOCK (128): the kernels' BlockMask block on both axes, defined beside the relative
# reads' tables, which are built per block diagonal.
from pallas_flex.kernels.relative_reads import (
    BLOCK, entry_count, relative_reads, varying_axes)
from pallas_flex.masks.mod_program import with_read_derivatives, with_score_derivative
from pallas_flex.kernels.tile_mods import (
    EXACT_FLOAT32_INTEGERS, ExactIndices, captured_read_positions, captured_read_sites,
    captured_read_varying_axes, exact_index_reads)

# D 32 (Evoformer's head dim) runs 4 K/V stages of 64-byte swizzled rows. H100, bf16,
# paired rounds, ms, Mosaic / Triton forward / cuDNN: B8 H16 S2048 noop 0.290 / 0.334 /
# 0.310, causal 0.192 / 0.227 / 0.195; B4 S4096 noop 0.540 / 0.653 / 0.594, causal 0.332
# / 0.414 / 0.344; Evoformer gated R256 S256 H8 (pair-bias blocks) 0.163 / 0.169 (XLA
# 1.071), its fwd+bwd 0.789 / 0.792 (the Triton backward's and batch loop's time).
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
# The backward kernels and the paged forward keep the head dims their tiles were sized
# and measured for.
BACKWARD_HEAD_DIMS = (32, 64, 80, 96, 128)
PAGED_HEAD_DIMS = (64, 128)
# The Mosaic GPU backward reduces a captured array's gradient over (batch, head) pairs
# by a compare-and-select sum (`backward.fixed_order_scatter_sum`): tables up to this size.
GRADIENT_TABLE_ENTRIES = 1 << 16
# A T5 table's gradient is summed per (b, h) pair into one shared-memory row of 64 keys
# per entry it reaches (`captured_gradients_mosaic.accumulate_runs`): 64 entries take 32 KiB of
# the dK/dV kernel's shared memory.
RELATIVE_GRADIENT_ENTRIES = 64
# Pages must hold a multiple of this many rows (one TMA copy per page and tile).
PAGE_ROWS_MULTIPLE = 8

# Score mods with these primitives keep the late hand-over at D 128 (see hand_over_early).
_TRANSCENDENTAL = {"tanh", "exp", "exp2", "log", "log1p", "expm1", "logistic", "pow",
                   "sqrt", "rsqrt", "cbrt", "erf", "erfc", "sin", "cos", "tan", "atan2"}
# Load a mod's reads of captured arrays at q_idx / kv_idx (document ids) as contiguous
# slices (`contiguous_reads`), so that document masks run on this kernel. On the H100
# (B4 H16 S4096 D128, 12 causal documents) 0.176 ms against 0.220 for the Triton
# kernel.

# Primitives with a Mosaic GPU lowering rule on register arrays (jax 0.11), plus the
# structural ones the tile interpreter handles itself (captured-array reads, size-1
# reshapes, calls it inlines). A mod using anything else runs on the Triton kernel.
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "and", "or",
    "xor", "not", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "convert_element_type",
    "exp", "exp2", "log", "log2", "tanh", "integer_pow", "square", "sqrt", "rsqrt",
    "clamp", "round", "erf", "one_minus_square", "add_any",
}
_STRUCTURAL = {"dynamic_slice", "squeeze", "reshape", "expand_dims", "broadcast_in_dim",
               "pjit", "jit", "closed_call", "custom_jvp_call", "remat", "checkpoint"}

def _primitives(jaxpr):
    for equation in jaxpr.eqns:
        yield equation.primitive.name
        for value in equation.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jex_core.Jaxpr):
                yield from _primitives(inner)


def hand_over_early(head_dim, score_program):
    """Whether the compute warpgroups hand the tensor cores to each other right after
    issuing q·kᵀ, before its result lands (as JAX's Mosaic GPU attention does), or only
    once it has landed.

    Measured on the H100 (A/B probes of both forms, paired rounds in one process; ms,
    bf16, early / late): at B4 H16 S4096 D128 noop 0.893 / 0.959 (cuDNN 0.90), prefix-LM
    0.517 / 0.539, ALiBi 0.555 / 0.556, causal 0.486 / 0.492, but soft-cap (a tanh per
    score) 0.587 / 0.579, and at B1 S16384 2.130 / 2.012. At B8 S2048 D64 a score_mod
    gains from early (soft-cap 0.271 / 0.279, ALiBi 0.246 / 0.253) and masks alone from
    late (noop 0.377 / 0.371, causal 0.218 / 0.216, prefix-LM 0.251 / 0.245).
    """
    if head_dim != 128:
        return score_program is not None
    return not _has_transcendental(score_program)


def named_turn_barriers(head_dim, score_program) -> bool:
    """Whether the compute warpgroups take their turns with named hardware barriers
    (`bar.arrive` / `bar.sync`, FlashAttention-3's ping-pong, as tokamax's kernel) rather
    than an mbarrier both arrive on and wait for (a rendezvous, JAX's `attention_mgpu`):
    at D 128 where the turn passes at the q·kᵀ issue (`hand_over_early`).

    H100, paired rounds of AOT-compiled calls, bf16 forward, ms, named / mbarrier: B4 H16
    S4096 D128 noop 0.941 / 0.961, causal 0.501 / 0.510, causal + ALiBi 0.544 / 0.555; B1
    S16384 noop 3.582 / 3.605, causal 1.748 / 1.830; GQA 32:8 noop 1.889 / 1.891; B4 noop
    fwd+bwd 3.972 / 3.991 (outputs bitwise the same). Not where the turn passes after the
    scores are read, where the rendezvous keeps the two softmaxes from overlapping on the
    transcendental unit: causal + soft-cap 30 at D128 0.699 / 0.527, B8 S2048 D64 noop
    0.370 / 0.333, causal 0.222 / 0.206. D 64 hands over early only with a score_mod, and
    there named barriers did not gain either (causal + soft-cap 30 0.240 / 0.237).
    """
    return head_dim == 128 and hand_over_early(head_dim, score_program)


def captured_row_sums(head_dim) -> bool:
    """Whether the Mosaic forward returns, for each captured array read at b and h whose
    gradient is wanted, each row's sum C = sum P g of the score's derivative g with
    respect to the value read (`mosaic_tiles.weighted_row_sums`), from which the Mosaic
    backward takes that gradient, sum P dP (g - C) + dlse C, with no delta at all: per
    key in the fused D 64 kernel (`FUSE_CAPTURED_GRADIENTS`), else one row sum an array
    in the dQ kernel (`captured_gradients_mosaic.accumulate_rows_from_forward`) where the exact
    deltas take four (the delta's two and two an array). Also closer to float64:
    interpret mode, bidirectional T5 table + slopes, the slopes' gradient 2.7e-5 off
    against the exact deltas' 3.8e-4 (tests/kernels/test_backward_mosaic.py). Without
    them the dQ kernel's sums correct each row to its exact delta
    (`captured_gradients_mosaic.captured_gradients`) and D 64 keeps the two kernels.

    At head dim 64 only. H200, causal forward+backward with learnable ALiBi slopes, bf16,
    paired rounds, ms, exact deltas / row sums in the dQ kernel / row sums fused / the
    same call without the slopes' gradient: B8 H16 S2048 D64 0.995 / 0.968 / 0.938 /
    0.854 (1.165x / 1.133x / 1.098x), B2 S8192 3.123 / 3.050 / 2.879 / 2.582 (1.210x /
    1.182x / 1.115x), GQA 32:8 B4 S4096 3.250 / 3.137 / 3.061 / 2.666 (1.219x / 1.177x /
    1.148x); at D 128, where nothing fuses, the forward's row sums cost more than the dQ
    kernel saves: B4 H16 S4096 2.505 / 2.682 / - / 2.298 (1.090x / 1.167x), GQA 32:8
    4.844 / 5.160 / - / 4.394 (1.102x / 1.174x). Gradients: dk, dv bitwise the exact
    deltas', dq within 8.1e-4 (fused), d_slopes within 7.4e-5 (relative to the largest
    entry).
    """
    return head_dim == 64
# With the forward's row sums (`captured_row_sums`), whether D 64 takes the captured
# arrays' gradients in the fused dK/dV/dQ kernel (`fuses_dq`; figures there).
# What the fused kernel did before, measured on the H200 (B8 H16 S2048, B2 S8192, GQA
# 32:8 B4 S4096; D 64 causal ALiBi fwd+bwd, ms, two kernels / fused / without the
# slopes' gradient): correcting each row to its exact delta by column sums (sum P dP,
# sum P g over the keys: reductions across the warps, whose one shared-memory scratch
# the two compute warpgroups had to take in turns) it was right (gradients within 8e-4
# of the two kernels') and slow: 0.993 / 1.619 / 0.868, 3.092 / 5.393 / 2.587,
# 3.211 / 5.821 / 2.661.
FUSE_CAPTURED_GRADIENTS = True


def fuses_dq(head_dim, gradient_positions, deterministic, relative_positions=(),
             forward_row_sums=False, block_positions=()) -> bool:
    """Whether the Mosaic GPU backward computes dQ in its dK/dV kernel (dS^T through
    shared memory, dQ += dS K per 64-key tile, float32 pieces TMA-reduce-added into a
    zeroed dQ: 5 matmuls per tile pair) instead of a dQ kernel of its own (which
    recomputes S and dP: 7). At D 64 only, and not where results must be bitwise
    reproducible (the reduce-adds' order varies run to run). With gradients of captured
    arrays (`gradient_positions`) only where `FUSE_CAPTURED_GRADIENTS` is set, none is
    read at kv_idx - q_idx (`relative_positions`, T5 tables: their sums by entry need
    each row's exact delta inside the dK/dV kernel, which the dQ kernel's row sums give
    it) and the forward gave each array's row sums C = sum P g (`forward_row_sums`,
    `captured_row_sums`): a row's share of the gradient, sum P (dP - delta*) g with
    delta* = sum P dP, is sum P dP (g - C), summed per key in the dK/dV kernel without
    any delta (`captured_gradients_mosaic.accumulate_pair`).

    H100, bf16 fwd+bwd, paired rounds, ms, fused / two kernels: B8 H16 S2048 D64 noop
    1.235 / 1.317 (cuDNN ~1.30). At D 128 the fused kernel spilled 450-540 bytes of
    registers (dK, dV [64, 128] float32 beside S, dP and the dQ tile) and lost at every
    variant tried (B4 H16 S4096 noop, two kernels 3.87): each warpgroup half of dQ's
    columns over both warpgroups' keys (dS^T halves shared, a named barrier) 5.13-5.22,
    without the barrier (wrong; to measure it) 4.59, dK's wgmma reading dS^T from shared
    memory with 240 registers 4.67, each warpgroup its own keys in two column pieces
    5.41-5.48, the dQ wgmmas issued after the step's score accumulators are read and dK's
    wgmma has landed 5.51 (still 444-548 B of spills); plain stores instead of
    reduce-adds (wrong) 4.82, no dQ store at all 4.85-5.53: not the reduction's traffic
    but the registers. Staggering the programs' walks (each key block starting at its own
    query block) and key blocks first in the grid were slower (4.72 / 6.34 against
    5.19). With 32-query steps instead (S^T, dP^T [64, 32] and dQ^T = K^T dS^T [128, 32]:
    60 B of spills) it lost to the two kernels 4.76 / 3.88 (B4 noop) and 16.99 / 15.36
    (B1 S16384 noop): twice the steps' fixed costs (docs/gpu-notes.md). FlashAttention-3's
    layout (commit 0ed59cd: queries on the tiles' rows, so that lse and delta are row
    vectors; P and dS through shared memory for dV's and dK's wgmmas; each warpgroup half
    of dQ's columns over both warpgroups' keys) was right on the H100 (GPU tests), still
    spilled 304 B and lost at every shape, fwd+bwd ms, two kernels / it / cuDNN: B4
    S4096 noop 3.93 / 4.64 / 3.71, causal 2.10 / 2.62 / 2.12; B1 S16384 noop 14.96 /
    16.47 / 13.84 (docs/gpu-notes.md)."""
    if (head_dim != 64 or deterministic or tuple(relative_positions)
            or tuple(block_positions)):  # (the two kernels' dK/dV one sums those)
        return False
    return not tuple(gradient_positions) or (FUSE_CAPTURED_GRADIENTS and forward_row_sums)


def _has_transcendental(score_program) -> bool:
    return score_program is not None and bool(
        set(_primitives(score_program.jaxpr)) & _TRANSCENDENTAL)


def exp2_fma_share(head_dim, score_program):
    """(a, b): a of every b registers of the forward's softmax tile compute exp2 on the FMA
    units (`fma_exp2`), or None: all on the transcendental unit.

    Only where that unit sets the pace: head dim 64 with a score_mod that has a
    transcendental of its own (a soft-cap's tanh). Measured on the H100 (AOT-compiled
    variants, paired rounds; ms, bf16, all on MUFU / 1 of 4 / 3 of 8 / 1 of 2 / 5 of 8 on
    the FMA units): B8 H16 S2048 D64 causal + soft-cap 30 0.260 / 0.240 / 0.243 / 0.238 /
    0.236 (causal alone 0.200: 1.30x -> 1.18x). Everywhere else the extra instructions
    cost more than the unit's time they free: D64 noop 0.334 / 0.366 / 0.393 / 0.398 /
    0.428, causal 0.200 / 0.218 / 0.219 / 0.232 / 0.244; B4 S4096 D128 causal 0.504 /
    0.519 / 0.543 / 0.559 / 0.581, soft-cap 0.537 / 0.571 / 0.577 / 0.578 / 0.580; B1
    S16384 D128 soft-cap 1.926 / 2.066 / 2.095 / 2.057 / 2.190.
    """
    return (5, 8) if head_dim <= 64 and _has_transcendental(score_program) else None


def contiguous_reads(program, blocks: bool = False):
    """The mod's reads of captured arrays at exactly q_idx or kv_idx along one axis, other
    indices uniform over a tile (`exact_index_reads`): {id(dynamic_slice equation):
    (captured position, axis, "q" or "kv")}; with `blocks`, also float arrays read at
    exactly q_idx along one axis and kv_idx along a later one (a bias tensor:
    `pair_bias[b // rows, h, q_idx, kv_idx]`): (captured position, (q axis, kv axis),
    "block").

    Such a read (document ids `doc_ids[q_idx]`, a per-position table `bias[h, kv_idx]`)
    covers a contiguous slice per tile, which the kernel loads as one vector (a block: one
    tile of the array) instead of gathering. Blocks are the forward's only (`tile_reads`).
    """
    reads = {}
    for equation, position, kinds, uniform in exact_index_reads(program):
        vector_axes = [axis for axis, kind in enumerate(kinds) if kind is not None]
        if len(vector_axes) == 1 and uniform:
            reads[id(equation)] = (position, vector_axes[0], kinds[vector_axes[0]])
        elif (blocks and uniform and [kinds[a] for a in vector_axes] == ["q", "kv"]
              and vector_axes[1] == len(kinds) - 1  # (TMA's box: whole rows of keys)
              and jnp.dtype(jnp.result_type(program.consts[position])) in BLOCK_DTYPES
              and block_indices(program, equation) is not None):
            reads[id(equation)] = (position, tuple(vector_axes), "block")
    return reads


# The dtypes of the bias tensors whose [q, kv] blocks the Mosaic forward copies by TMA.
BLOCK_DTYPES = tuple(jnp.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32))


def block_indices(program, equation):
    """For a read of a captured array at [.., q_idx, kv_idx] (the dynamic_slice
    `equation` of `program`'s jaxpr): a function of (b, h) giving the read's start index
    on each axis, None on the q and kv axes, or None where an index on another axis
    depends on anything but b, h and constants (a captured array, an index, the score).

    The Mosaic forward's memory warpgroup copies the read's [q, kv] blocks by TMA ahead
    of the compute warpgroups, which evaluate the mod; it runs this slice of the mod
    (`b // rows` for a pair bias shared by an MSA's rows) to address them."""
    jaxpr = program.jaxpr
    first_index = 2 + (program.kind == "score")
    batch_var, head_var = jaxpr.invars[first_index - 2], jaxpr.invars[first_index - 1]
    exact = ExactIndices(program)
    earlier = jaxpr.eqns[:next(i for i, e in enumerate(jaxpr.eqns) if e is equation)]
    for step in earlier:
        exact.follow(step)
    atoms = equation.invars[1:]
    other = [atom for atom in atoms if exact.of(atom) is None]
    needed = {atom for atom in other if isinstance(atom, jex_core.Var)}
    steps = []
    for step in reversed(earlier):
        if needed & set(step.outvars):
            steps.append(step)
            needed.update(a for a in step.invars if isinstance(a, jex_core.Var))
    if needed - {batch_var, head_var} - {v for step in steps for v in step.outvars}:
        return None
    steps.reverse()

    def indices(batch, head):
        values = {batch_var: batch, head_var: head}

        def value(atom):
            return values[atom] if isinstance(atom, jex_core.Var) else atom.val

        for step in steps:
            outputs = step.primitive.bind(*map(value, step.invars), **step.params)
            if not step.primitive.multiple_results:
                outputs = [outputs]
            values.update(zip(step.outvars, outputs))
        return [None if exact.of(atom) is not None else value(atom) for atom in atoms]
    return indices


def block_dtypes(program, reads) -> list:
    """The dtypes of the bias tensors `program` reads as [q, kv] blocks (`reads`: its
    `tile_reads` with blocks), in the reads' order: one shared-memory ring each in the
    Mosaic forward (`forward_mosaic.stages_and_parts`)."""
    return [jnp.dtype(program.consts[position].dtype)
            for position, _, kind in reads.values() if kind == "block"]


def tile_reads(program, blocks: bool = False) -> dict:
    """The mod's reads of captured arrays the Mosaic GPU kernels load without a gather:
    `contiguous_reads` (at exactly q_idx or kv_idx; with `blocks`, the forward's, also
    [q, kv] blocks of a bias tensor) and `relative_reads.relative_reads` (at indices of
    kv_idx - q_idx: T5 buckets), {id(dynamic_slice equation): (captured position, axis
    or axes, "q" / "kv" / "block" / "relative")}."""
    return {**contiguous_reads(program, blocks), **relative_reads(program)}


def device_unsupported_reason():
    """None on Hopper, which the Mosaic GPU kernels are written for, else why not."""
    capability = device.compute_capability()
    if capability is None:
        return "no GPU"
    if capability != device.HOPPER:
        return (f"compute capability {capability[0]}.{capability[1]} (it is written for "
                "Hopper, 9.0)")
    return None


def mod_unsupported_reason(program, blocks: bool = False):
    """None if the kernel can run `program` (None included), else why not. blocks: the
    kernel loads [q, kv] blocks of bias tensors (`contiguous_reads`; the forward)."""
    if program is None:
        return None
    unknown = sorted(set(_primitives(program.jaxpr)) - _ELEMENTWISE - _STRUCTURAL)
    if unknown:
        return f"{program.kind}_mod {program.name!r} uses {unknown}"
    slices = {key: (lambda captured, indices: jnp.zeros((), captured.ref.dtype), axis)
              for key, (_, axis, _) in tile_reads(program, blocks).items()}
    sites = captured_read_sites(program, captured_reads=slices)
    if any(jnp.shape(index) != () for _, indices in sites for index in indices):
        return (f"{program.kind}_mod {program.name!r} reads a captured array at indices "
                "computed from q_idx or kv_idx (a per-element gather)")
    return None


# What the Mosaic GPU backward takes but backward_kernel "auto" does not give it yet:
# checked on the CPU (interpret mode against float64, and lowering for Hopper), not yet
# timed on the GPU against the Triton backward; kernel_options {"backward_kernel":
# "mosaic"} runs them (`awaiting_measurement`). Score_mods reading bias tensors at
# (q_idx, kv_idx) (the dQ kernel copies [128, keys] blocks beside its K/V stages, the
# dK/dV kernel [128 keys, 64 queries] blocks of the transposed array beside its query
# stages; their gradients by TMA reduce-adds of each dK/dV tile), and head dim 32 (4
# stages of 64-byte swizzled rows in both kernels).
BACKWARD_BIAS_BLOCKS_BY_DEFAULT = False
BACKWARD_NAMED_ONLY_HEAD_DIMS = (32,)


def awaiting_measurement(score_program, head_dim: int):
    """None, or why backward_kernel "auto" keeps the Triton backward for a call the
    Mosaic GPU backward takes (see BACKWARD_NAMED_ONLY_HEAD_DIMS)."""
    if head_dim in BACKWARD_NAMED_ONLY_HEAD_DIMS:
        return f"head dim {head_dim}"
    if not BACKWARD_BIAS_BLOCKS_BY_DEFAULT and reads_bias_blocks(score_program):
        return "a score_mod reading a bias tensor at (q_idx, kv_idx)"
    return None


def reads_bias_blocks(score_program) -> bool:
    """Whether the score_mod reads a bias tensor at (q_idx, kv_idx), which the Mosaic
    kernels copy as blocks (`contiguous_reads`)."""
    return score_program is not None and any(
        kind == "block" for _, _, kind in tile_reads(score_program, blocks=True).values())


def backward_unsupported_reason(score_program, head_dim: int = 128, dtype=jnp.bfloat16,
                                gradient_tiles: int = 0):
    """None if the Mosaic GPU backward takes a call the Mosaic forward takes: its head
    dim, the score_mod's derivative (traced with `mod_program.with_score_derivative`)
    in what the kernels run, and the rings of the bias tensors it reads at (q_idx,
    kv_idx) in shared memory beside the tiles (`backward_mosaic.stages_beside_bias_blocks`,
    for either dK/dV kernel; `gradient_tiles`: how many of them train, see
    `block_positions`); else why not."""
    if head_dim not in BACKWARD_HEAD_DIMS:
        return f"head dim {head_dim} (the Mosaic backward takes D in {BACKWARD_HEAD_DIMS})"
    if score_program is None:
        return None
    reason = mod_unsupported_reason(score_program, blocks=True)
    if reason is not None:
        return reason
    dtypes = block_dtypes(score_program, tile_reads(score_program, blocks=True))
    if dtypes:
        from pallas_flex.kernels import backward_mosaic  # (which imports this module)
        for fused in (False, True) if head_dim == 64 else (False,):  # (`fuses_dq`)
            if backward_mosaic.stages_beside_bias_blocks(
                    head_dim, dtype, dtypes, dtypes, fused=fused and not gradient_tiles,
                    gradient_tiles=gradient_tiles) is None:
                return (f"score_mod {score_program.name!r} reading bias tensors at "
                        f"(q_idx, kv_idx) whose blocks do not fit the backward's shared "
                        f"memory at head dim {head_dim}")
    return mod_unsupported_reason(with_score_derivative(score_program), blocks=True)


def differentiated_positions(score_program, wanted) -> tuple:
    """The positions of the score_mod's captured arrays whose gradients are wanted
    (`wanted`: one bool per captured array, or None for none) and floating."""
    if score_program is None or wanted is None:
        return ()
    return tuple(position for position, (flag, const) in enumerate(
        zip(wanted, score_program.consts))
        if flag and jnp.issubdtype(jnp.result_type(const), jnp.floating))


def block_positions(score_program, positions) -> tuple:
    """Those of `positions` whose array the score_mod reads as [q, kv] blocks of a bias
    tensor (`contiguous_reads`' blocks): the Mosaic dK/dV kernel reduce-adds each tile's
    dS' g into their gradients (`backward_mosaic`)."""
    if not positions:
        return ()
    read = {position for position, _, kind in tile_reads(score_program, blocks=True).values()
            if kind == "block"}
    return tuple(position for position in positions if position in read)


def relative_positions(score_program, positions) -> tuple:
    """Those of `positions` whose array the score_mod reads at indices of kv_idx - q_idx
    (`relative_reads`: T5 buckets); the others it reads at indices of b and h only."""
    if not positions:
        return ()
    relative = varying_axes(score_program)
    return tuple(position for position in positions if position in relative)


def captured_gradient_unsupported_reason(score_program, positions) -> str | None:
    """None if the Mosaic GPU backward computes the gradients of the captured arrays at
    `positions` (`differentiated_positions`), else why not. It takes arrays the mod
    reads once, at indices of b and h only (learnable ALiBi slopes, a per-head bias or
    temperature), at indices of kv_idx - q_idx (a T5 table: `relative_reads`) reaching
    at most RELATIVE_GRADIENT_ENTRIES entries a (b, h) pair (all such arrays together),
    of at most GRADIENT_TABLE_ENTRIES entries, or as [q, kv] blocks (a bias tensor,
    shared by batch rows or not: `block_positions`); the Triton backward sums the others
    (reads per element at other indices: q_idx or kv_idx alone, gathers)."""
    if not positions:
        return None
    read_positions = captured_read_positions(score_program)
    varying = captured_read_varying_axes(score_program)
    relative = relative_positions(score_program, positions)
    blocks = block_positions(score_program, positions)
    for position in positions:
        sites = [site for site, read in enumerate(read_positions) if read == position]
        what = f"score_mod {score_program.name!r} captured array #{position}"
        if len(sites) != 1:
            return f"gradients of {what}, read {len(sites)} times (it takes one read)"
        if blocks and position in blocks:
            continue
        if position not in relative and any(varying[sites[0]]):
            return (f"gradients of {what}, read at indices computed from q_idx or kv_idx "
                    "other than through kv_idx - q_idx or as [q, kv] blocks (the Triton "
                    "backward sums those)")
        if jnp.size(score_program.consts[position]) > GRADIENT_TABLE_ENTRIES:
            return (f"gradients of {what}, of more than {GRADIENT_TABLE_ENTRIES} entries")
    entries = sum(entry_count(score_program, position) for position in relative)
    if entries > RELATIVE_GRADIENT_ENTRIES:
        return (f"gradients of arrays read at {entries} entries of kv_idx - q_idx a (b, h) "
                f"pair (it takes {RELATIVE_GRADIENT_ENTRIES})")
    try:
        program = with_read_derivatives(score_program, positions)
    except ValueError as error:
        return f"gradients of captured arrays: {error}"
    return mod_unsupported_reason(program, blocks=True)


# A score_mod reading a bias tensor at (q_idx, kv_idx) (`contiguous_reads`' blocks: a
# pair bias, `scores.bias_lookup`): the Mosaic forward's memory warpgroup copies its
# [128, keys] blocks by TMA beside the K/V tiles (`forward_mosaic._kernel`'s
# bias_blocks). H200, paired rounds, Mosaic / Triton forward, ms: a [1, H, S, S] bf16
# bias at B4 H16 S4096 D128 causal 0.644 / 1.111 (causal without it 0.484), noop 1.245 /
# 1.905, D64 causal 0.444 / 0.618, noop 0.859 / 1.125; Evoformer's gated row attention
# R256 S256 H8 D64 0.189 / 0.228 (XLA 1.095), D128 0.292 / 0.362 (XLA 1.323). Loaded
# instead by each compute warpgroup from GMEM when the mod ran, it was 0.275 ms at the
# Evoformer D64 shape, and at S 4096 it hung (the first call returned, the next never
# did). On pages the blocks are not contiguous: the Triton forward reads them there.


def unsupported_reason(q, k, v, block_mask, score_program, *, interpret: bool,
                       paged: bool = False):
    """None if the Mosaic GPU kernel runs this call, else why not (a short phrase).
    paged: k / v are pages [num_pages, Hkv, page_size, D] (see `_tile_pages`)."""
    _, q_len, _, head_dim = q.shape
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {q.dtype} (it takes bfloat16 and float16)"
    if head_dim not in HEAD_DIMS or v.shape[3] != head_dim:
        return f"head dims {head_dim}/{v.shape[3]} (it takes D = Dv in {HEAD_DIMS})"
    if paged and head_dim not in PAGED_HEAD_DIMS:
        return f"head dim {head_dim} on pages (it takes D in {PAGED_HEAD_DIMS} there)"
    if tuple(block_mask.block_size) != (BLOCK, BLOCK):
        return f"BlockMask block size {block_mask.block_size} (it takes {BLOCK}x{BLOCK})"
    kv_len = block_mask.shape[3]
    if paged:
        page_size = k.shape[2]
        if page_size % PAGE_ROWS_MULTIPLE or (BLOCK % page_size and page_size % BLOCK):
            return (f"page size {page_size} (it takes multiples of 128 and divisors of 128 "
                    f"that are multiples of {PAGE_ROWS_MULTIPLE})")
    if max(q_len, kv_len) > EXACT_FLOAT32_INTEGERS:  # see `_evaluate`
        return f"lengths {q_len}/{kv_len} above {EXACT_FLOAT32_INTEGERS}"
    if not interpret and (reason := device_unsupported_reason()) is not None:
        return reason
    reason = mod_unsupported_reason(block_mask.mask_mod)
    if reason is not None:
        return reason
    reason = mod_unsupported_reason(score_program, blocks=not paged)
    if reason and paged and mod_unsupported_reason(score_program, True) is None:
        return (f"score_mod {score_program.name!r} reading a bias tensor at (q_idx, kv_idx) "
                "on pages")
    if reason is None and not paged and score_program is not None:
        from pallas_flex.kernels import forward_mosaic  # (which imports this module)
        dtypes = block_dtypes(score_program, tile_reads(score_program, blocks=True))
        if dtypes and forward_mosaic.stages_and_parts(  # (one item a program at D 256)
                head_dim, q.dtype, dtypes, persistent=head_dim != 256,
                row_buffers=3) is None:
            return (f"score_mod {score_program.name!r} reading bias tensors at (q_idx, "
                    f"kv_idx) whose blocks do not fit shared memory at head dim {head_dim}")
    return reason
