"""Where the cascade decode step's time goes (decode_bench's cascade row: 16 requests
sharing a 4096-token prefix, 256-token suffixes, Hq 32 Hkv 8 D 128 bf16): the whole
`pf.cascade_attention`, its prefix part (the 16 queries folded into one query block over
the prefix), its suffix part, and the concatenated baseline, per `--kernel-options` set.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_cascade [--options '{};{"decode_num_splits": 8}']
  [--steps 0]
  --steps N: also time each call as N dependent steps inside one jitted `lax.scan` (each
  step's query takes a zero multiple of the previous output), so that Python's dispatch
  is paid once per N steps: the device's time per step.
"""
import argparse
import json

import jax
import jax.numpy as jnp

import pallas_flex as pf
from jax import lax

from benchmarks.tune_forward import time_ms


def scanned(fn, steps):
    """fn(q, *rest) -> out (or (out, lse)) run `steps` times in one jitted scan, each
    step's q depending on the previous out, so that no step can be skipped or reordered."""
    def run(q, *rest):
        def step(q, _):
            out = fn(q, *rest)
            out = out[0] if isinstance(out, tuple) else out
            return q + (out * 0).astype(q.dtype), None
        return lax.scan(step, q, None, length=steps)[0]
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--options", default="{}")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    batch, prefix_len, suffix_len, q_heads, kv_heads, dim = 16, 4096, 256, 32, 8, 128
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
    q = normal(keys[0], (batch, 1, q_heads, dim))
    prefix_k, prefix_v = (normal(key, (1, prefix_len, kv_heads, dim)) for key in keys[1:3])
    suffix_k, suffix_v = (normal(key, (batch, suffix_len, kv_heads, dim)) for key in keys[3:])
    whole_k = jnp.concatenate([jnp.broadcast_to(prefix_k, (batch,) + prefix_k.shape[1:]),
                               suffix_k], axis=1)
    whole_v = jnp.concatenate([jnp.broadcast_to(prefix_v, (batch,) + prefix_v.shape[1:]),
                               suffix_v], axis=1)
    folded_q = q.reshape(1, batch, q_heads, dim)
    rows = []
    for text in args.options.split(";"):
        options = json.loads(text)
        calls = {
            "cascade": (lambda q, pk, pv, sk, sv: pf.cascade_attention(
                q, pk, pv, sk, sv, kernel_options=options),
                (q, prefix_k, prefix_v, suffix_k, suffix_v)),
            "prefix_part": (lambda q, k, v: pf.attention(q, k, v, return_lse=True,
                                                         kernel_options=options),
                            (folded_q, prefix_k, prefix_v)),
            "suffix_part": (lambda q, k, v: pf.attention(q, k, v, return_lse=True,
                                                         kernel_options=options),
                            (q, suffix_k, suffix_v)),
            "concatenated": (lambda q, k, v: pf.attention(q, k, v, kernel_options=options),
                             (q, whole_k, whole_v)),
        }
        row = dict(options=options)
        for name, (fn, fn_args) in calls.items():
            row[f"{name}_ms"] = time_ms(jax.jit(fn), *fn_args)
            if args.steps:
                row[f"{name}_scanned_ms_per_step"] = time_ms(
                    jax.jit(scanned(fn, args.steps)), *fn_args) / args.steps
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
