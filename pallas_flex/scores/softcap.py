"""Tanh soft-capping of scores (Gemma 2, Grok): `soft_cap * tanh(score / soft_cap)`."""

import math
import numbers

import jax.numpy as jnp

_LOG2_E = math.log2(math.e)
# Below this |x| the odd Taylor polynomial of tanh (to x**7) is accurate to ~6e-8
# relative; above it, the exp2 form's cancellation error is at most ~2e-7 relative.
_POLYNOMIAL_LIMIT = 0.2


def tanh_with_exp2(x):
    """tanh(x) from one exp2, a division and a short polynomial, for kernels where exp2 is
    a fast hardware instruction and tanh is a library call.

    For |x| >= 0.2: tanh|x| = (1 - t) / (1 + t) with t = exp2(-2|x| log2 e) in (0, 1], which
    never overflows and tends to 1 as |x| grows. Near 0 that form loses relative accuracy
    (1 - t cancels), so there tanh x = x - x^3/3 + 2x^5/15 - 17x^7/315 is used instead.
    Maximum relative error ~2.5e-7 in float32 (measured against float64 tanh).
    """
    magnitude = jnp.abs(x)
    t = jnp.exp2(magnitude * (-2.0 * _LOG2_E))
    tanh_magnitude = (1.0 - t) / (1.0 + t)
    exp2_form = jnp.where(x < 0, -tanh_magnitude, tanh_magnitude)
    x_squared = x * x
    polynomial = x * (
        1.0 + x_squared * (-1.0 / 3.0 + x_squared * (2.0 / 15.0 + x_squared * (-17.0 / 315.0)))
    )
    return jnp.where(magnitude < _POLYNOMIAL_LIMIT, polynomial, exp2_form)


def tanh_softcap(soft_cap, *, approx=False):
    """A score_mod returning `soft_cap * tanh(score / soft_cap)`, squashing scores into
    (-soft_cap, soft_cap).

    Args:
      soft_cap: a positive Python float (a compile-time constant) or a 0-d float array
        (read as is, so new values do not recompile).
      approx: compute tanh from exp2 (see `tanh_with_exp2`: a polynomial near 0, the
        exp2 form elsewhere) instead of `jnp.tanh`; the same function to ~2.5e-7 relative
        error in float32.

    >>> score_mod = tanh_softcap(30.0)
    >>> score_mod.__name__
    'tanh_softcap_30.0'
    >>> round(float(score_mod(1000.0, 0, 0, 0, 0)), 4)
    30.0
    """
    if isinstance(soft_cap, numbers.Real):
        if soft_cap <= 0:
            raise ValueError(f"soft_cap must be positive, got {soft_cap}")
        name = f"tanh_softcap_{float(soft_cap)}"
        soft_cap = float(soft_cap)
    else:
        soft_cap = jnp.asarray(soft_cap, dtype=jnp.float32)
        if soft_cap.ndim != 0:
            raise ValueError(f"soft_cap must be a scalar, got shape {soft_cap.shape}")
        name = "tanh_softcap"
    tanh = tanh_with_exp2 if approx else jnp.tanh

    def softcap_score(score, b, h, q_idx, kv_idx):
        return soft_cap * tanh(score / soft_cap)

    softcap_score.__name__ = name + "_approx" if approx else name
    return softcap_score
