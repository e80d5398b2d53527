"""The tuning table: defaults chosen by dtype and head dim, and what a user sets wins."""

import jax.numpy as jnp
import pytest

from pallas_flex.kernels.config import default_forward_options, resolve_options


@pytest.mark.parametrize("head_dim", [80, 96, 128])
def test_float32_forward_at_head_dims_up_to_128_takes_eight_warps(head_dim):
    assert resolve_options(None, head_dim, jnp.float32).num_warps == 8
    for dtype in (jnp.bfloat16, jnp.float16, None):
        assert resolve_options(None, head_dim, dtype).num_warps == 4


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_float32_decode_takes_32_row_tiles_as_a_default_not_a_setting(head_dim):
    options = resolve_options(None, head_dim, jnp.float32)
    assert options.decode_block_kv == 32
    # A default, which shared-memory fitting may still shrink; not something the user set.
    assert "decode_block_kv" not in options.given
    assert resolve_options(None, head_dim, jnp.bfloat16).decode_block_kv == 0


@pytest.mark.parametrize("head_dim,backward_tiles", [
    (16, (64, 64, 64, 64, 4)), (32, (64, 64, 64, 64, 4)), (48, (128, 128, 64, 128, 8)),
    (64, (128, 128, 64, 128, 8))])
def test_head_dims_up_to_32_take_64_by_64_backward_tiles(head_dim, backward_tiles):
    """dQ and dK/dV tiles (q, kv, dkdv q, dkdv kv, warps) by head dim: 64x64 with 4 warps
    up to D 32 (the Evoformer's D 32 measured 15-21 % faster), D 64's above."""
    options = resolve_options(None, head_dim)
    assert (options.backward_block_q, options.backward_block_kv, options.backward_dkdv_block_q,
            options.backward_dkdv_block_kv, options.backward_num_warps) == backward_tiles
    assert (options.block_q, options.block_kv) == (64, 64)


def test_head_dims_above_128_take_smaller_float32_backward_tiles():
    sixteen_bit, float32 = default_forward_options(256), default_forward_options(256, jnp.float32)
    assert (float32.backward_block_q, float32.backward_block_kv, float32.backward_dkdv_block_q,
            float32.backward_dkdv_block_kv, float32.backward_num_stages) == (16, 16, 16, 16, 1)
    assert float32.replace(backward_block_q=32, backward_block_kv=32, backward_dkdv_block_q=32,
                           backward_dkdv_block_kv=32, backward_num_stages=2) == sixteen_bit


def test_user_settings_override_the_float32_defaults():
    options = resolve_options({"num_warps": 4, "decode_block_kv": 64}, 128, jnp.float32)
    assert options.num_warps == 4 and options.decode_block_kv == 64
    assert {"num_warps", "decode_block_kv"} <= options.given


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_short_key_ranges_take_smaller_triton_tiles(head_dim):
    """At most SHORT_KEYS keys (a program's walk is a few tiles long) the 16-bit Triton
    kernels take smaller tiles: the backward D 32's 64x64 dQ and dK/dV tiles on 4 warps,
    the forward at D 65-128 64x32 tiles in 3 stages; longer keys, float32 and the other
    head dims keep the table's tiles, and what the user sets wins."""
    def forward(options):
        return options.block_q, options.block_kv, options.num_warps, options.num_stages

    def backward(options):
        return (options.backward_block_q, options.backward_block_kv,
                options.backward_dkdv_block_q, options.backward_dkdv_block_kv,
                options.backward_num_warps, options.backward_num_stages)

    long = resolve_options(None, head_dim, jnp.bfloat16)
    for dtype in (jnp.bfloat16, jnp.float16, None):
        for keys in (256, 512):
            short = resolve_options(None, head_dim, dtype, key_length=keys)
            assert backward(short) == (64, 64, 64, 64, 4, 3) == backward(
                resolve_options(None, 32, dtype))
            assert forward(short) == ((64, 32, 4, 3) if head_dim > 64 else forward(long))
        assert resolve_options(None, head_dim, dtype, key_length=513) == long
        assert resolve_options(None, head_dim, dtype) == long
    assert resolve_options(None, head_dim, jnp.float32, key_length=256) == resolve_options(
        None, head_dim, jnp.float32)
    for other in (32, 256):
        assert (resolve_options(None, other, jnp.bfloat16, key_length=256)
                == resolve_options(None, other, jnp.bfloat16))
    given = resolve_options({"block_kv": 64, "backward_num_warps": 8}, head_dim,
                            jnp.bfloat16, key_length=256)
    assert given.block_kv == 64 and given.backward_num_warps == 8
