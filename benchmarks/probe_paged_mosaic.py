"""Paged prefill on the Mosaic forward against the same call on contiguous K/V, in one
process, paired: every round times each variant once (`--iters` calls), and the
overheads are the medians over rounds of each round's paged / contiguous ratio, so that
the H100's clock drift over a run (the contiguous call moves by up to 8 % from the first
round to the last) cancels. The prefill is `paged_bench`'s (2048 new tokens on 6144
cached, B4 H16 D128 bf16, causal).

Variants besides the paged calls: the contiguous call with the BlockMask clipping that
every paged prefill does inside its jit, and with the earlier clipping that rebuilt
every table from the block state (sorts and scatters), to show the clipping's share.

Usage: PYTHONPATH=$PWD python3 -m benchmarks.probe_paged_mosaic [--rounds 15] [--out f.json]
  [--page-sizes 16,64,128] [--copy-rows 0] [--head-dim 128] [--stages 0] [--one-warp]
  --one-warp: issue a tile's page copies from the whole memory warpgroup, one after
  another (forward_mosaic.SPREAD_PAGE_COPIES_OVER_WARPS off: the earlier form)
  --stages S: K/V tiles in flight in the Mosaic kernel (0 = its default for the head dim)
  --copy-rows R: split each TMA copy into copies of at most R rows (an experiment: is a
  small page's cost the number of copies, or where its rows lie?)
"""
import argparse
import json
import statistics

import jax
import jax.numpy as jnp

import pallas_flex as pf
from benchmarks.paged_bench import paged_copy
from benchmarks.jax_bench import paired_overhead, time_paired
from pallas_flex import masks
from pallas_flex.kernels import forward_mosaic
from pallas_flex.masks.block_mask import EMPTY, FULL, PARTIAL, BlockMask
from pallas_flex.paged.flex_attention import clip_block_mask_to_lengths, paged_flex_attention


def clip_by_block_state(block_mask, lengths):
    """The earlier clipping: the same tables rebuilt from the clipped block state."""
    state = block_mask.block_state()
    state = jnp.broadcast_to(state, (lengths.shape[0],) + state.shape[1:])
    block_kv = block_mask.block_size[1]
    starts = jnp.arange(state.shape[-1], dtype=jnp.int32) * block_kv
    length = lengths[:, None, None, None]
    state = jnp.where(starts >= length, EMPTY,
                      jnp.where((starts + block_kv > length) & (state == FULL), PARTIAL, state))
    return BlockMask.from_block_state(state.astype(jnp.int8), block_size=block_mask.block_size,
                                      seq_lengths=block_mask.shape[2:],
                                      mask_mod=block_mask.mask_mod)


def split_copies(rows_per_copy):
    """Makes the Mosaic kernel fill each K/V tile with copies of `rows_per_copy` rows."""
    tile_pages, copies_per_tile = forward_mosaic._tile_pages, forward_mosaic.copies_per_tile

    def split_tile_pages(page_table_ref, batch, block, page_size):
        rows = min(page_size, forward_mosaic.BLOCK)
        return [(page, first_row + offset)
                for page, first_row in tile_pages(page_table_ref, batch, block, page_size)
                for offset in range(0, rows, rows_per_copy)]

    def split_copy_pages(pages_ref, entries, kv_head, destination, barrier):
        for index, (page, first_row) in enumerate(entries):
            forward_mosaic.plgpu.copy_gmem_to_smem(
                pages_ref.at[page, kv_head, forward_mosaic.pl.ds(first_row, rows_per_copy)],
                destination.at[forward_mosaic.pl.ds(index * rows_per_copy, rows_per_copy)],
                barrier)

    forward_mosaic._tile_pages = split_tile_pages
    forward_mosaic._copy_pages = split_copy_pages
    forward_mosaic.copies_per_tile = lambda page_size: (
        copies_per_tile(page_size) * max(min(page_size, forward_mosaic.BLOCK) // rows_per_copy, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--page-sizes", default="16,64,128")
    parser.add_argument("--copy-rows", type=int, default=0)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--stages", type=int, default=0)
    parser.add_argument("--one-warp", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.one_warp:
        forward_mosaic.SPREAD_PAGE_COPIES_OVER_WARPS = False
    if args.copy_rows:
        split_copies(args.copy_rows)
    batch, q_len, length, heads, dim = 4, 2048, 8192, 16, args.head_dim
    if args.stages:
        forward_mosaic._STAGES[dim] = args.stages
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, q_len, heads, dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, length, heads, dim), jnp.bfloat16)
            for key in keys[1:])
    mask = masks.offset(masks.causal_mask, length - q_len)  # as paged_bench
    block_mask = pf.create_block_mask(mask, None, None, q_len, length)
    lengths = jnp.full((batch,), length, jnp.int32)
    contiguous = jax.jit(lambda q, k, v, bm: pf.flex_attention(q, k, v, block_mask=bm))
    clipped = jax.jit(lambda q, k, v, bm, lengths: pf.flex_attention(
        q, k, v, block_mask=clip_block_mask_to_lengths(bm, lengths)))
    clipped_by_state = jax.jit(lambda q, k, v, bm, lengths: pf.flex_attention(
        q, k, v, block_mask=clip_by_block_state(bm, lengths)))
    paged = jax.jit(lambda q, cache, bm: paged_flex_attention(q, cache, block_mask=bm))
    variants = {"contiguous": (contiguous, (q, k, v, block_mask)),
                "contiguous_with_clip": (clipped, (q, k, v, block_mask, lengths)),
                "contiguous_with_state_clip": (clipped_by_state, (q, k, v, block_mask, lengths))}
    reference = contiguous(q, k, v, block_mask).astype(jnp.float32)
    max_diff = {}
    for size in map(int, args.page_sizes.split(",")):
        cache = paged_copy(k, v, size)
        variants[f"page{size}"] = (paged, (q, cache, block_mask))
        max_diff[f"page{size}"] = float(jnp.max(jnp.abs(
            paged(q, cache, block_mask).astype(jnp.float32) - reference)))
    times = time_paired(variants, rounds=args.rounds, iters=args.iters)
    summary = {}
    for name, values in times.items():
        summary[name] = dict(median_ms=statistics.median(values), min_ms=min(values),
                             median_paired_overhead=paired_overhead(values,
                                                                    times["contiguous"]),
                             max_abs_diff=max_diff.get(name))
        print(f"{name:28s} median {summary[name]['median_ms']:.4f} ms  min "
              f"{summary[name]['min_ms']:.4f}  paired overhead "
              f"{100 * summary[name]['median_paired_overhead']:+.2f} %", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           rounds=args.rounds, iters=args.iters, copy_rows=args.copy_rows,
                           head_dim=dim, spread_over_warps=not args.one_warp,
                           stages=args.stages or forward_mosaic._STAGES[dim],
                           summary=summary, times_ms=times), handle, indent=1)


if __name__ == "__main__":
    main()
