"""Read a scalar option (an offset, a prefix length, a window size) inside a mod, either as
a compile-time constant, as one traced value, or as one value per batch row."""

import numbers

import jax.numpy as jnp


def per_batch_scalar(value, argument_name):
    """Returns `read(b)`: the value that batch row `b` sees.

    Args:
      value: a Python int (baked into the compiled kernel as a constant), a 0-d integer
        array (read as is, so new values do not recompile) or an integer array of shape
        [B] (batch row `b` reads `value[b]`).
      argument_name: the public argument's name, for error messages.
    """
    if isinstance(value, numbers.Integral):
        constant = int(value)
        return lambda b: constant
    array = jnp.asarray(value)
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise ValueError(
            f"{argument_name} must be an int or an integer array, got dtype {array.dtype}"
        )
    if array.ndim == 0:
        return lambda b: array
    if array.ndim == 1:
        return lambda b: array[b]
    raise ValueError(
        f"{argument_name} must be an int, a 0-d array or a [B] array, got shape {array.shape}"
    )
