"""Times the two backward kernels one at a time, and the whole backward, on the GPU.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_backward [--out probe.json]
B4 H16 S4096 D128 bf16. For each kernel-option set and variant: the dQ launch alone,
the dK/dV launch alone, and `flex_attention_backward` (both plus the delta and padding
work), in ms. Tells which kernel to work on, and what a tile change does to each.
"""
import argparse
import functools
import json

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels import backward
from pallas_flex.kernels.config import resolve_options
from pallas_flex.masks.mod_program import SCORE, make_mod_program
from benchmarks.tune_forward import time_ms

# name -> kernel_options over the defaults
CONFIGS = {
    "default": {},
    "dkdv128x64_8w2s": dict(backward_dkdv_block_q=64, backward_dkdv_block_kv=128,
                            backward_dkdv_num_warps=8, backward_dkdv_num_stages=2),
    "dkdv128x64_8w3s": dict(backward_dkdv_block_q=64, backward_dkdv_block_kv=128,
                            backward_dkdv_num_warps=8, backward_dkdv_num_stages=3),
    "dq128x64_8w": dict(backward_block_q=128, backward_block_kv=64, backward_num_warps=8,
                        backward_dkdv_num_warps=4),
    "dq64x128_4w": dict(backward_block_q=64, backward_block_kv=128),
    "dkdv64x128_4w": dict(backward_dkdv_block_q=128, backward_dkdv_block_kv=64),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--variants", default="noop,causal")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--parts", default="dq,dkdv,backward")
    parser.add_argument("--baseline", help="module with another flex_attention_backward")
    args = parser.parse_args()
    batch, heads, length, dim = 4, 16, 4096, 128
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (batch, length, heads, dim), jnp.bfloat16)
                      for key in keys)
    variants = {"noop": (None, None), "causal": (masks.causal_mask, None),
                "softcap": (masks.causal_mask, masks.tanh_softcap(30.0)),
                "alibi": (masks.causal_mask, masks.alibi(heads))}
    scale = dim ** -0.5
    rows = []
    for name in args.variants.split(","):
        mask_mod, score_mod = variants[name]
        block_mask = pf.create_block_mask(mask_mod, None, None, length, length)
        out, lse = pf.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
        score_program = (make_mod_program(score_mod, SCORE) if score_mod is not None
                         else None)
        for config_name in args.configs.split(","):
            options = resolve_options(CONFIGS[config_name], dim)

            # Arrays are arguments, not closed-over constants (XLA would fold them).
            def prepared(q, k, v, out, lse, d_out, block_mask, score_program):
                return backward._prepare(q, k, v, out, lse, d_out, None, block_mask,
                                         score_program, scale)

            def dq_only(*args):
                return backward._dq_launch(prepared(*args), options=options, interpret=False)

            def dkdv_only(*args):
                return backward._dkdv_launch(prepared(*args), options=options,
                                             interpret=False)

            def whole(q, k, v, out, lse, d_out, block_mask, score_program, module=backward):
                return module.flex_attention_backward(
                    q, k, v, out, lse, d_out, None, block_mask, score_program, scale=scale,
                    options=options, interpret=False)

            arguments = (q, k, v, out, lse, d_out, block_mask, score_program)
            row = dict(variant=name, config=config_name, options=CONFIGS[config_name])
            parts = {"dq": dq_only, "dkdv": dkdv_only, "backward": whole}
            for part in args.parts.split(","):
                fn = parts[part]
                try:
                    row[part] = time_ms(jax.jit(fn), *arguments, iters=args.iters)
                except Exception as error:  # one failing config must not end the probe
                    row[part] = float("nan")
                    print("failed", config_name, part, str(error)[:300], flush=True)
            if args.baseline and config_name == "default":
                import importlib
                module = importlib.import_module(args.baseline)
                row["baseline_backward"] = time_ms(
                    jax.jit(functools.partial(whole, module=module)), *arguments,
                    iters=args.iters)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
