"""make_attention_fn: unmodified Flax attention modules on pallas_flex kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention

from pallas_flex.nn import make_attention_fn
from tests.conftest import SMALL_TILES


def _mask(key, batch, q_len, kv_len):
    # Random, but every row keeps at least one key (Flax averages fully masked rows).
    return jax.random.bernoulli(key, 0.6, (batch, 1, q_len, kv_len)) | (
        jnp.arange(kv_len)[None, :] == jnp.arange(q_len)[:, None] % kv_len)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_multi_head_attention_matches_flax_outputs_and_gradients(backend):
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(keys[0], (2, 23, 32))
    mask = _mask(keys[1], 2, 23, 23)

    def layer(attention_fn=None):
        extra = {} if attention_fn is None else {"attention_fn": attention_fn}
        return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32,
                                      decode=False, rngs=nnx.Rngs(0), **extra)

    flax_layer = layer()
    our_layer = layer(make_attention_fn(backend=backend, kernel_options=SMALL_TILES))
    np.testing.assert_allclose(our_layer(x, mask=mask), flax_layer(x, mask=mask), atol=2e-5)

    def loss(module):
        return jnp.sum(module(x, mask=mask) ** 2)

    ours, theirs = nnx.grad(loss)(our_layer), nnx.grad(loss)(flax_layer)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_bias_causal_and_user_mods_compose_like_flax():
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    q = jax.random.normal(keys[0], (2, 19, 2, 16))
    k = jax.random.normal(keys[1], (2, 21, 2, 16))
    v = jax.random.normal(keys[2], (2, 21, 2, 16))
    bias = jax.random.normal(keys[3], (1, 2, 19, 21))
    window = jnp.abs(jnp.arange(19)[:, None] - jnp.arange(21)[None, :]) < 6
    attention_fn = make_attention_fn(
        mask_mod=lambda b, h, q_idx, kv_idx: jnp.abs(q_idx - kv_idx) < 6,
        backend="interpret", kernel_options=SMALL_TILES)
    ours = attention_fn(q, k, v, bias=bias, is_causal=True)
    causal = jnp.arange(19)[:, None] >= jnp.arange(21)[None, :]
    expected = dot_product_attention(q, k, v, bias=bias, mask=(window & causal)[None, None])
    np.testing.assert_allclose(ours, expected, atol=2e-5)


def test_refuses_dropout_and_weight_sowing_and_bad_mask_shapes():
    q = jnp.ones((1, 4, 2, 8))
    attention_fn = make_attention_fn(backend="xla")
    with pytest.raises(ValueError, match="dropout_rate"):
        attention_fn(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="module"):
        attention_fn(q, q, q, module=object())
    with pytest.raises(ValueError, match="mask"):
        attention_fn(q, q, q, mask=jnp.ones((1, 3, 4, 4), bool))
