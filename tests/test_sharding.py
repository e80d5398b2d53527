"""Batch and head sharding (`pallas_flex/sharding.py`) on four host devices: `pf.attention`
under `jax.jit` with q, k, v sharded over a 2 x 2 mesh ("data" for batch, "model" for
heads) gives the outputs, lse and gradients (q, k, v and captured arrays) of the same call
on one device, keeps the inputs' shardings, and moves no attention input between devices
(no all-gather in the compiled program); mods see global batch rows and heads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.paged.quantize import quantize

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


# Explicit axes take the shard_map route, Auto ones custom_partitioning; the kernels in
# Pallas's interpreter on one of them.
@pytest.mark.parametrize("axis_type,backend", [("Auto", "xla"), ("Explicit", "xla"),
                                               ("Auto", "interpret")])
def test_batch_and_head_sharded_call_equals_one_device(axis_type, backend):
    mesh = _mesh(axis_type)
    q, k, v, d_out = _inputs()
    step = _loss_and_grads(backend)
    (loss, (out, lse)), grads = step(q, k, v, SLOPES, d_out)

    spec = NamedSharding(mesh, P("data", None, "model", None))
    replicated = NamedSharding(mesh, P())
    sharded_args = [jax.device_put(x, spec) for x in (q, k, v)] + [
        jax.device_put(SLOPES, replicated), jax.device_put(d_out, spec)]
    # Compiled once: the program run is the one whose text is checked below.
    compiled = step.lower(*sharded_args).compile()
    (s_loss, (s_out, s_lse)), s_grads = compiled(*sharded_args)

    _assert_matches((s_out, s_lse), (out, lse), atol=1e-6)
    _assert_matches(s_grads[:3], grads[:3], atol=1e-5)
    # The slopes' gradient sums over every query, key, batch row and head: its partial
    # sums are added in another order across the four devices.
    _assert_matches(s_grads[3], grads[3], atol=1e-4)
    np.testing.assert_allclose(float(s_loss), float(loss), rtol=1e-5)
    for result in (s_out, *s_grads[:3]):
        assert tuple(result.sharding.spec)[:3] == ("data", None, "model"), result.sharding
    assert tuple(s_lse.sharding.spec)[:2] == ("data", "model"), s_lse.sharding
    assert _gathered_inputs(compiled.as_text()) == []


@pytest.mark.parametrize("axis_type,backend", [("Auto", "interpret"), ("Explicit", "xla")])
def test_an_output_gate_shards_as_the_output(axis_type, backend):
    """The gate read in the Triton forward's epilogue (not differentiated) and after the
    kernel (differentiated): sharded over batch and heads as q, equal to one device's,
    with no input gathered."""
    mesh = _mesh(axis_type)
    q, k, v, gate = _inputs(seed=3)

    def forward(q, k, v, gate):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, output_gate=gate,
                            backend=backend)
    step = jax.jit(lambda q, k, v, gate: (forward(q, k, v, gate), jax.grad(
        lambda *args: jnp.sum(forward(*args) * jnp.cos(jnp.arange(D))),
        argnums=(0, 3))(q, k, v, gate)))
    single = step(q, k, v, gate)
    spec = NamedSharding(mesh, P("data", None, "model", None))
    sharded_args = [jax.device_put(x, spec) for x in (q, k, v, gate)]
    compiled = step.lower(*sharded_args).compile()
    _assert_matches(compiled(*sharded_args), single, atol=1e-5)
    assert _gathered_inputs(compiled.as_text()) == []


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_decode_sharded_over_batch_equals_one_device(axis_type):
    mesh = _mesh(axis_type)
    q, k, v, d_out = _inputs(q_len=1)
    step = _loss_and_grads("interpret", decode=True)
    (_, (out, lse)), grads = step(q, k, v, SLOPES, d_out)
    spec = NamedSharding(mesh, P(("data", "model"), None, None, None))
    sharded_args = [jax.device_put(x, spec) for x in (q, k, v)] + [
        jax.device_put(SLOPES, NamedSharding(mesh, P())), jax.device_put(d_out, spec)]
    compiled = step.lower(*sharded_args).compile()  # once: run and its text checked
    (_, (s_out, s_lse)), s_grads = compiled(*sharded_args)
    _assert_matches((s_out, s_lse), (out, lse), atol=1e-6)
    _assert_matches(s_grads[:3], grads[:3], atol=1e-5)
    _assert_matches(s_grads[3], grads[3], atol=1e-4)
    assert _gathered_inputs(compiled.as_text()) == []


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


def _head_split_cache(cache, mesh):
    """The cache with its pages split over "model" by KV head, its tables whole."""
    import dataclasses
    pages = NamedSharding(mesh, P(None, "model", None, None))
    return dataclasses.replace(cache, k_pages=jax.device_put(cache.k_pages, pages),
                               v_pages=jax.device_put(cache.v_pages, pages))


@pytest.mark.parametrize("q_len", [1, 24])  # decode kernel, forward kernel on pages
def test_paged_cache_split_over_kv_heads_equals_one_device(q_len):
    """Tensor-parallel serving: pages split by KV head, q by query head; each device reads
    its own heads' pages (no all-gather), mods at global heads (ALiBi)."""
    from tests.paged.test_flex_attention import _filled_cache

    mesh = _mesh("Auto")
    cache = _filled_cache([70, 33], page_size=16, max_pages=6, kv_heads=HKV, dim=D,
                          value_dim=D, dtype=jnp.float32)
    q = jax.random.normal(jax.random.key(3), (2, q_len, HQ, D), jnp.float32)
    mask_mod = masks.offset(masks.causal_mask, jnp.maximum(cache.lengths - q_len, 0))

    @jax.jit
    def attend(q, cache):
        return pf.paged.paged_flex_attention(
            q, cache, mask_mod=mask_mod, score_mod=masks.alibi(HQ), return_lse=True,
            backend="interpret", kernel_options={"block_q": 16, "block_kv": 16})
    want = attend(q, cache)
    split_q = jax.device_put(q, NamedSharding(mesh, P(None, None, "model", None)))
    split_cache = _head_split_cache(cache, mesh)
    compiled = attend.lower(split_q, split_cache).compile()  # once: run and text checked
    got = compiled(split_q, split_cache)
    _assert_matches(got, want, atol=1e-6)
    assert tuple(got[0].sharding.spec)[:3] == (None, None, "model"), got[0].sharding
    assert _gathered_inputs(compiled.as_text()) == []


@pytest.mark.parametrize("backend,quantized,in_cache", [
    ("xla", False, True), ("interpret", False, True), ("xla", True, True),
    ("xla", False, False), ("interpret", True, False)])
def test_ragged_op_split_over_kv_heads_equals_one_device(backend, quantized, in_cache):
    """The OpenVINO-spec op with the caches split by KV head and the tokens' heads
    (query [T, Hq * D] split between heads), re-rotated blocks included: outputs, updated
    caches and the scores (summed over heads, so over the devices) equal one device's;
    int8 caches too (their scales split with them, re-quantized per head when rotated);
    and with the rotation in the key reads (`rotation_in_cache=False`)."""
    from pallas_flex.paged.quantize import quantize
    from tests.paged.test_ragged import _rotation, alibi_slopes, make_case

    mesh = _mesh("Auto")
    case = make_case(2, [(5, 3), (0, 6), (12, 1)], block_size=4, q_heads=HQ,
                     kv_heads=HKV, head_dim=D, value_dim=D, dtype=jnp.float32)
    if quantized:
        (k_stored, k_scales), (v_stored, v_scales) = (
            quantize(case[name], jnp.int8) for name in ("key_cache", "value_cache"))
        case = dict(case, key_cache=k_stored, value_cache=v_stored, key_cache_scales=k_scales,
                    value_cache_scales=v_scales)
    options = dict(sliding_window=6, alibi_slopes=alibi_slopes(HQ),
                   **_rotation(case, 4, D, per_slot=True), rotation_in_cache=in_cache)

    @jax.jit
    def step(case):
        return pf.paged.paged_attention(**case, **options, return_scores=True,
                                        backend=backend)
    want = step(case)
    heads = NamedSharding(mesh, P(None, "model"))
    pages = NamedSharding(mesh, P(None, "model", None, None))
    split = dict(case, query=jax.device_put(case["query"], heads),
                 key=jax.device_put(case["key"], heads),
                 value=jax.device_put(case["value"], heads),
                 key_cache=jax.device_put(case["key_cache"], pages),
                 value_cache=jax.device_put(case["value_cache"], pages))
    if quantized:
        scales = NamedSharding(mesh, P(None, "model", None))
        split.update({name: jax.device_put(case[name], scales)
                      for name in ("key_cache_scales", "value_cache_scales")})
    compiled = step.lower(split).compile()  # once: run and its text checked
    got = compiled(split)
    _assert_matches(got[0], want[0], atol=1e-6)
    _assert_matches(got[1], want[1], atol=1e-5)  # scores: partial sums added across heads
    # The caches: bit for bit where XLA rotates the listed blocks; the Pallas rotation
    # kernel (`kernels/rotate_blocks.py`, 16/32-bit caches on the Pallas backends) runs
    # with one head a device instead of two a program, its float32 products fused into
    # multiply-adds differently: within 2 units in the last place.
    _assert_matches(got[2:], want[2:], atol=0 if backend == "xla" else 2.5e-7)
    assert tuple(got[0].sharding.spec) == (None, "model"), got[0].sharding
    assert tuple(got[2].sharding.spec)[:2] == (None, "model"), got[2].sharding
    assert _gathered_inputs(compiled.as_text()) == []


def test_programs_name_their_partitioned_body_for_the_compilation_cache():
    """A custom-partitioned call's program text holds a digest of what it computes
    (`sharding._fingerprint`): calls of the same shapes with different score_mods get
    different texts even with the callback address left out, so JAX's persistent
    compilation cache (on in this suite) never hands one of them the other's executable.
    With `jax_remove_custom_partitioning_ptr_from_cache_key` the addresses are out of the
    cache key too, as when two processes' addresses coincide (the suite once failed that
    way): the second call computes its own scores. The same call traced twice keeps one
    text, so the cache still serves it."""
    import re

    mesh = _mesh("Auto")
    q, k, v, _ = _inputs()
    split = NamedSharding(mesh, P("data", None, "model"))
    placed = [jax.device_put(x, split) for x in (q, k, v)]
    mods = {"doubled": lambda score, b, h, q_idx, kv_idx: score * 2.0,
            "halved": lambda score, b, h, q_idx, kv_idx: score * 0.5}

    def program(mod):
        return jax.jit(lambda q, k, v: pf.attention(q, k, v, score_mod=mod, backend="xla"))

    def text_without_address(mod):
        text = program(mod).lower(*placed).as_text()
        assert "CustomSPMDPartitioning" in text
        return re.sub(r'backend_config = "\d+"', "", text)

    assert text_without_address(mods["doubled"]) != text_without_address(mods["halved"])
    assert text_without_address(mods["doubled"]) == text_without_address(
        lambda score, b, h, q_idx, kv_idx: score * 2.0)
    previous = jax.config.jax_remove_custom_partitioning_ptr_from_cache_key
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
    try:
        for mod in mods.values():
            got = program(mod)(*placed)
            want = pf.attention(q, k, v, score_mod=mod, backend="xla")
            _assert_matches(got, want, atol=1e-6)
    finally:
        jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", previous)


def test_operands_on_an_explicit_mesh_of_one_device():
    """Arrays typed on an Explicit mesh of one device (jax.make_mesh's default axis type,
    as a single-GPU user of jax.sharding.use_mesh gets) run through the kernels like
    plain arrays: the call once crashed inside them on sharded types."""
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (2, 64, 4, 32), jnp.float32) for key in keys)
    placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, P())) for x in (q, k, v)]

    def loss(q, k, v):
        return jnp.sum(pf.attention(q, k, v, mask_mod=masks.causal_mask, backend="xla") ** 2)
    expected = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*placed)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_attention_inside_a_shard_map_that_checks_varying_axes(backend):
    """pf.attention inside jax.shard_map with check_vma=True (its default): batch rows
    split over "data", the 2 x 2 mesh's "model" axis manual too. Outputs and gradients
    of q, k, v equal the call on one device; ALiBi slopes and sinks that every device
    reads whole get the sum of the devices' gradients (their cotangents typed as their
    primals, `sharding.typed_as_primals`); decode (one query token) runs too, on a paged
    cache and on an int8 cache as well; naming the
    Mosaic GPU kernel is a ValueError saying the Triton kernels run there."""
    mesh = _mesh("Explicit")
    q, k, v, d_out = _inputs()
    sinks = jnp.asarray([0.3, -0.2, 0.1, 0.0], jnp.float32)

    def attend(q, k, v, slopes, sinks, **options):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, sinks=sinks,
                            score_mod=lambda s, b, h, q_idx, kv_idx:
                            s + slopes[h] * (kv_idx - q_idx), backend=backend, **options)

    def loss(q, k, v, slopes, sinks, d_out):
        return jnp.sum(attend(q, k, v, slopes, sinks) * d_out)

    expected = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, SLOPES, sinks,
                                                                 d_out)
    expected_decode = pf.flex_attention(q[:, :1], k, v, backend=backend)
    # An int8 cache with per-token scales (the quantized contiguous decode).
    quantized = [*quantize(k.astype(jnp.bfloat16), jnp.int8),
                 *quantize(v.astype(jnp.bfloat16), jnp.int8)]
    quantized = [quantized[0], quantized[2], quantized[1], quantized[3]]
    expected_quantized = pf.flex_attention(q[:, :1].astype(jnp.bfloat16), *quantized[:2],
                                           k_scales=quantized[2], v_scales=quantized[3],
                                           backend=backend)
    split, whole = P("data"), P()
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in
                  zip((q, k, v, SLOPES, sinks, d_out),
                      (split, split, split, whole, whole, split))]

        def local_loss(*args):
            return jax.lax.psum(loss(*args), "data")

        step = jax.jit(jax.value_and_grad(jax.shard_map(
            local_loss, mesh=mesh, in_specs=(split,) * 3 + (whole,) * 2 + (split,),
            out_specs=P(), check_vma=True), argnums=(0, 1, 2, 3, 4)))
        got = step(*placed)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)

        decode = jax.jit(jax.shard_map(
            lambda q, k, v: pf.flex_attention(q, k, v, backend=backend), mesh=mesh,
            in_specs=(split,) * 3, out_specs=split, check_vma=True))
        np.testing.assert_allclose(np.asarray(decode(placed[0][:, :1], *placed[1:3])),
                                   np.asarray(expected_decode), atol=1e-5, rtol=1e-5)

        def quantized_decode(q, k, v, k_scales, v_scales):
            return pf.flex_attention(q, k, v, k_scales=k_scales, v_scales=v_scales,
                                     backend=backend)

        def paged_decode(q, k, v):  # a cache built on each device from its rows
            cache = pf.paged.PagedKVCache.create(
                num_pages=4 * q.shape[0], page_size=64, max_batch=q.shape[0],
                max_pages_per_seq=3, kv_heads=HKV, head_dim=D, dtype=q.dtype)
            for row in range(q.shape[0]):
                cache = cache.reserve(row, S)
            cache = cache.assign_batch(jnp.zeros((q.shape[0],), jnp.int32), k, v)
            return pf.paged.paged_flex_attention(q, cache, backend=backend)

        step = jax.jit(jax.shard_map(paged_decode, mesh=mesh, in_specs=(split,) * 3,
                                     out_specs=split, check_vma=True))
        np.testing.assert_allclose(np.asarray(step(placed[0][:, :1], *placed[1:3])),
                                   np.asarray(expected_decode), atol=1e-5, rtol=1e-5)

        step = jax.jit(jax.shard_map(quantized_decode, mesh=mesh, in_specs=(split,) * 5,
                                     out_specs=split, check_vma=True))
        got = step(placed[0][:, :1].astype(jnp.bfloat16),
                   *[jax.device_put(x, NamedSharding(mesh, split)) for x in quantized])
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(expected_quantized, np.float32), atol=1e-2)
        if backend == "interpret":
            named = jax.jit(jax.shard_map(
                lambda *args: attend(*args, kernel_options={"forward_kernel": "mosaic"}),
                mesh=mesh, in_specs=(split,) * 3 + (whole,) * 2, out_specs=split,
                check_vma=True))
            covered = [jax.device_put(jnp.ones((B, 128, heads, 64), jnp.bfloat16),
                                      NamedSharding(mesh, split)) for heads in (HQ, HKV, HKV)]
            with pytest.raises(ValueError, match="check_vma=True.*Triton kernels run"):
                named(*covered, *placed[3:5])


def test_a_mask_of_a_shard_s_own_arrays_inside_a_shard_map_that_checks_varying_axes():
    """A mask_mod reading document ids that are split with the batch rows (so its
    BlockMask's tables vary over the manual axis): the "xla" backend equals the call on
    one device; the "interpret" backend, whose Pallas interpreter cannot index varying
    tables, is a ValueError naming the way out."""
    mesh = _mesh("Explicit")
    q, k, v, _ = _inputs()
    ids = jnp.asarray(np.repeat(np.arange(4), S // 4)[None].repeat(B, 0) + np.arange(B)[:, None]
                      % 2, jnp.int32)

    def attend(q, k, v, ids, backend):
        return pf.attention(q, k, v, backend=backend,
                            mask_mod=lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx])

    expected = attend(q, k, v, ids, "xla")
    split = P("data")
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, split)) for x in (q, k, v, ids)]
        for backend in ("xla", "interpret"):
            step = jax.jit(jax.shard_map(functools.partial(attend, backend=backend),
                                         mesh=mesh, in_specs=(split,) * 4, out_specs=split,
                                         check_vma=True))
            if backend == "xla":
                np.testing.assert_allclose(np.asarray(step(*placed)), np.asarray(expected),
                                           atol=1e-5, rtol=1e-5)
            else:
                with pytest.raises(ValueError, match="interpreter cannot index"):
                    step(*placed)

