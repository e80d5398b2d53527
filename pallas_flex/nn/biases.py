"""Learnable attention biases as `flax.nnx` modules.

Each module owns its parameter and hands out a score_mod that closes over the
parameter's current value. pallas_flex treats arrays a mod captures as kernel inputs and
differentiates them, so `nnx.grad` of a loss trains the parameter straight through the
fused attention backward:

    >>> bias = T5RelativeBias(num_heads=4, rngs=nnx.Rngs(0))
    >>> out = pf.attention(q, k, v, mask_mod=pf.masks.causal_mask, score_mod=bias())

or, inside a layer, `FlexMultiHeadAttention(..., score_bias=bias)`. The bucketing and
slope rules are those of `pallas_flex.scores.t5_bias` and `pallas_flex.scores.alibi`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

from pallas_flex.scores.alibi import alibi, alibi_slopes
from pallas_flex.scores.t5_bias import t5_relative_bias


class T5RelativeBias(nnx.Module):
    """T5's bucketed relative-position bias, one learned scalar per (query head, bucket).

    Args:
      num_heads: query heads H.
      num_buckets, max_distance, bidirectional: as in `pallas_flex.masks.t5_relative_bucket`
        (bidirectional for encoders, False for causal decoders).
      param_dtype: dtype of the table (float32 by default; the kernels add it to float32
        scores).
      embedding_init: initializer of the table (T5 draws it from a normal distribution).
      rngs: `nnx.Rngs` with a `params` stream.

    Attributes:
      table: `nnx.Param` of shape [num_heads, num_buckets].

    Calling the module (or `.score_mod()`) returns the score_mod
    `score + table[h, bucket(kv_idx - q_idx)]`.
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, *, param_dtype=jnp.float32,
                 embedding_init=initializers.normal(stddev=1.0), rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.table = nnx.Param(embedding_init(rngs.params(), (num_heads, num_buckets),
                                              param_dtype))
        self.score_mod()  # validates num_buckets and max_distance now, not at first call

    def score_mod(self):
        """score_mod(score, b, h, q_idx, kv_idx) adding the table's bias."""
        return t5_relative_bias(self.table[...], num_buckets=self.num_buckets,
                                max_distance=self.max_distance,
                                bidirectional=self.bidirectional)

    def __call__(self):
        return self.score_mod()


class LearnableAlibi(nnx.Module):
    """ALiBi with one learnable slope per query head, starting from the paper's slopes.

    Args:
      num_heads: query heads H.
      param_dtype: dtype of the slopes (float32 by default).
      rngs: accepted for a uniform constructor; unused (the initial slopes are fixed).

    Attributes:
      slopes: `nnx.Param` of shape [num_heads], initialized to `alibi_slopes(num_heads)`.

    Calling the module (or `.score_mod()`) returns the score_mod
    `score + slopes[h] * (kv_idx - q_idx)`.
    """

    def __init__(self, num_heads: int, *, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        del rngs
        self.num_heads = num_heads
        self.slopes = nnx.Param(alibi_slopes(num_heads).astype(param_dtype))

    def score_mod(self):
        """score_mod(score, b, h, q_idx, kv_idx) adding the learned linear penalty."""
        return alibi(self.slopes[...])

    def __call__(self):
        return self.score_mod()
