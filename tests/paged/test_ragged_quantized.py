"""The ragged op (OpenVINO PagedAttention) over quantized caches (int8, float8 with
per-(token, head) scales, the spec's KV-cache compression): new tokens are quantized as
they are written, and the outputs equal the op over 16-bit caches holding the same
dequantized values, on the XLA loop and the Pallas kernel (interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex.masks import alibi_slopes
from pallas_flex.paged import paged_attention
from pallas_flex.paged.quantize import dequantize, quantize
from tests.paged.ragged_reference import reference_paged_attention, to_float64
from tests.paged.test_ragged import RAGGED_BACKENDS, _rotation, case_config, make_case

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


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_float16_queries_over_small_quantized_values(dtype, backend):
    """float16 queries make the ragged kernel's P.v float16: values of magnitude 1e-4
    (scales near 2e-7 in float8) keep float16's precision, their scales taken relative
    to a power of two a tile (`online_softmax.update_chunks`): the output equals the
    XLA loop's over the dequantized caches to 1 % of its largest magnitude."""
    keys = jax.random.split(jax.random.key(1), 5)
    key_cache = jax.random.normal(keys[0], (NUM_BLOCKS, HKV, BLOCK, D))
    value_cache = jax.random.normal(keys[1], (NUM_BLOCKS, HKV, BLOCK, D)) * 1e-4
    q = jax.random.normal(keys[2], (6, HQ * D)).astype(jnp.float16)
    k = jax.random.normal(keys[3], (6, HKV * D)).astype(jnp.float16)
    v = (jax.random.normal(keys[4], (6, HKV * D)) * 1e-4).astype(jnp.float16)
    (k_stored, k_scales), (v_stored, v_scales) = (quantize(x, dtype)
                                                  for x in (key_cache, value_cache))
    out = paged_attention(q, k, v, k_stored, v_stored, PAST, BEGINS, BLOCKS, BLOCK_BEGINS,
                          backend=backend, key_cache_scales=k_scales,
                          value_cache_scales=v_scales)[0]
    want = paged_attention(q, k, v, k_stored, v_stored, PAST, BEGINS, BLOCKS, BLOCK_BEGINS,
                           backend="xla", key_cache_scales=k_scales,
                           value_cache_scales=v_scales)[0]
    largest = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(out.astype(jnp.float32) / largest,
                               want.astype(jnp.float32) / largest, atol=1e-2)


def test_quantized_cache_arguments_are_checked():
    cache = jnp.zeros((NUM_BLOCKS, HKV, BLOCK, D), jnp.int8)
    scales = jnp.ones((NUM_BLOCKS, HKV, BLOCK), jnp.float32)
    q, k = jnp.zeros((6, HQ * D), jnp.bfloat16), jnp.zeros((6, HKV * D), jnp.bfloat16)
    args = (q, k, k, cache, cache, PAST, BEGINS, BLOCKS, BLOCK_BEGINS)
    with pytest.raises(ValueError, match="key_cache_scales must be float32"):
        paged_attention(*args, value_cache_scales=scales)
    with pytest.raises(ValueError, match="value_cache_scales must be float32"):
        paged_attention(*args, key_cache_scales=scales, value_cache_scales=scales[:, :1])
    # The spec's rotation metadata is checked on quantized caches as on 16-bit ones.
    rotation = dict(rotated_block_indices=jnp.array([5]),
                    rotation_deltas=jnp.zeros((1, 1), jnp.int32),
                    rotation_trig_lut=jnp.ones((1, D)))
    for change, message in [
            (dict(rotation_trig_lut=None), "rotation_trig_lut missing"),
            (dict(rotated_block_indices=jnp.array([5, 99])), r"rotated_block_indices\[1\] = 99"),
            (dict(rotated_block_indices=jnp.array([5, 5])), "lists block 5 twice"),
            (dict(rotation_deltas=jnp.ones((1, 1), jnp.int32)), "not a row of rotation_trig"),
            (dict(rotation_deltas=jnp.zeros((1, 3), jnp.int32)), "rotation_deltas must be"),
            (dict(rotation_trig_lut=jnp.ones((1, D + 1))), "rotation_trig_lut must be")]:
        bad = dict(rotation, **change)
        if bad["rotated_block_indices"].shape[0] == 2:
            bad["rotation_deltas"] = jnp.zeros((2, 1), jnp.int32)
        with pytest.raises(ValueError, match=message):
            paged_attention(*args, key_cache_scales=scales, value_cache_scales=scales, **bad)


# -- the spec's inputs 13-15 on quantized caches ---------------------------------------------


def _written_slots(case, num_blocks, block_size):
    """bool [num_blocks, block_size]: the slots the new tokens are written to."""
    written = np.zeros((num_blocks, block_size), bool)
    past, begins = np.asarray(case["past_lens"]), np.asarray(case["subsequence_begins"])
    blocks, block_begins = (np.asarray(case[name]) for name in ("block_indices",
                                                                "block_indices_begins"))
    for s in range(len(past)):
        for position in range(past[s], past[s] + begins[s + 1] - begins[s]):
            written[blocks[block_begins[s] + position // block_size], position % block_size] = 1
    return written


def _quantization_bound(exact, dtype):
    """The most |quantize-then-dequantize(x) - x| can be, per element of float64 vectors
    `exact` [..., D] (rounding to a step of s = max|x| / 127 for int8; to e4m3's 3
    mantissa bits, or its subnormal step 2^-9 s, for float8), with float32's slack."""
    largest = np.abs(exact).max(axis=-1, keepdims=True)
    if dtype == jnp.int8:
        bound = 0.5 * largest / 127 + 0 * exact
    else:
        bound = np.abs(exact) * 2.0 ** -4 + largest / 448 * 2.0 ** -10
    return bound * (1 + 1e-5) + 1e-6 * largest


def _quantized_rotation_case(config_name, dtype, per_slot):
    """(config, the 16-bit case, its rotation inputs, (keys, key scales), (values, value
    scales)) with the caches quantized to `dtype`."""
    config, seqs = case_config(config_name)
    case = make_case(3, seqs, **config)
    _, _, block_size, head_dim = case["key_cache"].shape
    rotation = _rotation(case, block_size, head_dim, per_slot)
    keys, values = (quantize(case[name].astype(jnp.float32), dtype)
                    for name in ("key_cache", "value_cache"))
    return config, case, rotation, keys, values


def _dequantized64(values, scales):
    return to_float64(values) * to_float64(scales)[..., None]


def _assert_matches_model(out, scores, case, config, dtype, key_cache, value_cache,
                          **options):
    """out and scores against a float64 model attending over float64 caches `key_cache`
    and `value_cache`, the new tokens' keys and values as quantized when written."""
    kv_heads = case["key_cache"].shape[1]

    def as_written(x, dim):
        tokens = x.shape[0]
        return _dequantized64(*quantize(x.reshape(tokens, kv_heads, dim).astype(jnp.float32),
                                        dtype)).reshape(tokens, kv_heads * dim)
    want, want_scores, _, _ = reference_paged_attention(
        **dict(case, key=as_written(case["key"], config["head_dim"]),
               value=as_written(case["value"], config["value_dim"]), key_cache=key_cache,
               value_cache=value_cache), **options)
    tolerance = 2e-5 if config["dtype"] == jnp.float32 else 2e-2
    np.testing.assert_allclose(to_float64(out), want, atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(np.asarray(scores)[:want_scores.shape[0]], want_scores,
                               atol=10 * tolerance, rtol=tolerance)
    return want


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "float8"])
@pytest.mark.parametrize("per_slot", [True, False], ids=["deltas_per_slot", "deltas_per_block"])
@pytest.mark.parametrize("config_name", ["gqa_dv_f32_page16", "mqa_bf16_page4"])
@pytest.mark.parametrize("backend", RAGGED_BACKENDS)
def test_rotation_of_quantized_caches(backend, config_name, per_slot, dtype):
    """Rotated blocks of an 8-bit cache are dequantized, rotated and quantized again:
    their keys equal the float64 rotation of the dequantized keys within one
    quantization's error, with the scales `quantize` gives them; every other block's
    stored keys and scales (slots the new tokens fill aside) and the value cache and its
    scales come back bit for bit; the output, over a mixed prefill / decode batch, equals
    a float64 model attending over the returned (dequantized) keys."""
    config, case, rotation, (k_stored, k_scales), (v_stored, v_scales) = (
        _quantized_rotation_case(config_name, dtype, per_slot))
    num_blocks, _, block_size, _ = case["key_cache"].shape
    quantized_case = dict(case, key_cache=k_stored, value_cache=v_stored)
    options = dict(alibi_slopes=alibi_slopes(config["q_heads"]))
    out, scores, k_out, v_out, k_scales_out, v_scales_out = paged_attention(
        **quantized_case, **options, **rotation, key_cache_scales=k_scales,
        value_cache_scales=v_scales, return_scores=True, backend=backend)
    assert (k_out.dtype, v_out.dtype) == (dtype, dtype)

    # The keys: the reference rotates the dequantized keys in float64 (and writes the new
    # tokens unquantized); ours are within the quantization's error of it.
    _, _, want_k, _ = reference_paged_attention(
        **dict(case, key_cache=_dequantized64(k_stored, k_scales),
               value_cache=_dequantized64(v_stored, v_scales)), **rotation)
    got_k = _dequantized64(k_out, k_scales_out)
    assert np.all(np.abs(got_k - want_k) <= _quantization_bound(want_k, dtype))
    rotated = np.asarray(rotation["rotated_block_indices"])
    written = _written_slots(case, num_blocks, block_size)
    limit = 127.0 if dtype == jnp.int8 else 448.0
    fresh = np.zeros((num_blocks, block_size), bool)
    fresh[rotated] = True
    fresh |= written  # slots given new scales: rotated, or written by a new token
    largest = np.abs(want_k).max(axis=-1) / limit  # [blocks, Hkv, block_size]
    np.testing.assert_allclose(to_float64(k_scales_out).transpose(0, 2, 1)[fresh],
                               largest.transpose(0, 2, 1)[fresh], rtol=1e-5)
    # The rotation did something, and the keys and scales elsewhere are untouched.
    assert np.abs(got_k[rotated] - _dequantized64(k_stored, k_scales)[rotated]).max() > 0.1
    kept = ~fresh  # [blocks, block_size]
    for got, given in ((k_out, k_stored), (k_scales_out, k_scales)):
        got, given = np.asarray(got).swapaxes(1, 2), np.asarray(given).swapaxes(1, 2)
        assert got[kept].tobytes() == given[kept].tobytes()
    for got, given in ((v_out, v_stored), (v_scales_out, v_scales)):
        got, given = np.asarray(got).swapaxes(1, 2), np.asarray(given).swapaxes(1, 2)
        assert got[~written].tobytes() == given[~written].tobytes()

    # The output and scores: a float64 model over the returned keys (rotated, then
    # quantized) and values, with the new tokens' keys and values as quantized.
    _assert_matches_model(out, scores, case, config, dtype, got_k,
                          _dequantized64(v_stored, v_scales), **options)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "float8"])
@pytest.mark.parametrize("config_name", ["gqa_dv_f32_page16", "mqa_bf16_page4"])
@pytest.mark.parametrize("backend", RAGGED_BACKENDS)
def test_rotation_in_the_reads_of_quantized_caches(backend, config_name, dtype):
    """rotation_in_cache=False on an 8-bit cache: the output and scores are a float64
    model's over the float64 rotation of the dequantized history keys (no second
    quantization: the stored values rotate before their scales), and the returned keys,
    values and scales are those of the call without rotation (only the new tokens
    written). Deltas per slot, a mixed prefill / decode batch."""
    config, case, rotation, (k_stored, k_scales), (v_stored, v_scales) = (
        _quantized_rotation_case(config_name, dtype, True))
    quantized_case = dict(case, key_cache=k_stored, value_cache=v_stored,
                          key_cache_scales=k_scales, value_cache_scales=v_scales)
    options = dict(alibi_slopes=alibi_slopes(config["q_heads"]))
    out, scores, *caches = paged_attention(**quantized_case, **options, **rotation,
                                           rotation_in_cache=False, return_scores=True,
                                           backend=backend)
    plain = paged_attention(**quantized_case, **options, backend=backend)
    for got, want in zip(caches, plain[1:]):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()

    want = _assert_matches_model(out, scores, case, config, dtype,
                                 _dequantized64(k_stored, k_scales),
                                 _dequantized64(v_stored, v_scales), **options, **rotation)
    # The rotation mattered: the call without it is far from the model.
    assert np.abs(to_float64(plain[0]) - want).max() > 0.05


def test_rotation_of_quantized_caches_under_jit_with_donated_caches_matches_eager():
    config, seqs = case_config("mha_f32_page4")
    case = make_case(4, seqs, **config)
    rotation = _rotation(case, config["block_size"], config["head_dim"], True)
    (k_stored, k_scales), (v_stored, v_scales) = (
        quantize(case[name], jnp.int8) for name in ("key_cache", "value_cache"))
    case = dict(case, key_cache=k_stored, value_cache=v_stored, key_cache_scales=k_scales,
                value_cache_scales=v_scales)
    eager = paged_attention(**case, **rotation, backend="xla")
    names = ("key_cache", "value_cache", "key_cache_scales", "value_cache_scales")
    step = jax.jit(lambda caches, rest, rotation: paged_attention(**caches, **rest, **rotation,
                                                                  backend="xla"),
                   donate_argnums=0)
    got = step({name: jnp.array(case[name], copy=True) for name in names},
               {name: x for name, x in case.items() if name not in names}, rotation)
    for got, want in zip(got, eager):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
