"""A dense additive bias read inside the kernel (an arbitrary learned or given bias)."""

import jax.numpy as jnp


def bias_lookup(bias):
    """A score_mod adding `bias[b, h, q_idx, kv_idx]`.

    Args:
      bias: float array of shape [B, H, Sq, Skv]; B and/or H may be 1, meaning one bias
        shared by every batch row / head (read at index 0 there). The bias is a kernel
        input, so a traced bias gets its gradient.

    >>> import jax.numpy as jnp
    >>> bias = jnp.arange(6, dtype=jnp.float32).reshape(1, 1, 2, 3)
    >>> score_mod = bias_lookup(bias)
    >>> float(score_mod(0.5, 3, 7, 1, 2))  # any batch row and head read bias[0, 0]
    5.5
    """
    bias = jnp.asarray(bias)
    if bias.ndim != 4:
        raise ValueError(f"bias must have shape [B, H, Sq, Skv], got shape {bias.shape}")
    batch_is_shared = bias.shape[0] == 1
    head_is_shared = bias.shape[1] == 1

    def bias_score(score, b, h, q_idx, kv_idx):
        batch_index = 0 if batch_is_shared else b
        head_index = 0 if head_is_shared else h
        return score + bias[batch_index, head_index, q_idx, kv_idx]

    bias_score.__name__ = "bias_lookup"
    return bias_score
