"""Probe (issue 20): the ragged op with RoPE re-rotation of 10 % of the cache blocks
against the same call without it (decode 64 x 4096 and mixed 4 x 1024 prefill + 60
decodes; Hq32 Hkv8 D128 bf16, blocks of 16), caches donated and fed back.
Run: PYTHONPATH=$PWD python3 benchmarks/probes/rotation_gpu.py $OUT"""
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
import pallas_flex as pf
from pallas_flex.bench.timing import time_paired

heads, dim, block = (32, 8), 128, 16
mixes = {"decode_64x4096": [(4096, 1)] * 64,
         "mixed_4prefill1024_60decode4096": [(1024, 1024)] * 4 + [(4096, 1)] * 60}
res = {}
rng = np.random.default_rng(0)
for name, seqs in mixes.items():
    blocks = [-(-(p + n) // block) for p, n in seqs]
    total, tokens = sum(blocks), sum(n for _, n in seqs)
    key = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(key[0], (tokens, heads[0] * dim), jnp.bfloat16)
    k = jax.random.normal(key[1], (tokens, heads[1] * dim), jnp.bfloat16)
    v = jax.random.normal(key[2], (tokens, heads[1] * dim), jnp.bfloat16)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    others = dict(query=q, key=k, value=v, past_lens=i32([p for p, _ in seqs]),
                  subsequence_begins=i32(np.cumsum([0] + [n for _, n in seqs])),
                  block_indices=i32(rng.permutation(total)),
                  block_indices_begins=i32(np.cumsum([0] + blocks)))
    listed = total // 10
    rows = 4096
    angles = rng.uniform(0, 6.28, (rows, dim // 2))
    rotation = dict(rotated_block_indices=i32(rng.choice(total, listed, replace=False)),
                    rotation_deltas=i32(rng.integers(0, rows, (listed, block))),
                    rotation_trig_lut=jnp.asarray(np.concatenate([np.cos(angles), np.sin(angles)], 1), jnp.float32))
    calls = {}
    for column, extra in (("plain", {}), ("rotated", rotation)):
        step = jax.jit(lambda others, kc, vc, extra=extra: pf.paged.paged_attention(
            **others, **extra, key_cache=kc, value_cache=vc), donate_argnums=(1, 2))
        caches = [jax.random.normal(key[3], (total, heads[1], block, dim), jnp.bfloat16),
                  jax.random.normal(key[4], (total, heads[1], block, dim), jnp.bfloat16)]

        def call(others, step=step, caches=caches):
            out, caches[0], caches[1] = step(others, *caches)
            return out
        with pf.paged.traced_checks(False):
            jax.block_until_ready(call(others))
        calls[column] = (call, (others,))
    with pf.paged.traced_checks(False):
        t = {c: round(e["ms"], 4) for c, e in time_paired(calls, rounds=7, iters=20).items()}
    t["rotated_over_plain"] = round(t["rotated"] / t["plain"], 4)
    t["listed_blocks"] = f"{listed} of {total}"
    print(name, t, flush=True)
    res[name] = t
json.dump(res, open(f"{sys.argv[1]}/rotation.json", "w"), indent=1)
