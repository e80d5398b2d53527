"""`make_attention_fn`: a drop-in `attention_fn` for Flax attention modules.

`nnx.MultiHeadAttention(..., attention_fn=make_attention_fn(mask_mod=...))` (or linen's
`MultiHeadDotProductAttention`) then runs pallas_flex kernels with no other change to the
model code. Flax's keywords are accepted: a dense boolean `mask` (broadcastable to
`[B, H, Sq, Skv]`) and an additive `bias` become captured arrays of the mask/score mods,
`is_causal` adds the causal mask, and dropout is refused (the kernels have none).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_flex.api import attention
from pallas_flex.masks.combinators import and_masks
from pallas_flex.masks.causal import causal_mask


def _broadcast_reader(array, name, batch, heads, q_len, kv_len):
    """Reads array[b, h, q, kv] of a [B|1, H|1, Sq|1, Skv|1] array (leading dims added)."""
    array = jnp.asarray(array)
    if array.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims [B, H, Sq, Skv], got {array.shape}")
    array = array.reshape((1,) * (4 - array.ndim) + array.shape)
    for size, full, axis in zip(array.shape, (batch, heads, q_len, kv_len), "B H Sq Skv".split()):
        if size not in (1, full):
            raise ValueError(f"{name} of shape {array.shape} does not broadcast to "
                             f"[B, H, Sq, Skv] = {(batch, heads, q_len, kv_len)} (axis {axis})")
    use = [size != 1 for size in array.shape]

    def read(b, h, q_idx, kv_idx):
        indices = [index if keep else 0 for index, keep in zip((b, h, q_idx, kv_idx), use)]
        return array[tuple(indices)]

    return read


def make_attention_fn(mask_mod=None, score_mod=None, **options):
    """Returns `attention_fn(query, key, value, bias=None, mask=None, **flax_keywords)`.

    Args:
      mask_mod, score_mod: mods applied on top of whatever the module passes.
      options: keyword arguments of `pallas_flex.attention` (backend, scale,
        kernel_options).
    Differences from Flax's `dot_product_attention`: a query row whose mask is all False
    gives zeros (Flax gives the mean of the values); dropout and `module` (weight
    sowing) are not supported and raise ValueError.
    """

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                     dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                     precision=None, module=None, is_causal=False, **unused):
        del broadcast_dropout, dropout_rng, precision, unused
        if dropout_rate > 0.0 and not deterministic:
            raise ValueError("dropout_rate > 0 is not supported by pallas_flex kernels; set "
                             "dropout_rate=0 or deterministic=True")
        if module is not None:
            raise ValueError("module (sow_weights) is not supported: the kernels never "
                             "materialize attention weights")
        if query.ndim != 4:
            raise ValueError(f"query must be [B, S, H, D] (one batch dim), got {query.shape}")
        if dtype is not None:
            query, key, value = (x.astype(dtype) for x in (query, key, value))
        batch, q_len, heads, _ = query.shape
        kv_len = key.shape[1]
        masks = [m for m in (mask_mod,) if m is not None]
        if is_causal:
            masks.append(causal_mask)
        if mask is not None:
            read_mask = _broadcast_reader(mask.astype(jnp.bool_), "mask", batch, heads, q_len,
                                          kv_len)
            masks.append(lambda b, h, q_idx, kv_idx: read_mask(b, h, q_idx, kv_idx))
        combined_mask = and_masks(*masks) if masks else None
        combined_score = score_mod
        if bias is not None:
            read_bias = _broadcast_reader(bias.astype(jnp.float32), "bias", batch, heads,
                                          q_len, kv_len)
            inner = score_mod

            def combined_score(score, b, h, q_idx, kv_idx):
                modded = inner(score, b, h, q_idx, kv_idx) if inner is not None else score
                return modded + read_bias(b, h, q_idx, kv_idx)
        return attention(query, key, value, mask_mod=combined_mask, score_mod=combined_score,
                         **options)

    return attention_fn
