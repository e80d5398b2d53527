"""BlockMask: which (q-block, kv-block) tiles a mask_mod leaves partly or wholly open.

The kernels never look at a dense mask. They walk, for each query block, the list of
KV blocks that hold at least one unmasked score; blocks where every score is unmasked
("full" blocks) are listed separately so the kernel can skip calling the mask_mod on
them. The backward pass walks the transposed lists (for each KV block, its query
blocks).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flex.masks.combinators import noop_mask
from pallas_flex.masks.mod_program import MASK, ModProgram, make_mod_program, vmap_mask

EMPTY, PARTIAL, FULL = 0, 1, 2

# Work per step of the block classifier: rows of q blocks are evaluated this many mask
# elements at a time, so a 131072 x 131072 mask never exists at once.
_CLASSIFY_ELEMENTS_PER_STEP = 1 << 26


def _normalize_block_size(block_size, argument_name="block_size") -> tuple[int, int]:
    # Messages echo the value as given (48, not the (48, 48) it expands to).
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    try:
        block_q, block_kv = pair
    except (TypeError, ValueError):
        block_q = block_kv = None
    # int() would silently truncate 16.5 or parse "16": only integers are block sizes.
    if not all(isinstance(size, (int, np.integer)) and not isinstance(size, bool)
               for size in (block_q, block_kv)):
        raise ValueError(
            f"{argument_name} must be an int or a pair (block_q, block_kv), got {block_size!r}"
        )
    block_q, block_kv = int(block_q), int(block_kv)
    for size in (block_q, block_kv):
        if size < 1 or size & (size - 1):
            raise ValueError(
                f"{argument_name} must be powers of two (kernel tiles are), got {block_size!r}"
            )
    return block_q, block_kv


def _tables(block_state: jax.Array, kind: int, xp=jnp) -> tuple[jax.Array, jax.Array]:
    """Per row of `block_state [..., rows, cols]`: how many columns are `kind`, and their
    indices first, ascending (the rest of each row is padding). `xp`: jnp, or NumPy for
    tables computed on the host."""
    selected = block_state == kind
    counts = xp.sum(selected, axis=-1, dtype=xp.int32)
    # A stable sort of "not selected" puts the selected columns first, in order.
    indices = xp.argsort(xp.logical_not(selected), axis=-1, stable=True).astype(xp.int32)
    return counts, indices


def _all_tables(block_state, xp=jnp):
    """The eight tables of a BlockMask, in its constructor's order, from block states."""
    transposed = xp.swapaxes(block_state, -1, -2)
    return (*_tables(block_state, PARTIAL, xp), *_tables(block_state, FULL, xp),
            *_tables(transposed, PARTIAL, xp), *_tables(transposed, FULL, xp))


def _state_from_tables(num_blocks, indices, num_cols, value) -> jax.Array:
    """Scatters `value` at the listed columns of each row: the inverse of `_tables`."""
    listed = jnp.arange(indices.shape[-1], dtype=jnp.int32) < num_blocks[..., None]
    state = jnp.zeros(indices.shape[:-1] + (num_cols,), jnp.int8)
    # Unlisted entries scatter to an extra column that is dropped afterwards.
    targets = jnp.where(listed, indices, num_cols)
    padded = jnp.concatenate([state, jnp.zeros(state.shape[:-1] + (1,), jnp.int8)], -1)
    padded = jnp.put_along_axis(padded, targets, jnp.int8(value), axis=-1, inplace=False)
    return padded[..., :num_cols]


def _check_kv_table(num_blocks, indices, num_name, indices_name, num_kv_blocks, kv_len,
                    block_kv):
    """Counts in [0, nKV] and listed indices in [0, nKV): ValueError when concrete, a
    checkify.debug_check when traced (`pallas_flex.paged._validation.require`)."""
    # Imported here: pallas_flex.paged imports the API, which imports this module.
    from pallas_flex.paged._validation import checking_arrays, first_true, require

    xp, (num_blocks, indices) = checking_arrays(num_blocks, indices)
    if indices.size == 0:
        return

    def first(bad):  # the index tuple of the first True entry (any one if none is)
        return xp.unravel_index(first_true(bad.reshape(-1)), bad.shape)

    bad = (num_blocks < 0) | (num_blocks > num_kv_blocks)
    where = first(bad)
    require(~xp.any(bad),
            f"{num_name}[{{b}}, {{h}}, {{q}}] = {{value}} is out of range: a query block "
            f"lists at most nKV = {num_kv_blocks} KV blocks (KV_LEN {kv_len} / block_kv "
            f"{block_kv}), so counts must be in [0, {num_kv_blocks}]",
            b=where[0], h=where[1], q=where[2], value=num_blocks[where])
    listed = xp.arange(num_kv_blocks) < num_blocks[..., None]
    bad = listed & ((indices < 0) | (indices >= num_kv_blocks))
    where = first(bad)
    require(~xp.any(bad),
            f"{indices_name}[{{b}}, {{h}}, {{q}}, {{slot}}] = {{value}} is out of range: KV "
            f"block indices must be in [0, {num_kv_blocks}) (KV_LEN {kv_len} / block_kv "
            f"{block_kv})",
            b=where[0], h=where[1], q=where[2], slot=where[3], value=indices[where])


@jax.tree_util.register_pytree_node_class
class BlockMask:
    """Block-sparse description of a mask, in the layout the kernels read.

    With `nQ = ceil(Q_LEN / block_q)` and `nKV = ceil(KV_LEN / block_kv)`, and batch and
    head dimensions `B'`, `H'` that are either the real B, H or 1 (broadcast):

      kv_num_blocks      int32 [B', H', nQ]        partial KV blocks of each query block
      kv_indices         int32 [B', H', nQ, nKV]   their indices first, ascending
      full_kv_num_blocks int32 [B', H', nQ]        full KV blocks (no mask_mod needed)
      full_kv_indices    int32 [B', H', nQ, nKV]
      q_num_blocks       int32 [B', H', nKV]       transposes, for the backward pass:
      q_indices          int32 [B', H', nKV, nQ]   query blocks of each KV block
      full_q_num_blocks  int32 [B', H', nKV]
      full_q_indices     int32 [B', H', nKV, nQ]

    A block is *full* when every score in it is unmasked and inside both sequences;
    blocks on a ragged sequence tail are therefore always partial. `mask_mod` (a traced
    `ModProgram`; its captured arrays are pytree leaves) masks the partial blocks.
    `block_size`, `seq_lengths` are static.
    """

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                 q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, *,
                 block_size: tuple[int, int], seq_lengths: tuple[int, int],
                 mask_mod: ModProgram):
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.block_size = tuple(block_size)
        self.seq_lengths = tuple(seq_lengths)
        self.mask_mod = mask_mod

    _TABLE_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")

    def tree_flatten(self):
        children = tuple(getattr(self, name) for name in self._TABLE_NAMES) + (self.mask_mod,)
        return children, (self.block_size, self.seq_lengths)

    @classmethod
    def tree_unflatten(cls, aux, children):
        block_size, seq_lengths = aux
        *tables, mask_mod = children
        return cls(*tables, block_size=block_size, seq_lengths=seq_lengths, mask_mod=mask_mod)

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_block_state(cls, block_state, *, block_size, seq_lengths, mask_mod) -> "BlockMask":
        """From an int8 `[B', H', nQ, nKV]` array of EMPTY (0), PARTIAL (1), FULL (2)."""
        return cls(*_all_tables(block_state), block_size=_normalize_block_size(block_size),
                   seq_lengths=seq_lengths, mask_mod=mask_mod)

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None,
                       full_kv_indices=None, *, block_size=128, mask_mod=None,
                       seq_lengths=None) -> "BlockMask":
        """From the KV tables alone (as PyTorch's `BlockMask.from_kv_blocks`).

        `kv_num_blocks [B', H', nQ]`, `kv_indices [B', H', nQ, nKV]` list the partial
        blocks, the optional full tables the full ones. `mask_mod` defaults to no mask;
        `seq_lengths` defaults to `(nQ * block_q, nKV * block_kv)`.

        Each count must be in `[0, nKV]` and each listed index (the first `count` of a
        row; the rest is padding, ignored) in `[0, nKV)`, the KV blocks of `KV_LEN`: a
        ValueError naming the entry when the tables are concrete, a
        `checkify.debug_check` with the same message when traced (as the paged
        metadata checks; `pallas_flex.paged.traced_checks(False)` leaves them out).
        """
        block_q, block_kv = _normalize_block_size(block_size)
        kv_num_blocks = jnp.asarray(kv_num_blocks, jnp.int32)
        kv_indices = jnp.asarray(kv_indices, jnp.int32)
        if kv_indices.ndim != 4 or kv_num_blocks.shape != kv_indices.shape[:3]:
            raise ValueError(
                "kv_indices must be [B, H, nQ, nKV] and kv_num_blocks [B, H, nQ], got "
                f"{kv_indices.shape} and {kv_num_blocks.shape}"
            )
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("full_kv_num_blocks and full_kv_indices go together")
        num_q_blocks, num_kv_blocks = kv_indices.shape[2:]
        if seq_lengths is None:
            seq_lengths = (num_q_blocks * block_q, num_kv_blocks * block_kv)
        q_len, kv_len = seq_lengths
        if -(-q_len // block_q) != num_q_blocks or -(-kv_len // block_kv) != num_kv_blocks:
            raise ValueError(
                f"seq_lengths {tuple(seq_lengths)} need {-(-q_len // block_q)} x "
                f"{-(-kv_len // block_kv)} blocks of {(block_q, block_kv)}, but kv_indices "
                f"has {num_q_blocks} x {num_kv_blocks}"
            )
        _check_kv_table(kv_num_blocks, kv_indices, "kv_num_blocks", "kv_indices",
                        num_kv_blocks, kv_len, block_kv)
        state = _state_from_tables(kv_num_blocks, kv_indices, num_kv_blocks, PARTIAL)
        if full_kv_num_blocks is not None:
            full_kv_num_blocks = jnp.asarray(full_kv_num_blocks, jnp.int32)
            full_kv_indices = jnp.asarray(full_kv_indices, jnp.int32)
            if (full_kv_indices.ndim != 4 or full_kv_num_blocks.shape != full_kv_indices.shape[:3]
                    or full_kv_indices.shape[2:] != kv_indices.shape[2:]):
                raise ValueError(
                    f"full_kv_indices must be [B, H, nQ, nKV] = [B, H, {num_q_blocks}, "
                    f"{num_kv_blocks}] (kv_indices') and full_kv_num_blocks [B, H, nQ], got "
                    f"{full_kv_indices.shape} and {full_kv_num_blocks.shape}")
            _check_kv_table(full_kv_num_blocks, full_kv_indices, "full_kv_num_blocks",
                            "full_kv_indices", num_kv_blocks, kv_len, block_kv)
            full_state = _state_from_tables(full_kv_num_blocks, full_kv_indices,
                                            num_kv_blocks, FULL)
            state = jnp.maximum(state, full_state)
        mask_program = make_mod_program(mask_mod if mask_mod is not None else noop_mask, MASK)
        return cls.from_block_state(state, block_size=(block_q, block_kv),
                                    seq_lengths=(int(q_len), int(kv_len)),
                                    mask_mod=mask_program)

    # -- views --------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B', H', Q_LEN, KV_LEN); B' and H' are 1 where the mask broadcasts."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    @property
    def num_blocks(self) -> tuple[int, int]:
        return self.kv_indices.shape[2], self.kv_indices.shape[3]

    def block_state(self) -> jax.Array:
        """int8 [B', H', nQ, nKV]: EMPTY (0), PARTIAL (1) or FULL (2) per block."""
        num_kv_blocks = self.kv_indices.shape[-1]
        partial = _state_from_tables(self.kv_num_blocks, self.kv_indices, num_kv_blocks, PARTIAL)
        full = _state_from_tables(self.full_kv_num_blocks, self.full_kv_indices,
                                  num_kv_blocks, FULL)
        return jnp.maximum(partial, full)

    def to_dense(self) -> jax.Array:
        """int32 [B', H', nQ, nKV]: 1 where a block is computed (partial or full)."""
        return (self.block_state() > EMPTY).astype(jnp.int32)

    def sparsity(self) -> float:
        """Percentage of blocks skipped (neither partial nor full)."""
        computed = jnp.sum(self.kv_num_blocks) + jnp.sum(self.full_kv_num_blocks)
        total = math.prod(self.kv_indices.shape)
        return float(100.0 * (1.0 - computed / total))

    def to_string(self, grid_size=(20, 20), limit: int = 4) -> str:
        """A picture per (batch, head): '█' full, '░' partial, ' ' skipped blocks.

        Blocks are pooled to at most `grid_size` characters per side; at most `limit`
        (batch, head) pairs are drawn.
        """
        state = np.asarray(self.block_state())
        lines = [f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                 f"sparsity={self.sparsity():.2f}%)"]
        max_rows, max_cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
        drawn = 0
        for b in range(state.shape[0]):
            for h in range(state.shape[1]):
                if drawn == limit:
                    lines.append("...")
                    return "\n".join(lines)
                lines.append(f"b={b}, h={h}")
                lines.extend(_draw(state[b, h], max_rows, max_cols))
                drawn += 1
        return "\n".join(lines)

    def __str__(self):
        return self.to_string()

    def __repr__(self):
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"mask_mod={self.mask_mod.name})")

    def plot(self, ax=None, batch: int = 0, head: int = 0):
        """Draws one (batch, head) block pattern with matplotlib; returns the axes."""
        import matplotlib.pyplot as plt  # Optional dependency: only needed to plot.

        if ax is None:
            _, ax = plt.subplots(figsize=(4, 4))
        state = np.asarray(self.block_state()[batch, head])
        ax.imshow(state, cmap="Blues", vmin=0, vmax=2, interpolation="nearest")
        ax.set_xlabel(f"KV block ({self.block_size[1]} keys)")
        ax.set_ylabel(f"Q block ({self.block_size[0]} queries)")
        ax.set_title(f"{self.mask_mod.name}: {self.sparsity():.1f}% sparse")
        return ax

    def clip_to_lengths(self, lengths) -> "BlockMask":
        """This BlockMask per batch row with blocks at or past `lengths[b]` dropped and
        a full block that crosses it made partial, so that the kernels check the length
        on partial tiles only and skip the empty tail of short rows (the paged prefill).

        A few elementwise ops and sums on the KV tables: their listed indices are
        ascending, so the blocks below a length are a prefix of each list and clipping
        shortens the counts; the one full block that can cross the length moves to the
        end of the partial list (after every partial block below it, so that list stays
        ascending). The result is forward-only: its transposed (backward) tables are
        None. On the H100 (prefill of 2048 new tokens on 8192, B4 H16 D128, paired rounds,
        f908cd9:benchmarks/results/2026-11-23-h100-paged-mosaic.json) this costs 1.1-1.6 % of the
        0.8 ms call; rebuilding all tables from the block state with sorts and scatters
        cost 1.9-3.7 %.
        """
        block_kv = self.block_size[1]
        batch = lengths.shape[0]
        length = lengths.astype(jnp.int32)[:, None, None, None]

        def per_row(table):
            return jnp.broadcast_to(table, (batch,) + table.shape[1:])

        full_num = per_row(self.full_kv_num_blocks)
        full_indices = per_row(self.full_kv_indices)
        partial_num = per_row(self.kv_num_blocks)
        partial_indices = per_row(self.kv_indices)
        position = jnp.arange(full_indices.shape[-1], dtype=jnp.int32)
        full_listed = position < full_num[..., None]
        full_start = full_indices * block_kv
        full_below = full_listed & (full_start + block_kv <= length)
        crossing = jnp.any(full_listed & (full_start < length) & ~full_below, axis=-1)
        partial_below = ((position < partial_num[..., None])
                         & (partial_indices * block_kv < length))
        num_partial = jnp.sum(partial_below, axis=-1, dtype=jnp.int32)
        partial_indices = jnp.where(crossing[..., None] & (position == num_partial[..., None]),
                                    length // block_kv, partial_indices)
        return BlockMask(num_partial + crossing.astype(jnp.int32), partial_indices,
                         jnp.sum(full_below, axis=-1, dtype=jnp.int32), full_indices,
                         None, None, None, None, block_size=self.block_size,
                         seq_lengths=self.shape[2:], mask_mod=self.mask_mod)

    def __getitem__(self, index) -> "BlockMask":
        """Slices batch, head and query-block dimensions: `bm[0]`, `bm[:, 2]`,
        `bm[0, 0, :4]`. Integers keep their dimension (size 1). Slicing query blocks
        shortens Q_LEN.

        The slice describes attention for the selected rows alone (e.g. `bm[:, :, i:i+1]`
        for a decode step over query block i): kernels number batch, heads and queries
        of their inputs from 0, so the sliced mask_mod is shifted to see the original
        `b`, `h` and `q_idx` of the rows it came from."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > 3:
            raise ValueError(f"BlockMask index takes at most 3 axes (B, H, q-block), got {index}")
        normalized = []
        for axis, entry in enumerate(index):
            size = self.kv_num_blocks.shape[axis]
            if isinstance(entry, (int, np.integer)):
                if not -size <= entry < size:
                    raise ValueError(f"BlockMask index {entry} out of range for axis {axis} "
                                     f"of size {size}")
                entry = slice(int(entry) % size, int(entry) % size + 1)
            elif not isinstance(entry, slice) or entry.step not in (None, 1):
                raise ValueError(f"BlockMask index must be ints or unit-step slices, got {index}")
            normalized.append(entry)
        normalized = tuple(normalized)
        q_len = self.seq_lengths[0]
        if len(normalized) == 3:
            start, stop, _ = normalized[2].indices(self.num_blocks[0])
            q_len = max(0, min(stop * self.block_size[0], q_len) - start * self.block_size[0])
        starts = [entry.indices(self.kv_num_blocks.shape[axis])[0]
                  for axis, entry in enumerate(normalized)] + [0] * (3 - len(normalized))
        batch_start, head_start, q_start = starts[0], starts[1], starts[2] * self.block_size[0]
        mask_mod = self.mask_mod
        if batch_start or head_start or q_start:
            original = self.mask_mod

            def shifted(b, h, q_idx, kv_idx):
                return original(b + batch_start, h + head_start, q_idx + q_start, kv_idx)

            shifted.__name__ = original.name
            mask_mod = make_mod_program(shifted, MASK)
        kv_num_blocks = self.kv_num_blocks[normalized]
        return BlockMask.from_kv_blocks(
            kv_num_blocks, self.kv_indices[normalized],
            self.full_kv_num_blocks[normalized], self.full_kv_indices[normalized],
            block_size=self.block_size, mask_mod=mask_mod,
            seq_lengths=(q_len, self.seq_lengths[1]))


def _draw(state: np.ndarray, max_rows: int, max_cols: int) -> list[str]:
    rows, cols = state.shape
    row_step, col_step = -(-rows // max_rows), -(-cols // max_cols)
    symbols = {EMPTY: " ", PARTIAL: "░", FULL: "█"}
    out = []
    for r in range(0, rows, row_step):
        line = []
        for c in range(0, cols, col_step):
            tile = state[r:r + row_step, c:c + col_step]
            value = FULL if (tile == FULL).all() else PARTIAL if tile.any() else EMPTY
            line.append(symbols[value] * 2)
        out.append("|" + "".join(line) + "|")
    return out


# -- building from a mask_mod -------------------------------------------------------------

def _classify_blocks(program: ModProgram, batch: int, heads: int, q_len: int, kv_len: int,
                     block_q: int, block_kv: int) -> jax.Array:
    """int8 [batch, heads, nQ, nKV] block states, one row of q blocks at a time."""
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
    mask = vmap_mask(program)
    kv_idx = jnp.arange(num_kv_blocks * block_kv, dtype=jnp.int32)
    kv_valid = kv_idx < kv_len
    # Indices handed to a mod are always in range: clamp, then mask the tail out.
    kv_clamped = jnp.minimum(kv_idx, kv_len - 1)

    # Rows past Q_LEN are never evaluated: with one block of queries (decoding) only the
    # Q_LEN real ones are (1 of 128 rows for one new token), and a block holding any
    # padding row is partial whatever the mod says (the tail rule above).
    evaluated_rows = block_q if num_q_blocks > 1 else q_len

    def classify_row(flat_row):
        b, rest = jnp.divmod(flat_row, heads * num_q_blocks)
        h, q_block = jnp.divmod(rest, num_q_blocks)
        q_idx = q_block * block_q + jnp.arange(evaluated_rows, dtype=jnp.int32)
        valid = (q_idx < q_len)[:, None] & kv_valid[None, :]
        allowed = mask(b, h, jnp.minimum(q_idx, q_len - 1), kv_clamped) & valid
        allowed = allowed.reshape(evaluated_rows, num_kv_blocks, block_kv)
        valid = valid.reshape(evaluated_rows, num_kv_blocks, block_kv)
        any_allowed = jnp.any(allowed, axis=(0, 2))
        whole_block = (q_block + 1) * block_q <= q_len
        all_allowed = (jnp.all(allowed | ~valid, axis=(0, 2)) & jnp.all(valid, axis=(0, 2))
                       & whole_block)
        return jnp.where(all_allowed, FULL, jnp.where(any_allowed, PARTIAL, EMPTY)).astype(jnp.int8)

    rows = batch * heads * num_q_blocks
    rows_per_step = max(1, _CLASSIFY_ELEMENTS_PER_STEP
                        // (evaluated_rows * num_kv_blocks * block_kv))
    states = jax.lax.map(classify_row, jnp.arange(rows, dtype=jnp.int32),
                         batch_size=min(rows, rows_per_step))
    return states.reshape(batch, heads, num_q_blocks, num_kv_blocks)


def _build(program, batch, heads, q_len, kv_len, block_q, block_kv):
    state = _classify_blocks(program, batch, heads, q_len, kv_len, block_q, block_kv)
    return BlockMask.from_block_state(state, block_size=(block_q, block_kv),
                                      seq_lengths=(q_len, kv_len), mask_mod=program)


_build_jitted = jax.jit(_build, static_argnums=(1, 2, 3, 4, 5, 6))


def noop_block_mask(q_len: int, kv_len: int, block_size=128, *, device=None) -> BlockMask:
    """The BlockMask of no mask, with nothing to compute: every block full, except those
    on a ragged sequence tail (partial). Its tables come from NumPy (cached by shape), so
    a call without a mask runs no mod and no device op to build them: under `jit` they
    are constants of the program; with `device` (a call's concrete inputs live there)
    small tables are kept on that device and reused across calls."""
    block_q, block_kv = _normalize_block_size(block_size)
    tables = _noop_tables(int(q_len), int(kv_len), block_q, block_kv)
    if device is not None and tables[1].size <= _CACHED_NOOP_ENTRIES:
        tables = _noop_tables_on(int(q_len), int(kv_len), block_q, block_kv, device)
    return BlockMask(*tables, block_size=(block_q, block_kv), seq_lengths=(q_len, kv_len),
                     mask_mod=_noop_program())


# Tables of at most this many entries each stay on the device between calls (decode's
# single row of query blocks always does; a 128k x 128k prefill's 4 MiB tables do not).
_CACHED_NOOP_ENTRIES = 1 << 16


@functools.lru_cache(maxsize=None)
def _noop_program() -> ModProgram:
    return make_mod_program(noop_mask, MASK)


@functools.lru_cache(maxsize=64)
def _noop_tables(q_len, kv_len, block_q, block_kv):
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
    state = np.full((num_q_blocks, num_kv_blocks), FULL, np.int8)
    if q_len % block_q:
        state[-1] = PARTIAL
    if kv_len % block_kv:
        state[:, -1] = PARTIAL
    return _all_tables(state[None, None], xp=np)


@functools.lru_cache(maxsize=16)
def _noop_tables_on(q_len, kv_len, block_q, block_kv, device):
    return tuple(jax.device_put(table, device)
                 for table in _noop_tables(q_len, kv_len, block_q, block_kv))


def _check_size(value, name, allow_none):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, "
                         f"got {value!r}")
    return int(value)


def create_block_mask(mask_mod: Callable | ModProgram | None, B: int | None, H: int | None,
                      Q_LEN: int, KV_LEN: int, *, block_size=128) -> BlockMask:
    """Builds the BlockMask of `mask_mod` over `[B, H, Q_LEN, KV_LEN]`.

    `B=None` / `H=None` broadcast over that axis (the mask must then not depend on
    `b` / `h`). Runs on device, works under `jit`, and evaluates the mask one row of
    query blocks at a time, never holding the dense Q_LEN x KV_LEN mask.

    Example:
      >>> bm = create_block_mask(pf.masks.causal_mask, None, None, 4096, 4096)
      >>> bm.sparsity()  # about 48.4
    """
    program = make_mod_program(mask_mod if mask_mod is not None else noop_mask, MASK)
    batch = _check_size(B, "B", allow_none=True)
    heads = _check_size(H, "H", allow_none=True)
    q_len = _check_size(Q_LEN, "Q_LEN", allow_none=False)
    kv_len = _check_size(KV_LEN, "KV_LEN", allow_none=False)
    block_q, block_kv = _normalize_block_size(block_size)
    if batch is None and program.uses_batch:
        raise ValueError(f"B=None broadcasts over batch, but mask_mod {program.name!r} reads b")
    if heads is None and program.uses_head:
        raise ValueError(f"H=None broadcasts over heads, but mask_mod {program.name!r} reads h")
    return _build_jitted(program, batch or 1, heads or 1, q_len, kv_len, block_q, block_kv)
