"""Values taken from the keys: `flex_attention(q, k, None, value_dim=Dv)` (a latent cache,
DeepSeek's MLA: one array whose first Dv columns are the values).

The latent decode reads them from k in place (no k[..., :Dv] copy); every other kernel,
and the backward, takes the slice. Results and gradients equal those of passing the
slice as v, on each backend, against float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels import decode_latent_mosaic
from tests.conftest import assert_close_to_golden, golden, random_qkv

MOSAIC = {"decode_kernel": "mosaic"}


def _decode_inputs(dtype=jnp.bfloat16, kv_len=300, dim=256, value_dim=128, q_heads=64):
    q, k, _ = random_qkv(3, 2, 1, kv_len, q_heads, 1, dim, value_dim, dtype)
    offsets = jnp.array([kv_len - 1, 150], jnp.int32)
    return q, k, masks.offset(masks.causal_mask, offsets)


def _spy_on_the_latent_decode(monkeypatch):
    """The latent decode's calls: (whether v is k itself, value_dim, v's last dim)."""
    seen = []
    run = decode_latent_mosaic.latent_decode

    def spy(q, k, v, block_mask, **kwargs):
        seen.append((v is k, kwargs["value_dim"], v.shape[3]))
        return run(q, k, v, block_mask, **kwargs)
    monkeypatch.setattr(decode_latent_mosaic, "latent_decode", spy)
    return seen


@pytest.mark.parametrize("backend,options", [("interpret", MOSAIC), ("xla", None),
                                             ("reference", None)])
def test_decode_matches_float64_on_the_keys_first_columns(backend, options, monkeypatch):
    """Against float64 on every backend. The Mosaic latent decode (interpret) gets k
    itself as the values' array with Dv, not the slice (which XLA then drops, nothing
    else using it), and agrees with the call on the slice up to float32 summation
    order (that one runs the split-column kernel, k itself the key-stage kernel's
    64-key tiles: `decode_latent_mosaic.VALUES_FROM_KEY_STAGE`)."""
    seen = _spy_on_the_latent_decode(monkeypatch)
    q, k, mask_mod = _decode_inputs()
    out, lse = pf.attention(q, k, None, value_dim=128, mask_mod=mask_mod, return_lse=True,
                            backend=backend, kernel_options=options)
    v = k[..., :128]
    expected_out, expected_lse = golden(q, k, v, mask_mod=mask_mod)
    assert out.shape == (2, 1, 64, 128) and out.dtype == q.dtype
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod=mask_mod)
    np.testing.assert_allclose(np.asarray(lse, np.float64), expected_lse, atol=2e-3,
                               rtol=1e-4)
    if backend != "interpret":
        return
    sliced = pf.attention(q, k, v, mask_mod=mask_mod, backend=backend, kernel_options=options)
    assert seen == [(True, 128, 256), (False, 128, 128)]
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)),
                               np.asarray(sliced.astype(jnp.float32)), atol=8e-3, rtol=2e-2)


@pytest.mark.parametrize("q_len", [1, 40])
def test_gradients_join_k(q_len):
    """d/dk of a call with the values in the keys: the keys' gradient plus the values'
    in k's first Dv columns, as with v = k[..., :Dv]."""
    q, k, _ = random_qkv(5, 1, q_len, 96, 4, 2, 32, 16, jnp.float32)
    weights = jax.random.normal(jax.random.PRNGKey(1), (1, q_len, 4, 16))

    def loss(q, k, in_keys):
        v = None if in_keys else k[..., :16]
        out = pf.attention(q, k, v, value_dim=16 if in_keys else None,
                           mask_mod=masks.causal_mask if q_len > 1 else None, backend="xla")
        return jnp.sum(out * weights)
    grads = jax.grad(loss, argnums=(0, 1))(q, k, True)
    expected = jax.grad(loss, argnums=(0, 1))(q, k, False)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)
    assert float(jnp.abs(grads[1][..., :16]).max()) > 0  # the values' part is there


@pytest.mark.parametrize("v,value_dim,match", [
    (None, None, "pass value_dim"),
    ("slice", 16, "pass v=None"),
    (None, 0, "value_dim must be an int from 1"),
    (None, 33, "value_dim must be an int from 1"),
    (None, 16.0, "value_dim must be an int from 1"),
    (None, True, "value_dim must be an int from 1"),
])
def test_bad_value_dim_is_a_value_error(v, value_dim, match):
    q, k, _ = random_qkv(5, 1, 1, 64, 4, 1, 32, 16, jnp.float32)
    v = k[..., :16] if v == "slice" else v
    with pytest.raises(ValueError, match=match):
        pf.flex_attention(q, k, v, value_dim=value_dim, backend="xla")
    with pytest.raises(ValueError, match=match):
        pf.attention(q, k, v, value_dim=value_dim, backend="xla")


def test_values_in_keys_refuse_a_quantized_cache_and_context_parallel():
    q, k, _ = random_qkv(5, 1, 1, 64, 4, 1, 32, 16, jnp.float32)
    scales = jnp.ones((1, 64, 1), jnp.float32)
    with pytest.raises(ValueError, match="quantized cache"):
        pf.flex_attention(q, k, None, value_dim=16, k_scales=scales, v_scales=scales)
    with pytest.raises(ValueError, match="context_parallel"):
        pf.attention(q, k, None, value_dim=16,
                     context_parallel=pf.ContextParallel(axis_name="x"))


def test_value_dim_is_not_a_kernel_option():
    q, k, v = random_qkv(5, 1, 1, 64, 4, 1, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="unknown keys.*values_in_keys"):
        pf.flex_attention(q, k, v, backend="xla", kernel_options={"values_in_keys": True})


@pytest.mark.gpu
def test_deepseek_latent_cache_on_gpu_matches_float64_and_the_slice():
    """Hq 128, one latent array [B, S, 1, 576] with the values its first 512 columns, on
    the Mosaic latent decode (chosen automatically on Hopper): against float64, and
    against the same call given the slice as v (that one runs the split-column kernel,
    the latent in place the key-stage kernel: equal up to float32 summation order)."""
    q, latent, _ = random_qkv(13, 2, 1, 1000, 128, 1, 576, 512, jnp.bfloat16)
    mask_mod = masks.offset(masks.causal_mask, jnp.array([999, 517], jnp.int32))
    out = pf.attention(q, latent, None, value_dim=512, mask_mod=mask_mod, backend="pallas")
    sliced = pf.attention(q, latent, latent[..., :512], mask_mod=mask_mod, backend="pallas")
    v = latent[..., :512]
    expected, _ = golden(q, latent, v, mask_mod=mask_mod)
    assert_close_to_golden(out, expected, q, latent, v, mask_mod=mask_mod)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)),
                               np.asarray(sliced.astype(jnp.float32)), atol=8e-3, rtol=2e-2)


# -- paged: a latent cache (`PagedKVCache.create(latent=True)`) -----------------------------

@pytest.mark.parametrize("backend,options,page_size", [
    ("interpret", MOSAIC, 16), ("interpret", MOSAIC, 64), ("xla", None, 16),
    pytest.param("pallas", None, 64, marks=pytest.mark.gpu)])
def test_latent_paged_cache_matches_float64(backend, options, page_size, monkeypatch):
    """paged_flex_attention over a latent cache (key pages only): the latent decode on
    pages of 16 (two a tile) and 64, and the gathered XLA path, against float64 over the
    gathered keys and their first Dv columns."""
    from tests.paged.test_flex_attention import check_paged_against_golden

    seen = _spy_on_the_latent_decode(monkeypatch)
    check_paged_against_golden([150, 61], page_size, 1, 64, 1, 256, 128, jnp.bfloat16,
                               "causal", None, options, backend, latent=True)
    if backend == "interpret":  # the latent decode reads the key pages in place
        assert seen and all(call[:2] == (True, 128) for call in seen), seen


def test_latent_cache_stores_keys_once_and_gathers_the_values_from_them():
    cache = pf.paged.PagedKVCache.create(num_pages=4, page_size=8, max_batch=1,
                                         max_pages_per_seq=2, kv_heads=1, head_dim=6,
                                         value_dim=4, latent=True, dtype=jnp.float32)
    assert cache.v_pages is None and cache.latent and cache.value_dim == 4
    k = jnp.arange(10 * 6, dtype=jnp.float32).reshape(10, 1, 6)
    cache = cache.reserve(0, 10).assign(0, 0, k)
    keys, values = pf.paged.gather_contiguous(cache)
    np.testing.assert_array_equal(np.asarray(keys[0, :10]), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(values[0, :10]), np.asarray(k[..., :4]))
    assert values.shape == (1, 16, 1, 4)
    batch = cache.assign_batch(jnp.array([10]), k[None, :2])  # v None as well
    assert int(batch.lengths[0]) == 12


@pytest.mark.parametrize("build,match", [
    (lambda: pf.paged.PagedKVCache.create(2, 8, 1, 2, 1, 4, value_dim=6, latent=True),
     "value_dim \\(6\\) must be at most head_dim"),
    (lambda: pf.paged.PagedKVCache.create(2, 8, 1, 2, 1, 4, latent=True, dtype=jnp.int8),
     "latent cache takes 16- or 32-bit"),
    (lambda: pf.paged.PagedKVCache.create(2, 8, 1, 2, 1, 4, latent=True).reserve(0, 2)
     .assign(0, 0, jnp.zeros((2, 1, 4), jnp.bfloat16), jnp.zeros((2, 1, 4), jnp.bfloat16)),
     "pass v=None"),
    (lambda: pf.paged.PagedKVCache.create(2, 8, 1, 2, 1, 4).reserve(0, 2)
     .assign(0, 0, jnp.zeros((2, 1, 4), jnp.bfloat16)),
     "only a latent cache"),
])
def test_latent_cache_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()
