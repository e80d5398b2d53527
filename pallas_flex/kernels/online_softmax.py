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

def initial_state_chunks(block_q: int, value_chunks, value_shift: bool = False):
    """(running max, running sum, one accumulator [block_q, width] per chunk width), and
    with `value_shift` the accumulators' power of two (log2; see `update_chunks`)."""
    running_max, running_sum, _ = initial_state(block_q, 1)
    state = running_max, running_sum, tuple(
        jnp.zeros((block_q, width), jnp.float32) for width in value_chunks)
    return state + (jnp.float32(0.0),) if value_shift else state


def update_chunks(state, scores_log2, v_chunks, precision=None, *, logit_scale=None,
                  value_scale=None, value_scale_reference=None):
    """`update` for v given as column chunks [block_kv, width_i] (one accumulator each).

    value_scale: [1, block_kv] per-key scales of a quantized cache's values: P's columns
    are scaled before P.v (the row sums keep the unscaled P). A state with a value
    shift (`initial_state_chunks(value_shift=True)`, for float16 P.v) takes them
    relative to a power of two near the tile's: its first scale where the kernel loads
    it as a scalar (`value_scale_reference`, the decode; 0 for a row past the length),
    else its largest (a reduction across warps). Its accumulators are kept in units of
    the last tile's power of two (the change joins their rescaling, so the products
    still add in place) and `finalize_chunks` gives it back. Without it the largest P
    column sits at the scales' magnitude, where float16's subnormals (below 6.1e-5)
    round it coarsely: values of magnitude 1e-4 in a float8 cache have scales near
    2e-7, and P.v was off by 6 % (bfloat16 keeps 8 bits at any magnitude).

    With `logit_scale` (> 0) the scale is applied inside the exponent, `exp2(s * c - m)`,
    one fused multiply-add per score, and to the row maximum of the raw scores: for
    c > 0, max(s) * c rounds to exactly max(s * c). Multiplying every score first costs
    one more instruction per score, about a tenth of the loop's non-matmul work."""
    (running_max, running_sum, accumulators), shifted = state[:3], state[3:]
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
    accumulator_correction = correction
    if shifted:
        reference = (jnp.max(value_scale) if value_scale_reference is None
                     else value_scale_reference)
        # (a tile with no valid key has scales of 0: the power of two stays)
        shift = jnp.where(reference > 0.0,
                          jnp.ceil(jnp.log2(jnp.maximum(reference, 2.0 ** -126))), shifted[0])
        value_scale = value_scale * jnp.exp2(-shift)
        accumulator_correction = correction * jnp.exp2(shifted[0] - shift)
        shifted = (shift,)
    if value_scale is not None:
        probabilities = probabilities * value_scale
    accumulators = tuple(
        accumulator * accumulator_correction[:, None] + jax.lax.dot_general(
            probabilities.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32, precision=precision)
        for accumulator, v in zip(accumulators, v_chunks))
    return (new_max, running_sum, accumulators) + shifted


def finalize_chunks(state, sink_log2=None):
    """(one normalized output chunk per accumulator, natural-log lse); `sink_log2` as in
    `finalize`; a value shift (`update_chunks`) given back."""
    (running_max, running_sum, accumulators), shifted = state[:3], state[3:]
    if shifted:
        accumulators = tuple(accumulator * jnp.exp2(shifted[0])
                             for accumulator in accumulators)
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
