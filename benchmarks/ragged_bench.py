"""The ragged paged-attention op (`pf.paged.paged_attention`) on the H100: the Pallas
kernel against the XLA loop, on mixed prefill + decode batches.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.ragged_bench [--out results.json]
       [--num-splits 1,0] [--mixes decode_64x4096,...] [--backends pallas,xla]
bf16, Hq 32, Hkv 8, D 128, block (page) size 16, pages shuffled. Bandwidth counts the
K/V bytes each sequence's tokens must read at least once (its whole history + new).
The caches are donated and fed back call after call, as in serving (`--no-donate`: the
call as a plain function, which copies both caches each time), and the calls run inside
`pallas_flex.paged.traced_checks(False)` as a server that does not checkify would
(`--traced-checks`: with the metadata checks traced in, which slows each call's dispatch).
`--num-splits` lists the Pallas kernel's KV splits to time (0 = automatic); each row
records the value asked for (`num_splits`) and the one the kernel used
(`num_splits_used`), so one run can A/B them.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.jax_bench import write_rows
from benchmarks.jax_bench import time_ms
from pallas_flex import paged
from pallas_flex.kernels import ragged_paged as ragged_kernel

MIXES = {
    # name: [(past_len, new_len)] per sequence
    "decode_64x4096": [(4096, 1)] * 64,
    "decode_16x4096": [(4096, 1)] * 16,
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


def _donating_step(inputs, backend, num_splits):
    """One call as a server makes it: the caches donated, updated in place and fed back
    into the next call (without donation every call copies both whole caches, which at
    64 x 4096 tokens costs more than the attention itself)."""
    caches = {"key_cache": inputs["key_cache"], "value_cache": inputs["value_cache"]}
    others = {name: value for name, value in inputs.items() if name not in caches}
    step = jax.jit(lambda others, key_cache, value_cache: paged.paged_attention(
        **others, key_cache=key_cache, value_cache=value_cache, backend=backend,
        num_splits=num_splits),
        donate_argnums=(1, 2))
    caches = {name: jnp.copy(value) for name, value in caches.items()}  # inputs stay valid

    def call(_inputs):
        out, caches["key_cache"], caches["value_cache"] = step(
            others, caches["key_cache"], caches["value_cache"])
        return out

    return call


def _splits_used(inputs, seqs, requested, backend):
    """The kernel's split count for these inputs (requested 0 = automatic)."""
    head_dim = inputs["key_cache"].shape[3]
    query_shape = (inputs["query"].shape[0], inputs["query"].shape[1] // head_dim, head_dim)
    return ragged_kernel.planned_num_splits(query_shape, inputs["key_cache"].shape, len(seqs),
                                            inputs["block_indices"].shape[0],
                                            requested=requested,
                                            interpret=backend == "interpret")


def _time(name, inputs, backend, donate, num_splits=None):
    fn = jax.jit(lambda inputs: paged.paged_attention(**inputs, backend=backend,
                                                      num_splits=num_splits)[0])
    if donate:
        fn = _donating_step(inputs, backend, num_splits)
    try:
        return time_ms(fn, inputs, iters=10, repeats=3), fn(inputs)
    except Exception as error:
        print("failed", name, backend, str(error)[:400])
        return float("nan"), None


def _kv_bytes(seqs, kv_heads=8, dim=128):
    """K/V bytes the sequences' tokens must read at least once (bf16; make_inputs' heads)."""
    return sum(past + new for past, new in seqs) * kv_heads * dim * 2 * 2


def kernel_only(args) -> list:
    """Times the Pallas kernel alone (caches already hold the new tokens; no writes, no
    work-item setup outside it) for each (block_kv, num_stages, num_splits)."""
    rows = []
    for name in args.mixes.split(","):
        seqs = MIXES[name]
        inputs = make_inputs(seqs)
        kv_bytes = _kv_bytes(seqs)
        head_dim = inputs["key_cache"].shape[3]
        num_tokens, q_heads = inputs["query"].shape[0], inputs["query"].shape[1] // head_dim
        query = inputs["query"].reshape(num_tokens, q_heads, head_dim)
        for config in args.kernel_configs.split(","):
            block_kv, stages, splits = (int(x) for x in config.split("/"))
            fn = jax.jit(lambda query, key_cache, value_cache, past_lens, begins, blocks,
                         block_begins, block_kv=block_kv, stages=stages, splits=splits:
                         ragged_kernel.ragged_paged_attention(
                             query, key_cache, value_cache, past_lens, begins, blocks,
                             block_begins, head_dim ** -0.5, 0,
                             jnp.zeros((q_heads,), jnp.float32),
                             interpret=False, block_kv=block_kv, num_stages=stages,
                             num_splits=splits)[0])
            ms = time_ms(fn, query, inputs["key_cache"], inputs["value_cache"],
                         inputs["past_lens"], inputs["subsequence_begins"],
                         inputs["block_indices"], inputs["block_indices_begins"],
                         iters=50, repeats=5)
            rows.append(dict(mix=name, kernel_only=True, block_kv=block_kv, num_stages=stages,
                             num_splits=splits, ms=ms, tb_per_s=kv_bytes / ms / 1e9))
            print(f"{name:34s} kernel block_kv {block_kv} stages {stages} splits {splits} "
                  f"{ms:8.3f} ms {kv_bytes / ms / 1e9:5.2f} TB/s", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--backends", default="pallas,xla")
    parser.add_argument("--num-splits", default="0",
                        help="comma-separated KV splits per work item to time in the Pallas "
                             "kernel (0 = automatic), e.g. 1,0,4")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--no-donate", dest="donate", action="store_false",
                        help="time the call without donating the caches: XLA then copies "
                             "both whole caches every call to write the new tokens")
    parser.add_argument("--traced-checks", action="store_true",
                        help="keep the metadata checks in the traced op (checkify "
                             "debug_checks: slower dispatch)")
    parser.add_argument("--kernel-configs", default="",
                        help="time the kernel alone instead, for block_kv/num_stages/num_splits "
                             "triples, e.g. 64/2/1,32/3/2 (0 splits = automatic)")
    args = parser.parse_args()
    if args.kernel_configs:
        rows = kernel_only(args)
        if args.out:
            write_rows(args.out, rows)
        return
    split_counts = [int(count) for count in args.num_splits.split(",")]
    rows = []
    for name in args.mixes.split(","):
        seqs = MIXES[name]
        inputs = make_inputs(seqs)
        kv_bytes = _kv_bytes(seqs)
        outputs = {}
        for backend in args.backends.split(","):
            # The XLA loop has no splits: time it once.
            for requested in split_counts if backend != "xla" else [None]:
                with paged.traced_checks(args.traced_checks):
                    ms, out = _time(name, inputs, backend, args.donate,
                                    num_splits=requested or None)
                used = (None if requested is None
                        else _splits_used(inputs, seqs, requested, backend))
                label = (backend if requested is None
                         else f"{backend}/{'auto:' if requested == 0 else ''}{used}")
                if out is not None:
                    outputs[label] = out
                rows.append(dict(mix=name, backend=backend, ms=ms,
                                 tb_per_s=kv_bytes / ms / 1e9, num_splits=requested,
                                 num_splits_used=used, caches_donated=args.donate,
                                 traced_checks=args.traced_checks))
                print(f"{name:34s} {label:14s} {ms:8.3f} ms {kv_bytes / ms / 1e9:5.2f} TB/s",
                      flush=True)
        if "xla" in outputs:
            reference = outputs.pop("xla").astype(jnp.float32)
            for label, out in outputs.items():
                error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference)))
                print(f"{name}: max |{label} - xla| = {error:.3e}")
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
