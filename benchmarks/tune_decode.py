"""Sweeps decode-kernel options on the H100 (bf16, Hq 32, Hkv 8, D 128, Sq 1).

Usage: PYTHONPATH=$PWD python3 benchmarks/tune_decode.py [--out results.json] [--quick]
Prints ms and the bandwidth reached reading the KV cache (TB/s) per (shape, options,
variant), next to cuDNN's `jax.nn.dot_product_attention` on the same inputs.
"""
import argparse

import jax
import jax.numpy as jnp

import pallas_flex as pf
from benchmarks.jax_bench import write_rows
from benchmarks.tune_forward import time_ms
from pallas_flex import masks


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true", help="default options only")
    args = parser.parse_args()
    q_heads, kv_heads, dim = 32, 8, 128
    configs = [{}] if args.quick else [
        {}, dict(decode_block_kv=64), dict(decode_num_warps=8),
        dict(decode_num_stages=3), dict(decode_block_kv=64, decode_num_stages=3),
        dict(decode_num_splits=0, decode_block_kv=256, decode_num_warps=8)]
    rows = []
    for batch, length in ((8, 16384), (1, 131072)):
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (batch, 1, q_heads, dim), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, length, kv_heads, dim), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, length, kv_heads, dim), jnp.bfloat16)
        cache_bytes = 2 * k.size * k.dtype.itemsize
        position = jnp.full((batch,), length - 1, jnp.int32)
        variants = {
            "noop": (None, None),
            "causal_offset": (masks.offset(masks.causal_mask, position), None),
            "alibi": (None, masks.alibi(q_heads)),
            "softcap": (None, masks.tanh_softcap(30.0)),
        }
        for config in configs:
            for name, (mask_mod, score_mod) in variants.items():
                if config and name in ("alibi", "softcap"):
                    continue
                block_mask = pf.create_block_mask(mask_mod, batch if mask_mod else None, None,
                                                  1, length)
                fn = jax.jit(lambda q, k, v, bm, config=config, score_mod=score_mod:
                             pf.flex_attention(q, k, v, score_mod, bm, kernel_options=config))
                try:
                    ms = time_ms(fn, q, k, v, block_mask)
                except Exception as error:
                    ms = float("nan")
                    print("failed", config, name, str(error)[:400])
                row = dict(batch=batch, length=length, config=config, variant=name, ms=ms,
                           tb_per_s=cache_bytes / ms / 1e9)
                rows.append(row)
                print(f"B{batch} S{length} {config} {name:14s} {ms:.4f} ms "
                      f"{row['tb_per_s']:.2f} TB/s", flush=True)
        for name, causal in (("noop", False),):
            fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, implementation="cudnn"))
            try:
                ms = time_ms(fn, q, k, v)
            except Exception as error:
                ms = float("nan")
                print("cudnn failed", str(error)[:300])
            rows.append(dict(batch=batch, length=length, config="cudnn", variant=name, ms=ms,
                             tb_per_s=cache_bytes / ms / 1e9))
            print(f"B{batch} S{length} cudnn {name} {ms:.4f} ms {cache_bytes / ms / 1e9:.2f} TB/s")
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
