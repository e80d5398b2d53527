"""The mods gallery, each mod evaluated on a full grid against a NumPy brute-force oracle.

Oracles are written from the definitions (loops or broadcasting), never by calling a mod.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex.scores.alibi import alibi, alibi_slopes
from pallas_flex.scores.bias import bias_lookup
from pallas_flex.masks.causal import causal_mask
from pallas_flex.masks.chunked import chunked_causal
from pallas_flex.masks.combinators import and_masks, noop_mask, noop_score, not_mask, or_masks
from pallas_flex.masks.dilated import dilated_sliding_window
from pallas_flex.masks.document import document, document_mask, document_mask_from_offsets
from pallas_flex.masks.neighborhood import (
    morton_neighborhood_2d,
    neighborhood_2d,
    tiled_neighborhood_2d,
)
from pallas_flex.masks.offset import offset, offset_score
from pallas_flex.masks.prefix_lm import prefix_lm
from pallas_flex.scores.relative_position import relative_position
from pallas_flex.masks.sliding_window import sliding_window
from pallas_flex.scores.softcap import tanh_softcap
from pallas_flex.scores.t5_bias import t5_relative_bias, t5_relative_bucket


# ---------------------------------------------------------------------------------------
# Evaluating mods on a grid


def _indices(length):
    return jnp.arange(length, dtype=jnp.int32)


def evaluate_mask(mask_mod, batch, heads, q_len, kv_len):
    """The mask_mod on every (b, h, q_idx, kv_idx): numpy bool [batch, heads, q_len, kv_len]."""
    over_kv = jax.vmap(mask_mod, in_axes=(None, None, None, 0))
    over_q = jax.vmap(over_kv, in_axes=(None, None, 0, None))
    over_h = jax.vmap(over_q, in_axes=(None, 0, None, None))
    over_b = jax.vmap(over_h, in_axes=(0, None, None, None))
    mask = jax.jit(over_b)(_indices(batch), _indices(heads), _indices(q_len), _indices(kv_len))
    assert mask.dtype == jnp.bool_
    assert mask.shape == (batch, heads, q_len, kv_len)
    return np.asarray(mask)


def evaluate_score(score_mod, scores):
    """The score_mod on every score of `scores` [B, H, Sq, Skv] (float32): numpy float32."""
    batch, heads, q_len, kv_len = scores.shape
    over_kv = jax.vmap(score_mod, in_axes=(0, None, None, None, 0))
    over_q = jax.vmap(over_kv, in_axes=(0, None, None, 0, None))
    over_h = jax.vmap(over_q, in_axes=(0, None, 0, None, None))
    over_b = jax.vmap(over_h, in_axes=(0, 0, None, None, None))
    result = jax.jit(over_b)(
        jnp.asarray(scores, dtype=jnp.float32),
        _indices(batch),
        _indices(heads),
        _indices(q_len),
        _indices(kv_len),
    )
    assert result.dtype == jnp.float32
    assert result.shape == scores.shape
    return np.asarray(result)


def position_grid(q_len, kv_len):
    """q [q_len, 1] and kv [1, kv_len] position arrays for broadcasting oracles."""
    return np.arange(q_len)[:, None], np.arange(kv_len)[None, :]


def random_scores(batch, heads, q_len, kv_len, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, heads, q_len, kv_len)).astype(
        np.float32
    )


# ---------------------------------------------------------------------------------------
# Combinators


def _table_mask(table):
    """A mask_mod reading a fixed [Sq, Skv] truth table."""
    table = jnp.asarray(table)

    def table_mask(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    return table_mask


# Every combination of three inputs appears in some (q, kv) cell: a full truth table.
TABLE_A = np.array([[0, 0, 0, 0, 1, 1, 1, 1]], dtype=bool)
TABLE_B = np.array([[0, 0, 1, 1, 0, 0, 1, 1]], dtype=bool)
TABLE_C = np.array([[0, 1, 0, 1, 0, 1, 0, 1]], dtype=bool)


def _evaluate_table_mask(mask_mod):
    return evaluate_mask(mask_mod, 1, 1, 1, 8)[0, 0]


def test_and_or_not_truth_tables():
    a, b, c = (_table_mask(table) for table in (TABLE_A, TABLE_B, TABLE_C))
    np.testing.assert_array_equal(_evaluate_table_mask(and_masks(a, b)), TABLE_A & TABLE_B)
    np.testing.assert_array_equal(
        _evaluate_table_mask(and_masks(a, b, c)), TABLE_A & TABLE_B & TABLE_C
    )
    np.testing.assert_array_equal(_evaluate_table_mask(or_masks(a, b)), TABLE_A | TABLE_B)
    np.testing.assert_array_equal(
        _evaluate_table_mask(or_masks(a, b, c)), TABLE_A | TABLE_B | TABLE_C
    )
    np.testing.assert_array_equal(_evaluate_table_mask(not_mask(a)), ~TABLE_A)
    np.testing.assert_array_equal(_evaluate_table_mask(and_masks(a)), TABLE_A)
    np.testing.assert_array_equal(
        _evaluate_table_mask(or_masks(and_masks(a, not_mask(b)), c)),
        (TABLE_A & ~TABLE_B) | TABLE_C,
    )


def test_empty_combinators_and_noop_mods():
    assert evaluate_mask(and_masks(), 2, 3, 5, 7).all()
    assert not evaluate_mask(or_masks(), 2, 3, 5, 7).any()
    assert evaluate_mask(noop_mask, 2, 3, 5, 7).all()
    scores = random_scores(2, 3, 5, 7)
    np.testing.assert_array_equal(evaluate_score(noop_score, scores), scores)


def test_combinator_names():
    assert and_masks(causal_mask, sliding_window(4)).__name__ == (
        "and_masks(causal_mask, sliding_window_4)"
    )
    assert or_masks().__name__ == "or_masks()"
    assert not_mask(causal_mask).__name__ == "not_mask(causal_mask)"


@pytest.mark.parametrize(
    "build, argument",
    [
        (lambda: and_masks(causal_mask, 3), r"mask_mods\[1\]"),
        (lambda: or_masks("causal"), r"mask_mods\[0\]"),
        (lambda: not_mask(None), "mask_mod"),
    ],
)
def test_combinators_reject_non_callables(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()


# ---------------------------------------------------------------------------------------
# Causal, sliding window, dilated, chunked, prefix-LM


@pytest.mark.parametrize("q_len, kv_len", [(17, 37), (37, 17), (1, 5)])
def test_causal_mask(q_len, kv_len):
    q, kv = position_grid(q_len, kv_len)
    expected = q >= kv
    np.testing.assert_array_equal(evaluate_mask(causal_mask, 1, 1, q_len, kv_len)[0, 0], expected)


@pytest.mark.parametrize("window_size", [1, 3, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(window_size, causal):
    q_len, kv_len = 17, 37
    expected = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        first = q - window_size + 1
        last = q if causal else q + window_size - 1
        expected[q, max(first, 0) : last + 1] = True
    mask = evaluate_mask(sliding_window(window_size, causal=causal), 1, 1, q_len, kv_len)[0, 0]
    np.testing.assert_array_equal(mask, expected)
    # The causal window holds exactly window_size keys once the sequence start is behind it.
    if causal:
        np.testing.assert_array_equal(mask[window_size - 1 :].sum(axis=1), window_size)


def test_sliding_window_from_arrays():
    q, kv = position_grid(11, 13)
    window_sizes = np.array([1, 4, 9])
    mask = evaluate_mask(sliding_window(jnp.asarray(window_sizes)), 3, 2, 11, 13)
    for batch_index, window_size in enumerate(window_sizes):
        expected = (q - kv >= 0) & (q - kv < window_size)
        for head in range(2):
            np.testing.assert_array_equal(mask[batch_index, head], expected)
    shared = evaluate_mask(sliding_window(jnp.int32(4), causal=False), 1, 1, 11, 13)[0, 0]
    np.testing.assert_array_equal(shared, np.abs(q - kv) < 4)


def test_sliding_window_rejects_bad_sizes():
    with pytest.raises(ValueError, match="window_size"):
        sliding_window(0)
    with pytest.raises(ValueError, match="window_size"):
        sliding_window(jnp.ones((2, 2), dtype=jnp.int32))
    with pytest.raises(ValueError, match="window_size"):
        dilated_sliding_window(0, 2)
    with pytest.raises(ValueError, match="dilation"):
        dilated_sliding_window(4, 0)


@pytest.mark.parametrize("window_size, dilation", [(7, 2), (9, 3), (5, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_dilated_sliding_window(window_size, dilation, causal):
    q_len, kv_len = 17, 23
    expected = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        for kv in range(kv_len):
            distance = q - kv
            in_window = 0 <= distance < window_size if causal else abs(distance) < window_size
            expected[q, kv] = in_window and distance % dilation == 0
    mask_mod = dilated_sliding_window(window_size, dilation, causal=causal)
    np.testing.assert_array_equal(evaluate_mask(mask_mod, 1, 1, q_len, kv_len)[0, 0], expected)


@pytest.mark.parametrize("chunk_size", [1, 4, 5])
def test_chunked_causal(chunk_size):
    q_len, kv_len = 17, 19
    expected = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        chunk_start = q - q % chunk_size
        expected[q, chunk_start : q + 1] = True
    mask_mod = chunked_causal(chunk_size)
    np.testing.assert_array_equal(evaluate_mask(mask_mod, 1, 1, q_len, kv_len)[0, 0], expected)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_causal(0)


def test_prefix_lm():
    q, kv = position_grid(17, 19)

    def expected_for(prefix_length):
        return (kv < prefix_length) | (q >= kv)

    constant = evaluate_mask(prefix_lm(5), 1, 1, 17, 19)[0, 0]
    np.testing.assert_array_equal(constant, expected_for(5))
    shared = evaluate_mask(prefix_lm(jnp.int32(7)), 2, 1, 17, 19)
    for batch_index in range(2):
        np.testing.assert_array_equal(shared[batch_index, 0], expected_for(7))
    prefix_lengths = [0, 3, 19]
    per_row = evaluate_mask(prefix_lm(jnp.array(prefix_lengths)), 3, 2, 17, 19)
    for batch_index, prefix_length in enumerate(prefix_lengths):
        for head in range(2):
            np.testing.assert_array_equal(per_row[batch_index, head], expected_for(prefix_length))


def test_prefix_lm_rejects_bad_lengths():
    with pytest.raises(ValueError, match="prefix_length"):
        prefix_lm(jnp.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="prefix_length"):
        prefix_lm(jnp.zeros((2, 3), dtype=jnp.int32))


# ---------------------------------------------------------------------------------------
# Documents


def _same_document_oracle(q_ids, kv_ids):
    return np.array([[q_id == kv_id for kv_id in kv_ids] for q_id in q_ids])


def _document_starts_oracle(ids):
    starts = []
    for position in range(len(ids)):
        start = position
        while start > 0 and ids[start - 1] == ids[position]:
            start -= 1
        starts.append(start)
    return starts


DOCUMENT_IDS = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 4, 4, 4, 4, 4, 4]  # S = 17


def test_document_mask_shared_ids():
    mask = evaluate_mask(document_mask(jnp.array(DOCUMENT_IDS)), 2, 1, 17, 17)
    expected = _same_document_oracle(DOCUMENT_IDS, DOCUMENT_IDS)
    for batch_index in range(2):
        np.testing.assert_array_equal(mask[batch_index, 0], expected)


def test_document_mask_per_batch_ids_and_separate_kv_ids():
    rng = np.random.default_rng(1)
    q_ids = np.sort(rng.integers(0, 4, size=(2, 7)), axis=1)
    kv_ids = np.sort(rng.integers(0, 4, size=(2, 19)), axis=1)
    mask = evaluate_mask(document_mask(jnp.asarray(q_ids), jnp.asarray(kv_ids)), 2, 1, 7, 19)
    for batch_index in range(2):
        np.testing.assert_array_equal(
            mask[batch_index, 0], _same_document_oracle(q_ids[batch_index], kv_ids[batch_index])
        )


def test_document_mask_from_offsets():
    offsets = [0, 3, 5, 10, 11, 17]
    ids = []
    for document_index in range(len(offsets) - 1):
        ids += [document_index] * (offsets[document_index + 1] - offsets[document_index])
    mask = evaluate_mask(document_mask_from_offsets(jnp.array(offsets), 17), 1, 1, 17, 17)
    np.testing.assert_array_equal(mask[0, 0], _same_document_oracle(ids, ids))


def _first_three_queries(b, h, q_idx, kv_idx):
    """Distinguishes positions relative to the document start from absolute ones."""
    return q_idx < 3


@pytest.mark.parametrize(
    "inner_mask_mod, inner_oracle",
    [
        (causal_mask, lambda q, kv: q >= kv),
        (prefix_lm(2), lambda q, kv: kv < 2 or q >= kv),
        (_first_three_queries, lambda q, kv: q < 3),
        (sliding_window(2, causal=False), lambda q, kv: abs(q - kv) < 2),
    ],
)
def test_document_wrapper_uses_positions_within_each_document(inner_mask_mod, inner_oracle):
    ids_per_row = [DOCUMENT_IDS, [5] * 6 + [9] * 11]
    mask = evaluate_mask(document(inner_mask_mod, jnp.array(ids_per_row)), 2, 1, 17, 17)
    for batch_index, ids in enumerate(ids_per_row):
        starts = _document_starts_oracle(ids)
        expected = np.zeros((17, 17), dtype=bool)
        for q in range(17):
            for kv in range(17):
                expected[q, kv] = ids[q] == ids[kv] and inner_oracle(q - starts[q], kv - starts[kv])
        np.testing.assert_array_equal(mask[batch_index, 0], expected)
    shared = evaluate_mask(document(inner_mask_mod, jnp.array(DOCUMENT_IDS)), 1, 1, 17, 17)
    np.testing.assert_array_equal(shared[0], mask[0])


def test_document_wrapper_with_separate_kv_ids():
    q_ids, kv_ids = [0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]
    mask_mod = document(causal_mask, jnp.array(q_ids), jnp.array(kv_ids))
    q_starts, kv_starts = _document_starts_oracle(q_ids), _document_starts_oracle(kv_ids)
    expected = np.array(
        [
            [q_ids[q] == kv_ids[kv] and q - q_starts[q] >= kv - kv_starts[kv] for kv in range(7)]
            for q in range(4)
        ]
    )
    np.testing.assert_array_equal(evaluate_mask(mask_mod, 1, 1, 4, 7)[0, 0], expected)


def test_document_masks_reject_bad_arguments():
    with pytest.raises(ValueError, match="document_ids"):
        document_mask(jnp.zeros((2, 3, 4), dtype=jnp.int32))
    with pytest.raises(ValueError, match="kv_document_ids"):
        document_mask(jnp.zeros(4, dtype=jnp.int32), jnp.zeros((), dtype=jnp.int32))
    with pytest.raises(ValueError, match="document_ids"):
        document_mask(jnp.zeros(4, dtype=jnp.float32))
    with pytest.raises(ValueError, match="offsets"):
        document_mask_from_offsets(jnp.zeros((2, 2), dtype=jnp.int32), 4)
    with pytest.raises(ValueError, match="total_length"):
        document_mask_from_offsets(jnp.array([0, 4]), 4.0)
    with pytest.raises(ValueError, match="inner_mask_mod"):
        document("causal", jnp.zeros(4, dtype=jnp.int32))


# ---------------------------------------------------------------------------------------
# 2-D neighborhood attention


def _window_oracle(query_coordinate, length, kernel_size):
    """The kernel_size-long run of coordinates whose centre (start + kernel_size // 2) is
    closest to the query, among those inside [0, length); everything if none fits."""
    if kernel_size >= length:
        return set(range(length))
    best_start = min(
        range(length - kernel_size + 1),
        key=lambda start: abs(start + kernel_size // 2 - query_coordinate),
    )
    return set(range(best_start, best_start + kernel_size))


def _natten_image_oracle(height, width, kernel_height, kernel_width):
    """[height*width, height*width] bool over row-major pixels."""
    size = height * width
    mask = np.zeros((size, size), dtype=bool)
    for q in range(size):
        q_row, q_col = divmod(q, width)
        rows = _window_oracle(q_row, height, kernel_height)
        cols = _window_oracle(q_col, width, kernel_width)
        for kv in range(size):
            kv_row, kv_col = divmod(kv, width)
            mask[q, kv] = kv_row in rows and kv_col in cols
    return mask


def _attention_gym_natten(height, width, kernel_height, kernel_width):
    """attention-gym's `generate_natten` formulation (odd kernels): the kernel centre is
    the query clamped kernel // 2 away from the borders."""
    size = height * width
    q_row, q_col = np.divmod(np.arange(size)[:, None], width)
    kv_row, kv_col = np.divmod(np.arange(size)[None, :], width)
    centre_row = np.clip(q_row, kernel_height // 2, height - 1 - kernel_height // 2)
    centre_col = np.clip(q_col, kernel_width // 2, width - 1 - kernel_width // 2)
    return (np.abs(centre_row - kv_row) <= kernel_height // 2) & (
        np.abs(centre_col - kv_col) <= kernel_width // 2
    )


@pytest.mark.parametrize(
    "height, width, kernel_height, kernel_width",
    [(5, 7, 3, 3), (6, 5, 3, 5), (5, 7, 2, 4), (4, 3, 7, 3), (1, 9, 1, 4)],
)
def test_neighborhood_2d(height, width, kernel_height, kernel_width):
    size = height * width
    mask_mod = neighborhood_2d(height, width, kernel_height, kernel_width)
    mask = evaluate_mask(mask_mod, 1, 1, size, size)[0, 0]
    np.testing.assert_array_equal(
        mask, _natten_image_oracle(height, width, kernel_height, kernel_width)
    )
    # Border windows are shifted, not cut: every row keeps the full kernel.
    expected_count = min(kernel_height, height) * min(kernel_width, width)
    np.testing.assert_array_equal(mask.sum(axis=1), np.full(size, expected_count))
    assert mask[np.arange(size), np.arange(size)].all()
    if kernel_height % 2 and kernel_width % 2 and kernel_height <= height and kernel_width <= width:
        np.testing.assert_array_equal(
            mask, _attention_gym_natten(height, width, kernel_height, kernel_width)
        )


def test_tiled_neighborhood_2d():
    height, width, tile_height, tile_width = 4, 6, 2, 3
    pixel_of_token = []
    for tile_row in range(height // tile_height):
        for tile_col in range(width // tile_width):
            for row_in_tile in range(tile_height):
                for col_in_tile in range(tile_width):
                    pixel_of_token.append(
                        (tile_row * tile_height + row_in_tile) * width
                        + tile_col * tile_width
                        + col_in_tile
                    )
    assert sorted(pixel_of_token) == list(range(height * width))
    image_mask = _natten_image_oracle(height, width, 3, 3)
    expected = image_mask[np.ix_(pixel_of_token, pixel_of_token)]
    mask_mod = tiled_neighborhood_2d(height, width, 3, 3, tile_height, tile_width)
    np.testing.assert_array_equal(evaluate_mask(mask_mod, 1, 1, 24, 24)[0, 0], expected)
    with pytest.raises(ValueError, match="tile_height x tile_width"):
        tiled_neighborhood_2d(height, width, 3, 3, 3, 3)


def _z_order_square(side):
    """Row-major pixel indices of a side x side square, in Z-order: recursively top-left,
    top-right, bottom-left, bottom-right quadrants."""
    if side == 1:
        return [(0, 0)]
    half = side // 2
    inner = _z_order_square(half)
    return [
        (row + quadrant_row * half, col + quadrant_col * half)
        for quadrant_row, quadrant_col in ((0, 0), (0, 1), (1, 0), (1, 1))
        for row, col in inner
    ]


def _morton_pixel_of_token(height, width):
    """Square blocks of side min(height, width) along the longer side, each in Z-order."""
    side = min(height, width)
    pixels = []
    for block in range(max(height, width) // side):
        block_row, block_col = (block * side, 0) if height > width else (0, block * side)
        for row, col in _z_order_square(side):
            pixels.append((block_row + row) * width + block_col + col)
    return pixels


@pytest.mark.parametrize("height, width", [(4, 4), (8, 8), (2, 8), (8, 4)])
def test_morton_neighborhood_2d(height, width):
    pixel_of_token = _morton_pixel_of_token(height, width)
    assert sorted(pixel_of_token) == list(range(height * width))
    image_mask = _natten_image_oracle(height, width, 3, 3)
    expected = image_mask[np.ix_(pixel_of_token, pixel_of_token)]
    size = height * width
    mask = evaluate_mask(morton_neighborhood_2d(height, width, 3, 3), 1, 1, size, size)[0, 0]
    np.testing.assert_array_equal(mask, expected)


def test_neighborhoods_reject_bad_shapes():
    with pytest.raises(ValueError, match="height"):
        morton_neighborhood_2d(6, 8, 3, 3)
    with pytest.raises(ValueError, match="width"):
        morton_neighborhood_2d(8, 12, 3, 3)
    with pytest.raises(ValueError, match="kernel_width"):
        neighborhood_2d(4, 4, 3, 0)


# ---------------------------------------------------------------------------------------
# Offsets


def test_offset_mask():
    q_len, kv_len = 5, 37
    q, kv = position_grid(q_len, kv_len)
    constant = evaluate_mask(offset(causal_mask, 30), 1, 1, q_len, kv_len)[0, 0]
    np.testing.assert_array_equal(constant, q + 30 >= kv)
    offsets = [0, 12, 32]
    per_row = evaluate_mask(offset(sliding_window(4), jnp.array(offsets)), 3, 1, q_len, kv_len)
    for batch_index, q_offset in enumerate(offsets):
        absolute_q = q + q_offset
        np.testing.assert_array_equal(
            per_row[batch_index, 0], (absolute_q >= kv) & (absolute_q - kv < 4)
        )
    shared = evaluate_mask(offset(causal_mask, jnp.int32(3)), 2, 1, q_len, kv_len)
    np.testing.assert_array_equal(shared[1, 0], q + 3 >= kv)
    assert offset(causal_mask, 30).__name__ == "offset_30(causal_mask)"


def test_offset_score():
    scores = random_scores(2, 1, 3, 11)
    q, kv = position_grid(3, 11)
    offsets = [4, 8]
    result = evaluate_score(offset_score(relative_position(), jnp.array(offsets)), scores)
    for batch_index, q_offset in enumerate(offsets):
        np.testing.assert_allclose(
            result[batch_index, 0], scores[batch_index, 0] + (kv - (q + q_offset)), rtol=1e-6
        )
    with pytest.raises(ValueError, match="q_offset"):
        offset_score(relative_position(), jnp.array([0.5]))
    with pytest.raises(ValueError, match="score_mod"):
        offset_score(3, 0)


# ---------------------------------------------------------------------------------------
# Score mods


def test_alibi_slopes_known_values():
    np.testing.assert_array_equal(
        np.asarray(alibi_slopes(8)), [1 / 2**k for k in range(1, 9)]
    )
    # Non-power-of-two rule: 8 slopes of 8 heads, then every other slope of 16 heads.
    np.testing.assert_allclose(
        np.asarray(alibi_slopes(12)),
        [2.0**-k for k in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5],
        rtol=1e-7,
    )
    np.testing.assert_allclose(
        np.asarray(alibi_slopes(6)), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    )
    assert alibi_slopes(12).dtype == jnp.float32
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


def test_alibi_score():
    scores = random_scores(2, 4, 7, 13)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32)
    q, kv = position_grid(7, 13)
    expected = scores + slopes[None, :, None, None] * (kv - q)
    np.testing.assert_allclose(
        evaluate_score(alibi(jnp.asarray(slopes)), scores), expected, rtol=1e-6
    )
    standard_slopes = np.array([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8], dtype=np.float32)
    expected_standard = scores + standard_slopes[None, :, None, None] * (kv - q)
    np.testing.assert_allclose(evaluate_score(alibi(4), scores), expected_standard, rtol=1e-6)
    with pytest.raises(ValueError, match="slopes"):
        alibi(jnp.ones((2, 2)))


def _softcap_test_scores():
    magnitudes = np.concatenate(
        [np.geomspace(1e-30, 1e3, 4000), np.linspace(0.0, 200.0, 4000)]
    ).astype(np.float32)
    return np.concatenate([magnitudes, -magnitudes]).reshape(1, 2, 40, 200)


def test_tanh_softcap_exact():
    scores = _softcap_test_scores()
    expected = 30.0 * np.tanh(scores.astype(np.float64) / 30.0)
    np.testing.assert_allclose(evaluate_score(tanh_softcap(30.0), scores), expected, rtol=1e-6)
    from_array = evaluate_score(tanh_softcap(jnp.float32(30.0)), scores)
    np.testing.assert_allclose(from_array, expected, rtol=1e-6)


@pytest.mark.parametrize("soft_cap", [1.0, 30.0, 50.0])
def test_tanh_softcap_approx_matches_exact(soft_cap):
    scores = _softcap_test_scores()
    exact = evaluate_score(tanh_softcap(soft_cap), scores)
    approx = evaluate_score(tanh_softcap(soft_cap, approx=True), scores)
    np.testing.assert_allclose(approx, exact, rtol=1e-6, atol=0)
    assert tanh_softcap(soft_cap, approx=True).__name__.endswith("_approx")


def test_tanh_softcap_approx_gradient_is_finite():
    scores = jnp.array([-1e4, -3.0, -1e-20, 0.0, 1e-20, 3.0, 1e4], dtype=jnp.float32)
    score_mod = tanh_softcap(20.0, approx=True)
    gradient = jax.jit(jax.vmap(jax.grad(score_mod), in_axes=(0, None, None, None, None)))(
        scores, 0, 0, 0, 0
    )
    assert np.isfinite(np.asarray(gradient)).all()
    np.testing.assert_allclose(gradient[3], 1.0)


def test_tanh_softcap_rejects_bad_caps():
    with pytest.raises(ValueError, match="soft_cap"):
        tanh_softcap(0.0)
    with pytest.raises(ValueError, match="soft_cap"):
        tanh_softcap(jnp.ones(3))


def test_relative_position():
    scores = random_scores(1, 2, 17, 37)
    q, kv = position_grid(17, 37)
    np.testing.assert_allclose(
        evaluate_score(relative_position(), scores), scores + (kv - q), rtol=1e-6
    )
    np.testing.assert_allclose(
        evaluate_score(relative_position(jnp.float32(0.25)), scores),
        scores + 0.25 * (kv - q),
        rtol=1e-6,
    )


def hugging_face_t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """transformers' T5Attention._relative_position_bucket, transcribed to NumPy (float32
    log as in the PyTorch original)."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).astype(np.int64) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, np.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore", invalid="ignore"):
        relative_position_if_large = max_exact + (
            np.log(relative_position.astype(np.float32) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).astype(np.int64)
    relative_position_if_large = np.minimum(
        relative_position_if_large, np.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += np.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


@pytest.mark.parametrize(
    "num_buckets, max_distance, bidirectional",
    [(32, 128, True), (32, 128, False), (16, 40, True), (8, 20, False)],
)
def test_t5_relative_bucket_matches_transformers(num_buckets, max_distance, bidirectional):
    relative_positions = np.arange(-600, 601, dtype=np.int32)
    expected = hugging_face_t5_bucket(relative_positions, bidirectional, num_buckets, max_distance)
    bucket = jax.jit(jax.vmap(
        lambda relative_position: t5_relative_bucket(
            relative_position,
            num_buckets=num_buckets,
            max_distance=max_distance,
            bidirectional=bidirectional,
        )
    ))(jnp.asarray(relative_positions))
    assert bucket.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(bucket), expected)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_relative_bias(bidirectional):
    heads, num_buckets = 3, 32
    table = np.random.default_rng(2).normal(size=(heads, num_buckets)).astype(np.float32)
    scores = random_scores(1, heads, 17, 37)
    q, kv = position_grid(17, 37)
    buckets = hugging_face_t5_bucket(kv - q, bidirectional, num_buckets, 40)
    expected = scores + table[:, buckets][None]  # table[:, buckets]: [heads, Sq, Skv]
    score_mod = t5_relative_bias(jnp.asarray(table), max_distance=40, bidirectional=bidirectional)
    np.testing.assert_allclose(evaluate_score(score_mod, scores), expected, rtol=1e-6)


def test_t5_relative_bias_rejects_bad_tables():
    with pytest.raises(ValueError, match="bias_table"):
        t5_relative_bias(jnp.zeros(32))
    with pytest.raises(ValueError, match="num_buckets"):
        t5_relative_bias(jnp.zeros((2, 32)), num_buckets=64)
    with pytest.raises(ValueError, match="max_distance"):
        t5_relative_bias(jnp.zeros((2, 32)), max_distance=4)


@pytest.mark.parametrize("bias_batch, bias_heads", [(2, 3), (1, 3), (2, 1), (1, 1)])
def test_bias_lookup(bias_batch, bias_heads):
    bias = np.random.default_rng(3).normal(size=(bias_batch, bias_heads, 7, 17)).astype(np.float32)
    scores = random_scores(2, 3, 7, 17)
    expected = scores + np.broadcast_to(bias, scores.shape)
    np.testing.assert_allclose(
        evaluate_score(bias_lookup(jnp.asarray(bias)), scores), expected, rtol=1e-6
    )


def test_bias_lookup_rejects_non_4d():
    with pytest.raises(ValueError, match="bias"):
        bias_lookup(jnp.zeros((3, 7, 17)))


# ---------------------------------------------------------------------------------------
# Every mod traces to a scalar program on scalar arguments


def _gallery_mask_mods():
    ids = jnp.array(DOCUMENT_IDS)
    return [
        noop_mask,
        and_masks(),
        or_masks(),
        and_masks(causal_mask, not_mask(sliding_window(4))),
        causal_mask,
        sliding_window(8),
        sliding_window(jnp.array([3, 5]), causal=False),
        dilated_sliding_window(8, 2),
        chunked_causal(4),
        prefix_lm(jnp.array([1, 2])),
        document_mask(ids),
        document_mask(jnp.stack([ids, ids]), jnp.stack([ids, ids])),
        document_mask_from_offsets(jnp.array([0, 4, 17]), 17),
        document(causal_mask, ids),
        neighborhood_2d(4, 4, 3, 3),
        tiled_neighborhood_2d(4, 4, 3, 3, 2, 2),
        morton_neighborhood_2d(4, 4, 3, 3),
        offset(causal_mask, jnp.array([3, 4])),
    ]


def _gallery_score_mods():
    return [
        noop_score,
        alibi(8),
        tanh_softcap(30.0),
        tanh_softcap(jnp.float32(30.0), approx=True),
        relative_position(jnp.float32(0.5)),
        t5_relative_bias(jnp.zeros((4, 32))),
        bias_lookup(jnp.zeros((1, 4, 17, 17))),
        offset_score(alibi(4), 5),
    ]


def _largest_intermediate(jaxpr):
    """The most elements any equation in `jaxpr` (or its sub-jaxprs) produces."""
    largest = 1
    for equation in jaxpr.eqns:
        for variable in equation.outvars:
            largest = max(largest, math.prod(variable.aval.shape))
        for parameter in equation.params.values():
            inner = getattr(parameter, "jaxpr", parameter)
            if hasattr(inner, "eqns"):
                largest = max(largest, _largest_intermediate(inner))
    return largest


def _scalar(dtype):
    return np.zeros((), dtype=dtype)


@pytest.mark.parametrize("mask_mod", _gallery_mask_mods(), ids=lambda mod: mod.__name__)
def test_mask_mods_trace_to_scalar_bool_programs(mask_mod):
    index = _scalar(np.int32)
    closed_jaxpr = jax.make_jaxpr(mask_mod)(index, index, index, index)
    (output,) = closed_jaxpr.out_avals
    assert output.shape == () and output.dtype == jnp.bool_
    # Closed-over arrays are only ever indexed: no whole-array computation in the mod.
    assert _largest_intermediate(closed_jaxpr.jaxpr) == 1


@pytest.mark.parametrize("score_mod", _gallery_score_mods(), ids=lambda mod: mod.__name__)
def test_score_mods_trace_to_scalar_float32_programs(score_mod):
    index = _scalar(np.int32)
    closed_jaxpr = jax.make_jaxpr(score_mod)(_scalar(np.float32), index, index, index, index)
    (output,) = closed_jaxpr.out_avals
    assert output.shape == () and output.dtype == jnp.float32
    assert _largest_intermediate(closed_jaxpr.jaxpr) == 1
