"""The latent decode that reads the values from its key tiles
(`kernels/decode_latent_stage_mosaic.py`, off by default: `decode_latent_mosaic.
VALUES_FROM_KEY_STAGE`), in Mosaic GPU's interpret mode against float64 and against the
other latent kernel; compiled on the GPU (marker `gpu`) at DeepSeek's shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels import decode_latent_mosaic, decode_latent_stage_mosaic
from tests.conftest import assert_close_to_golden, golden, random_qkv

MOSAIC = {"decode_kernel": "mosaic"}


@pytest.fixture
def key_stage(monkeypatch):
    """Routes latent calls with the values in the keys to the key-stage kernel, and
    records that it ran."""
    monkeypatch.setattr(decode_latent_mosaic, "VALUES_FROM_KEY_STAGE", True)
    launches = []
    launch = decode_latent_stage_mosaic.launch

    def spy(*args, **kwargs):
        launches.append(kwargs["value_dim"])
        return launch(*args, **kwargs)
    monkeypatch.setattr(decode_latent_stage_mosaic, "launch", spy)
    jax.clear_caches()
    yield launches
    jax.clear_caches()


@pytest.mark.parametrize("dim,value_dim,kv_len,dtype,mask", [
    # Three chunks (the values' halves, 64 more key columns); ragged keys; a decode offset
    # per row (full, partial and unlisted blocks).
    (192, 128, 300, jnp.bfloat16, "offset_causal"),
    # Two chunks (D = Dv), float16, a captured array read at kv_idx with an empty row.
    (128, 128, 200, jnp.float16, "key_padding"),
])
def test_matches_float64_and_the_split_column_kernel(key_stage, dim, value_dim, kv_len,
                                                      dtype, mask):
    q, latent, _ = random_qkv(17, 2, 1, kv_len, 64, 1, dim, value_dim, dtype)
    if mask == "offset_causal":
        mask_mod = masks.offset(masks.causal_mask, jnp.array([kv_len - 1, 100], jnp.int32))
    else:
        valid = ((jnp.arange(kv_len)[None, :] % 5 != 2)
                 & (jnp.arange(2)[:, None] == 0)).astype(jnp.int8)

        def mask_mod(b, h, q_idx, kv_idx):
            return valid[b, kv_idx] != 0
    out, lse = pf.attention(q, latent, None, value_dim=value_dim, mask_mod=mask_mod,
                            return_lse=True, backend="interpret", kernel_options=MOSAIC)
    assert key_stage == [value_dim]
    v = latent[..., :value_dim]
    expected_out, expected_lse = golden(q, latent, v, mask_mod=mask_mod)
    assert_close_to_golden(out, expected_out, q, latent, v, mask_mod=mask_mod)
    lse = np.asarray(lse, np.float64)
    empty = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], expected_lse[~empty], atol=2e-3, rtol=1e-4)
    assert not np.any(np.asarray(out.astype(jnp.float32))[np.moveaxis(empty, 2, 1)])
    # The other latent kernel, given the slice: the same up to float32 summation order.
    sliced = pf.attention(q, latent, v, mask_mod=mask_mod, backend="interpret",
                          kernel_options=MOSAIC)
    assert key_stage == [value_dim]  # (a separate v runs the split-column kernel)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)),
                               np.asarray(sliced.astype(jnp.float32)), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [16, 64])
def test_latent_paged_cache_matches_float64(key_stage, page_size):
    """A latent PagedKVCache (pages shuffled between rows), tiles from one page or four;
    lengths crossing a tile, their stale rows zeroed before p·v."""
    from tests.paged.test_flex_attention import check_paged_against_golden

    check_paged_against_golden([150, 61], page_size, 1, 64, 1, 192, 128, jnp.bfloat16,
                               "causal", None, MOSAIC, "interpret", latent=True)
    assert key_stage and set(key_stage) == {128}


def test_paged_never_reads_stale_slots_past_a_length(key_stage):
    from tests.paged.test_flex_attention import check_stale_slots_never_read

    check_stale_slots_never_read([100, 45], page_size=16, kv_len=128, q_len=1, q_heads=64,
                                 kv_heads=1, dim=128, stale=np.nan, kernel_options=MOSAIC,
                                 backend="interpret", latent=True)
    assert key_stage


def test_unsupported_shapes_say_why():
    reason = decode_latent_stage_mosaic.unsupported_reason
    assert reason(576, 512, None, 128) is None
    assert reason(576, 512, 64, 128) is None and reason(576, 512, 16, 128) is None
    assert "D - Dv" in reason(640, 256, None, 128)
    assert "exceed shared memory" in reason(640, 512, None, 128)
    assert "pages of 48" in reason(576, 512, 48, 128)


@pytest.mark.gpu
def test_deepseek_shape_on_gpu_matches_float64_and_the_split_column_kernel(key_stage):
    q, latent, _ = random_qkv(13, 2, 1, 1000, 128, 1, 576, 512, jnp.bfloat16)
    mask_mod = masks.offset(masks.causal_mask, jnp.array([999, 517], jnp.int32))
    out = pf.attention(q, latent, None, value_dim=512, mask_mod=mask_mod, backend="pallas")
    assert key_stage == [512]
    v = latent[..., :512]
    expected, _ = golden(q, latent, v, mask_mod=mask_mod)
    assert_close_to_golden(out, expected, q, latent, v, mask_mod=mask_mod)
    sliced = pf.attention(q, latent, v, mask_mod=mask_mod, backend="pallas")
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)),
                               np.asarray(sliced.astype(jnp.float32)), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_deepseek_shape_on_latent_pages_on_gpu(key_stage, page_size):
    """DeepSeek's shape on a latent PagedKVCache of pages of 64 (FlashMLA's) and 16 (four
    a tile), lengths crossing a tile, against float64; stale NaN slots never read."""
    from tests.paged.test_flex_attention import check_paged_against_golden

    check_paged_against_golden([1000, 517], page_size, 1, 128, 1, 576, 512, jnp.bfloat16,
                               "causal", None, MOSAIC, "pallas", latent=True)
    assert key_stage and set(key_stage) == {512}
