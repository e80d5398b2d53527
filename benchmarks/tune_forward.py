"""Sweeps forward kernel options on the H100 for a few variants (B4 H16 S4096 D128 bf16).

Usage: PYTHONPATH=$PWD python3 benchmarks/tune_forward.py [--out results.json]
Prints one line per (options, variant) with the median time of repeated timed loops.
"""
import argparse
import json

import jax
import jax.numpy as jnp

import pallas_flex as pf
from benchmarks.jax_bench import time_calls
from pallas_flex import masks


def time_ms(fn, *args, iters=20, repeats=5):
    """Median ms per call, timed by the harness's own timer (`jax_bench.time_calls`)."""
    entry, _ = time_calls(fn, args, iters=iters, repeats=repeats)
    return entry["ms"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    batch, heads, length, dim = 4, 16, 4096, args.head_dim
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (batch, length, heads, dim), jnp.bfloat16) for key in keys)
    doc_ids = jnp.asarray((jnp.arange(length) * 12) // length, jnp.int32)
    variants = {
        "noop": (None, None),
        "causal": (masks.causal_mask, None),
        "document": (masks.and_masks(masks.causal_mask, masks.document_mask(doc_ids)), None),
        "softcap": (masks.causal_mask, masks.tanh_softcap(30.0)),
    }
    block_masks = {name: pf.create_block_mask(mask, None, None, length, length)
                   for name, (mask, _) in variants.items()}
    configs = [dict(block_q=bq, block_kv=bk, num_warps=w, num_stages=st)
               for bq, bk, w, st in [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3),
                                     (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                                     (128, 32, 4, 3), (64, 128, 4, 2)]]
    rows = []
    for config in configs:
        for name, (_, score_mod) in variants.items():
            fn = jax.jit(lambda q, k, v, bm, config=config, score_mod=score_mod: pf.flex_attention(
                q, k, v, score_mod, bm, kernel_options=config))
            try:
                ms = time_ms(fn, q, k, v, block_masks[name])
            except Exception as error:  # a config that does not compile (shared memory)
                ms = float("nan")
                print("failed", config, name, str(error)[:300])
            rows.append(dict(config=config, variant=name, ms=ms))
            print(f"{config} {name:9s} {ms:.3f} ms", flush=True)
    for causal in (False, True):
        fn = jax.jit(lambda q, k, v, causal=causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
        ms = time_ms(fn, q, k, v)
        rows.append(dict(config="cudnn", variant="causal" if causal else "noop", ms=ms))
        print(f"cudnn {'causal' if causal else 'noop'} {ms:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
