"""Times forward+backward (jax.vjp) of pallas_flex for a few kernel options on the GPU.

Usage: PYTHONPATH=$PWD python3 benchmarks/tune_backward.py [--out results.json]
B4 H16 S4096 D128 bf16; prints the median ms per (options, variant) and cuDNN's.
"""
import argparse, json

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex import masks
from benchmarks.tune_forward import time_ms


# (dQ block_q, dQ block_kv, dK/dV block_q, dK/dV block_kv, warps, stages)
# Each entry: (dQ block_q, dQ block_kv, dK/dV block_q, dK/dV block_kv, warps, stages), or
# with two more, the dK/dV kernel's own (warps, stages).
CONFIGS = [(64, 64, 64, 64, 4, 2), (64, 64, 64, 128, 4, 2, 8, 2), (64, 64, 64, 128, 4, 2, 8, 3),
           (128, 64, 64, 64, 8, 2, 4, 2), (128, 64, 64, 128, 8, 2, 8, 2),
           (64, 64, 128, 64, 4, 2, 8, 2), (64, 64, 64, 64, 4, 2, 4, 3)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--variants", default="noop,causal,softcap,alibi")
    args = parser.parse_args()
    batch, heads, length, dim = 4, 16, 4096, 128
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (batch, length, heads, dim), jnp.bfloat16)
                      for key in keys)
    variants = {"noop": (None, None), "causal": (masks.causal_mask, None),
                "softcap": (masks.causal_mask, masks.tanh_softcap(30.0)),
                "alibi": (masks.causal_mask, masks.alibi(heads))}
    variants = {name: variants[name] for name in args.variants.split(",")}
    block_masks = {name: pf.create_block_mask(mask, None, None, length, length)
                   for name, (mask, _) in variants.items()}
    rows = []
    # (dQ block_q, dQ block_kv, dK/dV block_q, dK/dV block_kv, warps, stages)
    configs = [dict(backward_block_q=c[0], backward_block_kv=c[1], backward_dkdv_block_q=c[2],
                    backward_dkdv_block_kv=c[3], backward_num_warps=c[4],
                    backward_num_stages=c[5],
                    **(dict(backward_dkdv_num_warps=c[6], backward_dkdv_num_stages=c[7])
                       if len(c) > 6 else {}))
               for c in CONFIGS]
    for config in configs:
        for name, (_, score_mod) in variants.items():
            def step(q, k, v, d_out, bm, config=config, score_mod=score_mod):
                out, vjp = jax.vjp(lambda q, k, v: pf.flex_attention(
                    q, k, v, score_mod, bm, kernel_options=config), q, k, v)
                return out, vjp(d_out)
            try:
                ms = time_ms(jax.jit(step), q, k, v, d_out, block_masks[name], iters=10)
            except Exception as error:
                ms = float("nan")
                print("failed", config, name, str(error)[:400])
            rows.append(dict(config=config, variant=name, ms=ms))
            print(f"{config} {name:8s} fwd+bwd {ms:.3f} ms", flush=True)
    for causal in (False, True):
        def step(q, k, v, d_out, causal=causal):
            out, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"), q, k, v)
            return out, vjp(d_out)
        ms = time_ms(jax.jit(step), q, k, v, d_out, iters=10)
        rows.append(dict(config="cudnn", variant="causal" if causal else "noop", ms=ms))
        print(f"cudnn {'causal' if causal else 'noop'} fwd+bwd {ms:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
