"""The RoPE re-rotation kernel over listed cache blocks (`kernels/rotate_blocks.py`),
against the XLA rotation the ragged op keeps for other caches (`paged.ragged._rotate_blocks`,
float32 arithmetic) and against float64 pair rotations. Interpret mode on the CPU; the
same cases compiled on the GPU (marker `gpu`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex.kernels.rotate_blocks import rotate_blocks, supported
from pallas_flex.paged.ragged import _rotate_blocks

GPU = pytest.param(False, marks=pytest.mark.gpu)


def _inputs(dtype, seed=0, blocks=10, kv_heads=2, block_size=16, head_dim=64, rows=33):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.normal(size=(blocks, kv_heads, block_size, head_dim)), dtype)
    # Block 12 lies past the pool (left out); deltas below 0 and past the LUT are clamped.
    indices = jnp.asarray([7, 2, 12, 0], jnp.int32)
    deltas = jnp.asarray(rng.integers(-2, rows + 5, (4, block_size)), jnp.int32)
    angles = rng.uniform(0, 2 * np.pi, (rows, head_dim // 2))
    lut = jnp.asarray(np.concatenate([np.cos(angles), np.sin(angles)], 1), jnp.float32)
    return cache, indices, deltas, lut


@pytest.mark.parametrize("interpret", [True, GPU])
@pytest.mark.parametrize("dtype,kv_heads", [
    (jnp.bfloat16, 2), (jnp.float16, 3), (jnp.float32, 2)])
def test_matches_the_xla_rotation_and_float64(dtype, kv_heads, interpret):
    """kv_heads 2: a block's heads in one program; 3 (not a power of two): one each."""
    cache, indices, deltas, lut = _inputs(dtype, kv_heads=kv_heads)
    before = np.asarray(cache, np.float64)
    got = np.asarray(rotate_blocks(cache, indices, deltas, lut, interpret=interpret),
                     np.float64)
    want = np.asarray(_rotate_blocks(cache, indices, deltas, lut)[0], np.float64)
    # The same float32 arithmetic, whose products may be fused differently: within two
    # units in the last place of the cache's dtype.
    ulp = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=2 * ulp, atol=ulp)
    # Unlisted blocks (and the one past the pool) untouched; listed ones moved.
    for block in range(cache.shape[0]):
        if block in (7, 2, 0):
            assert not np.array_equal(got[block], before[block])
        else:
            np.testing.assert_array_equal(got[block], before[block])
    # Against float64 pair rotations of the original keys.
    table = np.asarray(lut, np.float64)
    half = cache.shape[3] // 2
    tolerance = {jnp.bfloat16: 2e-2, jnp.float16: 3e-3, jnp.float32: 1e-5}[dtype]
    for entry, block in enumerate([7, 2, 12, 0]):
        if block >= cache.shape[0]:
            continue
        rows = np.clip(np.asarray(deltas[entry]), 0, table.shape[0] - 1)
        cos, sin = table[rows, :half][None], table[rows, half:][None]
        even, odd = before[block, ..., 0::2], before[block, ..., 1::2]
        np.testing.assert_allclose(got[block, ..., 0::2], even * cos - odd * sin,
                                   atol=tolerance * 4, rtol=tolerance)
        np.testing.assert_allclose(got[block, ..., 1::2], even * sin + odd * cos,
                                   atol=tolerance * 4, rtol=tolerance)


def test_supported_caches():
    assert supported(jnp.zeros((4, 2, 16, 128), jnp.bfloat16))
    assert supported(jnp.zeros((4, 1, 32, 64), jnp.float32))
    assert not supported(jnp.zeros((4, 2, 16, 128), jnp.int8))  # quantized: XLA
    assert not supported(jnp.zeros((4, 2, 16, 96), jnp.bfloat16))  # 48 features a half
    assert not supported(jnp.zeros((4, 2, 12, 128), jnp.bfloat16))  # blocks of 12
