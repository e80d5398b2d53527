"""pallas_flex: FlexAttention for JAX.

Write an attention variant as `mask_mod(b, h, q_idx, kv_idx) -> bool` and/or
`score_mod(score, b, h, q_idx, kv_idx) -> score`; get fused, block-sparse Pallas
kernels:

    >>> import pallas_flex as pf
    >>> out = pf.attention(q, k, v, mask_mod=pf.masks.causal_mask)
"""

from pallas_flex import context_parallel, masks, paged, scores, variants
from pallas_flex.api import (
    BACKENDS, AuxOutput, AuxRequest, attention, default_backend, explain, flex_attention,
    merge_attention_states)
from pallas_flex.cascade import cascade_attention
from pallas_flex.context_parallel import ContextParallel, context_parallel_attention
from pallas_flex.fuse import explain_fuse, fuse
from pallas_flex.kernels.config import KernelOptions
from pallas_flex.masks.block_mask import BlockMask, create_block_mask
from pallas_flex.masks.combinators import and_masks, noop_mask, not_mask, or_masks

__version__ = "0.1.0"

__all__ = [
    "AuxOutput", "AuxRequest", "BACKENDS", "BlockMask", "ContextParallel", "KernelOptions",
    "and_masks", "attention", "create_block_mask", "cascade_attention", "context_parallel",
    "context_parallel_attention", "default_backend", "explain", "explain_fuse",
    "flex_attention", "fuse", "masks", "merge_attention_states", "noop_mask", "not_mask",
    "or_masks", "paged", "scores", "variants",
]
