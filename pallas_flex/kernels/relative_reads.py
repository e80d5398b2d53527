"""Reads of captured arrays at indices that depend on kv_idx - q_idx only (T5 buckets,
clipped relative-position tables), on the Mosaic GPU kernels.

A mod such as `score + table[h, t5_bucket(kv_idx - q_idx)]` reads a different entry per
score, and Mosaic GPU has no per-element gather. But such a read takes one value per
diagonal of the score matrix, and the tiles of one block diagonal (key block minus
query block, `delta`) see the same 255 diagonals: outside the kernel, the read's value
is computed once per (b, h, diagonal) with plain JAX (`relative_tables`), and each
block diagonal's 255 values are stored as runs of equal values (T5: the 16-32 exact and
logarithmic buckets near the main diagonal, one run everywhere past `max_distance`).
Inside, the tile starts as the first run's value and takes each later run's value where
kv_idx - q_idx reaches its start (`mosaic_tiles.relative_read_tile`): one scalar
broadcast on most tiles, two operations per element and run near the diagonal. The index
arithmetic (a T5 bucket's log) is never evaluated in the kernel. The forward reads dense
tiles near the diagonal instead and one of two values elsewhere, where that covers the
read (`diagonal_blocks`: one load per score where T5 takes some 30 runs).

For a table's gradient (`backward_mosaic`), `entry_tables` lists the runs by table
entry instead of by value, with where each entry lies in the table.

`relative_reads` finds the reads (an analysis of the mod's jaxpr); the kernels take
them with the contiguous reads (`mosaic_eligibility.tile_reads`) and receive three
arrays per read after the mods' captured arrays (`mosaic_tiles.split_tile_refs`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from pallas_flex.kernels.tile_mods import CapturedRef, evaluate_jaxpr_on_tiles
from pallas_flex.masks.mod_program import CALL_JAXPR_PARAMS

BLOCK = 128  # the Mosaic kernels' BlockMask block (`mosaic_eligibility.BLOCK`)
WINDOW = 2 * BLOCK - 1  # the diagonals kv_idx - q_idx one block pair spans
TILE = 64  # the dK/dV kernel's tiles: 64 keys x 64 queries
TABLE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32)


class RelativeRead(NamedTuple):
    """A read at indices of kv_idx - q_idx (and b, h): its captured array's `position`
    and all the array's axes (`axes`: the kernels evaluate none of its indices), as the
    contiguous reads' (position, axis, kind) entries (`mosaic_eligibility.tile_reads`)."""
    position: int
    axes: tuple
    kind: str = "relative"


def numbered(reads) -> dict:
    """{key: number} of the relative reads among `reads`, in order: read `number`'s
    three table refs follow the mod's captured arrays at 3 * number."""
    keys = [key for key, read in reads.items() if isinstance(read, RelativeRead)]
    return {key: number for number, key in enumerate(keys)}


# Linear forms a * q_idx + c * kv_idx + (terms without q_idx, kv_idx); _DIFFERENCE: a
# function of kv_idx - q_idx (and b, h, constants) that is not linear; _OTHER: anything
# else (the score, q_idx or kv_idx apart).
_DIFFERENCE, _OTHER = "difference", "other"


def _is_difference(tag) -> bool:
    """Whether a tag depends on q_idx and kv_idx through kv_idx - q_idx only."""
    if tag is None or tag == _DIFFERENCE:
        return True
    return isinstance(tag, tuple) and tag[0] == -tag[1]


def _combine(name, equation, tags):
    """The tag of an equation's outputs from its inputs' tags."""
    if all(tag is None for tag in tags):
        return None
    linear = all(tag is None or isinstance(tag, tuple) for tag in tags)
    if linear and name in ("add", "sub", "add_any"):
        first, second = ((0, 0) if tag is None else tag for tag in tags)
        sign = -1 if name == "sub" else 1
        total = (first[0] + sign * second[0], first[1] + sign * second[1])
        return None if total == (0, 0) else total
    if linear and name == "neg":
        return (-tags[0][0], -tags[0][1])
    if (linear and name == "mul" and any(tag is None for tag in tags)
            and any(isinstance(atom, jex_core.Literal) for atom in equation.invars)):
        (literal,) = [atom for atom in equation.invars if isinstance(atom, jex_core.Literal)]
        (form,) = [tag for tag in tags if tag is not None]
        if float(literal.val) == int(literal.val):
            factor = int(literal.val)
            return None if factor == 0 else (form[0] * factor, form[1] * factor)
    if name == "convert_element_type" and isinstance(tags[0], tuple):
        if jnp.issubdtype(equation.params["new_dtype"], jnp.integer):
            return tags[0]
    if all(_is_difference(tag) for tag in tags):
        return _DIFFERENCE
    return _OTHER


def relative_reads(program) -> dict:
    """The mod's reads of a captured array whose indices depend on q_idx and kv_idx only
    through kv_idx - q_idx (some of them on it, the others on b, h and constants), at the
    top level of its jaxpr: {id(dynamic_slice equation): RelativeRead}. Tables of other
    dtypes than TABLE_DTYPES are left out (they stay gathers)."""
    return {key: RelativeRead(position, tuple(range(len(varying))))
            for key, (position, varying) in _relative_sites(program).items()}


def varying_axes(program) -> dict:
    """{captured position: the axes of the array whose index depends on kv_idx - q_idx}
    for each array `relative_reads` finds (T5's `table[h, bucket]`: (1,))."""
    return {position: tuple(axis for axis, varies in enumerate(varying) if varies)
            for position, varying in _relative_sites(program).values()}


def _relative_sites(program) -> dict:
    """{id(dynamic_slice equation): (captured position, per index: whether it depends on
    kv_idx - q_idx)} of the reads `relative_reads` describes."""
    if program is None:
        return {}
    jaxpr = program.jaxpr
    first_index = 2 if program.kind == "mask" else 3
    tags = {jaxpr.invars[first_index]: (1, 0), jaxpr.invars[first_index + 1]: (0, 1)}
    if program.kind == "score":
        tags[jaxpr.invars[0]] = _OTHER
    positions = {var: position for position, var in enumerate(jaxpr.constvars)}

    def tag_of(atom):
        return tags.get(atom) if isinstance(atom, jex_core.Var) else None

    sites = {}
    for equation in jaxpr.eqns:
        name, inputs = equation.primitive.name, equation.invars
        input_tags = [tag_of(atom) for atom in inputs]
        if (name == "dynamic_slice" and isinstance(inputs[0], jex_core.Var)
                and inputs[0] in positions):
            index_tags = input_tags[1:]
            const = program.consts[positions[inputs[0]]]
            if (all(_is_difference(tag) for tag in index_tags)
                    and any(tag is not None for tag in index_tags)
                    and all(size == 1 for size in equation.params["slice_sizes"])
                    and any(jnp.dtype(const.dtype) == jnp.dtype(dtype)
                            for dtype in TABLE_DTYPES)):
                sites[id(equation)] = (positions[inputs[0]],
                                       tuple(tag is not None for tag in index_tags))
            output = _DIFFERENCE if all(_is_difference(t) for t in index_tags) else _OTHER
        elif name in CALL_JAXPR_PARAMS:
            output = _DIFFERENCE if all(_is_difference(t) for t in input_tags) else _OTHER
            if all(tag is None for tag in input_tags):
                output = None
        else:
            output = _combine(name, equation, input_tags)
        for var in equation.outvars:
            tags[var] = output
    return sites


def relative_tables(program, reads, batch: int, heads: int, q_length: int,
                    kv_length: int) -> list:
    """Per relative read of `program` (in `number` order): counts [Bm, H, N] int32, the
    number of runs; starts [Bm, H, N, WINDOW] int32, each run's first kv_idx - q_idx;
    values [Bm, H, N, WINDOW] in the array's dtype, each run's value. N = 2 n - 1 block
    diagonals for n = max(q_length, kv_length) / BLOCK (the kernel indexes them by key
    block - query block + n - 1); Bm = batch where the mod reads b, else 1.

    The read's value is the mod's own (its jaxpr evaluated with jnp on every (b, h,
    kv_idx - q_idx), its index clamped as the kernels' gathers clamp it)."""
    numbers = numbered(reads)
    if not numbers:
        return []
    differences, window = _windows(q_length, kv_length)
    table_batch = batch if program.uses_batch else 1
    values, _ = _per_difference(program, numbers, table_batch, heads, differences)
    tables = []
    for number in range(len(numbers)):
        tables += _runs(values[number][:, :, window], window + differences[0])
    return tables


# The most block diagonals a read takes as dense tiles (`diagonal_blocks`).
MAX_DIAGONAL_BLOCKS = 8


class DiagonalBlocks(NamedTuple):
    """A relative read's value on the block diagonals `first` .. first + count - 1 (key
    block less query block) as dense tiles: tiles [Bm, H, count, BLOCK, BLOCK], the value
    at each (query row, key column) of a block pair on that diagonal; and on every other
    block diagonal, where it is one value, that value: sides [Bm, H, 2], below `first`
    and past the last."""
    first: int
    count: int
    tiles: jax.Array
    sides: jax.Array


def diagonal_blocks(program, reads, batch: int, heads: int, q_length: int,
                    kv_length: int) -> dict:
    """{relative read number: DiagonalBlocks} for the reads whose value changes on at
    most MAX_DIAGONAL_BLOCKS consecutive block diagonals (T5: the main one and the one
    below it one way, also the one above two ways; a table clipped to [-c, c]: those
    within c of the main one): the Mosaic kernels load those block diagonals' tiles
    from global memory (`mosaic_tiles.diagonal_loads`), and every other tile adds one
    of the two side values,
    where the runs (`mosaic_tiles.RunsTile`) cost a compare and a select per score and
    run (some 30 runs a T5 tile near the diagonal) and scalar table loads on every tile.

    Which block diagonals those are is known at trace time where the read's indices
    depend on b, h and kv_idx - q_idx only (not on a traced array); the values are the
    mod's own at every (b, h, difference), as `relative_tables`' are."""
    numbers = numbered(reads)
    if not numbers:
        return {}
    table_batch = batch if program.uses_batch else 1
    with jax.ensure_compile_time_eval():
        differences, window = _windows(q_length, kv_length)
        _, indices = _per_difference(program, numbers, table_batch, heads, differences)
    window = np.asarray(window)
    shape = (table_batch, heads, differences.shape[0])
    values = None
    found = {}
    for key, number in numbers.items():
        sizes = jnp.shape(program.consts[reads[key].position])
        try:
            clamped = [np.clip(np.broadcast_to(np.asarray(index), shape), 0, size - 1)
                       for index, size in zip(indices[number], sizes)]
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
            continue  # an index read from a traced array: the runs are traced too
        changes = np.zeros(shape[-1] - 1, bool)
        for index in clamped:
            changes |= np.any(index[..., 1:] != index[..., :-1], axis=(0, 1))
        # A block diagonal whose differences reach a change holds more than one value.
        dense = np.flatnonzero(changes[window[:, :-1]].any(axis=1))
        if not dense.size or dense[-1] - dense[0] + 1 > MAX_DIAGONAL_BLOCKS:
            continue
        if values is None:
            values, _ = _per_difference(program, numbers, table_batch, heads, differences)
        blocks = window.shape[0] // 2 + 1
        diagonals = np.arange(dense[0], dense[-1] + 1)
        rows, columns = np.indices((BLOCK, BLOCK))
        positions = window[diagonals][:, columns - rows + BLOCK - 1]  # [count, q, kv]
        value = values[number]
        found[number] = DiagonalBlocks(
            int(dense[0]) - (blocks - 1), len(diagonals), value[:, :, positions],
            jnp.stack([value[:, :, 0], value[:, :, -1]], axis=-1))
    return found


def entry_tables(program, reads, position: int, batch: int, heads: int, q_length: int,
                 kv_length: int):
    """For the gradient of the captured array at `position`, read once by a relative read
    of `program` (`reads`: its `tile_reads`): the block diagonals' runs by table entry
    rather than by value (two buckets that hold equal values are two entries), and where
    each entry lies in the array.

    Returns (counts [Bm, H, N], starts [Bm, H, N, WINDOW], entries [Bm, H, N, WINDOW],
    spans [Bm, H, N, 3, 2]): as `relative_tables` with each run's local entry in place of
    its value (the entry's row-major number along the array's axes indexed by
    kv_idx - q_idx, `varying_axes`: 0 <= entry < `entry_count`), and per 64 x 64 tile of
    a block pair (its keys' start less its queries' start -64, 0 or 64 from the block
    diagonal's) the runs it reaches, [first, last + 1), or None where the read has a
    `Dump` (its kernel reads no table); flat [Bm, H, E] int32, each (b, h, local
    entry)'s flat index in the array (the other axes' indices are the pair's); and the
    read's `Dump` or None."""
    numbers = numbered(reads)
    (number,) = [n for key, n in numbers.items() if reads[key].position == position]
    table_batch = batch if program.uses_batch else 1
    # The indices usually depend on b, h, q_idx and kv_idx only (T5's bucket): evaluated
    # at trace time, they fix which tiles the kernel dumps.
    # (Where the index reads a traced array, `local` stays traced and there is no Dump.)
    with jax.ensure_compile_time_eval():
        differences, window = _windows(q_length, kv_length)
        local, flat = _local_entries(program, numbers, number, position, table_batch,
                                     heads, differences)
        dump = Dump.of(local, int(differences[0]), q_length, kv_length)
    if dump is not None:
        return None, flat, dump
    counts, starts, entries = _runs(local[:, :, window], window + differences[0])
    spans = _tile_spans(counts, starts, window + differences[0])
    return (counts, starts, entries, spans), flat, None


def _local_entries(program, numbers, number, position, table_batch, heads, differences):
    """(each (b, h, difference)'s local entry [Bm, H, D], each (b, h, local entry)'s flat
    index [Bm, H, E]) of relative read `number`, which reads the array at `position`."""
    axes = varying_axes(program)[position]
    shape = jnp.shape(program.consts[position])
    _, indices = _per_difference(program, {key: n for key, n in numbers.items()
                                           if n == number}, table_batch, heads, differences)
    pair_shape = (table_batch, heads, differences.shape[0])
    clamped = [jnp.broadcast_to(jnp.clip(index, 0, size - 1).astype(jnp.int32), pair_shape)
               for index, size in zip(indices[number], shape)]
    local = jnp.zeros(pair_shape, jnp.int32)
    for axis in axes:
        local = local * shape[axis] + clamped[axis]
    strides = np.cumprod((1,) + tuple(shape[::-1][:-1]))[::-1]
    base = sum((clamped[axis][..., 0] * int(strides[axis])
                for axis in range(len(shape)) if axis not in axes),
               jnp.zeros(pair_shape[:2], jnp.int32))
    digits = np.indices([shape[axis] for axis in axes]).reshape(len(axes), -1)
    offsets = sum(digits[i] * int(strides[axis]) for i, axis in enumerate(axes))
    return local, base[..., None] + jnp.asarray(offsets, jnp.int32)


class Dump(NamedTuple):
    """The 64 x 64 dK/dV tiles whose differences reach more than one entry for some
    (b, h): those whose keys' start less their queries' start is TILE * o for o in
    [first_offset, first_offset + count). The dK/dV kernel writes each such tile's dS' g
    to HBM, and `captured_gradients_mosaic._dumped_entry_sums` sums it by diagonal, then by entry:
    in the kernel, one compare, select and cross-thread sum per element and run cost
    ~1000 cycles a run (some 30 runs a T5 tile on the diagonal). entries [Bm, H, count,
    2 TILE - 1] int32: the local entry of each (b, h, tile offset, diagonal), the
    diagonals kv_idx - q_idx from TILE * o - (TILE - 1) on."""
    first_offset: int
    count: int
    entries: np.ndarray

    @staticmethod
    def of(local, first_difference: int, q_length: int, kv_length: int):
        """The Dump of a read with local entries `local` [Bm, H, D] at the differences
        from `first_difference` on, or None where they are traced (the index reads a
        traced array: the kernel sums the runs itself) or one entry everywhere."""
        try:
            per_difference = np.asarray(local)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
            return None
        # changes[i]: the entry differs between differences first + i and first + i + 1.
        changes = np.any(per_difference[..., 1:] != per_difference[..., :-1], axis=(0, 1))
        reaches = lambda offset: TILE * offset - (TILE - 1) - first_difference
        offsets = [offset for offset in range(-(q_length // TILE) + 1, kv_length // TILE)
                   if changes[reaches(offset):reaches(offset) + 2 * (TILE - 1)].any()]
        if not offsets:
            return None
        first, count = offsets[0], offsets[-1] - offsets[0] + 1
        positions = (np.array([reaches(first + o) for o in range(count)])[:, None]
                     + np.arange(2 * TILE - 1)[None, :])
        return Dump(first, count, per_difference[:, :, positions].astype(np.int32))


def _tile_spans(counts, starts, differences):
    """Per block diagonal and 64 x 64 tile offset (keys' start - queries' start - the
    diagonal's first difference + 127 in {-64, 0, 64}: index 0, 1, 2), the runs whose
    differences the tile's [offset - 63, offset + 63] reaches: [first, last + 1), [Bm, H,
    N, 3, 2] int32. A run list in order of starts: the first is the last run starting at
    or before the tile's least difference."""
    listed = jnp.arange(WINDOW)[None, None, None, :] < counts[..., None]
    centre = differences[:, BLOCK - 1]  # delta * BLOCK: a tile pair on the diagonal
    spans = []
    for offset in (-TILE, 0, TILE):
        low = (centre + offset - (TILE - 1))[None, None, :, None]
        high = (centre + offset + (TILE - 1))[None, None, :, None]
        first = jnp.sum(listed & (starts <= low), axis=-1) - 1
        last = jnp.sum(listed & (starts <= high), axis=-1)
        spans.append(jnp.stack([jnp.maximum(first, 0), last], axis=-1))
    return jnp.stack(spans, axis=-2).astype(jnp.int32)


def entry_count(program, position: int) -> int:
    """How many entries of the captured array at `position` one (b, h) pair's relative
    read reaches at most: the product of its `varying_axes`' sizes."""
    shape = jnp.shape(program.consts[position])
    return int(np.prod([shape[axis] for axis in varying_axes(program)[position]]))


def _windows(q_length: int, kv_length: int):
    """(every kv_idx - q_idx a block pair of the padded lengths spans [D]; per block
    diagonal delta, the positions in it of the WINDOW differences delta * BLOCK -
    (BLOCK - 1) onwards [N, WINDOW])."""
    blocks = max(q_length, kv_length) // BLOCK
    first = -(blocks * BLOCK - 1)
    differences = jnp.arange(first, blocks * BLOCK, dtype=jnp.int32)
    diagonals = jnp.arange(2 * blocks - 1, dtype=jnp.int32) - (blocks - 1)
    window_starts = diagonals * BLOCK - (BLOCK - 1) - first
    return differences, window_starts[:, None] + jnp.arange(WINDOW, dtype=jnp.int32)[None, :]


def _runs(per_window, differences):
    """[counts, starts, run values] of per-window values [Bm, H, N, WINDOW] at
    kv_idx - q_idx `differences` [N, WINDOW]: a run starts where the value changes."""
    changes = jnp.concatenate(
        [jnp.ones(per_window.shape[:-1] + (1,), bool),
         per_window[..., 1:] != per_window[..., :-1]], axis=-1)
    # Stable sort puts each window's run starts first, in order.
    order = jnp.argsort(~changes, axis=-1, stable=True)
    starts = jnp.take_along_axis(jnp.broadcast_to(differences, per_window.shape), order,
                                 axis=-1)
    return [changes.sum(axis=-1, dtype=jnp.int32), starts.astype(jnp.int32),
            jnp.take_along_axis(per_window, order, axis=-1)]


def _per_difference(program, numbers, table_batch, heads, differences):
    """Per relative read (`numbered`), its value at every (b, h, difference), [Bm, H, D],
    and the indices it read the array at (per axis, broadcastable to that shape)."""
    recorded, read_indices = {}, {}

    def recorder(number):
        def record(captured, indices):
            read_indices[number] = list(indices)
            recorded[number] = captured.gather(indices)
            return recorded[number]
        return record

    consts = [CapturedRef(jnp.reshape(c, (1,)) if jnp.ndim(c) == 0 else c, jnp.shape(c), i)
              for i, c in enumerate(program.consts)]
    q_idx = jnp.maximum(-differences, 0)[None, None, :]
    kv_idx = q_idx + differences[None, None, :]
    args = [jnp.arange(table_batch, dtype=jnp.int32)[:, None, None],
            jnp.arange(heads, dtype=jnp.int32)[None, :, None], q_idx, kv_idx]
    if program.kind == "score":
        args = [jnp.zeros((), jnp.float32)] + args
    replaced = {key: (recorder(number), ()) for key, number in numbers.items()}
    evaluate_jaxpr_on_tiles(program.jaxpr, consts, args, program.name,
                            captured_reads=replaced)
    shape = (table_batch, heads, differences.shape[0])
    values = {number: jnp.broadcast_to(value, shape) for number, value in recorded.items()}
    return values, read_indices


__all__ = ["DiagonalBlocks", "Dump", "RelativeRead", "TABLE_DTYPES", "WINDOW",
           "diagonal_blocks", "entry_count", "entry_tables", "numbered", "relative_reads",
           "relative_tables", "varying_axes"]
