"""The loop every kernel shares: visit the tiles of one BlockMask row (or column)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Read each tile's index one iteration ahead (see walk_listed_tile_range). A switch only
# so that benchmarks can time the plain loop against it.
PREFETCH_INDICES = True


def walk_listed_tiles(num_blocks_ref, indices_ref, table_index, *, mask_block: int,
                      tile: int, visit, state, lookahead=None):
    """Folds `visit(tile_start, state)` over the tiles of the blocks one table row lists.

    `num_blocks_ref[table_index]` blocks are listed in `indices_ref[table_index + (j,)]`;
    a mask block of `mask_block` positions spans `mask_block // tile` kernel tiles. One
    flat loop over kernel tiles (not a loop of blocks with an inner tile loop): a
    single-tile loop body is what Triton's software pipeliner handles best.
    `lookahead`: see `walk_listed_tile_range`.
    """
    num_tiles = num_blocks_ref[table_index] * (mask_block // tile)
    return walk_listed_tile_range(indices_ref, table_index, 0, num_tiles,
                                  mask_block=mask_block, tile=tile, visit=visit, state=state,
                                  lookahead=lookahead)


def walk_listed_tile_range(indices_ref, table_index, start, stop, *, mask_block: int,
                           tile: int, visit, state, lookahead=None):
    """Like `walk_listed_tiles`, for the listed tiles numbered [start, stop) only (the
    decode kernel splits one row's tiles between programs).

    The start of tile `step + 1` is read from the table during step `step` and carried
    into the next iteration. Tile loads then depend on a loop-carried value only, never
    on a load of the same iteration: Triton's software pipeliner pipelines such loads
    with all of `num_stages`, where it would split the stages between an index load and
    the tile loads that depend on it (none are left for either at num_stages = 2).

    lookahead: None, or `lookahead(tile_start)` -> values the tile's loads need that
    come from memory (the pages of a paged cache); they are read one iteration ahead
    too, and `visit(tile_start, state, looked_ahead)` receives them.
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

    if not PREFETCH_INDICES:
        def visit_now(step, state):
            start_of_tile = tile_start(block_of(step), step)
            if lookahead is None:
                return visit(start_of_tile, state)
            return visit(start_of_tile, state, lookahead(start_of_tile))

        return lax.fori_loop(start, stop, visit_now, state)

    def read_ahead(step):
        start_of_tile = tile_start(block_of(step), step)
        return start_of_tile, (() if lookahead is None else lookahead(start_of_tile))

    def visit_tile(step, carry):
        current_start, current_ahead, state = carry
        next_step = jnp.minimum(step + 1, last_step)
        next_start, next_ahead = read_ahead(next_step)  # issued now, used next iteration
        if lookahead is None:
            state = visit(current_start, state)
        else:
            state = visit(current_start, state, current_ahead)
        return next_start, next_ahead, state

    first_step = jnp.minimum(jnp.asarray(start, jnp.int32), last_step)
    _, _, state = lax.fori_loop(start, stop, visit_tile, (*read_ahead(first_step), state))
    return state
