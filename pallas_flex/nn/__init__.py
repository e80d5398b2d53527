"""Flax integration (DESIGN §5). `make_attention_fn` runs unmodified Flax attention
modules on pallas_flex kernels; the FlexMultiHeadAttention layer is still to come."""

from pallas_flex.nn.attention_fn import make_attention_fn

__all__ = ["make_attention_fn"]
