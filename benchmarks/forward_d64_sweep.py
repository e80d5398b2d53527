"""Sweep of the Mosaic forward's D 64 settings on the H200 (issue 16: D 64 noop and
prefix-LM are 1.09x / 1.08x torch FlexAttention there, the bar 1.1x). Delete after
recording the winner where the constant is defined (forward_mosaic.py).

    PYTHONPATH=$PWD python3 -m benchmarks.forward_d64_sweep          # on the GPU
    python -m benchmarks.forward_d64_sweep --lower                   # CUDA lowering, CPU

B8 H16 S2048 D64 bf16 forward (noop, causal, prefix-LM 1024): the defaults against K/V
stages 3 and 5 (`forward_mosaic._STAGES[64]`, 4) and 4 / 16 items a program where rows
are equal (`_ITEMS_PER_PROGRAM_EQUAL_ROWS_D64`, 8) or 4 where they are not
(`_ITEMS_PER_PROGRAM`, 2), each AOT-compiled after `jax.clear_caches()`, timed in paired
rounds (ms, and the ratio to the defaults)."""
import sys

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex.bench.timing import time_paired
from pallas_flex.kernels import device, forward_mosaic

MASKS = {"noop": None, "causal": pf.masks.causal_mask,
         "prefix_lm_1024": lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < 1024)}
# (name, module constant, value)
VARIANTS = [("default", None, None),
            ("stages_3", "_STAGES", {**forward_mosaic._STAGES, 64: 3}),
            ("stages_5", "_STAGES", {**forward_mosaic._STAGES, 64: 5}),
            ("equal_rows_items_4", "_ITEMS_PER_PROGRAM_EQUAL_ROWS_D64", 4),
            ("equal_rows_items_16", "_ITEMS_PER_PROGRAM_EQUAL_ROWS_D64", 16),
            ("items_4", "_ITEMS_PER_PROGRAM", 4)]


def _call(mask_mod):
    def attend(q, k, v):
        return pf.attention(q, k, v, mask_mod=mask_mod, backend="pallas")
    return attend


def _compile(variant, mask_mod, args, lower_only):
    _, name, value = variant
    saved = getattr(forward_mosaic, name) if name else None
    try:
        if name:
            setattr(forward_mosaic, name, value)
        jax.clear_caches()
        traced = jax.jit(_call(mask_mod)).trace(*args)
        if lower_only:  # (inside `lowering_for_gpu`)
            return traced.lower(lowering_platforms=("cuda",))
        return traced.lower().compile()
    finally:
        if name:
            setattr(forward_mosaic, name, saved)


def main(lower_only=False):
    if lower_only:
        device.compute_capability = lambda: (9, 0)
        args = [jax.ShapeDtypeStruct((8, 2048, 16, 64), jnp.bfloat16)] * 3
    else:
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        args = [jax.random.normal(key, (8, 2048, 16, 64), jnp.bfloat16) for key in keys]
    for mask_name, mask_mod in MASKS.items():
        if lower_only:
            with pf.api.lowering_for_gpu():
                for variant in VARIANTS:
                    _compile(variant, mask_mod, args, True)
            print(f"{mask_name}: every variant lowered", flush=True)
            continue
        executables = {variant[0]: _compile(variant, mask_mod, args, False)
                       for variant in VARIANTS}
        ms = {name: entry["ms"] for name, entry in time_paired(
            {name: (run, args) for name, run in executables.items()}, rounds=7).items()}
        print(f"B8 H16 S2048 D64 {mask_name} forward ms: " + ", ".join(
            f"{name} {value:.4f} ({value / ms['default']:.3f}x)" for name, value in ms.items()),
            flush=True)


if __name__ == "__main__":
    main(lower_only="--lower" in sys.argv[1:])
