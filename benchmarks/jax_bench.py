"""JAX side of the benchmark: pallas_flex kernels, cuDNN, and (optionally) the XLA path.

Run on its own (`python -m benchmarks.jax_bench --json-out rows.json`) or through
`benchmarks.run`, which starts it in a subprocess with `XLA_PYTHON_CLIENT_PREALLOCATE=false`
so PyTorch (in another process) still finds GPU memory.

Per shape and variant:
  * ours   — `pallas_flex.flex_attention` with `backend=None` (the best for the device),
             a BlockMask built once by `pallas_flex.create_block_mask`, all under one
             `jax.jit` so a call is one dispatch;
  * cudnn  — `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only, for the
             variants it can express (no mask, causal, causal sliding window);
  * jax_mha — with `--jax-mha`: JAX's Pallas Triton FlashAttention
             (`jax.experimental.pallas.ops.gpu.attention.mha`), GPU only, for no mask,
             causal and document (`segment_ids` + causal), no GQA;
  * xla    — `flex_attention(backend="xla")` with `--xla` (fwd only).
`--mode fwd` times the output; `--mode fwd_bwd` times one jitted step returning (out, dq,
dk, dv), the `jax.vjp` of each with the same fixed bf16 cotangent d_out
(`suites.make_cotangent`), i.e. the gradients of `sum(out * d_out)`.
Timing (GPU-NOTES): compile and warm up, then time `--iters` calls in a Python loop with one
`block_until_ready` at the end; repeat `--repeats` times and keep the median (fewer where
the warm-up says that would exceed `--time-budget-s`: only slow CPU paths).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import math
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from benchmarks import suites
from benchmarks.run import error_text


# -- the variants as jnp mods (scalar semantics, as a user would write them) --------------

def jax_mods(variant: suites.Variant, shape: suites.Shape):
    """(mask_mod or None, score_mod or None) of `variant`, closing over jnp arrays that
    are only indexed with scalar indices."""
    tables = {name: jnp.asarray(array) for name, array in
              suites.variant_tables(variant, shape).items()}

    if variant.mask == suites.NO_MASK:
        mask_mod = None
    elif variant.mask == suites.CAUSAL:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    elif variant.mask == suites.SLIDING_WINDOW:
        window = variant.window

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    elif variant.mask == suites.PREFIX_LM:
        prefix = variant.prefix

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)
    elif variant.mask == suites.DOCUMENT:
        doc_ids = tables["document_ids"]

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)
    else:
        raise ValueError(f"unknown mask kind {variant.mask!r}")

    if variant.score == suites.NO_SCORE:
        score_mod = None
    elif variant.score == suites.ALIBI:
        slopes = tables["slopes"]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx).astype(jnp.float32)
    elif variant.score == suites.SOFTCAP:
        cap = variant.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * jnp.tanh(score / cap)
    else:
        raise ValueError(f"unknown score kind {variant.score!r}")

    for mod in (mask_mod, score_mod):
        if mod is not None:
            mod.__name__ = variant.name
    return mask_mod, score_mod


# -- steps: what one timed call does, per mode -------------------------------------------
#
# Every step has the signature `step(q, k, v, d_out, *extra)`: `d_out` is None in "fwd"
# (the step returns out) and the fixed bf16 cotangent in "fwd_bwd" (the step returns
# (out, dq, dk, dv), the vector-Jacobian product of out with d_out, i.e. the gradients of
# `sum(out * d_out)`). `extra` is (block_mask,) for ours, () for cuDNN, (segment_ids,) for
# JAX's Triton mha.

def _ours_attend(score_mod, backend):
    def attend(q, k, v, block_mask):
        return pf.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                 backend=backend)
    return attend


def _cudnn_attend(variant):
    kwargs = {"is_causal": variant.is_causal}
    if variant.mask == suites.SLIDING_WINDOW:
        # (left, right) = (window - 1, 0): kv in [q - window + 1, q], i.e. (q - window, q].
        kwargs["local_window_size"] = (variant.window - 1, 0)
    return functools.partial(jax.nn.dot_product_attention, implementation="cudnn", **kwargs)


def _mha_attend(variant, head_dim, interpret=False):
    """JAX's own Pallas Triton FlashAttention (`jax.experimental.pallas.ops.gpu.attention
    .mha`, deprecated in favour of tokamax, still shipped): [B, S, H, D], no GQA, causal
    and/or `segment_ids` (documents), default block sizes. `interpret` only for testing
    this wrapper off the GPU; the harness runs it on GPUs only."""
    with warnings.catch_warnings():  # The module warns that it is deprecated on import.
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as triton_attention
    sm_scale = 1.0 / math.sqrt(head_dim)
    causal = variant.is_causal

    def attend(q, k, v, segment_ids):
        return triton_attention.mha(q, k, v, segment_ids, sm_scale=sm_scale, causal=causal,
                                    interpret=interpret)
    return attend


def _forward(attend):
    def step(q, k, v, d_out, *extra):
        del d_out  # None in fwd
        return attend(q, k, v, *extra)
    return step


def _forward_backward(attend):
    def step(q, k, v, d_out, *extra):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, *extra), q, k, v)
        dq, dk, dv = pullback(d_out)  # d_out is exactly the cotangent: no f32 round trip
        return out, dq, dk, dv
    return step


def _builders(wrap):
    """(ours, cudnn, mha) step builders, each returning one jitted step."""
    return (lambda score_mod, backend: jax.jit(wrap(_ours_attend(score_mod, backend))),
            lambda variant: jax.jit(wrap(_cudnn_attend(variant))),
            lambda variant, head_dim, interpret=False: jax.jit(
                wrap(_mha_attend(variant, head_dim, interpret))))


# mode -> (ours, cudnn, mha) step builders: ours(score_mod, backend),
# cudnn(variant), mha(variant, head_dim).
STEP_BUILDERS = {
    "fwd": _builders(_forward),
    "fwd_bwd": _builders(_forward_backward),
}
# What a step returns, per mode (one array in fwd, a tuple in fwd_bwd).
OUTPUT_NAMES = {"fwd": ("out",), "fwd_bwd": ("out", "dq", "dk", "dv")}


# -- timing ------------------------------------------------------------------------------

def time_calls(fn, args, *, iters: int, repeats: int, warmup: int = 2,
               budget_s: float | None = None):
    """Median milliseconds per call: compile, warm up, then `repeats` x (time `iters`
    back-to-back calls, block once). If the fastest warm-up call says that would take
    longer than `budget_s`, fewer iters (then fewer repeats, never below 1) are timed; on a
    GPU that happens only to slow paths (the CPU smoke tests). Returns (entry, out) with
    entry = {ms, repeats_ms, compile_s, iters, repeats}."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    per_call_s = compile_s
    for _ in range(warmup):  # One at a time: the fastest is the estimate (early calls
        start = time.perf_counter()  # can carry one-time costs).
        out = jax.block_until_ready(fn(*args))
        per_call_s = min(per_call_s, time.perf_counter() - start)
    if budget_s is not None and per_call_s * iters * repeats > budget_s:
        iters = max(1, min(iters, int(budget_s / (per_call_s * repeats))))
        if per_call_s * iters * repeats > budget_s:
            repeats = max(1, min(repeats, int(budget_s / per_call_s)))
    per_call_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call_ms.append((time.perf_counter() - start) / iters * 1e3)
    entry = {"ms": statistics.median(per_call_ms), "repeats_ms": per_call_ms,
             "compile_s": compile_s, "iters": iters, "repeats": repeats}
    return entry, out


def time_ms(fn, *args, iters=20, repeats=5):
    """Median ms per call of `fn(*args)` (`time_calls`)."""
    entry, _ = time_calls(fn, args, iters=iters, repeats=repeats)
    return entry["ms"]


def time_paired(calls, *, rounds: int, iters: int) -> dict:
    """{name: [ms per call, one entry per round]} for `calls` {name: (fn, args)}: every
    round times each call once (`iters` calls, synced once), so that clock drift over a
    run (several percent on the H100 under sustained load) hits all of them alike."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, args) in calls.items():
            entry, _ = time_calls(fn, args, iters=iters, repeats=1)
            times[name].append(entry["ms"])
    return times


def paired_overhead(times, base_times) -> float:
    """Median over rounds of times / base_times, minus 1 (`time_paired`'s rounds)."""
    return statistics.median(t / base for t, base in zip(times, base_times)) - 1


def _as_tuple(result):
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def compare(ours, other, names) -> dict:
    """How far `other` (a reference's step result) is from ours: the largest |ours -
    other| of the output (`max_abs_diff_vs_ours`, as in fwd) and, in fwd_bwd, per
    gradient the largest |ours - other| and that relative to max|other|; the largest of
    those relative differences is `grad_max_rel_diff_vs_ours`."""
    result = {}
    grad_abs, grad_rel = {}, {}
    for name, a, b in zip(names, _as_tuple(ours), _as_tuple(other)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        difference = float(jnp.max(jnp.abs(a - b)))
        if name == "out":
            result["max_abs_diff_vs_ours"] = difference
            continue
        scale = float(jnp.max(jnp.abs(b)))
        grad_abs[name] = difference
        grad_rel[name] = difference / scale if scale > 0 else (0.0 if difference == 0
                                                                else float("inf"))
    if grad_abs:
        result["grad_max_abs_diff_vs_ours"] = grad_abs
        result["grad_rel_diff_vs_ours"] = grad_rel
        result["grad_max_rel_diff_vs_ours"] = max(grad_rel.values())
    return result


def samples_of(result, names, samples, kv_samples) -> dict:
    """The sampled elements of each returned array (lists of floats), keyed by name:
    out and dq at `samples` ([B, S, Hq, D]), dk and dv at `kv_samples` ([B, S, Hkv, D])."""
    picked = {}
    for name, array in zip(names, _as_tuple(result)):
        index = kv_samples if name in ("dk", "dv") else samples
        picked[name] = np.asarray(array[index].astype(jnp.float32)).tolist()
    return picked


# -- one (shape, variant) ----------------------------------------------------------------

def bench_one(shape, variant, inputs, samples, args, backend, on_gpu):
    q, k, v, d_out = inputs  # d_out is None in fwd
    samples, kv_samples = samples
    density = suites.mask_density(variant, shape)
    flops = suites.flop_count(shape, density, args.mode)
    row = {"shape": shape.as_dict(), "variant": variant.as_dict(), "mode": args.mode,
           "density": density, "flops": flops, "ours_backend": backend}
    build_ours, build_cudnn, build_mha = STEP_BUILDERS[args.mode]
    names = OUTPUT_NAMES[args.mode]
    timing = {"iters": args.iters, "repeats": args.repeats, "budget_s": args.time_budget_s}

    def timed(fn, fn_args):
        entry, result = time_calls(fn, fn_args, **timing)
        entry["tflops"] = suites.tflops(flops, entry["ms"])
        return entry, result

    mask_mod, score_mod = jax_mods(variant, shape)
    block_mask = ours_out = None
    try:
        start = time.perf_counter()
        block_mask = pf.create_block_mask(mask_mod, None, None, shape.seq_len, shape.seq_len)
        jax.block_until_ready(block_mask.kv_num_blocks)
        row["block_mask_build_s"] = time.perf_counter() - start  # includes compiling
        row["block_density"] = 1.0 - block_mask.sparsity() / 100.0
        row["ours"], ours_out = timed(build_ours(score_mod, backend),
                                      (q, k, v, d_out, block_mask))
        picked = samples_of(ours_out, names, samples, kv_samples)
        row["ours_samples"] = picked.pop("out")
        if picked:
            row["ours_grad_samples"] = picked
    except Exception as error:  # One broken variant must not end the run.
        row["ours"] = {"error": error_text(error)}
        traceback.print_exc()

    def reference(name, build, fn_args, failed_status="unsupported"):
        """Times one reference (cuDNN, mha, xla) and compares it with ours."""
        try:
            row[name], result = timed(build(), fn_args)
            if ours_out is not None:
                row[name].update(compare(ours_out, result, names))
            del result
        except Exception as error:
            row[name] = {"error": error_text(error)}
            if failed_status:
                row[name]["status"] = failed_status

    if not on_gpu:
        row["cudnn"] = {"status": "n/a", "reason": "no GPU"}
    elif not variant.cudnn_expressible:
        row["cudnn"] = {"status": "inexpressible",
                        "reason": "cuDNN cannot express this variant"}
    else:
        reference("cudnn", lambda: build_cudnn(variant), (q, k, v, d_out))

    if args.jax_mha:
        if not on_gpu:
            row["jax_mha"] = {"status": "n/a", "reason": "no GPU"}
        elif not variant.mha_expressible or shape.is_gqa:
            row["jax_mha"] = {"status": "inexpressible", "reason":
                              "mha has no GQA" if variant.mha_expressible else
                              "mha cannot express this variant"}
        else:
            segment_ids = None
            if variant.mask == suites.DOCUMENT:
                ids = suites.variant_tables(variant, shape)["document_ids"]
                segment_ids = jnp.broadcast_to(jnp.asarray(ids), (shape.batch, shape.seq_len))
            reference("jax_mha", lambda: build_mha(variant, shape.head_dim),
                      (q, k, v, d_out, segment_ids))

    if args.xla and block_mask is not None:
        if args.mode == "fwd_bwd":
            row["xla"] = {"status": "skipped", "reason": "backend='xla' has no backward "
                          "kernels: its backward runs the Pallas kernels in interpret mode"}
        else:
            reference("xla", lambda: build_ours(score_mod, "xla"),
                      (q, k, v, d_out, block_mask), failed_status=None)
    return row


def write_rows(path, rows) -> None:
    """A sweep's rows as JSON, with the device, versions and date they were taken on."""
    with open(path, "w") as f:
        json.dump(dict(environment=environment(), date=str(datetime.date.today()), rows=rows),
                  f, indent=1)


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": _distribution_version("jaxlib"),
        "pallas_flex": pf.__version__,
        "default_backend": pf.default_backend(),
    }


def _distribution_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args) -> dict:
    suites.check_mode(args.mode)
    _, shapes, variants = suites.select(args)
    env = environment()
    on_gpu = env["platform"] == "gpu"
    backend = args.backend or pf.default_backend()
    rows = []
    for shape in shapes:
        host_inputs = list(suites.make_inputs(shape))
        host_inputs.append(suites.make_cotangent(shape) if suites.needs_cotangent(args.mode)
                           else None)
        inputs = tuple(None if x is None else jnp.asarray(x, dtype=jnp.bfloat16)
                       for x in host_inputs)
        del host_inputs
        samples = (tuple(jnp.asarray(index) for index in suites.sample_positions(shape)),
                   tuple(jnp.asarray(index) for index in suites.kv_sample_positions(shape)))
        for variant in variants:
            print(f"[jax] {shape.name} {variant.name} ...", file=sys.stderr, flush=True)
            rows.append(bench_one(shape, variant, inputs, samples, args, backend, on_gpu))
            _report(rows[-1])
        del inputs
    return {"framework": "jax", "environment": env, "iters": args.iters,
            "repeats": args.repeats, "time_budget_s": args.time_budget_s,
            "timing": "median over repeats of (loop of iters calls, one "
            "block_until_ready) / iters; iters, then repeats, cut where the warm-up calls "
            "say the repeats would take longer than time_budget_s (each entry records "
            "the iters and repeats it ran)", "rows": rows}


def _report(row):
    parts = []
    for name in ("ours", "cudnn", "jax_mha", "xla"):
        entry = row.get(name)
        if entry is None:
            continue
        if "ms" in entry:
            parts.append(f"{name} {entry['ms']:.3f} ms")
        else:
            parts.append(f"{name} {entry.get('status', 'error')}")
    print("      " + ", ".join(parts), file=sys.stderr, flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    suites.add_selection_args(parser)
    parser.add_argument("--iters", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops (median kept)")
    parser.add_argument("--backend", default=None, choices=pf.BACKENDS,
                        help="backend of 'ours' (default: the best for the device)")
    parser.add_argument("--xla", action="store_true",
                        help="also time backend='xla' (fwd only)")
    parser.add_argument("--jax-mha", action="store_true",
                        help="also time JAX's Pallas Triton mha (GPU; no mask, causal, "
                             "document; no GQA)")
    parser.add_argument("--time-budget-s", type=float, default=20.0,
                        help="cut iters, then repeats, of a timing whose warm-up calls say "
                             "it would take longer than this (default 20 s)")
    parser.add_argument("--json-out", default=None, help="write the results here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as file:
            file.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
