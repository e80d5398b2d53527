"""What the Mosaic GPU kernels share: mods on register tiles, and the matmuls.

A compute warpgroup holds a tile of scores in the wgmma register layout: 64 rows (the
warpgroup's own) by a tile's columns. The forward and the backward's dQ kernel put
queries on the rows and keys on the columns; the dK/dV kernel the other way round.
Index vectors are 1-D arrays in the layout of one tile axis, so that a mod's index
arithmetic runs once per row or column, not per element; `Vector` says which axis a
vector runs along (a 64x64 tile has vectors of one length on both), and operations on
vectors of one axis keep it. `to_tile` spreads a vector over the tile where it meets
another axis or the scores. Sums and scalings of scores and vectors stay unevaluated
(`Affine`) until an operation needs one array, so that a mod's linear arithmetic costs
per element only what its result needs (`score_parts` hands the kernels the rest).

In Mosaic GPU's interpret mode (CPU tests) wgmma has no rule: `matmul` is a plain dot
there, and everything else is the kernels' own code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels.tile_mods import (
    CaptureLog, CapturedRef, captured_inputs, evaluate_jaxpr_on_tiles, reads_argument)
from pallas_flex.kernels.relative_reads import BLOCK, numbered, relative_tables

ROWS_PER_WARPGROUP = 64
# A program's 65,536 registers are split evenly between its warpgroups at launch (a
# thread gets 65,536 / threads rounded down to a multiple of 8: 168 for three
# warpgroups); setmaxnreg only moves them between warpgroups, and an increase past what
# the others released waits forever: a hang on the GPU, not an error.
REGISTER_FILE = 65536
THREADS_PER_WARPGROUP = 128


def registers_fit(per_warpgroup) -> bool:
    """Whether setmaxnreg counts (one per warpgroup, registers a thread) fit the
    registers the program is launched with."""
    launched = REGISTER_FILE // (THREADS_PER_WARPGROUP * len(per_warpgroup)) // 8 * 8
    return (all(count % 8 == 0 and 24 <= count <= 256 for count in per_warpgroup)
            and sum(per_warpgroup) <= launched * len(per_warpgroup))


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
    """x (a scalar, a Vector, a RunsTile or a tile) as an array of the tile's `shape`."""
    if isinstance(x, RunsTile):
        return x.value_tile()
    if isinstance(x, Vector):
        return lax.broadcast_in_dim(x.value, shape, [x.axis])
    if jnp.shape(x) == tuple(shape):
        return x
    return jnp.broadcast_to(x, shape)


@dataclasses.dataclass(frozen=True)
class Affine:
    """`factor * tile + vectors + offset`, float32, kept apart until an operation needs
    the sum as one array (`materialize`).

    A mod's linear arithmetic then costs per element only what its result needs: the
    forward's soft-cap `cap * tanh(score / cap)` multiplies each score once before the
    tanh (scale / cap folded into one factor, no division) and leaves `cap` as a factor
    the kernel folds into the softmax's exponent; ALiBi's `score + slope * (kv - q)`
    scales the two index vectors, not the tile, and adds them to the scores in one FMA
    and one add. A division by a scalar runs as a multiplication by its reciprocal
    (within an ulp of float32 division, which Mosaic GPU lowers as the IEEE sequence
    per element). tile: a float32 tile or None; vectors: at most one Vector per tile
    axis; factor and offset: Python floats (compile-time constants) or 0-d values."""
    tile: object = None
    factor: object = 1.0
    vectors: tuple = ()
    offset: object = 0.0


_LINEAR_PRIMITIVES = {"add", "add_any", "sub", "mul", "div", "neg"}


def _is_scalar(x) -> bool:
    return not isinstance(x, (Vector, Affine)) and jnp.ndim(x) == 0


def _constant(x):
    """x as a Python float when it is a compile-time constant, else None."""
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, jax.core.Tracer) or jnp.ndim(x) != 0:
        return None
    return float(x)


def _is_constant(x) -> bool:
    """Whether x is a literal of the mod (the tile interpreter passes them as numpy):
    operations on literals alone fold at trace time."""
    return isinstance(x, (int, float, np.ndarray, np.generic))


def _scalar_product(a, b):
    """a * b for scalars, folded at trace time when both are constants."""
    constant_a, constant_b = _constant(a), _constant(b)
    if constant_a is not None and constant_b is not None:
        return constant_a * constant_b
    if constant_a == 0.0 or constant_b == 0.0:  # an Affine's absent term stays absent
        return 0.0
    if _is_one(a):
        return b
    if _is_one(b):
        return a
    return a * b


def _reciprocal(x):
    constant = _constant(x)
    return 1.0 / constant if constant is not None else 1.0 / x


def _as_affine(x) -> Affine:
    if isinstance(x, Affine):
        return x
    if isinstance(x, Vector):
        return Affine(vectors=(x,))
    if jnp.ndim(x) == 0:
        return Affine(offset=x)
    return Affine(tile=x)


def _is_float32(x) -> bool:
    if isinstance(x, Affine):
        return True
    value = x.value if isinstance(x, Vector) else x
    return not isinstance(value, (int, bool)) and jnp.result_type(value) == jnp.float32


def _vector_axes(operands):
    return {x.axis for x in operands if isinstance(x, Vector)}


def _stays_affine(primitive, operands) -> bool:
    """Whether an operation keeps (or starts) an unevaluated Affine: sums of scores and
    vectors of both axes, and scalings of a tile by a scalar."""
    if primitive not in _LINEAR_PRIMITIVES or not all(_is_float32(x) for x in operands):
        return False
    any_affine = any(isinstance(x, Affine) for x in operands)
    if primitive == "neg":
        return any_affine
    if primitive in ("add", "add_any", "sub"):
        return any_affine or len(_vector_axes(operands)) == 2
    first, second = operands
    if primitive == "div":
        return _is_scalar(second) and not _is_scalar(first) and not isinstance(first, Vector)
    return (_is_scalar(first) != _is_scalar(second)
            and not any(isinstance(x, Vector) for x in operands))


def _scale(a: Affine, factor) -> Affine:
    if _constant(factor) == 0.0:
        # A derivative's zero direction (`jax.linearize` multiplies by a zero tangent):
        # nothing left to compute. Scores are finite here (masking comes after the mods).
        return Affine()
    if _is_one(factor):
        return a
    return Affine(
        tile=a.tile,
        factor=_scalar_product(a.factor, factor) if a.tile is not None else 1.0,
        vectors=tuple(Vector(v.value * factor, v.axis) for v in a.vectors),
        offset=_scalar_product(a.offset, factor))


def _sum(a: Affine, b: Affine) -> Affine:
    if a.tile is not None and b.tile is not None:
        tile, factor = _tile_times_factor(a) + _tile_times_factor(b), 1.0
    elif a.tile is not None:
        tile, factor = a.tile, a.factor
    else:
        tile, factor = b.tile, b.factor
    vectors = {}
    for vector in a.vectors + b.vectors:
        if vector.axis in vectors:
            vector = Vector(vectors[vector.axis].value + vector.value, vector.axis)
        vectors[vector.axis] = vector
    offset = a.offset if _constant(b.offset) == 0.0 else (
        b.offset if _constant(a.offset) == 0.0 else a.offset + b.offset)
    return Affine(tile, factor, tuple(vectors[axis] for axis in sorted(vectors)), offset)


def _linear(primitive, operands):
    if primitive == "neg":
        return _scale(_as_affine(operands[0]), -1.0)
    if primitive in ("add", "add_any"):
        return _sum(_as_affine(operands[0]), _as_affine(operands[1]))
    if primitive == "sub":
        return _sum(_as_affine(operands[0]), _scale(_as_affine(operands[1]), -1.0))
    if primitive == "div":
        return _scale(_as_affine(operands[0]), _reciprocal(operands[1]))
    scalar, other = operands if _is_scalar(operands[0]) else operands[::-1]
    return _scale(_as_affine(other), scalar)


def constant_value(x):
    """A mod's output (scalar, Vector, Affine or tile) as a Python float when it is a
    compile-time constant (a bias's derivative, 1), else None."""
    return None if isinstance(x, (Vector, Affine, RunsTile)) else _constant(x)


def _is_one(x) -> bool:
    """Whether x is a constant that rounds to 1 in float32 (1 / 30 * 30 does)."""
    constant = _constant(x)
    return constant is not None and np.float32(constant) == 1.0


def _tile_times_factor(a: Affine):
    return a.tile if _is_one(a.factor) else a.tile * a.factor


def materialize(x, shape):
    """x as a scalar, a Vector or a tile of `shape`: an Affine's sum evaluated (a tile
    with FMAs where it has one, a Vector when it has one vector only), a RunsTile's value
    tile, anything else as it is."""
    if isinstance(x, RunsTile):
        return x.value_tile()
    if not isinstance(x, Affine):
        return x
    vectors = list(x.vectors)
    offset = x.offset
    if vectors and _constant(offset) != 0.0:  # added once per vector entry, not per element
        vectors[0] = Vector(vectors[0].value + offset, vectors[0].axis)
        offset = 0.0
    if x.tile is None and len(vectors) == 1:
        return vectors[0]
    if x.tile is None and not vectors:
        return offset
    total = _tile_times_factor(x) if x.tile is not None else None
    for vector in vectors:
        total = to_tile(vector, shape) if total is None else total + to_tile(vector, shape)
    if _constant(offset) != 0.0:
        total = total + offset
    return total


def _split_vector(x, axis: int):
    """(x less its term along tile axis `axis`, that term as a Vector or None)."""
    if not isinstance(x, Affine):
        return x, None
    kept = tuple(v for v in x.vectors if v.axis != axis)
    if len(kept) == len(x.vectors):
        return x, None
    (term,) = [v for v in x.vectors if v.axis == axis]
    return Affine(x.tile, x.factor, kept, x.offset), term


def scaled_tile(x, shape):
    """(tile, factor) with x = factor * tile, factor a Python float (1.0 unless x is an
    Affine of a tile times a constant): the kernels fold the factor into the exponent."""
    if (isinstance(x, Affine) and x.tile is not None and not x.vectors
            and _constant(x.offset) == 0.0 and _constant(x.factor) is not None):
        return x.tile, _constant(x.factor)
    return to_tile(materialize(x, shape), shape), 1.0


def score_parts(x, shape, q_axis: int):
    """A score_mod's output as (tile, factor, query term): x = factor * tile + the query
    term, factor a Python float (folded by the kernels into the exponent), the query term
    a Vector along tile axis `q_axis` or None. A term that depends on the query only
    (ALiBi's -slope * q_idx) is a per-query constant the softmax does not change with:
    the kernels add it to the query's lse once instead of to every score."""
    x, query_term = _split_vector(x, q_axis)
    tile, factor = scaled_tile(x, shape)
    return tile, factor, query_term


def split_rows(x, shape, q_axis: int):
    """x (a mod's output: an Affine, Vector, scalar or tile) as (the part that varies
    along the keys, as a tile of `shape`, or None; the part that depends on the query
    only: a 1-D array along tile axis `q_axis`, a scalar, or None). A row sum of
    X * x is then the row sum of X times the first part plus the second times X's own
    row sum: ALiBi's slope derivative (kv - q) costs a product per element, not a
    difference and a product."""
    if isinstance(x, RunsTile):
        return x.value_tile(), None
    if isinstance(x, Affine):
        rest, query_term = _split_vector(x, q_axis)
        offset = rest.offset
        rest = Affine(rest.tile, rest.factor, rest.vectors, 0.0)
        varying = (None if rest.tile is None and not rest.vectors
                   else to_tile(materialize(rest, shape), shape))
        per_row = None if query_term is None else query_term.value
        if _constant(offset) != 0.0:
            per_row = offset if per_row is None else per_row + offset
        return varying, per_row
    if isinstance(x, Vector):
        return (None, x.value) if x.axis == q_axis else (to_tile(x, shape), None)
    if jnp.ndim(x) == 0:
        return None, (None if _constant(x) == 0.0 else x)
    return x, None


def weighted_row_sums(x, x_row_sums, parts):
    """The row sums of x g over a [queries, keys] tile, g a captured read's derivative
    taken apart as `split_rows(g, tile, q_axis=0)` (`parts`) and x_row_sums x's own row
    sums: g's part that varies along the keys takes a product per element, its
    query-only part multiplies x_row_sums. The forward's row sums P g, the dQ kernel's
    P dP g and dS' g (one split serves several x)."""
    varying, per_row = parts
    total = 0.0
    if varying is not None:
        total = (x * varying).sum(axis=1)
    if per_row is not None:
        total = total + per_row * x_row_sums
    return total


def tile_applier(shape):
    """`apply` for `evaluate_jaxpr_on_tiles` on a tile of `shape`: sums and scalings of
    float32 scores and vectors stay unevaluated Affines; other operations on scalars and
    vectors of one axis stay scalars or vectors (of that axis); anything else runs on
    the tile."""
    def apply(function, operands, primitive=None):
        runs = [x for x in operands if isinstance(x, RunsTile)]
        if runs:
            return _apply_to_runs(function, operands, primitive, runs, shape)
        if all(_is_constant(x) for x in operands):
            # Arithmetic on literals (a derivative's 1 / cap) folds at trace time.
            with jax.ensure_compile_time_eval():
                outputs = function(*operands)
            if isinstance(outputs, (list, tuple)):
                return [np.asarray(output) for output in outputs]
            return np.asarray(outputs)
        if _stays_affine(primitive, operands):
            return _linear(primitive, operands)
        if (primitive == "convert_element_type" and isinstance(operands[0], Affine)
                and jax.eval_shape(function, jax.ShapeDtypeStruct((), jnp.float32)).dtype
                == jnp.float32):
            return operands[0]  # float32 to float32
        operands = [materialize(x, shape) for x in operands]
        axes = _vector_axes(operands)
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


def _apply_to_runs(function, operands, primitive, runs, shape):
    """An operation on a relative read's `RunsTile`: a conversion stays lazy; a float32
    sum with one other operand adds the runs to it in place (`RunsTile.added_to`);
    anything else takes the value tile."""
    if primitive == "convert_element_type":
        (read,) = operands
        dtype = read.dtype or read.tables[2].dtype
        return read.converted(jax.eval_shape(function, jax.ShapeDtypeStruct((), dtype)).dtype)
    if primitive in ("add", "add_any") and len(runs) == 1 and len(operands) == 2:
        (read,) = runs
        other = operands[1] if operands[0] is read else operands[0]
        if _is_constant(other) and np.ndim(other) == 0 and float(other) == 0.0:
            return read  # a derivative's zero shift (`with_read_derivatives`)
        if (jnp.dtype(read.dtype or read.tables[2].dtype) == jnp.float32
                and _is_float32(other) and not _is_constant(other)):
            return read.added_to(to_tile(materialize(other, shape), shape))
    values = [x.value_tile() if isinstance(x, RunsTile) else x for x in operands]
    return tile_applier(shape)(function, values, primitive)


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


def run_per_element_under_vmap(launch):
    """`launch` with a batching rule of its own: Pallas would batch a Mosaic GPU kernel by
    batching its body, which the compiled kernel cannot run; under `jax.vmap` it runs
    once per element instead (`map_each_element`)."""

    @jax.custom_batching.custom_vmap
    def run(*args):
        return launch(*args)

    run.def_vmap(lambda axis_size, in_batched, *args:
                 map_each_element(run, axis_size, in_batched, args))
    return run


def reads_index(program, reads, name: str) -> bool:
    """Whether a kernel must build `name`'s index vector for `program`: it reads it
    other than as the index of one of its contiguous `reads`."""
    if program is None:
        return False
    position = {"q_idx": 2, "kv_idx": 3}[name] + (program.kind == "score")
    return reads_argument(program.jaxpr, position, reads)


def evaluate(program, reads, refs, args, *, tile, q_axis, q_start, kv_start, interpret,
             keep_affine=False, block_readers=None):
    """Runs a mod on a kernel's index vectors and score tile ([64, columns]; queries
    along `q_axis`). args: (score,) b, h, q_idx, kv_idx, the indices clamped into the
    lengths, at most 2**24: an int difference of them converted to float32 is converted
    per vector instead (see evaluate_jaxpr_on_tiles). Its contiguous `reads` at q_idx /
    kv_idx load the slice from row q_start or kv_start of the captured array (as many
    rows as the tile has along that axis), edge-padded by the caller. Returns the mod's
    outputs as scalars, Vectors or tiles, or, with keep_affine, as they came out
    (Affines too: `score_parts` takes those apart). The score arg may be an Affine (the
    kernels pass `Affine(raw, scale)`, so that the mod's own scalings fold into one).
    block_readers: {read key: read(captured, indices) -> the [q, kv] tile} for the
    reads `reads` calls blocks (the Mosaic forward's, from its TMA-fed rings), and
    {key: RunsTile -> DiagonalTile} for relative reads with dense block diagonals."""
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

    def relative_reader(key, number):
        tables = refs[len(program.consts) + 3 * number:][:3]
        batch, head = args[first_index_arg - 2], args[first_index_arg - 1]

        def read(captured, indices):
            del captured, indices  # the tables hold the read's values
            runs = relative_read_tile(tables, batch=batch, head=head, q_start=q_start,
                                      kv_start=kv_start, tile=tile, q_axis=q_axis,
                                      interpret=interpret)
            # Dense on some block diagonals (`relative_reads.diagonal_blocks`): the
            # kernel's reader makes it a `DiagonalTile`.
            return block_readers[key](runs) if key in (block_readers or {}) else runs
        return read

    numbers = numbered(reads)
    readers = {key: (relative_reader(key, numbers[key]) if key in numbers
                     else _block_reader(block_readers, key) if kind == "block"
                     else slice_reader(axis, kind), axis)
               for key, (_, axis, kind) in reads.items()}
    outputs = evaluate_jaxpr_on_tiles(
        program.jaxpr, consts, args, program.name,
        small_index_args=(first_index_arg, first_index_arg + 1),
        primitive_overrides=PRIMITIVE_OVERRIDES, captured_reads=readers,
        apply=tile_applier(tile))
    return outputs if keep_affine else [materialize(x, tile) for x in outputs]


def _block_reader(block_readers, key):
    if not block_readers or key not in block_readers:
        raise NotImplementedError("a bias tensor's [q, kv] blocks are read by the Mosaic "
                                  "forward only (its memory warpgroup copies them)")
    return block_readers[key]


def relative_read_tile(tables, *, batch, head, q_start, kv_start, tile, q_axis, interpret):
    """A relative read's value on a tile (`relative_reads`), from its three table refs
    (counts, starts, values), as a `RunsTile`: the value tile itself where an operation
    needs it, the read added to a tile without one where the mod adds it (a T5 bias)."""
    counts_ref = tables[0]
    blocks = (counts_ref.shape[2] + 1) // 2
    row = (0 if counts_ref.shape[0] == 1 else batch, head,
           lax.div(kv_start, BLOCK) - lax.div(q_start, BLOCK) + blocks - 1)
    return RunsTile(tuple(tables), row, q_start, kv_start, tuple(tile), q_axis, interpret)


@dataclasses.dataclass(frozen=True)
class RunsTile:
    """A relative read's value on a tile, in runs along kv_idx - q_idx: the block
    diagonal's first run's value, then each later run's where kv_idx - q_idx reaches its
    start. The test is kv_idx >= start + q_idx: the start moves onto the query vector
    (two values a thread), so no tile of differences takes registers next to the scores
    and the accumulator. dtype: the value's after the mod's conversions (None: the
    table's).

    `value_tile` builds the tile; `added_to` adds the read to a tile in place, one run's
    change at a time, so that the scores and the value never take registers side by
    side (`tile_applier` takes that form for `score + read`, a T5 bias). H100, causal +
    one-way T5, fwd+bwd B4 H16 S4096 D128 7.23 -> 3.14 ms in place, forward 1.10 ->
    0.90; B8 S2048 D64 3.07 -> 1.70 and 0.663 -> 0.595: in the backward's dQ kernel a
    value tile beside S, dP's accumulator in flight and dQ spilled.

    H200, B4 H16 S4096 D128 bf16, AOT-compiled paired rounds (ms; causal + one-way T5 /
    bidirectional T5 without a mask; plain causal 0.469, no mask 0.888), value tiles:
    this test 1.145 / 1.680; with a tile of differences 1.651 / 2.282; four runs a loop
    step, their table loads first, 1.254 / 1.965 (D64 0.596 against 0.619: it won only
    there); a constant tile instead of the read 0.528 / 0.957."""
    tables: tuple
    row: tuple
    q_start: object
    kv_start: object
    tile: tuple
    q_axis: int
    interpret: bool
    dtype: object = None

    def converted(self, dtype):
        return dataclasses.replace(self, dtype=jnp.dtype(dtype))

    def _value(self, run):
        value = self.tables[2][self.row + (run,)]
        return value if self.dtype is None else value.astype(self.dtype)

    def _walk(self, step, initial):
        """lax.fori_loop over the runs after the first: carried = step(reached, previous
        run's value, this run's value, carried), `reached` the tile's elements at or past
        this run's start. Each step issues the next step's table loads before its own
        work, so that their latency is off the loop's path (H100, causal + one-way T5
        forward: 1.087 ms against 1.212 loading in the step that uses them at B4 H16 S4096
        D128 in an A/B probe; in the harness 1.113 -> 1.08 there, B1 S16384 2.995 ->
        2.83, B8 S2048 D64 0.64 -> 0.676)."""
        counts_ref, starts_ref, _ = self.tables
        kv_axis = 1 - self.q_axis
        queries = index_vector(self.q_start, self.tile[self.q_axis], self.q_axis)
        keys = to_tile(index_vector(self.kv_start, self.tile[kv_axis], kv_axis), self.tile)
        last_run = jnp.maximum(counts_ref[self.row] - 1, 0)

        def take_run(run, carry):
            carried, start, previous, current = carry
            following = jnp.minimum(run + 1, last_run)
            next_start = starts_ref[self.row + (following,)]
            next_value = self._value(following)
            threshold = to_tile(Vector(queries.value + start, self.q_axis), self.tile)
            carried = step(keys >= threshold, previous, current, carried)
            return carried, next_start, current, next_value

        first = jnp.minimum(1, last_run)
        carried, *_ = lax.fori_loop(1, last_run + 1, take_run, (
            initial, starts_ref[self.row + (first,)], self._value(0), self._value(first)))
        return carried

    def value_tile(self):
        value = jnp.full(self.tile, self._value(0))
        if not self.interpret:
            value = plgpu.layout_cast(value, plgpu.Layout.WGMMA)
        return self._walk(lambda reached, previous, current, value:
                          jnp.where(reached, current, value), value)

    def added_to(self, base):
        """base (a float32 tile) + the read's value: base plus the first run's value, then
        each later run's change where it starts (the same as base + value_tile() but for
        float32 rounding of the changes' sum)."""
        total = base + self._value(0)
        return self._walk(lambda reached, previous, current, total:
                          jnp.where(reached, total + (current - previous), total), total)


@dataclasses.dataclass(frozen=True)
class DiagonalTile(RunsTile):
    """A relative read that `relative_reads.diagonal_blocks` covers: on a tile of its
    dense block diagonals (`dense`, a traced bool) its value is `load()` (the [rows,
    columns] tile in the table's dtype, loaded from global memory by `diagonal_loads`),
    elsewhere the one value `side` of that side (a scalar). Its runs are not walked."""
    dense: object = None
    load: object = None
    side: object = None

    @classmethod
    def around(cls, runs, *, held, count, load, side):
        """`runs` (a RunsTile) on a tile whose block diagonal is `held` past the read's
        first dense one, of `count`: dense there when 0 <= held < count."""
        fields = {f.name: getattr(runs, f.name) for f in dataclasses.fields(runs)}
        return cls(**fields, dense=(held >= 0) & (held < count), load=load, side=side)

    def _as_value(self, value):
        return value if self.dtype is None else value.astype(self.dtype)

    def value_tile(self):
        def side():
            value = jnp.full(self.tile, self._as_value(self.side))
            return value if self.interpret else plgpu.layout_cast(value,
                                                                   plgpu.Layout.WGMMA)
        return lax.cond(self.dense, lambda: self._as_value(self.load()), side)

    def added_to(self, base):
        return lax.cond(self.dense, lambda base: base + self._as_value(self.load()),
                        lambda base: base + self._as_value(self.side), base)


def diagonal_loads(diagonal_reads, tile_refs, side_refs, *, interpret):
    """`evaluate`'s block_readers for relative reads with dense block diagonals
    (`relative_reads.diagonal_blocks`) read straight from global memory: diagonal_reads
    ((read key, first, count), ...), per read its dense tiles [Bm, H, count, 128, 128]
    (query rows, key columns; or keys on the rows for a kernel whose tiles put them
    there, q_axis 1) and side values [Bm, H, 2]. A tile on those block diagonals loads
    its [rows, columns] piece of the block pair's tile in the wgmma layout (the same
    tiles for every query block of a head: L2 holds them); the others take the side's
    value (two scalar loads)."""
    def reader(first, count, tiles_ref, sides_ref):
        def wrap(runs):
            batch, head, diagonal = runs.row
            blocks = (runs.tables[0].shape[2] + 1) // 2
            held = diagonal - (blocks - 1) - first
            rows, columns = runs.tile
            offsets = (lax.rem(runs.q_start, BLOCK), lax.rem(runs.kv_start, BLOCK))
            if runs.q_axis == 1:
                offsets = offsets[::-1]

            def load():
                view = tiles_ref.at[batch, head, jnp.clip(held, 0, count - 1),
                                    pl.ds(offsets[0], rows), pl.ds(offsets[1], columns)]
                if interpret:
                    return view[...]
                return plgpu.load(view, layout=plgpu.Layout.WGMMA, optimized=False)
            side = jnp.where(held < 0, sides_ref[batch, head, 0], sides_ref[batch, head, 1])
            return DiagonalTile.around(runs, held=held, count=count, load=load, side=side)
        return wrap
    return {key: reader(first, count, tiles_ref, sides_ref)
            for (key, first, count), tiles_ref, sides_ref
            in zip(diagonal_reads, tile_refs, side_refs)}


def diagonal_readers(diagonal_reads, refs, *, interpret):
    """(`diagonal_loads`' block_readers, or None without dense reads; the refs after the
    dense tiles and side values a kernel's inputs hold per read of diagonal_reads, first
    among `refs`)."""
    count = len(diagonal_reads)
    readers = diagonal_loads(diagonal_reads, refs[:count], refs[count:2 * count],
                             interpret=interpret) if count else None
    return readers, refs[2 * count:]


def padded_for_slices(program, reads, q_length: int, kv_length: int):
    """`captured_inputs(program)`, each array of its contiguous `reads` edge-padded along
    the read's axis to the kernel's padded q_length / kv_length: a slice read past the
    array's end then sees its last entry, which is what the clamped index of the scalar
    semantics reads."""
    arrays = captured_inputs(program)
    for position, axis, kind in reads.values():
        if kind == "relative":  # its tables follow (`tile_inputs`)
            continue
        # A block read pads its q axis and its kv axis.
        lengths = (zip(axis, (q_length, kv_length)) if kind == "block"
                   else [(axis, q_length if kind == "q" else kv_length)])
        for axis_, length in lengths:
            array = arrays[position]
            if array.shape[axis_] < length:
                widths = [(0, 0)] * array.ndim
                widths[axis_] = (0, length - array.shape[axis_])
                arrays[position] = jnp.pad(array, widths, mode="edge")
    return arrays


def tile_inputs(mask_program, mask_reads, score_program, score_reads, *, batch: int,
                heads: int, q_length: int, kv_length: int):
    """The Mosaic GPU kernels' inputs for the mods' captured arrays: per mod, its arrays
    (`padded_for_slices`) and then three tables per relative read
    (`relative_reads.relative_tables`); mask_mod's first. q_length / kv_length: the
    padded lengths. `split_tile_refs` takes the kernel's refs apart again."""
    inputs = []
    for program, reads in ((mask_program, mask_reads), (score_program, score_reads)):
        if program is None:
            continue
        inputs += padded_for_slices(program, reads, q_length, kv_length)
        inputs += relative_tables(program, reads, batch, heads, q_length, kv_length)
    return inputs


def split_tile_refs(refs, mask_program, mask_reads, score_program, score_reads):
    """(mask_refs, score_refs, the refs after them) of a Mosaic GPU kernel whose inputs
    for the mods came from `tile_inputs`: each mod's refs are its captured arrays' and
    then its relative reads' tables, which `evaluate` finds after the arrays."""
    counts = [0 if program is None else len(program.consts) + 3 * len(numbered(reads))
              for program, reads in ((mask_program, mask_reads),
                                     (score_program, score_reads))]
    return (refs[:counts[0]], refs[counts[0]:counts[0] + counts[1]],
            refs[counts[0] + counts[1]:])


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


def with_accumulators(body, carried, fresh_shapes, *, interpret, states=()):
    """Runs body(carried_accumulators, fresh_accumulators) and returns the carried
    accumulators' final values: `carried` float32 tiles (a loop's dK, dV), fresh ones
    zero tiles of `fresh_shapes` that live in `body` only (S, dP). `body` issues wgmmas
    into them with `issue` and reads them with `result`, so that several matmuls are in
    flight while the elementwise work of the first result runs.

    states: register values (row sums a loop carries) that `body` reads and updates as
    refs (`ref[...]`), passed as a third argument when given; their final values follow
    the accumulators' in the result."""
    if interpret:
        carried = [_InterpretedAccumulator(value) for value in carried]
        fresh = [_InterpretedAccumulator(jnp.zeros(shape, jnp.float32))
                 for shape in fresh_shapes]
        holders = [_Holder(value) for value in states]
        if states:
            body(carried, fresh, holders)
        else:
            body(carried, fresh)
        return [accumulator.value for accumulator in carried] + [h.value for h in holders]

    if not carried and not states:  # no state to discharge: the fresh ones only
        def fresh_only(*fresh_refs):
            body([], list(fresh_refs))
        pl.run_scoped(fresh_only, *[plgpu.ACC(shape, jnp.float32) for shape in fresh_shapes])
        return []

    count = len(carried)

    def stateful(refs):
        carried_refs, state_refs = list(refs[:count]), list(refs[count:])

        def scoped(*fresh_refs):
            if states:
                body(carried_refs, list(fresh_refs), state_refs)
            else:
                body(carried_refs, list(fresh_refs))
        pl.run_scoped(scoped, *[plgpu.ACC(shape, jnp.float32) for shape in fresh_shapes])

    return list(pl.run_state(stateful)(
        tuple(plgpu.ACC.init(value) for value in carried) + tuple(states)))


class _Holder:
    """Stands in for a discharged state ref in interpret mode: `ref[...]` reads and
    writes a value."""

    def __init__(self, value):
        self.value = value

    def __getitem__(self, index):
        return self.value

    def __setitem__(self, index, value):
        self.value = value


def issue(accumulator, a, b_smem, *, transpose_a=False, transpose_b=False, interpret):
    """accumulator += a · b (a: shared memory ref, [M, K] or [K, M] with transpose_a, or
    a 16-bit register tile; b: shared memory, [K, N] or [N, K] with transpose_b),
    asynchronously on the GPU."""
    if interpret:
        left = a[...] if not isinstance(a, jax.Array) else a
        accumulator.value = accumulator.value + lax.dot_general(
            left, b_smem[...], (((0 if transpose_a else 1,), (1 if transpose_b else 0,)),
                                ((), ())),
            preferred_element_type=jnp.float32)
        return
    plgpu.wgmma(accumulator, a.transpose((1, 0)) if transpose_a else a,
                b_smem.transpose((1, 0)) if transpose_b else b_smem)


def result(accumulator, *, in_flight_after: int, interpret):
    """The accumulator's value once at most `in_flight_after` of the wgmmas issued so
    far (in issue order) are still running."""
    if interpret:
        return accumulator.value
    return plgpu.wgmma_accumulator_load(accumulator, wait_n=in_flight_after)


__all__ = ["Affine", "ROWS_PER_WARPGROUP", "Vector", "apply_mask", "constant_value", "evaluate",
           "index_vector", "issue", "load_vector", "map_each_element", "materialize",
           "matmul", "padded_for_slices", "reads_index", "result", "scaled_tile",
           "split_tile_refs", "tile_inputs",
           "score_parts", "split_rows", "tile_applier", "to_tile", "vector_layout",
           "with_accumulators"]
