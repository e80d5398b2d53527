"""Output gates (`output_gate=`: the output times sigmoid(gate), `pallas_flex/output_gate.py`):
values against a float64 model on every backend and dtype, with GQA, ragged lengths,
Dv != D, a score_mod and sinks; the Triton forward's epilogue taking the gate where no
one differentiates; gradients of q, k, v, the gate, sinks and a captured array against
plain JAX; the paths that gate after their kernel (decode, an 8-bit cache, values in the
keys); bad gates refused."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from tests.conftest import golden, random_qkv


def _gate(seed, q, v, dtype=jnp.float32):
    shape = q.shape[:3] + (v.shape[3],)
    return (jax.random.normal(jax.random.PRNGKey(seed), shape) * 3).astype(dtype)


def _gated_golden(q, k, v, gate, mask_mod=None, score_mod=None):
    out, _ = golden(q, k, v, mask_mod, score_mod)
    sigmoid = 1.0 / (1.0 + np.exp(-np.asarray(gate, np.float64)))
    return out * sigmoid


_TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}


@pytest.mark.parametrize("backend,dims", [
    ("interpret", (64, 32)), ("xla", (64, 32)), ("reference", (64, 32)),
    pytest.param("pallas", (64, 32), marks=pytest.mark.gpu),
    pytest.param("pallas", (128, 128), marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_values(backend, dims, dtype):
    """GQA 4:2, 200 queries over 300 keys (neither a multiple of the tiles), D 64 and
    Dv 32 (and 128 / 128 on the GPU: the Mosaic forward there, gated after it), causal
    with an offset and ALiBi; the gate in bfloat16 for 16-bit inputs."""
    q, k, v = random_qkv(1, 2, 200, 300, 4, 2, *dims, dtype)
    gate = _gate(2, q, v, jnp.bfloat16 if dtype != jnp.float32 else jnp.float32)
    mask_mod, score_mod = masks.offset(masks.causal_mask, 100), masks.alibi(4)
    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                            output_gate=gate, backend=backend, return_lse=True)
    assert out.shape == (2, 200, 4, dims[1]) and out.dtype == dtype
    want = _gated_golden(q, k, v, gate, mask_mod, score_mod)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, atol=_TOLERANCE[dtype], rtol=_TOLERANCE[dtype])
    # lse is the softmax's own, ungated.
    _, want_lse = golden(q, k, v, mask_mod, score_mod)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-2, rtol=2e-3)


def test_the_triton_forward_takes_the_gate_in_its_epilogue():
    """Not differentiated: the gate's sigmoid runs inside the forward kernel, and nothing
    outside it reads the ungated output. Differentiated: the forward rule gates after
    the kernel (its backward needs the ungated output)."""
    q, k, v = random_qkv(3, 1, 128, 128, 2, 2, 64, 64, jnp.float32)
    gate = _gate(4, q, v)

    def primitives(jaxpr, inside=False, found=None):
        found = [] if found is None else found
        for equation in jaxpr.eqns:
            found.append((equation.primitive.name, inside))
            for sub in jax.extend.core.jaxprs_in_params(equation.params):
                primitives(sub, inside or equation.primitive.name == "pallas_call", found)
        return found

    def call(q, k, v, gate):
        return pf.attention(q, k, v, output_gate=gate, backend="interpret")
    found = primitives(jax.make_jaxpr(call)(q, k, v, gate).jaxpr)
    assert ("logistic", True) in found and ("logistic", False) not in found

    def forward_rule(q, k, v, gate):
        return jax.vjp(call, q, k, v, gate)[0]
    found = primitives(jax.make_jaxpr(forward_rule)(q, k, v, gate).jaxpr)
    assert ("logistic", False) in found and ("logistic", True) not in found


@pytest.mark.parametrize("backend", ["interpret", "xla",
                                     pytest.param("pallas", marks=pytest.mark.gpu)])
def test_gradients_against_plain_jax(backend):
    """q, k, v, the gate, the sinks and an ALiBi-like captured slope array, against
    autodiff of the dense reference times sigmoid(gate), float32."""
    q, k, v = random_qkv(5, 2, 96, 160, 4, 2, 32, 48, jnp.float32)
    gate = _gate(6, q, v)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    weights = jnp.cos(jnp.arange(48.0))

    def loss(q, k, v, gate, sinks, slopes, backend):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)
        if backend == "plain":
            out = pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                               sinks=sinks, backend="reference")
            out = out * jax.nn.sigmoid(gate)
        else:
            out = pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                               sinks=sinks, output_gate=gate, backend=backend)
        return jnp.sum(out * weights)

    arguments = (q, k, v, gate, sinks, slopes)
    tolerance = 1e-4 if backend == "pallas" else 2e-5  # (the GPU's float32 matmuls)
    got = jax.grad(loss, argnums=tuple(range(6)))(*arguments, backend)
    want = jax.grad(loss, argnums=tuple(range(6)))(*arguments, "plain")
    for name, a, b in zip(("q", "k", "v", "gate", "sinks", "slopes"), got, want):
        scale = float(jnp.max(jnp.abs(b)))
        assert scale > 0, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tolerance * scale + 1e-6,
                                   rtol=10 * tolerance, err_msg=name)
    # The gate alone differentiated (q, k, v constant) and none of it: no other gradient.
    d_gate = jax.grad(loss, argnums=3)(*arguments, backend)
    np.testing.assert_allclose(np.asarray(d_gate), np.asarray(want[3]), atol=tolerance,
                               rtol=10 * tolerance)


@pytest.mark.parametrize("case", ["decode", "quantized", "values_in_keys", "block_mask"])
def test_calls_that_gate_after_their_kernel(case):
    """One query token (the split-KV decode kernel), an int8 cache, values in the keys
    (a latent cache) and a prebuilt BlockMask through flex_attention: each output gated."""
    q_len = 1 if case in ("decode", "values_in_keys") else 64
    q, k, v = random_qkv(7, 2, q_len, 256, 4, 2, 64, 64, jnp.bfloat16)
    value_dim = 32 if case == "values_in_keys" else None
    if value_dim:
        v = k[..., :value_dim]
    gate = _gate(8, q, v)
    want = _gated_golden(q, k, v, gate)
    if case == "quantized":
        k8, k_scales = pf.paged.quantize.quantize(k, jnp.int8)
        v8, v_scales = pf.paged.quantize.quantize(v, jnp.int8)
        out = pf.attention(q, k8, v8, k_scales=k_scales, v_scales=v_scales, output_gate=gate,
                           backend="interpret")
        atol = 5e-2
    elif case == "values_in_keys":
        out = pf.attention(q, k, None, value_dim=value_dim, output_gate=gate,
                           backend="interpret")
        atol = 2e-2
    elif case == "block_mask":
        block_mask = pf.create_block_mask(masks.causal_mask, None, None, 64, 256)
        out = pf.flex_attention(q, k, v, block_mask=block_mask, output_gate=gate,
                                backend="interpret")
        want = _gated_golden(q, k, v, gate, masks.causal_mask)
        atol = 2e-2
    else:
        out = pf.attention(q, k, v, output_gate=gate, backend="interpret")
        atol = 2e-2
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, atol=atol, rtol=atol)


def test_the_row_max_is_the_ungated_softmax_s():
    """return_aux with a gate: out gated in the kernel, lse and max_scores those of the
    ungated softmax."""
    q, k, v = random_qkv(11, 1, 100, 100, 2, 2, 32, 32, jnp.float32)
    gate = _gate(12, q, v)
    request = pf.AuxRequest(lse=True, max_scores=True)
    out, aux = pf.attention(q, k, v, mask_mod=masks.causal_mask, output_gate=gate,
                            return_aux=request, backend="interpret")
    plain, plain_aux = pf.attention(q, k, v, mask_mod=masks.causal_mask, return_aux=request,
                                    backend="interpret")
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain * jax.nn.sigmoid(gate)),
                               atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux.lse), np.asarray(plain_aux.lse))
    np.testing.assert_array_equal(np.asarray(aux.max_scores), np.asarray(plain_aux.max_scores))


def test_under_vmap():
    """vmapped with q, k, v, gate, and with the gate alone (the kernel's grid takes the
    vmapped axis; the gate's tile follows its output's)."""
    q, k, v = (x[:, None] for x in random_qkv(13, 3, 64, 64, 2, 2, 16, 16, jnp.float32))
    gate = jnp.stack([_gate(14 + i, q[0], v[0]) for i in range(3)])

    def gated(q, k, v, gate):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, output_gate=gate,
                            backend="interpret")

    def plain(i, j):
        return pf.attention(q[i], k[i], v[i], mask_mod=masks.causal_mask,
                            backend="reference") * jax.nn.sigmoid(gate[j])
    np.testing.assert_allclose(np.asarray(jax.vmap(gated)(q, k, v, gate)),
                               np.asarray(jnp.stack([plain(i, i) for i in range(3)])),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(jax.vmap(gated, in_axes=(None, None, None, 0))(q[0], k[0], v[0], gate)),
        np.asarray(jnp.stack([plain(0, j) for j in range(3)])), atol=1e-5, rtol=1e-5)


def test_bad_gates_are_refused():
    q, k, v = random_qkv(9, 1, 16, 16, 2, 2, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"output_gate must have the output's shape"):
        pf.attention(q, k, v, output_gate=jnp.zeros((1, 16, 2, 16)), backend="xla")
    with pytest.raises(ValueError, match="output_gate must be a float array"):
        pf.attention(q, k, v, output_gate=jnp.zeros((1, 16, 2, 8), jnp.int32), backend="xla")
