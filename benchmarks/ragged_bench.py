"""The ragged paged-attention op (`pf.paged.paged_attention`) on the H100: the Pallas
kernel against the XLA loop, on mixed prefill + decode batches.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.ragged_bench [--out results.json]
bf16, Hq 32, Hkv 8, D 128, block (page) size 16, pages shuffled. Bandwidth counts the
K/V bytes each sequence's tokens must read at least once (its whole history + new).
The caches are donated and fed back call after call, as in serving (`--no-donate`: the
call as a plain function, which copies both caches each time).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.jax_bench import write_rows
from benchmarks.tune_forward import time_ms
from pallas_flex import paged
from pallas_flex.kernels import ragged as ragged_kernel

MIXES = {
    # name: [(past_len, new_len)] per sequence
    "decode_64x4096": [(4096, 1)] * 64,
    "mixed_4prefill1024_60decode4096": [(1024, 1024)] * 4 + [(4096, 1)] * 60,
    "prefill_2x4096": [(0, 4096)] * 2,
}


def make_inputs(seqs, *, q_heads=32, kv_heads=8, dim=128, block_size=16, seed=0):
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-(past + new) // block_size) for past, new in seqs]
    num_blocks = sum(blocks_per_seq)
    order = rng.permutation(num_blocks).astype(np.int32)
    block_begins = np.concatenate([[0], np.cumsum(blocks_per_seq)]).astype(np.int32)
    num_tokens = sum(new for _, new in seqs)
    begins = np.concatenate([[0], np.cumsum([new for _, new in seqs])]).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
    return dict(
        query=normal(keys[0], (num_tokens, q_heads * dim)),
        key=normal(keys[1], (num_tokens, kv_heads * dim)),
        value=normal(keys[2], (num_tokens, kv_heads * dim)),
        key_cache=normal(keys[3], (num_blocks, kv_heads, block_size, dim)),
        value_cache=normal(keys[4], (num_blocks, kv_heads, block_size, dim)),
        past_lens=jnp.asarray([past for past, _ in seqs], jnp.int32),
        subsequence_begins=jnp.asarray(begins), block_indices=jnp.asarray(order),
        block_indices_begins=jnp.asarray(block_begins))


def _donating_step(inputs, backend):
    """One call as a server makes it: the caches donated, updated in place and fed back
    into the next call (without donation every call copies both whole caches, which at
    64 x 4096 tokens costs more than the attention itself)."""
    caches = {"key_cache": inputs["key_cache"], "value_cache": inputs["value_cache"]}
    others = {name: value for name, value in inputs.items() if name not in caches}
    step = jax.jit(lambda others, key_cache, value_cache: paged.paged_attention(
        **others, key_cache=key_cache, value_cache=value_cache, backend=backend),
        donate_argnums=(1, 2))
    caches = {name: jnp.copy(value) for name, value in caches.items()}  # inputs stay valid

    def call(_inputs):
        out, caches["key_cache"], caches["value_cache"] = step(
            others, caches["key_cache"], caches["value_cache"])
        return out

    return call


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--backends", default="pallas,xla")
    parser.add_argument("--num-splits", type=int, default=0,
                        help="programs per work item in the Pallas kernel (0 = automatic)")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--no-donate", dest="donate", action="store_false",
                        help="time the call without donating the caches: XLA then copies "
                             "both whole caches every call to write the new tokens")
    args = parser.parse_args()
    ragged_kernel.NUM_SPLITS = args.num_splits
    rows = []
    for name in args.mixes.split(","):
        seqs = MIXES[name]
        inputs = make_inputs(seqs)
        kv_bytes = sum(past + new for past, new in seqs) * 8 * 128 * 2 * 2
        outputs = {}
        for backend in args.backends.split(","):
            fn = jax.jit(lambda inputs, backend=backend: paged.paged_attention(
                **inputs, backend=backend)[0])
            if args.donate:
                fn = _donating_step(inputs, backend)
            try:
                ms = time_ms(fn, inputs, iters=10, repeats=3)
                outputs[backend] = fn(inputs)
            except Exception as error:
                ms = float("nan")
                print("failed", name, backend, str(error)[:400])
            rows.append(dict(mix=name, backend=backend, ms=ms, tb_per_s=kv_bytes / ms / 1e9,
                             num_splits=args.num_splits))
            print(f"{name:34s} {backend:7s} {ms:8.3f} ms {kv_bytes / ms / 1e9:5.2f} TB/s",
                  flush=True)
        if len(outputs) == 2:
            a, b = (x.astype(jnp.float32) for x in outputs.values())
            print(f"{name}: max |pallas - xla| = {float(jnp.max(jnp.abs(a - b))):.3e}")
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
