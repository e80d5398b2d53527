"""Attention sinks: a logit per head that takes part in every row's softmax but has no
value (gpt-oss; StreamingLLM's sink tokens as one learned number).

A row's weights become `exp(s_i) / (sum_j exp(s_j) + exp(sink_h))`: the sink is one more
key whose value is zero. The forward kernels (Triton, Mosaic GPU, the XLA blockwise
loop) add it where they finish a row: the running sum takes `exp2(sink_h * log2(e) - m)`
in their base-2 units (`online_softmax.with_sink`), so the output and the lse they write
already include it, at no cost beyond a few operations per row; the dense "reference"
backend adds it as one more column. A row whose keys are all masked gives zeros and
lse = sink_h.

The backward needs nothing of its own for q, k, v: given that output and lse, its
P = exp(s - lse) are the sinked weights, and with a zero value the sink's column drops
out of dV, dQ and dK. The sinks' gradient (`sink_gradient`) follows from
lse = logaddexp(lse_keys, sink_h) and out = out_keys * exp(lse_keys - lse):

    d sink_h = sum over rows of exp(sink_h - lse) * (d_lse - rowsum(d_out * out))
             = -sum over rows of exp(sink_h - lse) * delta,

with delta = rowsum(d_out * out) - d_lse the backward kernels' own (`kernels/backward.py`
`prepare_operands`); the sum runs over batch rows and queries of head h. (A fully masked
row has out = 0 and lse = sink_h: its part is d_lse.)

Calls served by other kernels, whose outputs have no sink yet (the split-KV decode
kernel, a paged cache, the ragged op, context parallelism's merged ring, an 8-bit
cache), take it afterwards with `merge_sinks`: one elementwise pass over the output,

    out_with_sink = out * exp(lse - lse_with_sink),   lse_with_sink = logaddexp(lse, sink_h),

the sink merged exactly as one more part (as `merge_attention_states` merges two key
sets), differentiated by autodiff where those calls have gradients.
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


def sink_gradient(sinks, out, lse, d_out, d_lse=None):
    """The gradient of the sinks [H] from a sinked call's out [B, Sq, H, Dv], lse
    [B, H, Sq] and their cotangents (d_lse None: zero); see the module docstring.

    delta is spelled as `kernels/backward.py` spells it, so that under `jit` XLA computes
    it once for both (one read of d_out and out)."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=3)
    delta = jnp.transpose(delta, (0, 2, 1))
    if d_lse is not None:
        delta = delta - d_lse
    sink = sinks.astype(jnp.float32)[None, :, None]
    # The sink's weight in each row, exp(sink - lse) <= 1; 0 where the row has no mass
    # at all (a sink of -inf on a fully masked row).
    weight = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(sink - lse))
    return (-jnp.sum(weight * delta, axis=(0, 2))).astype(sinks.dtype)
