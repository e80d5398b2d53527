"""Value checks that are ValueErrors on concrete values and checkify checks when traced.

Paged metadata (page tables, lengths, begins) is data: eagerly it is concrete and a bad
value can be reported at once, but inside `jax.jit` it is traced and nothing can be
raised. There the same check becomes a `checkify.debug_check`: free (a no-op) under a
plain `jit`, and reported with the same message when the caller wraps the function in
`jax.experimental.checkify.checkify`. (A plain `checkify.check` would make every
un-checkified `jit` of these functions fail to trace.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


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
    `checkify.debug_check` carrying the same message and values.
    """
    if is_traced(condition, values):
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
