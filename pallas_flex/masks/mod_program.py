"""A mod traced once, with the arrays it closes over hoisted out as explicit inputs.

A user's `mask_mod(b, h, q_idx, kv_idx)` or `score_mod(score, b, h, q_idx, kv_idx)` is
a Python closure. Kernels cannot capture arrays, and baking captured arrays in as
constants would recompile on every new value (new document ids each batch, new ALiBi
slopes each step) and hide them from `jax.grad`. So each mod is traced once on scalar
arguments into a jaxpr, and the arrays it captured become `consts`: pytree leaves that
travel into the kernels as ordinary inputs (and get gradients as ordinary inputs).

Two programs compare equal when their jaxprs print the same, whatever their constant
values: that is what lets `jit` reuse a compiled kernel for a new closure of the same
shape.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from pallas_flex.manual_axes import vary, varying_axes

MASK = "mask"
SCORE = "score"

_ARGUMENT_NAMES = {
    MASK: ("b", "h", "q_idx", "kv_idx"),
    SCORE: ("score", "b", "h", "q_idx", "kv_idx"),
}


class _JaxprStructure:
    """Hashable key of a jaxpr: its printed text (constant *values* are not printed)."""

    def __init__(self, jaxpr: jex_core.Jaxpr):
        self.jaxpr = jaxpr
        self.text = str(jaxpr)

    def __eq__(self, other):
        return isinstance(other, _JaxprStructure) and self.text == other.text

    def __hash__(self):
        return hash(self.text)


@jax.tree_util.register_pytree_node_class
class ModProgram:
    """A traced mask_mod or score_mod.

    Attributes:
      kind: "mask" or "score".
      jaxpr: the mod's jaxpr on scalar int32 indices (and a float32 score), with one
        constvar per captured array.
      consts: the captured arrays, in `jaxpr.constvars` order (pytree leaves).
      name: the mod's `__name__`, for error messages and reprs.
      uses_batch, uses_head: whether the mod reads `b` / `h`; when it does not, a
        BlockMask built from it broadcasts over that axis.
    """

    def __init__(self, kind: str, structure: _JaxprStructure, consts, name: str):
        self.kind = kind
        self._structure = structure
        self.consts = tuple(consts)
        self.name = name

    @property
    def jaxpr(self) -> jex_core.Jaxpr:
        return self._structure.jaxpr

    def _reads_argument(self, position: int) -> bool:
        argument = self.jaxpr.invars[position]
        return any(
            argument in equation.invars for equation in self.jaxpr.eqns
        ) or argument in self.jaxpr.outvars

    @property
    def uses_batch(self) -> bool:
        return self._reads_argument(0 if self.kind == MASK else 1)

    @property
    def uses_head(self) -> bool:
        return self._reads_argument(1 if self.kind == MASK else 2)

    def __call__(self, *args):
        """Evaluates the mod with scalar semantics (vmap it for arrays of indices)."""
        axes = varying_axes(self.consts, args)
        if axes:
            (result,) = _eval_varying(self.jaxpr, self.consts, args, axes)
        else:
            (result,) = jax.core.eval_jaxpr(self.jaxpr, self.consts, *args)
        return result

    def tree_flatten(self):
        return self.consts, (self.kind, self._structure, self.name)

    @classmethod
    def tree_unflatten(cls, aux, consts):
        kind, structure, name = aux
        return cls(kind, structure, consts, name)

    def __repr__(self):
        return f"ModProgram({self.kind}_mod={self.name}, captured={len(self.consts)})"


# The parameter holding a call primitive's jaxpr, for the evaluators that inline the
# calls a mod makes (`_eval_varying`, `kernels.tile_mods.evaluate_jaxpr_on_tiles`).
CALL_JAXPR_PARAMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
                     "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
                     "remat": "jaxpr", "checkpoint": "jaxpr"}


def _eval_varying(jaxpr, consts, args, axes):
    """`jax.core.eval_jaxpr` inside a jax.shard_map that checks varying manual axes,
    where some of the mod's values vary over `axes`: every value (constants, arguments,
    literals, each primitive's results) is typed as varying over all of them first. The
    mod's jaxpr was traced outside the shard_map, and its primitives, bound as they are,
    take operands of equal varying axes only, where jnp's functions would have cast
    them. Calls the mod makes are evaluated inline, the same way."""
    def cast(x):
        return vary(x, axes)

    environment = {}

    def read(atom):  # cast where read: an argument the mod ignores stays unread (a mask
        # that ignores h must still build a BlockMask broadcast over heads)
        if isinstance(atom, jex_core.Literal):
            return cast(jnp.asarray(atom.val, atom.aval.dtype))
        return cast(environment[atom])

    for var, value in zip(jaxpr.constvars, consts):
        environment[var] = value
    for var, value in zip(jaxpr.invars, args):
        environment[var] = value
    for equation in jaxpr.eqns:
        inputs = [read(atom) for atom in equation.invars]
        name = equation.primitive.name
        if axes and name in ("pvary", "pcast"):
            # A mod traced under a varying value (context parallelism's shard offset)
            # casts invariant values to varying; here every value varies already.
            outputs = inputs
        elif name in CALL_JAXPR_PARAMS:
            inner = equation.params[CALL_JAXPR_PARAMS[name]]
            outputs = _eval_varying(getattr(inner, "jaxpr", inner),
                                    getattr(inner, "consts", ()), inputs, axes)
        else:
            outputs = equation.primitive.bind(*inputs, **equation.params)
            if not equation.primitive.multiple_results:
                outputs = [outputs]
            outputs = [cast(x) for x in outputs]
        for var, value in zip(equation.outvars, outputs):
            environment[var] = value
    return [read(atom) for atom in jaxpr.outvars]


def eval_inline(jaxpr, consts, args):
    """`jax.core.eval_jaxpr` with the calls a mod makes (jnp functions under `jit`)
    evaluated inline, so that tracing it gives one flat jaxpr; casts to varying axes are
    kept as recorded."""
    return _eval_varying(jaxpr, consts, args, ())


def _check_arity(function: Callable, kind: str, argument_name: str) -> None:
    expected = len(_ARGUMENT_NAMES[kind])
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # Builtins and some C callables have no signature; tracing will tell.
    try:
        signature.bind(*range(expected))
    except TypeError:
        names = ", ".join(_ARGUMENT_NAMES[kind])
        raise ValueError(
            f"{argument_name} must take {expected} positional arguments ({names}); "
            f"{getattr(function, '__name__', function)!r} has signature {signature}"
        ) from None


def make_mod_program(function, kind: str, argument_name: str | None = None) -> ModProgram:
    """Traces `function` as a mask_mod (`kind="mask"`) or score_mod (`kind="score"`)."""
    argument_name = argument_name or f"{kind}_mod"
    if isinstance(function, ModProgram):
        if function.kind != kind:
            raise ValueError(
                f"{argument_name} must be a {kind}_mod, got a traced {function.kind}_mod"
            )
        return function
    if not callable(function):
        raise ValueError(f"{argument_name} must be callable, got {type(function).__name__}")
    _check_arity(function, kind, argument_name)

    index = jax.ShapeDtypeStruct((), jnp.int32)
    example_args = [index] * 4
    if kind == SCORE:
        example_args = [jax.ShapeDtypeStruct((), jnp.float32)] + example_args
    name = getattr(function, "__name__", type(function).__name__)
    try:
        closed_jaxpr, out_shape = jax.make_jaxpr(function, return_shape=True)(*example_args)
    except jax.errors.TracerBoolConversionError as error:
        raise ValueError(
            f"{argument_name} {name!r} uses Python control flow on its arguments; "
            "use jnp.where / & / | instead of if/and/or"
        ) from error
    except (jax.errors.TracerIntegerConversionError,
            jax.errors.TracerArrayConversionError) as error:
        # `table[q_idx]` on a captured Python list/tuple or NumPy array asks the traced
        # index for a concrete Python int (list, tuple) or a NumPy array (NumPy).
        raise ValueError(
            f"{argument_name} {name!r} indexes a Python list/tuple or NumPy array it "
            "captured with a traced index (b, h, q_idx and kv_idx are traced int32 "
            "scalars), or passes one to a NumPy function: wrap it with "
            "jnp.asarray(...) so it is captured as an array (outside the mod, once), and "
            "use jnp functions inside the mod"
        ) from error
    except jax.errors.ConcretizationTypeError as error:
        raise ValueError(
            f"{argument_name} {name!r} needs a concrete Python value of a traced argument "
            f"(int(), float(), range() or similar on b, h, q_idx, kv_idx or the score); "
            f"mods run on traced int32 scalars: use jnp operations instead"
        ) from error
    if not isinstance(out_shape, jax.ShapeDtypeStruct) or out_shape.shape != ():
        raise ValueError(
            f"{argument_name} {name!r} must return one scalar for scalar indices, got {out_shape}"
        )
    if kind == MASK and out_shape.dtype != jnp.bool_:
        raise ValueError(
            f"{argument_name} {name!r} must return a bool, got {out_shape.dtype} "
            "(compare, e.g. `q_idx >= kv_idx`, rather than returning numbers)"
        )
    if kind == SCORE and not jnp.issubdtype(out_shape.dtype, jnp.floating):
        raise ValueError(
            f"{argument_name} {name!r} must return a floating score, got {out_shape.dtype}"
        )
    consts = [jnp.asarray(c) if isinstance(c, (np.ndarray, np.generic)) else c
              for c in closed_jaxpr.consts]
    return ModProgram(kind, _JaxprStructure(closed_jaxpr.jaxpr), consts, name)


def const_positions(original: ModProgram | None, derived: ModProgram | None) -> list:
    """Per captured array of `derived` (a program traced from a mod that calls
    `original`: a shifted or wrapped mod), its position among `original`'s captured
    arrays, or None for one of its own (a shard offset, say). Tracing keeps the captured
    arrays themselves, in an order of its own: matched by identity. Maps gradients of the
    derived program's captured arrays back to the original's."""
    if derived is None:
        return []
    positions = {id(c): i for i, c in enumerate(original.consts if original else ())}
    return [positions.get(id(c)) for c in derived.consts]


def with_score_derivative(program: ModProgram) -> ModProgram:
    """A score program computing `(score_mod(score, ...), d score_mod / d score)`: the
    mod and its derivative traced together (`jax.jvp` on scalars), so that the backward
    kernels evaluate them in one pass over a tile (a soft-cap's tanh once, shared by
    both) with the same tile interpreter as the mod itself. Same consts, same order."""
    structure = _with_score_derivative(program._structure, tuple(
        (tuple(jnp.shape(c)), jnp.result_type(c)) for c in program.consts), program.name)
    return ModProgram(SCORE, structure, program.consts, program.name + "_with_derivative")


@functools.lru_cache(maxsize=256)
def _with_score_derivative(structure, const_types, name):
    count = len(const_types)

    def value_and_derivative(*args):
        consts, (score, b, h, q_idx, kv_idx) = args[:count], args[count:]

        def mod(s):
            (result,) = jax.core.eval_jaxpr(structure.jaxpr, consts, s, b, h, q_idx, kv_idx)
            return result.astype(jnp.float32)

        return jax.jvp(mod, (score,), (jnp.ones_like(score),))

    index = jax.ShapeDtypeStruct((), jnp.int32)
    closed = jax.make_jaxpr(value_and_derivative)(
        *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in const_types],
        jax.ShapeDtypeStruct((), jnp.float32), index, index, index, index)
    if closed.consts:  # constants of the derivative itself: none for jnp code
        raise ValueError(f"score_mod {name!r}: its derivative closes over constants")
    # The first `count` inputs become constvars: jaxprs mark them by attaching values
    # (placeholders here; kernels take a program's own `consts`).
    placeholders = [np.zeros(shape, dtype) for shape, dtype in const_types]
    return _JaxprStructure(jex_core.ClosedJaxpr(closed.jaxpr, placeholders).jaxpr)


def with_read_derivatives(program: ModProgram, positions: tuple) -> ModProgram:
    """A score program computing `(score_mod(score, ...), d score_mod / d score,
    d score_mod / d read_p for p in positions)`: besides the score's derivative, that of
    the value the mod read from each captured array in `positions` (each read exactly
    once, see `mosaic_eligibility.captured_gradient_unsupported_reason`), all traced in one
    pass (`jax.linearize`: the mod's primal work once). The Mosaic GPU backward sums
    dS times each read's derivative into the array's gradient. Same consts, same order."""
    positions = tuple(positions)
    structure = _with_read_derivatives(program._structure, tuple(
        (tuple(jnp.shape(c)), jnp.result_type(c)) for c in program.consts), positions,
        program.name)
    return ModProgram(SCORE, structure, program.consts,
                      program.name + "_with_read_derivatives")


@functools.lru_cache(maxsize=256)
def _with_read_derivatives(structure, const_types, positions, name):
    count = len(const_types)

    def values_and_derivatives(*args):
        # The tile interpreter reads the captured arrays (the kernels' semantics: clamped
        # indices, calls inlined); a read of an array at `positions` adds a shift, and
        # the derivative with respect to the shift is that with respect to the value read.
        # The other arrays are read alike, without a shift (a T5 table beside
        # differentiated slopes: a plain array there broadcast its indices as a tile's).
        from pallas_flex.kernels.tile_mods import (
            ShiftedReads, TracedReads, evaluate_jaxpr_on_tiles)

        consts, (score, b, h, q_idx, kv_idx) = args[:count], args[count:]

        def mod(s, shifts):
            shift_of = dict(zip(positions, shifts))
            refs = [ShiftedReads(c, shift_of[p]) if p in shift_of else TracedReads(c)
                    for p, c in enumerate(consts)]
            (result,) = evaluate_jaxpr_on_tiles(structure.jaxpr, refs,
                                                (s, b, h, q_idx, kv_idx), name)
            return jnp.asarray(result).astype(jnp.float32)

        shifts = tuple(jnp.zeros((), const_types[p][1]) for p in positions)
        value, linear = jax.linearize(mod, score, shifts)
        none = tuple(jnp.zeros_like(shift) for shift in shifts)
        derivatives = [linear(jnp.ones_like(score), none)]
        for k in range(len(positions)):
            direction = tuple(jnp.ones_like(shift) if i == k else zero
                              for i, (shift, zero) in enumerate(zip(shifts, none)))
            derivatives.append(linear(jnp.zeros_like(score), direction))
        return (value, *[d.astype(jnp.float32) for d in derivatives])

    index = jax.ShapeDtypeStruct((), jnp.int32)
    closed = jax.make_jaxpr(values_and_derivatives)(
        *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in const_types],
        jax.ShapeDtypeStruct((), jnp.float32), index, index, index, index)
    if closed.consts:
        raise ValueError(f"score_mod {name!r}: its derivative closes over constants")
    placeholders = [np.zeros(shape, dtype) for shape, dtype in const_types]
    return _JaxprStructure(jex_core.ClosedJaxpr(closed.jaxpr, placeholders).jaxpr)


def dependent_vars(jaxpr, sources) -> set:
    """The variables of `jaxpr` whose values depend on those in `sources` (forward data
    flow: an equation that takes a dependent value makes its outputs dependent)."""
    dependent = set(sources)
    for equation in jaxpr.eqns:
        if any(isinstance(atom, jex_core.Var) and atom in dependent
               for atom in equation.invars):
            dependent.update(equation.outvars)
    return dependent


def constant_output(program: ModProgram, index: int):
    """Output `index` of the program's jaxpr as a Python float where it depends on none
    of its inputs (indices, score, captured arrays): a bias's derivative with respect to
    the value it reads, 1, from `with_read_derivatives`; else None. Decided by the
    jaxpr's data flow (`dependent_vars`), then the independent output evaluated once."""
    jaxpr = program.jaxpr
    out = jaxpr.outvars[index]
    if isinstance(out, jex_core.Literal):
        return float(np.asarray(out.val))
    if out in dependent_vars(jaxpr, (*jaxpr.constvars, *jaxpr.invars)):
        return None
    zeros = [np.zeros(v.aval.shape, v.aval.dtype) for v in (*jaxpr.constvars, *jaxpr.invars)]
    with jax.ensure_compile_time_eval():  # concrete under an outer trace too
        values = jax.core.eval_jaxpr(jaxpr, zeros[:len(jaxpr.constvars)],
                                     *zeros[len(jaxpr.constvars):])
    return float(np.asarray(values[index]))


def vmap_mask(program: ModProgram) -> Callable[..., Any]:
    """mask(b, h, q_idx [Q], kv_idx [K]) -> [Q, K] for scalar b, h."""
    over_kv = jax.vmap(program, in_axes=(None, None, None, 0))
    return jax.vmap(over_kv, in_axes=(None, None, 0, None))


def vmap_score(program: ModProgram) -> Callable[..., Any]:
    """score(s [Q, K], b, h, q_idx [Q], kv_idx [K]) -> [Q, K] for scalar b, h."""
    over_kv = jax.vmap(program, in_axes=(0, None, None, None, 0))
    return jax.vmap(over_kv, in_axes=(0, None, None, 0, None))


def _interval_of(atom, bounds):
    """The interval of a jaxpr atom: a literal's value, a variable's bound (unbounded
    where it has none)."""
    if isinstance(atom, jex_core.Literal):
        value = float(np.asarray(atom.val))
        return value, value
    return bounds.get(atom, (-np.inf, np.inf))


def _product(a, b):
    if any(np.isinf(x) for x in a + b):  # keeps 0 * inf out of the corners
        if a == (0.0, 0.0) or b == (0.0, 0.0):
            return 0.0, 0.0
        return -np.inf, np.inf
    corners = [x * y for x in a for y in b]
    return min(corners), max(corners)


def _quotient(a, b):
    low, high = b
    if low <= 0.0 <= high:
        return -np.inf, np.inf
    return _product(a, (1.0 / high, 1.0 / low))


_INTERVAL_RULES = {
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "mul": _product,
    "div": _quotient,
    "neg": lambda a: (-a[1], -a[0]),
    "tanh": lambda a: (float(np.tanh(a[0])), float(np.tanh(a[1]))),
    "logistic": lambda a: (float(1 / (1 + np.exp(-a[0]))), float(1 / (1 + np.exp(-a[1])))),
    "sin": lambda a: (-1.0, 1.0),
    "cos": lambda a: (-1.0, 1.0),
    "max": lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
    "min": lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    "convert_element_type": lambda a: a,
    "copy": lambda a: a,
    "copy_p": lambda a: a,
}


def _bounds_of(jaxpr, in_intervals):
    """The intervals of `jaxpr`'s outputs given its inputs', or None where an operation
    has no rule. Nested jit calls (`jnp.clip`) are followed."""
    bounds = dict(zip(jaxpr.invars, in_intervals))
    for equation in jaxpr.eqns:
        operands = [_interval_of(atom, bounds) for atom in equation.invars]
        inner = equation.params.get("jaxpr") if equation.primitive.name in ("pjit", "jit") else None
        if inner is not None:
            results = _bounds_of(inner.jaxpr, operands)
        else:
            rule = _INTERVAL_RULES.get(equation.primitive.name)
            results = None if rule is None or len(equation.outvars) != 1 else [rule(*operands)]
        if results is None or any(np.isnan(x) for interval in results for x in interval):
            return None
        bounds.update(zip(equation.outvars, results))
    return [_interval_of(atom, bounds) for atom in jaxpr.outvars]


def score_bounds(program: ModProgram | None) -> tuple[float, float] | None:
    """(low, high) bounds of a score_mod's result for every score, or None: found by
    interval arithmetic on its jaxpr, for mods that read the score only (no index, no
    captured array) through the operations of `_INTERVAL_RULES` (a soft-cap's
    cap * tanh(score / cap) is within (-cap, cap)). The Mosaic GPU forward then
    normalizes its softmax by a fixed shift instead of a running row max."""
    if program is None or program.kind != SCORE or program.consts:
        return None
    if any(program._reads_argument(position) for position in range(1, 5)):
        return None
    unbounded = (-np.inf, np.inf)
    results = _bounds_of(program.jaxpr, [unbounded] * len(program.jaxpr.invars))
    if results is None:
        return None
    low, high = results[0]
    if not (np.isfinite(low) and np.isfinite(high)):
        return None
    return float(low), float(high)
