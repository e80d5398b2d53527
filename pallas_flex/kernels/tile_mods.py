"""Evaluates a traced mod on a whole tile of scores inside a Pallas kernel.

A mod is written for scalars and traced into a scalar jaxpr (see
`masks/mod_program.py`). Inside a kernel there is no `vmap` over Triton programs, so
this module replays that jaxpr on tiles instead: every scalar operation becomes the
same operation on broadcast arrays (`q_idx` is a `[block_q, 1]` column, `kv_idx` a
`[1, block_kv]` row, so work that depends on one index only stays on a vector), and a
read `array[i, j]` of a captured array becomes a gather-load from that array's kernel
input ref. Anything else on a captured array (arithmetic on the whole array) has no
tile meaning and is rejected with a message saying how to rewrite the mod.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.extend import core as jex_core

from pallas_flex.manual_axes import vary, varying_axes
from pallas_flex.masks.mod_program import CALL_JAXPR_PARAMS as _CALL_PARAMS
from pallas_flex.masks.mod_program import dependent_vars

# Primitives that only reshape between size-1 shapes in a scalar program: on a tile they
# are the identity (the scalar program's `x[i]` is `dynamic_slice` then `squeeze`).
_SIZE_ONE_RESHAPES = {"squeeze", "reshape", "expand_dims", "broadcast_in_dim"}
# A captured array read per element at indices reaching at most this many entries (a T5
# table's 32 buckets) is read as one select per entry a tile reaches (`CapturedRef._select`)
# instead of a gather; DETERMINISTIC_MAX_ENTRIES in kernels/config.py bounds the same
# tables' one-hot gradient rows.
SELECTED_GATHER_MAX_ENTRIES = 64
# Primitives that wrap a sub-jaxpr with the same semantics as inlining it.

class CaptureLog:
    """Where a mod read its captured arrays: one *site* per read, in program order.

    In recording mode each read loads from the kernel ref and is remembered; in replay
    mode the values come from `replay_values` instead, which makes the mod a pure function
    of those values (so `jax.vjp` can differentiate it with respect to them, inside a
    kernel, without differentiating through memory reads).
    """

    def __init__(self, replay_values=None):
        self.replay_values = replay_values
        self.sites = []  # (captured position, index tuple)
        self.varying = []  # per site, per index: whether it varies over the tile
        # per site, its indices as the mod computed them (clamped, not broadcast to the
        # tile: scalars for indices of b and h, [rows, 1] / [1, columns] vectors)
        self.unbroadcast = []
        # per site, a BlockRead where the read was loaded as a block of the array (at
        # exactly q_idx / kv_idx, see `block_reads`), else None (a gather)
        self.blocks = []
        self.values = []

    def read(self, captured, indices, varying=None, unbroadcast=None, block=None,
             load=None):
        """The value of one read; `load()` loads it (default: `captured.ref[indices]`)."""
        if self.replay_values is not None:
            value = self.replay_values[len(self.sites)]
        elif load is not None:
            value = load()
        elif not indices:
            value = captured.ref[0]
        else:
            value = captured.ref[indices]
        self.sites.append((captured.position, indices))
        self.varying.append(varying if varying is not None else (False,) * len(indices))
        self.unbroadcast.append(unbroadcast if unbroadcast is not None else indices)
        self.blocks.append(block)
        self.values.append(value)
        return value


@dataclasses.dataclass(frozen=True)
class TileFrame:
    """Where a kernel's score tile lies in the sequences, for loading a mod's reads at
    exactly q_idx / kv_idx (`block_reads`) as blocks of the array instead of gathers.

    q_start / kv_start: the tile's first query / key position (int32 scalars, traced);
    block_q / block_kv: its extents; transposed: the tile is [block_kv, block_q] (the
    dK/dV programs' P^T), else [block_q, block_kv]. The arrays of such reads reach every
    tile (`padded_for_blocks`). `load(ref, block_read)` overrides the load (checks
    outside kernels)."""
    q_start: object
    kv_start: object
    block_q: int
    block_kv: int
    transposed: bool = False
    load: object = None

    def span(self, kind):
        """(start, size) of the tile along the queries ("q") or keys ("kv")."""
        return (self.q_start, self.block_q) if kind == "q" else (self.kv_start, self.block_kv)

    def tile_axis(self, kind) -> int:
        """The axis of the score tile the queries ("q") or keys ("kv") run along."""
        return int(kind == "q") if self.transposed else int(kind == "kv")

    def positions(self, kind):
        """The tile's positions along `kind` as a [n, 1] or [1, n] vector of the tile."""
        start, size = self.span(kind)
        axis = self.tile_axis(kind)
        shape = (size, 1) if axis == 0 else (1, size)
        return start + lax.broadcasted_iota(jnp.int32, shape, axis)


@dataclasses.dataclass(frozen=True)
class BlockRead:
    """A read `array[i0, .., q_idx, .., kv_idx]` of a captured array loaded as one block
    (or a vector, for a read at q_idx or kv_idx alone): `lead` are the clamped indices
    of the other axes (scalars; None on the tile axes), `axes` ((axis, "q" / "kv"), ...)
    its tile axes in the array's order. The kernel's array is edge-padded to reach every
    tile (`padded_for_blocks`): no block is masked."""
    lead: tuple
    axes: tuple
    frame: TileFrame

    def index(self, lead=None):
        """The indexer of the block: scalars and `pl.ds` slices (`lead` overrides the
        scalars: the batch loop flushes the previous row's entries)."""
        index = list(self.lead if lead is None else lead)
        for axis, kind in self.axes:
            index[axis] = pl.ds(*self.frame.span(kind))
        return tuple(index)

    def block_shape(self):
        return tuple(self.frame.span(kind)[1] for _, kind in self.axes)

    def _swapped(self) -> bool:
        """Whether the array's axis order is the transpose of the tile's."""
        return len(self.axes) == 2 and self.frame.tile_axis(self.axes[0][1]) == 1

    def to_tile(self, block):
        """The loaded block in the score tile's orientation ([n, 1] / [1, n] vectors)."""
        if len(self.axes) == 1:
            return block.reshape(self.frame.positions(self.axes[0][1]).shape)
        return block.T if self._swapped() else block

    def from_tile(self, tile):
        """A tile-shaped value (a cotangent) in the block's orientation."""
        if len(self.axes) == 1:
            return jnp.broadcast_to(tile, self.frame.positions(self.axes[0][1]).shape
                                    ).reshape(self.block_shape())
        return tile.T if self._swapped() else tile

    def load(self, ref):
        if self.frame.load is not None:
            return self.to_tile(self.frame.load(ref, self))
        return self.to_tile(ref[self.index()])

    def scatter_add(self, ref, tile, lead=None):
        """ref[block] += tile (a tile in the score tile's orientation): one atomic add of
        the block (vectorized on the GPU; interpret mode adds the slice)."""
        plgpu.atomic_add(ref, self.index(lead), self.from_tile(tile.astype(ref.dtype)))


def padded_for_blocks(program, q_limit: int, kv_limit: int):
    """`captured_inputs(program)`, each array read as blocks (`block_reads`) edge-padded
    along its tile axes to q_limit / kv_limit (how far the kernel's tiles reach: the
    padded lengths): every block then lies inside its array, unmasked, and a position
    past the array's end reads its last entry, which is what the clamped index of the
    scalar semantics reads. Indices of other reads of those arrays keep their meaning
    (the padding follows the array's own entries)."""
    arrays = captured_inputs(program)
    widths = {}
    for position, axes in block_reads(program).values():
        for axis, kind in axes:
            limit = q_limit if kind == "q" else kv_limit
            widths.setdefault(position, {})
            widths[position][axis] = max(widths[position].get(axis, 0), limit)
    for position, limits in widths.items():
        array = arrays[position]
        pads = [(0, max(0, limits.get(axis, 0) - size)) for axis, size in enumerate(array.shape)]
        if any(after for _, after in pads):
            arrays[position] = jnp.pad(array, pads, mode="edge")
    return arrays


def unpadded_gradient(gradient, shape):
    """The gradient of an array from that of its `padded_for_blocks` copy (the VJP of the
    edge padding): each padded axis's entries past the array's end sum into its last
    entry, which those positions read (clamped indices: a table shorter than the
    sequence; past the sequence, padded query rows and masked keys, the cotangents are
    zero)."""
    for axis, size in enumerate(shape):
        if gradient.shape[axis] > size:
            kept = lax.slice_in_dim(gradient, 0, size - 1, axis=axis)
            edge = jnp.sum(lax.slice_in_dim(gradient, size - 1, gradient.shape[axis],
                                            axis=axis), axis=axis, keepdims=True)
            gradient = jnp.concatenate([kept, edge], axis=axis)
    return gradient


class CapturedRef:
    """A captured array living in a kernel input ref.

    0-d arrays travel as shape `[1]` refs (kernels need at least one dimension).
    """

    def __init__(self, ref, shape: tuple[int, ...], position: int = 0, log=None,
                 select_small_tables: bool = False):
        self.ref = ref
        self.shape = shape
        self.position = position
        self.log = log if log is not None else CaptureLog()
        # Per-element reads of small tables as selects (`_select`) rather than gathers.
        self.select_small_tables = select_small_tables

    def load_scalar(self):
        return self.log.read(self, ())

    def gather(self, indices):
        """`array[indices]` for index tiles that broadcast against each other.

        Indices are clamped into range first, as XLA's dynamic_slice does, so a mod that
        reads past the end of a short array gets the same value on every backend
        instead of reading outside the buffer.
        """
        indices = [jnp.clip(i, 0, size - 1) for i, size in zip(indices, self.shape)]
        varying = tuple(jnp.ndim(i) > 0 for i in indices)
        unbroadcast = tuple(indices)
        shape = np.broadcast_shapes(*(jnp.shape(i) for i in indices))
        if shape:
            indices = [jnp.broadcast_to(i, shape) for i in indices]
        entries = int(np.prod([size for size, v in zip(self.shape, varying) if v], dtype=int))
        load = None
        if (self.select_small_tables and len(shape) == 2
                and 1 < entries <= SELECTED_GATHER_MAX_ENTRIES):
            load = functools.partial(self._select, unbroadcast, varying, shape)
        return self.log.read(self, tuple(indices), varying, unbroadcast, load=load)

    def _select(self, indices, varying, shape):
        """`array[indices]` on a tile as a select per table entry the tile reaches (between
        its least and greatest flat entry along the varying axes), each entry one scalar
        load: a T5 bucket or a clipped relative position takes one value on most tiles.
        The same values as the gather. The tile's least and greatest entry are full
        reductions of the tile: where that costs more than the gather depends on the
        tiles (figures at `KernelOptions.forward_selects_small_tables`)."""
        sizes = [size for size, v in zip(self.shape, varying) if v]
        entry = jnp.zeros(shape, jnp.int32)
        for index, size, varies in zip(indices, self.shape, varying):
            if varies:
                entry = entry * jnp.int32(size) + jnp.broadcast_to(index, shape)

        def select(value, tile):
            digits, rest = [], value
            for size in reversed(sizes):
                digits.append(lax.rem(rest, jnp.int32(size)))
                rest = lax.div(rest, jnp.int32(size))
            digits = iter(reversed(digits))
            scalar = tuple(next(digits) if v else index for index, v in zip(indices, varying))
            return jnp.where(entry == value, self.ref[scalar].astype(tile.dtype), tile)

        return lax.fori_loop(jnp.min(entry), jnp.max(entry) + 1, select,
                             jnp.zeros(shape, self.ref.dtype))

    def block(self, indices, axes, frame: TileFrame):
        """`array[indices]` where `indices[axis]` is exactly q_idx / kv_idx for each
        (axis, kind) of `axes` (None there) and a scalar elsewhere: loaded as a block of
        the array at the tile's positions (`BlockRead`), not gathered. The site is logged
        with the indices a gather would have used (clamped), for gradients that scatter
        per element."""
        lead = [None if i is None else jnp.clip(i, 0, size - 1)
                for i, size in zip(indices, self.shape)]
        read = BlockRead(tuple(lead), tuple(axes), frame)
        unbroadcast = list(lead)
        for axis, kind in axes:
            unbroadcast[axis] = jnp.clip(frame.positions(kind), 0, self.shape[axis] - 1)
        shape = np.broadcast_shapes(*(jnp.shape(i) for i in unbroadcast))
        broadcast = tuple(jnp.broadcast_to(i, shape) for i in unbroadcast)
        varying = tuple(jnp.ndim(i) > 0 for i in unbroadcast)
        return self.log.read(self, broadcast, varying, tuple(unbroadcast), block=read,
                             load=lambda: read.load(self.ref))


class TracedReads(CapturedRef):
    """A captured array traced outside any kernel, read as the kernels read it (indices
    clamped, 0-d arrays as [1]): `mod_program.with_read_derivatives` traces a mod's
    reads of every captured array this way, so that they lower as the kernels' reads."""

    def __init__(self, array):
        super().__init__(jnp.reshape(array, (1,)) if jnp.ndim(array) == 0 else array,
                         jnp.shape(array))


class ShiftedReads(TracedReads):
    """A `TracedReads` whose every read adds `shift` to the value read:
    `mod_program.with_read_derivatives` differentiates with respect to the shift."""

    def __init__(self, array, shift):
        super().__init__(array)
        self.shift = shift

    def load_scalar(self):
        return super().load_scalar() + self.shift

    def gather(self, indices):
        return super().gather(indices) + self.shift


def _as_array(value, aval):
    """A literal as a numpy value: concrete at trace time, so that the Mosaic GPU tile
    evaluation can fold constants (`mosaic_tiles.Affine`)."""
    if isinstance(value, CapturedRef):
        return value
    return np.asarray(value, dtype=aval.dtype)


def broadcast_numpy_style(operands):
    """Operands broadcast to their common shape by numpy's rules (index columns
    [block_q, 1] against rows [1, block_kv])."""
    shape = np.broadcast_shapes(*(jnp.shape(x) for x in operands))
    return [jnp.broadcast_to(x, shape) if jnp.shape(x) != shape else x for x in operands]


def _bound(equation):
    """The equation's primitive as a function of its operands (with its parameters)."""
    def bind(*operands):
        # Inside a shard_map that checks varying axes (context parallelism's mods, with
        # a varying shard offset) the mod's primitives take operands of equal axes.
        return equation.primitive.bind(*vary(operands, varying_axes(operands)),
                                       **equation.params)
    return bind


def _read_captured(value, name: str, primitive: str):
    if value.shape == ():
        return value.load_scalar()
    raise ValueError(
        f"mod {name!r} applies {primitive!r} to a whole captured array of shape "
        f"{value.shape}; inside a mod, captured arrays may only be indexed with scalar "
        "indices (e.g. table[h, q_idx]). Compute derived arrays outside the mod and "
        "close over the result."
    )


# Int32 values below this convert to float32 exactly, and so does the difference of two.
EXACT_FLOAT32_INTEGERS = 2 ** 24


def _is_float32_conversion(equation) -> bool:
    return (equation.primitive.name == "convert_element_type"
            and equation.params["new_dtype"] == jnp.float32
            and jnp.issubdtype(equation.invars[0].aval.dtype, jnp.integer))


def evaluate_jaxpr_on_tiles(jaxpr: jex_core.Jaxpr, consts, args, name: str,
                            small_index_args=(), primitive_overrides=None,
                            broadcast=broadcast_numpy_style, captured_reads=None,
                            apply=None):
    """Runs scalar `jaxpr` on tile-shaped `args`; `consts` are CapturedRefs or arrays.

    small_index_args: positions of int args whose values lie in [0, 2**24), which the
    kernels guarantee for clamped q_idx/kv_idx when both lengths are below 2**24. For
    those, `float32(a - b)` (ALiBi, relative positions) is evaluated as
    `float32(a) - float32(b)`: the same value exactly, but the conversions run on the
    [block_q, 1] and [1, block_kv] index vectors instead of on every element of the
    tile (int->float conversion runs at a quarter of the FMA rate on Hopper, like exp2,
    and doubled the softmax's per-element cost on ALiBi).

    primitive_overrides: {primitive name: function(*operands, **the equation's params)}
    replacing a primitive's own rule (the Mosaic GPU kernels' `not` on bool tiles).
    broadcast: how operands of different shapes meet (numpy's rules by default).
    apply: `apply(function, operands, primitive)` runs every operation (`primitive`: the
    jaxpr primitive's name) instead of `function(*broadcast(operands))`: the Mosaic GPU
    kernels' index vectors are 1-D, tagged with the tile axis they run along
    (`mosaic_tiles.Vector`), their operations keep the tag, and sums and scalings stay
    unevaluated until an operation needs them (`mosaic_tiles.Affine`).
    captured_reads: {id(dynamic_slice equation of `jaxpr`): (read, axis or axes)}
    replacing those reads of captured arrays by `read(captured_ref, indices)`, whose
    `indices[axis]` is None on those axes (the kernels load reads at q_idx or kv_idx as
    contiguous slices: `block_reads`, and the Mosaic GPU kernel's own).
    """
    primitive_overrides = primitive_overrides or {}
    captured_reads = captured_reads or {}
    if apply is None:
        def apply(function, operands, primitive=None):
            del primitive
            return function(*broadcast(operands))
    # Dead equations are skipped: with reads replaced, the index arithmetic that fed them
    # is dead, and the caller may not have built indices that only dead code reads.
    live = live_equations(jaxpr, captured_reads)
    environment = {}
    small_index_vars = {var for position, var in enumerate(jaxpr.invars)
                        if position in small_index_args}
    index_differences = {}  # var -> (a, b) of an int `a - b` of two small index values

    def read(atom):
        if isinstance(atom, jex_core.Literal):
            return _as_array(atom.val, atom.aval)
        return environment[atom]

    for var, value in zip(jaxpr.constvars, consts):
        environment[var] = value
    for var, value in zip(jaxpr.invars, args):
        environment[var] = value

    for equation in jaxpr.eqns:
        if id(equation) not in live:
            continue
        sliced = _sliced_inputs(equation, captured_reads)
        operands = [None if position in sliced else read(atom)
                    for position, atom in enumerate(equation.invars)]
        primitive = equation.primitive.name
        if (primitive == "sub" and all(isinstance(atom, jex_core.Var) and atom in small_index_vars
                                       for atom in equation.invars)):
            index_differences[equation.outvars[0]] = operands
        if primitive in ("pvary", "pcast"):
            # A cast to varying manual axes, recorded where the mod was traced under a
            # varying value (context parallelism's shard offset): the identity here, the
            # operands of each later primitive meet in their varying axes in `_bound`.
            for var, operand in zip(equation.outvars, operands):
                environment[var] = operand
            continue
        kept = _integer_identity(equation)
        if kept is not None:
            # `i - 0` (a query offset of 0): the same var, an index difference still.
            environment[equation.outvars[0]] = operands[kept]
            if equation.invars[kept] in index_differences:
                index_differences[equation.outvars[0]] = index_differences[equation.invars[kept]]
            continue
        if (_is_float32_conversion(equation) and isinstance(equation.invars[0], jex_core.Var)
                and equation.invars[0] in index_differences):
            first, second = index_differences[equation.invars[0]]
            # The int difference computed for this var stays unused unless something
            # else reads it, and then the compiler drops it.
            convert = _bound(equation)
            outputs = [apply(lambda a, b: a - b,
                             [apply(convert, [first], "convert_element_type"),
                              apply(convert, [second], "convert_element_type")], "sub")]
        elif primitive in _CALL_PARAMS:
            inner = equation.params[_CALL_PARAMS[primitive]]
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_consts = getattr(inner, "consts", ())
            inner_small = [position for position, atom in enumerate(equation.invars)
                           if isinstance(atom, jex_core.Var) and atom in small_index_vars]
            outputs = evaluate_jaxpr_on_tiles(inner_jaxpr, list(inner_consts), operands, name,
                                              small_index_args=inner_small,
                                              primitive_overrides=primitive_overrides,
                                              broadcast=broadcast, apply=apply)
        elif (primitive == "dynamic_slice" and isinstance(operands[0], CapturedRef)
              and id(equation) in captured_reads):
            outputs = [captured_reads[id(equation)][0](operands[0], operands[1:])]
        elif primitive == "dynamic_slice" and isinstance(operands[0], CapturedRef):
            if any(size != 1 for size in equation.params["slice_sizes"]):
                raise ValueError(f"mod {name!r} slices a captured array; index it with "
                                 "scalar indices instead")
            outputs = [operands[0].gather(operands[1:])]
        elif primitive in _SIZE_ONE_RESHAPES and all(
                np.prod(v.aval.shape, dtype=int) == 1 for v in equation.outvars):
            outputs = [operands[0].load_scalar() if isinstance(operands[0], CapturedRef)
                       else operands[0]]
        else:
            operands = [_read_captured(x, name, primitive) if isinstance(x, CapturedRef) else x
                        for x in operands]
            if any(np.prod(v.aval.shape, dtype=int) != 1 for v in equation.outvars):
                raise ValueError(
                    f"mod {name!r} builds an array with {primitive!r}; mods must compute "
                    "one scalar from scalars (precompute arrays outside and index them)"
                )
            override = primitive_overrides.get(primitive)
            function = (_bound(equation) if override is None
                        else lambda *xs, override=override: override(*xs, **equation.params))
            outputs = apply(function, operands, primitive)
            if not equation.primitive.multiple_results:
                outputs = [outputs]
        for var, value in zip(equation.outvars, outputs):
            environment[var] = value

    return [read(atom) for atom in jaxpr.outvars]


def _integer_identity(equation):
    """The input position an integer `x + 0`, `0 + x` or `x - 0` passes through, else
    None."""
    primitive = equation.primitive.name
    if primitive not in ("add", "sub") or not jnp.issubdtype(equation.outvars[0].aval.dtype,
                                                               jnp.integer):
        return None
    for position in ((1, 0) if primitive == "add" else (1,)):
        atom = equation.invars[position]
        other = equation.invars[1 - position]
        if (isinstance(atom, jex_core.Literal) and np.ndim(atom.val) == 0 and atom.val == 0
                and isinstance(other, jex_core.Var)
                and other.aval.dtype == equation.outvars[0].aval.dtype
                and other.aval.shape == equation.outvars[0].aval.shape):
            return 1 - position
    return None


def live_equations(jaxpr: jex_core.Jaxpr, replaced_reads=()):
    """ids of the equations the outputs need, reads in `replaced_reads` counting as
    needing their array only (not their indices)."""
    live_vars = {atom for atom in jaxpr.outvars if isinstance(atom, jex_core.Var)}
    live = set()
    for equation in reversed(jaxpr.eqns):
        if not any(var in live_vars for var in equation.outvars):
            continue
        live.add(id(equation))
        live_vars.update(atom for atom in _needed_inputs(equation, replaced_reads)
                         if isinstance(atom, jex_core.Var))
    return live


def _sliced_inputs(equation, replaced_reads):
    """The input positions of a replaced read's indices along its sliced axes
    (`replaced_reads[id(equation)]` is a tuple whose second entry is that axis, or a
    tuple of them), or none."""
    if id(equation) not in replaced_reads:
        return ()
    axes = replaced_reads[id(equation)][1]
    return tuple(1 + axis for axis in (axes if isinstance(axes, tuple) else (axes,)))


def _needed_inputs(equation, replaced_reads):
    """equation.invars, less the indices of a replaced read's sliced axes."""
    sliced = _sliced_inputs(equation, replaced_reads)
    return [atom for position, atom in enumerate(equation.invars) if position not in sliced]


def reads_argument(jaxpr: jex_core.Jaxpr, position: int, replaced_reads=()) -> bool:
    """Whether argument `position` reaches the outputs, reads in `replaced_reads`
    not counting their indices."""
    argument = jaxpr.invars[position]
    live = live_equations(jaxpr, replaced_reads)
    for equation in jaxpr.eqns:
        if id(equation) in live and argument in _needed_inputs(equation, replaced_reads):
            return True
    return argument in jaxpr.outvars


class ExactIndices:
    """The variables of a mod's jaxpr that equal q_idx or kv_idx exactly ("q" / "kv" in
    `kind`), through an integer `x + 0` / `x - 0` (`ids[q_idx + offset]` with offset 0)
    and jnp indexing's negative-index wrap `select_n(i < 0, i, i + n)`: the kernels'
    indices are never negative, so that select is the index itself; and through
    `jnp.clip(i, lower <= 0, upper)`, exact up to `upper` (`bound`): a read of an array
    whose axis ends at or before `upper` clamps there anyway (`exact_index_reads`), as
    `mod_program.with_read_derivatives`' traced reads do (`TracedReads`)."""

    def __init__(self, program):
        first_index = 2 if program.kind == "mask" else 3
        invars = program.jaxpr.invars
        self.kind = {invars[first_index]: "q", invars[first_index + 1]: "kv"}
        self.bound = {}  # var: the upper bound a clip put on it
        self._never_true = set()

    def of(self, atom):
        """"q", "kv" or None for an equation input."""
        return self.kind.get(atom) if isinstance(atom, jex_core.Var) else None

    def bound_of(self, atom):
        """The upper bound a clip put on an exact index (None: none)."""
        return self.bound.get(atom) if isinstance(atom, jex_core.Var) else None

    def _pass(self, source, target):
        self.kind[target] = self.kind[source]
        if source in self.bound:
            self.bound[target] = self.bound[source]

    def follow(self, equation) -> bool:
        """Records what `equation` makes exact (or never true); whether it did."""
        name, inputs = equation.primitive.name, equation.invars
        kept = _integer_identity(equation)
        if kept is not None and self.of(inputs[kept]):
            self._pass(inputs[kept], equation.outvars[0])
            return True
        upper = _clip_upper_bound(equation)
        if upper is not None and self.of(inputs[0]):
            self._pass(inputs[0], equation.outvars[0])
            self.bound[equation.outvars[0]] = min(upper, self.bound.get(inputs[0], upper))
            return True
        if (name == "lt" and self.of(inputs[0]) and isinstance(inputs[1], jex_core.Literal)
                and inputs[1].val <= 0):
            self._never_true.add(equation.outvars[0])
            return True
        if (name == "select_n" and len(inputs) == 3
                and isinstance(inputs[0], jex_core.Var) and inputs[0] in self._never_true
                and self.of(inputs[1])):
            self._pass(inputs[1], equation.outvars[0])
            return True
        return False


def _clip_upper_bound(equation):
    """`upper` for `jnp.clip(x, lower, upper)` of an integer x (a call named clip whose
    bounds are literals, lower <= 0), else None."""
    if (equation.primitive.name not in ("pjit", "jit")
            or equation.params.get("name") != "clip" or len(equation.invars) != 3
            or not jnp.issubdtype(equation.outvars[0].aval.dtype, jnp.integer)):
        return None
    lower, upper = equation.invars[1:]
    if not all(isinstance(atom, jex_core.Literal) and np.ndim(atom.val) == 0
               for atom in (lower, upper)) or lower.val > 0:
        return None
    return int(upper.val)


def exact_index_reads(program):
    """Each read of a captured array in the mod's jaxpr (a dynamic_slice of one element)
    with what its indices are: (equation, captured position, kinds, uniform), kinds one
    per axis ("q" / "kv" where the index is exactly q_idx / kv_idx: `ExactIndices`, else
    None), uniform whether the other indices are the same over a tile (functions of b, h
    and constants, not of q_idx, kv_idx or the score). `block_reads` (Triton) and
    `mosaic_eligibility.contiguous_reads` (Mosaic GPU) choose from these the reads their
    kernels load as blocks."""
    if program is None:
        return
    jaxpr = program.jaxpr
    exact = ExactIndices(program)
    depends_on_tile = set(exact.kind)
    if program.kind == "score":
        depends_on_tile.add(jaxpr.invars[0])
    positions = {var: position for position, var in enumerate(jaxpr.constvars)}

    def is_var(atom):
        return isinstance(atom, jex_core.Var)

    for equation in jaxpr.eqns:
        name, inputs = equation.primitive.name, equation.invars
        if exact.follow(equation):
            pass
        elif (name == "dynamic_slice" and is_var(inputs[0]) and inputs[0] in positions
              and all(size == 1 for size in equation.params["slice_sizes"])):
            # (an index clipped below the axis's end is not exact: it stops early)
            kinds = [exact.of(atom) if (exact.bound_of(atom) is None
                                        or exact.bound_of(atom) >= size - 1) else None
                     for atom, size in zip(inputs[1:], inputs[0].aval.shape)]
            uniform = not any(is_var(atom) and atom in depends_on_tile
                              for atom, kind in zip(inputs[1:], kinds) if kind is None)
            yield equation, positions[inputs[0]], kinds, uniform
        if any(is_var(atom) and atom in depends_on_tile for atom in inputs):
            depends_on_tile.update(equation.outvars)


def block_reads(program):
    """The mod's reads of captured arrays that the Triton kernels load as blocks:
    {id(dynamic_slice equation of program.jaxpr): (captured position, ((axis, "q" /
    "kv"), ...))}.

    A read qualifies when its index on one axis is exactly q_idx, or kv_idx, or on one
    axis exactly q_idx and on another exactly kv_idx (in either order: `pair_bias[b //
    rows, h, q_idx, kv_idx]`, `bias[h, kv_idx, q_idx]`, `key_bias[b, kv_idx]`), and its
    other indices are uniform over a tile (`exact_index_reads`). Such a read covers a
    contiguous block (or vector) of the array per tile, which the kernels load with
    slices (`BlockRead`), where a gather computes and loads one pointer per element; a
    read at a computed index (`table[h, kv_idx - q_idx + S]`) stays a gather. jnp
    indexing wraps negative indices (`select_n(i < 0, i, i + n)`); the kernels' indices
    are never negative, so that select is the index itself. Reads inside calls the mod
    makes (`jax.jit` functions) stay gathers."""
    reads = {}
    for equation, position, kinds, uniform in exact_index_reads(program):
        axes = tuple((axis, kind) for axis, kind in enumerate(kinds) if kind is not None)
        if axes and uniform and len({kind for _, kind in axes}) == len(axes):
            reads[id(equation)] = (position, axes)
    return reads


def _block_readers(program, frame):
    """`captured_reads` for `evaluate_jaxpr_on_tiles`: the `block_reads` of `program`
    loaded at the tile `frame` (None: none, every read gathers)."""
    if frame is None or program is None:
        return None
    readers = {}
    for key, (_, axes) in block_reads(program).items():
        def read(captured, indices, axes=axes):
            return captured.block(indices, axes, frame)
        readers[key] = (read, tuple(axis for axis, _ in axes))
    return readers


def _captured(program, refs, log, select_small_tables=False):
    return [CapturedRef(ref, jnp.shape(c), position, log, select_small_tables)
            for position, (ref, c) in enumerate(zip(refs, program.consts))]


def _small_index_args(first_index_arg, indices_below):
    """Positions of q_idx and kv_idx among a program's args when every index passed is
    known to lie in [0, indices_below) with indices_below <= 2**24; else none."""
    if indices_below is None or indices_below > EXACT_FLOAT32_INTEGERS:
        return ()
    return (first_index_arg, first_index_arg + 1)


def apply_mask_on_tile(program, captured_refs, b, h, q_idx, kv_idx, *, indices_below=None,
                       frame=None, select_small_tables=False):
    """mask [block_q, block_kv] (bool) for q_idx [block_q, 1] and kv_idx [1, block_kv]
    (or the transposed tile, for q_idx [1, block_q] and kv_idx [block_kv, 1]).

    indices_below: a bound on every q_idx and kv_idx value passed (the kernels clamp
    them into their sequences), or None if unknown; see `evaluate_jaxpr_on_tiles`.
    frame: the tile's TileFrame, with which reads at exactly q_idx / kv_idx load blocks
    (`block_reads`); None: every read gathers. select_small_tables: per-element reads of
    small tables as selects (`CapturedRef._select`)."""
    consts = _captured(program, captured_refs, CaptureLog(), select_small_tables)
    (mask,) = evaluate_jaxpr_on_tiles(program.jaxpr, consts, (b, h, q_idx, kv_idx), program.name,
                                      _small_index_args(2, indices_below),
                                      captured_reads=_block_readers(program, frame))
    return jnp.broadcast_to(mask, np.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)))


def apply_score_on_tile(program, captured_refs, score, b, h, q_idx, kv_idx, *,
                        indices_below=None, frame=None, select_small_tables=False):
    """score_mod applied to score [block_q, block_kv] (float32); indices_below, frame and
    select_small_tables as for `apply_mask_on_tile`."""
    consts = _captured(program, captured_refs, CaptureLog(), select_small_tables)
    (result,) = evaluate_jaxpr_on_tiles(program.jaxpr, consts, (score, b, h, q_idx, kv_idx),
                                        program.name, _small_index_args(3, indices_below),
                                        captured_reads=_block_readers(program, frame))
    return jnp.broadcast_to(result, score.shape).astype(jnp.float32)


def score_vjp_on_tile(program, captured_refs, score, b, h, q_idx, kv_idx, *,
                      indices_below=None, log=None, frame=None, select_small_tables=False):
    """The modded score and its VJP, for the backward kernels.

    Returns `(modded [block_q, block_kv], vjp, sites)`: `vjp(cotangent)` gives the
    cotangent of `score` and one cotangent per site in `sites` (a list of
    `(captured position, indices)` reads of captured arrays), already summed over the
    tile dimensions the site's indices do not vary along. indices_below, frame and
    select_small_tables as for `apply_mask_on_tile`. log: a CaptureLog to record the reads in (the caller reads
    its `unbroadcast` indices and `blocks`), else a new one.
    """
    small_index_args = _small_index_args(3, indices_below)
    recording = log if log is not None else CaptureLog()
    readers = _block_readers(program, frame)
    evaluate_jaxpr_on_tiles(program.jaxpr,
                            _captured(program, captured_refs, recording, select_small_tables),
                            (score, b, h, q_idx, kv_idx), program.name, small_index_args,
                            captured_reads=readers)

    def modded(score, site_values):
        replay = CaptureLog(replay_values=site_values)
        (result,) = evaluate_jaxpr_on_tiles(
            program.jaxpr, _captured(program, captured_refs, replay),
            (score, b, h, q_idx, kv_idx), program.name, small_index_args,
            captured_reads=readers)
        return jnp.broadcast_to(result, score.shape).astype(jnp.float32)

    result, vjp = jax.vjp(modded, score, list(recording.values))
    # A mod whose values vary over manual mesh axes (context parallelism's shard offsets
    # inside a shard_map that checks them) takes a cotangent varying alike.
    axes = varying_axes(result, score, recording.values)
    return result, lambda cotangent: vjp(vary(cotangent, axes)), recording.sites


def split_captured_refs(refs, mask_program, score_program):
    """(mask_refs, score_refs, the refs after them): a kernel's inputs for the arrays the
    mods captured come in `captured_inputs` order, mask_mod's first."""
    num_mask = len(mask_program.consts)
    num_score = len(score_program.consts) if score_program is not None else 0
    return (refs[:num_mask], refs[num_mask:num_mask + num_score],
            refs[num_mask + num_score:])


def captured_inputs(program):
    """The arrays to pass as kernel inputs for `program`'s captured arrays (0-d -> [1])."""
    if program is None:
        return []
    return [jnp.reshape(c, (1,)) if jnp.ndim(c) == 0 else c for c in program.consts]


def captured_read_positions(program) -> list[int]:
    """Traces `program` on a dummy tile outside any kernel and returns, for each read of a
    captured array (in program order, as the kernels will see them), that array's
    position in `program.consts`. Raises the tile interpreter's errors early, at trace
    time, before any kernel is built."""
    return [position for position, _ in captured_read_sites(program)]


def captured_read_sites(program, captured_reads=None):
    """The (captured position, indices) of each read of a captured array when `program`
    runs on a dummy tile ([4, 1] query and [1, 8] key indices) outside any kernel;
    `captured_reads` as for `evaluate_jaxpr_on_tiles` (those reads are not listed)."""
    return _dummy_tile_log(program, captured_reads).sites


def captured_read_varying_axes(program) -> list[tuple[bool, ...]]:
    """Per read of a captured array (in program order), per axis of the array: whether
    its index varies over a tile (depends on q_idx or kv_idx) rather than on b, h and
    constants only."""
    return _dummy_tile_log(program, None).varying


def captured_read_batch_axes(program) -> list[tuple[bool, ...]]:
    """Per read of a captured array (in program order), per axis of the array: whether
    its index depends on b (directly, or through values read from captured arrays at
    indices that do). A pair bias shared by the rows of an MSA, `bias[b // rows, h,
    q_idx, kv_idx]`, gives (True, False, False, False)."""
    if program is None:
        return []

    def indices(b):
        log = CaptureLog()
        consts = _captured(program, [_DependentRef(jnp.shape(c), c.dtype)
                                     for c in program.consts], log)
        args = [b, jnp.int32(0), jnp.zeros((4, 1), jnp.int32), jnp.zeros((1, 8), jnp.int32)]
        if program.kind == "score":
            args = [jnp.zeros((4, 8), jnp.float32)] + args
        evaluate_jaxpr_on_tiles(program.jaxpr, consts, args, program.name)
        return [tuple(jnp.asarray(i) for i in site) for _, site in log.sites]

    closed, shapes = jax.make_jaxpr(indices, return_shape=True)(jnp.int32(0))
    dependent = dependent_vars(closed.jaxpr, closed.jaxpr.invars[:1])
    flags = [isinstance(atom, jex_core.Var) and atom in dependent
             for atom in closed.jaxpr.outvars]
    return [tuple(site) for site in jax.tree.unflatten(jax.tree.structure(shapes), flags)]


class _DependentRef:
    """A stand-in kernel ref whose reads depend on their indices (their values do not
    matter), for `captured_read_batch_axes`."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        index = [jnp.asarray(i) for i in index]
        shape = np.broadcast_shapes(*(jnp.shape(i) for i in index))
        total = sum(jnp.broadcast_to(i, shape).astype(jnp.int32) for i in index)
        return jnp.broadcast_to(total, shape).astype(self.dtype)


def captured_read_blocks(program) -> list:
    """Per read of a captured array (in program order), its tile axes ((axis, "q" /
    "kv"), ...) where the kernels load it as a block (`block_reads`), else None (a
    gather)."""
    if program is None:
        return []
    frame = TileFrame(jnp.int32(0), jnp.int32(0), 4, 8,
                      load=lambda ref, read: jnp.zeros(read.block_shape(), ref.dtype))
    log = _dummy_tile_log(program, _block_readers(program, frame))
    return [None if block is None else block.axes for block in log.blocks]


def _dummy_tile_log(program, captured_reads):
    log = CaptureLog()
    if program is None:
        return log
    consts = _captured(program, [_ShapeOnlyRef(jnp.shape(c), c.dtype) for c in program.consts],
                       log)
    args = [jnp.int32(0), jnp.int32(0), jnp.zeros((4, 1), jnp.int32), jnp.zeros((1, 8), jnp.int32)]
    if program.kind == "score":
        args = [jnp.zeros((4, 8), jnp.float32)] + args
    jax.eval_shape(lambda: evaluate_jaxpr_on_tiles(program.jaxpr, consts, args, program.name,
                                                   captured_reads=captured_reads))
    return log


class _ShapeOnlyRef:
    """Stands in for a kernel ref when checking a program outside a kernel."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        shape = np.broadcast_shapes(*(jnp.shape(i) for i in index))
        return jnp.zeros(shape, self.dtype)


__all__ = ["apply_mask_on_tile", "apply_score_on_tile", "block_reads", "captured_inputs",
           "captured_read_batch_axes", "captured_read_blocks", "captured_read_positions",
           "captured_read_sites",
           "captured_read_varying_axes",
           "evaluate_jaxpr_on_tiles",
           "padded_for_blocks", "split_captured_refs", "unpadded_gradient", "BlockRead",
           "CapturedRef", "TileFrame", "TracedReads"]
