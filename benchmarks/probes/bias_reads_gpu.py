"""Probe: score_mods reading a captured array at exactly q_idx / kv_idx, which the Triton
kernels now load as a block a tile (`tile_mods.block_reads`) instead of a per-element
gather, and whose gradient the backward adds as a block.

    PYTHONPATH=$PWD python3 benchmarks/probes/bias_reads_gpu.py $OUT

Paired rounds in one process (`pallas_flex.bench.timing.time_paired`), bfloat16, ms a
call. Columns:

evoformer (B1 R256 S256 H8, D32 and D64; pair bias [B, H, S, S] read at b // R):
  fwd: xla_plain (AlphaFold's formulation under XLA, jax_suites.plain_gated), ours
    (pf.variants.gated_self_attention), kernel_bias (pf.attention on the folded rows with
    the pair-bias score_mod: the block path), kernel_gather (the same bias read at
    `minimum(kv_idx, S - 1)`: a computed index, so the per-element gather of before, for
    comparison in the same process), kernel_no_bias (no score_mod).
  fwd_bwd (gradients of q, k, v, gate and the pair bias): xla_plain, ours.
bias_lookup (B4 H16 S4096 D128, causal, bias [1, H, S, S] bfloat16 read at [0, h, q_idx,
  kv_idx]: pf.scores.bias_lookup): fwd: bias (the block path), bias_gather (read at
  `minimum(kv_idx, S - 1)`: the gather), causal (no score_mod; the dispatcher's kernel:
  Mosaic GPU on the H100), causal_triton (no score_mod, Triton forward). fwd_bwd
  (gradients of q, k, v and the bias; the bias's sum over the 4 batch rows is the
  batch-loop launch): bias, bias_gather, causal (q, k, v), causal_triton.
vectors (the same shape, Triton forward, causal): a key bias [B, S] read at [b, kv_idx]
  (key_bias: a vector load a tile) against the same read at `minimum(kv_idx, S - 1)`
  (key_bias_gather: a [1, block_kv] gather, how such reads ran before), and a document
  mask (ids [B, S] at q_idx and kv_idx, 16 documents a row) likewise.

checks: the evoformer's output and gradients (float32 inputs, R 32) and the bias_lookup's
output (bfloat16 inputs; the first batch row, all heads) against XLA in float32 at
precision "highest": max |ours - xla| / max |xla|.

Writes $OUT/bias_reads.json and prints a summary. BIAS_PROBE_SMOKE=1 shrinks every shape
(a CPU dry run of the script on the interpret backend).
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
from pallas_flex import masks
from pallas_flex.bench import cases
from pallas_flex.bench.jax_suites import _grad_step, plain_gated
from pallas_flex.bench.timing import error_entry, time_paired
from pallas_flex.kernels.reference import reference_attention

SMOKE = bool(os.environ.get("BIAS_PROBE_SMOKE"))
BACKEND = "interpret" if SMOKE else None
ROWS, RESIDUES, HEADS, HEAD_DIMS, CHECK_ROWS = 256, 256, 8, (32, 64), 32
LOOKUP = dict(batch=4, heads=16, length=4096, dim=128)
ROUNDS, ITERS = 5, 10
if SMOKE:
    ROWS, RESIDUES, HEADS, HEAD_DIMS, CHECK_ROWS = 4, 64, 2, (32,), 4
    LOOKUP = dict(batch=1, heads=2, length=256, dim=64)
    ROUNDS, ITERS = 1, 1
BUDGET_S = 160.0  # extras are skipped past this (the probe must finish in 3 minutes)
START = time.perf_counter()


def _normal(seed, shape, dtype):
    return jnp.asarray(cases.normal(shape, seed), dtype)


def _gated_inputs(dim, dtype, rows=ROWS):
    msa = (1, rows, RESIDUES, HEADS, dim)
    q, k, v, gate, d_out = (_normal(i, msa, dtype) for i in range(5))
    return q, k, v, gate, _normal(5, (1, HEADS, RESIDUES, RESIDUES), dtype), d_out


def _ours(q, k, v, gate, pair_bias):
    return pf.variants.gated_self_attention(q, k, v, gate, pair_bias=pair_bias,
                                            backend=BACKEND)


def _folded(rows, read):
    """pf.attention on the rows folded into the batch, the pair bias read as `read` says:
    "block" (at exactly q_idx, kv_idx), "gather" (at a computed kv index), None."""
    def attend(q, k, v, gate, pair_bias):
        del gate
        fold = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
        last = pair_bias.shape[-1] - 1

        def bias(score, b, h, q_idx, kv_idx):
            kv = kv_idx if read == "block" else jnp.minimum(kv_idx, last)
            return score + pair_bias[b // rows, h, q_idx, kv]
        return pf.attention(fold(q), fold(k), fold(v), score_mod=bias if read else None,
                            backend=BACKEND)
    return attend


def _time(calls, required=()):
    """time_paired over the calls that compile and run; failures become entries, and
    past the budget only `required` calls run."""
    entries, ok = {}, {}
    for name, (fn, args) in calls.items():
        if time.perf_counter() - START > BUDGET_S and name not in required:
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


def _max_rel(got, want):
    got, want = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (got, want))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def _evoformer_check(dim):
    """Output and gradients of ours against XLA's plain formulation, float32, R 32."""
    q, k, v, gate, pair_bias, d_out = _gated_inputs(dim, jnp.float32, rows=CHECK_ROWS)
    args = (q, k, v, gate, pair_bias)
    shape = cases.Shape("check", 1, HEADS, HEADS, RESIDUES, dim)
    with jax.default_matmul_precision("highest"):
        want = jax.block_until_ready(
            _grad_step(plain_gated(shape), "fwd_bwd", tuple(range(5)))(*args, d_out))
    got = _grad_step(_ours, "fwd_bwd", tuple(range(5)))(*args, d_out)
    return {name: _max_rel(a, b) for name, a, b in
            zip(["out", "dq", "dk", "dv", "dgate", "dpair_bias"], got, want)}


def evoformer(report):
    for dim in HEAD_DIMS:
        q, k, v, gate, pair_bias, d_out = _gated_inputs(dim, jnp.bfloat16)
        args = (q, k, v, gate, pair_bias, d_out)
        plain = plain_gated(cases.Shape("evoformer", 1, HEADS, HEADS, RESIDUES, dim))
        fwd = lambda fn: (_grad_step(fn, "fwd", ()), args)  # noqa: E731
        case = {}
        print(f"[evoformer D{dim}] forward", flush=True)
        case["fwd"] = _time({
            "xla_plain": fwd(plain), "ours": fwd(_ours),
            "kernel_bias": fwd(_folded(ROWS, "block")),
            "kernel_gather": fwd(_folded(ROWS, "gather")),
            "kernel_no_bias": fwd(_folded(ROWS, None)),
        }, required=("xla_plain", "ours"))
        print(f"[evoformer D{dim}] forward+backward", flush=True)
        grad = lambda fn: (_grad_step(fn, "fwd_bwd", tuple(range(5))), args)  # noqa: E731
        case["fwd_bwd"] = _time({"xla_plain": grad(plain), "ours": grad(_ours)},
                                required=("xla_plain", "ours"))
        try:
            case["check_float32_r32"] = _evoformer_check(dim)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            case["check_float32_r32"] = repr(error)
        report["evoformer"][f"D{dim}"] = case
        _save(report)


def bias_lookup(report):
    batch, heads, length, dim = (LOOKUP[key] for key in ("batch", "heads", "length", "dim"))
    q, k, v = (_normal(i, (batch, length, heads, dim), jnp.bfloat16) for i in range(3))
    bias = _normal(3, (1, heads, length, length), jnp.bfloat16)

    def attend(read, kernel_options=None):
        score_mod = None
        if read == "block":
            score_mod = pf.scores.bias_lookup(bias)
        elif read == "gather":
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[0, h, q_idx, jnp.minimum(kv_idx, length - 1)]
        return jax.jit(lambda q, k, v: pf.attention(
            q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod, backend=BACKEND,
            kernel_options=kernel_options))

    print("[bias_lookup] forward", flush=True)
    case = {"shape": LOOKUP, "bias_dtype": "bfloat16"}
    calls = {"bias": (attend("block"), (q, k, v)), "bias_gather": (attend("gather"), (q, k, v)),
             "causal": (attend(None), (q, k, v)),
             "causal_triton": (attend(None, {"forward_kernel": "triton"}), (q, k, v))}
    case["fwd"] = _time(calls, required=("bias", "causal"))
    _save(report)
    print("[bias_lookup] forward+backward", flush=True)
    d_out = _normal(4, (batch, length, heads, dim), jnp.bfloat16)

    def gradients(read, kernel_options=None):
        def step(q, k, v, bias_, d_out):
            def attend(q, k, v, bias_):
                score_mod = None
                if read == "block":
                    score_mod = pf.scores.bias_lookup(bias_)
                elif read == "gather":
                    def score_mod(score, b, h, q_idx, kv_idx):
                        return score + bias_[0, h, q_idx, jnp.minimum(kv_idx, length - 1)]
                return pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                                    backend=BACKEND, kernel_options=kernel_options)
            if read is None:
                out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, bias_), q, k, v)
            else:
                out, pullback = jax.vjp(attend, q, k, v, bias_)
            return (out, *pullback(d_out))
        return jax.jit(step), (q, k, v, bias, d_out)

    case["fwd_bwd"] = _time({"bias": gradients("block"), "bias_gather": gradients("gather"),
                             "causal": gradients(None),
                             "causal_triton": gradients(None, {"forward_kernel": "triton",
                                                               "backward_kernel": "triton"})})
    try:  # the first batch row against XLA in float32
        got = calls["bias"][0](q, k, v)[:1]
        with jax.default_matmul_precision("highest"):
            want, _ = jax.jit(lambda q, k, v: reference_attention(
                q, k, v, mask_mod=masks.causal_mask,
                score_mod=pf.scores.bias_lookup(bias.astype(jnp.float32))))(
                *(x[:1].astype(jnp.float32) for x in (q, k, v)))
        case["check_out_vs_xla_float32"] = _max_rel(got, want)
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        case["check_out_vs_xla_float32"] = repr(error)
    report["bias_lookup"] = case
    _save(report)


def vectors(report):
    """Reads at q_idx or kv_idx alone: vector loads against the [n, 1] / [1, n] gathers."""
    batch, heads, length, dim = (LOOKUP[key] for key in ("batch", "heads", "length", "dim"))
    q, k, v = (_normal(i, (batch, length, heads, dim), jnp.bfloat16) for i in range(3))
    key_bias = _normal(5, (batch, length), jnp.bfloat16)
    ids = jnp.asarray(np.repeat(np.arange(16), -(-length // 16))[:length][None].repeat(
        batch, 0), jnp.int32)
    last = length - 1
    triton = {"forward_kernel": "triton"}

    def attend(score_mod=None, mask_mod=masks.causal_mask):
        return jax.jit(lambda q, k, v: pf.attention(q, k, v, mask_mod=mask_mod,
                                                    score_mod=score_mod, backend=BACKEND,
                                                    kernel_options=triton)), (q, k, v)

    def document(gathered):
        def mask_mod(b, h, q_idx, kv_idx):
            if gathered:
                return ids[b, jnp.minimum(q_idx, last)] == ids[b, jnp.minimum(kv_idx, last)]
            return ids[b, q_idx] == ids[b, kv_idx]
        return mask_mod

    print("[vectors] forward", flush=True)
    report["vectors"] = {"fwd": _time({
        "key_bias": attend(lambda s, b, h, q_idx, kv_idx: s + key_bias[b, kv_idx]),
        "key_bias_gather": attend(
            lambda s, b, h, q_idx, kv_idx: s + key_bias[b, jnp.minimum(kv_idx, last)]),
        "document": attend(mask_mod=document(False)),
        "document_gather": attend(mask_mod=document(True)),
    })}
    _save(report)


def _save(report):
    report["elapsed_s"] = round(time.perf_counter() - START, 1)
    with open(os.path.join(OUT_DIR, "bias_reads.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def _summary(report):
    print(f"\n{report['device']}, jax {report['jax']}, commit {report['git_commit'][:10]}, "
          f"{report['elapsed_s']:.0f} s")
    sections = [(f"evoformer {label}", case) for label, case in report["evoformer"].items()]
    shape = "B{batch} H{heads} S{length} D{dim}".format(**LOOKUP)
    if "bias_lookup" in report:
        sections.append((f"bias_lookup {shape} causal", report["bias_lookup"]))
    if "vectors" in report:
        sections.append((f"vectors {shape} (Triton forward)", report["vectors"]))
    for label, case in sections:
        for mode in ("fwd", "fwd_bwd"):
            if mode not in case:
                continue
            print(f"== {label} {mode}")
            for name, entry in case[mode].items():
                if "ms" in entry:
                    print(f"   {name:16s} {entry['ms']:8.3f} ms")
                else:
                    print(f"   {name:16s} {entry.get('status')}: {entry.get('reason', '')[:100]}")
        for key in ("check_float32_r32", "check_out_vs_xla_float32"):
            if key in case:
                print(f"   {key}: {case[key]}")


if __name__ == "__main__":
    OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    os.makedirs(OUT_DIR, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    REPORT = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "git_commit": commit, "rounds": ROUNDS, "iters": ITERS, "smoke": SMOKE,
              "evoformer": {}}
    for part in (evoformer, bias_lookup, vectors):
        try:
            part(REPORT)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            REPORT[part.__name__ + "_error"] = repr(error)
    _save(REPORT)
    _summary(REPORT)
