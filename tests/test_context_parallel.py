"""Context parallelism (`pf.context_parallel_attention`) on four host devices: outputs, lse and
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

    def two_shards_back(b, h, q_idx, kv_idx):
        """Keys in the query's own shard of 32 or two shards back: ring steps 1 and 3
        are empty on every device, step 2 busy on devices 2 and 3."""
        distance = q_idx // (S // DEVICES) - kv_idx // (S // DEVICES)
        return (distance == 0) | (distance == 2)
    return {"causal": (causal, None), "documents": (documents, None),
            "sliding_window": (sliding, None), "prefix_lm": (prefix_lm, None),
            "noop_softcap": (None, masks.tanh_softcap(5.0)),
            "two_shards_back": (two_shards_back, None)}


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


def _sharded(mesh, fn, *replicated, check_vma=False):
    """fn(q, k, v, *replicated) under shard_map: the sequence split over "cp"."""
    shard = P(None, "cp")
    return jax.jit(jax.shard_map(
        fn, mesh=mesh, in_specs=(shard, shard, shard) + (P(),) * len(replicated),
        out_specs=(shard, P(None, None, "cp")), check_vma=check_vma))


def _assert_equals_one_device(mesh, inputs, mask_mod, score_mod, backend="xla",
                              check_vma=False, **options):
    """context_parallel_attention(**options) over the four devices (inputs laid out for
    the layout, outputs put back in order) against pf.attention on one device: outputs
    and lse to 2e-5, dq, dk, dv to 1e-4."""
    q, k, v, d_out = inputs
    order = pf.context_parallel.layout_order(S, DEVICES, options.get("layout", "contiguous"))
    restore = jnp.argsort(order)
    options.setdefault("strategy", "ring")
    parallel = _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
        q, k, v, axis_name="cp", mask_mod=mask_mod, score_mod=score_mod,
        return_lse=True, backend=backend, **options), check_vma=check_vma)

    def sharded(q, k, v):
        out, lse = parallel(q[:, order], k[:, order], v[:, order])
        return out[:, restore], lse[:, :, restore]

    def single(q, k, v):
        return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True,
                            backend=backend)

    def with_gradients(attend):
        """out, lse and the gradients of sum(out * d_out) (the lse, an aux output, gets no
        cotangent) from one forward, instead of compiling the forward once more on its
        own (the ring's custom VJP forward is the primal's _ring_forward; the forward
        without AD is compared with one device's in the schedule and row-max tests)."""
        out, pullback, lse = jax.vjp(attend, q, k, v, has_aux=True)
        return out, lse, pullback(d_out)
    (out, lse, grads), (expected, expected_lse, expected_grads) = (
        with_gradients(sharded), with_gradients(single))
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, expected_lse, atol=2e-5, rtol=2e-5)
    for name, a, b in zip("qkv", grads, expected_grads):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


# Every mask once: causal and documents on the Pallas kernels (interpret mode), the other
# masks on the XLA path (the score_mod case runs in the other strategies' tests and with a
# learnable array below). The XLA ring on causal and documents ran the same ring as the
# interpret cases and is still checked in test_every_strategy_inside_a_shard_map_that_...
# (ring, causal, xla) and by the head-group, all_gather and all_to_all tests (documents).
# two_shards_back (ring steps 1 and 3 empty on every device, forward and backward) runs in
# test_the_ring_by_head_groups_equals_one_device, its schedule in test_the_schedule_...
@pytest.mark.parametrize("case,backend", [
    (case, "xla") for case in CASES
    if case not in ("noop_softcap", "causal", "documents", "two_shards_back")] + [
    ("causal", "interpret"), ("documents", "interpret")])
def test_ring_equals_one_device(mesh, case, backend):
    _assert_equals_one_device(mesh, _inputs(), *CASES[case], backend=backend)


def test_the_ring_backward_keeps_only_this_device_s_shards(mesh):
    """The ring's custom VJP saves q, k, v as given, the merged float32 output and the
    lse, and passes K/V round the ring again in the backward: no K/V shard that visited
    a device is kept for the backward. (JAX's transpose of the forward would keep every
    step's visiting shard: on 4 devices 4x the K/V, with per-step outputs and lse.)"""
    q, k, v, d_out = _inputs()
    attend = _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
        q, k, v, axis_name="cp", strategy="ring", mask_mod=masks.causal_mask, return_lse=True))
    _, backward = jax.vjp(lambda q, k, v: attend(q, k, v)[0], q, k, v)
    saved = sum(x.nbytes for x in jax.tree.leaves(backward) if hasattr(x, "nbytes"))
    inputs, out_f32 = q.nbytes + k.nbytes + v.nbytes, q.size // D * D * 4
    lse = B * HQ * S * 4
    assert saved <= inputs + out_f32 + 2 * lse + 64 * 1024, (saved, inputs, out_f32)
    # (The gradients it gives equal one device's: test_ring_equals_one_device.)


def test_zigzag_layout_equals_one_device_at_original_positions(mesh):
    """Inputs laid out zig-zag (device i: chunks i and 7 - i of 8): the mods still see
    original positions, and the outputs put back in order equal single-device ones.
    (Documents crossing every chunk boundary; the causal ring on the zig-zag layout is
    checked in test_the_ring_by_head_groups_equals_one_device, each group's ring being
    this one.)"""
    order = pf.context_parallel.zigzag_order(S, DEVICES)
    np.testing.assert_array_equal(order[:S // 8], np.arange(S // 8))  # device 0: chunk 0 ...
    np.testing.assert_array_equal(order[S // 8:S // 4], np.arange(7 * S // 8, S))  # and 7
    _assert_equals_one_device(mesh, _inputs(3), CASES["documents"][0], None, layout="zig-zag")


@pytest.mark.parametrize("case,strategy", [("documents", "ring"), ("causal", "all_gather")])
def test_striped_layout_equals_one_device_at_original_positions(mesh, case, strategy):
    """Inputs striped (device i: positions i, i + 4, ...): mods at original positions,
    outputs and gradients as on one device (the all-gather maps gathered rows back)."""
    order = pf.context_parallel.striped_order(S, DEVICES)
    np.testing.assert_array_equal(order[:4], [0, 4, 8, 12])  # device 0's first rows
    _assert_equals_one_device(mesh, _inputs(13), CASES[case][0], None, layout="striped",
                              strategy=strategy)


def test_bad_layouts_are_value_errors(mesh):
    with pytest.raises(ValueError, match="layout must be"):
        _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
            q, k, v, axis_name="cp", layout="diagonal"))(*_inputs()[:3])
    with pytest.raises(ValueError, match="strategy must be"):
        _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
            q, k, v, axis_name="cp", strategy="ulysses"))(*_inputs()[:3])
    with pytest.raises(ValueError, match="not a multiple of 8"):
        pf.context_parallel.zigzag_order(100, DEVICES)


@pytest.mark.parametrize("check_vma", [False, True])
def test_a_captured_learnable_array_gets_its_gradient(mesh, check_vma):
    """ALiBi slopes passed replicated: their gradient, summed over the devices' shards by
    shard_map's transpose (with check_vma=True by the ring's VJP, typing it as its
    replicated primal: `sharding.typed_as_primals`), equals the single-device one."""
    q, k, v, d_out = _inputs(1)
    slopes = pf.scores.alibi_slopes(HQ)

    def single(q, k, v, slopes):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=pf.scores.alibi(
            slopes), return_lse=True, backend="xla")

    def ring(q, k, v, slopes):
        return pf.context_parallel_attention(q, k, v, axis_name="cp", strategy="ring",
                                             mask_mod=masks.causal_mask,
                                             score_mod=pf.scores.alibi(slopes), return_lse=True,
                                             backend="xla")
    ring = _sharded(mesh, ring, slopes, check_vma=check_vma)

    def loss(attend):
        return lambda slopes, q: jnp.sum(attend(q, k, v, slopes)[0] * d_out)
    got = jax.grad(loss(ring), argnums=(0, 1))(slopes, q)
    want = jax.grad(loss(single), argnums=(0, 1))(slopes, q)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(got[0]))) > 0


def _head_window(b, h, q_idx, kv_idx):
    """A causal window that grows with the head (reads h: each head group builds its
    own BlockMasks, at the whole call's heads)."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 16 + 24 * h)


@pytest.mark.parametrize("case,layout,check_vma", [
    ("causal", "zig-zag", False), ("documents", "striped", True),
    ("head_window", "contiguous", True), ("two_shards_back", "contiguous", False)])
def test_the_ring_by_head_groups_equals_one_device(mesh, case, layout, check_vma):
    """head_chunks=2 runs the ring once per KV head (each with its GQA pair of query
    heads), one after the other: out, lse and dq, dk, dv equal one device's, also for a
    mask that reads h (each group's mods see the whole call's heads) and under a
    shard_map that checks varying axes."""
    mask_mod = _head_window if case == "head_window" else CASES[case][0]
    _assert_equals_one_device(mesh, _inputs(9), mask_mod, None, check_vma=check_vma,
                              layout=layout, head_chunks=2)


@pytest.mark.parametrize("check_vma", [False, True])
def test_head_groups_keep_the_gradient_of_a_learnable_array_read_per_head(mesh, check_vma):
    """ALiBi slopes [HQ] read at h by the head groups' score_mods (h offset to the whole
    call's heads): out and the slopes' and q's gradients equal one device's."""
    q, k, v, d_out = _inputs(10)
    slopes = pf.scores.alibi_slopes(HQ) * jnp.asarray([1.0, 2.0, 0.5, 3.0])

    def single(q, k, v, slopes):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=pf.scores.alibi(
            slopes), return_lse=True, backend="xla")

    def ring(q, k, v, slopes):
        return pf.context_parallel_attention(
            q, k, v, axis_name="cp", strategy="ring", mask_mod=masks.causal_mask,
            score_mod=pf.scores.alibi(slopes), return_lse=True, backend="xla",
            head_chunks=2)
    ring = _sharded(mesh, ring, slopes, check_vma=check_vma)

    def out_and_grads(attend):
        """out and the gradients of sum(out * d_out) for the slopes and q, from one
        forward (jax.vjp) instead of a forward compiled again on its own."""
        out, pullback = jax.vjp(lambda slopes, q: attend(q, k, v, slopes)[0], slopes, q)
        return out, pullback(d_out)
    (out, got), (expected, want) = out_and_grads(ring), out_and_grads(single)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)
    assert float(jnp.min(jnp.abs(got[0]))) > 0  # every head's slope has a gradient


def test_head_groups_cut_the_ring_s_memory(mesh):
    """XLA's plan for a forward+backward step on each device: the ring's temporaries
    (visiting K/V, float32 accumulators and the dK/dV buffers travelling with them) shrink
    with the head groups. (On the CPU the XLA backend's dense scores of one step, kept per
    group, are part of them; the GPU kernels have none: `pallas_flex.bench.multi_device`
    measures the plan there.)"""
    heads, length, dim = 8, 512, 64
    keys = jax.random.split(jax.random.key(11), 4)
    q, k, v, d_out = (jax.random.normal(key, (1, length, heads, dim), jnp.bfloat16)
                      for key in keys)

    def temporaries(head_chunks):
        attend = _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
            q, k, v, axis_name="cp", strategy="ring", mask_mod=masks.causal_mask,
            return_lse=True, backend="xla", layout="zig-zag", head_chunks=head_chunks))

        def step(q, k, v, d_out):
            out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v)[0], q, k, v)
            return pullback(d_out)
        plan = jax.jit(step).lower(q, k, v, d_out).compile().memory_analysis()
        return plan.temp_size_in_bytes
    whole, pairs, single = temporaries(1), temporaries(4), temporaries(heads)
    assert single < pairs < whole / 2, (single, pairs, whole)
    assert single < whole / 3, (single, whole)


def test_bad_head_chunks_are_value_errors(mesh):
    q, k, v, _ = _inputs()
    for bad, strategy in ((3, "ring"), (0, "ring"), (True, "ring"), (2, "all_gather")):
        with pytest.raises(ValueError, match="head_chunks"):
            _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
                q, k, v, axis_name="cp", strategy=strategy, mask_mod=masks.causal_mask,
                return_lse=True, backend="xla", head_chunks=bad))(q, k, v)


def test_auto_head_chunks_keep_a_group_s_kv_shard_within_64_mib():
    from pallas_flex.context_parallel import ring_head_chunks
    assert ring_head_chunks((1, 2 ** 17, 16, 128), (1, 2 ** 17, 16, 128), jnp.bfloat16) == 16
    assert ring_head_chunks((1, 2 ** 15, 16, 128), (1, 2 ** 15, 16, 128), jnp.bfloat16) == 4
    assert ring_head_chunks((1, 2 ** 13, 16, 128), (1, 2 ** 13, 16, 128), jnp.bfloat16) == 1
    assert ring_head_chunks((1, 2 ** 20, 2, 128), (1, 2 ** 20, 2, 128), jnp.float32) == 2
    assert ring_head_chunks((1, 2 ** 17, 16, 128), (1, 2 ** 17, 16, 128), jnp.bfloat16,
                            head_chunks=2) == 2


def test_a_row_masked_on_every_shard_is_zero_with_finite_gradients(mesh):
    """Queries of document -1 see no key anywhere: zeros, lse -inf, and no NaN reaches
    the gradients through the merges of empty partial results."""
    q, k, v, d_out = _inputs(2)
    ids = DOCUMENT_IDS.at[:7].set(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (ids[q_idx] >= 0) & (q_idx >= kv_idx)

    ring = _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
        q, k, v, axis_name="cp", strategy="ring", mask_mod=mask_mod, return_lse=True,
        backend="xla"))
    # out, lse and the gradients of sum(out * d_out) from one forward (the lse an aux
    # output), instead of compiling the forward once more on its own.
    out, pullback, lse = jax.vjp(ring, q, k, v, has_aux=True)
    assert not np.any(np.asarray(out[:, :7])) and np.all(np.isneginf(lse[:, :, :7]))
    grads = pullback(d_out)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_shards_must_be_4d(mesh):
    with pytest.raises(ValueError, match="4-D shards"):
        _sharded(mesh, lambda q, k, v: (pf.context_parallel_attention(q[0], k, v, axis_name="cp"),
                                        jnp.zeros((B, HQ, S // DEVICES))))(*_inputs()[:3])


def test_zigzag_balances_a_causal_mask_s_blocks_across_devices():
    """The blocks each device's BlockMasks list over its N ring steps: contiguous shards
    leave the last device N times the first's causal work; zig-zag gives all the same."""
    from pallas_flex import context_parallel

    def work(layout):
        per_device = []
        for device in range(DEVICES):
            q_position = context_parallel._positions(jnp.int32(device), S // DEVICES,
                                                     DEVICES, layout)
            total = 0
            for source in range(DEVICES):
                kv_position = context_parallel._positions(jnp.int32(source), S // DEVICES,
                                                          DEVICES, layout)
                block_mask = pf.create_block_mask(context_parallel._at_global_positions(
                    masks.causal_mask, q_position, kv_position, False), None, None,
                    S // DEVICES, S // DEVICES, block_size=16)
                total += int(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
            per_device.append(total)
        return per_device
    contiguous, zigzag, striped = work("contiguous"), work("zig-zag"), work("striped")
    assert contiguous[-1] >= 3 * contiguous[0], contiguous
    assert len(set(zigzag)) == 1 and sum(zigzag) == sum(contiguous), (zigzag, contiguous)
    assert max(striped) - min(striped) <= 1, striped  # a diagonal block's worth at most


def test_striped_spreads_documents_more_evenly_than_zigzag():
    """(q, kv) pairs each device attends under a document mask over all its ring steps:
    zig-zag leaves each device the documents its two chunks hold, striped deals every
    document to every device (the 2-GPU run measured document masks at 75 % efficiency
    under zig-zag against 98 % causal)."""
    from pallas_flex import context_parallel
    documents = CASES["documents"][0]
    local = jnp.arange(S // DEVICES, dtype=jnp.int32)

    def pairs(layout):
        per_device = []
        for device in range(DEVICES):
            q_position = context_parallel._positions(jnp.int32(device), S // DEVICES,
                                                     DEVICES, layout)(local)
            kv_position = jnp.concatenate([context_parallel._positions(
                jnp.int32(source), S // DEVICES, DEVICES, layout)(local)
                for source in range(DEVICES)])
            per_device.append(int(jnp.sum(jax.vmap(lambda qp: jax.vmap(
                lambda kp: documents(0, 0, qp, kp))(kv_position))(q_position))))
        return per_device
    zigzag, striped = pairs("zig-zag"), pairs("striped")
    assert sum(zigzag) == sum(striped)
    assert max(striped) - min(striped) < (max(zigzag) - min(zigzag)) / 4, (striped, zigzag)


@pytest.mark.parametrize("case,computed,transfers", [
    ("causal", 1 + 2 + 3 + 4, 3 * DEVICES),  # device i: shards 0..i; the last needs all
    ("sliding_window", 1 + 2 + 2 + 2, 1 * DEVICES),  # window 20 < 32: this shard and the
    ("noop_softcap", DEVICES * DEVICES, 3 * DEVICES),  # previous; then K/V stay put
    ("two_shards_back", DEVICES + 2, DEVICES)])  # steps 1 and 3 empty: one hop of two
def test_the_schedule_skips_what_the_block_masks_allow(mesh, monkeypatch, case, computed,
                                                        transfers):
    """Kernel calls and K/V transfers actually executed (host callbacks inside the taken
    branches), summed over the four devices. A step no device computes is not
    transferred: the shard of the step after it comes in one hop."""
    from pallas_flex import context_parallel

    counts = {"computed": 0, "transfers": 0}

    def counting(name, function):
        def wrapped(*args, **kwargs):
            jax.debug.callback(lambda: counts.__setitem__(name, counts[name] + 1))
            return function(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(context_parallel, "flex_attention",
                        counting("computed", context_parallel.flex_attention))
    monkeypatch.setattr(jax.lax, "ppermute", counting("transfers", jax.lax.ppermute))
    mask_mod, score_mod = CASES[case]
    q, k, v, _ = _inputs(4)
    ring = _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
        q, k, v, axis_name="cp", strategy="ring", mask_mod=mask_mod, score_mod=score_mod,
        return_lse=True, backend="xla"))
    out, _ = ring(q, k, v)
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert counts == {"computed": computed, "transfers": transfers}
    expected, _ = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                               return_lse=True, backend="xla")
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


# Each mask and each layout once (documents zig-zag also runs in
# test_every_strategy_inside_a_shard_map_that_checks_varying_axes).
@pytest.mark.parametrize("case,layout", [("documents", "contiguous"),
                                         ("noop_softcap", "zig-zag")])
def test_all_gather_strategy_equals_one_device(mesh, case, layout):
    """strategy="all_gather": K/V gathered once (in device order, positions mapped back
    through the layout), one call per device; outputs and gradients as on one device."""
    _assert_equals_one_device(mesh, _inputs(5), *CASES[case], layout=layout,
                              strategy="all_gather")


# Each layout once, both masks (alibi on the striped layout also runs in
# test_every_strategy_inside_a_shard_map_that_checks_varying_axes).
@pytest.mark.parametrize("case,layout", [("documents", "contiguous"), ("alibi", "zig-zag"),
                                         ("documents", "striped")])
def test_all_to_all_strategy_equals_one_device(mesh, case, layout):
    """strategy="all_to_all" (Ulysses): heads split over the devices, each attending the
    whole sequence; ALiBi's per-head slopes check that the mods see global heads."""
    q, k, v, d_out = _inputs(6)
    q = jnp.concatenate([q, q[:, :, ::-1]], axis=2)  # Hq 8, Hkv 4: multiples of 4 devices
    k, v = (jnp.concatenate([x, x[:, :, ::-1]], axis=2) for x in (k, v))
    d_out = jnp.concatenate([d_out, d_out], axis=2)
    mask_mod, score_mod = ((CASES["documents"][0], None) if case == "documents" else
                           (masks.causal_mask, pf.scores.alibi(pf.scores.alibi_slopes(8))))
    _assert_equals_one_device(mesh, (q, k, v, d_out), mask_mod, score_mod, layout=layout,
                              strategy="all_to_all")
    with pytest.raises(ValueError, match="multiples of it"):
        _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
            q, k, v, axis_name="cp", strategy="all_to_all", return_lse=True))(*_inputs()[:3])


def test_attention_takes_a_context_parallel_option(mesh):
    """pf.attention(..., context_parallel=pf.ContextParallel(...)) is the same program as
    pf.context_parallel_attention; a prebuilt BlockMask or another value is a ValueError."""
    q, k, v, _ = _inputs(7)
    order = pf.context_parallel.zigzag_order(S, DEVICES)
    option = pf.ContextParallel("cp", layout="zig-zag", strategy="all_gather")
    through_attention = _sharded(mesh, lambda q, k, v: pf.attention(
        q, k, v, mask_mod=masks.causal_mask, return_lse=True, backend="xla",
        context_parallel=option))
    direct = _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
        q, k, v, axis_name="cp", mask_mod=masks.causal_mask, return_lse=True, backend="xla",
        layout="zig-zag", strategy="all_gather"))
    shards = (q[:, order], k[:, order], v[:, order])
    np.testing.assert_array_equal(through_attention(*shards)[0], direct(*shards)[0])
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, S, S)
    with pytest.raises(ValueError, match="not block_mask"):
        pf.attention(q, k, v, block_mask=block_mask, context_parallel=option)
    with pytest.raises(ValueError, match="must be a pf.ContextParallel"):
        pf.attention(q, k, v, context_parallel="cp")


def test_an_output_gate_gates_each_device_s_queries(mesh):
    """output_gate with context_parallel: each device's query shard times the sigmoid of
    its gate shard, equal to the gated call on one device."""
    q, k, v, gate = _inputs(8)
    option = pf.ContextParallel("cp", strategy="all_gather")
    shard = P(None, "cp")
    gated = jax.jit(jax.shard_map(lambda q, k, v, gate: pf.attention(
        q, k, v, mask_mod=masks.causal_mask, backend="xla", context_parallel=option,
        output_gate=gate), mesh=mesh, in_specs=(shard,) * 4, out_specs=shard,
        check_vma=False))
    want = pf.attention(q, k, v, mask_mod=masks.causal_mask, backend="xla",
                        output_gate=gate)
    np.testing.assert_allclose(np.asarray(gated(q, k, v, gate)), np.asarray(want),
                               atol=1e-5, rtol=1e-5)


def test_a_training_step_on_the_mesh_equals_one_device(mesh):
    """The README's context-parallel training step: projections of a zig-zag sharded
    sequence, causal attention over the ring, mean squared error; the mean over devices of
    their loss and parameter gradients equals the single-device loss and gradients."""
    from jax.sharding import NamedSharding

    features, heads, dim, length = 32, 4, 8, S
    params = {name: jax.random.normal(jax.random.key(i), (features, heads * dim)) / 8
              for i, name in enumerate(("wq", "wk", "wv", "wo"))}
    x = jax.random.normal(jax.random.key(9), (1, length, features))
    order = pf.context_parallel.zigzag_order(length, DEVICES)

    def loss_fn(params, x, parallel):
        def project(w):
            return (x @ w).reshape(*x.shape[:2], heads, dim)
        extra = ({"context_parallel": pf.ContextParallel("cp", layout="zig-zag")}
                 if parallel else {})
        out = pf.attention(project(params["wq"]), project(params["wk"]),
                           project(params["wv"]), mask_mod=masks.causal_mask, **extra)
        prediction = out.reshape(*x.shape[:2], heads * dim) @ params["wo"].T
        return jnp.mean((prediction - x) ** 2)

    def step(params, x):
        return jax.lax.pmean(jax.value_and_grad(loss_fn)(params, x, True), "cp")
    parallel = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(None, "cp")),
                                     out_specs=(P(), P()), check_vma=False))
    loss, grads = parallel(jax.device_put(params, NamedSharding(mesh, P())),
                           jax.device_put(x[:, order], NamedSharding(mesh, P(None, "cp"))))
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, x, False)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(want_grads[name]),
                                   atol=1e-6, rtol=1e-4, err_msg=name)


def test_auto_strategy_gathers_what_fits_and_rings_the_rest(mesh):
    """strategy="auto" (the default) runs all_gather where the whole K/V takes at most 1/8
    of the device's memory and the ring past it; its result is that strategy's."""
    from pallas_flex.context_parallel import choose_strategy
    device = jax.devices("cpu")[0]  # no memory_stats on the host: 16 GiB assumed
    shard = (1, 2 ** 15, 16, 128)  # 4 shards of 32k tokens: 1 GiB of bf16 K and V
    assert choose_strategy(shard, shard, jnp.bfloat16, 4, device) == "all_gather"
    assert choose_strategy(shard, shard, jnp.float32, 8, device) == "ring"  # 4 GiB
    q, k, v, _ = _inputs(8)

    def run(**options):
        return _sharded(mesh, lambda q, k, v: pf.context_parallel_attention(
            q, k, v, axis_name="cp", mask_mod=masks.causal_mask, return_lse=True,
            backend="xla", **options))(q, k, v)[0]
    np.testing.assert_array_equal(run(), run(strategy="all_gather"))


@pytest.mark.parametrize("strategy,layout,backend", [
    ("ring", "zig-zag", "xla"), ("ring", "contiguous", "reference"),
    ("all_gather", "contiguous", "xla"), ("all_to_all", "zig-zag", "xla")])
def test_the_row_max_is_the_largest_over_every_device_s_keys(mesh, strategy, layout,
                                                              backend):
    """return_aux's max_scores: each device's rows, the max over every shard's keys
    (-inf for rows masked everywhere), as one device gives it."""
    q, k, v, _ = _inputs(3)
    q = jnp.concatenate([q, q[:, :, ::-1]], axis=2)  # Hq 8, Hkv 4: all_to_all's multiples
    k, v = (jnp.concatenate([x, x[:, :, ::-1]], axis=2) for x in (k, v))
    ids = DOCUMENT_IDS.at[:7].set(-1)  # rows 0-6 see no key anywhere

    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (ids[q_idx] >= 0) & (q_idx >= kv_idx)
    score_mod = pf.scores.alibi(pf.scores.alibi_slopes(2 * HQ))
    order = pf.context_parallel.layout_order(S, DEVICES, layout)

    def local(q, k, v):
        out, aux = pf.context_parallel_attention(
            q, k, v, axis_name="cp", strategy=strategy, layout=layout, mask_mod=mask_mod,
            score_mod=score_mod, backend=backend,
            return_aux=pf.AuxRequest(lse=True, max_scores=True))
        return out, aux.max_scores
    sharded = _sharded(mesh, local)
    out, row_max = sharded(*(x[:, order] for x in (q, k, v)))
    want_out, want = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                  backend="xla", return_aux=pf.AuxRequest(max_scores=True))
    want = want.max_scores[:, :, order]
    finite = np.isfinite(np.asarray(want))
    assert not finite[:, :, np.isin(np.asarray(order), np.arange(7))].any()
    np.testing.assert_array_equal(finite, np.isfinite(np.asarray(row_max)))
    np.testing.assert_allclose(np.where(finite, row_max, 0), np.where(finite, want, 0),
                               atol=1e-5)
    np.testing.assert_allclose(out, want_out[:, order], atol=2e-5)


def _eight_heads(inputs):
    """Hq 8, Hkv 4: heads that split over the 4 devices (all_to_all)."""
    q, k, v, d_out = inputs
    return (jnp.concatenate([q, q[:, :, ::-1]], axis=2),
            *(jnp.concatenate([x, x[:, :, ::-1]], axis=2) for x in (k, v)),
            jnp.concatenate([d_out, d_out], axis=2))


@pytest.mark.parametrize("strategy,case,layout,backend", [
    ("ring", "causal", "contiguous", "xla"), ("ring", "noop_softcap", "zig-zag", "xla"),
    ("all_gather", "documents", "zig-zag", "xla"),
    ("all_to_all", "alibi", "striped", "xla")])
def test_every_strategy_inside_a_shard_map_that_checks_varying_axes(mesh, strategy, case,
                                                                      layout, backend):
    """context_parallel_attention inside jax.shard_map with check_vma=True (its
    default): outputs, lse and gradients equal one device's, as with check_vma=False.
    The ring's merged state and gradient buffers start varying, the mods' casts to
    varying (recorded where they were traced under the varying shard offset) are the
    identity in the tile interpreter, and each primitive's operands meet in their
    varying axes (`manual_axes.vary` in `tile_mods._bound`). (The per-step BlockMasks vary with
    the shard: the "interpret" backend refuses them there, tests/test_sharding.py.)"""
    inputs = _inputs(9)
    if case == "alibi":
        inputs = _eight_heads(inputs)
        mask_mod, score_mod = masks.causal_mask, pf.scores.alibi(pf.scores.alibi_slopes(8))
    else:
        mask_mod, score_mod = CASES[case]
    _assert_equals_one_device(mesh, inputs, mask_mod, score_mod, backend=backend,
                              check_vma=True, layout=layout, strategy=strategy)
