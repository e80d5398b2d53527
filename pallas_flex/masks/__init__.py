"""Mask mods (one concept per file), their combinators, and the BlockMask.

Mask mods: `mask_mod(b, h, q_idx, kv_idx) -> bool`. Generators return closures. The score
mods (`score_mod(score, b, h, q_idx, kv_idx) -> score`) live in `pallas_flex.scores`;
this module re-exports them, so `pf.masks.alibi` is `pf.scores.alibi`.
"""

from pallas_flex.masks.block_mask import BlockMask, create_block_mask
from pallas_flex.masks.causal import causal_mask
from pallas_flex.masks.chunked import chunked_causal
from pallas_flex.masks.combinators import and_masks, noop_mask, noop_score, not_mask, or_masks
from pallas_flex.masks.dilated import dilated_sliding_window
from pallas_flex.masks.document import document, document_mask, document_mask_from_offsets
from pallas_flex.masks.mod_program import ModProgram, make_mod_program
from pallas_flex.masks.neighborhood import (
    morton_neighborhood_2d, neighborhood_2d, tiled_neighborhood_2d)
from pallas_flex.masks.offset import offset, offset_score
from pallas_flex.masks.prefix_lm import prefix_lm
from pallas_flex.masks.sliding_window import sliding_window
from pallas_flex.scores import (
    alibi, alibi_slopes, bias_lookup, relative_position, t5_relative_bias, t5_relative_bucket,
    tanh_softcap)

__all__ = [
    "BlockMask", "ModProgram", "alibi", "alibi_slopes", "and_masks", "bias_lookup",
    "causal_mask", "chunked_causal", "create_block_mask", "dilated_sliding_window", "document",
    "document_mask", "document_mask_from_offsets", "make_mod_program", "morton_neighborhood_2d",
    "neighborhood_2d", "noop_mask", "noop_score", "not_mask", "offset", "offset_score",
    "or_masks", "prefix_lm", "relative_position", "sliding_window", "t5_relative_bias",
    "t5_relative_bucket", "tanh_softcap", "tiled_neighborhood_2d",
]
