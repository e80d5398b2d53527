"""Probe (temporary): the ragged op's device time per kernel, plain / rotated in the cache
/ rotated in the key reads, from profiler traces (the bench's wall times on one H100
host were bound elsewhere).

    PYTHONPATH=$PWD python3 -m benchmarks.ragged_rotation_probe OUT [case names]
    python3 -m benchmarks.ragged_rotation_probe --parse OUT   (here, on the fetched files)

Delete `OUT/trace/**/*.pb` on the device before the files come back (the JSON traces
are enough). Once the device times are known, write them in docs/gpu-notes.md (Paged
and ragged), commit `bench ragged` if its wall times agree, and delete this probe."""
import collections
import glob
import gzip
import json
import sys

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex.bench import machine_state
from pallas_flex.bench.jax_suites import RAGGED_MIXES, ragged_inputs
from pallas_flex.bench.timing import time_calls
from pallas_flex.kernels import rotate_blocks

BACKEND = "pallas"


def main():
    out_dir = sys.argv[1]
    heads, dim, block = (32, 8), 128, 16
    results = {"machine_before": machine_state.snapshot()}
    names = sys.argv[2:] or list(RAGGED_MIXES)
    for name, seqs in ((n, RAGGED_MIXES[n]) for n in names):
        others, caches, rotation = ragged_inputs(seqs, heads, dim, block)
        for column, extra in (("kernel", {}), ("in_cache", rotation),
                              ("in_reads", dict(rotation, rotation_in_cache=False)),
                              ("in_reads_reduced_flag", dict(rotation, rotation_in_cache=False))):
            # A/B of rotate_blocks.FLAG_FROM_ENTRY_COUNTS (read at trace time).
            rotate_blocks.FLAG_FROM_ENTRY_COUNTS = column != "in_reads_reduced_flag"
            jax.clear_caches()  # inner jits are keyed on the arguments, not the switch
            with pf.paged.traced_checks(False):
                step = jax.jit(lambda others, kc, vc, extra=extra: pf.paged.paged_attention(
                    **others, **extra, key_cache=kc, value_cache=vc, backend=BACKEND),
                    donate_argnums=(1, 2))
                current = [jnp.copy(c) for c in caches]  # donated and fed back

                def call(others):
                    out, current[0], current[1] = step(others, *current)
                    return out
                entry, _ = time_calls(call, (others,))
            results[f"{name} {column}"] = entry["ms"]
            print(name, column, entry["ms"], flush=True)
    results["machine_after"] = machine_state.snapshot()
    json.dump(results, open(f"{out_dir}/wall.json", "w"), indent=1)


def parse(out_dir, calls=10):
    """Prints each traced column's device time a call, by kernel, from the GPU streams."""
    for folder in sorted(glob.glob(f"{out_dir}/trace/*")):
        files = glob.glob(f"{folder}/plugins/profile/*/*.trace.json.gz")
        if not files:
            continue
        trace = json.load(gzip.open(files[0]))
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
        sums, total = collections.Counter(), 0.0
        for e in events:
            if e.get("ph") != "X":
                continue
            thread = names.get((e["pid"], e["tid"]), "")
            if "stream" not in thread.lower():
                continue
            sums[e["name"][:60]] += e["dur"]
            total += e["dur"]
        print(folder.split("/")[-1], f"device {total / calls / 1000:.4f} ms a call")
        for name, us in sums.most_common(6):
            print(f"    {us / calls / 1000:.4f}  {name}")


if __name__ == "__main__":
    if sys.argv[1] == "--parse":
        parse(sys.argv[2])
    else:
        main()
