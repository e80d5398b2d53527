"""Context parallelism (`pf.ring_attention`) on four host devices: outputs, lse and
gradients (q, k, v and a captured learnable array) equal single-device attention for the
masks whose blocks cross shard boundaries, with the mods seeing global positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_flex as pf
from pallas_flex import masks

DEVICES = 4
S, B, HQ, HKV, D = 128, 2, 4, 2, 32
DOCUMENT_IDS = jnp.asarray(np.repeat(np.arange(5), [10, 40, 3, 50, 25]), jnp.int32)


def _cases():
    causal = masks.causal_mask

    def documents(b, h, q_idx, kv_idx):  # documents crossing every shard boundary
        return (DOCUMENT_IDS[q_idx] == DOCUMENT_IDS[kv_idx]) & (q_idx >= kv_idx)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 20)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < 40) | (q_idx >= kv_idx)
    return {"causal": (causal, None), "documents": (documents, None),
            "sliding_window": (sliding, None), "prefix_lm": (prefix_lm, None),
            "noop_softcap": (None, masks.tanh_softcap(5.0))}


CASES = _cases()


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count("cpu") < DEVICES:
        pytest.fail("tests/conftest.py asks XLA for 4 host devices; it gave "
                    f"{jax.device_count('cpu')}")
    return jax.make_mesh((DEVICES,), ("cp",), devices=jax.devices("cpu")[:DEVICES],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (B, S, HQ, D), jnp.float32),
            jax.random.normal(keys[1], (B, S, HKV, D), jnp.float32),
            jax.random.normal(keys[2], (B, S, HKV, D), jnp.float32),
            jax.random.normal(keys[3], (B, S, HQ, D), jnp.float32))


def _sharded(mesh, fn, *replicated):
    """fn(q, k, v, *replicated) under shard_map: the sequence split over "cp"."""
    shard = P(None, "cp")
    return jax.jit(jax.shard_map(
        fn, mesh=mesh, in_specs=(shard, shard, shard) + (P(),) * len(replicated),
        out_specs=(shard, P(None, None, "cp")), check_vma=False))


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("case", CASES)
def test_ring_equals_one_device(mesh, case, backend):
    if backend == "interpret" and case not in ("causal", "documents"):
        pytest.skip("interpret mode is slow: two masks cover the kernels' path")
    mask_mod, score_mod = CASES[case]
    q, k, v, d_out = _inputs()

    def single(q, k, v):
        return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                            return_lse=True, backend=backend)

    def ring(q, k, v):
        return pf.ring_attention(q, k, v, axis_name="cp", mask_mod=mask_mod,
                                 score_mod=score_mod, return_lse=True, backend=backend)
    ring = _sharded(mesh, ring)
    (out, lse), (expected, expected_lse) = ring(q, k, v), single(q, k, v)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, expected_lse, atol=2e-5, rtol=2e-5)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v)[0] * d_out)
    got = jax.grad(loss(ring), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(single), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


def test_a_captured_learnable_array_gets_its_gradient(mesh):
    """ALiBi slopes passed replicated: their gradient, summed over the devices' shards by
    shard_map's transpose, equals the single-device one."""
    q, k, v, d_out = _inputs(1)
    slopes = pf.scores.alibi_slopes(HQ)

    def single(q, k, v, slopes):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=pf.scores.alibi(
            slopes), return_lse=True, backend="xla")

    def ring(q, k, v, slopes):
        return pf.ring_attention(q, k, v, axis_name="cp", mask_mod=masks.causal_mask,
                                 score_mod=pf.scores.alibi(slopes), return_lse=True,
                                 backend="xla")
    ring = _sharded(mesh, ring, slopes)

    def loss(attend):
        return lambda slopes, q: jnp.sum(attend(q, k, v, slopes)[0] * d_out)
    got = jax.grad(loss(ring), argnums=(0, 1))(slopes, q)
    want = jax.grad(loss(single), argnums=(0, 1))(slopes, q)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(got[0]))) > 0


def test_a_row_masked_on_every_shard_is_zero_with_finite_gradients(mesh):
    """Queries of document -1 see no key anywhere: zeros, lse -inf, and no NaN reaches
    the gradients through the merges of empty partial results."""
    q, k, v, d_out = _inputs(2)
    ids = DOCUMENT_IDS.at[:7].set(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (ids[q_idx] >= 0) & (q_idx >= kv_idx)

    ring = _sharded(mesh, lambda q, k, v: pf.ring_attention(
        q, k, v, axis_name="cp", mask_mod=mask_mod, return_lse=True, backend="xla"))
    out, lse = ring(q, k, v)
    assert not np.any(np.asarray(out[:, :7])) and np.all(np.isneginf(lse[:, :, :7]))
    grads = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)[0] * d_out), argnums=(0, 1, 2))(
        q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_shards_must_be_4d(mesh):
    with pytest.raises(ValueError, match="4-D shards"):
        _sharded(mesh, lambda q, k, v: (pf.ring_attention(q[0], k, v, axis_name="cp"),
                                        jnp.zeros((B, HQ, S // DEVICES))))(*_inputs()[:3])
