"""The loop every kernel shares: visit the tiles of one BlockMask row (or column); and the
share of a row's listed tiles one split-KV program of the latent decodes walks."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def loop_value(value, anchor):
    """`value` as a value a loop body computes, for its carry. Triton's loop lowering
    yields the body's outputs as MLIR values and cannot yield a constant: a carry the
    body returns as a constant (a flat table index of 0 for a 0-d captured array, a
    `started` flag set to 1) failed with 'Operand N of operation "scf.yield" must be a
    Value (is not a Value)'. Inside a trace a constant is a tracer too (it becomes a
    jaxpr literal only later), so this always ties `value` to `anchor`, an int32 scalar
    the body computes (its loop index, a tile start): `value + anchor * 0`, which Triton
    folds away."""
    value = jnp.asarray(value)
    return value + (anchor * 0).astype(value.dtype)


def walk_listed_tiles(num_blocks_ref, indices_ref, table_index, *, mask_block: int,
                      tile: int, visit, state):
    """Folds `visit(tile_start, state)` over the tiles of the blocks one table row lists.

    `num_blocks_ref[table_index]` blocks are listed in `indices_ref[table_index + (j,)]`;
    a mask block of `mask_block` positions spans `mask_block // tile` kernel tiles. One
    flat loop over kernel tiles (not a loop of blocks with an inner tile loop): a
    single-tile loop body is what Triton's software pipeliner handles best.
    """
    num_tiles = num_blocks_ref[table_index] * (mask_block // tile)
    return walk_listed_tile_range(indices_ref, table_index, 0, num_tiles,
                                  mask_block=mask_block, tile=tile, visit=visit, state=state)


def walk_listed_tile_range(indices_ref, table_index, start, stop, *, mask_block: int,
                           tile: int, visit, state):
    """Like `walk_listed_tiles`, for the listed tiles numbered [start, stop) only (the
    decode kernel splits one row's tiles between programs).

    The start of tile `step + 1` is read from the table during step `step` and carried
    into the next iteration. Tile loads then depend on a loop-carried value only, never
    on a load of the same iteration: Triton's software pipeliner pipelines such loads
    with all of `num_stages`, where it would split the stages between an index load and
    the tile loads that depend on it (none are left for either at num_stages = 2).
    """
    tiles_per_block = mask_block // tile
    last_step = indices_ref.shape[-1] * tiles_per_block - 1  # stay inside the table row

    def block_of(step):
        if tiles_per_block == 1:
            return indices_ref[table_index + (step,)]
        # lax.div/rem with an int32 divisor, not // and %: the operands are non-negative,
        # and jnp's floored remainder on the loop index does not lower to Triton.
        return indices_ref[table_index + (lax.div(step, jnp.int32(tiles_per_block)),)]

    def tile_start(block, step):
        if tiles_per_block == 1:
            return block * mask_block
        return block * mask_block + lax.rem(step, jnp.int32(tiles_per_block)) * tile

    def visit_tile(step, carry):
        current_start, state = carry
        next_step = jnp.minimum(step + 1, last_step)
        next_block = block_of(next_step)  # issued now, used after this tile's work
        state = visit(current_start, state)
        return tile_start(next_block, next_step), state

    first_step = jnp.minimum(jnp.asarray(start, jnp.int32), last_step)
    _, state = lax.fori_loop(start, stop, visit_tile,
                             (tile_start(block_of(first_step), first_step), state))
    return state


def split_walk(tables, lengths_ref, *, batch, split, num_splits, tile, tiles_per_block,
               kv_len, broadcast_batch):
    """The tiles of `tile` keys one program walks: (low, high, middle, kv_length,
    key_start_of): split `split` of batch row `batch`'s listed tiles (full blocks' first)
    is [low, high), its full tiles those below `middle`; kv_length the row's length
    (lengths_ref [B] of a paged cache, whose BlockMask was clipped to it: only the last
    listed block may cross it, and its tiles at or past it are left out) or kv_len;
    key_start_of(t) the first key of listed tile t. tables: the BlockMask's full and
    partial counts and indices."""
    full_num_ref, full_indices_ref, partial_num_ref, partial_indices_ref = tables
    table = (0 if broadcast_batch else batch, 0, 0)
    num_full_tiles = full_num_ref[table] * tiles_per_block
    num_tiles = num_full_tiles + partial_num_ref[table] * tiles_per_block
    last_listed = full_indices_ref.shape[-1] - 1
    kv_length = kv_len
    if lengths_ref is not None:
        kv_length = jnp.minimum(lengths_ref[batch], kv_len)
        num_partial = partial_num_ref[table]
        last_block = partial_indices_ref[table + (jnp.clip(num_partial - 1, 0, last_listed),)]
        tiles_below = lax.div(kv_length + (tile - 1), jnp.int32(tile))
        past = jnp.clip((last_block + 1) * tiles_per_block - tiles_below, 0, tiles_per_block)
        num_tiles = num_tiles - jnp.where(num_partial > 0, past, 0)
    per_split = lax.div(num_tiles + (num_splits - 1), jnp.int32(num_splits))
    low = jnp.minimum(split * per_split, num_tiles)
    high = jnp.minimum(num_tiles, low + per_split)

    def key_start_of(listed_tile):
        listed = lax.div(listed_tile, jnp.int32(tiles_per_block))
        part = lax.rem(listed_tile, jnp.int32(tiles_per_block))
        num_full = full_num_ref[table]
        full = full_indices_ref[table + (jnp.minimum(listed, last_listed),)]
        partial = partial_indices_ref[table + (jnp.clip(listed - num_full, 0, last_listed),)]
        block = jnp.where(listed < num_full, full, partial)
        return (block * tiles_per_block + part) * tile

    return low, high, jnp.clip(num_full_tiles, low, high), kv_length, key_start_of
