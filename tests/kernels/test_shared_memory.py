"""The shared-memory estimate against sizes Triton reported, and fitting configurations
to a budget (kernels/shared_memory.py, kernels/device.py)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import pallas_flex as pf
from pallas_flex.kernels import device, shared_memory
from pallas_flex.kernels.config import resolve_options
from pallas_flex.kernels.shared_memory import ModReads, backward_bytes, forward_bytes

KIB = 1024

# (estimate arguments, bytes Triton reported) for the H100: XLA's "Shared memory size
# limit exceeded: requested N" where a launch did not fit (before this estimate existed),
# else pip triton 3.6.0 on the lowered kernel (benchmarks/inspect_kernels.py), which gave
# the same figure as XLA where both were seen.
MEASURED = [
    # bf16 D128 backward, default tiles (dQ 128x64, dK/dV 64x128, 3 stages): pip triton
    (dict(kind="backward", dtype=jnp.bfloat16, head_dim=128, dq_tile=(128, 64),
          dkdv_tile=(64, 128), stages=3), 164864),
    # the same with a differentiated T5 table: XLA
    (dict(kind="backward", dtype=jnp.bfloat16, head_dim=128, dq_tile=(128, 64),
          dkdv_tile=(64, 128), stages=3, reads=ModReads(1, 1)), 262144),
    # D64 (dQ 128x128, dK/dV 64x128) with a differentiated T5 table: XLA
    (dict(kind="backward", dtype=jnp.bfloat16, head_dim=64, dq_tile=(128, 128),
          dkdv_tile=(64, 128), stages=3, reads=ModReads(1, 1)), 327680),
    # float32 D64 backward with 3xTF32 dots: pip triton
    (dict(kind="backward", dtype=jnp.float32, head_dim=64, dq_tile=(128, 128),
          dkdv_tile=(64, 128), stages=3), 327680),
    # float32 D256 backward on 32-row tiles (mma.sync, no operand copies): pip triton
    (dict(kind="backward", dtype=jnp.float32, head_dim=256, dq_tile=(32, 32),
          dkdv_tile=(32, 32), stages=2), 196612),
    # forwards: bf16 D64 (64x64, 3 stages), D128 (128x64, 2), float32 D128 with 3xTF32
    (dict(kind="forward", dtype=jnp.bfloat16, head_dim=64, block_q=64, block_kv=64,
          stages=3), 57344),
    (dict(kind="forward", dtype=jnp.bfloat16, head_dim=128, block_q=128, block_kv=64,
          stages=2), 98304),
    (dict(kind="forward", dtype=jnp.float32, head_dim=128, block_q=128, block_kv=64,
          stages=2), 262144),
    # a T5 table read in the forward: the estimate's two scratch tiles are what D64
    # needed (pip triton: 90112 at 64x64, 3 stages); at 128x64 Triton needed one
    (dict(kind="forward", dtype=jnp.bfloat16, head_dim=64, block_q=64, block_kv=64,
          stages=3, reads=ModReads(1, 0)), 90112),
    (dict(kind="forward", dtype=jnp.bfloat16, head_dim=128, block_q=128, block_kv=64,
          stages=2, reads=ModReads(1, 0), slack=33 * KIB), 131072),
    # float32 with one stage, pip triton for the budget's GPU (tests/gpu/results/
    # shared-memory-audit.json): held tiles in TF32 halves, one streamed tile.
    # D256 backward, 16-row tiles, sm_90 (the K tile once per dot layout)
    (dict(kind="backward", dtype=jnp.float32, head_dim=256, dq_tile=(16, 16),
          dkdv_tile=(16, 16), stages=1), 81920),
    # D256 backward, 32-row tiles, sm_80; dQ 32x16, dK/dV 16x32, sm_89
    (dict(kind="backward", dtype=jnp.float32, head_dim=256, dq_tile=(32, 32),
          dkdv_tile=(32, 32), stages=1, capability=(8, 0)), 163840),
    (dict(kind="backward", dtype=jnp.float32, head_dim=256, dq_tile=(32, 16),
          dkdv_tile=(16, 32), stages=1, capability=(8, 9)), 147456),
    # D256 forward 32x16, sm_89
    (dict(kind="forward", dtype=jnp.float32, head_dim=256, block_q=32, block_kv=16,
          stages=1, capability=(8, 9)), 81920),
    # D256 forward 64x32: sm_80 streams one tile at a time; sm_90's wgmma reads K and V
    # from shared memory, both there
    (dict(kind="forward", dtype=jnp.float32, head_dim=256, block_q=64, block_kv=32,
          stages=1, capability=(8, 0)), 163840),
    (dict(kind="forward", dtype=jnp.float32, head_dim=256, block_q=64, block_kv=32,
          stages=1), 196608),
    # sm_75 (T4): FMA dots on float32 copies of the operands, no pipeline
    (dict(kind="backward", dtype=jnp.float32, head_dim=128, dq_tile=(32, 16),
          dkdv_tile=(16, 32), stages=1, capability=(7, 5)), 53248),
    (dict(kind="backward", dtype=jnp.float16, head_dim=256, dq_tile=(32, 16),
          dkdv_tile=(16, 32), stages=1, capability=(7, 5), slack=25 * KIB), 81920),
    (dict(kind="forward", dtype=jnp.float16, head_dim=256, block_q=64, block_kv=16,
          stages=1, capability=(7, 5), slack=25 * KIB), 81920),
    (dict(kind="forward", dtype=jnp.float32, head_dim=128, block_q=32, block_kv=16,
          stages=1, capability=(7, 5)), 32768),
    # a differentiated key bias read at kv_idx (a vector a tile, summed across warps):
    # D64 and D128 bf16 backwards; a query bias read at q_idx, differentiated by the
    # batch loop, not here: D128 bf16; pip triton
    (dict(kind="backward", dtype=jnp.bfloat16, head_dim=64, dq_tile=(128, 128),
          dkdv_tile=(64, 128), stages=3, reads=ModReads(vector_gradients=1, vector_reads=1)),
     136192),
    (dict(kind="backward", dtype=jnp.bfloat16, head_dim=128, dq_tile=(128, 64),
          dkdv_tile=(64, 128), stages=3, reads=ModReads(vector_gradients=1, vector_reads=1)),
     166912),
    (dict(kind="backward", dtype=jnp.bfloat16, head_dim=128, dq_tile=(128, 64),
          dkdv_tile=(64, 128), stages=3, reads=ModReads(vector_reads=1)), 165888),
    # a pair bias read at exactly q_idx, kv_idx, loaded as blocks (float32, D128
    # backward; the forward: bf16 D128, float32 D64): pip triton
    (dict(kind="backward", dtype=jnp.bfloat16, head_dim=128, dq_tile=(128, 64),
          dkdv_tile=(64, 128), stages=3, reads=ModReads(1, 1), slack=32 * KIB), 230400),
    (dict(kind="forward", dtype=jnp.bfloat16, head_dim=128, block_q=128, block_kv=64,
          stages=2, reads=ModReads(1, 0), slack=49 * KIB), 114688),
    (dict(kind="forward", dtype=jnp.bfloat16, head_dim=64, block_q=64, block_kv=64,
          stages=3, reads=ModReads(1, 0), slack=24 * KIB), 73728),
    # large tiles of a small head dim: the two score tiles the estimate counts are not
    # both live there (float16 D32, dQ 128x128, dK/dV 64x128)
    (dict(kind="backward", dtype=jnp.float16, head_dim=32, dq_tile=(128, 128),
          dkdv_tile=(64, 128), stages=2, capability=(7, 5), slack=100 * KIB), 98304),
]


def _estimate(case):
    reads, capability = case.get("reads", ModReads()), case.get("capability", (9, 0))
    if case["kind"] == "forward":
        return forward_bytes(dtype=case["dtype"], head_dim=case["head_dim"],
                             value_dim=case["head_dim"], block_q=case["block_q"],
                             block_kv=case["block_kv"], num_stages=case["stages"], reads=reads,
                             capability=capability)
    stages = shared_memory.effective_backward_stages
    return backward_bytes(
        dtype=case["dtype"], head_dim=case["head_dim"], value_dim=case["head_dim"],
        dq_tile=case["dq_tile"], dkdv_tile=case["dkdv_tile"],
        dq_stages=stages(case["stages"], min(case["dq_tile"][0], case["dkdv_tile"][1])),
        dkdv_stages=stages(case["stages"], case["dkdv_tile"][1]), reads=reads, capability=capability)


@pytest.mark.parametrize("case,reported", MEASURED)
def test_estimate_covers_what_triton_reported_and_errs_by_little(case, reported):
    estimate = _estimate(case)
    assert estimate >= reported, f"estimate {estimate} below the {reported} Triton needed"
    slack = case.get("slack", 8 * KIB)
    assert estimate <= reported + slack, f"estimate {estimate} far above {reported}"


def _backward_estimate(options, dtype, head_dim, reads=ModReads()):
    return shared_memory.backward_options_bytes(options, dtype=dtype, head_dim=head_dim,
                                                value_dim=head_dim, mask_block=(128, 128),
                                                reads=reads)


def test_hopper_defaults_fit_unchanged_in_16_bit():
    for head_dim in (32, 64, 128, 256):
        options = resolve_options(None, head_dim)
        fitted = shared_memory.fit(options, lambda o: _backward_estimate(
            o, jnp.bfloat16, head_dim), 227 * KIB, kernel="backward")
        assert fitted == options


@pytest.mark.parametrize("budget_kib", [227, 164, 100, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fitting_shrinks_until_the_estimate_fits(budget_kib, dtype):
    reads = ModReads(tile_reads=1, tile_gradients=1)
    options = resolve_options(None, 128)
    estimate = lambda o: _backward_estimate(o, dtype, 128, reads)  # noqa: E731
    fitted = shared_memory.fit(options, estimate, budget_kib * KIB, kernel="backward")
    assert estimate(fitted) <= budget_kib * KIB
    assert estimate(options) > budget_kib * KIB or fitted == options


def test_user_settings_are_kept_or_refused_by_name():
    options = resolve_options({"backward_block_q": 128, "backward_num_stages": 3}, 128)
    estimate = lambda o: _backward_estimate(o, jnp.bfloat16, 128)  # noqa: E731
    fitted = shared_memory.fit(options, estimate, 164 * KIB, kernel="backward")
    assert estimate(fitted) <= 164 * KIB
    assert (fitted.backward_block_q, fitted.backward_num_stages) == (128, 3)
    with pytest.raises(ValueError, match="backward_block_q"):
        shared_memory.fit(resolve_options({"backward_block_q": 128, "backward_block_kv": 128,
                                           "backward_dkdv_block_q": 128,
                                           "backward_dkdv_block_kv": 128}, 128),
                          estimate, 64 * KIB, kernel="backward")


def test_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(device.SHARED_MEMORY_ENVIRONMENT_VARIABLE, raising=False)
    assert device.shared_memory_budget() == device.device_shared_memory_bytes()
    monkeypatch.setenv(device.SHARED_MEMORY_ENVIRONMENT_VARIABLE, "100")
    assert device.shared_memory_budget() == 100 * KIB
    assert not device.mosaic_allowed(device.shared_memory_budget())
    monkeypatch.setenv(device.SHARED_MEMORY_ENVIRONMENT_VARIABLE, "lots")
    with pytest.raises(ValueError, match="PALLAS_FLEX_SHARED_MEMORY_KIB"):
        device.shared_memory_budget()


def test_a_call_whose_options_cannot_fit_names_them(monkeypatch):
    monkeypatch.setenv(device.SHARED_MEMORY_ENVIRONMENT_VARIABLE, "64")
    q = jnp.ones((1, 128, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="block_q"):
        pf.attention(q, q, q, backend="interpret",
                     kernel_options={"block_q": 128, "block_kv": 128, "num_stages": 3})
    # Left to the defaults, the same call fits the 64 KiB budget and runs.
    out = pf.attention(q, q, q, backend="interpret")
    assert out.shape == q.shape
