"""PyTorch side of the benchmark: `torch.nn.attention.flex_attention` on the same suite.

Run on its own (`python -m benchmarks.torch_bench --json-out rows.json`) or through
`benchmarks.run`, which starts it in its own subprocess (never in the JAX process: JAX
preallocates GPU memory). It must not import jax: the variants come from `suites` (numpy
only), so document ids, ALiBi slopes and q, k, v are the same numbers as on the JAX side.

Per shape and variant: a BlockMask from a compiled `create_block_mask`, built once, and
`torch.compile(flex_attention)` called on bf16 CUDA tensors in PyTorch's [B, H, S, D]
layout (transposed from pallas_flex's [B, S, H, D]), `enable_gqa=True` when Hq != Hkv.
`--mode fwd_bwd`: q, k, v require grad and a step is the compiled forward followed by
`torch.autograd.grad(out, (q, k, v), d_out)` with the fixed cotangent of
`suites.make_cotangent` (the same numbers as the JAX side's d_out).
Timing: `triton.testing.do_bench(..., return_mode="median")` after one compiling call.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import inspect
import json
import sys
import time
import traceback

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

from benchmarks import suites
from benchmarks.run import error_text

DEVICE = "cuda"
DYNAMO_LIMIT = 64  # one compile per (shape, variant); the default of 8 is far too low


def configure_dynamo() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            try:
                setattr(config, name, max(DYNAMO_LIMIT, getattr(config, name)))
            except (AttributeError, TypeError):  # A read-only alias in some versions.
                pass


# -- the variants as torch mods -----------------------------------------------------------

def torch_mods(variant: suites.Variant, shape: suites.Shape):
    """(mask_mod, score_mod or None) of `variant`; mask_mod is `noop_mask` for no mask."""
    tables = {name: torch.from_numpy(array).to(DEVICE) for name, array in
              suites.variant_tables(variant, shape).items()}

    if variant.mask == suites.NO_MASK:
        mask_mod = noop_mask
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
            return score + slopes[h] * (kv_idx - q_idx)
    elif variant.score == suites.SOFTCAP:
        cap = variant.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
    else:
        raise ValueError(f"unknown score kind {variant.score!r}")
    return mask_mod, score_mod


@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask, dynamic=False)


def build_block_mask(mask_mod, seq_len: int):
    """The BlockMask over [1, 1, S, S] (broadcast over batch and heads), built by
    `torch.compile(create_block_mask)` (torch 2.11 deprecates `_compile=True`, which
    stalled at S=16384 on the H100), so the dense mask is never materialized."""
    return _compiled_create_block_mask()(mask_mod, None, None, seq_len, seq_len,
                                         device=DEVICE)


# -- steps: what one timed call does, per mode ----------------------------------------------

@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def _forward_step(q, k, v, d_out, score_mod, block_mask, enable_gqa):
    flex = _compiled_flex_attention()

    def step():
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                    enable_gqa=enable_gqa)
    return step


def _forward_backward_step(q, k, v, d_out, score_mod, block_mask, enable_gqa):
    """out and the gradients of `sum(out * d_out)` w.r.t. q, k, v: the compiled forward,
    then `torch.autograd.grad(out, (q, k, v), d_out)` (the compiled backward kernel)."""
    flex = _compiled_flex_attention()
    # Leaves of their own that require grad; detach() shares the storage, no copy.
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))

    def step():
        out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                   enable_gqa=enable_gqa)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
        return out.detach(), dq, dk, dv
    return step


# mode -> step builder(q, k, v, d_out, score_mod, block_mask, enable_gqa) -> step(); d_out
# is None in fwd. A step returns out (fwd) or (out, dq, dk, dv) (fwd_bwd).
STEP_BUILDERS = {"fwd": _forward_step, "fwd_bwd": _forward_backward_step}
# What a step returns, per mode (as in jax_bench).
OUTPUT_NAMES = {"fwd": ("out",), "fwd_bwd": ("out", "dq", "dk", "dv")}


# -- one (shape, variant) --------------------------------------------------------------------

def _samples_of(result, names, samples, kv_samples) -> dict:
    """The sampled elements of each returned tensor, keyed by name. Tensors are
    [B, H, S, D]; the samples index [B, S, H, D] (out and dq: query heads; dk, dv: KV
    heads, `suites.kv_sample_positions`)."""
    result = result if isinstance(result, (tuple, list)) else (result,)
    picked = {}
    for name, tensor in zip(names, result):
        b, s, h, d = kv_samples if name in ("dk", "dv") else samples
        picked[name] = tensor[b, h, s, d].float().cpu().tolist()
    return picked


def bench_one(shape, variant, inputs, samples, args):
    from triton.testing import do_bench  # Ships with torch on CUDA.

    q, k, v, d_out = inputs  # d_out is None in fwd
    samples, kv_samples = samples
    density = suites.mask_density(variant, shape)
    flops = suites.flop_count(shape, density, args.mode)
    row = {"shape": shape.as_dict(), "variant": variant.as_dict(), "mode": args.mode,
           "density": density, "flops": flops}
    try:
        mask_mod, score_mod = torch_mods(variant, shape)
        start = time.perf_counter()
        block_mask = build_block_mask(mask_mod, shape.seq_len)
        torch.cuda.synchronize()
        row["block_mask_build_s"] = time.perf_counter() - start  # includes compiling
        row["block_density"] = 1.0 - float(block_mask.sparsity()) / 100.0

        step = STEP_BUILDERS[args.mode](q, k, v, d_out, score_mod, block_mask,
                                        shape.is_gqa)
        start = time.perf_counter()
        result = step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        ms = float(do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms,
                            return_mode="median"))
        row["torch"] = {"ms": ms, "compile_s": compile_s, "tflops": suites.tflops(flops, ms)}
        picked = _samples_of(result, OUTPUT_NAMES[args.mode], samples, kv_samples)
        row["torch_samples"] = picked.pop("out")
        if picked:
            row["torch_grad_samples"] = picked
        del result
    except Exception as error:  # One broken variant must not end the run.
        row["torch"] = {"error": error_text(error)}
        traceback.print_exc()
    return row


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": _version("triton"), "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
        env["device_capability"] = list(torch.cuda.get_device_capability(0))
    return env


def _to_torch(array: np.ndarray) -> torch.Tensor:
    """[B, S, H, D] float32 numpy -> [B, H, S, D] contiguous bf16 on the GPU."""
    tensor = torch.from_numpy(array).to(device=DEVICE, dtype=torch.bfloat16)
    return tensor.permute(0, 2, 1, 3).contiguous()


def run(args) -> dict:
    suites.check_mode(args.mode)
    _, shapes, variants = suites.select(args)
    env = environment()
    result = {"framework": "torch", "environment": env, "rows": [],
              "timing": f"triton.testing.do_bench(warmup={args.warmup_ms} ms, "
                        f"rep={args.rep_ms} ms, return_mode='median')"}
    if not torch.cuda.is_available():
        result["error"] = "torch sees no CUDA device"
        return result
    configure_dynamo()
    for shape in shapes:
        inputs = tuple(_to_torch(x) for x in suites.make_inputs(shape))
        inputs += (_to_torch(suites.make_cotangent(shape))
                   if suites.needs_cotangent(args.mode) else None,)
        samples = tuple(tuple(torch.from_numpy(index).to(DEVICE) for index in positions)
                        for positions in (suites.sample_positions(shape),
                                          suites.kv_sample_positions(shape)))
        for variant in variants:
            print(f"[torch] {shape.name} {variant.name} ...", file=sys.stderr, flush=True)
            row = bench_one(shape, variant, inputs, samples, args)
            result["rows"].append(row)
            entry = row["torch"]
            print("      " + (f"torch {entry['ms']:.3f} ms" if "ms" in entry else
                              "torch error"), file=sys.stderr, flush=True)
        del inputs, samples
        torch.cuda.empty_cache()
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    suites.add_selection_args(parser)
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time (ms)")
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
