"""Prefix-LM attention: bidirectional over a prefix, causal after it."""

import numbers

from pallas_flex.masks._per_batch import per_batch_scalar


def prefix_lm(prefix_length):
    """A mask_mod keeping every key of the prefix, and the causal keys after it.

    True where `kv_idx < prefix_length` or `q_idx >= kv_idx`.

    Args:
      prefix_length: a Python int (a compile-time constant), a 0-d int array, or an int
        array of shape [B] with one prefix length per batch row (read as
        `prefix_length[b]`); arrays change without recompiling.

    >>> mask_mod = prefix_lm(3)
    >>> mask_mod.__name__
    'prefix_lm_3'
    >>> [bool(mask_mod(0, 0, 1, kv)) for kv in range(5)]
    [True, True, True, False, False]
    >>> import jax.numpy as jnp
    >>> per_row = prefix_lm(jnp.array([0, 4]))
    >>> bool(per_row(0, 0, 1, 3)), bool(per_row(1, 0, 1, 3))
    (False, True)
    """
    read_prefix_length = per_batch_scalar(prefix_length, "prefix_length")

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < read_prefix_length(b)) | (q_idx >= kv_idx)

    if isinstance(prefix_length, numbers.Integral):
        prefix_lm_mask.__name__ = f"prefix_lm_{prefix_length}"
    else:
        prefix_lm_mask.__name__ = "prefix_lm"
    return prefix_lm_mask
