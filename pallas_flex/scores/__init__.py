"""Score mods (one concept per file): `score_mod(score, b, h, q_idx, kv_idx) -> score`.

Generators return closures. `pallas_flex.masks` re-exports them (`pf.masks.alibi` is
`pf.scores.alibi`), beside the mask mods and their combinators.
"""

from pallas_flex.scores.alibi import alibi, alibi_slopes
from pallas_flex.scores.bias import bias_lookup
from pallas_flex.scores.relative_position import relative_position
from pallas_flex.scores.softcap import tanh_softcap
from pallas_flex.scores.t5_bias import t5_relative_bias, t5_relative_bucket

__all__ = ["alibi", "alibi_slopes", "bias_lookup", "relative_position", "t5_relative_bias",
           "t5_relative_bucket", "tanh_softcap"]
