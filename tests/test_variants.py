"""Variants past the template (`pf.variants`): differential attention and Evoformer gated
self-attention against plain JAX written the way a paper writes them, outputs and
gradients (the learnable lambda and both biases included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _plain_attention(q, k, v, bias=None, visible=None):
    """softmax(q k^T / sqrt(D) + bias) v with GQA by repetition; [B, S, H, D] layout."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(jnp.isnan(weights), 0.0, weights)  # rows with no key
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _assert_close(got, want, atol, names):
    for name, a, b in zip(names, got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=atol,
                                   err_msg=name)


# Both backends run the same backward kernels (the "xla" backend differentiates through
# them in Pallas's interpreter): one case each.
@pytest.mark.parametrize("backend,per_head_lambda", [("xla", True), ("interpret", False)])
def test_differential_attention_matches_plain_jax(backend, per_head_lambda):
    batch, q_len, kv_len, heads, kv_heads, dim = 2, 80, 144, 4, 2, 16
    q1, q2 = _normal(0, (batch, q_len, heads, dim)), _normal(1, (batch, q_len, heads, dim))
    k1, k2 = _normal(2, (batch, kv_len, kv_heads, dim)), _normal(3, (batch, kv_len, kv_heads, dim))
    v = _normal(4, (batch, kv_len, kv_heads, dim))
    lam = jnp.array([0.8, 0.2, 0.5, 0.1]) if per_head_lambda else jnp.float32(0.6)
    d_out = _normal(5, (batch, q_len, heads, dim))
    offset = kv_len - q_len
    visible = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + offset

    def ours(q1, k1, q2, k2, v, lam):
        return pf.variants.differential_attention(
            q1, k1, q2, k2, v, lam, mask_mod=masks.offset(masks.causal_mask, offset),
            backend=backend)

    def plain(q1, k1, q2, k2, v, lam):
        lam = lam.reshape((-1, 1)) if lam.ndim else lam
        return (_plain_attention(q1, k1, v, visible=visible)
                - lam * _plain_attention(q2, k2, v, visible=visible))
    args = (q1, k1, q2, k2, v, lam)
    _assert_close([ours(*args)], [plain(*args)], 2e-5, ["out"])
    loss = lambda f: lambda *a: jnp.sum(f(*a) * d_out)
    argnums = tuple(range(6))
    _assert_close(jax.grad(loss(ours), argnums)(*args), jax.grad(loss(plain), argnums)(*args),
                  2e-4, ["dq1", "dk1", "dq2", "dk2", "dv", "dlam"])


@pytest.mark.parametrize("backend", ["interpret"])
def test_gated_self_attention_matches_plain_jax(backend):
    """Pair bias shared by the rows, a key bias, a padding mask leaving one row with no
    key at all, and the sigmoid gate; gradients for q, k, v, gate and both biases. Four
    rows share each pair bias: its gradient comes from the backward's batch loop."""
    batch, rows, residues, heads, dim = 2, 4, 40, 2, 16
    shape = (batch, rows, residues, heads, dim)
    q, k, v, gate = (_normal(seed, shape) for seed in range(4))
    pair_bias = _normal(4, (batch, heads, residues, residues))
    key_bias = _normal(5, (batch, rows, residues))
    key_mask = jnp.asarray(np.random.default_rng(6).random((batch, rows, residues)) > 0.3)
    key_mask = key_mask.at[1, 2].set(False)  # a row with no key: zeros
    d_out = _normal(7, shape)

    def ours(q, k, v, gate, pair_bias, key_bias):
        return pf.variants.gated_self_attention(q, k, v, gate, pair_bias=pair_bias,
                                                key_bias=key_bias, key_mask=key_mask,
                                                backend=backend)

    def plain(q, k, v, gate, pair_bias, key_bias):
        fold = lambda x: x.reshape((batch * rows,) + x.shape[2:])
        bias = (jnp.repeat(pair_bias, rows, axis=0)
                + key_bias.reshape(batch * rows, 1, 1, residues))
        visible = key_mask.reshape(batch * rows, 1, 1, residues)
        out = _plain_attention(fold(q), fold(k), fold(v), bias=bias, visible=visible)
        return out.reshape(shape) * jax.nn.sigmoid(gate)
    args = (q, k, v, gate, pair_bias, key_bias)
    out = ours(*args)
    _assert_close([out], [plain(*args)], 2e-5, ["out"])
    np.testing.assert_array_equal(np.asarray(out[1, 2]), 0)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * d_out)
    argnums = tuple(range(6))
    assert "flex_attention_backward_batch_loop" in str(
        jax.make_jaxpr(jax.grad(loss(ours), argnums))(*args))
    _assert_close(jax.grad(loss(ours), argnums)(*args), jax.grad(loss(plain), argnums)(*args),
                  2e-4, ["dq", "dk", "dv", "dgate", "dpair_bias", "dkey_bias"])


def test_variant_arguments_are_checked():
    q = _normal(0, (1, 16, 2, 8))
    with pytest.raises(ValueError, match="lam must be"):
        pf.variants.differential_attention(q, q, q, q, q, jnp.ones(3))
    with pytest.raises(ValueError, match="equal shapes"):
        pf.variants.differential_attention(q, q, q[:, :8], q, q, 0.5)
    x = _normal(1, (1, 2, 16, 2, 8))
    with pytest.raises(ValueError, match="pair_bias must have shape"):
        pf.variants.gated_self_attention(x, x, x, x, pair_bias=jnp.zeros((1, 2, 16, 8)))
    with pytest.raises(ValueError, match="key_mask must have shape"):
        pf.variants.gated_self_attention(x, x, x, x, pair_bias=jnp.zeros((1, 2, 16, 16)),
                                         key_mask=jnp.ones((1, 16), bool))
