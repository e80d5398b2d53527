"""Probe: a T5 table's gradient with its dumped tiles reduce-added in the dK/dV kernel
(`backward_mosaic.REDUCED_DUMPS`) against the per-tile dumps (the default) and the call
without the table's gradient: causal one-way T5 [Hq, 32], fwd+bwd, AOT-compiled arms in
paired rounds, the table gradients' largest difference from the default's.

    PYTHONPATH=$PWD python3 -m benchmarks.t5_gradient_ab OUT.json [shape names]

If `reduced` wins, make REDUCED_DUMPS the default (the GPU test of T5 tables then checks
bitwise repeats with `backward_deterministic` only), run the T5 GPU tests and
`pallas-flex bench captured_gradients`, and delete this probe.
"""
import json
import sys
import time

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex.bench import cases
from pallas_flex.bench.jax_suites import _grad_step
from pallas_flex.bench.timing import time_paired
from pallas_flex.kernels import backward_mosaic

# arm: (the table's gradient wanted, REDUCED_DUMPS)
ARMS = {"fixed": (False, False), "table": (True, False), "reduced": (True, True)}


def main():
    out_path = sys.argv[1]
    names = sys.argv[2:] or ["b4_s4096_d128", "b8_s2048_d64", "b1_s16384_d128",
                             "gqa_b4_s4096_d128"]
    results = {"device": jax.devices()[0].device_kind}
    for shape in [s for s in cases.ATTENTION_SHAPES if s.name in names]:
        q, k, v, d_out = (jnp.asarray(x, jnp.bfloat16) for x in cases.inputs(shape))
        table = jnp.asarray(cases.normal((shape.q_heads, 32), 4))
        block_mask = pf.create_block_mask(pf.masks.causal_mask, None, None,
                                          shape.seq_len, shape.seq_len)

        def attend(q, k, v, table, block_mask):
            return pf.flex_attention(q, k, v, pf.scores.t5_relative_bias(
                table, bidirectional=False), block_mask)

        args = (q, k, v, table, block_mask, d_out)
        entry, calls, grads = {}, {}, {}
        start = time.perf_counter()
        for arm, (with_table, reduced) in ARMS.items():
            backward_mosaic.REDUCED_DUMPS = reduced
            jax.clear_caches()
            try:
                step = _grad_step(attend, "fwd_bwd", (0, 1, 2, 3) if with_table else (0, 1, 2))
                compiled = step.lower(*args).compile()
                result = jax.block_until_ready(compiled(*args))
            except Exception as error:  # noqa: BLE001 - the probe records it
                entry[arm] = repr(error)[:2000]
                continue
            calls[arm] = (compiled, args)
            if with_table:
                grads[arm] = result[4]
        backward_mosaic.REDUCED_DUMPS = False
        entry["compile_s"] = time.perf_counter() - start
        if len(grads) == 2:
            scale = float(jnp.max(jnp.abs(grads["table"])))
            entry["reduced_max_rel_diff"] = float(
                jnp.max(jnp.abs(grads["reduced"] - grads["table"]))) / scale
        timed = time_paired(calls, rounds=7, iters=20)
        entry.update({arm: timed[arm]["ms"] for arm in timed})
        print(shape.name, json.dumps(entry), flush=True)
        results[shape.name] = entry
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
