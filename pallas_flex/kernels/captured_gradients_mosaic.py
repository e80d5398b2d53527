"""Gradients of a score_mod's captured arrays on the Mosaic GPU backward
(`backward_mosaic.py`): the sums its kernels accumulate on their tiles, and what turns
those sums into each array's gradient after them.

A captured array's gradient is the sum, over the elements that read an entry, of the
cotangent of the value read, dS' g (dS' = P (dP - delta*), g the read's derivative from
`mod_program.with_read_derivatives`), taken with each row's exact delta* = sum P dP - dlse
(the kernels' delta comes from the output rounded to 16 bits: `captured_gradients` says
why that matters). Three shapes of read:

* At indices of b and h only (ALiBi slopes, a temperature, a per-head bias): every
  element of a (batch, head) reaches one entry. The dQ kernel sums per query row
  (`accumulate_rows`, then `captured_gradients` corrects each row to its exact delta);
  or, where the forward returned each row's C = sum P g
  (`mosaic_eligibility.captured_row_sums`), sum P dP (g - C), which needs no delta at all:
  per row in the dQ kernel (`accumulate_rows_from_forward`) or per key in the fused D 64
  dK/dV kernel (`accumulate_pair`), both finished by `pair_gradients`.
* At indices of kv_idx - q_idx (T5 tables): the dK/dV kernel sums per key and table entry
  (`accumulate_runs`, or tiles dumped to HBM, `_dump_or_add`) with each row's exact delta
  from the dQ kernel's row sums (`exact_delta`), finished by `relative_gradient`. Where
  the read is a bias (its derivative 1), the tiles before the dumped ones are not summed
  in the kernel at all: every element's dS' adds up, per (b, h), to the rows' totals
  (`relative_totals`), and their share is what the others leave of it.

Every sum into an array's entries runs in a fixed order (`fixed_order_scatter_sum`): these
gradients are bitwise reproducible.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels.backward import fixed_order_scatter_sum
from pallas_flex.kernels.backward_tiles import flat_index
from pallas_flex.kernels.mosaic_eligibility import BLOCK
from pallas_flex.kernels.mosaic_tiles import (
    ROWS_PER_WARPGROUP, Vector, constant_value, index_vector, load_vector, split_rows,
    to_tile, vector_layout, weighted_row_sums)
from pallas_flex.kernels.relative_reads import TILE
from pallas_flex.kernels.tile_mods import CaptureLog, CapturedRef, evaluate_jaxpr_on_tiles

# 64 x 64 dK/dV tiles: query tiles per 128-row BlockMask block.
TILES_PER_BLOCK = BLOCK // TILE


def clear_rows(rows_ref):
    """Zeros [n, 64] float32 rows of shared memory, one row vector at a time."""
    zeros = plgpu.layout_cast(jnp.full((ROWS_PER_WARPGROUP,), 0.0, jnp.float32),
                              vector_layout(0))

    def clear_row(row, carry):
        rows_ref.at[row][...] = zeros
        return carry

    lax.fori_loop(0, rows_ref.shape[0], clear_row, 0)


def accumulate_runs(sums_ref, d_scores_t, derivative, tables, dump, *, batch, head,
                    q_start, kv_start, tile, interpret):
    """sums_ref[e] [64 keys] += sum over the tile's queries of dS' g where kv_idx - q_idx
    lies in a run of entry e (g: the read's derivative, as
    `backward_mosaic._scores_to_logits` returns it), from the tile's block diagonal's runs
    by entry (`relative_reads.entry_tables`: starts, entries, and the span of runs the
    tile reaches). A dK/dV tile has keys on the rows.

    Suffix sums: the tile's row sum, then for each later run r the sum over the elements
    at or past its start (one compare, select and add per element and run, as
    `mosaic_tiles.relative_read_tile` reads the values); run r - 1 gets the difference of
    two consecutive suffixes. A block diagonal past the table's last bucket has one run:
    its tiles cost a row sum (a branch of its own, without the loop's index tiles).

    Each tile loops over the runs its differences reach only (the table's spans). This
    loop is what runs where the entries are traced (no `relative_reads.Dump`); with a
    `dump` (dump_ref, staging [64, 64] float32 shared memory, the Dump's first offset and
    count, the key tile's first slot, refs to the two key sums the walk carries, whether
    the tiles before the offsets are left to the rows' totals)
    `_dump_or_add` takes the tile instead.

    H100, causal + one-way T5 [Hq, 32] forward+backward with the run loop (`pallas-flex
    bench captured_gradients`; ms, with the table's gradient / without): B4 H16 S4096
    D128 4.36 / 3.16, B1 S16384 12.5 / 9.35, B8 S2048 D64 2.11 / 1.66, GQA 32:8 8.63 /
    6.14: almost all in the loop on the tiles near the diagonal (some 30 runs a block
    diagonal, ~1000 cycles a run) and in each tile's two dependent table reads (span,
    then entry). A/B probes of the loop (AOT-compiled, paired rounds, before the spans):
    two runs a step 4.56 against 4.62 ms, the table loads a step ahead 4.67, the sums
    after dK's wgmma instead of beside it 4.64."""
    weighted = _weighted_by_derivative(d_scores_t, derivative, tile)
    if weighted is None:
        return  # the read does not change the score
    if dump is not None:
        _dump_or_add(weighted, dump, kv_start=kv_start, q_start=q_start)
        return

    def add(entry, sums):
        sums_ref.at[entry][...] = load_vector(sums_ref.at[entry], 0, interpret) + sums

    starts_ref, entries_ref, spans_ref = tables
    blocks = (spans_ref.shape[2] + 1) // 2
    row = (0 if spans_ref.shape[0] == 1 else batch, head,
           lax.div(kv_start, BLOCK) - lax.div(q_start, BLOCK) + blocks - 1)
    # The runs this tile reaches: its keys' start less its queries' start is the block
    # diagonal's -64, 0 or 64.
    span = row + (lax.div(lax.rem(kv_start, BLOCK) - lax.rem(q_start, BLOCK), TILE) + 1,)
    first, end = spans_ref[span + (0,)], spans_ref[span + (1,)]

    def single():
        add(entries_ref[row + (first,)], weighted.sum(axis=1))

    def several():
        queries = index_vector(q_start, tile[1], 1)
        keys = to_tile(index_vector(kv_start, tile[0], 0), tile)

        def suffix(run, previous):
            threshold = to_tile(Vector(queries.value + starts_ref[row + (run,)], 1), tile)
            current = jnp.where(keys >= threshold, weighted, 0.0).sum(axis=1)
            add(entries_ref[row + (run - 1,)], previous - current)
            return current

        last = lax.fori_loop(first + 1, end, suffix, weighted.sum(axis=1))
        add(entries_ref[row + (end - 1,)], last)

    lax.cond(end - first > 1, several, single)


def _weighted_by_derivative(d_scores_t, derivative, tile):
    """dS' g on a dK/dV tile (keys on the rows), g a read's derivative as
    `backward_mosaic._scores_to_logits` returns it, taken apart by `split_rows` into a
    part that varies along the keys and one that depends on the query only (a vector
    along the columns): g is their sum. None where the read does not change the score."""
    varying, per_row = split_rows(derivative, tile, q_axis=1)
    if per_row is not None and constant_value(per_row) == 0.0:
        per_row = None
    if per_row is not None and jnp.ndim(per_row):
        per_row = to_tile(Vector(per_row, 1), tile)
    if varying is None and per_row is None:
        return None
    if varying is None:
        return d_scores_t if constant_value(per_row) == 1.0 else d_scores_t * per_row
    return d_scores_t * (varying if per_row is None else varying + per_row)


def accumulate_pair(sums, products, derivative, row_sums, tile):
    """sums [64 keys] += the tile's P dP (g - C) summed over its queries (products:
    P^T dP^T; row_sums: C [64 queries], each row's sum P g over all its keys, from the
    forward), for a captured array read at indices of b and h (ALiBi slopes, a
    temperature): every element of a (batch, head)'s walk reaches the same entry, so
    per-key sums flushed per head are all its gradient needs (`pair_gradients`). A row
    sum within each warp, in registers: no delta, no sum across the warps."""
    varying, per_row = split_rows(derivative, tile, q_axis=1)
    # g - C = the part of g that varies along the keys + (its query-only part - C).
    offset = -row_sums if per_row is None else per_row - row_sums
    weights = to_tile(Vector(offset, 1), tile)
    if varying is not None:
        weights = weights + varying
    sums[...] = sums[...] + (products * weights).sum(axis=1)


def _dump_or_add(weighted, dump, *, kv_start, q_start):
    """A tile at one of the dump's offsets to HBM; the others, which reach one entry
    each, the same on every tile before the dumped offsets and on every tile past them
    (`relative_reads.Dump`), summed per key into the two register vectors the walk
    carries (dump's last element), which go to rows 0 and 1 of the sums per head: no
    table read and no shared-memory sum in the kernel. `relative_gradient` sums the
    dumped tiles by diagonal, then by entry.

    reduced (the dump's last element): None, or where the dumped tiles are summed by
    TMA reduce-adds into one [64, 64] tile a (batch, head, offset) (`ReducedDump`):
    first_slot is then that (batch, head)'s, and dump_ref the zeroed accumulator.

    With before_from_totals (the dump's next-to-last element) the tiles before the dumped
    offsets add nothing here: `relative_gradient` takes their sum from the rows'
    totals; a tile past them sums behind a branch (H100, paired rounds, fwd+bwd ms,
    with it / without: B4 H16 S4096 D128 3.253 / 3.324, B1 S16384 9.771 / 10.163).

    H100, the same cases as `accumulate_runs`' figures (ms, with the table's gradient /
    without), with these sums in shared memory: B4 3.76 / 3.19, B1 S16384 11.2 / 9.59, B8
    D64 1.90 / 1.69, GQA 7.47 / 6.23 (1.13-1.20x). Where the cost went at B4 when the
    call took 3.84 ms, before they shrank from 34 rows to 2 (probes, paired rounds, parts
    left out in turn): the summing of the dumps outside 0.09, their writes 0.12, the
    other tiles' row sums 0.13, the dQ kernel's row sums for the exact deltas 0.13, the
    rest (the dK/dV program with the read's derivative, the per-head flushes of the 34
    rows, the entry tables computed per call) 0.21."""
    (dump_ref, staging, first_offset, count, first_slot, (before, after),
     before_from_totals, reduced) = dump
    offset = lax.div(kv_start - q_start, TILE) - first_offset
    if before_from_totals:
        # The tiles before the dumped offsets are left to `relative_gradient` (the rows'
        # totals less the rest): only a tile past them pays a row sum, behind a branch (a
        # causal walk never takes it).
        after[...] = lax.cond(offset >= count, lambda sums: sums + weighted.sum(axis=1),
                              lambda sums: sums, after[...])
    else:
        sums = weighted.sum(axis=1)
        # Selected by a factor, not a branch: the sums stay in registers.
        before[...] = before[...] + sums * (offset < 0).astype(jnp.float32)
        after[...] = after[...] + sums * (offset >= count).astype(jnp.float32)

    @pl.when((offset >= 0) & (offset < count))
    def _():
        # The last tile's copy has read the staging tile by now, or soon: tiles at the
        # dumped offsets are a few steps apart.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        tile = weighted
        if reduced is not None and reduced.keys_below is not None:
            # The padded keys' rows (their P is not 0 here) left out of the sum.
            keys = to_tile(index_vector(kv_start, weighted.shape[0], 0), weighted.shape)
            tile = jnp.where(keys < reduced.keys_below, weighted, 0.0)
        staging[...] = tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staging, dump_ref.at[first_slot + offset],
                                **({} if reduced is None else {"reduction_op": "add"}))


class ReducedDump(NamedTuple):
    """A dumped read's tiles summed in the kernel by TMA reduce-adds, per (batch, head,
    offset) rather than one slot a (batch, head, key tile, offset): float32 [Bd Hq count,
    64 keys, 64 queries] (Bd: 1 where the read's entries do not depend on b, summed over
    the batch too) in place of 64x the traffic there and the sum after. Not bitwise
    reproducible (the adds land in whatever order the programs reach them): not with
    `backward_deterministic`, and not in interpret mode (no TMA reductions).
    keys_below: the key length where it is not a multiple of 64, else None."""
    batch: int
    keys_below: int | None


def accumulate_rows(rows, probabilities, d_probabilities, d_scores, read_derivatives, tile):
    """rows[0] += sum dS' and rows[1] += sum P over the tile's keys, per query row, with
    dS' = P (dP - delta) before the score derivative; per read derivative g,
    rows[2 + 2i] += sum dS' g and rows[3 + 2i] += sum P g (see `captured_gradients`).
    g's part that depends on the query only multiplies the first two sums instead of
    every element (`mosaic_tiles.split_rows`). With one row only (the exact deltas of a
    call without those reads), rows[0] += sum P dP: one sum in place of two."""
    if len(rows) == 1:
        rows[0][...] = rows[0][...] + (probabilities * d_probabilities).sum(axis=1)
        return
    d_sum, p_sum = d_scores.sum(axis=1), probabilities.sum(axis=1)
    rows[0][...] = rows[0][...] + d_sum
    rows[1][...] = rows[1][...] + p_sum
    for index, derivative in enumerate(read_derivatives):
        parts = split_rows(derivative, tile, q_axis=0)
        rows[2 + 2 * index][...] = (rows[2 + 2 * index][...]
                                    + weighted_row_sums(d_scores, d_sum, parts))
        rows[3 + 2 * index][...] = (rows[3 + 2 * index][...]
                                    + weighted_row_sums(probabilities, p_sum, parts))


def accumulate_rows_from_forward(rows, products, read_derivatives, forward_sums, tile):
    """With the forward's row sums C of the n read derivatives g (`forward_sums`, vectors
    along the queries): per query row, rows[-n + i] += sum P dP (g_i - C_i) over the
    tile's keys (products: P dP), and before them, where there is one more row (a table
    read at kv_idx - q_idx wants the exact deltas too), rows[0] += sum P dP."""
    mass = products.sum(axis=1)
    extra = len(rows) - len(forward_sums)
    if extra:
        rows[0][...] = rows[0][...] + mass
    for row, derivative, row_sum in zip(rows[extra:], read_derivatives, forward_sums):
        parts = split_rows(derivative, tile, q_axis=0)
        row[...] = row[...] + weighted_row_sums(products, mass, parts) - mass * row_sum


def captured_gradients(rows, delta, d_lse, score_program, positions, q_len):
    """Per captured array at `positions`, its gradient from the dQ kernel's row sums
    rows [2 + 2 n, B, Hq, S] (D = sum dS', E = sum P, then per array A = sum dS' g and
    B = sum P g; `accumulate_rows`) and the kernel's delta [B, Hq, S].

    A row's cotangent of the value it read is sum P (dP - delta*) g, taken with the row's
    exact delta* = sum P dP - dlse rather than the kernel's delta = rowsum(dO * out) -
    dlse, from the output rounded to 16 bits: a row's rounding error there would be
    multiplied by g (an ALiBi slope's: key distances in the thousands; with it the
    Triton backward keeps a float32 output). With sum P dP = D + delta E that is
    A + (delta (1 - E) + dlse - D) B. E is summed, not taken as 1 (nor as 1 less a
    sink's weight): the lse holds the mod's query-only term (ALiBi's, thousands at
    S 16384), which its float32 rounding leaves in E - 1 at up to 1e-3, and with E = 1
    the slopes' gradient moved 0.8 % (B1 H16 S16384 D128 on the H100) where the summed
    E keeps it at float32 precision. Summed over the rows of each (batch, head), then
    into the table entry that pair reads, in a fixed order (`fixed_order_scatter_sum`):
    bitwise reproducible."""
    rows, delta = rows[..., :q_len], delta[..., :q_len]
    d_sum, p_sum = rows[0], rows[1]
    correction = delta * (1.0 - p_sum) - d_sum
    if d_lse is not None:
        correction = correction + d_lse.astype(jnp.float32)
    batch, heads = delta.shape[:2]
    flat = _read_entries(score_program, positions, batch, heads)
    grads = []
    for index, position in enumerate(positions):
        per_pair = jnp.sum(rows[2 + 2 * index] + correction * rows[3 + 2 * index], axis=-1)
        grads.append(_into_entries(flat[index].reshape(per_pair.shape), per_pair,
                                   score_program.consts[position]))
    return grads


def _into_entries(flat, sums, const):
    """The gradient of captured array `const`: `sums` added into the flat entries
    `flat` (broadcast to sums' shape) in a fixed order (`fixed_order_scatter_sum`), in const's shape
    and dtype."""
    flat = jnp.broadcast_to(flat, sums.shape)
    gradient = fixed_order_scatter_sum(flat.reshape(-1), sums.reshape(-1), jnp.size(const))
    return gradient.reshape(jnp.shape(const)).astype(const.dtype)


def over_keys(run_sums, kv_len):
    """The dK/dV kernel's per-key sums [B, Hq, key tiles, rows, 64] summed over the keys
    (padded ones left out): [B, Hq, rows]."""
    batch, heads, slots, rows, keys = run_sums.shape
    per_key = jnp.moveaxis(run_sums, 3, 2).reshape(batch, heads, rows, slots * keys)
    return jnp.sum(per_key[..., :kv_len], axis=-1)


def _read_entries(score_program, positions, batch, heads):
    """Per captured array at `positions`, the flat entry each (batch, head) pair's read
    of it reaches, [B * Hq] int32: the mod evaluated once per pair (its reads there are
    at indices of b and h only)."""
    def entries(b, h):
        log = CaptureLog()
        consts = [CapturedRef(jnp.reshape(c, (-1,)) if jnp.ndim(c) == 0 else c,
                              jnp.shape(c), i, log)
                  for i, c in enumerate(score_program.consts)]
        evaluate_jaxpr_on_tiles(score_program.jaxpr, consts,
                                [jnp.float32(0), b, h, jnp.int32(0), jnp.int32(0)],
                                score_program.name)
        sites = dict(log.sites)  # each array at `positions` is read once
        return [flat_index(sites[p], jnp.shape(score_program.consts[p]),
                           range(jnp.ndim(score_program.consts[p]))) for p in positions]

    per_pair = jax.vmap(jax.vmap(entries, (None, 0)), (0, None))(
        jnp.arange(batch, dtype=jnp.int32), jnp.arange(heads, dtype=jnp.int32))
    return [entry.reshape(-1) for entry in per_pair]


def pair_gradients(per_pair, row_sums, d_lse, score_program, positions):
    """Per captured array at `positions` (read at indices of b and h), its gradient from
    the sums of P dP (g - C) per (b, h) (per_pair: one [B, Hq] per array; per key in the
    fused kernel, `accumulate_pair`, or per row in the dQ kernel,
    `accumulate_rows_from_forward`) and the forward's row sums C = sum P g (row_sums:
    one [B, Hq, Sq] per array). A row's share of the gradient,
    sum P (dP - delta*) g with its exact delta* = sum P dP - dlse, is
    sum P dP g - (sum P dP) C + dlse C = sum P dP (g - C) + dlse C: no delta at all,
    so none of the 16-bit output's rounding (`captured_gradients` has why that
    matters). The kernel's P carries its row's lse rounding (the mod's query-only term,
    thousands at long rows, lives in the lse) as one factor per row, which scales that
    row's share alike rather than leaving a difference of large sums. Then into the
    entry each (b, h) reads, in a fixed order (`fixed_order_scatter_sum`): bitwise
    reproducible."""
    batch, heads = per_pair[0].shape
    flat = _read_entries(score_program, positions, batch, heads)
    grads = []
    for index, (position, sums, row_sum) in enumerate(zip(positions, per_pair, row_sums)):
        if d_lse is not None:
            sums = sums + jnp.sum(d_lse.astype(jnp.float32) * row_sum, axis=-1)
        grads.append(_into_entries(flat[index].reshape(batch, heads), sums,
                                   score_program.consts[position]))
    return grads


def relative_gradient(run_sums, dumped, flat, dump, const, block_mask, kv_len, totals=None,
                      reduced=None):
    """The gradient of a captured array read at indices of kv_idx - q_idx from the dK/dV
    kernel's sums per (b, h, key, entry) (run_sums [B, Hq, 2 num_kv_blocks, E, 64]), or
    with a `relative_reads.Dump`, its sums per key of the tiles before and past the
    dumped offsets (2 rows in place of E) and its `dumped` tiles: summed over the keys
    (padded ones left out) per (b, h, local entry), then into the array's entries by
    `entry_tables`' flat [Bm, Hq, E], in a fixed order (`fixed_order_scatter_sum`).
    totals: None, or each (b, h)'s sum of dS' over all its elements [B, Hq]
    (`relative_totals`), where the kernel left the tiles before the dump's offsets out:
    their sum is what the dumped tiles and those past them leave of it. reduced: None or
    the `ReducedDump` the kernel summed `dumped` by."""
    per_row = over_keys(run_sums, kv_len)
    if dump is None:
        per_entry = per_row
    else:
        entries = flat.shape[-1]
        before, after = per_row[..., 0], per_row[..., 1]
        if reduced is None:
            per_entry = _dumped_entry_sums(_summed_dumps(
                dumped, dump, _visited_tiles(block_mask, dump), kv_len), dump, entries)
        else:
            batch, heads = per_row.shape[:2]
            per_entry = _dumped_entry_sums(
                dumped.reshape(reduced.batch, heads, dump.count, TILE, TILE), dump, entries)
            if reduced.batch != batch:  # summed over the batch: so are the rest
                before, after = (x.sum(axis=0, keepdims=True) for x in (before, after))
                totals = None if totals is None else totals.sum(axis=0, keepdims=True)
        if totals is not None:
            before = totals - jnp.sum(per_entry, axis=-1) - after
        # Every tile before the dumped offsets reaches the first dumped diagonal's entry,
        # every tile past them the last one's.
        for sums, entry in ((before, dump.entries[:, :, 0, 0]),
                            (after, dump.entries[:, :, -1, -1])):
            per_entry = per_entry + jnp.where(entry[..., None] == np.arange(entries),
                                              sums[..., None], 0.0)
    return _into_entries(flat, per_entry, const)


def _visited_tiles(block_mask, dump):
    """[Bt, Ht, key tiles, dump.count] bool: whether the dK/dV kernel visits (and so
    dumps) the tile of each key tile at each of the dump's offsets: those of the blocks
    the BlockMask computes."""
    per_block = jnp.swapaxes(block_mask.to_dense() > 0, -1, -2)  # [Bt, Ht, nKV, nQ]
    q_blocks = per_block.shape[-1]
    key_tiles = jnp.arange(per_block.shape[2] * TILES_PER_BLOCK, dtype=jnp.int32)
    query_tiles = (key_tiles[:, None]
                   - (dump.first_offset + jnp.arange(dump.count, dtype=jnp.int32))[None, :])
    inside = (query_tiles >= 0) & (query_tiles < q_blocks * TILES_PER_BLOCK)
    query_blocks = jnp.clip(query_tiles // TILES_PER_BLOCK, 0, q_blocks - 1)
    return per_block[:, :, (key_tiles // TILES_PER_BLOCK)[:, None], query_blocks] & inside


def _summed_dumps(dumped, dump, visited, kv_len):
    """The dumped tiles dS' g (dumped [B Hq key_tiles count, 64 keys, 64 queries],
    `relative_reads.Dump`) summed over the key tiles: [B, Hq, count, 64, 64]. Tiles the
    kernel did not visit hold whatever the buffer held: `visited` [Bt, Ht, key tiles,
    count] selects the others; padded keys are left out."""
    key_tiles, count = visited.shape[2:]
    heads = dump.entries.shape[1]
    batch = dumped.shape[0] // (heads * key_tiles * count)
    tiles = dumped.reshape(batch, heads, key_tiles, count, TILE, TILE)
    keys = (jnp.arange(key_tiles)[:, None] * TILE + jnp.arange(TILE)[None, :]) < kv_len
    keep = visited[:, :, :, :, None, None] & keys[None, None, :, None, :, None]
    return jnp.sum(jnp.where(keep, tiles, 0.0), axis=2)


def _dumped_entry_sums(summed, dump, entries):
    """[B, Hq, entries]: the dumped tiles summed over the key tiles (summed [B, Hq,
    count, 64 keys, 64 queries]) summed by local entry: along each diagonal (a skewed
    view: the tile's queries reversed and padded to a pitch of 128, read at a pitch of
    127, puts diagonal kv_idx - q_idx = TILE o + m - 63 in column m), then by entry in a
    fixed order."""
    batch, heads, count = summed.shape[:3]
    skewed = jnp.pad(summed[..., ::-1], [(0, 0)] * 4 + [(0, TILE)])
    skewed = skewed.reshape(batch, heads, count, TILE * 2 * TILE)[..., :TILE * (2 * TILE - 1)]
    diagonals = skewed.reshape(batch, heads, count, TILE, 2 * TILE - 1).sum(axis=3)
    one_hot = dump.entries[..., None] == np.arange(entries)  # [Bm, Hq, count, 127, E]
    return jnp.sum(jnp.where(one_hot, diagonals[..., None], 0.0), axis=(2, 3))


def relative_totals(rows, delta, d_lse, q_len):
    """Each (b, h)'s sum of dS' = P (dP - delta*) over all its elements, [B, Hq] float32,
    from the dQ kernel's row sums D = sum dS' and E = sum P (`accumulate_rows`) and the
    exact delta* the dK/dV kernel took (`exact_delta`): a row's sum is
    sum P dP - delta* E, sum P dP = D + delta E. (With E = 1, i.e. dlse, the lse's float32
    rounding, ~1e-6 of E a row, moved a T5 table's gradient by 1e-4 of its largest
    entry at 200 rows.)"""
    rows, delta = rows[..., :q_len], delta[..., :q_len]
    exact = exact_delta(rows, delta, None if d_lse is None else d_lse[..., :q_len])
    products = rows[0] + delta * rows[1]
    return jnp.sum(products - exact * rows[1], axis=-1)


def exact_delta(rows, delta, d_lse):
    """Each row's delta* = sum P dP - dlse from the dQ kernel's row sums: sum P dP itself
    (one row), or D = sum dS' and E = sum P, sum P dP = D + delta E (`accumulate_rows`).
    The kernels' delta takes rowsum(dO * out) from the output rounded to 16 bits; a
    table's gradient sums dS over many rows, each of which would keep its rounding error
    (see `captured_gradients`)."""
    exact = rows[0] if rows.shape[0] == 1 else rows[0] + delta * rows[1]
    return exact if d_lse is None else exact - d_lse
