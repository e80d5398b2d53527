"""ALiBi (Press et al., 2022): a per-head linear penalty on the query-key distance."""

import math
import numbers

import jax.numpy as jnp


def _power_of_two_slopes(num_heads):
    first = 2.0 ** (-8.0 / num_heads)
    return [first ** (head + 1) for head in range(num_heads)]


def _slopes(num_heads):
    if num_heads & (num_heads - 1) == 0:
        return _power_of_two_slopes(num_heads)
    # The paper's rule for other head counts: the slopes of the largest power of two below,
    # then every other slope of the next power of two (the ones between those).
    closest_power_of_two = 2 ** math.floor(math.log2(num_heads))
    remaining = num_heads - closest_power_of_two
    return (
        _power_of_two_slopes(closest_power_of_two)
        + _slopes(2 * closest_power_of_two)[0::2][:remaining]
    )


def alibi_slopes(num_heads):
    """The standard ALiBi slopes: float32 array of shape [num_heads].

    For a power of two `n`, head `h` gets `2 ** (-8 * (h + 1) / n)`; other head counts
    follow the paper's interleaving rule (the reference implementation's `get_slopes`).

    >>> [float(slope) for slope in alibi_slopes(4)]
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    if not isinstance(num_heads, numbers.Integral) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
    return jnp.asarray(_slopes(int(num_heads)), dtype=jnp.float32)


def alibi(slopes):
    """A score_mod adding `slopes[h] * (kv_idx - q_idx)`: earlier keys are penalized in
    proportion to their distance (keys after the query get a bonus unless masked; combine
    with a causal mask as in the paper).

    Args:
      slopes: float array of shape [H] (one slope per query head; may be traced, e.g.
        learned), or a Python int H to use `alibi_slopes(H)`.

    >>> score_mod = alibi(8)
    >>> float(score_mod(0.0, 0, 0, 5, 3))  # head 0 has slope 1/2
    -1.0
    """
    if isinstance(slopes, numbers.Integral):
        slopes = alibi_slopes(slopes)
    slopes = jnp.asarray(slopes)
    if slopes.ndim != 1:
        raise ValueError(f"slopes must have shape [num_heads], got shape {slopes.shape}")

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * jnp.astype(kv_idx - q_idx, jnp.float32)

    alibi_score.__name__ = "alibi"
    return alibi_score
