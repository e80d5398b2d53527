"""return_aux=pf.AuxRequest(lse=, max_scores=): the row max of the logits from the forward
kernels' running max (issue 21), against the dense reference; it carries no gradient and
leaves the others unchanged."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flex as pf
from pallas_flex.kernels.reference import reference_attention


def _mask(b, h, q_idx, kv_idx):  # causal, with row 5 fully masked
    return (q_idx >= kv_idx) & (q_idx != 5)


def _inputs(dtype=jnp.float32, q_len=200, kv_len=200, heads=4, kv_heads=2, dim=32):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (2, q_len, heads, dim), dtype),
            jax.random.normal(keys[1], (2, kv_len, kv_heads, dim), dtype),
            jax.random.normal(keys[2], (2, kv_len, kv_heads, dim), dtype))


@pytest.mark.parametrize("backend", ["xla", "interpret", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_max_scores_equal_the_reference_row_max(backend, dtype):
    q, k, v = _inputs(dtype, q_len=150, kv_len=200)  # Sq != Skv, GQA, ragged blocks
    score_mod = pf.scores.alibi(pf.scores.alibi_slopes(4))
    out, aux = pf.attention(q, k, v, mask_mod=_mask, score_mod=score_mod, backend=backend,
                            return_aux=pf.AuxRequest(lse=True, max_scores=True))
    _, lse, expected = reference_attention(q, k, v, mask_mod=_mask, score_mod=score_mod,
                                           return_max=True)
    assert aux.max_scores.shape == (2, 4, 150) and aux.max_scores.dtype == jnp.float32
    assert bool(jnp.all(jnp.isneginf(aux.max_scores[:, :, 5])))  # the fully masked row
    finite = jnp.isfinite(expected)
    np.testing.assert_allclose(jnp.where(finite, aux.max_scores, 0),
                               jnp.where(finite, expected, 0),
                               atol=2e-5 if dtype == jnp.float32 else 2e-2)
    assert bool(jnp.all(finite == jnp.isfinite(aux.max_scores)))
    _, lse = pf.attention(q, k, v, mask_mod=_mask, score_mod=score_mod, backend=backend,
                          return_lse=True)
    np.testing.assert_allclose(aux.lse, lse, atol=1e-6)


def test_the_decode_kernel_gives_the_max_of_its_split_kv_parts():
    q, k, v = _inputs(q_len=3, kv_len=1000)  # Sq <= 16: the split-KV decode kernel
    assert "decode" in pf.explain(q, k, v, backend="interpret")
    out, aux = pf.attention(q, k, v, backend="interpret",
                            return_aux=pf.AuxRequest(max_scores=True))
    assert aux.lse is None
    _, _, expected = reference_attention(q, k, v, return_max=True)
    np.testing.assert_allclose(aux.max_scores, expected, atol=2e-5)
    np.testing.assert_allclose(out, pf.attention(q, k, v, backend="interpret"), atol=2e-6)


def test_the_max_has_no_gradient_and_the_others_are_unchanged():
    q, k, v = _inputs()

    def loss(q, with_aux):
        if not with_aux:
            return jnp.sum(pf.attention(q, k, v, mask_mod=_mask, backend="interpret") ** 2)
        out, aux = pf.attention(q, k, v, mask_mod=_mask, backend="interpret",
                                return_aux=pf.AuxRequest(max_scores=True))
        return jnp.sum(out ** 2)
    np.testing.assert_array_equal(jax.grad(loss)(q, True), jax.grad(loss)(q, False))
    only_max = jax.grad(lambda q: jnp.sum(jnp.where(jnp.isfinite(m := pf.attention(
        q, k, v, mask_mod=_mask, backend="interpret",
        return_aux=pf.AuxRequest(max_scores=True))[1].max_scores), m, 0.0)))(q)
    assert not bool(jnp.any(only_max))


def test_batch_sharded_calls_give_each_shard_s_max():
    q, k, v = _inputs()
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v)]
    call = jax.jit(lambda q, k, v: pf.attention(q, k, v, mask_mod=_mask, backend="xla",
                                                return_aux=pf.AuxRequest(max_scores=True)))
    np.testing.assert_allclose(call(*placed)[1].max_scores, call(q, k, v)[1].max_scores,
                               atol=1e-6)


def test_bad_requests_are_value_errors():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="not both"):
        pf.attention(q, k, v, return_lse=True, return_aux=pf.AuxRequest(lse=True))
    with pytest.raises(ValueError, match="AuxRequest"):
        pf.attention(q, k, v, return_aux={"max_scores": True})


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("score", ["none", "alibi"])  # ALiBi: a query-only row term
def test_the_mosaic_forward_writes_the_row_max(backend, score):
    """The Hopper kernel (its interpret mode on a CPU): bf16, GQA, ragged lengths, Sq !=
    Skv (in interpret mode 2 x 2 tiles, on the GPU 3 x 2)."""
    q_len, kv_len = (200, 130) if backend == "interpret" else (300, 200)
    q, k, v = _inputs(jnp.bfloat16, q_len=q_len, kv_len=kv_len, dim=64)
    score_mod = pf.scores.alibi(pf.scores.alibi_slopes(4)) if score == "alibi" else None
    out, aux = pf.attention(q, k, v, mask_mod=_mask, score_mod=score_mod, backend=backend,
                            kernel_options={"forward_kernel": "mosaic"},
                            return_aux=pf.AuxRequest(lse=True, max_scores=True))
    _, lse, expected = reference_attention(q, k, v, mask_mod=_mask, score_mod=score_mod,
                                           return_max=True)
    finite = jnp.isfinite(expected)
    assert bool(jnp.all(finite == jnp.isfinite(aux.max_scores)))
    np.testing.assert_allclose(jnp.where(finite, aux.max_scores, 0),
                               jnp.where(finite, expected, 0), atol=2e-2)
    np.testing.assert_allclose(jnp.where(finite, aux.lse, 0), jnp.where(finite, lse, 0),
                               atol=2e-2)
    plain = pf.attention(q, k, v, mask_mod=_mask, score_mod=score_mod, backend=backend,
                         kernel_options={"forward_kernel": "mosaic"})
    np.testing.assert_array_equal(out, plain)  # asking for the max changes nothing else


def _paged_cache(dtype, lengths=(70, 33), heads=2, dim=32, written=96):
    """Rows of `lengths` tokens whose pages also hold `written - length` stale tokens
    past the length, with keys 30x larger: a max that read them would be far off."""
    cache = pf.paged.PagedKVCache.create(num_pages=16, page_size=16, max_batch=len(lengths),
                                         max_pages_per_seq=8, kv_heads=heads, head_dim=dim,
                                         dtype=dtype)
    for b in range(len(lengths)):
        cache = cache.reserve(b, written)
        k, v = (jax.random.normal(jax.random.key(10 * b + i), (written, heads, dim),
                                  jnp.float32) for i in (1, 2))
        stale = (jnp.arange(written) >= lengths[b])[:, None, None]
        k = jnp.where(stale, 30 * jnp.abs(k), k)
        cache = cache.assign(b, 0, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    return dataclasses.replace(cache, lengths=jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("q_len", [1, 40])  # the decode kernel; the paged forward kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_paged_calls_give_the_row_max_over_each_row_s_length(backend, q_len, dtype):
    """The row max over the keys within each row's length, as the dense reference on the
    cache's (dequantized) contents gives it; lse as return_lse gives it."""
    cache = _paged_cache(dtype)
    q = jax.random.normal(jax.random.key(7), (2, q_len, 4, 32), jnp.float32).astype(
        jnp.bfloat16)
    mask = pf.masks.offset(pf.masks.causal_mask, cache.lengths - q_len)
    out, aux = pf.paged.paged_flex_attention(
        q, cache, mask_mod=mask, backend=backend,
        return_aux=pf.AuxRequest(lse=True, max_scores=True))
    k, v = pf.paged.gather_contiguous(cache)
    lengths = cache.lengths

    def in_length(b, h, q_idx, kv_idx):
        return (q_idx + lengths[b] - q_len >= kv_idx) & (kv_idx < lengths[b])
    _, lse, expected = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), mask_mod=in_length,
                                           return_max=True)
    assert aux.max_scores.shape == (2, 4, q_len)
    np.testing.assert_allclose(aux.max_scores, expected, atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(aux.lse, lse, atol=2e-2, rtol=1e-2)
    _, plain_lse = pf.paged.paged_flex_attention(q, cache, mask_mod=mask, backend=backend,
                                                 return_lse=True)
    np.testing.assert_allclose(aux.lse, plain_lse, atol=1e-6)
