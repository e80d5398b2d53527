"""Attention sinks (`sinks=`): a logit per query head in every row's softmax, with no
value. Against an independent float64 NumPy model (the sink as one more column of the
softmax, dropped before p.v), on every backend, with gradients (the sinks' included)
against plain JAX autodiff, for decode, a paged cache, the ragged op and context
parallelism; and each forward kernel that folds the sinks into its normalization (XLA
blockwise, Triton, Mosaic GPU, in Pallas's interpreter), with the backward kernels'
gradients, against a float64 model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from tests.conftest import random_qkv

SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


def numpy_sink_attention(q, k, v, sinks, *, causal_offset=None, visible=None, bias=None):
    """float64 (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]): softmax over [scores, sink_h].
    bias: None or [Hq, Sq, Skv], added to the scores."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, q_heads, dim = q.shape
    group = q_heads // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
    if bias is not None:
        scores = scores + bias
    if visible is None:
        visible = np.ones(scores.shape[-2:], bool)
        if causal_offset is not None:
            visible = np.arange(k.shape[1])[None, :] <= np.arange(q_len)[:, None] + causal_offset
    scores = np.where(visible, scores, -np.inf)
    sink = np.asarray(sinks, np.float64)[None, :, None, None] * np.ones(scores.shape[:3] + (1,))
    both = np.concatenate([scores, sink], axis=-1)
    top = both.max(-1, keepdims=True)
    weights = np.exp(both - top)
    total = weights.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights[..., :-1] / total, v)
    return out, (top + np.log(total))[..., 0]


@pytest.mark.parametrize("backend", ["xla", "interpret", "reference"])
@pytest.mark.parametrize("q_len,kv_len", [(130, 130), (1, 200), (37, 300)])
def test_outputs_and_lse_match_the_model(backend, q_len, kv_len):
    q, k, v = random_qkv(0, 2, q_len, kv_len, 4, 2, 16, 24, jnp.float32)
    offset = kv_len - q_len
    out, lse = pf.attention(q, k, v, mask_mod=masks.offset(masks.causal_mask, offset),
                            sinks=jnp.asarray(SINKS), return_lse=True, backend=backend)
    want_out, want_lse = numpy_sink_attention(q, k, v, SINKS, causal_offset=offset)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=2e-5)


def test_fully_masked_rows_give_zeros_and_the_sink_as_lse():
    q, k, v = random_qkv(1, 1, 64, 64, 4, 4, 16, 16, jnp.float32)

    def nothing_before_32(b, h, q_idx, kv_idx):
        return (q_idx >= 32) & (kv_idx <= q_idx)
    out, lse = pf.attention(q, k, v, mask_mod=nothing_before_32, sinks=jnp.asarray(SINKS),
                            return_lse=True, backend="interpret")
    np.testing.assert_array_equal(np.asarray(out[:, :32]), 0)
    np.testing.assert_allclose(np.asarray(lse[0, :, :32]),
                               np.broadcast_to(SINKS[:, None], (4, 32)), rtol=1e-6)
    grads = jax.grad(lambda q, s: jnp.sum(pf.attention(
        q, k, v, mask_mod=nothing_before_32, sinks=s, backend="interpret") ** 2),
        argnums=(0, 1))(q, jnp.asarray(SINKS))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_gradients_of_q_k_v_and_the_sinks_match_plain_jax(backend):
    q, k, v = random_qkv(2, 2, 96, 160, 4, 2, 16, 16, jnp.float32)
    d_out = jax.random.normal(jax.random.key(3), (2, 96, 4, 16))

    def plain(q, k, v, sinks):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        visible = jnp.arange(160)[None, :] <= jnp.arange(96)[:, None] + 64
        scores = jnp.where(visible, scores, -jnp.inf)
        sink = jnp.broadcast_to(sinks[None, :, None, None], scores.shape[:3] + (1,))
        weights = jax.nn.softmax(jnp.concatenate([scores, sink], -1), axis=-1)[..., :-1]
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)

    def ours(q, k, v, sinks):
        return pf.attention(q, k, v, mask_mod=masks.offset(masks.causal_mask, 64),
                            sinks=sinks, backend=backend)
    loss = lambda f: lambda *args: jnp.sum(f(*args) * d_out)
    args = (q, k, v, jnp.asarray(SINKS))
    for name, got, want in zip(("q", "k", "v", "sinks"),
                               jax.grad(loss(ours), argnums=(0, 1, 2, 3))(*args),
                               jax.grad(loss(plain), argnums=(0, 1, 2, 3))(*args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4,
                                   err_msg=f"d{name}")


def test_bfloat16_stays_within_the_dense_bfloat16_error():
    q, k, v = random_qkv(4, 2, 128, 256, 4, 4, 32, 32, jnp.bfloat16)
    out = pf.attention(q, k, v, sinks=jnp.asarray(SINKS), backend="interpret")
    want, _ = numpy_sink_attention(q, k, v, SINKS)
    error = np.sqrt(np.mean((np.asarray(out, np.float64) - want) ** 2))
    # One rounding to bfloat16 (the kernel's output, the sink in its normalization; P is
    # rounded for p.v too): within bfloat16's half-ulp relative to the output's scale.
    assert error <= 2.0 ** -8 * np.sqrt(np.mean(want ** 2)), error


def test_a_paged_cache_with_sinks_equals_the_contiguous_call():
    from tests.paged.test_flex_attention import _filled_cache

    cache = _filled_cache([70, 33], page_size=16, max_pages=6, kv_heads=2, dim=16,
                          value_dim=16, dtype=jnp.float32)
    q = jax.random.normal(jax.random.key(5), (2, 1, 4, 16))
    mask_mod = masks.offset(masks.causal_mask, cache.lengths - 1)
    out, lse = pf.paged.paged_flex_attention(q, cache, mask_mod=mask_mod,
                                             sinks=jnp.asarray(SINKS), return_lse=True,
                                             backend="interpret")
    k, v = pf.paged.gather_contiguous(cache)
    for b, length in enumerate((70, 33)):
        want_out, want_lse = numpy_sink_attention(q[b:b + 1], k[b:b + 1, :length],
                                                  v[b:b + 1, :length], SINKS)
        np.testing.assert_allclose(np.asarray(out[b:b + 1]), want_out, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(lse[b:b + 1]), want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_the_ragged_op_with_sinks_matches_its_reference(backend):
    from tests.paged.ragged_reference import reference_paged_attention
    from tests.paged.test_ragged import case_config, make_case

    config, seqs = case_config("gqa_dv_f32_page16")
    case = make_case(6, seqs, **config)
    out, scores, _, _ = pf.paged.paged_attention(**case, sinks=jnp.asarray(SINKS),
                                                 return_scores=True, backend=backend)
    want, want_scores, _, _ = reference_paged_attention(**case, sinks=SINKS)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(scores[:want_scores.shape[0]]), want_scores,
                               atol=2e-5, rtol=2e-5)


def test_context_parallel_with_sinks_equals_one_device():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices("cpu")[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = random_qkv(7, 1, 128, 128, 4, 2, 16, 16, jnp.float32)
    sinks = jnp.asarray(SINKS)
    shard = P(None, "cp")

    attend = jax.shard_map(
        lambda q, k, v, sinks: pf.context_parallel_attention(
            q, k, v, axis_name="cp", sinks=sinks, mask_mod=masks.causal_mask),
        mesh=mesh, in_specs=(shard, shard, shard, P()), out_specs=shard, check_vma=False)
    parallel = jax.jit(jax.value_and_grad(
        lambda q, s: jnp.sum(attend(q, k, v, s) ** 2), argnums=(0, 1)))
    (value, (d_q, d_sinks)) = parallel(q, sinks)
    single = jax.value_and_grad(lambda q, s: jnp.sum(pf.attention(
        q, k, v, mask_mod=masks.causal_mask, sinks=s) ** 2), argnums=(0, 1))
    want_value, (want_d_q, want_d_sinks) = single(q, sinks)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(d_q), np.asarray(want_d_q), atol=1e-4, rtol=1e-4)
    # shard_map sums a replicated input's cotangent over the devices
    np.testing.assert_allclose(np.asarray(d_sinks), np.asarray(want_d_sinks), atol=1e-4,
                               rtol=1e-4)


# The kernels that fold the sinks into their final normalization: (backend,
# kernel_options, dtype, head dim). The Mosaic GPU forward takes 16-bit inputs at
# D 64 / 128 only. The backward is the Triton kernel's in each (the Mosaic GPU backward
# reads the same lse and delta: GPU_FOLDING_KERNELS run it).
FOLDING_KERNELS = {
    "xla": ("xla", None, jnp.float32, 16),
    "triton": ("interpret", None, jnp.float32, 16),
    "mosaic": ("interpret", {"forward_kernel": "mosaic"}, jnp.bfloat16, 64),
}
# On the GPU: the Mosaic GPU forward and backward (16-bit, D 64 / 128) and the Triton
# kernels (float32).
GPU_FOLDING_KERNELS = {
    "gpu_mosaic_d64": ("pallas", None, jnp.bfloat16, 64),
    "gpu_mosaic_d128": ("pallas", None, jnp.float16, 128),
    "gpu_triton_float32": ("pallas", None, jnp.float32, 64),
}
# Head 3's sink lies far above every logit (its rows' weights all but vanish): the
# kernels move their running max to it rather than overflow the sum.
FOLDED_SINKS = np.array([0.5, -1.0, 2.0, 30.0], np.float32)


def _model_with_gradients(q, k, v, sinks, visible, slopes, d_out, d_lse):
    """The float64 model's (out, lse) and the gradients of sum(out * d_out) +
    sum(lse * d_lse) in q, k, v and the sinks (plain JAX autodiff of the same math)."""
    q_len, kv_len = visible.shape
    bias = slopes[:, None, None] * (np.arange(kv_len)[None, None, :]
                                    - np.arange(q_len)[None, :, None])
    d_out, d_lse = (np.asarray(x, np.float64) for x in (d_out, d_lse))
    with jax.enable_x64(True):
        def model(q, k, v, sinks):
            group = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[3]) + bias
            scores = jnp.where(visible, scores, -jnp.inf)
            sink = jnp.broadcast_to(sinks[None, :, None, None], scores.shape[:3] + (1,))
            both = jnp.concatenate([scores, sink], axis=-1)
            lse = jax.nn.logsumexp(both, axis=-1)
            weights = jnp.exp(both[..., :-1] - lse[..., None])
            return jnp.einsum("bhqk,bkhd->bqhd", weights, v), lse

        @jax.jit
        def with_gradients(*args):
            (out, lse), pullback = jax.vjp(model, *args)
            return out, lse, pullback((d_out, d_lse))

        out, lse, grads = with_gradients(
            *[jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, sinks)])
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("kernel", list(FOLDING_KERNELS) + [
    pytest.param(name, marks=pytest.mark.gpu) for name in GPU_FOLDING_KERNELS])
def test_kernels_fold_the_sinks_into_the_softmax(kernel):
    """Forward and gradients (q, k, v, sinks; through out and lse) of each kernel with
    the sinks in its normalization: GQA, a ragged length (200), fully masked rows (the
    first 32 queries see no key: zeros, lse = sink, d sink = d_lse) and ALiBi (whose
    query term the Mosaic GPU kernel adds to the lse at the end, so the sink is
    compared with the logits less that term)."""
    backend, options, dtype, dim = {**FOLDING_KERNELS, **GPU_FOLDING_KERNELS}[kernel]
    q_len = kv_len = 200
    q, k, v = random_qkv(11, 1, q_len, kv_len, 4, 2, dim, dim, dtype)
    slopes = np.array([0.25, 0.0625, 0.015625, 0.00390625])

    def late_causal(b, h, q_idx, kv_idx):
        return (q_idx >= 32) & (kv_idx <= q_idx)
    visible = ((np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None])
               & (np.arange(q_len)[:, None] >= 32))
    d_out = jax.random.normal(jax.random.key(12), (1, q_len, 4, dim)).astype(dtype)
    d_lse = jax.random.normal(jax.random.key(13), (1, 4, q_len))

    def ours(q, k, v, sinks):
        return pf.attention(q, k, v, mask_mod=late_causal,
                            score_mod=masks.alibi(jnp.asarray(slopes, jnp.float32)),
                            sinks=sinks, return_lse=True, backend=backend,
                            kernel_options=options)

    (out, lse), pullback = jax.vjp(ours, q, k, v, jnp.asarray(FOLDED_SINKS))
    grads = pullback((d_out, d_lse))
    want_out, want_lse, want_grads = _model_with_gradients(
        q, k, v, FOLDED_SINKS, visible, slopes, np.asarray(d_out), np.asarray(d_lse))

    np.testing.assert_array_equal(np.asarray(out[:, :32]).astype(np.float32), 0)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=2e-5)
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=2e-5)
        for name, got, want in zip("qkv", grads, want_grads):
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4,
                                       err_msg=f"d{name}")
    else:
        # 16-bit: the output is the kernel's one rounding of the float32 result (and
        # P rounded for p.v); gradients as the Mosaic GPU kernels' own tests bound them.
        ulp = float(jnp.finfo(dtype).eps)
        error = np.abs(np.asarray(out, np.float64) - want_out).max()
        assert error <= 2 * ulp * np.abs(want_out).max(), error
        for name, got, want in zip("qkv", grads, want_grads):
            error = np.abs(np.asarray(got, np.float64) - want).max()
            assert error <= 2e-2 * np.abs(want).max(), f"d{name}: {error}"
    # The sinks' gradient sums over whole rows: relative to its own size, in each dtype.
    d_sinks, want_d_sinks = np.asarray(grads[3], np.float64), want_grads[3]
    tolerance = 2e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(d_sinks, want_d_sinks, rtol=tolerance,
                               atol=tolerance * np.abs(want_d_sinks).max(), err_msg="dsinks")


def test_a_head_sharded_call_with_sinks_equals_one_device():
    """The forward kernels take the sinks as an input: split over the heads with q
    (`sharding.PER_HEAD`), each device's kernel reads its own heads' sinks."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices("cpu")[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q, k, v = random_qkv(9, 2, 64, 64, 4, 2, 16, 16, jnp.float32)

    def loss(q, k, v, sinks):
        out, lse = pf.attention(q, k, v, mask_mod=masks.causal_mask, sinks=sinks,
                                return_lse=True, backend="xla")
        return jnp.sum(out ** 2) + jnp.sum(lse), (out, lse)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 3), has_aux=True))
    spec = NamedSharding(mesh, P("data", None, "model", None))
    sharded = step(*[jax.device_put(x, spec) for x in (q, k, v)], jnp.asarray(SINKS))
    for got, want in zip(jax.tree.leaves(sharded),
                         jax.tree.leaves(step(q, k, v, jnp.asarray(SINKS)))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks", [np.zeros(3, np.float32), np.zeros((4, 1), np.float32),
                                   np.zeros(4, np.int32), [0.0, 0.0, 0.0, 0.0]])
def test_bad_sinks_are_value_errors(sinks):
    q, k, v = random_qkv(8, 1, 16, 16, 4, 2, 16, 16, jnp.float32)
    with pytest.raises(ValueError, match="sinks must be a float array"):
        pf.attention(q, k, v, sinks=sinks)
