"""Value checks that are ValueErrors on concrete values and checkify checks when traced.

Paged metadata (page tables, lengths, begins) is data: eagerly it is concrete and a bad
value can be reported at once, but inside `jax.jit` it is traced and nothing can be
raised. There the same check becomes a `checkify.debug_check`: free (a no-op) under a
plain `jit`, and reported with the same message when the caller wraps the function in
`jax.experimental.checkify.checkify`. (A plain `checkify.check` would make every
un-checkified `jit` of these functions fail to trace.)

A debug check is free on the device but not on the host: it gives the traced function
an effect, and a jitted function with effects leaves JAX's fast C++ dispatch path. On
this project's CPU machine one `debug_check` took a trivial jitted call from 4 to 42 us
of dispatch, and the ragged op's jitted serving step from 25 to 275 us, per call. A
server that does not checkify turns the traced checks off with `traced_checks(False)`
around its jitted calls (on the GPU machine: 0.61 -> 0.15 ms of host time per call of
the ragged op).
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


TRACED_CHECKS_ENVIRONMENT_VARIABLE = "PALLAS_FLEX_PAGED_TRACED_CHECKS"


def _default_traced_checks() -> bool:
    setting = os.environ.get(TRACED_CHECKS_ENVIRONMENT_VARIABLE, "").strip().lower()
    return setting not in ("0", "false", "no", "off")


# A JAX user context (`jax.make_user_context`) rather than a plain context variable: its
# value is part of jit's cache keys, so a function traced with the checks and the same
# function traced without them are two cache entries (a context variable would hand
# back whichever was traced first). Off process-wide with `set_traced_checks(False)` or
# the environment variable PALLAS_FLEX_PAGED_TRACED_CHECKS=0 (read at import).
_TRACED_CHECKS = jax.make_user_context(default_value=_default_traced_checks())


def set_traced_checks(enabled: bool) -> None:
    """Process-wide default of `traced_checks` (a `traced_checks(...)` context still
    overrides it inside its block)."""
    if not isinstance(enabled, (bool, np.bool_)):
        raise ValueError(f"enabled must be a bool, got {type(enabled).__name__}")
    _TRACED_CHECKS.set_global(bool(enabled))


@contextlib.contextmanager
def traced_checks(enabled: bool):
    """Whether functions traced inside this context emit the paged metadata checks as
    `checkify.debug_check`s (the default) or leave them out, for the fast dispatch of
    effect-free jitted functions. The setting is part of jit's cache key: a function
    called inside and outside the context is traced once for each. Concrete (eager)
    checks are ValueErrors either way.

    Example:
      >>> step = jax.jit(serve_step, donate_argnums=(1,))
      >>> with pallas_flex.paged.traced_checks(False):
      ...     out, cache = step(params, cache, tokens)  # traced and run without checks
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise ValueError(f"enabled must be a bool, got {type(enabled).__name__}")
    with _TRACED_CHECKS(bool(enabled)):
        yield


def is_traced(*values) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(values))


def checking_arrays(*values):
    """(xp, arrays): NumPy copies of `values` when all are concrete (checks then cost no
    device dispatches or compilations), else `jnp` arrays, for checks written once
    against either module."""
    if is_traced(values):
        return jnp, tuple(jnp.asarray(value) for value in values)
    return np, tuple(np.asarray(value) for value in values)


def require(condition, message: str, **values) -> None:
    """Asserts `condition` (a boolean scalar, array or Python bool).

    `message` is a `str.format` template over `values` (arrays or numbers). Concrete:
    raises `ValueError(message.format(**values))` when false. Traced: a
    `checkify.debug_check` carrying the same message and values (nothing inside
    `traced_checks(False)`).
    """
    if is_traced(condition, values):
        if not _TRACED_CHECKS.value:
            return
        checkify.debug_check(jnp.asarray(condition), message,
                             **{name: jnp.asarray(value) for name, value in values.items()})
        return
    if not bool(np.asarray(condition)):
        raise ValueError(message.format(**{name: np.asarray(value).tolist()
                                           for name, value in values.items()}))


def first_true(mask):
    """Index of the first True in a 1-D boolean array (0 when there is none)."""
    return mask.argmax() if mask.shape[0] else 0


def as_index_scalar(value, name: str):
    """An int32 scalar from a Python int (as a NumPy scalar) or an integer 0-d array
    (traced or not)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if isinstance(value, (int, np.integer)):
        return np.int32(value)
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"{name} must be an integer or an integer scalar array, got "
                         f"{type(value).__name__}")
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer scalar, got an array of shape "
                         f"{tuple(value.shape)} and dtype {value.dtype}")
    return jnp.asarray(value, jnp.int32)


def as_index_vector(value, name: str, length: int | None = None):
    """An int32 1-D array from an integer array (traced or not) or a sequence of ints."""
    if not hasattr(value, "shape"):
        value = np.asarray(value)
        if value.size == 0:  # [] is float64 to NumPy
            value = value.astype(np.int32)
    if len(value.shape) != 1 or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got shape "
                         f"{tuple(value.shape)} and dtype {value.dtype}")
    if length is not None and value.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {value.shape[0]}")
    return jnp.asarray(value, jnp.int32)
