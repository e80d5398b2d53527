"""BlockMask against a NumPy brute force: the dense mask built with broadcasting, block
states and tables derived from it in NumPy, never by calling BlockMask code.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.masks.block_mask import BlockMask


EMPTY, PARTIAL, FULL = 0, 1, 2


# ---------------------------------------------------------------------------------------
# The brute force


def dense_mask(oracle, batch, heads, q_len, kv_len):
    """oracle(b, h, q, kv) on broadcast NumPy index grids: bool [batch, heads, Q, KV]."""
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    q = np.arange(q_len)[None, None, :, None]
    kv = np.arange(kv_len)[None, None, None, :]
    return np.broadcast_to(oracle(b, h, q, kv), (batch, heads, q_len, kv_len)).astype(bool)


def expected_block_state(dense, block_q, block_kv):
    """EMPTY / PARTIAL / FULL per block; FULL needs every score of a block that lies
    entirely inside both sequences to be unmasked."""
    batch, heads, q_len, kv_len = dense.shape
    num_q, num_kv = -(-q_len // block_q), -(-kv_len // block_kv)
    state = np.zeros((batch, heads, num_q, num_kv), np.int8)
    for i in range(num_q):
        for j in range(num_kv):
            rows = slice(i * block_q, (i + 1) * block_q)
            cols = slice(j * block_kv, (j + 1) * block_kv)
            tile = dense[:, :, rows, cols]
            inside = (i + 1) * block_q <= q_len and (j + 1) * block_kv <= kv_len
            any_true = tile.any(axis=(2, 3))
            all_true = tile.all(axis=(2, 3)) & inside
            state[:, :, i, j] = np.where(all_true, FULL, np.where(any_true, PARTIAL, EMPTY))
    return state


def assert_tables_match(num_blocks, indices, state, kind):
    """Each row lists exactly the `kind` columns of `state`, first and ascending."""
    num_blocks, indices = np.asarray(num_blocks), np.asarray(indices)
    assert num_blocks.dtype == np.int32 and indices.dtype == np.int32
    assert num_blocks.shape == state.shape[:-1]
    assert indices.shape == state.shape
    for position in np.ndindex(*state.shape[:-1]):
        expected = np.flatnonzero(state[position] == kind)
        count = num_blocks[position]
        assert count == len(expected), (position, count, expected)
        np.testing.assert_array_equal(indices[position][:count], expected, err_msg=str(position))


def assert_block_mask_matches(block_mask, state):
    """All eight tables, block_state, to_dense and sparsity against a NumPy state."""
    np.testing.assert_array_equal(np.asarray(block_mask.block_state()), state)
    assert_tables_match(block_mask.kv_num_blocks, block_mask.kv_indices, state, PARTIAL)
    assert_tables_match(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, state, FULL)
    transposed = np.swapaxes(state, -1, -2)
    assert_tables_match(block_mask.q_num_blocks, block_mask.q_indices, transposed, PARTIAL)
    assert_tables_match(block_mask.full_q_num_blocks, block_mask.full_q_indices, transposed,
                        FULL)
    dense_blocks = np.asarray(block_mask.to_dense())
    np.testing.assert_array_equal(dense_blocks, (state != EMPTY).astype(np.int32))
    expected_sparsity = 100.0 * np.count_nonzero(state == EMPTY) / state.size
    assert block_mask.sparsity() == pytest.approx(expected_sparsity, abs=1e-4)


# ---------------------------------------------------------------------------------------
# Mods and their NumPy oracles (written from the definitions)

def _document_ids(length, seed):
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, 5, size=length)).astype(np.int32)


def _random_looking(b, h, q_idx, kv_idx):
    return (q_idx * 7 + kv_idx * 3) % 5 != 0


def _per_batch_and_head(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx + 20 * h - 30 * b) & ((q_idx + kv_idx + h) % 3 != 0)


def _cases(q_len, kv_len):
    """name -> (mask_mod, numpy oracle, B, H)."""
    q_ids, kv_ids = _document_ids(q_len, 1), _document_ids(kv_len, 2)
    return {
        "causal": (masks.causal_mask, lambda b, h, q, kv: q >= kv, None, None),
        "sliding_window": (masks.sliding_window(20),
                           lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 20), None, None),
        "document": (masks.document_mask(jnp.asarray(q_ids), jnp.asarray(kv_ids)),
                     lambda b, h, q, kv: q_ids[q] == kv_ids[kv], None, None),
        "random_looking": (_random_looking, lambda b, h, q, kv: (q * 7 + kv * 3) % 5 != 0,
                           None, None),
        "per_batch_and_head": (
            _per_batch_and_head,
            lambda b, h, q, kv: (kv <= q + 20 * h - 30 * b) & ((q + kv + h) % 3 != 0), 2, 3),
    }


MOD_NAMES = list(_cases(4, 4))
LENGTHS = [(64, 64), (70, 45), (33, 100)]
BLOCK_SIZES = [16, (16, 32), (32, 16)]


# Each mod meets every length pair and every block size, in a Latin-square rotation (the
# full product costs one compile per case for little extra coverage).
ROTATION = [pytest.param(name, q_len, kv_len, BLOCK_SIZES[(i + j) % len(BLOCK_SIZES)],
                         id=f"{name}-{q_len}x{kv_len}-{BLOCK_SIZES[(i + j) % len(BLOCK_SIZES)]}")
            for i, name in enumerate(MOD_NAMES) for j, (q_len, kv_len) in enumerate(LENGTHS)]


@pytest.mark.parametrize("name,q_len,kv_len,block_size", ROTATION)
def test_block_mask_matches_brute_force(name, q_len, kv_len, block_size):
    mask_mod, oracle, batch, heads = _cases(q_len, kv_len)[name]
    block_q, block_kv = (block_size, block_size) if isinstance(block_size, int) else block_size
    block_mask = pf.create_block_mask(mask_mod, batch, heads, q_len, kv_len,
                                      block_size=block_size)
    dense = dense_mask(oracle, batch or 1, heads or 1, q_len, kv_len)
    state = expected_block_state(dense, block_q, block_kv)
    assert block_mask.shape == (batch or 1, heads or 1, q_len, kv_len)
    assert block_mask.block_size == (block_q, block_kv)
    assert block_mask.seq_lengths == (q_len, kv_len)
    assert block_mask.num_blocks == (math.ceil(q_len / block_q), math.ceil(kv_len / block_kv))
    assert_block_mask_matches(block_mask, state)


def test_brute_force_sees_every_state():
    """The parametrized cases above would be weak if some state never appeared."""
    _, oracle, *_ = _cases(70, 45)["causal"]
    state = expected_block_state(dense_mask(oracle, 1, 1, 70, 45), 16, 16)
    assert {EMPTY, PARTIAL, FULL} <= set(np.unique(state).tolist())
    # The ragged last row of blocks is entirely inside the causal triangle, yet partial.
    assert np.all(state[0, 0, -1, :-1] == PARTIAL)


# ---------------------------------------------------------------------------------------
# Broadcasting over batch and heads


def test_none_batch_and_heads_broadcast_as_size_one():
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 48, 48, block_size=16)
    assert block_mask.shape == (1, 1, 48, 48)
    assert block_mask.kv_num_blocks.shape == (1, 1, 3)
    assert block_mask.kv_indices.shape == (1, 1, 3, 3)
    assert block_mask.q_indices.shape == (1, 1, 3, 3)


def test_mask_reading_h_needs_heads():
    def head_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + h

    with pytest.raises(ValueError, match=r"H=None.*reads h"):
        pf.create_block_mask(head_mask, None, None, 32, 32, block_size=16)
    with pytest.raises(ValueError, match=r"B=None.*reads b"):
        pf.create_block_mask(_per_batch_and_head, None, 3, 32, 32, block_size=16)


def test_given_batch_and_heads_build_full_dims_that_differ():
    batch, heads, q_len, kv_len = 2, 3, 50, 40
    block_mask = pf.create_block_mask(_per_batch_and_head, batch, heads, q_len, kv_len,
                                      block_size=16)
    _, oracle, *_ = _cases(q_len, kv_len)["per_batch_and_head"]
    state = expected_block_state(dense_mask(oracle, batch, heads, q_len, kv_len), 16, 16)
    # The oracle itself differs across b and h, so a broadcast answer would fail below.
    assert not np.array_equal(state[0, 0], state[1, 0])
    assert not np.array_equal(state[0, 0], state[0, 2])
    assert block_mask.kv_num_blocks.shape == (batch, heads, 4)
    assert_block_mask_matches(block_mask, state)


def test_given_batch_and_heads_for_a_mask_ignoring_them_repeats_the_pattern():
    block_mask = pf.create_block_mask(masks.causal_mask, 2, 3, 40, 40, block_size=16)
    state = expected_block_state(dense_mask(lambda b, h, q, kv: q >= kv, 2, 3, 40, 40), 16, 16)
    assert block_mask.shape == (2, 3, 40, 40)
    assert_block_mask_matches(block_mask, state)


# ---------------------------------------------------------------------------------------
# from_kv_blocks


def _all_tables(block_mask):
    return [np.asarray(getattr(block_mask, name)) for name in BlockMask._TABLE_NAMES]


def test_from_kv_blocks_round_trip():
    block_mask = pf.create_block_mask(_per_batch_and_head, 2, 3, 70, 45, block_size=(32, 16))
    rebuilt = BlockMask.from_kv_blocks(
        block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices, block_size=block_mask.block_size,
        mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths)
    assert rebuilt.shape == block_mask.shape
    assert rebuilt.block_size == block_mask.block_size
    for name, original, copy in zip(BlockMask._TABLE_NAMES, _all_tables(block_mask),
                                    _all_tables(rebuilt)):
        np.testing.assert_array_equal(copy, original, err_msg=name)


def test_from_kv_blocks_from_hand_written_tables():
    """PyTorch-style tables: padding entries past the count are ignored whatever they hold."""
    kv_num_blocks = np.array([[[1, 1, 0]]], np.int32)
    kv_indices = np.array([[[[2, 2, 2], [0, 0, 1], [1, 1, 1]]]], np.int32)
    full_kv_num_blocks = np.array([[[0, 1, 2]]], np.int32)
    full_kv_indices = np.array([[[[1, 1, 1], [1, 2, 0], [0, 2, 2]]]], np.int32)
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks,
                                          full_kv_indices, block_size=16)
    expected = np.array([[[[EMPTY, EMPTY, PARTIAL],
                           [PARTIAL, FULL, EMPTY],
                           [FULL, EMPTY, FULL]]]], np.int8)
    assert block_mask.shape == (1, 1, 48, 48)  # default lengths: whole blocks
    assert_block_mask_matches(block_mask, expected)
    # Without full tables every listed block is partial.
    partial_only = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, block_size=(16, 32),
                                            seq_lengths=(40, 90))
    assert partial_only.shape == (1, 1, 40, 90)
    assert_block_mask_matches(partial_only, np.where(expected == PARTIAL, PARTIAL, EMPTY))


def test_from_kv_blocks_rejects_inconsistent_tables():
    with pytest.raises(ValueError, match="kv_indices"):
        BlockMask.from_kv_blocks(np.zeros((1, 1, 3), np.int32), np.zeros((1, 1, 2, 3), np.int32))
    with pytest.raises(ValueError, match="seq_lengths"):
        BlockMask.from_kv_blocks(np.zeros((1, 1, 3), np.int32), np.zeros((1, 1, 3, 3), np.int32),
                                 block_size=16, seq_lengths=(100, 48))
    with pytest.raises(ValueError, match="full_kv_num_blocks"):
        BlockMask.from_kv_blocks(np.zeros((1, 1, 3), np.int32), np.zeros((1, 1, 3, 3), np.int32),
                                 np.zeros((1, 1, 3), np.int32))


_GOOD_NUM = np.array([[[1, 1, 0]]], np.int32)
_GOOD_INDICES = np.array([[[[2, 2, 2], [0, 0, 1], [1, 1, 1]]]], np.int32)
BAD_KV_TABLES = {
    # name: (kv_num_blocks, kv_indices, full tables or None, message); KV_LEN 48, block 16.
    "index_past_kv_len": (_GOOD_NUM, np.where(np.arange(3) == 0, 3, _GOOD_INDICES), None,
                          r"kv_indices\[0, 0, 0, 0\] = 3 is out of range: KV block indices "
                          r"must be in \[0, 3\) \(KV_LEN 48 / block_kv 16\)"),
    "negative_index": (_GOOD_NUM, np.where(np.arange(3) == 0, -1, _GOOD_INDICES), None,
                       r"kv_indices\[0, 0, 0, 0\] = -1 is out of range"),
    "count_past_width": (np.array([[[1, 4, 0]]], np.int32), _GOOD_INDICES, None,
                         r"kv_num_blocks\[0, 0, 1\] = 4 is out of range: a query block lists "
                         r"at most nKV = 3 KV blocks \(KV_LEN 48 / block_kv 16\), so counts "
                         r"must be in \[0, 3\]"),
    "negative_count": (np.array([[[1, -1, 0]]], np.int32), _GOOD_INDICES, None,
                       r"kv_num_blocks\[0, 0, 1\] = -1 is out of range"),
    "full_index_past_kv_len": (_GOOD_NUM, _GOOD_INDICES,
                               (np.array([[[0, 1, 0]]], np.int32),
                                np.array([[[[0, 0, 0], [9, 0, 0], [0, 0, 0]]]], np.int32)),
                               r"full_kv_indices\[0, 0, 1, 0\] = 9 is out of range"),
}


@pytest.mark.parametrize("case", BAD_KV_TABLES)
def test_from_kv_blocks_rejects_out_of_range_entries(case):
    """An index past KV_LEN's blocks (or negative), or a count past the width, is a
    ValueError eagerly (it used to be dropped silently) and a checkify error under jit."""
    from jax.experimental import checkify

    num, indices, full, message = BAD_KV_TABLES[case]
    full = full or (None, None)
    with pytest.raises(ValueError, match=message):
        BlockMask.from_kv_blocks(num, indices, *full, block_size=16)
    build = jax.jit(lambda *tables: BlockMask.from_kv_blocks(*tables, block_size=16))
    error, _ = checkify.checkify(build)(num, indices, *full)
    assert error.get() is not None and re.search(message, error.get()), error.get()
    # Padding past a row's count is ignored whatever it holds.
    error, _ = checkify.checkify(build)(_GOOD_NUM, np.where(_GOOD_NUM[..., None] <= np.arange(3),
                                                            99, _GOOD_INDICES))
    assert error.get() is None


def test_from_kv_blocks_rejects_full_tables_of_another_shape():
    with pytest.raises(ValueError, match=r"full_kv_indices must be \[B, H, nQ, nKV\] = "
                                         r"\[B, H, 3, 3\]"):
        BlockMask.from_kv_blocks(_GOOD_NUM, _GOOD_INDICES, np.zeros((1, 1, 2), np.int32),
                                 np.zeros((1, 1, 2, 3), np.int32), block_size=16)


# ---------------------------------------------------------------------------------------
# Slicing


@pytest.fixture(scope="module")
def sliced_source():
    """B=2, H=3, Q_LEN=70 (five 16-row blocks, the last one ragged), KV_LEN=45."""
    block_mask = pf.create_block_mask(_per_batch_and_head, 2, 3, 70, 45, block_size=16)
    _, oracle, *_ = _cases(70, 45)["per_batch_and_head"]
    state = expected_block_state(dense_mask(oracle, 2, 3, 70, 45), 16, 16)
    return block_mask, state


def test_getitem_batch_and_head(sliced_source):
    block_mask, state = sliced_source
    first_batch = block_mask[0]
    assert first_batch.shape == (1, 3, 70, 45)
    assert_block_mask_matches(first_batch, state[0:1])
    second_head = block_mask[:, 1]
    assert second_head.shape == (2, 1, 70, 45)
    assert_block_mask_matches(second_head, state[:, 1:2])
    last_batch, last_head = block_mask[-1], block_mask[:, -1]
    assert_block_mask_matches(last_batch, state[1:2])
    assert_block_mask_matches(last_head, state[:, 2:3])
    assert_block_mask_matches(block_mask[-2, -3], state[0:1, 0:1])


def test_getitem_query_blocks(sliced_source):
    block_mask, state = sliced_source
    middle = block_mask[0, 0, 1:3]
    assert middle.shape == (1, 1, 32, 45)
    assert middle.seq_lengths == (32, 45)
    assert middle.num_blocks == (2, 3)
    assert_block_mask_matches(middle, state[0:1, 0:1, 1:3])
    # The ragged last block keeps its real length: 70 - 3 * 16 = 22 rows.
    tail = block_mask[1, 2, 3:]
    assert tail.shape == (1, 1, 22, 45)
    assert tail.num_blocks == (2, 3)
    assert_block_mask_matches(tail, state[1:2, 2:3, 3:])
    negative = block_mask[:, :, -1:]
    assert negative.shape == (2, 3, 6, 45)
    assert_block_mask_matches(negative, state[:, :, -1:])


@pytest.mark.parametrize("index", [2, -3, (0, 3), (0, 0, 5), (slice(None), -4)], ids=str)
def test_getitem_out_of_range_int_raises(sliced_source, index):
    block_mask, _ = sliced_source
    with pytest.raises(ValueError, match="out of range"):
        block_mask[index]


def test_getitem_rejects_steps_and_extra_axes(sliced_source):
    block_mask, _ = sliced_source
    with pytest.raises(ValueError, match="unit-step"):
        block_mask[0, 0, ::2]
    with pytest.raises(ValueError, match="at most 3"):
        block_mask[0, 0, 0, 0]


# ---------------------------------------------------------------------------------------
# Pictures


def test_to_string_draws_one_line_per_block_row():
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 64, 64, block_size=16)
    text = block_mask.to_string()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows == ["|░░      |", "|██░░    |", "|████░░  |", "|██████░░|"]
    assert "b=0, h=0" in text

    # Non-square blocks and a ragged tail: 3 rows of 32 queries over 6 columns of 16 keys.
    window = pf.create_block_mask(masks.causal_mask, None, None, 70, 96, block_size=(32, 16))
    state = expected_block_state(dense_mask(lambda b, h, q, kv: q >= kv, 1, 1, 70, 96), 32, 16)
    symbols = {EMPTY: "  ", PARTIAL: "░░", FULL: "██"}
    expected_rows = ["|" + "".join(symbols[s] for s in row) + "|" for row in state[0, 0]]
    assert [line for line in window.to_string().splitlines()
            if line.startswith("|")] == expected_rows
    assert "█" in "".join(expected_rows) and "░" in "".join(expected_rows)


def test_plot_returns_axes_showing_the_block_state():
    import matplotlib  # here: the GPU machine, which collects this module, lacks it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes

    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 64, 48, block_size=16)
    ax = block_mask.plot()
    try:
        assert isinstance(ax, Axes)
        expected = expected_block_state(dense_mask(lambda b, h, q, kv: q >= kv, 1, 1, 64, 48),
                                        16, 16)[0, 0]
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), expected)
    finally:
        plt.close(ax.figure)


# ---------------------------------------------------------------------------------------
# Pytree and jit


def test_leaves_are_the_tables_and_the_captured_arrays():
    ids = _document_ids(40, 3)
    block_mask = pf.create_block_mask(masks.document_mask(jnp.asarray(ids)), None, None, 40, 40,
                                      block_size=16)
    leaves = jax.tree.leaves(block_mask)
    assert len(leaves) == 9
    for leaf, name in zip(leaves, BlockMask._TABLE_NAMES):
        assert leaf is getattr(block_mask, name)
    np.testing.assert_array_equal(np.asarray(leaves[8]), ids)
    assert len(jax.tree.leaves(pf.create_block_mask(masks.causal_mask, None, None, 40, 40,
                                                    block_size=16))) == 8
    rebuilt = jax.tree.unflatten(jax.tree.structure(block_mask), leaves)
    assert rebuilt.block_size == (16, 16) and rebuilt.seq_lengths == (40, 40)
    assert_block_mask_matches(
        rebuilt, expected_block_state(dense_mask(lambda b, h, q, kv: ids[q] == ids[kv],
                                                 1, 1, 40, 40), 16, 16))


def test_passes_through_jit_without_retracing_for_new_captured_values():
    traces = []

    @jax.jit
    def computed_blocks(block_mask):
        traces.append(1)
        return jnp.sum(block_mask.kv_num_blocks) + jnp.sum(block_mask.full_kv_num_blocks)

    for seed in (4, 5):
        ids = _document_ids(64, seed)
        block_mask = pf.create_block_mask(masks.document_mask(jnp.asarray(ids)), None, None,
                                          64, 64, block_size=16)
        state = expected_block_state(
            dense_mask(lambda b, h, q, kv: ids[q] == ids[kv], 1, 1, 64, 64), 16, 16)
        assert int(computed_blocks(block_mask)) == np.count_nonzero(state)
    assert len(traces) == 1


def test_create_block_mask_under_jit_with_traced_captures():
    traces = []

    @jax.jit
    def build(ids):
        traces.append(1)
        return pf.create_block_mask(masks.document_mask(ids), None, None, 50, 50, block_size=16)

    for seed in (6, 7):
        ids = _document_ids(50, seed)
        block_mask = build(jnp.asarray(ids))
        np.testing.assert_array_equal(np.asarray(block_mask.mask_mod.consts[0]), ids)
        assert_block_mask_matches(block_mask, expected_block_state(
            dense_mask(lambda b, h, q, kv: ids[q] == ids[kv], 1, 1, 50, 50), 16, 16))
    assert len(traces) == 1


LARGE = 32768


def test_large_causal_mask_builds_without_the_dense_mask(xla_cpu_optimized):
    """Row i of a causal mask over aligned blocks: block i partial (the diagonal), blocks
    0..i-1 full. A dense bool mask would be LARGE**2 bytes; the build holds far less.
    (Compiled with XLA's optimizations: the build evaluates the mask_mod at LARGE**2
    positions, which takes ~40 s at backend level 0 and ~2 s optimized.)"""
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, LARGE, LARGE,
                                      block_size=128)
    n = LARGE // 128
    rows = np.arange(n)
    assert block_mask.kv_indices.shape == (1, 1, n, n)
    assert block_mask.q_indices.shape == (1, 1, n, n)
    np.testing.assert_array_equal(np.asarray(block_mask.kv_num_blocks)[0, 0], np.ones(n))
    np.testing.assert_array_equal(np.asarray(block_mask.kv_indices)[0, 0, :, 0], rows)
    np.testing.assert_array_equal(np.asarray(block_mask.full_kv_num_blocks)[0, 0], rows)
    full_kv_indices = np.asarray(block_mask.full_kv_indices)[0, 0]
    lower = rows[None, :] < rows[:, None]
    np.testing.assert_array_equal(np.where(lower, full_kv_indices, -1),
                                  np.where(lower, rows[None, :], -1))
    np.testing.assert_array_equal(np.asarray(block_mask.q_num_blocks)[0, 0], np.ones(n))
    np.testing.assert_array_equal(np.asarray(block_mask.q_indices)[0, 0, :, 0], rows)
    np.testing.assert_array_equal(np.asarray(block_mask.full_q_num_blocks)[0, 0], n - 1 - rows)
    full_q_indices = np.asarray(block_mask.full_q_indices)[0, 0]
    # Column j is full for query blocks j+1 .. n-1, listed first.
    listed = rows[None, :] < (n - 1 - rows)[:, None]
    np.testing.assert_array_equal(np.where(listed, full_q_indices, -1),
                                  np.where(listed, rows[None, :] + rows[:, None] + 1, -1))
    assert block_mask.sparsity() == pytest.approx(100.0 * (n * (n - 1) / 2) / n**2)

    # The whole build, compiled as one program: its scratch memory stays well below even a
    # bool dense mask (LARGE**2 bytes; about 0.19 of that at LARGE = 32768).
    build = jax.jit(lambda: pf.create_block_mask(masks.causal_mask, None, None, LARGE, LARGE,
                                                 block_size=128))
    memory = build.lower().compile().memory_analysis()
    assert memory is not None
    assert memory.temp_size_in_bytes < LARGE * LARGE // 4


def test_query_block_slice_attends_like_the_same_rows_of_the_full_mask():
    """A q-block slice (e.g. for one decode/chunk step) evaluates its mask_mod at the
    original query positions, so attention over those rows alone matches the full call."""
    document_ids = jnp.asarray(np.arange(64) // 10, jnp.int32)
    mask_mod = pf.and_masks(pf.masks.causal_mask, pf.masks.document_mask(document_ids))
    full_mask = pf.create_block_mask(mask_mod, None, None, 64, 64, block_size=16)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, 64, 2, 16)) for key in keys)
    options = {"block_q": 16, "block_kv": 16}
    full = pf.flex_attention(q, k, v, block_mask=full_mask, backend="interpret",
                             kernel_options=options)
    rows = pf.flex_attention(q[:, 32:48], k, v, block_mask=full_mask[:, :, 2:3],
                             backend="interpret", kernel_options=options)
    np.testing.assert_allclose(rows, full[:, 32:48], atol=1e-6)


@pytest.mark.parametrize("q_len,kv_len,block_size", [
    (1, 1000, 128), (256, 256, 128), (300, 130, 128), (17, 250, (16, 32)), (128, 129, 64)])
def test_the_no_mask_block_mask_equals_the_built_one(q_len, kv_len, block_size):
    """`noop_block_mask` (NumPy tables, cached) lists exactly what create_block_mask(None)
    builds on the device, ragged tails partial, on the host or on a device."""
    from pallas_flex.masks.block_mask import noop_block_mask

    built = pf.create_block_mask(None, None, None, q_len, kv_len, block_size=block_size)
    for device in (None, jax.devices()[0]):
        cheap = noop_block_mask(q_len, kv_len, block_size, device=device)
        assert cheap.block_size == built.block_size
        assert cheap.seq_lengths == built.seq_lengths
        for name in pf.BlockMask._TABLE_NAMES:
            np.testing.assert_array_equal(np.asarray(getattr(cheap, name)),
                                          np.asarray(getattr(built, name)), err_msg=name)


def test_a_call_without_a_mask_builds_no_block_mask(monkeypatch):
    """flex_attention(q, k, v) with no BlockMask neither traces a mod nor runs the
    device build (about a millisecond of host time a call before)."""
    from pallas_flex.masks import block_mask as module

    q = jnp.ones((1, 1, 2, 16), jnp.float32)
    k = jnp.ones((1, 300, 2, 16), jnp.float32)
    expected = pf.flex_attention(q, k, k)
    monkeypatch.setattr(module, "_build_jitted", None)  # calling it would fail
    monkeypatch.setattr(module, "make_mod_program", None)
    np.testing.assert_allclose(pf.flex_attention(q, k, k), expected)


@pytest.mark.parametrize("q_len", [1, 5, 64, 128, 200])
def test_short_query_blocks_classify_like_the_dense_mask(q_len):
    """With one block of queries only the real rows are evaluated; a block with padding
    rows is partial, never full (a decode step's BlockMask)."""
    kv_len, block = 700, 64
    positions = jnp.array([650, 3], jnp.int32)
    mask_mod = masks.offset(masks.causal_mask, positions)
    built = pf.create_block_mask(mask_mod, 2, None, q_len, kv_len, block_size=block)
    q_idx, kv_idx = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    for b in range(2):
        dense = kv_idx <= q_idx + int(positions[b])
        num_q_blocks, num_kv_blocks = -(-q_len // block), -(-kv_len // block)
        for i in range(num_q_blocks):
            for j in range(num_kv_blocks):
                tile = dense[i * block:(i + 1) * block, j * block:(j + 1) * block]
                whole = tile.shape == (block, block)
                want = 2 if whole and tile.all() else 1 if tile.any() else 0
                partial = list(np.asarray(built.kv_indices[b, 0, i, :built.kv_num_blocks[b, 0, i]]))
                full = list(np.asarray(
                    built.full_kv_indices[b, 0, i, :built.full_kv_num_blocks[b, 0, i]]))
                got = 2 if j in full else 1 if j in partial else 0
                assert got == want, (b, i, j, got, want)
