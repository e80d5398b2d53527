"""Quantized paged KV caches (int8, float8_e4m3fn with per-(token, head) scales): what
is written is quantized, the kernels (decode and paged prefill, in interpret mode) apply
the scales inside, and outputs equal dense attention over the dequantized values."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import dispatch
from pallas_flex.kernels.config import resolve_options
from pallas_flex.kernels.reference import reference_attention
from pallas_flex.paged import PagedKVCache, gather_contiguous, paged_flex_attention
from pallas_flex.paged.quantize import dequantize, dequantized_pages, quantize

B, HKV, HQ, D = 2, 2, 4, 64
LENGTHS = (70, 33)
DTYPES = [jnp.int8, jnp.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_round_trip_error_is_bounded(dtype):
    x = jax.random.normal(jax.random.key(0), (5, 3, D)) * jnp.array([0.01, 1.0, 100.0])[
        None, :, None]
    values, scales = quantize(x, dtype)
    assert values.dtype == dtype and scales.shape == (5, 3) and scales.dtype == jnp.float32
    error = jnp.abs(dequantize(values, scales) - x)
    largest = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    # int8: half a step of max/127; float8 e4m3: 3 mantissa bits, 2^-4 relative.
    bound = largest / 254 if dtype == jnp.int8 else jnp.abs(x) / 16 + largest / 448 / 8
    assert bool(jnp.all(error <= bound * 1.0001 + 1e-12)), float(jnp.max(error - bound))
    zeros, zero_scales = quantize(jnp.zeros((2, D)), dtype)
    assert bool(jnp.all(dequantize(zeros, zero_scales) == 0))


def _cache(dtype, page_size=16, v_magnitude=1.0):
    """(a cache of LENGTHS' rows of normal keys and values times `v_magnitude`, the
    keys and values written)."""
    cache = PagedKVCache.create(num_pages=32, page_size=page_size, max_batch=B,
                                max_pages_per_seq=8, kv_heads=HKV, head_dim=D, dtype=dtype)
    keys, values = [], []
    for b, length in enumerate(LENGTHS):
        cache = cache.reserve(b, length)
        k = jax.random.normal(jax.random.key(b), (length, HKV, D)).astype(jnp.bfloat16)
        v = (jax.random.normal(jax.random.key(10 + b), (length, HKV, D)) * v_magnitude
             ).astype(jnp.bfloat16)
        cache = cache.assign(b, 0, k, v)
        keys.append(k)
        values.append(v)
    return cache, keys, values


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_are_quantized_per_token_and_head(dtype):
    cache, keys, _ = _cache(dtype)
    assert cache.quantized and cache.k_pages.dtype == dtype
    k_all, _ = gather_contiguous(cache)
    values, scales = quantize(keys[0], dtype)
    np.testing.assert_allclose(k_all[0, :LENGTHS[0]], dequantize(values, scales), rtol=1e-6)
    assert bool(jnp.all(k_all[0, LENGTHS[0]:] == 0))
    plain = PagedKVCache.create(num_pages=4, page_size=16, max_batch=1, max_pages_per_seq=2,
                                kv_heads=HKV, head_dim=D)
    assert not plain.quantized and plain.k_scales is None


def _decode_step(cache, q_len, seed, magnitude=1.0, dtype=jnp.bfloat16):
    """(q, normal times `magnitude` in `dtype`, its offset causal mask_mod, dense
    attention over the dequantized cache)."""
    k_all, v_all = gather_contiguous(cache)
    q = (jax.random.normal(jax.random.key(seed), (B, q_len, HQ, D)) * magnitude).astype(dtype)
    lengths = cache.lengths

    def dense_mask(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (q_idx + lengths[b] - q_len >= kv_idx)
    expected, _ = reference_attention(q, k_all, v_all, mask_mod=dense_mask)
    return q, pf.masks.offset(pf.masks.causal_mask, lengths - q_len), expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 12])  # a tile inside a page / across pages
@pytest.mark.parametrize("q_len", [1, 40])  # the decode kernel / the paged prefill
def test_kernels_equal_attention_over_the_dequantized_cache(dtype, page_size, q_len):
    cache, keys, values = _cache(dtype, page_size)
    q, mask_mod, expected = _decode_step(cache, q_len, 5)
    # The prefill reads the 8-bit pages dequantized first (the default) or in its kernel.
    runs = [("xla", None)] + [("interpret", {"quantized_prefill": way})
                              for way in ("in_kernel", "dequantize")]
    for backend, options in runs:
        out = paged_flex_attention(q, cache, mask_mod=mask_mod, backend=backend,
                                   kernel_options=options)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=1.5e-2,
                                   err_msg=f"{backend} {options}")
    # Against the unquantized cache: the quantization's own loss, small.
    unquantized = PagedKVCache.create(num_pages=32, page_size=page_size, max_batch=B,
                                      max_pages_per_seq=8, kv_heads=HKV, head_dim=D)
    for b, length in enumerate(LENGTHS):
        unquantized = unquantized.reserve(b, length).assign(b, 0, keys[b], values[b])
    exact = paged_flex_attention(q, unquantized, mask_mod=mask_mod, backend="interpret")
    loss = float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact.astype(jnp.float32))))
    assert loss < (0.05 if dtype == jnp.int8 else 0.15), loss


def test_quantized_cache_errors():
    cache, _, _ = _cache(jnp.int8)
    with pytest.raises(ValueError, match="dtype must be"):
        PagedKVCache.create(num_pages=4, page_size=16, max_batch=1, max_pages_per_seq=2,
                            kv_heads=1, head_dim=8, dtype=jnp.int32)
    with pytest.raises(ValueError, match="quantized"):
        paged_flex_attention(jnp.zeros((B, 1, HQ, D), jnp.int8), cache, backend="interpret")
    with pytest.raises(ValueError, match="quantized"):
        cache.assign(0, 0, jnp.zeros((1, HKV, D), jnp.int8), jnp.zeros((1, HKV, D), jnp.int8))
    with pytest.raises(ValueError, match="Mosaic GPU forward does not read quantized"):
        paged_flex_attention(jnp.zeros((B, 40, HQ, D), jnp.bfloat16), cache,
                             backend="interpret", kernel_options={
                                 "forward_kernel": "mosaic", "quantized_prefill": "in_kernel"})
    with pytest.raises(ValueError, match="quantized_prefill"):
        paged_flex_attention(jnp.zeros((B, 40, HQ, D), jnp.bfloat16), cache,
                             backend="interpret",
                             kernel_options={"quantized_prefill": "sometimes"})


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantized_pages_hold_each_rows_pages_in_order(dtype):
    cache, _, _ = _cache(dtype, 16)
    pages, table = dequantized_pages(cache.k_pages, cache.k_scales, cache.page_table,
                                     jnp.bfloat16)
    assert pages.dtype == jnp.bfloat16 and table.shape == cache.page_table.shape
    assert pages.shape == (B * cache.max_pages_per_seq,) + cache.k_pages.shape[1:]
    k_all, _ = gather_contiguous(cache)  # float32, dequantized, zero past the lengths
    for b, length in enumerate(LENGTHS):
        rows = pages[table[b]]  # [max_pages, Hkv, page, D] -> [positions, Hkv, D]
        rows = jnp.swapaxes(rows, 1, 2).reshape(-1, HKV, D)[:length]
        np.testing.assert_allclose(rows.astype(jnp.float32), k_all[b, :length],
                                   rtol=2 ** -8, atol=1e-6)


def test_the_prefill_choice_over_a_quantized_cache(monkeypatch):
    cache, _, _ = _cache(jnp.int8)
    q = jnp.zeros((B, 40, HQ, D), jnp.bfloat16)
    block_mask = pf.create_block_mask(pf.masks.causal_mask, None, None, 40,
                                      cache.max_seq_len)
    choose = functools.partial(dispatch.choose_forward, q, cache.k_pages, cache.v_pages,
                               block_mask, None, backend="pallas", paged=True, quantized=True)
    choice = choose(options=resolve_options(None, D, q.dtype))
    assert choice.kernel == "dequantized_pages" and choice.then is not None
    assert choice.then.kernel in ("mosaic_forward", "triton_forward")
    assert choice.then.kernel in choice.reason
    choice = choose(options=resolve_options({"quantized_prefill": "in_kernel"}, D, q.dtype))
    assert choice.kernel == "triton_forward" and "in_kernel" in choice.reason
    # "auto" (the default) reads in place where the dequantized pages would pass the
    # limit: B x max_seq_len x Hkv x (D + Dv) x 2 bytes = 2 x 128 x 2 x 128 x 2 here.
    dequantized = B * cache.max_seq_len * HKV * 2 * D * 2
    for limit, kernel in ((dequantized, "dequantized_pages"), (dequantized - 1,
                                                               "triton_forward")):
        monkeypatch.setattr(dispatch, "QUANTIZED_PREFILL_MAX_BYTES", limit)
        assert choose(options=resolve_options(None, D, q.dtype)).kernel == kernel, limit
        assert choose(options=resolve_options({"quantized_prefill": "dequantize"}, D,
                                              q.dtype)).kernel == "dequantized_pages"
    # The decode reads the pages in place whatever the option says.
    decode = dispatch.choose_forward(q[:, :1], cache.k_pages, cache.v_pages,
                                     pf.create_block_mask(pf.masks.causal_mask, None, None, 1,
                                                          cache.max_seq_len),
                                     None, backend="pallas", paged=True, quantized=True,
                                     options=resolve_options(None, D, q.dtype))
    assert decode.kernel == "decode"


def test_assign_batch_under_jit_quantizes_every_row():
    cache = PagedKVCache.create(num_pages=16, page_size=16, max_batch=B, max_pages_per_seq=4,
                                kv_heads=HKV, head_dim=D, dtype=jnp.float8_e4m3fn)
    cache = cache.reserve(0, 8).reserve(1, 8)
    k = jax.random.normal(jax.random.key(3), (B, 8, HKV, D))
    cache = jax.jit(lambda c, k: c.assign_batch(jnp.zeros(B, jnp.int32), k, k))(cache, k)
    k_all, v_all = gather_contiguous(cache)
    values, scales = quantize(k, jnp.float8_e4m3fn)
    np.testing.assert_allclose(k_all[:, :8], dequantize(values, scales), rtol=1e-6)
    np.testing.assert_allclose(v_all[:, :8], dequantize(values, scales), rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,prefill", [(1, "dequantize"), (40, "dequantize"),
                                           (40, "in_kernel")])
def test_the_gpu_kernels_read_quantized_pages(dtype, q_len, prefill):
    cache, _, _ = _cache(dtype)
    q, mask_mod, expected = _decode_step(cache, q_len, 6)
    out = paged_flex_attention(q, cache, mask_mod=mask_mod, backend="pallas",
                               kernel_options={"quantized_prefill": prefill})
    np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=1.5e-2)


@pytest.mark.parametrize("q_magnitude,v_magnitude", [(3e5, 1.0), (1e-3, 1.0), (1e-7, 1.0),
                                                      (1.0, 1e-4)])
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_float8_decode_takes_bfloat16_inputs_of_any_magnitude(backend, q_magnitude,
                                                              v_magnitude):
    """Over float8 pages the decode's matmuls run in float16 (`decode._decode_kernel`):
    bfloat16 queries past float16's range (65504) or below its normals (6.1e-5) are
    scaled by a power of two first, and P's columns times values' scales near 2e-7
    (values of magnitude 1e-4) are taken relative to a power of two near each tile's
    first scale (`online_softmax.update_chunks`), so the output still equals dense
    attention over the cache's values, to 1 % of its largest magnitude (as float16's
    subnormals, P.v was off by 6 %)."""
    cache, _, _ = _cache(jnp.float8_e4m3fn, v_magnitude=v_magnitude)
    q, mask_mod, expected = _decode_step(cache, 1, 8, q_magnitude)
    out = paged_flex_attention(q, cache, mask_mod=mask_mod, backend=backend)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    largest = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(out.astype(jnp.float32) / largest, expected / largest,
                               atol=1e-2)


@pytest.mark.parametrize("q_len", [1, 40])  # the decode kernel / the paged prefill's
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_float16_queries_over_small_8bit_values(backend, q_len):
    """float16 queries make every kernel's P.v float16: values of magnitude 1e-4 in an
    int8 cache (scales near 8e-7) still give dense attention's output to 1 % of its
    largest magnitude, in the decode kernel (powers of two by tile, carried) and in the
    prefill's Triton forward reading the pages in its kernel (by tile's largest scale)."""
    cache, _, _ = _cache(jnp.int8, v_magnitude=1e-4)
    q, mask_mod, expected = _decode_step(cache, q_len, 9, dtype=jnp.float16)
    out = paged_flex_attention(q, cache, mask_mod=mask_mod, backend=backend,
                               kernel_options={"quantized_prefill": "in_kernel"})
    largest = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(out.astype(jnp.float32) / largest, expected / largest,
                               atol=1e-2)
