"""The loop every kernel shares: visit the tiles of one BlockMask row (or column)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


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
    decode kernel splits one row's tiles between programs)."""
    tiles_per_block = mask_block // tile

    def visit_tile(step, state):
        if tiles_per_block == 1:
            return visit(indices_ref[table_index + (step,)] * mask_block, state)
        # lax.div/rem with an int32 divisor, not // and %: the operands are non-negative,
        # and jnp's floored remainder on the loop index does not lower to Triton.
        block = indices_ref[table_index + (lax.div(step, jnp.int32(tiles_per_block)),)]
        offset = lax.rem(step, jnp.int32(tiles_per_block)) * tile
        return visit(block * mask_block + offset, state)

    return lax.fori_loop(start, stop, visit_tile, state)
