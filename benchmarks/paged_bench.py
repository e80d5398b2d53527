"""Paged vs contiguous: the same FlexAttention call reading K/V from pages (shuffled in
memory) or from contiguous arrays, on the H100.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.paged_bench [--out results.json]
Rows: decode (Sq 1, B8, S16384, Hq 32, Hkv 8, D 128, bf16, causal at the last position)
and prefill (Sq 2048 new tokens after 6144 cached, B4, Hq 16, Hkv 16, causal) at page
sizes 16, 64, 128. Timed in paired rounds: each round times every layout once (`--iters`
calls), so the H100's clock drift over a run (several percent) cancels; `ms` is the median
over rounds and `overhead` the median over rounds of paged ms / contiguous ms - 1.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from benchmarks.jax_bench import paired_overhead, time_paired, write_rows
from pallas_flex import masks
from pallas_flex.paged.cache import PagedKVCache
from pallas_flex.paged.flex_attention import paged_flex_attention


def paged_copy(k, v, page_size, seed=0):
    """A PagedKVCache holding k/v [B, S, H, D] in randomly shuffled pages."""
    batch, length, heads, dim = k.shape
    pages_per_row = length // page_size
    num_pages = batch * pages_per_row
    order = np.random.default_rng(seed).permutation(num_pages)
    page_table = jnp.asarray(order.reshape(batch, pages_per_row), jnp.int32)

    def to_pages(x):
        pages = x.reshape(batch * pages_per_row, page_size, heads, x.shape[3]).transpose(0, 2, 1, 3)
        return jnp.zeros_like(pages).at[page_table.reshape(-1)].set(pages)

    owner = jnp.zeros((num_pages,), jnp.int32).at[page_table.reshape(-1)].set(
        jnp.repeat(jnp.arange(batch, dtype=jnp.int32), pages_per_row))
    return PagedKVCache(k_pages=to_pages(k), v_pages=to_pages(v), page_table=page_table,
                        lengths=jnp.full((batch,), length, jnp.int32), page_owner=owner)


def paged_call(q, cache, block_mask, *, options):
    return paged_flex_attention(q, cache, block_mask=block_mask, kernel_options=options)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--kernel-options", default="{}", help="JSON dict for both layouts")
    parser.add_argument("--cases", default="decode,prefill")
    parser.add_argument("--page-sizes", default="16,64,128")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--paged-options", default="",
                        help="';'-separated JSON dicts over --kernel-options for the paged "
                             "call only (the contiguous baseline keeps --kernel-options)")
    parser.add_argument("--short-by", type=int, default=0,
                        help="rows of the paged cache hold this many fewer tokens than the "
                             "contiguous K/V (a length inside a tile, as in serving; the "
                             "max|diff| column then compares different calls)")
    args = parser.parse_args()
    options = json.loads(args.kernel_options)
    paged_option_sets = [dict(options, **json.loads(text))
                         for text in args.paged_options.split(";") if text] or [options]
    rows = []
    for name, batch, q_len, length, q_heads, kv_heads in (
            ("decode", 8, 1, 16384, 32, 8), ("prefill", 4, 2048, 8192, 16, 16)):
        if name not in args.cases.split(","):
            continue
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (batch, q_len, q_heads, 128), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, length, kv_heads, 128), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, length, kv_heads, 128), jnp.bfloat16)
        mask_mod = masks.offset(masks.causal_mask, length - q_len)
        block_mask = pf.create_block_mask(mask_mod, None, None, q_len, length)
        contiguous = jax.jit(lambda q, k, v, bm: pf.flex_attention(q, k, v, block_mask=bm,
                                                                       kernel_options=options))
        out_contiguous = contiguous(q, k, v, block_mask).astype(jnp.float32)
        layouts = [("contiguous", options, contiguous, (q, k, v, block_mask), None)]
        for page_size, paged_options in itertools.product(
                [int(p) for p in args.page_sizes.split(",")], paged_option_sets):
            cache = paged_copy(k, v, page_size)
            cache = dataclasses.replace(cache, lengths=cache.lengths - args.short_by)
            paged = jax.jit(functools.partial(paged_call, options=paged_options))
            max_diff = float(jnp.max(jnp.abs(
                paged(q, cache, block_mask).astype(jnp.float32) - out_contiguous)))
            layouts.append((f"paged{page_size}", paged_options, paged, (q, cache, block_mask),
                            max_diff))
        times = time_paired({layout[0]: layout[2:4] for layout in layouts},
                            rounds=args.rounds, iters=args.iters)
        for layout, layout_options, _, _, max_diff in layouts:
            layout_times = times[layout]
            row = dict(case=name, layout=layout, ms=statistics.median(layout_times),
                       min_ms=min(layout_times), rounds_ms=layout_times,
                       kernel_options=layout_options)
            if max_diff is not None:
                row.update(overhead=paired_overhead(layout_times, times["contiguous"]),
                           max_abs_diff=max_diff)
                print(f"{name} {layout} {layout_options} {row['ms']:.4f} ms overhead "
                      f"{100 * row['overhead']:+.1f}% max|diff| {max_diff:.2e}", flush=True)
            else:
                print(f"{name} contiguous {row['ms']:.4f} ms", flush=True)
            rows.append(row)
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
