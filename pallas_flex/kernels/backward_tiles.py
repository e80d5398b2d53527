"""What both launches of the Triton backward (`backward.py`, `backward_batch_loop.py`)
compute on one tile: its probabilities recomputed from the saved lse with the mods
applied (`tile_probabilities`), dS and the captured-array cotangents from them
(`tile_score_gradients`), and how a captured array's read sums its cotangents
(`SitePlan`, `flat_index`, `scatter_add`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_flex.kernels import online_softmax
from pallas_flex.kernels.tile_mods import apply_mask_on_tile, score_vjp_on_tile
from pallas_flex.masks.block_mask import EMPTY, FULL


def tile_probabilities(q, k, lse_log2, *, q_idx, kv_idx, batch, head, masked, mask_program,
                        mask_refs, score_program, score_refs, scale, q_len, kv_len,
                        mask_block_kv, precision, transposed=False, block_state=None,
                        capture_log=None, frame=None):
    """Recomputes one tile's probabilities: (P, score_vjp, sites).

    q [bq, D], k [bk, D], lse_log2 [bq, 1]; q_idx [bq, 1], kv_idx [1, bk] (unclamped).
    `score_vjp`/`sites` (None/() without a score_mod) give the score_mod's derivative
    and the captured-array reads for `tile_score_gradients`.

    transposed=True computes P^T [bk, bq] instead (lse_log2 [1, bq], q_idx [1, bq],
    kv_idx [bk, 1]): the dK/dV programs then feed P^T and dS^T to their matmuls as they
    are, where transposing a [bq, bk] accumulator would go through shared memory.

    block_state (with masked=True): the tile's BlockMask block state, traced (EMPTY,
    PARTIAL or FULL): the mask_mod applies to partial blocks only, empty ones get P = 0
    (the batch loop's programs visit every block). capture_log: the CaptureLog the
    score_mod's reads are recorded in (`tile_mods.score_vjp_on_tile`). frame: the tile's
    TileFrame (the mods' reads at exactly q_idx / kv_idx load blocks), or None.
    """
    q_idx_in_range = q_idx  # the caller clamps query indices; padded rows have P = 0
    kv_idx_in_range = jnp.minimum(kv_idx, kv_len - 1)
    indices_below = max(q_len, kv_len)
    rows, columns = (k, q) if transposed else (q, k)
    scores = lax.dot_general(rows, columns, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32, precision=precision)
    score_vjp, sites = None, ()
    if score_program is None:
        logits = scores * (scale * online_softmax.LOG2_E)  # one multiply per score
    else:
        scores, score_vjp, sites = score_vjp_on_tile(score_program, score_refs, scores * scale,
                                                     batch, head, q_idx_in_range,
                                                     kv_idx_in_range,
                                                     indices_below=indices_below,
                                                     log=capture_log, frame=frame,
                                                     select_small_tables=True)
        logits = scores * online_softmax.LOG2_E
    if masked:
        keep = apply_mask_on_tile(mask_program, mask_refs, batch, head, q_idx_in_range,
                                  kv_idx_in_range, indices_below=indices_below, frame=frame,
                                  select_small_tables=True)
        if block_state is not None:
            keep = (keep | (block_state == FULL)) & (block_state != EMPTY)
        if kv_len % mask_block_kv:  # else no tile reaches past the keys
            keep = keep & (kv_idx < kv_len)
        logits = jnp.where(keep, logits, -jnp.inf)
    probabilities = jnp.exp2(logits - lse_log2)  # lse_log2 = +inf on rows to ignore
    return probabilities, score_vjp, sites


def tile_score_gradients(probabilities, v, d_out, delta, score_vjp, *, precision,
                          transposed=False):
    """(dS, the captured-array cotangents) of one tile from its probabilities.

    v [bk, Dv], d_out [bq, Dv], delta [bq, 1] ([1, bq] and dS^T when transposed). dS
    includes the score_mod's derivative but not `scale`: the callers multiply their
    dQ/dK accumulators by it once, after the loop, instead of every tile."""
    rows, columns = (v, d_out) if transposed else (d_out, v)
    d_probabilities = lax.dot_general(rows, columns, (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32, precision=precision)
    d_modded = probabilities * (d_probabilities - delta)
    if score_vjp is None:
        return d_modded, ()
    return score_vjp(d_modded)


def scatter_add(target_ref, indices, value, interpret):
    """target[indices] += value, with repeated indices accumulating."""
    if interpret:
        # Interpret mode runs programs one after another; a whole-array scatter-add is
        # exact where the atomic's interpret rule would drop repeated indices.
        full = target_ref[...]
        target_ref[...] = full.at[indices if indices else (0,)].add(value)
    else:
        plgpu.atomic_add(target_ref, indices if indices else (0,), value)


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """How one differentiated read of a captured array accumulates its cotangents.

    mode: "sum" (indices of b and h only: a register sum per program), "one_hot"
    (deterministic: a register row over the `entries` table entries the varying axes
    reach) or "atomic" (scatter-added into the float32 gradient buffer). `offsets`:
    the flat table offset of each of the `width` (a power of two >= entries) row
    slots, relative to the flat index of the read's non-varying axes."""
    site: int
    position: int
    mode: str
    varying: tuple
    table_shape: tuple
    entries: int = 1
    width: int = 1

    @property
    def offsets(self):
        strides = np.cumprod((1,) + self.table_shape[::-1][:-1])[::-1]
        varying_sizes = [size for size, varies in zip(self.table_shape, self.varying) if varies]
        varying_strides = [stride for stride, varies in zip(strides, self.varying) if varies]
        offsets = np.zeros(self.width, np.int64)
        for entry in range(self.entries):
            digits = np.unravel_index(entry, varying_sizes) if varying_sizes else ()
            offsets[entry] = sum(int(d) * int(st) for d, st in zip(digits, varying_strides))
        return offsets


def flat_index(indices, shape, axes):
    """The flat (row-major) offset in an array of `shape` of the index on `axes`
    (scalar int32; the other axes count as 0)."""
    flat = jnp.int32(0)
    if not indices:  # a 0-d array
        return flat
    strides = np.cumprod((1,) + tuple(shape[::-1][:-1]))[::-1]
    for axis in axes:
        index = indices[axis]
        if jnp.ndim(index):  # the same value across the tile: any element
            index = jnp.max(index)
        flat = flat + index.astype(jnp.int32) * jnp.int32(strides[axis])
    return flat
