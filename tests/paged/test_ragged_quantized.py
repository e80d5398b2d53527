"""The ragged op (OpenVINO PagedAttention) over quantized caches (int8, float8 with
per-(token, head) scales, the spec's KV-cache compression): new tokens are quantized as
they are written, and the outputs equal the op over 16-bit caches holding the same
dequantized values, on the XLA loop and the Pallas kernel (interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex.paged import paged_attention
from pallas_flex.paged.quantize import dequantize, quantize

HQ, HKV, D, BLOCK, NUM_BLOCKS = 4, 2, 32, 8, 12
PAST, BEGINS = jnp.array([13, 0]), jnp.array([0, 1, 6])  # a decode step and a 5-token prompt
BLOCKS, BLOCK_BEGINS = jnp.array([5, 2, 7, 1]), jnp.array([0, 3, 4])


def _round_trip(x, dtype):
    return dequantize(*quantize(x, dtype), jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["xla", "interpret",
                                     pytest.param("pallas", marks=pytest.mark.gpu)])
def test_quantized_caches_equal_16_bit_caches_of_the_dequantized_values(dtype, backend):
    keys = jax.random.split(jax.random.key(0), 5)
    key_cache = jax.random.normal(keys[0], (NUM_BLOCKS, HKV, BLOCK, D))
    value_cache = jax.random.normal(keys[1], (NUM_BLOCKS, HKV, BLOCK, D))
    q = jax.random.normal(keys[2], (6, HQ * D)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[3], (6, HKV * D)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[4], (6, HKV * D)).astype(jnp.bfloat16)
    (k_stored, k_scales), (v_stored, v_scales) = (quantize(x, dtype)
                                                  for x in (key_cache, value_cache))
    out, scores, k_cache, v_cache, k_scales, v_scales = paged_attention(
        q, k, v, k_stored, v_stored, PAST, BEGINS, BLOCKS, BLOCK_BEGINS, backend=backend,
        return_scores=True, key_cache_scales=k_scales, value_cache_scales=v_scales)
    assert k_cache.dtype == dtype and k_scales.shape == (NUM_BLOCKS, HKV, BLOCK)

    def as_written(x):
        return _round_trip(x.reshape(6, HKV, D), dtype).reshape(6, HKV * D)
    want, want_scores, _, _ = paged_attention(
        q, as_written(k), as_written(v), dequantize(k_stored, quantize(key_cache, dtype)[1],
                                                    jnp.bfloat16),
        dequantize(v_stored, quantize(value_cache, dtype)[1], jnp.bfloat16), PAST, BEGINS,
        BLOCKS, BLOCK_BEGINS, backend="xla", return_scores=True)
    np.testing.assert_allclose(out.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)
    np.testing.assert_allclose(scores, want_scores, atol=1e-3, rtol=2e-3)
    # The decode token (position 13: block 2, slot 5) was quantized as written.
    written = dequantize(k_cache[2, :, 5], k_scales[2, :, 5])
    np.testing.assert_allclose(written, as_written(k)[0].reshape(HKV, D).astype(jnp.float32),
                               rtol=1e-2, atol=1e-2)


def test_quantized_cache_arguments_are_checked():
    cache = jnp.zeros((NUM_BLOCKS, HKV, BLOCK, D), jnp.int8)
    scales = jnp.ones((NUM_BLOCKS, HKV, BLOCK), jnp.float32)
    q, k = jnp.zeros((6, HQ * D), jnp.bfloat16), jnp.zeros((6, HKV * D), jnp.bfloat16)
    args = (q, k, k, cache, cache, PAST, BEGINS, BLOCKS, BLOCK_BEGINS)
    with pytest.raises(ValueError, match="key_cache_scales must be float32"):
        paged_attention(*args, value_cache_scales=scales)
    with pytest.raises(ValueError, match="value_cache_scales must be float32"):
        paged_attention(*args, key_cache_scales=scales, value_cache_scales=scales[:, :1])
    with pytest.raises(ValueError, match="rotation"):
        paged_attention(*args, key_cache_scales=scales, value_cache_scales=scales,
                        rotated_block_indices=jnp.array([5]),
                        rotation_deltas=jnp.zeros((1, 1), jnp.int32),
                        rotation_trig_lut=jnp.ones((1, D)))
