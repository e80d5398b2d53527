"""The dispatch table (`pallas_flex.dispatch`): which forward kernel representative calls
get on an H100, an A100 and a machine without a GPU, checked on the CPU by planning as
each device would (its compute capability and shared memory). A row here and the rules
in the code must agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_flex as pf
from pallas_flex import dispatch, masks
from pallas_flex.api import _prepare, build_block_mask
from pallas_flex.kernels import device

H100, A100, NO_GPU = (9, 0), (8, 0), None


def _shape(batch=1, length=1024, heads=4, dim=128, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((batch, length, heads, dim), dtype)


def _t5_score_mod():
    table = jnp.zeros((4, 32))
    return lambda score, b, h, q_idx, kv_idx: score + table[h, jnp.clip(q_idx - kv_idx, 0, 31)]


def _gathering_score_mod():
    table = jnp.zeros((4, 32))
    return lambda score, b, h, q_idx, kv_idx: score + table[h, jnp.clip(q_idx + kv_idx, 0, 31)]


def _bias_score_mod():
    return pf.scores.bias_lookup(jnp.zeros((1, 1, 1024, 1024), jnp.bfloat16))


def _halves_mask():
    """Documents read at q_idx // 2: a gather, which the entry points precompute as a row
    vector (`dispatch.mask_for_kernels`); both positions computed: stays a gather."""
    ids = jnp.repeat(jnp.arange(8), 128)

    def halves(b, h, q_idx, kv_idx):
        return (ids[q_idx // 2] == ids[kv_idx]) & (q_idx // 2 >= kv_idx)
    return halves


def _pair_sum_mask():
    ids = jnp.repeat(jnp.arange(8), 256)
    return lambda b, h, q_idx, kv_idx: ids[q_idx + kv_idx] == 3


# (name, q, k/v, mask_mod, score_mod, kernel_options, backend, {device: kernel})
ROWS = [
    ("bf16 D128 mask read at q_idx // 2", _shape(length=2048), _shape(), _halves_mask(),
     None, None, "pallas", {H100: "mosaic_forward", A100: "triton_forward"}),
    ("bf16 D128 mask read at q_idx + kv_idx", _shape(), _shape(), _pair_sum_mask(), None,
     None, "pallas", {H100: "triton_forward", A100: "triton_forward"}),
    ("bf16 D128 causal", _shape(), _shape(), masks.causal_mask, None, None, "pallas",
     {H100: "mosaic_forward", A100: "triton_forward"}),
    ("f16 D64 noop", _shape(dim=64, dtype=jnp.float16), _shape(dim=64, dtype=jnp.float16),
     None, None, None, "pallas", {H100: "mosaic_forward", A100: "triton_forward"}),
    ("f32 D128 causal", _shape(dtype=jnp.float32), _shape(dtype=jnp.float32),
     masks.causal_mask, None, None, "pallas", {H100: "triton_forward", A100: "triton_forward"}),
    ("bf16 D256", _shape(dim=256), _shape(dim=256), masks.causal_mask, None, None, "pallas",
     {H100: "mosaic_forward", A100: "triton_forward"}),
    ("bf16 D96", _shape(dim=96), _shape(dim=96), masks.causal_mask, None, None, "pallas",
     {H100: "mosaic_forward", A100: "triton_forward"}),
    ("bf16 D32", _shape(dim=32), _shape(dim=32), masks.causal_mask, None, None, "pallas",
     {H100: "mosaic_forward", A100: "triton_forward"}),
    ("bf16 D48", _shape(dim=48), _shape(dim=48), masks.causal_mask, None, None, "pallas",
     {H100: "triton_forward", A100: "triton_forward"}),
    ("bf16 D128 T5 (a read at kv_idx - q_idx)", _shape(), _shape(), masks.causal_mask,
     _t5_score_mod(), None, "pallas", {H100: "mosaic_forward", A100: "triton_forward"}),
    ("bf16 D128 gather", _shape(), _shape(), masks.causal_mask, _gathering_score_mod(), None,
     "pallas", {H100: "triton_forward", A100: "triton_forward"}),
    ("bf16 D128 ALiBi", _shape(), _shape(), masks.causal_mask, masks.alibi(4), None, "pallas",
     {H100: "mosaic_forward", A100: "triton_forward"}),
    # A bias tensor read at (q_idx, kv_idx): the Mosaic forward copies its blocks by TMA
    # (not at D 256, where they do not fit shared memory beside the K/V stages).
    ("bf16 D128 bias tensor", _shape(), _shape(), masks.causal_mask, _bias_score_mod(), None,
     "pallas", {H100: "mosaic_forward", A100: "triton_forward"}),
    ("bf16 D256 bias tensor", _shape(dim=256), _shape(dim=256), masks.causal_mask,
     _bias_score_mod(), None, "pallas", {H100: "triton_forward", A100: "triton_forward"}),
    ("forward_kernel triton", _shape(), _shape(), masks.causal_mask, None,
     {"forward_kernel": "triton"}, "pallas", {H100: "triton_forward", A100: "triton_forward"}),
    ("one query token", _shape(length=1), _shape(), None, None, None, "pallas",
     {H100: "decode", A100: "decode"}),
    ("16 query tokens", _shape(length=16), _shape(), None, None, None, "pallas",
     {H100: "decode", A100: "decode"}),
    ("interpret", _shape(), _shape(), masks.causal_mask, None, None, "interpret",
     {H100: "triton_forward", A100: "triton_forward", NO_GPU: "triton_forward"}),
    ("interpret, Mosaic by name", _shape(), _shape(), masks.causal_mask, None,
     {"forward_kernel": "mosaic"}, "interpret",
     {H100: "mosaic_forward", A100: "mosaic_forward", NO_GPU: "mosaic_forward"}),
    ("xla", _shape(), _shape(), masks.causal_mask, None, None, "xla",
     {H100: "xla_blockwise", A100: "xla_blockwise", NO_GPU: "xla_blockwise"}),
    ("no GPU, default backend", _shape(), _shape(), masks.causal_mask, None, None, None,
     {NO_GPU: "xla_blockwise"}),
]


@pytest.fixture
def plan_as(monkeypatch):
    """Plans calls as on a GPU of the given compute capability (None: no GPU)."""
    def plan(capability):
        monkeypatch.setattr(device, "compute_capability", lambda: capability)
        monkeypatch.delenv(device.SHARED_MEMORY_ENVIRONMENT_VARIABLE, raising=False)
    return plan


def _choose(q, kv, mask_mod, score_mod, kernel_options, backend):
    block_mask = None
    if mask_mod is not None:
        block_mask = build_block_mask(mask_mod, q.shape[0], q.shape[2], q.shape[1],
                                      kv.shape[1], kernel_options)
    # resolve_backend refuses "pallas" without a GPU; these calls are only planned.
    with pf.api.lowering_for_gpu():
        block_mask, score_program, (backend, _, options) = _prepare(
            q, kv, kv, score_mod, block_mask, None, backend, kernel_options)
    return dispatch.choose_forward(q, kv, kv, block_mask, score_program, backend=backend,
                                   options=options)


CASES = [pytest.param(row, capability, kernel,
                      id=f"{row[0]}-{'cpu' if capability is None else 'sm%d%d' % capability}")
         for row in ROWS for capability, kernel in row[-1].items()]


@pytest.mark.parametrize("row,capability,kernel", CASES)
def test_dispatch_table(row, capability, kernel, plan_as):
    plan_as(capability)
    _, q, kv, mask_mod, score_mod, kernel_options, backend, _ = row
    choice = _choose(q, kv, mask_mod, score_mod, kernel_options, backend)
    assert choice.kernel == kernel, choice.reason
    assert choice.kernel in dispatch.FORWARD_KERNELS and choice.reason


def test_the_explanation_names_the_query_blocks_per_program(plan_as):
    plan_as(H100)
    causal = _choose(_shape(dim=64), _shape(dim=64), masks.causal_mask, None, None, "pallas")
    # 8 x 16 heads x 16 query blocks: one wave of 128 programs on the H100's 132 SMs.
    large = _shape(batch=8, length=2048, heads=16, dim=64)
    dense = _choose(large, large, None, None, None, "pallas")
    given = _choose(_shape(), _shape(), None, None, {"forward_items_per_program": 3},
                    "pallas")
    assert causal.kernel == dense.kernel == given.kernel == "mosaic_forward"
    assert "2 query blocks per program" in causal.reason
    assert "16 query blocks per program" in dense.reason
    assert "3 query blocks per program" in given.reason


def test_backward_auto_waits_for_gpu_timings_of_d32_and_bias_blocks(plan_as):
    """On Hopper, backward_kernel "auto" keeps the Triton backward for what the Mosaic
    backward takes but has not been timed on the GPU (`awaiting_measurement`: head dim
    32, a bias tensor read at (q_idx, kv_idx)), saying so; named, the Mosaic one runs."""
    plan_as(H100)
    def backward(dim, score_mod=None, kernel_options=None):
        q = _shape(dim=dim)
        block_mask = build_block_mask(masks.causal_mask, 1, q.shape[2], q.shape[1],
                                      q.shape[1], kernel_options)
        with pf.api.lowering_for_gpu():
            block_mask, program, (backend, _, options) = _prepare(
                q, q, q, score_mod, block_mask, None, "pallas", kernel_options)
        return dispatch.choose_backward(q, q, q, block_mask, program, backend=backend,
                                        options=options)
    assert backward(64).kernel == "mosaic_backward"
    for dim, score_mod, waiting in ((32, None, "head dim 32"),
                                    (64, masks.bias_lookup(jnp.zeros(
                                        (1, 1, 1024, 1024), jnp.bfloat16)), "bias tensor")):
        choice = backward(dim, score_mod)
        assert choice.kernel == "triton_backward" and waiting in choice.reason, choice
        assert "not yet timed" in choice.reason
        assert backward(dim, score_mod, {"backward_kernel": "mosaic"}).kernel == (
            "mosaic_backward")


@pytest.mark.parametrize("capability,reason", [
    (A100, "compute capability 8.0"), (NO_GPU, "no GPU")])
def test_why_the_mosaic_kernel_is_not_taken(capability, reason, plan_as):
    plan_as(capability)
    with pf.api.lowering_for_gpu():
        choice = _choose(_shape(), _shape(), masks.causal_mask, None, None, "pallas")
    assert choice.kernel == "triton_forward" and reason in choice.reason


def test_a_smaller_shared_memory_budget_runs_the_triton_kernel(plan_as, monkeypatch):
    plan_as(H100)
    monkeypatch.setenv(device.SHARED_MEMORY_ENVIRONMENT_VARIABLE, "164")
    choice = _choose(_shape(), _shape(), masks.causal_mask, None, None, "pallas")
    assert choice.kernel == "triton_forward" and "164 KiB" in choice.reason


def test_naming_the_mosaic_kernel_for_a_call_it_cannot_take_is_a_value_error(plan_as):
    plan_as(H100)
    with pytest.raises(ValueError, match="forward_kernel'] is 'mosaic'.*float32"):
        _choose(_shape(dtype=jnp.float32), _shape(dtype=jnp.float32), masks.causal_mask,
                None, {"forward_kernel": "mosaic"}, "pallas")


@pytest.mark.parametrize("page_size,kernel", [(16, "mosaic_forward"), (128, "mosaic_forward"),
                                              (4, "triton_forward"), (48, "triton_forward")])
def test_paged_prefill_by_page_size(page_size, kernel, plan_as):
    plan_as(H100)
    q = _shape(length=256)
    pages = jax.ShapeDtypeStruct((64, 4, page_size, 128), jnp.bfloat16)
    block_mask = build_block_mask(masks.causal_mask, 1, 4, 256, 1024, None)
    with pf.api.lowering_for_gpu():
        _, _, (_, _, options) = _prepare(q, _shape(), _shape(), None, block_mask, None,
                                         "pallas", None)
    choice = dispatch.choose_forward(q, pages, pages, block_mask, None, backend="pallas",
                                     options=options, paged=True)
    assert choice.kernel == kernel, choice.reason


def test_explain_names_the_kernels():
    q = _shape()
    text = pf.explain(q, q, q, mask_mod=masks.causal_mask, backend="interpret")
    assert text.splitlines()[0].startswith("forward: triton_forward")
    assert "backward: triton_backward" in text
    decode = pf.explain(_shape(length=1), q, q, backend="interpret")
    assert decode.startswith("forward: decode")
    assert pf.explain(q, q, q, backend="reference").startswith("forward: reference")

