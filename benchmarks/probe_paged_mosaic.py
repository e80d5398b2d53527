"""Paged prefill on the Mosaic forward against the same call on contiguous K/V, in one
process and interleaved rounds (machine-to-machine variance on this op is several
percent, so compare within a process): the prefill of `paged_bench` (2048 new tokens on
6144 cached, B4 H16 D128 bf16, causal), and the contiguous call with the BlockMask
clipping that every paged call does inside its jit (what of the overhead it accounts
for).

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_paged_mosaic [--rounds 3] [--out f.json]
"""
import argparse
import json

import jax
import jax.numpy as jnp

import pallas_flex as pf
from benchmarks.paged_bench import paged_copy
from benchmarks.tune_forward import time_ms
from pallas_flex import masks
from pallas_flex.paged.flex_attention import clip_block_mask_to_lengths, paged_flex_attention


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-sizes", default="16,64,128")
    parser.add_argument("--out")
    args = parser.parse_args()
    batch, q_len, length, heads, dim = 4, 2048, 8192, 16, 128
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, q_len, heads, dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, length, heads, dim), jnp.bfloat16)
            for key in keys[1:])
    mask = masks.offset(masks.causal_mask, length - q_len)  # as paged_bench
    block_mask = pf.create_block_mask(mask, None, None, q_len, length)
    lengths = jnp.full((batch,), length, jnp.int32)
    caches = {size: paged_copy(k, v, size) for size in map(int, args.page_sizes.split(","))}
    contiguous = jax.jit(lambda q, k, v, bm: pf.flex_attention(q, k, v, block_mask=bm))
    clipped = jax.jit(lambda q, k, v, bm, lengths: pf.flex_attention(
        q, k, v, block_mask=clip_block_mask_to_lengths(bm, lengths)))
    paged = jax.jit(lambda q, cache, bm: paged_flex_attention(q, cache, block_mask=bm))
    rows = []
    for round_index in range(args.rounds):
        row = dict(round=round_index, contiguous_ms=time_ms(contiguous, q, k, v, block_mask),
                   contiguous_with_clip_ms=time_ms(clipped, q, k, v, block_mask, lengths))
        for size, cache in caches.items():
            row[f"page{size}_ms"] = time_ms(paged, q, cache, block_mask)
            row[f"page{size}_overhead"] = row[f"page{size}_ms"] / row["contiguous_ms"] - 1
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
