"""pf.flex_attention over contiguous int8 / float8 K/V with per-(token, head) scales:
decode runs the split-KV kernel on the 8-bit values, other calls a dequantized copy; the
outputs equal a float64 model over the dequantized values, on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_flex as pf
from pallas_flex.paged.quantize import dequantize, quantize

B, HQ, HKV, D, DV = 2, 4, 2, 32, 16
KV_LEN = 200  # not a whole number of the decode kernel's tiles
POSITIONS = jnp.array([150, 199], jnp.int32)  # each row's first query position
SLOPES = jnp.array([0.5, 0.25, 0.125, 0.0625], jnp.float32)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _window(b, h, q_idx, kv_idx):  # per-head windows: a BlockMask row per query head
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 40 * (h + 1))


def _alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx - POSITIONS[b]).astype(jnp.float32)


def _case(dtype, q_len, q_dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, q_len, HQ, D)).astype(q_dtype)
    k = jax.random.normal(keys[1], (B, KV_LEN, HKV, D)) * 2
    v = jax.random.normal(keys[2], (B, KV_LEN, HKV, DV))
    (k, k_scales), (v, v_scales) = quantize(k, dtype), quantize(v, dtype)
    sinks = jax.random.normal(keys[3], (HQ,))
    return q, k, v, k_scales, v_scales, sinks


def _float64_model(q, k, v, k_scales, v_scales, mask_mod, sinks):
    """(out, lse including the sink, row max of the logits) over the dequantized values,
    densely in float64, ALiBi as `_alibi`."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    k = np.asarray(k.astype(jnp.float32), np.float64) * np.asarray(k_scales, np.float64)[..., None]
    v = np.asarray(v.astype(jnp.float32), np.float64) * np.asarray(v_scales, np.float64)[..., None]
    q_len = q.shape[1]
    group = HQ // HKV
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    q_pos = np.asarray(POSITIONS)[:, None] + np.arange(q_len)[None, :]  # [B, Sq]
    kv_pos = np.arange(KV_LEN)
    distance = kv_pos[None, None, None, :] - q_pos[:, None, :, None]
    logits = logits + np.asarray(SLOPES, np.float64)[None, :, None, None] * distance
    heads = np.arange(HQ)[None, :, None, None]
    visible = np.asarray(mask_mod(0, heads, q_pos[:, None, :, None], kv_pos[None, None, None]))
    logits = np.where(visible, logits, -np.inf)
    row_max = logits.max(-1)
    sink = np.asarray(sinks, np.float64)[None, :, None]
    top = np.maximum(row_max, sink)
    weights = np.exp(logits - top[..., None])
    total = weights.sum(-1) + np.exp(sink - top)
    out = np.einsum("bhqk,bkhd->bqhd", weights / total[..., None], v)
    return out, np.log(total) + top, row_max


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "float8"])
@pytest.mark.parametrize("q_len,mask_mod,q_dtype", [
    (1, _causal, jnp.bfloat16), (4, _window, jnp.float32), (40, _causal, jnp.bfloat16)],
    ids=["decode", "speculative_per_head_mask", "prefill"])
@pytest.mark.parametrize("backend", ["interpret", "xla", "reference",
                                     pytest.param("pallas", marks=pytest.mark.gpu)])
def test_quantized_kv_equals_float64_model_of_the_dequantized_values(backend, q_len,
                                                                     mask_mod, q_dtype, dtype):
    q, k, v, k_scales, v_scales, sinks = _case(dtype, q_len, q_dtype)
    block_mask = pf.create_block_mask(pf.masks.offset(mask_mod, POSITIONS), B,
                                      HQ if mask_mod is _window else None, q_len, KV_LEN)
    out, aux = pf.flex_attention(q, k, v, _alibi, block_mask, k_scales=k_scales,
                                 v_scales=v_scales, backend=backend, sinks=sinks,
                                 return_aux=pf.AuxRequest(lse=True, max_scores=True))
    want_out, want_lse, want_max = _float64_model(q, k, v, k_scales, v_scales, mask_mod,
                                                   sinks)
    assert out.dtype == q_dtype and out.shape == (B, q_len, HQ, DV)
    tolerance = 2e-5 if q_dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want_out,
                               atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(aux.lse, want_lse, atol=tolerance * 10, rtol=tolerance)
    np.testing.assert_allclose(aux.max_scores, want_max, atol=tolerance * 10, rtol=tolerance)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "float8"])
def test_decode_runs_the_kernel_on_the_8_bit_values_without_dequantizing(dtype):
    """The decode kernel reads the 8-bit arrays themselves: no dequantized [B, S, Hkv, D]
    array is made; float8 ones as int8 of the same bits (`kv_tiles.as_int8_bits`: a
    bitcast, no float8 load in the kernel)."""
    q, k, v, k_scales, v_scales, _ = _case(dtype, 1, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda *a: pf.flex_attention(*a[:3], k_scales=a[3], v_scales=a[4],
                                                         backend="interpret"))(
        q, k, v, k_scales, v_scales)
    text = str(jaxpr)
    assert "pallas_call" in text
    assert f"bf16[{B},{KV_LEN},{HKV},{D}]" not in text and f"f32[{B},{KV_LEN},{HKV},{D}]" not in text

    def pallas_calls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from pallas_calls(inner)
    [call] = pallas_calls(jaxpr.jaxpr)
    kernel_inputs = [str(var.aval.dtype) for var in call.invars]
    assert "int8" in kernel_inputs and not any("float8" in name for name in kernel_inputs)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "float8"])
def test_under_jit_and_split_over_kv_heads_equals_one_device(dtype):
    q, k, v, k_scales, v_scales, _ = _case(dtype, 1, jnp.float32)
    mask = pf.create_block_mask(pf.masks.offset(_causal, POSITIONS), B, None, 1, KV_LEN)

    @jax.jit
    def step(q, k, v, k_scales, v_scales):
        return pf.flex_attention(q, k, v, block_mask=mask, k_scales=k_scales,
                                 v_scales=v_scales, backend="interpret")
    want = step(q, k, v, k_scales, v_scales)
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices("cpu")[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    heads = NamedSharding(mesh, P("data", None, "model"))
    got = step(*(jax.device_put(x, heads) for x in (q, k, v, k_scales, v_scales)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    assert tuple(got.sharding.spec)[:3] == ("data", None, "model"), got.sharding


def test_quantized_kv_arguments_are_checked():
    q, k, v, k_scales, v_scales, _ = _case(jnp.int8, 1, jnp.bfloat16)
    float8_v = quantize(dequantize(v, v_scales), jnp.float8_e4m3fn)[0]
    for kwargs, message in [
            (dict(k_scales=k_scales), "v_scales must be float32"),
            (dict(k_scales=k_scales[:, :-1], v_scales=v_scales), "k_scales must be float32"),
            (dict(k_scales=k_scales, v_scales=v_scales.astype(jnp.bfloat16)), "v_scales must"),
            (dict(v=float8_v, k_scales=k_scales, v_scales=v_scales), "both be int8 or"),
            (dict(k_scales=k_scales, v_scales=v_scales, q=q[..., :16]), "head dim"),
            (dict(k_scales=k_scales, v_scales=v_scales, q=q[:, :, :3]), "multiple of k's"),
            (dict(), "k_scales must be float32")]:
        arrays = dict(q=q, k=k, v=v)
        arrays.update({name: kwargs.pop(name) for name in ("q", "v") if name in kwargs})
        with pytest.raises(ValueError, match=message):
            pf.flex_attention(arrays["q"], arrays["k"], arrays["v"], backend="xla", **kwargs)
    with pytest.raises(ValueError, match="both be int8 or"):  # scales with 16-bit K/V
        pf.flex_attention(q, q, q, k_scales=k_scales, v_scales=v_scales)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_differentiating_quantized_kv_is_a_value_error(backend):
    q, k, v, k_scales, v_scales, _ = _case(jnp.int8, 1, jnp.float32)
    with pytest.raises(ValueError, match="inference"):
        jax.grad(lambda q: pf.flex_attention(q, k, v, k_scales=k_scales, v_scales=v_scales,
                                             backend=backend).sum())(q)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_attention_takes_quantized_kv_with_a_mask_mod(backend):
    """pf.attention(mask_mod=..., k_scales=, v_scales=) builds the mask in the call and
    gives flex_attention's result with the prebuilt BlockMask."""
    q, k, v, k_scales, v_scales, sinks = _case(jnp.int8, 1, jnp.bfloat16)
    mask_mod = pf.masks.offset(_causal, POSITIONS)
    got = jax.jit(lambda *a: pf.attention(*a[:3], mask_mod=mask_mod, k_scales=a[3],
                                          v_scales=a[4], backend=backend))(
        q, k, v, k_scales, v_scales)
    block_mask = pf.create_block_mask(mask_mod, B, None, 1, KV_LEN)
    want = pf.flex_attention(q, k, v, block_mask=block_mask, k_scales=k_scales,
                             v_scales=v_scales, backend=backend)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        pf.attention(q, k, v, mask_mod=mask_mod, block_mask=block_mask, k_scales=k_scales,
                     v_scales=v_scales)
