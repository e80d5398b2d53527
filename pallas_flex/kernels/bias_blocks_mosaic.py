"""Bias tensors a score_mod reads at (q_idx, kv_idx), as the Mosaic GPU kernels move them.

A read like `pair_bias[b // rows, h, q_idx, kv_idx]` (`mosaic_eligibility.contiguous_reads`'
blocks) covers one [rows, columns] block of the array per tile. Rather than gathering it
per element, each kernel's memory warpgroup copies the blocks by TMA into a ring of its
own beside its streamed tiles, one 64-row half per compute warpgroup, addressed by the
mod's own index slice on b and h (`mosaic_eligibility.block_indices`), and each compute
warpgroup loads its half in the scores' wgmma layout when the mod runs:

* the forward (`forward_mosaic.py`): a [128, keys] block per K/V tile;
* the backward's dQ kernel (`backward_mosaic.py`): a [128, 128] block per K/V stage;
* its dK/dV kernel: a [128 keys, 64 queries] block per query stage, from the array
  with its q and kv axes swapped (its tiles hold keys on rows), into whose transposed
  float32 gradient each tile's dS' is reduce-added.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flex.kernels.mosaic_eligibility import BLOCK, block_indices
from pallas_flex.kernels.mosaic_tiles import ROWS_PER_WARPGROUP

HALVES = BLOCK // ROWS_PER_WARPGROUP  # (one per compute warpgroup)


def bias_block_reads(score_program, score_reads):
    """The kernels' bias_blocks: (read key, captured position, (q axis, kv axis), other
    indices as a function of (b, h)) per read `tile_reads` calls a block."""
    if score_program is None:
        return ()
    equations = {id(equation): equation for equation in score_program.jaxpr.eqns}
    return tuple((key, position, axes, block_indices(score_program, equations[key]))
                 for key, (position, axes, kind) in score_reads.items() if kind == "block")


def block_transforms(columns: int, dtype):
    """The shared-memory layout of a bias block's [64, columns] rows: 128-byte rows of 8
    swizzled by 128 bytes (16-bit: 64 columns a tile row; float32: 32), as the compute
    warpgroups load them in the scores' wgmma layout."""
    row_elements = 128 // jnp.dtype(dtype).itemsize
    assert columns % row_elements == 0, (columns, dtype)
    return (plgpu.TilingTransform((8, row_elements)), plgpu.SwizzleTransform(128))


def ring(stages: int, columns: int, dtype):
    """A read's ring: [stages, 2 halves, 64 rows, columns]."""
    return plgpu.SMEM((stages, HALVES, ROWS_PER_WARPGROUP, columns), dtype,
                      transforms=block_transforms(columns, dtype))


def bias_block_sources(bias_blocks, sources, batch, head):
    """Per bias block read, (its array's ref, `sources`' entry for the read, its index on
    every axis for (batch, head), clamped: None on the q and kv axes; its q axis, kv
    axis)."""
    found = []
    for (_, _, (q_axis, kv_axis), indices_of), source in zip(bias_blocks, sources):
        index = [None if i is None else jnp.clip(jnp.asarray(i, jnp.int32), 0, size - 1)
                 for i, size in zip(indices_of(batch, head), source.shape)]
        found.append((source, index, q_axis, kv_axis))
    return found


def block_at(index, axes, first_row, rows, first_column, columns):
    """`index` with the block's rows on axes[0] and its columns on axes[1]."""
    at = list(index)
    at[axes[0]] = pl.ds(first_row, rows)
    at[axes[1]] = pl.ds(first_column, columns)
    return tuple(at)


def copy_block(source_entry, first_row, first_column, columns, ring_ref, slot, barrier):
    """The [128, columns] block from (first_row, first_column) of a read's array
    (`bias_block_sources`' entry: rows along its q axis, columns along its kv axis) as
    two 64-row copies into the ring's `slot`, arriving on `barrier` (once each)."""
    source, index, q_axis, kv_axis = source_entry
    for half in range(HALVES):
        at = block_at(index, (q_axis, kv_axis), first_row + half * ROWS_PER_WARPGROUP,
                      ROWS_PER_WARPGROUP, first_column, columns)
        plgpu.copy_gmem_to_smem(source.at[at], ring_ref.at[slot, half], barrier)


def with_ring_readers(readers, bias_blocks, rings, slot, warpgroup, barriers, interpret):
    """`readers` (the dense diagonal reads', or None) with a reader per bias block read:
    the warpgroup's rows of the ring's `slot` (a [64, columns] tile in the scores'
    layout), once its copy has landed (barriers: one per ring, or None where the caller
    has waited for the stage's copies)."""
    if not bias_blocks:
        return readers
    readers = dict(readers or {})
    for (key, *_), ring_ref, barrier in zip(bias_blocks, rings,
                                            barriers or [None] * len(rings)):
        def read(captured, indices, ring_ref=ring_ref, barrier=barrier):
            del captured, indices  # (the memory warpgroup addressed the copy)
            if barrier is not None:
                plgpu.barrier_wait(barrier.at[slot])
            rows = ring_ref.at[slot, warpgroup]
            if interpret:
                return rows[...]
            return plgpu.load(rows, layout=plgpu.Layout.WGMMA)
        readers[key] = read
    return readers
