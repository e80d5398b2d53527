"""Device time by kernel of the 8-bit paged decode against the bf16 one (issue 20: int8
runs at 2.2 TB/s and float8 at 1.6 on the H200, not HBM-bound, not conversion-bound, not
the launch settings; is it the decode kernel, or what runs beside it each step?). Delete
after recording the answer in docs/gpu-notes.md (Decode).

    PYTHONPATH=$PWD python3 -m benchmarks.device_time          # on the GPU
    python -m benchmarks.device_time --quick                   # the parsing, on the CPU

B8 S16384 Hq 32 Hkv 8 D 128, pages of 64 and of 128 (a 128-row decode tile then lies in
one page: its K/V, scales and page-table entry are slices, not per-row gathers), 8
chained decode steps a call (as `bench quantized`), 5 calls under `jax.profiler.trace`:
per cache dtype, the device time a step of each kernel (the trace's events on the GPU's
streams, summed by name, divided by the steps) and their total, against the wall time a
step."""
import collections
import glob
import gzip
import json
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import pallas_flex as pf
from pallas_flex.bench.jax_suites import _shuffled_pages
from pallas_flex.paged.quantize import quantize

STEPS, CALLS = 8, 5


def device_time_by_kernel(fn, args, calls=CALLS):
    """{kernel name: ms summed over `calls` calls} from a profiler trace of fn(*args)
    (events of the processes named /device:..., the GPU's streams), and the wall ms."""
    jax.block_until_ready(fn(*args))
    directory = tempfile.mkdtemp()
    start = time.perf_counter()
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    wall_ms = (time.perf_counter() - start) * 1e3
    [path] = glob.glob(f"{directory}/**/perfetto_trace.json.gz", recursive=True)
    trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and processes.get(event.get("pid"), "").startswith(
                "/device:"):
            totals[event["name"]] += event.get("dur", 0) / 1e3
    return totals, wall_ms


def main(quick=False):
    batch, length, q_heads, kv_heads, dim = ((2, 1024, 8, 2, 64) if quick else
                                             (8, 16384, 32, 8, 128))
    backend = "xla" if quick else "pallas"
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, 1, q_heads, dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, length, kv_heads, dim), jnp.bfloat16)
            for key in keys[1:])
    block_mask = pf.create_block_mask(
        pf.masks.offset(pf.masks.causal_mask, jnp.full((batch,), length - 1)), batch, None,
        1, length)
    lengths = jnp.full((batch,), length, jnp.int32)

    @jax.jit
    def steps(q, cache, block_mask):
        out = q
        for _ in range(STEPS):
            out = pf.paged.paged_flex_attention(out, cache, block_mask=block_mask,
                                                backend=backend)
        return out

    for page in (64, 128):
        (k_pages, table, owner), (v_pages, _, _) = (_shuffled_pages(x, page) for x in (k, v))
        for name in ("bfloat16", "int8", "float8_e4m3fn"):
            if name == "bfloat16":
                cache = pf.paged.PagedKVCache(k_pages, v_pages, table, lengths, owner)
            else:
                (kq, ks), (vq, vs) = (quantize(x, jnp.dtype(name)) for x in (k_pages, v_pages))
                cache = pf.paged.PagedKVCache(kq, vq, table, lengths, owner, ks, vs)
            totals, wall_ms = device_time_by_kernel(steps, (q, cache, block_mask))
            per_step = CALLS * STEPS
            print(f"pages of {page}, {name}: wall {wall_ms / per_step:.4f} ms a step, "
                  f"device {sum(totals.values()) / per_step:.4f}", flush=True)
            for kernel, ms in totals.most_common(8):
                print(f"    {ms / per_step:.4f}  {kernel[:100]}", flush=True)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
