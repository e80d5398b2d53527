"""Sliding-window (local) attention."""

import numbers

import jax.numpy as jnp

from pallas_flex.masks._per_batch import per_batch_scalar


def _check_window_size(window_size):
    """Raises ValueError when a Python int `window_size` is below 1."""
    if isinstance(window_size, numbers.Integral) and window_size < 1:
        raise ValueError(f"window_size must be at least 1, got {window_size}")


def _window_name(base_name, window_size):
    """`sliding_window_1024` for a constant window; the bare name for an array."""
    if isinstance(window_size, numbers.Integral):
        return f"{base_name}_{window_size}"
    return base_name


def sliding_window(window_size, *, causal=True):
    """A mask_mod keeping the keys within `window_size` positions of the query.

    * causal (default): kv_idx in (q_idx - window_size, q_idx], that is
      `0 <= q_idx - kv_idx < window_size`: the query and the `window_size - 1` keys
      before it, `window_size` keys in all (Mistral's convention).
    * causal=False: `|q_idx - kv_idx| < window_size`, `2 * window_size - 1` keys.

    Args:
      window_size: a Python int >= 1 (a compile-time constant), or, to change it without
        recompiling, a 0-d int array or an int array of shape [B] (one per batch row).
      causal: whether to drop the keys after the query.

    >>> mask_mod = sliding_window(3)
    >>> mask_mod.__name__
    'sliding_window_3'
    >>> [bool(mask_mod(0, 0, 5, kv)) for kv in range(7)]
    [False, False, False, True, True, True, False]
    """
    _check_window_size(window_size)
    read_window_size = per_batch_scalar(window_size, "window_size")

    if causal:

        def sliding_window_mask(b, h, q_idx, kv_idx):
            distance = q_idx - kv_idx
            return (distance >= 0) & (distance < read_window_size(b))

        sliding_window_mask.__name__ = _window_name("sliding_window", window_size)
    else:

        def sliding_window_mask(b, h, q_idx, kv_idx):
            return jnp.abs(q_idx - kv_idx) < read_window_size(b)

        sliding_window_mask.__name__ = (
            _window_name("sliding_window", window_size) + "_bidirectional"
        )
    return sliding_window_mask
