"""Differential attention (Ye et al., "Differential Transformer", 2024).

    out = softmax(q1 k1^T * scale) v - lambda * softmax(q2 k2^T * scale) v

Two maps over the same keys' positions and values, subtracted, so that attention noise
common to both cancels. Built as two kernel calls that share one BlockMask (built once
from the mask_mod), rather than one fused pass: the two maps need their own running max
and sum, so a fused kernel saves only the second read of V (one of the four tensors a
step reads) while holding two accumulators; whether that pays is a GPU measurement
(issue 21), and the two-call form runs every kernel, backend and mod as it is.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_flex.api import _attention_block_mask, flex_attention


def differential_attention(q1, k1, q2, k2, v, lam, *, mask_mod=None, score_mod=None,
                           scale=None, backend=None, kernel_options=None):
    """`attention(q1, k1, v) - lam * attention(q2, k2, v)` with one BlockMask for both.

    Args:
      q1, q2: [B, Sq, Hq, D]; k1, k2: [B, Skv, Hkv, D]; v: [B, Skv, Hkv, Dv] (shared).
      lam: a float scalar or [Hq] array (one lambda per head); differentiable (the paper
        re-parametrizes it as exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init: compute that
        outside and pass the result).
      mask_mod, score_mod, scale, backend, kernel_options: as in `pf.attention`, the same
        for both maps (score_mod sees each map's own scores).
    Returns:
      [B, Sq, Hq, Dv] in q1's dtype (the difference taken in float32). The paper then
      normalizes each head (RMSNorm) and scales by (1 - lambda_init): model code.
    """
    if q1.shape != q2.shape or k1.shape != k2.shape:
        raise ValueError(f"q1/q2 and k1/k2 must have equal shapes, got {q1.shape}, "
                         f"{q2.shape} and {k1.shape}, {k2.shape}")
    lam = jnp.asarray(lam)
    if lam.shape not in ((), (q1.shape[2],)) or not jnp.issubdtype(lam.dtype, jnp.floating):
        raise ValueError(f"lam must be a float scalar or an array [{q1.shape[2]}] (one per "
                         f"query head), got shape {lam.shape} and dtype {lam.dtype}")
    block_mask = _attention_block_mask(q1, k1, v, mask_mod, None, kernel_options)
    options = dict(scale=scale, backend=backend, kernel_options=kernel_options)
    first = flex_attention(q1, k1, v, score_mod, block_mask, **options)
    second = flex_attention(q2, k2, v, score_mod, block_mask, **options)
    lam = lam.astype(jnp.float32).reshape((-1, 1) if lam.ndim else ())
    out = first.astype(jnp.float32) - lam * second.astype(jnp.float32)
    return out.astype(q1.dtype)
