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
  * xla    — `flex_attention(backend="xla")` with `--xla`.
Timing (GPU-NOTES): compile and warm up, then time `--iters` calls in a Python loop with one
`block_until_ready` at the end; repeat `--repeats` times and keep the median.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from benchmarks import suites


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

def _forward_ours(score_mod, backend):
    def forward(q, k, v, block_mask):
        return pf.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                 backend=backend)
    return jax.jit(forward)


def _forward_cudnn(variant):
    kwargs = {"is_causal": variant.is_causal}
    if variant.mask == suites.SLIDING_WINDOW:
        # (left, right) = (window - 1, 0): kv in [q - window + 1, q], i.e. (q - window, q].
        kwargs["local_window_size"] = (variant.window - 1, 0)
    return jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                     **kwargs))


def _forward_bwd_not_implemented(*_):
    suites.check_mode("fwd_bwd")


# mode -> (ours step builder, cudnn step builder). A fwd_bwd entry will time
# `jax.grad` of `sum(out * d_out)` through both.
STEP_BUILDERS = {
    "fwd": (_forward_ours, _forward_cudnn),
    "fwd_bwd": (_forward_bwd_not_implemented, _forward_bwd_not_implemented),
}


# -- timing ------------------------------------------------------------------------------

def time_calls(fn, args, *, iters: int, repeats: int, warmup: int = 2):
    """Median milliseconds per call: compile, warm up, then `repeats` x (time `iters`
    back-to-back calls, block once). Returns (median_ms, all repeat ms, compile_s, out)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    per_call_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call_ms.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(per_call_ms), per_call_ms, compile_s, out


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) < 600 else text[:600] + " ..."


def _max_abs_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# -- one (shape, variant) ----------------------------------------------------------------

def bench_one(shape, variant, inputs, samples, args, backend, on_gpu):
    q, k, v = inputs
    density = suites.mask_density(variant, shape)
    flops = suites.flop_count(shape, density, args.mode)
    row = {"shape": shape.as_dict(), "variant": variant.as_dict(), "mode": args.mode,
           "density": density, "flops": flops, "ours_backend": backend}
    build_ours, build_cudnn = STEP_BUILDERS[args.mode]

    mask_mod, score_mod = jax_mods(variant, shape)
    block_mask = ours_out = None
    try:
        start = time.perf_counter()
        block_mask = pf.create_block_mask(mask_mod, None, None, shape.seq_len, shape.seq_len)
        jax.block_until_ready(block_mask.kv_num_blocks)
        row["block_mask_build_s"] = time.perf_counter() - start  # includes compiling
        row["block_density"] = 1.0 - block_mask.sparsity() / 100.0
        ms, repeats_ms, compile_s, ours_out = time_calls(
            build_ours(score_mod, backend), (q, k, v, block_mask),
            iters=args.iters, repeats=args.repeats)
        row["ours"] = {"ms": ms, "repeats_ms": repeats_ms, "compile_s": compile_s,
                       "tflops": suites.tflops(flops, ms)}
        row["ours_samples"] = np.asarray(
            ours_out[samples].astype(jnp.float32)).tolist()
    except Exception as error:  # One broken variant must not end the run.
        row["ours"] = {"error": _error_text(error)}
        traceback.print_exc()

    if not on_gpu:
        row["cudnn"] = {"status": "n/a", "reason": "no GPU"}
    elif not variant.cudnn_expressible:
        row["cudnn"] = {"status": "inexpressible",
                        "reason": "cuDNN cannot express this variant"}
    else:
        try:
            ms, repeats_ms, compile_s, cudnn_out = time_calls(
                build_cudnn(variant), (q, k, v), iters=args.iters, repeats=args.repeats)
            row["cudnn"] = {"ms": ms, "repeats_ms": repeats_ms, "compile_s": compile_s,
                            "tflops": suites.tflops(flops, ms)}
            if ours_out is not None:
                row["cudnn"]["max_abs_diff_vs_ours"] = _max_abs_diff(ours_out, cudnn_out)
            del cudnn_out
        except Exception as error:
            row["cudnn"] = {"status": "unsupported", "error": _error_text(error)}

    if args.xla and block_mask is not None:
        try:
            ms, repeats_ms, compile_s, xla_out = time_calls(
                build_ours(score_mod, "xla"), (q, k, v, block_mask),
                iters=args.iters, repeats=args.repeats)
            row["xla"] = {"ms": ms, "repeats_ms": repeats_ms, "compile_s": compile_s,
                          "tflops": suites.tflops(flops, ms)}
            if ours_out is not None:
                row["xla"]["max_abs_diff_vs_ours"] = _max_abs_diff(ours_out, xla_out)
            del xla_out
        except Exception as error:
            row["xla"] = {"error": _error_text(error)}
    return row


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
        host_inputs = suites.make_inputs(shape)
        inputs = tuple(jnp.asarray(x, dtype=jnp.bfloat16) for x in host_inputs)
        del host_inputs
        samples = tuple(jnp.asarray(index) for index in suites.sample_positions(shape))
        for variant in variants:
            print(f"[jax] {shape.name} {variant.name} ...", file=sys.stderr, flush=True)
            rows.append(bench_one(shape, variant, inputs, samples, args, backend, on_gpu))
            _report(rows[-1])
        del inputs
    return {"framework": "jax", "environment": env, "iters": args.iters,
            "repeats": args.repeats, "timing": "median over repeats of (loop of iters "
            "calls, one block_until_ready) / iters", "rows": rows}


def _report(row):
    parts = []
    for name in ("ours", "cudnn", "xla"):
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
    parser.add_argument("--xla", action="store_true", help="also time backend='xla'")
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
