"""WIP probe (branch wip-relative-sides): relative reads (T5 buckets, clipped relative
tables) on the Mosaic forward with their dense block diagonals copied by TMA and one value
per side elsewhere (`forward_mosaic.SIDE_VALUES`), against main's dense block diagonals
then the runs (dense_then_runs: causal one-way T5 B4 H16 S4096 D128 0.752 ms on the H200,
B8 S2048 D64 0.355), the runs everywhere, and the same call without the mod; B1 S16384
too (there main's dense diagonals gained nothing: t5_bias 2.58 ms, causal 1.89); paired
rounds, AOT-compiled after clearing JAX's caches, each arm called four times before
timing (a hang shows as the last line printed).

    PYTHONPATH=$PWD python3 -m benchmarks.dense_diagonals_ab OUT.json
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench.timing import time_paired
from pallas_flex.kernels import forward_mosaic

rng = np.random.default_rng(0)
CASES = {  # batch, heads, length, dim, mask, mod, table dtype
    "t5_one_way_causal_b4_s4096_d128": (4, 16, 4096, 128, "causal", "t5", jnp.float32),
    "t5_one_way_causal_b8_s2048_d64": (8, 16, 2048, 64, "causal", "t5", jnp.float32),
    "t5_bidirectional_b4_s4096_d128": (4, 16, 4096, 128, None, "t5_bidirectional", jnp.float32),
    "t5_bf16_table_causal_b4_s4096_d128": (4, 16, 4096, 128, "causal", "t5", jnp.bfloat16),
    "clipped64_causal_b4_s4096_d128": (4, 16, 4096, 128, "causal", "clipped", jnp.float32),
    "t5_one_way_causal_b1_s16384_d128": (1, 16, 16384, 128, "causal", "t5", jnp.float32),
}


def compiled(fn, args, dense, sides=True):
    forward_mosaic.DENSE_DIAGONALS, forward_mosaic.SIDE_VALUES = dense, sides
    try:
        jax.clear_caches()
        return jax.jit(fn).lower(*args).compile()
    finally:
        forward_mosaic.DENSE_DIAGONALS, forward_mosaic.SIDE_VALUES = True, True


def main(path):
    results = {}
    for name, (batch, heads, length, dim, mask, mod, table_dtype) in CASES.items():
        shape = (batch, length, heads, dim)
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
        table = jnp.asarray(rng.standard_normal((heads, 32 if mod != "clipped" else 129)),
                            table_dtype)
        score_mod = {
            "t5": lambda t: pf.scores.t5_relative_bias(t, bidirectional=False),
            "t5_bidirectional": lambda t: pf.scores.t5_relative_bias(t, bidirectional=True),
            "clipped": lambda t: (lambda s, b, h, q_idx, kv_idx:
                                  s + t[h, jnp.clip(kv_idx - q_idx, -64, 64) + 64]),
        }[mod]
        mask_mod = pf.masks.causal_mask if mask == "causal" else None

        def attend(q, k, v, table, with_mod=True):
            return pf.attention(q, k, v, mask_mod=mask_mod,
                                score_mod=score_mod(table) if with_mod else None)
        args = (q, k, v, table)
        calls = {"dense": (compiled(attend, args, True), args),
                 "dense_then_runs": (compiled(attend, args, True, sides=False), args),
                 "runs": (compiled(attend, args, False), args),
                 "no_mod": (compiled(lambda *a: attend(*a, with_mod=False), args, True), args)}
        outs = {}
        for arm, (fn, a) in calls.items():
            started = time.perf_counter()
            outs[arm] = jax.block_until_ready(fn(*a))
            for _ in range(3):
                jax.block_until_ready(fn(*a))
            print(f"  {name} {arm}: four calls in {time.perf_counter() - started:.2f} s",
                  flush=True)
        diff = float(jnp.max(jnp.abs(outs["dense"].astype(jnp.float32)
                                     - outs["runs"].astype(jnp.float32))))
        timed = time_paired(calls, rounds=7)
        results[name] = {"ms": {arm: entry["ms"] for arm, entry in timed.items()},
                         "max_abs_dense_minus_runs": diff}
        print(name, results[name], flush=True)
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
