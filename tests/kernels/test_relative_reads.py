"""The tables behind a T5 table's gradient on the Mosaic backward
(`relative_reads.entry_tables`): runs of table entries per block diagonal, the runs each
64 x 64 dK/dV tile reaches, and where each entry lies in the table. Checked against the
bucket function evaluated per difference with numpy."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex import masks
from pallas_flex.kernels import mosaic_eligibility, relative_reads
from pallas_flex.masks.mod_program import SCORE, make_mod_program


def _entries_per_difference(program, position, batch, heads, q_length, kv_length):
    """Rebuilds, per (b, h) and block diagonal, the local entry of every difference from
    the runs, and checks the tile spans on the way."""
    reads = mosaic_eligibility.tile_reads(program)
    tables, flat, dump = relative_reads.entry_tables(program, reads, position, batch,
                                                     heads, q_length, kv_length)
    assert tables is None and dump is not None  # a dumped read's kernel reads no table
    # The run tables, as where the entries are traced.
    with mock.patch.object(relative_reads.Dump, "of", staticmethod(lambda *args: None)):
        (counts, starts, entries, spans), flat, no_dump = relative_reads.entry_tables(
            program, reads, position, batch, heads, q_length, kv_length)
    assert no_dump is None
    blocks = max(q_length, kv_length) // 128
    rebuilt = {}
    for b in range(counts.shape[0]):
        for h in range(heads):
            for diagonal in range(-(blocks - 1), blocks):
                index = (b, h, diagonal + blocks - 1)
                differences = np.arange(diagonal * 128 - 127, diagonal * 128 + 128)
                runs = int(counts[index])
                run_starts = np.asarray(starts[index])[:runs]
                assert run_starts[0] == differences[0] and np.all(np.diff(run_starts) > 0)
                local = np.full(255, -1)
                for run in range(runs):
                    local[differences >= run_starts[run]] = int(entries[index + (run,)])
                rebuilt[index] = local
                for offset_index, offset in enumerate((-64, 0, 64)):
                    low, high = diagonal * 128 + offset - 63, diagonal * 128 + offset + 63
                    reached = [run for run in range(runs)
                               if run_starts[run] <= high
                               and (run + 1 == runs or run_starts[run + 1] > low)]
                    first, end = np.asarray(spans[index + (offset_index,)])
                    assert (first, end) == (reached[0], reached[-1] + 1), (index, offset)
    _check_dump(dump, rebuilt, counts.shape[0], heads, q_length, kv_length)
    return rebuilt, np.asarray(flat), np.asarray(spans), dump


def _check_dump(dump, rebuilt, table_batch, heads, q_length, kv_length):
    """The dumped 64 x 64 tile offsets cover every offset whose 127 diagonals reach two
    entries for some (b, h), and list each diagonal's entry."""
    blocks = max(q_length, kv_length) // 128
    for b in range(table_batch):
        for h in range(heads):
            entry_of = {}
            for diagonal in range(-(blocks - 1), blocks):
                differences = np.arange(diagonal * 128 - 127, diagonal * 128 + 128)
                entry_of.update(zip(differences.tolist(),
                                    rebuilt[(b, h, diagonal + blocks - 1)].tolist()))
            for offset in range(-(q_length // 64) + 1, kv_length // 64):
                local = [entry_of[d] for d in range(64 * offset - 63, 64 * offset + 64)]
                dumped = dump is not None and 0 <= offset - dump.first_offset < dump.count
                assert dumped or len(set(local)) == 1, (b, h, offset)
                if dumped:
                    np.testing.assert_array_equal(
                        dump.entries[b, h, offset - dump.first_offset], local)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_entry_runs_split_equal_values_and_point_into_the_table(bidirectional):
    """A [3, 32] T5 table whose buckets 4 and 5 hold one value: the runs follow the
    bucket (4 and 5 stay apart, where the value runs merge them), each run's entry is the
    bucket, and flat[b, h, e] is h * 32 + e."""
    table = np.random.default_rng(2).standard_normal((3, 32)).astype(np.float32)
    table[:, 5] = table[:, 4]
    program = make_mod_program(
        masks.t5_relative_bias(jnp.asarray(table), bidirectional=bidirectional), SCORE)
    assert mosaic_eligibility.relative_positions(program, (0,)) == (0,)
    assert relative_reads.entry_count(program, 0) == 32
    rebuilt, flat, _, dump = _entries_per_difference(program, 0, 2, 3, 384, 256)
    # The buckets change up to |kv_idx - q_idx| = 91 both ways (one way, up to 112 keys
    # before the query): the tiles up to two offsets from the diagonal are dumped.
    assert (dump.first_offset, dump.count) == ((-2, 5) if bidirectional else (-2, 3))
    for (b, h, diagonal_index), local in rebuilt.items():
        diagonal = diagonal_index - 2
        differences = np.arange(diagonal * 128 - 127, diagonal * 128 + 128)
        buckets = np.asarray(masks.t5_relative_bucket(jnp.asarray(differences),
                                                      bidirectional=bidirectional))
        np.testing.assert_array_equal(local, buckets)
    assert flat.shape == (1, 3, 32)
    np.testing.assert_array_equal(flat[0], np.arange(3)[:, None] * 32 + np.arange(32))


def test_a_table_read_at_b_and_a_clipped_difference():
    """`table[b, clip(kv - q, -3, 3) + 3]` ([2, 7]): per batch element (Bm = 2), the
    entries are the clipped difference, flat[b, h, e] = b * 7 + e, and every tile past
    the clip reaches one run."""
    table = jnp.asarray(np.random.default_rng(3).standard_normal((2, 7)), jnp.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[b, jnp.clip(kv_idx - q_idx, -3, 3) + 3]

    program = make_mod_program(score_mod, SCORE)
    assert relative_reads.varying_axes(program) == {0: (1,)}
    rebuilt, flat, spans, dump = _entries_per_difference(program, 0, 2, 2, 256, 256)
    # The entries change from difference -3 to 3: the tiles one offset from the diagonal
    # reach two entries or more; the others are not dumped.
    assert (dump.first_offset, dump.count) == (-1, 3)
    for (b, h, diagonal_index), local in rebuilt.items():
        diagonal = diagonal_index - 1
        differences = np.arange(diagonal * 128 - 127, diagonal * 128 + 128)
        np.testing.assert_array_equal(local, np.clip(differences, -3, 3) + 3)
    np.testing.assert_array_equal(flat, np.broadcast_to(
        np.arange(2)[:, None, None] * 7 + np.arange(7), (2, 2, 7)))
    # Block diagonal +1, keys 64 past the queries: differences 65..191, all clipped.
    np.testing.assert_array_equal(spans[:, :, 2, 2, 1] - spans[:, :, 2, 2, 0], 1)
    # The main diagonal's middle tile reaches all 7 entries.
    np.testing.assert_array_equal(spans[:, :, 1, 1, 1] - spans[:, :, 1, 1, 0], 7)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_dense_block_diagonals_hold_the_read_per_score(bidirectional):
    """`diagonal_blocks`: the block diagonals whose tiles reach more than one value (a
    one-way T5 bucket: the main one and the one below it; two ways: also the one above),
    each as the read's value at every (query row, key column) of a block pair on it,
    checked against the bucket function per score; the others' one value per side."""
    table = jnp.asarray(np.random.default_rng(3).standard_normal((3, 32)), jnp.float32)
    program = make_mod_program(masks.t5_relative_bias(table, bidirectional=bidirectional),
                               SCORE)
    reads = mosaic_eligibility.tile_reads(program)
    (found,) = relative_reads.diagonal_blocks(program, reads, 2, 3, 256, 640).values()
    assert (found.first, found.count) == ((-1, 3) if bidirectional else (-1, 2))
    assert found.tiles.shape == (1, 3, found.count, 128, 128)
    rows, columns = np.indices((128, 128))
    for index in range(found.count):
        differences = (found.first + index) * 128 + columns - rows
        buckets = np.asarray(masks.t5_relative_bucket(
            jnp.asarray(differences), num_buckets=32, max_distance=128,
            bidirectional=bidirectional))
        for head in range(3):
            np.testing.assert_array_equal(np.asarray(found.tiles[0, head, index]),
                                          np.asarray(table)[head][buckets])
    far = np.asarray(masks.t5_relative_bucket(jnp.array([-1000, 1000]), num_buckets=32,
                                              max_distance=128, bidirectional=bidirectional))
    np.testing.assert_array_equal(np.asarray(found.sides[0]), np.asarray(table)[:, far])


def test_wide_tables_and_traced_indices_keep_the_runs():
    """A table read at a difference clipped to [-2, 2] changes on the main block diagonal
    and its two neighbours (dense, with one value per side past them); clipped to
    [-600, 600], on more than MAX_DIAGONAL_BLOCKS: runs. An index read from a captured
    array is traced: no block diagonal is known dense."""
    table = jnp.arange(2 * 1201, dtype=jnp.float32).reshape(2, 1201)

    def clipped(limit):
        return lambda s, b, h, q_idx, kv_idx: s + table[h, jnp.clip(kv_idx - q_idx, -limit,
                                                                     limit) + 600]
    found = []
    for limit in (2, 600):
        program = make_mod_program(clipped(limit), SCORE)
        found.append({number: (blocks.first, blocks.count, np.asarray(blocks.sides).tolist())
                      for number, blocks in relative_reads.diagonal_blocks(
                          program, mosaic_eligibility.tile_reads(program), 1, 2, 2048,
                          2048).items()})
    assert found == [{0: (-1, 3, [[[598.0, 602.0], [1799.0, 1803.0]]])}, {}]
    # Under jit (as the kernels are built) a captured array is traced.
    seen = []

    @jax.jit
    def trace(offsets):
        def shifted(s, b, h, q_idx, kv_idx):
            return s + table[h, jnp.clip(kv_idx - q_idx, -20, 20) + 20 - offsets[h]]
        program = make_mod_program(shifted, SCORE)
        reads = mosaic_eligibility.tile_reads(program)
        assert any(read.kind == "relative" for read in reads.values())
        seen.append(relative_reads.diagonal_blocks(program, reads, 1, 2, 384, 384))
        return offsets
    trace(jnp.array([3, 0], jnp.int32))
    assert seen == [{}]
