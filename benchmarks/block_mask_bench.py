"""Times building a document BlockMask (causal within 12 packed documents, block 128).

`pallas_flex.create_block_mask` (jit-compiled, evaluated on device one row of q blocks
at a time) against `torch.nn.attention.flex_attention.create_block_mask` (compiled) on
the same GPU, at 16k, 64k and 128k tokens. Each framework runs in its own subprocess.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.block_mask_bench [--out file.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

LENGTHS = (16384, 65536, 131072)
NUM_DOCUMENTS = 12


def document_ids(length: int) -> np.ndarray:
    return ((np.arange(length, dtype=np.int64) * NUM_DOCUMENTS) // length).astype(np.int32)


def _median_seconds(build, synchronize, repeats=5):
    build()
    synchronize(build())  # compile and warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        synchronize(build())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_jax():
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf

    rows = []
    for length in LENGTHS:
        ids = jnp.asarray(document_ids(length))

        def build(ids=ids, length=length):
            mask_mod = pf.and_masks(pf.masks.causal_mask, pf.masks.document_mask(ids))
            return pf.create_block_mask(mask_mod, None, None, length, length)

        seconds = _median_seconds(build, lambda bm: jax.block_until_ready(bm.kv_indices))
        sparsity = build().sparsity()
        rows.append(dict(framework="pallas_flex", length=length, ms=seconds * 1e3,
                         sparsity=sparsity))
    return rows


def run_torch():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)
    rows = []
    for length in LENGTHS:
        ids = torch.from_numpy(document_ids(length)).cuda()

        def mask_mod(b, h, q_idx, kv_idx, ids=ids):
            return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

        def build(length=length, mask_mod=mask_mod):
            return compiled_create_block_mask(mask_mod, None, None, length, length,
                                              device="cuda")
        try:
            seconds = _median_seconds(build, lambda bm: torch.cuda.synchronize())
            rows.append(dict(framework="torch", length=length, ms=seconds * 1e3,
                             sparsity=float(build().sparsity())))
        except Exception as error:  # e.g. out of memory at 128k
            rows.append(dict(framework="torch", length=length, error=repr(error)[:300]))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["jax", "torch"])
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per framework")
    args = parser.parse_args()
    if args.framework:
        rows = run_jax() if args.framework == "jax" else run_torch()
        print("ROWS " + json.dumps(rows))
        return
    rows = []
    for framework in ("jax", "torch"):
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        try:
            result = subprocess.run([sys.executable, "-m", "benchmarks.block_mask_bench",
                                     "--framework", framework], capture_output=True,
                                    text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{framework}: no result within {args.timeout} s")
            continue
        lines = [line for line in result.stdout.splitlines() if line.startswith("ROWS ")]
        if not lines:
            print(f"{framework} failed:\n{result.stderr[-2000:]}")
            continue
        rows += json.loads(lines[-1][5:])
    print(f"{'framework':12s} {'length':>7s} {'ms':>9s} {'sparsity %':>10s}")
    for row in rows:
        if "error" in row:
            print(f"{row['framework']:12s} {row['length']:7d} error: {row['error']}")
        else:
            print(f"{row['framework']:12s} {row['length']:7d} {row['ms']:9.2f} {row['sparsity']:10.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(mask="causal document mask, 12 documents, block 128", rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
