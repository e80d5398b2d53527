"""`make demo` / `pallas-flex demo`: the mods gallery, end to end.

For each variant: build its BlockMask, show its sparsity and block picture, run attention
on the best backend for this machine, check it against the dense reference, and print a
table (variant, sparsity, max abs error, time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels.reference import reference_attention


def gallery(batch: int, heads: int, length: int):
    """name -> (mask_mod or None, score_mod or None), at this sequence length."""
    document_ids = jnp.asarray((np.arange(length) * 6) // length, jnp.int32)
    side = int(np.sqrt(length))
    return {
        "noop": (None, None),
        "causal": (masks.causal_mask, None),
        "sliding_window": (masks.sliding_window(length // 8), None),
        "prefix_lm": (masks.prefix_lm(length // 4), None),
        "document": (masks.document_mask(document_ids), None),
        "document(causal)": (masks.document(masks.causal_mask, document_ids), None),
        "dilated_sliding_window": (masks.dilated_sliding_window(length // 4, 2), None),
        "chunked_causal": (masks.chunked_causal(length // 4), None),
        "neighborhood_2d": (masks.neighborhood_2d(side, length // side, 7, 7), None),
        "alibi (causal)": (masks.causal_mask, masks.alibi(heads)),
        "softcap 30 (causal)": (masks.causal_mask, masks.tanh_softcap(30.0)),
        "t5 bias": (None, masks.t5_relative_bias(
            0.1 * jax.random.normal(jax.random.PRNGKey(7), (heads, 32)))),
    }


def _time_ms(function, repeats=5):
    jax.block_until_ready(function())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="pallas-flex demo", description=__doc__)
    parser.add_argument("--length", type=int, help="sequence length (default: 4096 on GPU, "
                        "512 on CPU)")
    parser.add_argument("--no-pictures", action="store_true", help="skip the block pictures")
    args = parser.parse_args(argv)

    backend = pf.default_backend()
    on_gpu = backend == "pallas"
    batch, heads, head_dim = (2, 8, 128) if on_gpu else (1, 2, 64)
    length = args.length or (4096 if on_gpu else 512)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    device = jax.devices()[0].device_kind
    print(f"pallas_flex demo on {device}: backend {backend!r}"
          + ("" if on_gpu else " (no GPU here: the XLA blockwise path; Pallas kernels run on "
             "a CUDA GPU)"))
    print(f"B={batch} H={heads} S={length} D={head_dim} {jnp.dtype(dtype).name}\n")

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.float32).astype(dtype)
               for key in keys)
    rows = []
    for name, (mask_mod, score_mod) in gallery(batch, heads, length).items():
        block_mask = pf.create_block_mask(mask_mod, None, None, length, length)
        if not args.no_pictures:
            print(f"{name}:\n{block_mask.to_string(grid_size=16, limit=1)}\n")
        run = jax.jit(lambda q, k, v, bm, score_mod=score_mod: pf.flex_attention(
            q, k, v, score_mod, bm, backend=backend))
        milliseconds = _time_ms(lambda: run(q, k, v, block_mask))
        out = run(q, k, v, block_mask)
        expected, _ = reference_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
        error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected)))
        rows.append((name, block_mask.sparsity(), error, milliseconds))

    print(f"{'variant':24s} {'sparsity %':>10s} {'max abs err':>12s} {'time ms':>9s}")
    for name, sparsity, error, milliseconds in rows:
        print(f"{name:24s} {sparsity:10.1f} {error:12.2e} {milliseconds:9.3f}")
    tolerance = 5e-2 if dtype == jnp.bfloat16 else 1e-4
    worst = max(row[2] for row in rows)
    print(f"\nall variants within {tolerance:g} of the dense reference: {worst <= tolerance}")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
