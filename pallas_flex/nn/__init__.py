"""Flax integration.

* `FlexMultiHeadAttention`: an `nnx.MultiHeadAttention`-shaped layer taking mods or a
  BlockMask at call time, with a per-row decode cache.
* `T5RelativeBias`, `LearnableAlibi`: learnable biases whose score_mods train through the
  attention backward.
* `make_attention_fn`: runs unmodified Flax attention modules on pallas_flex kernels.
"""

from pallas_flex.nn.attention_fn import make_attention_fn
from pallas_flex.nn.biases import LearnableAlibi, T5RelativeBias
from pallas_flex.nn.module import FlexMultiHeadAttention

__all__ = ["FlexMultiHeadAttention", "LearnableAlibi", "T5RelativeBias", "make_attention_fn"]
