"""Batch and head sharding (`pallas_flex/sharding.py`) on four host devices: `pf.attention`
under `jax.jit` with q, k, v sharded over a 2 x 2 mesh ("data" for batch, "model" for
heads) gives the outputs, lse and gradients (q, k, v and captured arrays) of the same call
on one device, keeps the inputs' shardings, and moves no attention input between devices
(no all-gather in the compiled program); mods see global batch rows and heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flex as pf
from pallas_flex import masks

B, S, HQ, HKV, D = 4, 160, 4, 2, 16
SLOPES = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
LENGTHS = jnp.asarray([160, 37, 100, 129], jnp.int32)  # per batch row: mods read b


def _mesh(axis_type):
    if jax.device_count("cpu") < 4:
        pytest.fail("tests/conftest.py asks XLA for 4 host devices; it gave "
                    f"{jax.device_count('cpu')}")
    return jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices("cpu")[:4],
                         axis_types=(getattr(AxisType, axis_type),) * 2)


def _inputs(q_len=S, kv_heads=HKV, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (B, q_len, HQ, D), jnp.float32),
            jax.random.normal(keys[1], (B, S, kv_heads, D), jnp.float32),
            jax.random.normal(keys[2], (B, S, kv_heads, D), jnp.float32),
            jax.random.normal(keys[3], (B, q_len, HQ, D), jnp.float32))


def _loss_and_grads(backend, decode=False):
    """value_and_grad of <out, d_out> + sum(lse) with respect to q, k, v and the ALiBi
    slopes, for causal-within-length attention whose mask reads b and score_mod reads h."""
    def loss(q, k, v, slopes, d_out):
        def within_length(b, h, q_idx, kv_idx):
            keep = kv_idx < LENGTHS[b]
            return keep if decode else keep & (q_idx >= kv_idx)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx).astype(jnp.float32)

        out, lse = pf.attention(q, k, v, mask_mod=within_length, score_mod=alibi,
                                return_lse=True, backend=backend)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * d_out) + jnp.sum(finite_lse), (out, lse)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _assert_matches(sharded, single, atol):
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=atol)


def _gathered_inputs(compiled_text):
    """The all-gather instructions of a compiled program (none: no input moved)."""
    return [line for line in compiled_text.splitlines() if "all-gather" in line]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_batch_and_head_sharded_call_equals_one_device(axis_type, backend):
    mesh = _mesh(axis_type)
    q, k, v, d_out = _inputs()
    step = _loss_and_grads(backend)
    (loss, (out, lse)), grads = step(q, k, v, SLOPES, d_out)

    spec = NamedSharding(mesh, P("data", None, "model", None))
    replicated = NamedSharding(mesh, P())
    sharded_args = [jax.device_put(x, spec) for x in (q, k, v)] + [
        jax.device_put(SLOPES, replicated), jax.device_put(d_out, spec)]
    (s_loss, (s_out, s_lse)), s_grads = step(*sharded_args)

    _assert_matches((s_out, s_lse), (out, lse), atol=1e-6)
    _assert_matches(s_grads[:3], grads[:3], atol=1e-5)
    # The slopes' gradient sums over every query, key, batch row and head: its partial
    # sums are added in another order across the four devices.
    _assert_matches(s_grads[3], grads[3], atol=1e-4)
    np.testing.assert_allclose(float(s_loss), float(loss), rtol=1e-5)
    for result in (s_out, *s_grads[:3]):
        assert tuple(result.sharding.spec)[:3] == ("data", None, "model"), result.sharding
    assert tuple(s_lse.sharding.spec)[:2] == ("data", "model"), s_lse.sharding
    compiled = step.lower(*sharded_args).compile().as_text()
    assert _gathered_inputs(compiled) == []


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_decode_sharded_over_batch_equals_one_device(axis_type):
    mesh = _mesh(axis_type)
    q, k, v, d_out = _inputs(q_len=1)
    step = _loss_and_grads("interpret", decode=True)
    (_, (out, lse)), grads = step(q, k, v, SLOPES, d_out)
    spec = NamedSharding(mesh, P(("data", "model"), None, None, None))
    sharded_args = [jax.device_put(x, spec) for x in (q, k, v)] + [
        jax.device_put(SLOPES, NamedSharding(mesh, P())), jax.device_put(d_out, spec)]
    (_, (s_out, s_lse)), s_grads = step(*sharded_args)
    _assert_matches((s_out, s_lse), (out, lse), atol=1e-6)
    _assert_matches(s_grads[:3], grads[:3], atol=1e-5)
    _assert_matches(s_grads[3], grads[3], atol=1e-4)
    assert _gathered_inputs(step.lower(*sharded_args).compile().as_text()) == []


@pytest.mark.parametrize("layout", ["kv_heads_indivisible", "sequence_sharded"])
def test_layouts_the_kernels_cannot_split_are_gathered_and_still_exact(layout):
    """One KV head over two "model" devices cannot be split (its query heads would be),
    and a sequence split is context parallelism's job: both are gathered first."""
    mesh = _mesh("Auto")
    kv_heads = 1 if layout == "kv_heads_indivisible" else HKV
    q, k, v, d_out = _inputs(kv_heads=kv_heads)
    step = _loss_and_grads("xla")
    (_, (out, lse)), grads = step(q, k, v, SLOPES, d_out)
    if kv_heads == 1:  # query heads split over "model", the one KV head whole
        q_spec = NamedSharding(mesh, P("data", None, "model", None))
        kv_spec = NamedSharding(mesh, P("data", None, None, None))
    else:
        q_spec = kv_spec = NamedSharding(mesh, P(None, "data", "model", None))
    sharded_args = [jax.device_put(q, q_spec)] + [
        jax.device_put(x, kv_spec) for x in (k, v)] + [
        jax.device_put(SLOPES, NamedSharding(mesh, P())), jax.device_put(d_out, q_spec)]
    (_, (s_out, s_lse)), s_grads = step(*sharded_args)
    _assert_matches((s_out, s_lse), (out, lse), atol=1e-6)
    _assert_matches(s_grads[:3], grads[:3], atol=1e-5)
    _assert_matches(s_grads[3], grads[3], atol=1e-4)


def test_vmap_over_sharded_inputs_runs_unsharded():
    """custom_partitioning has no batching rule: under jax.vmap the kernels run on the
    whole call, with the same results."""
    mesh = _mesh("Auto")
    q, k, v, _ = _inputs()
    stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]

    def one(q, k, v):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, backend="xla")
    want = jax.jit(jax.vmap(one))(*stacked)
    spec = NamedSharding(mesh, P(None, "data", None, "model", None))
    got = jax.jit(jax.vmap(one))(*[jax.device_put(x, spec) for x in stacked])
    _assert_matches(got, want, atol=1e-6)
