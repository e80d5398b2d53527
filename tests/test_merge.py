"""merge_attention_states: attention over A ∪ B from attention over A and over B."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from tests.conftest import SMALL_TILES, golden, random_qkv


@pytest.mark.parametrize("split", [1, 20, 47])
def test_merging_two_key_ranges_equals_attention_over_both(split):
    q, k, v = random_qkv(31, 2, 30, 48, 4, 2, 32, 24, jnp.float32)

    def part(keys, values):
        return pf.attention(q, keys, values, backend="xla", return_lse=True,
                            kernel_options=SMALL_TILES)

    out_a, lse_a = part(k[:, :split], v[:, :split])
    out_b, lse_b = part(k[:, split:], v[:, split:])
    out, lse = pf.merge_attention_states(out_a, lse_a, out_b, lse_b)
    expected_out, expected_lse = golden(q, k, v)
    np.testing.assert_allclose(out, expected_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, expected_lse, atol=2e-5, rtol=2e-5)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32


def test_merging_with_an_empty_side_keeps_the_other_and_both_empty_gives_zeros():
    q, k, v = random_qkv(32, 1, 20, 20, 2, 2, 16, 16, jnp.float32)
    out, lse = pf.attention(q, k, v, backend="xla", return_lse=True, kernel_options=SMALL_TILES)
    nothing_out = jnp.zeros_like(out)
    nothing_lse = jnp.full_like(lse, -jnp.inf)
    merged_out, merged_lse = pf.merge_attention_states(out, lse, nothing_out, nothing_lse)
    np.testing.assert_array_equal(merged_out, out)
    np.testing.assert_array_equal(merged_lse, lse)
    empty_out, empty_lse = pf.merge_attention_states(nothing_out, nothing_lse, nothing_out,
                                                     nothing_lse)
    assert np.all(np.asarray(empty_out) == 0) and np.all(np.isneginf(np.asarray(empty_lse)))
    assert np.isfinite(np.asarray(empty_out)).all()


def test_merging_two_empty_rows_has_zero_gradients():
    """A row with no keys in either part merges to zeros and lse -inf, and its gradients
    are zeros, not NaN (jnp.logaddexp's derivative at (-inf, -inf) is NaN): context
    parallelism merges such rows at every ring step."""
    out = jnp.ones((1, 3, 2, 4), jnp.float32)
    lse = jnp.array([[[-jnp.inf, 0.5, -jnp.inf]] * 2], jnp.float32)  # rows 0 and 2 empty

    def loss(out_a, lse_a, out_b, lse_b):
        merged, merged_lse = pf.merge_attention_states(out_a, lse_a, out_b, lse_b)
        return jnp.sum(merged) + jnp.sum(jnp.where(jnp.isfinite(merged_lse), merged_lse, 0))
    merged, merged_lse = pf.merge_attention_states(out, lse, 2 * out, lse)
    assert not np.any(np.asarray(merged[:, 0])) and bool(jnp.isneginf(merged_lse[0, 0, 0]))
    np.testing.assert_allclose(merged[:, 1], 1.5 * np.ones((1, 2, 4)))
    np.testing.assert_allclose(merged_lse[:, :, 1], 0.5 + np.log(2.0), rtol=1e-6)
    for gradient in jax.grad(loss, argnums=(0, 1, 2, 3))(out, lse, 2 * out, lse):
        assert bool(jnp.all(jnp.isfinite(gradient)))
