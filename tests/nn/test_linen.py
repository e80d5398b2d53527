"""make_attention_fn in a linen MultiHeadDotProductAttention, against linen's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen

import pallas_flex as pf
from pallas_flex.nn import make_attention_fn
from tests.conftest import SMALL_TILES

BATCH, LENGTH, FEATURES, HEADS = 2, 21, 32, 4


def _module(attention_fn=None):
    extra = {} if attention_fn is None else {"attention_fn": attention_fn}
    return linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES, **extra)


MASK_MOD = pf.and_masks(pf.masks.causal_mask, pf.masks.sliding_window(8))
DENSE_MASK = MASK_MOD(0, 0, jnp.arange(LENGTH)[:, None], jnp.arange(LENGTH)[None, :])[None, None]


def _outputs_and_gradients(module, params, x, mask):
    def loss(params):
        out = module.apply(params, x, mask=mask)
        return jnp.sum(jnp.sin(out)), out

    (_, out), gradients = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, gradients


@pytest.fixture(scope="module")
def linen_reference():
    """Inputs, parameters, and linen's own outputs and parameter gradients."""
    x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, LENGTH, FEATURES))
    params = jax.jit(_module().init)(jax.random.PRNGKey(1), x)
    return x, params, _outputs_and_gradients(_module(), params, x, DENSE_MASK)


@pytest.mark.parametrize("where", ["mask_mod", "dense_mask"])
def test_linen_module_with_attention_fn_matches_linen(linen_reference, where):
    """The pattern given as a mask_mod to make_attention_fn, or as linen's dense mask
    argument: outputs and parameter gradients equal linen's own attention's."""
    x, params, theirs = linen_reference
    if where == "mask_mod":
        attention_fn = make_attention_fn(mask_mod=MASK_MOD, backend="xla",
                                         kernel_options=SMALL_TILES)
        ours = _outputs_and_gradients(_module(attention_fn), params, x, None)
    else:
        attention_fn = make_attention_fn(backend="xla", kernel_options=SMALL_TILES)
        ours = _outputs_and_gradients(_module(attention_fn), params, x, DENSE_MASK)
    np.testing.assert_allclose(ours[0], theirs[0], atol=2e-5)
    assert jax.tree.structure(ours[1]) == jax.tree.structure(theirs[1])
    for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(theirs[1])):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
