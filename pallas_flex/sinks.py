"""Attention sinks: a logit per head that takes part in every row's softmax but has no
value (gpt-oss; StreamingLLM's sink tokens as one learned number).

A row's weights become `exp(s_i) / (sum_j exp(s_j) + exp(sink_h))`, so

    out_with_sink = out * exp(lse - lse_with_sink),   lse_with_sink = logaddexp(lse, sink_h)

from the kernels' own (out, lse): the sink is one more part merged exactly, as
`merge_attention_states` merges two key sets (a part with no value). It costs one
elementwise pass over the output, the kernels are unchanged, and gradients (of q, k, v
through the kernels' backward with the lse's cotangent, and of the sinks) come from
autodiff of the merge. A row whose keys are all masked gives zeros and lse = sink_h.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_sinks(sinks, q_heads: int):
    """`sinks` as given, if it is a float array [Hq]; else a ValueError."""
    if sinks is None:
        return None
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise ValueError(f"sinks must be a float array [{q_heads}] (one logit per query "
                         f"head), got {type(sinks).__name__}")
    if tuple(sinks.shape) != (q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be a float array [{q_heads}] (one logit per query "
                         f"head), got shape {tuple(sinks.shape)} and dtype {sinks.dtype}")
    return sinks


def merge_sinks(out, lse, sinks, *, head_axis_of_out=2, head_axis_of_lse=1):
    """(out, lse) of attention with the sinks taking part: out [..., H, Dv] (heads at
    `head_axis_of_out`), lse float32 with heads at `head_axis_of_lse` and the same other
    axes as out's leading ones, in some order; sinks [H]."""
    lse = lse.astype(jnp.float32)
    shape = [1] * lse.ndim
    shape[head_axis_of_lse] = -1
    lse_with_sink = jnp.logaddexp(lse, sinks.astype(jnp.float32).reshape(shape))
    weight = jnp.exp(lse - lse_with_sink)  # 0 where lse is -inf (no key)
    weight = jnp.moveaxis(weight, head_axis_of_lse, -1)  # [..., H]
    weight = jnp.moveaxis(weight, -1, head_axis_of_out)[..., None]
    return (out.astype(jnp.float32) * weight).astype(out.dtype), lse_with_sink
