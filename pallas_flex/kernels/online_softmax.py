"""Online softmax in base 2, shared by the Pallas kernels and the XLA blockwise path.

Scores arrive already multiplied by log2(e), so `exp2` replaces `exp` (one MUFU op on
NVIDIA GPUs). Rows that have seen only masked scores keep `max = -inf`; subtracting a
stand-in 0 instead keeps `exp2(-inf - -inf)` from producing NaN, and such rows end as
zeros with `lse = -inf`.

An attention sink (`pallas_flex/sinks.py`) joins a row at the end as one more key with
no value (`with_sink`): its term enters the running sum, never the accumulator, so a
row with no key ends as zeros with `lse = sink`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def initial_state(block_q: int, value_dim: int):
    """(running max [block_q], running sum [block_q], accumulator [block_q, Dv])."""
    return (jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
            jnp.zeros((block_q, value_dim), jnp.float32))


def update(state, scores_log2, v, precision=None, *, logit_scale=None):
    """Folds one tile: scores_log2 [block_q, block_kv] (-inf where masked), v [block_kv, Dv].

    logit_scale: a positive Python float; when given, `scores_log2` are raw scores whose
    logits are `scores_log2 * logit_scale` (see `update_chunks`)."""
    running_max, running_sum, accumulator = state
    running_max, running_sum, (accumulator,) = update_chunks(
        (running_max, running_sum, (accumulator,)), scores_log2, (v,), precision,
        logit_scale=logit_scale)
    return running_max, running_sum, accumulator


def with_sink(running_max, running_sum, sink_log2):
    """(max, sum, accumulator factor) of a row after one more key with base-2 logit
    `sink_log2` (a scalar or a [block_q] vector) and no value: the running sum takes its
    exp2 and the accumulator only the rescaling by the new max (the factor, which the
    caller folds into its per-row division). The max moves to the sink where the sink is
    larger, so a sink far above every logit cannot overflow the sum; a sink of -inf
    changes nothing."""
    new_max = jnp.maximum(running_max, sink_log2)
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp2(running_max - safe_max)
    return new_max, running_sum * correction + jnp.exp2(sink_log2 - safe_max), correction


def finalize(state, sink_log2=None):
    """out [block_q, Dv] (float32) and natural-log lse [block_q]; with `sink_log2` (base 2,
    the scale folded in as for the scores), the sink takes part (`with_sink`)."""
    running_max, running_sum, accumulator = state
    (out,), lse = finalize_chunks((running_max, running_sum, (accumulator,)), sink_log2)
    return out, lse


def row_max(state):
    """The row maximum of the logits folded in (natural units; -inf for a row that saw
    only masked scores): the running max is kept in the exponent's base-2 units."""
    return state[0] * LN_2


def dot_precision(dtype, interpret: bool = True):
    """The dot precision of a kernel's tiles: 16-bit inputs need no hint; float32 inputs
    get float32-accurate dots, not one TF32 pass. In a GPU kernel that is three TF32
    tensor-core products (TF32_TF32_F32_X3, about 1e-6 relative error): Triton's
    IEEE float32 dot runs on the CUDA cores, unrolled, which took 30-45 s to compile a
    forward on the H100 at head dim 128 and spilled registers. Interpret mode and the
    XLA path (interpret=True) run on XLA's CPU dots, which have no TF32 algorithms."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    if interpret:
        return jax.lax.Precision.HIGHEST
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


# The same recurrence with the value dimension cut into column chunks (the decode kernel
# reads V as power-of-two column slices, so an unpadded Dv = 512 + 64 needs no copy).

def initial_state_chunks(block_q: int, value_chunks):
    """(running max, running sum, one accumulator [block_q, width] per chunk width)."""
    running_max, running_sum, _ = initial_state(block_q, 1)
    return running_max, running_sum, tuple(
        jnp.zeros((block_q, width), jnp.float32) for width in value_chunks)


def update_chunks(state, scores_log2, v_chunks, precision=None, *, logit_scale=None,
                  value_scale=None, accumulator_factor=None):
    """`update` for v given as column chunks [block_kv, width_i] (one accumulator each).

    value_scale: [1, block_kv] per-key scales of a quantized cache's values: P's columns
    are scaled before P.v (the row sums keep the unscaled P). With float16 values they
    are taken relative to a power of two near the tile's largest scale, given back after
    the dot, so that the largest P column is near 1 rather than at the scales'
    magnitude, where float16's subnormals (below 6.1e-5) would round it coarsely: values
    of magnitude 1e-4 in a float8 cache have scales near 2e-7, and P.v was off by 6 %
    (bfloat16 keeps 8 bits at any magnitude). That takes a reduction across warps and a
    multiply of each product; the decode kernel instead gives scales already divided by
    a power of two of its own and `accumulator_factor`, the ratio of the previous tile's
    power of two to this one's, which joins the accumulators' rescaling (its
    accumulators are kept in units of the last tile's power of two).

    With `logit_scale` (> 0) the scale is applied inside the exponent, `exp2(s * c - m)`,
    one fused multiply-add per score, and to the row maximum of the raw scores: for
    c > 0, max(s) * c rounds to exactly max(s * c). Multiplying every score first costs
    one more instruction per score, about a tenth of the loop's non-matmul work."""
    running_max, running_sum, accumulators = state
    if logit_scale is None:
        new_max = jnp.maximum(running_max, jnp.max(scores_log2, axis=1))
    else:
        new_max = jnp.maximum(running_max, jnp.max(scores_log2, axis=1) * logit_scale)
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp2(running_max - safe_max)
    if logit_scale is None:
        probabilities = jnp.exp2(scores_log2 - safe_max[:, None])
    else:
        probabilities = jnp.exp2(scores_log2 * logit_scale - safe_max[:, None])
    running_sum = running_sum * correction + jnp.sum(probabilities, axis=1)
    product_factor = None
    if value_scale is not None:
        if (accumulator_factor is None
                and any(jnp.dtype(v.dtype) == jnp.dtype(jnp.float16) for v in v_chunks)):
            shift = jnp.ceil(jnp.log2(jnp.maximum(jnp.max(value_scale), 2.0 ** -126)))
            value_scale = value_scale * jnp.exp2(-shift)
            product_factor = jnp.exp2(shift)
        probabilities = probabilities * value_scale
    accumulator_correction = (correction if accumulator_factor is None
                              else correction * accumulator_factor)

    def weighted_values(v):
        product = jax.lax.dot_general(
            probabilities.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32, precision=precision)
        return product if product_factor is None else product * product_factor
    accumulators = tuple(accumulator * accumulator_correction[:, None] + weighted_values(v)
                         for accumulator, v in zip(accumulators, v_chunks))
    return new_max, running_sum, accumulators


def finalize_chunks(state, sink_log2=None):
    """(one normalized output chunk per accumulator, natural-log lse); `sink_log2` as in
    `finalize`."""
    running_max, running_sum, accumulators = state
    correction = None
    if sink_log2 is not None:
        running_max, running_sum, correction = with_sink(running_max, running_sum, sink_log2)
    has_mass = running_sum > 0.0
    denominator = jnp.where(has_mass, running_sum, 1.0)
    if correction is None:
        outs = tuple(accumulator / denominator[:, None] for accumulator in accumulators)
    else:  # one factor per row: the rescaling to the sink's max and the division
        factor = (correction / denominator)[:, None]
        outs = tuple(accumulator * factor for accumulator in accumulators)
    safe_max = jnp.where(running_max == -jnp.inf, 0.0, running_max)
    lse = jnp.where(has_mass, (safe_max + jnp.log2(denominator)) * LN_2, -jnp.inf)
    return outs, lse


def merge_partials(partial_out, partial_lse, axis: int):
    """The exact merge of attention over disjoint key sets (the split-KV programs of the
    decode and ragged kernels): `partial_lse` (natural log, float32, -inf for a part with no
    keys) along `axis`, `partial_out` the parts' normalized outputs with the same axes
    and a trailing value axis. Returns (out, lse) with `axis` summed out; a row no part
    saw ends as zeros with lse = -inf."""
    lse = jax.nn.logsumexp(partial_lse, axis=axis)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weights = jnp.exp(partial_lse - jnp.expand_dims(safe, axis))  # exp(-inf) = 0
    return jnp.sum(weights[..., None] * partial_out, axis=axis), lse
