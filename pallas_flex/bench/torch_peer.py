"""PyTorch FlexAttention on the same cases, in a process of its own (JAX and torch must not
share a GPU process): `python -m pallas_flex.bench.torch_peer SUITE CASES.json OUT.json`.

Per case: a BlockMask from `torch.compile(create_block_mask)` built once, then
`torch.compile(flex_attention)` on the JAX side's numbers in torch's [B, H, S, D] layout,
`enable_gqa` when Hq != Hkv; fwd_bwd adds `torch.autograd.grad(out, (q, k, v), d_out)`.
Timed by `triton.testing.do_bench` (median) after one compiling call.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
import traceback

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from pallas_flex.bench import cases
from pallas_flex.bench.jax_suites import mods
from pallas_flex.bench.timing import error_entry

DEVICE = "cuda"


def _tensor(array: np.ndarray) -> torch.Tensor:
    """[B, S, H, D] float32 numpy -> [B, H, S, D] bf16 on the GPU."""
    return torch.from_numpy(array).to(DEVICE, torch.bfloat16).permute(0, 2, 1, 3).contiguous()


def attention_case(shape, variant, mode):
    from triton.testing import do_bench

    q, k, v, d_out = (_tensor(x) for x in cases.inputs(shape))
    mask_mod, score_mod = mods(variant, shape, arrays=lambda x: torch.from_numpy(x).to(DEVICE),
                               tanh=torch.tanh)
    block_mask = None if mask_mod is None else torch.compile(create_block_mask)(
        mask_mod, None, None, shape.queries, shape.seq_len, device=DEVICE)
    flex = torch.compile(flex_attention, dynamic=False)
    if mode == "fwd_bwd":
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))

    def step():
        out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=shape.scale,
                   enable_gqa=shape.q_heads != shape.kv_heads)
        if mode == "fwd":
            return (out,)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), d_out))

    start = time.perf_counter()
    outs = step()
    torch.cuda.synchronize()
    entry = {"compile_s": time.perf_counter() - start,
             "ms": float(do_bench(step, warmup=25, rep=100, return_mode="median"))}
    samples = []
    for i, out in enumerate(outs):
        b, s, h, d = (torch.from_numpy(x).to(DEVICE)
                      for x in cases.sample_positions(shape, kv=i in (2, 3)))
        samples.append(out[b, h, s, d].float().cpu().tolist())
    return entry, samples


def block_mask_case(length):
    """torch's create_block_mask, eager (compiled, it took over 200 s at S = 16384)."""
    ids = torch.from_numpy(cases.document_ids(length, 12)).to(DEVICE)

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (ids[q] == ids[kv])
    create_block_mask(mask_mod, None, None, length, length, device=DEVICE)
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        mask = create_block_mask(mask_mod, None, None, length, length, device=DEVICE)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"ms": statistics.median(seconds) * 1e3,
            "sparsity_percent": float(mask.sparsity())}, None


def main(suite: str, cases_path: str, out_path: str) -> None:
    """cases_path: [[case, params], ...] from the JAX side's rows."""
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per case
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    fields = [field.name for field in dataclasses.fields(cases.Shape)]
    variants = {v.name: v for v in cases.VARIANTS + cases.DECODE_VARIANTS}
    results = {"torch": torch.__version__, "entries": {}}
    for case, params in json.load(open(cases_path)):
        print(f"[torch {suite}] {case}", flush=True)
        try:
            if suite == "block_mask":
                entry, samples = block_mask_case(params["seq_len"])
            else:
                entry, samples = attention_case(cases.Shape(**{f: params[f] for f in fields}),
                                                variants[params["variant"]], params["mode"])
            results["entries"][case] = {**entry, "samples": samples}
        except Exception as error:
            traceback.print_exc()
            results["entries"][case] = error_entry(error, "unsupported")
        torch.cuda.empty_cache()
        json.dump(results, open(out_path, "w"))  # a timeout keeps the cases done


if __name__ == "__main__":
    main(*sys.argv[1:4])
