"""Issue 21 probe: Evoformer gated self-attention (MSA row attention with pair bias) on
one GPU, where the time goes, and the backward's batch loop against its atomics.

    PYTHONPATH=$PWD python3 benchmarks/probes/evoformer_gpu.py $OUT

Cases B1 R256 S256 H8 D32 and D64, bfloat16, timed in paired rounds in one process
(`pallas_flex.bench.timing.time_paired`, as `pallas-flex bench variants` does). Columns
(ms a call):

forward
  xla_plain          AlphaFold's plain formulation under XLA (jax_suites.plain_gated)
  ours               pf.variants.gated_self_attention
  ours_chained4 / xla_chained4   four dependent forwards in one jitted call, per step
                     (no host dispatch in the figure)
  kernel_only        pf.attention on the folded [B*R, S, H, D] with the pair-bias
                     score_mod (no gate, no reshapes)
  kernel_no_bias     the same call without the score_mod (what the per-element pair-bias
                     read costs: kernel_only - kernel_no_bias)
  kernel_128x64      kernel_only with the D128 tiles (block_q 128, block_kv 64)
forward+backward (gradients of q, k, v, gate and the pair bias; cotangent d_out)
  xla_plain
  ours_atomic        backward_batch_sum "atomic": every row's dQ programs scatter-add
                     their dS tiles into the shared [H, S, S] pair-bias gradient (as before)
  ours_loop          backward_batch_sum "loop" (what "auto" picks here): the batch-loop
                     launch sums dS over the rows in registers
  ours_const_bias    pair bias closed over as a constant (no pair-bias gradient: what the
                     attention backward costs without it)
  xla_const_bias     XLA with the pair bias held constant
  loop_kernel_only   the batch-loop launch alone (pallas_flex.kernels.backward
                     ._batch_loop_gradients on the folded operands)

Gradients of both of ours against plain JAX in float32 (R 32, otherwise the same
shapes; matmuls at precision "highest"): the largest |ours - plain| / max |plain| per
gradient. Writes $OUT/evoformer.json and prints a summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench import cases
from pallas_flex.bench.jax_suites import _chained, _grad_step, plain_gated
from pallas_flex.bench.timing import error_entry, time_paired

BATCH, ROWS, RESIDUES, HEADS = 1, 256, 256, 8
HEAD_DIMS = (32, 64)
ROUNDS, ITERS = 5, 10
CHECK_ROWS = 32
if os.environ.get("EVOFORMER_PROBE_QUICK"):  # a CPU smoke test of the probe itself
    ROWS, RESIDUES, HEADS, ROUNDS, ITERS, CHECK_ROWS = 4, 32, 2, 1, 1, 4
BUDGET_S = 165.0  # extras are skipped past this (the probe must finish in 3 minutes)
START = time.perf_counter()


def _normal(seed, shape, dtype):
    return jnp.asarray(cases.normal(shape, seed), dtype)


def _inputs(dim, dtype, rows=ROWS):
    msa = (BATCH, rows, RESIDUES, HEADS, dim)
    q, k, v, gate, d_out = (_normal(i, msa, dtype) for i in range(5))
    pair_bias = _normal(5, (BATCH, HEADS, RESIDUES, RESIDUES), dtype)
    return q, k, v, gate, pair_bias, d_out


def _ours(batch_sum):
    def attend(q, k, v, gate, pair_bias):
        return pf.variants.gated_self_attention(
            q, k, v, gate, pair_bias=pair_bias,
            kernel_options={"backward_batch_sum": batch_sum})
    return attend


def _folded_kernel(rows, kernel_options=None, with_bias=True):
    def attend(q, k, v, gate, pair_bias):
        del gate
        fold = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731

        def bias(score, b, h, q_idx, kv_idx):
            return score + pair_bias[b // rows, h, q_idx, kv_idx]
        return pf.attention(fold(q), fold(k), fold(v), score_mod=bias if with_bias else None,
                            kernel_options=kernel_options)
    return attend


def _const_bias(fn, pair_bias):
    """fn with the pair bias closed over (a constant of the jitted step)."""
    return lambda q, k, v, gate, _unused: fn(q, k, v, gate, pair_bias)


def _loop_kernel_only(dim):
    """The batch-loop launch alone, on the folded operands of the D `dim` case."""
    from pallas_flex.api import _prepare
    from pallas_flex.kernels import backward as bw
    q, k, v, gate, pair_bias, d_out = _inputs(dim, jnp.bfloat16)
    fold = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
    fq, fk, fv, fd = fold(q), fold(k), fold(v), fold(d_out)

    def bias(score, b, h, q_idx, kv_idx):
        return score + pair_bias[b // ROWS, h, q_idx, kv_idx]
    block_mask, program, (backend, scale, options) = _prepare(
        fq, fk, fv, bias, None, None, None, {"backward_batch_sum": "loop"})
    out, lse = pf.attention(fq, fk, fv, score_mod=bias, return_lse=True)
    out = out.astype(jnp.float32)

    def run(fq, fk, fv, out, lse, fd):
        launch = bw.prepare_operands(fq, fk, fv, out, lse, fd, None, block_mask, program,
                                     scale)
        plans = tuple(p for p in bw._site_plans(program, None, batch=fq.shape[0],
                                                  batch_sum="loop")
                      if p.mode == "batch_loop")
        return bw._batch_loop_gradients(launch, plans, options=options,
                                        interpret=backend != "pallas")[0]
    return jax.jit(run), (fq, fk, fv, out, lse, fd)


def _time(calls):
    """time_paired over the calls that compile and run; failures become entries."""
    entries, ok = {}, {}
    for name, (fn, args) in calls.items():
        if time.perf_counter() - START > BUDGET_S and name not in ("xla_plain", "ours",
                                                                    "ours_atomic",
                                                                    "ours_loop"):
            entries[name] = {"status": "skipped", "reason": "probe time budget"}
            continue
        try:
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            entries[name] = {"compile_s": round(time.perf_counter() - start, 2)}
            ok[name] = (fn, args)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            entries[name] = error_entry(error)
    for name, entry in time_paired(ok, rounds=ROUNDS, iters=ITERS).items():
        entries[name].update(entry)
    return entries


def _gradient_check(dim):
    """Largest |ours - plain| / max |plain| per output/gradient, float32, R 32."""
    rows = CHECK_ROWS
    q, k, v, gate, pair_bias, d_out = _inputs(dim, jnp.float32, rows=rows)
    shape = cases.Shape("check", BATCH, HEADS, HEADS, RESIDUES, dim)
    args = (q, k, v, gate, pair_bias)
    with jax.default_matmul_precision("highest"):
        want = _grad_step(plain_gated(shape), "fwd_bwd", tuple(range(5)))(*args, d_out)
        want = jax.block_until_ready(want)
    result = {}
    for batch_sum in ("atomic", "loop"):
        got = _grad_step(_ours(batch_sum), "fwd_bwd", tuple(range(5)))(*args, d_out)
        result[batch_sum] = {
            name: float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-12))
            for name, a, b in zip(["out", "dq", "dk", "dv", "dgate", "dpair_bias"], got, want)}
    return result


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    device = jax.devices()[0]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    report = {"device": device.device_kind, "jax": jax.__version__, "git_commit": commit,
              "shape": dict(batch=BATCH, rows=ROWS, residues=RESIDUES, heads=HEADS),
              "dtype": "bfloat16", "rounds": ROUNDS, "iters": ITERS, "cases": {}}
    for dim in HEAD_DIMS:
        q, k, v, gate, pair_bias, d_out = _inputs(dim, jnp.bfloat16)
        shape = cases.Shape("evoformer", BATCH, HEADS, HEADS, RESIDUES, dim)
        folded = cases.Shape("folded", BATCH * ROWS, HEADS, HEADS, RESIDUES, dim)
        plain = plain_gated(shape)
        args = (q, k, v, gate, pair_bias)
        case = {"flops_fwd": cases.flops(cases.VARIANTS[0], folded, "fwd"),
                "flops_fwd_bwd": cases.flops(cases.VARIANTS[0], folded, "fwd_bwd")}
        try:
            fq = q.reshape((-1,) + q.shape[2:])
            case["dispatch"] = pf.explain(
                fq, fq, fq, score_mod=lambda s, b, h, i, j: s + pair_bias[b // ROWS, h, i, j])
        except Exception as error:  # noqa: BLE001
            case["dispatch"] = repr(error)
        print(f"[D{dim}] forward", flush=True)
        fwd = lambda fn: (_grad_step(fn, "fwd", ()), args + (d_out,))  # noqa: E731
        case["fwd"] = _time({
            "xla_plain": fwd(plain),
            "ours": fwd(_ours("auto")),
            "ours_chained4": (jax.jit(_chained(_ours("auto"), 4)), args),
            "xla_chained4": (jax.jit(_chained(plain, 4)), args),
            "kernel_only": fwd(_folded_kernel(ROWS)),
            "kernel_no_bias": fwd(_folded_kernel(ROWS, with_bias=False)),
            "kernel_128x64": fwd(_folded_kernel(ROWS, {"block_q": 128, "block_kv": 64})),
        })
        for name in ("ours_chained4", "xla_chained4"):
            entry = case["fwd"][name]
            if "ms" in entry:
                entry["ms"] /= 4
                entry["rounds_ms"] = [t / 4 for t in entry["rounds_ms"]]
        print(f"[D{dim}] forward+backward", flush=True)
        grad = lambda fn, argnums=tuple(range(5)): (  # noqa: E731
            _grad_step(fn, "fwd_bwd", argnums), args + (d_out,))
        calls = {
            "xla_plain": grad(plain),
            "ours_atomic": grad(_ours("atomic")),
            "ours_loop": grad(_ours("loop")),
            "ours_const_bias": grad(_const_bias(_ours("auto"), pair_bias), (0, 1, 2, 3)),
            "xla_const_bias": grad(_const_bias(plain, pair_bias), (0, 1, 2, 3)),
        }
        try:
            calls["loop_kernel_only"] = _loop_kernel_only(dim)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            case["loop_kernel_only_error"] = repr(error)
        case["fwd_bwd"] = _time(calls)
        try:
            loop, atomic = (jax.block_until_ready(calls[name][0](*calls[name][1]))
                            for name in ("ours_loop", "ours_atomic"))
            case["loop_vs_atomic_max_rel"] = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                      / max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-6))
                for a, b in zip(loop, atomic))
        except Exception as error:  # noqa: BLE001
            case["loop_vs_atomic_max_rel"] = repr(error)
        if time.perf_counter() - START < BUDGET_S:
            print(f"[D{dim}] float32 gradient check", flush=True)
            try:
                case["float32_check_r32"] = _gradient_check(dim)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                case["float32_check_r32"] = repr(error)
        report["cases"][f"D{dim}"] = case
        with open(os.path.join(out_dir, "evoformer.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)

    report["elapsed_s"] = time.perf_counter() - START
    with open(os.path.join(out_dir, "evoformer.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\n{report['device']}, jax {report['jax']}, commit {commit[:10]}, "
          f"B{BATCH} R{ROWS} S{RESIDUES} H{HEADS} bf16, {report['elapsed_s']:.0f} s")
    for label, case in report["cases"].items():
        print(f"\n== {label}  dispatch: {case['dispatch']!r}")
        for mode in ("fwd", "fwd_bwd"):
            flops = case[f"flops_{mode}"]
            base = case[mode].get("xla_plain", {}).get("ms")
            print(f"  {mode}:")
            for name, entry in case[mode].items():
                if "ms" not in entry:
                    print(f"    {name:18s} {entry.get('status')}: {entry.get('reason', '')[:120]}")
                    continue
                ms = entry["ms"]
                speedup = f"  xla/this {base / ms:5.2f}x" if base else ""
                print(f"    {name:18s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s{speedup}")
        print(f"  loop vs atomic (bf16, max rel): {case.get('loop_vs_atomic_max_rel')}")
        check = case.get("float32_check_r32")
        if isinstance(check, dict):
            for batch_sum, errors in check.items():
                print(f"  float32 vs plain JAX ({batch_sum}): " + ", ".join(
                    f"{k} {v:.1e}" for k, v in errors.items()))
        else:
            print(f"  float32 check: {check}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
