"""Attention variants past the mask_mod / score_mod template, built on the kernels.

* `differential_attention`: two softmax maps subtracted with a learnable lambda, sharing
  V (Differential Transformer).
* `gated_self_attention`: AlphaFold's Evoformer row/column attention: a pair bias shared
  by every MSA row, a per-key bias, a sigmoid gate on the output.

Attention sinks are an argument of the entry points themselves (`sinks=`).
"""

from pallas_flex.variants.differential import differential_attention
from pallas_flex.variants.gated import gated_self_attention

__all__ = ["differential_attention", "gated_self_attention"]
