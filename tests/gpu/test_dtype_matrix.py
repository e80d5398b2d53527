"""Issue 15: every dtype x head dim x head layout x operation x shared-memory budget cell
passes against the float64 reference.

Cells (504): dtype {float32, bfloat16, float16} x head dim {32, 64, 80, 96, 128, 192,
256} x layout {mha: Hq = Hkv = 4, gqa: Hq 8, Hkv 2} x op x budget {device's own, 164,
100, 64 KiB} (`PALLAS_FLEX_SHARED_MEMORY_KIB`), where op is
  forward:          Sq 200, Skv 300, no mask, no score_mod;
  forward_backward: Sq = Skv = 300, causal, ALiBi with learnable float32 slopes [Hq]:
                    out, dq, dk, dv and the slopes' gradient;
  decode:           Sq 1 after 900 cached positions of Skv 1000 (decode kernel),
                    `offset(causal)` and `offset_score(alibi)`.
B = 1 throughout. Each cell is one test and one fresh `jax.jit`, whose first call is timed
(compile seconds go to `PALLAS_FLEX_RESULTS`, see conftest). The float64 values and the
plain-JAX baselines depend on (dtype, head dim, layout, op) only: computed once and
shared by the four budgets.

Rules (tests/gpu/conftest.py): outputs float32 within 1e-4 of max|ref|, 16-bit RMSE no
worse than plain JAX's in that dtype; dq/dk/dv as tests/test_backward.py; the slopes'
gradient float32 within 1e-3 of max|ref|, 16-bit RMSE no worse than twice plain JAX's.

Cells no kernel configuration fits (`REFUSED`): float32 forward_backward at head dims
192 and 256 under 64 KiB. On tensor cores (the H100 this suite runs on) the smallest
float32 backward at a 256-wide (padded) head dim, 16-row tiles and one stage, needs ~81
KiB: its held tiles are kept as TF32 high and low halves (kernels/shared_memory.py). The
call raises a ValueError that says so and points to bfloat16/float16 or a smaller head
dim; these cells expect it. The list comes from the shared-memory audit (`python -m
benchmarks.inspect_kernels audit`, tests/gpu/results/shared-memory-audit.json),
which compiles every cell's kernels for the GPU each budget stands for; a real T4 (sm_75,
no tensor cores in Triton) plans with its own estimate and is not bound by this list.

Also: a budget set between two calls changes the second call's kernels without clearing
JAX's caches (`test_budget_change_takes_effect_on_the_next_call`). The cells do not rely
on it: the suite clears the caches when the budget changes (conftest).

Runtime estimate (H100). First-call compile seconds measured there with an earlier
version of this suite running as 6 concurrent shards (f908cd9:benchmarks/results/
2026-11-24-h100-training-dtypes-and-captured-gradients.json; the latest whole run:
tests/gpu/results/h100-gpu-suite.json): forward 4.2 (float32) /
2.7 (16-bit), forward_backward 7.3 / 4.5, decode 2.5 / 1.9. Tracing every cell on the
CPU (kernels planned as for the H100) gives 346 distinct programs of the 504 (146
float32, 200 16-bit), and ~28 more on the GPU, where the device budget's 16-bit forward
runs the Mosaic kernel: ~374 compiles, ~1390 s, plus ~0.3 s a cell of lowering,
host-CPU references and checks: ~26 min in one process. The other ~130 cells resolve
to a program byte for byte identical to an earlier budget's and run its executable
(`compile_and_time`). `make test-gpu` runs this file and test_captured_gradients.py
(~27 min) as 8 concurrent shards, ~7-8 min (see the Makefile). Measured figures: the
records of a run (`PALLAS_FLEX_RESULTS`).

Select a slice with -k, e.g. `-k "float32-d128"` or `-k "smem64 and decode"` ("float16"
also matches "bfloat16": write `-k "float16 and not bfloat16"`).
"""

from __future__ import annotations

import functools
import itertools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels.reference import reference_attention
from tests.gpu.conftest import (BACKEND, attention_inputs, BUDGET_ENV, BUDGETS_KIB, SMALL, as_float64,
                                budget_id, check_captured_gradient, check_gradient,
                                check_output, compile_and_time, forget_traced_budget,
                                plain_attention, set_budget)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
HEAD_DIMS = [32, 64, 80, 96, 128, 192, 256]
LAYOUTS = {"mha": (4, 4), "gqa": (8, 2)}
OPS = ["forward", "forward_backward", "decode"]

if SMALL:  # interpret-mode checks of the test code on the CPU
    FORWARD_LENGTHS, BACKWARD_LENGTH, DECODE_KV_LENGTH, DECODE_POSITION = (40, 56), 45, 100, 80
else:
    FORWARD_LENGTHS, BACKWARD_LENGTH, DECODE_KV_LENGTH, DECODE_POSITION = (200, 300), 300, 1000, 900

GRADIENT_NAMES = ("out", "dq", "dk", "dv", "d_slopes")


def _lengths(op):
    if op == "forward":
        return FORWARD_LENGTHS
    if op == "forward_backward":
        return BACKWARD_LENGTH, BACKWARD_LENGTH
    return 1, DECODE_KV_LENGTH


def _mods(op, slopes):
    if op == "forward":
        return None, None
    if op == "forward_backward":
        return masks.causal_mask, masks.alibi(slopes)
    return (masks.offset(masks.causal_mask, DECODE_POSITION),
            masks.offset_score(masks.alibi(slopes), DECODE_POSITION))


def _outputs(attention_fn, op, q, k, v, slopes, d_out):
    """(out,) or, for forward_backward, (out, dq, dk, dv, d_slopes) of sum(out * d_out):
    the one computation run by the kernels, in float64 and by plain JAX."""
    def attend(q, k, v, slopes):
        mask_mod, score_mod = _mods(op, slopes)
        return attention_fn(q, k, v, mask_mod, score_mod)

    if op != "forward_backward":
        return (attend(q, k, v, slopes),)
    out, vjp = jax.vjp(attend, q, k, v, slopes)
    return (out, *vjp(d_out))


def _ours(q, k, v, mask_mod, score_mod):
    return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=BACKEND)


def _float64_reference(q, k, v, mask_mod, score_mod):
    return reference_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)[0]


def _plain(q, k, v, mask_mod, score_mod):
    return plain_attention(q, k, v, mask_mod, score_mod)


# Module-level jits, run on the host CPU (small shapes; CPU compiles are quicker than
# the GPU's).
_float64_outputs = jax.jit(functools.partial(_outputs, _float64_reference), static_argnums=0)
_plain_outputs = jax.jit(functools.partial(_outputs, _plain), static_argnums=0)


@functools.lru_cache(maxsize=None)
def _cell_data(dtype_name, head_dim, layout, op):
    """Inputs, float64 values and (16-bit) plain-JAX baselines of a cell: shared by its
    budgets."""
    dtype = DTYPES[dtype_name]
    q_heads, kv_heads = LAYOUTS[layout]
    q_len, kv_len = _lengths(op)
    seed = zlib.crc32(f"{dtype_name}-{head_dim}-{layout}-{op}".encode())
    q, k, v, d_out = attention_inputs(seed, q_len, kv_len, q_heads, kv_heads, head_dim, dtype)
    slopes = masks.alibi_slopes(q_heads)  # float32, learnable
    inputs = (q, k, v, slopes, d_out)
    with jax.default_device(jax.devices("cpu")[0]):
        with jax.enable_x64(True):
            expected = _float64_outputs(op, *(jnp.asarray(as_float64(x)) for x in inputs))
            expected = tuple(np.asarray(x) for x in expected)
        baseline = None
        if dtype != jnp.float32:
            host_inputs = [jnp.asarray(np.asarray(x)) for x in inputs]
            baseline = tuple(as_float64(x) for x in _plain_outputs(op, *host_inputs))
    return inputs, expected, baseline


# Ordered by (dtype, head dim), then budget: cells that share a budget are neighbours
# (JAX's caches are cleared when the budget changes, see conftest), and so are the
# budgets of one (dtype, head dim), which share reference values and often programs.
CELLS = [pytest.param(dtype_name, head_dim, layout, op, budget,
                      id=f"{dtype_name}-d{head_dim}-{layout}-{op}-{budget_id(budget)}")
         for dtype_name, head_dim, budget, layout, op in itertools.product(
             DTYPES, HEAD_DIMS, BUDGETS_KIB, LAYOUTS, OPS)]


# (dtype, head dims, op, budget KiB) of the cells no configuration fits (see the docstring).
REFUSED = {("float32", head_dim, "forward_backward", 64) for head_dim in (192, 256)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,head_dim,layout,op,budget", CELLS)
def test_cell_matches_float64_reference(dtype_name, head_dim, layout, op, budget, cell,
                                        monkeypatch):
    cell.update(issue=15, dtype=dtype_name, head_dim=head_dim, layout=layout, op=op,
                budget_kib=budget)
    inputs, expected, baseline = _cell_data(dtype_name, head_dim, layout, op)
    set_budget(monkeypatch, budget)
    if (dtype_name, head_dim, op, budget) in REFUSED:
        with pytest.raises(ValueError, match=f"{dtype_name} inputs at a head dim padded to "
                           r"\d+ cannot run on a GPU with this budget; use bfloat16 or "
                           "float16"):
            compile_and_time(functools.partial(_outputs, _ours, op), inputs, cell)
        cell.update(refused=True)
        return
    results, _ = compile_and_time(functools.partial(_outputs, _ours, op), inputs, cell)

    failures = []
    for index, (name, result) in enumerate(zip(GRADIENT_NAMES, results)):
        reference = expected[index]
        plain = None if baseline is None else baseline[index]
        if name == "out":
            assert result.shape == reference.shape and result.dtype == inputs[0].dtype
            failure = check_output(result, reference, plain)
        elif name == "d_slopes":
            failure = check_captured_gradient(result, reference, plain, name)
        else:
            assert result.shape == inputs[index - 1].shape
            failure = check_gradient(result, reference, plain, name)
        if failure:
            failures.append(failure)
    assert not failures, "; ".join(failures)


def cell_program(op, dtype, head_dim, layout):
    """(function, argument shapes) of a cell's kernel computation (also lowered by
    benchmarks/inspect_kernels.py's shared-memory audit)."""
    q_heads, kv_heads = LAYOUTS[layout]
    q_len, kv_len = _lengths(op)
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape in (
        (1, q_len, q_heads, head_dim), (1, kv_len, kv_heads, head_dim),
        (1, kv_len, kv_heads, head_dim))]
    args += [jax.ShapeDtypeStruct((q_heads,), jnp.float32),
             jax.ShapeDtypeStruct((1, q_len, q_heads, head_dim), dtype)]
    return functools.partial(_outputs, _ours, op), args


def _traced_program(op, dtype, head_dim, layout, clear_caches):
    """The jaxpr text of a cell's program under the current budget."""
    if clear_caches:
        jax.clear_caches()
    function, args = cell_program(op, dtype, head_dim, layout)
    jaxpr = jax.jit(function).trace(*args).jaxpr
    return re.sub(r"0x[0-9a-f]+", "", str(jaxpr))  # object addresses in reprs


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["forward_backward", "decode"])
def test_budget_change_takes_effect_on_the_next_call(op, monkeypatch, cell):
    """A budget set between two calls changes the second call's kernels, without clearing
    JAX's caches: what a 64 KiB budget traces right after a call under the device's own
    is what it traces from scratch (and differs from the device budget's kernels)."""
    cell.update(issue=15, dtype="float32", head_dim=128, layout="gqa", op=f"{op}_budget_change")
    forget_traced_budget()
    shape = (op, jnp.float32, 128, "gqa")
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    device_budget = _traced_program(*shape, clear_caches=True)
    monkeypatch.setenv(BUDGET_ENV, "64")
    after_a_call = _traced_program(*shape, clear_caches=False)
    from_scratch = _traced_program(*shape, clear_caches=True)
    changes_kernels, applied = from_scratch != device_budget, after_a_call == from_scratch
    assert changes_kernels, "the 64 KiB budget should change these kernels"
    assert applied, (
        f"{BUDGET_ENV}=64 set between calls was not applied: the call reused kernels "
        "traced under the previous budget (the budget is not part of a cache key)")
