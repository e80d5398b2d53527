"""Machinery shared by the GPU suites: which backend runs the kernels, the shared-memory
budgets, the plain-JAX accuracy baseline, the accuracy rules, first-call timing, and one
JSON record per cell.

Environment:
  PALLAS_FLEX_TEST_BACKEND: "pallas" (default: the GPU kernels) or "interpret" (the same
    test bodies in Pallas's interpreter on the CPU; slow, select a few cells with -k).
  PALLAS_FLEX_TEST_SMALL=1: shorter sequences (for interpret-mode checks of the tests).
  PALLAS_FLEX_RESULTS=path: one JSON record per cell (test id, parameters, passed,
    first-call compile seconds, error), plus device, jax version and date. Rewritten
    after every test, so a run cut off by a time limit keeps the cells it finished.
    Under pytest-xdist each worker writes `path.<worker id>`. A cell that ran the
    executable of an earlier cell (the same program: its budget resolved to the same
    kernels) says so in `same_program_as`.
  PALLAS_FLEX_SHARED_MEMORY_KIB: the kernels' shared-memory budget; the budget tests set
    and unset it per cell (`set_budget`).
  PALLAS_FLEX_TEST_SHARD=i/n and PALLAS_FLEX_GPU_SMOKE=1: shards and the smoke selection
    (tests/selection.py, hooked in from tests/conftest.py: they apply to any run).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import rmse
from tests.selection import SHARD_ENV
from tests.test_backward import FLOAT32_GRADIENT_TOLERANCE, _assert_gradient_close

BACKEND = os.environ.get("PALLAS_FLEX_TEST_BACKEND", "pallas")
SMALL = os.environ.get("PALLAS_FLEX_TEST_SMALL", "") not in ("", "0")
BUDGET_ENV = "PALLAS_FLEX_SHARED_MEMORY_KIB"
RESULTS_ENV = "PALLAS_FLEX_RESULTS"
# Shared-memory budgets (KiB) the kernels' configurations must fit: None is the device's
# own (227 KiB on the H100), then an A100's, an sm_89's and a T4's.
BUDGETS_KIB = [None, 164, 100, 64]

# float32 kernels run their dots as three TF32 products on the GPU (about 1e-6 relative
# per product); with accumulation over a few hundred keys the outputs land within this
# of the float64 value, relative to the output's scale.
FLOAT32_OUTPUT_TOLERANCE = 1e-4
# float32 gradients of captured arrays sum over every (query, key) pair that reads an
# entry: relative to the gradient's scale they stay within this (issue 23's bar).
FLOAT32_CAPTURED_TOLERANCE = 1e-3
# 16-bit captured-array gradients: RMSE against float64 no worse than this many times
# plain JAX attention's in the same dtype (issues 15 and 23).
CAPTURED_BASELINE_FACTOR = 2.0


# The budget JAX's caches hold traces for. The variable is read when a call is traced,
# and pallas_flex's inner jit may reuse a trace made under another budget (see
# test_dtype_matrix.py::test_budget_change_takes_effect_on_the_next_call), so the suites
# clear the caches whenever the budget differs from the one they were traced under:
# each cell then runs its own budget's kernels whatever the library caches.
_traced_under = [os.environ.get(BUDGET_ENV)]


def sync_caches_with_budget():
    current = os.environ.get(BUDGET_ENV)
    if _traced_under[0] != current:
        jax.clear_caches()
        _traced_under[0] = current


def forget_traced_budget():
    """After a test that traced under changed budgets itself."""
    _traced_under[0] = object()


@pytest.fixture(autouse=True)
def _caches_follow_budget():
    sync_caches_with_budget()


def set_budget(monkeypatch, budget_kib):
    """Shared-memory budget of the next calls (None: the device's own)."""
    if budget_kib is None:
        monkeypatch.delenv(BUDGET_ENV, raising=False)
    else:
        monkeypatch.setenv(BUDGET_ENV, str(budget_kib))
    sync_caches_with_budget()


def budget_id(budget_kib):
    return "smem_device" if budget_kib is None else f"smem{budget_kib}"


def numpy_normal(seed, shape, scale=1.0):
    """float32 normal draws from numpy: on the GPU each new shape of a jax.random draw
    would be one more XLA compile."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def attention_inputs(seed, q_len, kv_len, q_heads, kv_heads, head_dim, dtype):
    """q, k, v and an output cotangent in `dtype`, drawn with `numpy_normal` from
    consecutive seeds."""
    shapes = [(1, q_len, q_heads, head_dim), (1, kv_len, kv_heads, head_dim),
              (1, kv_len, kv_heads, head_dim), (1, q_len, q_heads, head_dim)]
    return tuple(jnp.asarray(numpy_normal(seed + i, shape), dtype)
                 for i, shape in enumerate(shapes))


# Compiled programs by the hash of their lowered text: a cell whose budget resolves to
# the same kernels as an earlier cell's (the same program, byte for byte) runs that
# executable instead of compiling it again. Bounded: cells that share programs are
# neighbours (the budgets of one dtype / head dim / layout / op).
_PROGRAMS: dict[str, tuple] = {}
_PROGRAMS_KEPT = 64


def compile_and_time(function, args, cell):
    """Lowers a fresh `jax.jit(function)` for `args`, compiles it (or reuses an identical
    program compiled earlier in this process), and runs it twice. Records in `cell`:
    compile_s, the first call's seconds (lowering, compiling, running) less the second
    call's (with `same_program_as`, the test id whose executable it reused, the lowering
    only), and run_s, the second call's. Returns (the first call's result, the compiled
    executable)."""
    start = time.perf_counter()
    lowered = jax.jit(function).lower(*args)
    key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    if key in _PROGRAMS:
        compiled, first_cell = _PROGRAMS[key]
        cell["same_program_as"] = first_cell
    else:
        compiled = lowered.compile()
        _PROGRAMS[key] = (compiled, cell["test"])
        while len(_PROGRAMS) > _PROGRAMS_KEPT:
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
    result = jax.block_until_ready(compiled(*args))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    second = time.perf_counter() - start
    cell.update(compile_s=round(max(first - second, 0.0), 3), run_s=round(second, 5))
    return result, compiled


# ----- plain JAX attention: the accuracy baseline of 16-bit results ----------------------

def plain_attention(q, k, v, mask_mod=None, score_mod=None, bias=None):
    """What plain XLA attention does in q's dtype, as `tests.conftest.dense_low_precision`
    (scores, softmax and p.v rounded to the input dtype; mods see float32 scores), but
    with the mods vmapped over index vectors rather than fed [B, H, Sq, Skv] index
    constants, so that it also serves S = 4096 (no O(S^2) constants in the program).
    `bias` (float32, [H, Sq, Skv]): added to the float32 scores as an additive score_mod
    `score + bias[h, q_idx, kv_idx]` would be."""
    dtype = q.dtype
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    k = jnp.repeat(k, q_heads // kv_heads, axis=2)
    v = jnp.repeat(v, q_heads // kv_heads, axis=2)
    scale = jnp.asarray(1.0 / np.sqrt(head_dim), dtype)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=dtype) * scale
    indices = (jnp.arange(batch, dtype=jnp.int32), jnp.arange(q_heads, dtype=jnp.int32),
               jnp.arange(q_len, dtype=jnp.int32), jnp.arange(kv_len, dtype=jnp.int32))
    if score_mod is not None:
        over_all = score_mod
        for axis in (4, 3, 2, 1):  # kv_idx, q_idx, h, b
            axes = [0] + [None] * 4  # the score always, and one index
            axes[axis] = 0
            over_all = jax.vmap(over_all, in_axes=tuple(axes))
        scores = over_all(scores.astype(jnp.float32), *indices).astype(dtype)
    if bias is not None:
        scores = (scores.astype(jnp.float32) + bias).astype(dtype)
    if mask_mod is not None:
        over_all = mask_mod
        for axis in (3, 2, 1, 0):
            axes = [None] * 4
            axes[axis] = 0
            over_all = jax.vmap(over_all, in_axes=tuple(axes))
        scores = jnp.where(over_all(*indices), scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(jnp.isnan(weights), 0, weights).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v, preferred_element_type=dtype)


# ----- accuracy rules -----------------------------------------------------------------

def as_float64(x):
    """On the host (numpy casts bfloat16 through ml_dtypes): no device program per shape."""
    return np.asarray(x).astype(np.float64)


def check_output(out, expected, baseline, name="out"):
    """float32: within FLOAT32_OUTPUT_TOLERANCE of the float64 value, relative to its
    scale. 16-bit (`baseline` = plain JAX's output in that dtype): RMSE against float64
    no worse than the baseline's (the rule of `tests.conftest.assert_close_to_golden`).
    Returns a failure message, or None."""
    out = as_float64(out)
    if not np.isfinite(out).all():
        return f"{name} has NaN or inf"
    if baseline is None:
        bound = FLOAT32_OUTPUT_TOLERANCE * max(np.abs(expected).max(), 1e-30)
        error = np.abs(out - expected).max()
        if error > bound:
            return f"{name}: max error {error:.3g} > {bound:.3g} (1e-4 x max|ref|)"
        return None
    ours, theirs = rmse(out, expected), rmse(baseline, expected)
    if ours > theirs:
        return f"{name}: RMSE {ours:.3g} worse than plain JAX's {theirs:.3g}"
    return None


def check_gradient(grad, expected, baseline, name):
    """dq, dk, dv: the rule of `tests.test_backward._assert_gradient_close` (float32 within
    1e-4 of the float64 value, relative to its scale; 16-bit RMSE no worse than plain
    JAX's in that dtype). Returns a failure message, or None."""
    try:
        _assert_gradient_close(grad, expected, baseline, name=name)
    except AssertionError as error:
        return _short(str(error), 600)
    return None


@jax.jit
def _error_statistics(grad, expected, baseline):
    """(max|expected|, max|grad - expected|, RMSE of grad, RMSE of baseline) in float64,
    on the device: a [8, 4096, 4096] pair-bias gradient is 134M entries."""
    grad, expected = grad.astype(jnp.float64), expected.astype(jnp.float64)
    baseline = baseline.astype(jnp.float64)
    return (jnp.max(jnp.abs(expected)), jnp.max(jnp.abs(grad - expected)),
            jnp.sqrt(jnp.mean((grad - expected) ** 2)),
            jnp.sqrt(jnp.mean((baseline - expected) ** 2)))


def check_captured_gradient(grad, expected, baseline, name):
    """Gradient of an array a mod captured (slopes, tables, pair bias): float32 within
    1e-3 of the float64 value relative to its largest entry; 16-bit RMSE no worse than
    twice plain JAX's in that dtype (`baseline`). Returns a failure message, or None."""
    if tuple(grad.shape) != tuple(expected.shape):
        return f"{name}: shape {tuple(grad.shape)}, expected {tuple(expected.shape)}"
    reference = expected if baseline is None else baseline
    if grad.size > 1 << 20:  # on the device
        with jax.enable_x64(True):
            grad, expected = jnp.asarray(grad), jnp.asarray(expected)
            finite = bool(jnp.isfinite(grad).all())
            statistics = _error_statistics(grad, expected, jnp.asarray(reference))
    else:
        grad, expected, reference = (as_float64(x) for x in (grad, expected, reference))
        finite = bool(np.isfinite(grad).all())
        statistics = (np.abs(expected).max(), np.abs(grad - expected).max(),
                      rmse(grad, expected), rmse(reference, expected))
    if not finite:
        return f"{name} has NaN or inf"
    scale, max_error, ours, theirs = (float(x) for x in statistics)
    if baseline is None:
        if max_error > FLOAT32_CAPTURED_TOLERANCE * scale:
            return (f"{name}: max error {max_error:.3g} > 1e-3 x max|ref| "
                    f"({FLOAT32_CAPTURED_TOLERANCE * scale:.3g})")
        return None
    floor = FLOAT32_GRADIENT_TOLERANCE * max(scale, 1.0) * 1e-2
    if ours > max(CAPTURED_BASELINE_FACTOR * theirs, floor):
        return f"{name}: RMSE {ours:.3g} worse than twice plain JAX's {theirs:.3g}"
    return None


# ----- per-cell records ------------------------------------------------------------------

def _short(text, limit=3000):
    text = str(text)
    if len(text) <= limit:
        return text
    return text[:limit // 2] + "\n...\n" + text[-limit // 2:]


class _Recorder:
    def __init__(self):
        self.records = []
        path = os.environ.get(RESULTS_ENV)
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        self.path = f"{path}.{worker}" if path and worker else path
        self.header = None

    def _header(self):
        if self.header is None:
            import jaxlib
            device = jax.devices()[0]
            self.header = {
                "device": getattr(device, "device_kind", str(device)),
                "platform": device.platform,
                "jax": jax.__version__,
                "jaxlib": jaxlib.__version__,
                "backend": BACKEND,
                "small": SMALL,
                "budget_env_at_start": os.environ.get(BUDGET_ENV),
                "shard": os.environ.get(SHARD_ENV),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
            }
        return self.header

    def add(self, record):
        self.records.append(record)
        if not self.path:
            return
        payload = dict(self._header(), cells=self.records)
        temporary = f"{self.path}.tmp"
        with open(temporary, "w") as file:
            json.dump(payload, file, indent=1)
        os.replace(temporary, self.path)


_RECORDER = _Recorder()


@pytest.fixture
def cell(request):
    """A dict the test fills with its cell's parameters and timings; the report hook adds
    passed / error and records it."""
    record = {"test": request.node.nodeid}
    request.node.gpu_cell_record = record
    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    record = getattr(item, "gpu_cell_record", None)
    if record is None or record.get("recorded"):
        return
    if call.when == "call" or (call.when == "setup" and report.failed):
        record["recorded"] = True
        record["passed"] = bool(report.passed)
        record["test_s"] = round(report.duration, 3)  # the whole test, references included
        if report.failed and call.excinfo is not None:
            record["error"] = _short(f"{call.excinfo.typename}: {call.excinfo.value}")
        _RECORDER.add({key: value for key, value in record.items() if key != "recorded"})


def merge_results(shard_directory, output_path):
    """Merges the shards' record files (`shard*.json` in `shard_directory`) into one."""
    import glob
    merged = None
    for path in sorted(glob.glob(os.path.join(shard_directory, "shard*.json"))):
        with open(path) as file:
            payload = json.load(file)
        if merged is None:
            merged = dict(payload, cells=[], shards=[])
            merged.pop("shard", None)
        merged["shards"].append(payload.get("shard"))
        merged["cells"].extend(payload["cells"])
    if merged is None:
        return None
    merged["passed"] = sum(cell["passed"] for cell in merged["cells"])
    merged["failed"] = len(merged["cells"]) - merged["passed"]
    with open(output_path, "w") as file:
        json.dump(merged, file, indent=1)
    return merged
