"""FlexAttention over contiguous int8 / float8 K/V (a quantized KV cache not paged).

`pf.flex_attention(q, k, v, ..., k_scales=, v_scales=)` with k [B, Skv, Hkv, D] and v
[B, Skv, Hkv, Dv] stored as int8 or float8_e4m3fn and float32 scales [B, Skv, Hkv] (one
per token and head, as `pallas_flex.paged.quantize.quantize` makes them): the keys and
values are `k * k_scales[..., None]`, `v * v_scales[..., None]`.

Decode (Sq <= decode_max_q_len in one BlockMask query block) on "pallas" / "interpret"
runs the split-KV decode kernel on the 8-bit values as they lie, applying the scales as
it does for a quantized paged cache: a key's scale multiplies its score column after
q.k, a value's the probability column before P.v (half the bytes read of a 16-bit
cache). Anything else (longer queries, where reading K/V is not the bottleneck; the
"xla" and "reference" backends) attends over a dequantized copy in q's dtype. Inference
only, like the paged cache: differentiating raises a ValueError.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flex import api, dispatch, sharding
from pallas_flex.kernels.decode import flex_decode
from pallas_flex.paged.quantize import dequantize, is_quantized
from pallas_flex.sinks import check_sinks, merge_sinks


def is_quantized_call(k, v, k_scales, v_scales) -> bool:
    """Whether a flex_attention call is one over quantized K/V (scales given, or 8-bit
    K/V, which then need them)."""
    return (k_scales is not None or v_scales is not None
            or is_quantized(getattr(k, "dtype", jnp.float32))
            or is_quantized(getattr(v, "dtype", jnp.float32)))


def _validate(q, k, v, k_scales, v_scales):
    for name, x in (("k", k), ("v", v)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-D array [B, S, H, D], got shape "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if k.dtype != v.dtype or not is_quantized(k.dtype):
        raise ValueError(f"with k_scales / v_scales, k and v must both be int8 or "
                         f"float8_e4m3fn, got {k.dtype} and {v.dtype}")
    expected = tuple(k.shape[:3])
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if (x is None or tuple(getattr(x, "shape", ())) != expected
                or jnp.dtype(x.dtype) != jnp.float32):
            raise ValueError(f"{name} must be float32 [B, Skv, Hkv] = {list(expected)} for "
                             f"{k.dtype} k and v, got "
                             f"{None if x is None else (getattr(x, 'shape', x), x.dtype)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k and v must have the same [B, Skv, Hkv], got {list(k.shape[:3])} "
                         f"and {list(v.shape[:3])}")


def flex_attention(q, k, v, k_scales, v_scales, score_mod=None, block_mask=None, *,
                   scale=None, return_lse=False, backend=None, kernel_options=None,
                   sinks=None, return_aux=None):
    """`pf.flex_attention` over quantized k, v (its arguments; see the module)."""
    _validate(q, k, v, k_scales, v_scales)
    with_max = api.check_aux(return_aux, return_lse)
    # Checked as the 16-bit K/V of q's dtype they stand for.
    block_mask, score_program, config = api._prepare(
        q, *(jax.ShapeDtypeStruct(x.shape, q.dtype) for x in (k, v)), score_mod, block_mask,
        scale, backend, kernel_options)
    out, lse, *row_max = _quantized_attention_jit(
        q, k, v, k_scales, v_scales, block_mask, score_program,
        check_sinks(sinks, q.shape[2]), config=(config, with_max))
    return api.call_results(out, lse, row_max, return_lse, return_aux)


def _quantized_attention_impl(q, k, v, k_scales, v_scales, block_mask, score_program,
                              config):
    (backend, scale, options), with_max = config
    if backend in ("pallas", "interpret") and dispatch.uses_decode_kernel(
            q.shape[1], block_mask, options):
        def attend(operands, offsets):
            q, k, v, k_scales, v_scales, block_mask, score_program = operands
            block_mask, score_program, _ = sharding.shift_mods(block_mask, score_program,
                                                               offsets)
            return flex_decode(q, k, v, block_mask, score_program, scale=scale,
                               options=options, interpret=backend == "interpret",
                               with_max=with_max, k_scales=k_scales, v_scales=v_scales)

        # Scales [B, Skv, Hkv] split as K/V are (batch and KV heads).
        return sharding.call(
            attend, (q, k, v, k_scales, v_scales, block_mask, score_program),
            (sharding.QUERY,) + (sharding.KEY,) * 4 + (sharding.roles_of(block_mask, None),
                                                       sharding.WHOLE),
            sharding.query_and_rows,
            batch=q.shape[0], q_heads=q.shape[2], kv_heads=k.shape[2])
    k, v = dequantize(k, k_scales, q.dtype), dequantize(v, v_scales, q.dtype)
    return api._attention(q, k, v, block_mask, score_program, config=config[0],
                          with_max=with_max)


_quantized_attention = jax.custom_vjp(_quantized_attention_impl, nondiff_argnums=(7,))


def _no_gradients(*args):
    raise ValueError("flex_attention over quantized (int8 / float8) k and v is for "
                     "inference and has no gradients")


_quantized_attention.defvjp(lambda *args: (_quantized_attention_impl(*args), None),
                            _no_gradients)


@functools.partial(jax.jit, static_argnames=("config",))
def _quantized_attention_jit(q, k, v, k_scales, v_scales, block_mask, score_program,
                             sinks=None, *, config):
    out, lse, *row_max = _quantized_attention(q, k, v, k_scales, v_scales, block_mask,
                                              score_program, config)
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
    return (out, lse, *row_max)
