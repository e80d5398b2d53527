"""Linear relative-position bias: scores grow (or shrink) with the key's offset."""

import numbers

import jax.numpy as jnp


def relative_position(scale=1.0):
    """A score_mod adding `scale * (kv_idx - q_idx)`.

    Args:
      scale: a Python float (a compile-time constant) or a 0-d float array (read as is:
        new values do not recompile, and a traced scale gets its gradient).

    >>> score_mod = relative_position(0.5)
    >>> float(score_mod(1.0, 0, 0, 6, 2))
    -1.0
    """
    if not isinstance(scale, numbers.Real):
        scale = jnp.asarray(scale, dtype=jnp.float32)
        if scale.ndim != 0:
            raise ValueError(f"scale must be a scalar, got shape {scale.shape}")

    def relative_position_score(score, b, h, q_idx, kv_idx):
        return score + scale * jnp.astype(kv_idx - q_idx, jnp.float32)

    relative_position_score.__name__ = "relative_position"
    return relative_position_score
