"""Probe: the query-rows fused backward at head dim 128 (`mosaic_eligibility.FUSE_DQ_AT_128`)
against the two kernels, fwd+bwd, AOT-compiled arms in paired rounds, cuDNN beside them.

    PYTHONPATH=$PWD python3 -m benchmarks.fused_dq_ab OUT.json [--quick]
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench.timing import time_paired
from pallas_flex.kernels import mosaic_eligibility

SHAPES = [  # name, B, Hq, Hkv, S
    ("b4_s4096", 4, 16, 16, 4096), ("b1_s16384", 1, 16, 16, 16384),
    ("gqa_b4_s4096", 4, 32, 8, 4096)]


def softcap(score, b, h, q, kv):
    return 30.0 * jnp.tanh(score / 30.0)


def alibi(score, b, h, q, kv):
    return score - (h + 1).astype(jnp.float32) * 0.05 * (q - kv).astype(jnp.float32)


VARIANTS = [("noop", None, None), ("causal", pf.masks.causal_mask, None),
            ("causal_softcap", pf.masks.causal_mask, softcap),
            ("causal_alibi", pf.masks.causal_mask, alibi)]


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    results = {"device": jax.devices()[0].device_kind, "rows": []}
    for name, b, hq, hkv, s in SHAPES:
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, s, hq, 128), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, s, hkv, 128), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, hkv, 128), jnp.bfloat16)
        d_out = jax.random.normal(keys[3], (b, s, hq, 128), jnp.bfloat16)
        for variant, mask_mod, score_mod in VARIANTS:
            if variant.startswith("causal_") and name != "b4_s4096":
                continue
            block_mask = pf.create_block_mask(mask_mod or pf.masks.noop_mask, None, None, s, s)

            def step(q, k, v, d_out, block_mask):
                out, pullback = jax.vjp(
                    lambda q, k, v: pf.flex_attention(q, k, v, score_mod, block_mask), q, k, v)
                return (out, *pullback(d_out))

            arms, grads = {}, {}
            for arm, fused in (("two_kernels", False), ("fused", True)):
                mosaic_eligibility.FUSE_DQ_AT_128 = fused
                jax.clear_caches()
                start = time.perf_counter()
                try:
                    compiled = jax.jit(step).lower(q, k, v, d_out, block_mask).compile()
                    result = jax.block_until_ready(compiled(q, k, v, d_out, block_mask))
                except Exception as error:  # noqa: BLE001 - the probe records it
                    print(name, variant, arm, "FAILED", repr(error)[:2000], flush=True)
                    continue
                print(name, variant, arm, f"compiled {time.perf_counter() - start:.1f} s",
                      flush=True)
                arms[arm] = (compiled, (q, k, v, d_out, block_mask))
                grads[arm] = result
            if mask_mod is None or (variant == "causal" and score_mod is None):
                is_causal = variant == "causal"

                def cudnn(q, k, v, d_out):
                    out, pullback = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                        q, k, v, is_causal=is_causal, implementation="cudnn"), q, k, v)
                    return (out, *pullback(d_out))
                arms["cudnn"] = (jax.jit(cudnn), (q, k, v, d_out))
            row = {"shape": name, "variant": variant}
            if len(grads) == 2:
                for label, x, y in zip(("out", "dq", "dk", "dv"), grads["two_kernels"],
                                       grads["fused"]):
                    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
                    row[f"max_diff_{label}"] = float(np.max(np.abs(x - y)))
                    row[f"max_abs_{label}"] = float(np.max(np.abs(x)))
            timed = time_paired(arms, rounds=3 if quick else 7, iters=10 if quick else 20)
            row.update({arm: entry["ms"] for arm, entry in timed.items()})
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
