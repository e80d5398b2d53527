"""Sweeps decode options for latent-attention decode on the H100: Hq 128 over one KV head,
D 576 for scores, Dv 512, bf16, Sq 1.

Usage: PYTHONPATH=$PWD python3 benchmarks/tune_mla.py [--out results.json]
Bandwidth counts K and V as separate arrays (B * S * (576 + 512) * 2 bytes).
"""
import argparse

import jax
import jax.numpy as jnp

import pallas_flex as pf
from benchmarks.jax_bench import write_rows
from benchmarks.tune_forward import time_ms

CONFIGS = [{}, dict(decode_max_rows=64, decode_num_warps=8),
           dict(decode_max_rows=64, decode_num_warps=8, decode_block_kv=16),
           dict(decode_max_rows=128, decode_num_warps=8, decode_block_kv=16),
           dict(decode_max_rows=32, decode_num_warps=8), dict(decode_block_kv=64)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for batch, length in ((8, 32768), (1, 32768)):
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (batch, 1, 128, 576), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, length, 1, 576), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, length, 1, 512), jnp.bfloat16)
        cache_bytes = (k.size + v.size) * 2
        block_mask = pf.create_block_mask(None, None, None, 1, length)
        for config in CONFIGS:
            fn = jax.jit(lambda q, k, v, bm, config=config: pf.flex_attention(
                q, k, v, block_mask=bm, scale=192 ** -0.5, kernel_options=config))
            try:
                ms = time_ms(fn, q, k, v, block_mask)
            except Exception as error:
                ms = float("nan")
                print("failed", config, str(error)[:300])
            rows.append(dict(batch=batch, length=length, config=config, ms=ms,
                             tb_per_s=cache_bytes / ms / 1e9))
            print(f"B{batch} S{length} {config} {ms:.4f} ms {cache_bytes / ms / 1e9:.2f} TB/s",
                  flush=True)
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
