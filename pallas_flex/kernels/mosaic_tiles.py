"""What the Mosaic GPU kernels share: mods on register tiles, and the matmuls.

A compute warpgroup holds a tile of scores in the wgmma register layout: 64 rows (the
warpgroup's own) by a tile's columns. The forward and the backward's dQ kernel put
queries on the rows and keys on the columns; the dK/dV kernel the other way round.
Index vectors are 1-D arrays in the layout of one tile axis, so that a mod's index
arithmetic runs once per row or column, not per element; `Vector` says which axis a
vector runs along (a 64x64 tile has vectors of one length on both), and operations on
vectors of one axis keep it. `to_tile` spreads a vector over the tile where it meets
another axis or the scores.

In Mosaic GPU's interpret mode (CPU tests) wgmma has no rule: `matmul` is a plain dot
there, and everything else is the kernels' own code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels.tile_mods import (
    CaptureLog, CapturedRef, captured_inputs, evaluate_jaxpr_on_tiles, reads_argument)

ROWS_PER_WARPGROUP = 64

def _integer_pow(x, *, y):
    """x ** y for Mosaic GPU, whose rule takes y >= 2 and y = -1 only (the derivative of
    a division is x ** -2)."""
    if y >= 2:
        return lax.integer_pow(x, y)
    if y == 1:
        return x
    if y == 0:
        return jnp.ones_like(x)
    return 1.0 / _integer_pow(x, y=-y)


# Mosaic GPU's `not` on a bool tile converts 1-bit registers, which it cannot
# ("Register bitwidth ... must be divisible by 8"): xor with True says the same.
PRIMITIVE_OVERRIDES = {
    "not": lambda x: x ^ True if x.dtype == jnp.bool_ else ~x,
    "integer_pow": _integer_pow,
    "add_any": lambda x, y: x + y,  # a derivative's sum of two contributions
}


@dataclasses.dataclass(frozen=True)
class Vector:
    """A 1-D array with one entry per position along tile axis `axis` (0: rows)."""
    value: jax.Array
    axis: int


def vector_layout(axis: int):
    """The register layout of a vector along tile axis `axis` of a wgmma tile."""
    return plgpu.Layout.WGMMA.reduce(1 - axis)


def index_vector(start, length: int, axis: int, below=None) -> Vector:
    """start, start + 1, ... along tile axis `axis`, clamped to `below - 1` when given
    (mods see in-range indices on a ragged tail; those rows or columns are masked or
    sliced off)."""
    iota = plgpu.broadcasted_iota(jnp.int32, (length,), 0, layout=vector_layout(axis))
    indices = start + iota
    return Vector(indices if below is None else jnp.minimum(indices, below - 1), axis)


def to_tile(x, shape):
    """x (a scalar, a Vector or a tile) as an array of the tile's `shape`."""
    if isinstance(x, Vector):
        return lax.broadcast_in_dim(x.value, shape, [x.axis])
    if jnp.shape(x) == tuple(shape):
        return x
    return jnp.broadcast_to(x, shape)


def tile_applier(shape):
    """`apply` for `evaluate_jaxpr_on_tiles` on a tile of `shape`: operations on scalars
    and vectors of one axis stay scalars or vectors (of that axis); anything else runs on
    the tile."""
    def apply(function, operands):
        axes = {x.axis for x in operands if isinstance(x, Vector)}
        has_tile = any(not isinstance(x, Vector) and jnp.ndim(x) > 0 for x in operands)
        if not axes and not has_tile:
            return function(*operands)
        if len(axes) == 1 and not has_tile:
            (axis,) = axes
            length = shape[axis]
            values = [x.value if isinstance(x, Vector) else jnp.broadcast_to(x, (length,))
                      for x in operands]
            return Vector(function(*values), axis)
        return function(*[to_tile(x, shape) for x in operands])
    return apply


def apply_mask(logits, program, reads, refs, args, *, extra_keep=None, tile, q_axis, q_start,
               kv_start, interpret):
    """logits with -inf where the mask_mod (args: b, h, q_idx, kv_idx), and `extra_keep`
    (a Vector or None) where given, is False."""
    (keep,) = evaluate(program, reads, refs, args, tile=tile, q_axis=q_axis, q_start=q_start,
                       kv_start=kv_start, interpret=interpret)
    if extra_keep is not None:
        keep = tile_applier(tile)(jnp.logical_and, [keep, extra_keep])
    if not isinstance(keep, Vector) and jnp.shape(keep) == ():  # reads no index (noop_mask)
        return logits + jnp.where(keep, 0.0, -jnp.inf)
    return jnp.where(to_tile(keep, tile), logits, -jnp.inf)


def map_each_element(run, axis_size, in_batched, args):
    """`run(*args)` under jax.vmap as a `custom_vmap` rule that runs it once per element
    (`lax.map`): Pallas would batch a Mosaic GPU kernel by batching its body, which the
    compiled kernel cannot run. Returns (outputs, out_batched)."""
    del axis_size
    leaves, treedef = jax.tree.flatten(args)
    flags = jax.tree.leaves(in_batched)

    def one(batched_leaves):
        remaining = iter(batched_leaves)
        element = [next(remaining) if batched else leaf for leaf, batched in zip(leaves, flags)]
        return run(*jax.tree.unflatten(treedef, element))

    outs = lax.map(one, [leaf for leaf, batched in zip(leaves, flags) if batched])
    return outs, jax.tree.map(lambda _: True, outs)


def reads_index(program, reads, name: str) -> bool:
    """Whether a kernel must build `name`'s index vector for `program`: it reads it
    other than as the index of one of its contiguous `reads`."""
    if program is None:
        return False
    position = {"q_idx": 2, "kv_idx": 3}[name] + (program.kind == "score")
    return reads_argument(program.jaxpr, position, reads)


def evaluate(program, reads, refs, args, *, tile, q_axis, q_start, kv_start, interpret):
    """Runs a mod on a kernel's index vectors and score tile ([64, columns]; queries
    along `q_axis`). args: (score,) b, h, q_idx, kv_idx, the indices clamped into the
    lengths, at most 2**24: an int difference of them converted to float32 is converted
    per vector instead (see evaluate_jaxpr_on_tiles). Its contiguous `reads` at q_idx /
    kv_idx load the slice from row q_start or kv_start of the captured array (as many
    rows as the tile has along that axis), edge-padded by the caller. Returns the mod's
    outputs as scalars, Vectors or tiles."""
    consts = [CapturedRef(ref, jnp.shape(c), position, CaptureLog())
              for position, (ref, c) in enumerate(zip(refs, program.consts))]
    first_index_arg = 2 + (program.kind == "score")

    def slice_reader(axis, kind):
        tile_axis = q_axis if kind == "q" else 1 - q_axis
        start = q_start if kind == "q" else kv_start

        def read(captured, indices):
            index = [None if i is None else jnp.clip(i, 0, size - 1)
                     for i, size in zip(indices, captured.shape)]
            index[axis] = pl.ds(start, tile[tile_axis])
            if interpret:
                return Vector(captured.ref[tuple(index)], tile_axis)
            # From GMEM: Mosaic GPU has no "optimized" (vectorized) transfer for it.
            return Vector(plgpu.load(captured.ref.at[tuple(index)],
                                     layout=vector_layout(tile_axis), optimized=False),
                          tile_axis)
        return read

    readers = {key: (slice_reader(axis, kind), axis)
               for key, (_, axis, kind) in reads.items()}
    return evaluate_jaxpr_on_tiles(
        program.jaxpr, consts, args, program.name,
        small_index_args=(first_index_arg, first_index_arg + 1),
        primitive_overrides=PRIMITIVE_OVERRIDES, captured_reads=readers,
        apply=tile_applier(tile))


def padded_for_slices(program, reads, q_length: int, kv_length: int):
    """`captured_inputs(program)`, each array of its contiguous `reads` edge-padded along
    the read's axis to the kernel's padded q_length / kv_length: a slice read past the
    array's end then sees its last entry, which is what the clamped index of the scalar
    semantics reads."""
    arrays = captured_inputs(program)
    for position, axis, kind in reads.values():
        length = q_length if kind == "q" else kv_length
        array = arrays[position]
        if array.shape[axis] < length:
            widths = [(0, 0)] * array.ndim
            widths[axis] = (0, length - array.shape[axis])
            arrays[position] = jnp.pad(array, widths, mode="edge")
    return arrays


def load_vector(ref, axis: int, interpret: bool):
    """A [n] float32 vector from shared memory, in the layout of tile axis `axis`."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, layout=vector_layout(axis))


def matmul(a, b_smem, *, shape, interpret, transpose_b=False, accumulator=None,
           after_issue=None):
    """accumulator (or zeros) + a · b as a float32 [shape] tile, by wgmma: `a` a shared
    memory ref or a 16-bit register tile, `b_smem` a shared memory ref ([K, N], or
    [N, K] with transpose_b). `after_issue` runs while the wgmma is in flight."""
    if interpret:
        if after_issue is not None:
            after_issue()
        left = a[...] if not isinstance(a, jax.Array) else a
        product = lax.dot_general(left, b_smem[...],
                                  (((1,), (1 if transpose_b else 0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        return product if accumulator is None else accumulator + product
    right = b_smem.transpose((1, 0)) if transpose_b else b_smem

    def issue(accumulator_ref):
        plgpu.wgmma(accumulator_ref, a, right)
        if after_issue is not None:
            after_issue()

    if accumulator is None:
        def fresh(accumulator_ref):
            issue(accumulator_ref)
            return accumulator_ref[...]
        return pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))
    return pl.run_state(issue)(plgpu.ACC.init(accumulator))


class _InterpretedAccumulator:
    """Stands in for a wgmma accumulator in interpret mode: a value, updated by dots."""

    def __init__(self, value):
        self.value = value


def with_accumulators(body, carried, fresh_shapes, *, interpret):
    """Runs body(carried_accumulators, fresh_accumulators) and returns the carried
    accumulators' final values: `carried` float32 tiles (a loop's dK, dV), fresh ones
    zero tiles of `fresh_shapes` that live in `body` only (S, dP). `body` issues wgmmas
    into them with `issue` and reads them with `result`, so that several matmuls are in
    flight while the elementwise work of the first result runs."""
    if interpret:
        carried = [_InterpretedAccumulator(value) for value in carried]
        fresh = [_InterpretedAccumulator(jnp.zeros(shape, jnp.float32))
                 for shape in fresh_shapes]
        body(carried, fresh)
        return [accumulator.value for accumulator in carried]

    def stateful(carried_refs):
        def scoped(*fresh_refs):
            body(list(carried_refs), list(fresh_refs))
        pl.run_scoped(scoped, *[plgpu.ACC(shape, jnp.float32) for shape in fresh_shapes])

    return list(pl.run_state(stateful)(tuple(plgpu.ACC.init(value) for value in carried)))


def issue(accumulator, a, b_smem, *, transpose_b=False, interpret):
    """accumulator += a · b (a: shared memory ref or 16-bit register tile; b: shared
    memory, [K, N] or [N, K] with transpose_b), asynchronously on the GPU."""
    if interpret:
        left = a[...] if not isinstance(a, jax.Array) else a
        accumulator.value = accumulator.value + lax.dot_general(
            left, b_smem[...], (((1,), (1 if transpose_b else 0,)), ((), ())),
            preferred_element_type=jnp.float32)
        return
    plgpu.wgmma(accumulator, a, b_smem.transpose((1, 0)) if transpose_b else b_smem)


def result(accumulator, *, in_flight_after: int, interpret):
    """The accumulator's value once at most `in_flight_after` of the wgmmas issued so
    far (in issue order) are still running."""
    if interpret:
        return accumulator.value
    return plgpu.wgmma_accumulator_load(accumulator, wait_n=in_flight_after)


__all__ = ["Vector", "apply_mask", "evaluate", "map_each_element", "index_vector", "issue", "load_vector", "matmul",
           "padded_for_slices", "reads_index", "result", "to_tile", "tile_applier",
           "vector_layout", "with_accumulators", "ROWS_PER_WARPGROUP"]
