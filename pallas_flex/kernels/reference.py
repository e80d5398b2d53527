"""Dense attention with mods: the oracle for tests and the `"reference"` backend.

Materializes the full `[B, H, Sq, Skv]` score matrix, so it is for small shapes only.
Computes in float32, or in float64 when given float64 inputs under `jax.enable_x64`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_flex.masks.mod_program import vmap_mask, vmap_score


def _dense_over_batch_and_heads(function, batch, heads):
    over_heads = jax.vmap(function, in_axes=(None, 0))
    return jax.vmap(over_heads, in_axes=(0, None))(
        jnp.arange(batch, dtype=jnp.int32), jnp.arange(heads, dtype=jnp.int32))


def reference_attention(q, k, v, *, mask_mod=None, score_mod=None, scale=None,
                        return_max=False, sinks=None):
    """Dense `softmax(mask(score_mod(q k^T * scale))) v`.

    Args:
      q: [B, Sq, Hq, D]; k: [B, Skv, Hkv, D]; v: [B, Skv, Hkv, Dv], Hq a multiple of Hkv.
      mask_mod, score_mod: callables with scalar semantics (or traced ModPrograms).
      sinks: None, or [Hq]: a logit per query head in every row's softmax with no value
        (`pallas_flex/sinks.py`).
    Returns:
      out [B, Sq, Hq, Dv] in the compute dtype, lse [B, Hq, Sq] (natural log), and with
      return_max the row max of the logits [B, Hq, Sq] (the sinks not included). Fully
      masked rows give zeros, lse = -inf (the sink's logit with sinks) and max = -inf.
    """
    compute_dtype = jnp.promote_types(q.dtype, jnp.float32)
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // kv_heads
    q, k, v = (x.astype(compute_dtype) for x in (q, k, v))
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    q_idx = jnp.arange(q_len, dtype=jnp.int32)
    kv_idx = jnp.arange(kv_len, dtype=jnp.int32)
    if score_mod is not None:
        score_fn = vmap_score(score_mod)
        scores = _dense_over_batch_and_heads(
            lambda b, h: score_fn(scores[b, h], b, h, q_idx, kv_idx), batch, q_heads)
        scores = scores.astype(compute_dtype)
    if mask_mod is not None:
        mask_fn = vmap_mask(mask_mod)
        mask = _dense_over_batch_and_heads(lambda b, h: mask_fn(b, h, q_idx, kv_idx),
                                           batch, q_heads)
        scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    logits_max = row_max[..., 0]
    if sinks is not None:  # one more column of the softmax, with no value
        sink = sinks.astype(compute_dtype)[None, :, None, None]
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        row_sum = row_sum + jnp.exp(sink - row_max)
    probabilities = jnp.where(row_sum > 0, weights / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", probabilities, v, precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(row_sum[..., 0] > 0, jnp.log(row_sum[..., 0]) + row_max[..., 0], -jnp.inf)
    return (out, lse, logits_max) if return_max else (out, lse)
