"""What training costs beyond plain attention: captured-array gradients and compile time.

    PYTHONPATH=$PWD python3 -m benchmarks.training_bench [--part gradients|compile|all]
        [--out benchmarks/results/<date>-<device>-training.json]

* `gradients`: forward+backward at B4 H16 S4096 D128 bf16 causal with a T5 table
  [H, 32] and with ALiBi slopes [H], each timed with its array's gradient and without
  (the array a constant), in paired rounds (every round times every call once); also
  the gradient with `backward_deterministic`. The overhead is the median of the
  per-round ratios.
* `compile`: the first-call time (trace, lower, compile, one run) of the forward,
  forward+backward and decode of one new shape per dtype and head dim, B1 H8 S1024
  causal (decode: one query token on 1024 keys), each in a fresh jit cache.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp

import pallas_flex as pf
from benchmarks.jax_bench import environment, paired_overhead, time_paired


def _inputs(shape, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys]


def gradient_rows(rounds: int, iters: int) -> list[dict]:
    batch, seq_len, heads, head_dim = 4, 4096, 16, 128
    q, k, v, d_out = _inputs((batch, seq_len, heads, head_dim), jnp.bfloat16)
    block_mask = pf.create_block_mask(pf.masks.causal_mask, None, None, seq_len, seq_len)
    parameters = {"t5": jax.random.normal(jax.random.PRNGKey(5), (heads, 32)) * 0.1,
                  "alibi": pf.masks.alibi_slopes(heads)}
    score_mods = {"t5": lambda table: pf.masks.t5_relative_bias(table, bidirectional=False),
                  "alibi": pf.masks.alibi}

    def step(kind, with_parameter_gradient, options=None):
        def loss(parameter, q, k, v):
            out = pf.flex_attention(q, k, v, score_mods[kind](parameter), block_mask,
                                    kernel_options=options)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
        argnums = (0, 1, 2, 3) if with_parameter_gradient else (1, 2, 3)
        return jax.jit(jax.grad(loss, argnums=argnums))

    rows = []
    for kind, parameter in parameters.items():
        calls = {
            "without": (step(kind, False), (parameter, q, k, v)),
            "with": (step(kind, True), (parameter, q, k, v)),
            "deterministic": (step(kind, True, {"backward_deterministic": True}),
                              (parameter, q, k, v)),
        }
        times = time_paired(calls, rounds=rounds, iters=iters)
        row = {"case": f"{kind} B{batch} H{heads} S{seq_len} D{head_dim} bf16 causal fwd+bwd",
               "ms_without_gradient": min(times["without"]),
               "ms_with_gradient": min(times["with"]),
               "ms_deterministic": min(times["deterministic"]),
               "overhead": paired_overhead(times["with"], times["without"]),
               "deterministic_overhead": paired_overhead(times["deterministic"],
                                                         times["without"]),
               "rounds_ms": times}
        print(f"{row['case']}: without {row['ms_without_gradient']:.3f} ms, with "
              f"{row['ms_with_gradient']:.3f} ms ({row['overhead']:+.1%}), deterministic "
              f"{row['ms_deterministic']:.3f} ms ({row['deterministic_overhead']:+.1%})",
              flush=True)
        rows.append(row)
    return rows


def _first_call_seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def compile_rows(head_dims=(64, 128, 256)) -> list[dict]:
    """First-call seconds per dtype and head dim, and each dtype's ratio to bfloat16's
    (issue 15 asks for every ratio within 2). A warm-up call first, so that the first row
    does not pay for the process's first jit."""
    _first_call_seconds(jax.jit(lambda x: x + 1), jnp.zeros((8,)))
    rows = []
    for head_dim in head_dims:
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            seq_len, heads = 1024 + head_dim, 8  # a new shape per row
            q, k, v, d_out = _inputs((1, seq_len, heads, head_dim), dtype)

            def forward(q, k, v):
                return pf.attention(q, k, v, mask_mod=pf.masks.causal_mask)

            def loss(q, k, v):
                return jnp.sum(forward(q, k, v).astype(jnp.float32)
                               * d_out.astype(jnp.float32))

            row = {"dtype": jnp.dtype(dtype).name, "head_dim": head_dim,
                   "forward_s": _first_call_seconds(jax.jit(forward), q, k, v),
                   "forward_backward_s": _first_call_seconds(
                       jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v),
                   "decode_s": _first_call_seconds(
                       jax.jit(lambda q, k, v: pf.attention(q, k, v)), q[:, :1], k, v)}
            bfloat16_row = next((earlier for earlier in rows if earlier["head_dim"] == head_dim
                                 and earlier["dtype"] == "bfloat16"), row)
            for name in ("forward_s", "forward_backward_s", "decode_s"):
                row[name.replace("_s", "_vs_bfloat16")] = row[name] / bfloat16_row[name]
            print(row, flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="all", choices=["gradients", "compile", "all"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = {"environment": environment(),
              "date": datetime.date.today().isoformat()}
    if args.part in ("compile", "all"):
        result["compile"] = compile_rows()
    if args.part in ("gradients", "all"):
        result["gradients"] = gradient_rows(args.rounds, args.iters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
