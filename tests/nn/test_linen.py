"""make_attention_fn in a linen MultiHeadDotProductAttention, against linen's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen

import pallas_flex as pf
from pallas_flex.nn import make_attention_fn
from tests.conftest import SMALL_TILES

BATCH, LENGTH, FEATURES, HEADS = 2, 21, 32, 4


def _outputs_and_gradients(module, params, x, mask):
    def loss(params):
        out = module.apply(params, x, mask=mask)
        return jnp.sum(jnp.sin(out)), out

    (_, out), gradients = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, gradients


def test_linen_module_with_attention_fn_matches_linen():
    """linen passes its dense causal mask through attention_fn; the mask_mod given to
    make_attention_fn adds a window on top. Outputs and parameter gradients equal linen's
    own attention with both masks combined densely."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((BATCH, LENGTH, FEATURES)),
                    jnp.float32)
    window = pf.masks.sliding_window(8, causal=False)
    positions = jnp.arange(LENGTH)
    dense_window = window(0, 0, positions[:, None], positions[None, :])[None, None]
    causal = linen.make_causal_mask(jnp.zeros((BATCH, LENGTH)))  # float32 1/0, as linen's

    theirs = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES)
    ours = linen.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=FEATURES,
        attention_fn=make_attention_fn(mask_mod=window, backend="xla",
                                       kernel_options=SMALL_TILES))
    params = jax.jit(theirs.init)(jax.random.PRNGKey(1), x)
    our_out, our_gradients = _outputs_and_gradients(ours, params, x, causal)
    their_out, their_gradients = _outputs_and_gradients(theirs, params, x,
                                                        causal.astype(bool) & dense_window)
    np.testing.assert_allclose(our_out, their_out, atol=2e-5)
    assert jax.tree.structure(our_gradients) == jax.tree.structure(their_gradients)
    for a, b in zip(jax.tree.leaves(our_gradients), jax.tree.leaves(their_gradients)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
