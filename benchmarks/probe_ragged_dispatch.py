"""Where the ragged op's whole-call time goes: `pf.paged.paged_attention` under `jit` with
the caches donated and fed back (as `ragged_bench` and a server call it), on 64 decode
steps over 4096-token histories. Prints per-call times with a sync after every call
(what a Python loop waiting on each step sees: dispatch + launch + kernel + sync) next
to back-to-back calls synced once per 20 (the device's time per call), and lists the
compiled HLO's instructions on cache-sized buffers (a copy there would mean the
donation did not take). Both with the paged metadata checks traced in (the default:
`checkify.debug_check`s, which take a jitted call off JAX's fast dispatch path) and
inside `pallas_flex.paged.traced_checks(False)`.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_ragged_dispatch [--out f.json]
"""
import argparse
import json
import time

import jax
import numpy as np

from benchmarks.ragged_bench import MIXES, _donating_step, make_inputs
from pallas_flex import paged


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mix", default="decode_64x4096")
    parser.add_argument("--out")
    args = parser.parse_args()
    inputs = make_inputs(MIXES[args.mix])
    caches = {name: inputs[name] for name in ("key_cache", "value_cache")}
    others = {name: value for name, value in inputs.items() if name not in caches}
    step = jax.jit(lambda others, key_cache, value_cache: paged.paged_attention(
        **others, key_cache=key_cache, value_cache=value_cache, backend="pallas"),
        donate_argnums=(1, 2))
    hlo = step.lower(others, caches["key_cache"], caches["value_cache"]).compile().as_text()
    cache_shape = "bf16[%d,8,16,128]" % caches["key_cache"].shape[0]
    cache_lines = [line.strip()[:300] for line in hlo.splitlines()
                   if cache_shape in line and any(word in line for word in
                                                  ("copy", "scatter", "custom-call", "alias"))]
    results = {}
    for checks in (True, False):
        with paged.traced_checks(checks):
            call = _donating_step(inputs, "pallas")  # fresh caches for each variant
            jax.block_until_ready(call(None))
            dispatch, synced = [], []
            for _ in range(60):
                start = time.perf_counter()
                out = call(None)
                dispatch.append((time.perf_counter() - start) * 1e3)
                jax.block_until_ready(out)
                synced.append((time.perf_counter() - start) * 1e3)
            back_to_back = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(20):
                    out = call(None)
                jax.block_until_ready(out)
                back_to_back.append((time.perf_counter() - start) / 20 * 1e3)
        label = "traced_checks" if checks else "no_traced_checks"
        results[label] = dict(dispatch_ms=dispatch, synced_per_call_ms=synced,
                              back_to_back_ms=back_to_back)
        print(f"{label}: dispatch median {np.median(dispatch):.3f} ms; synced per call "
              f"median {np.median(synced):.3f} ms (min {min(synced):.3f}); back to back "
              f"{[round(t, 3) for t in back_to_back]} ms", flush=True)
    copies = [line for line in cache_lines if " copy(" in line or "copy-start" in line]
    print(f"copies of cache-sized buffers in the compiled step: {len(copies)}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           mix=args.mix, cache_sized_hlo=cache_lines, **results),
                      handle, indent=1)


if __name__ == "__main__":
    main()
