"""Corrupt page tables under compute-sanitizer: no kernel reads outside the page pool.

Runs the kernels that read a paged cache — paged decode (Triton), paged prefill
(Triton and Mosaic GPU, 16- and 128-row pages) and the ragged op — with page-table
entries far past the pool (999 with 16 pages) and negative ones, inside `jax.jit`
(where the wrappers' checks are checkify debug checks and do not stop the call). The
kernels clamp every entry into the pool (`kernels/kv_tiles.in_pool`), so the results are
unspecified but finite, and no load leaves the pool. On the GPU machine:

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
        python3 tests/gpu/sanitize_paged_kernels.py

(`platform` gives each array its own allocation, so a read past the pages is a read
past an allocation, which memcheck reports; under XLA's default pool allocator it would
land in a neighbouring buffer unseen). `--unclamped` replaces the clamp with the
earlier `max(entry, 0)` of the Triton kernels, to see the sanitizer catch the reads it
guards against. Prints one line per call and exits 1 if an output is not finite.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels import forward_mosaic, kv_tiles
from pallas_flex.paged.cache import PagedKVCache
from pallas_flex.paged.ragged import paged_attention

NUM_PAGES, HEADS, DIM = 16, 2, 64


def corrupt_cache(page_size: int) -> PagedKVCache:
    """Two rows of 3 * page_size - 5 tokens whose tables point past the pool (999) and
    below it (-7)."""
    pages_per_row = 4
    cache = PagedKVCache.create(num_pages=NUM_PAGES, page_size=page_size, max_batch=2,
                                max_pages_per_seq=pages_per_row, kv_heads=HEADS,
                                head_dim=DIM, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    length = 3 * page_size - 5
    for row in range(2):
        cache = cache.reserve(row, length)
        cache = cache.assign(row, 0, jnp.asarray(rng.normal(size=(length, HEADS, DIM)), jnp.bfloat16),
                             jnp.asarray(rng.normal(size=(length, HEADS, DIM)), jnp.bfloat16))
    table = np.asarray(cache.page_table).copy()
    table[0, 1], table[1, 2] = 999, -7
    return PagedKVCache(cache.k_pages, cache.v_pages, jnp.asarray(table), cache.lengths,
                        cache.page_owner)


def paged_call(cache, q_len: int, forward_kernel: str):
    q = jnp.ones((2, q_len, 2 * HEADS, DIM), jnp.bfloat16)
    positions = cache.lengths - q_len
    return jax.jit(lambda q, cache: pf.paged.paged_flex_attention(
        q, cache, mask_mod=masks.offset(masks.causal_mask, positions),
        kernel_options={"forward_kernel": forward_kernel}))(q, cache)


def ragged_call():
    block_size, tokens = 16, 20
    rng = np.random.default_rng(1)
    query = jnp.asarray(rng.normal(size=(tokens, 2 * HEADS * DIM)), jnp.bfloat16)
    key = jnp.asarray(rng.normal(size=(tokens, HEADS * DIM)), jnp.bfloat16)
    caches = jnp.zeros((NUM_PAGES, HEADS, block_size, DIM), jnp.bfloat16)
    # Sequence 0: 8 new tokens after 30; sequence 1: 12 after 0. Entries 999 and -7.
    block_indices = jnp.array([0, 999, 2, -7], jnp.int32)
    call = jax.jit(lambda *args: paged_attention(*args)[0])
    return call(query, key, key, caches, caches, jnp.array([30, 0]), jnp.array([0, 8, 20]),
                block_indices, jnp.array([0, 3, 4]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--unclamped", action="store_true")
    args = parser.parse_args(argv)
    if args.unclamped:
        kv_tiles.in_pool = forward_mosaic.in_pool = lambda page, num_pages: jnp.maximum(page, 0)
    calls = {}
    for page_size in (16, 128):
        cache = corrupt_cache(page_size)
        calls[f"paged decode, {page_size}-row pages"] = lambda c=cache: paged_call(c, 1, "auto")
        calls[f"paged prefill triton, {page_size}-row pages"] = (
            lambda c=cache: paged_call(c, 32, "triton"))
        calls[f"paged prefill mosaic, {page_size}-row pages"] = (
            lambda c=cache: paged_call(c, 32, "mosaic"))
    calls["ragged op, 16-row blocks"] = ragged_call
    failed = False
    for name, call in calls.items():
        out = np.asarray(jax.block_until_ready(call()), np.float32)
        finite = bool(np.isfinite(out).all())
        failed |= not finite
        print(f"{name}: output {out.shape}, finite {finite}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
