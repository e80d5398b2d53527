"""PagedKVCache: page bookkeeping, token writes against a dense NumPy model, errors
(ValueError eagerly, checkify under jit), jit with donation, and agreement with
paged_attention's own cache writes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_flex import paged
from pallas_flex.paged import PagedKVCache, gather_contiguous

NUM_PAGES, PAGE_SIZE, MAX_BATCH, MAX_PAGES, KV_HEADS, HEAD_DIM, VALUE_DIM = 10, 4, 3, 4, 2, 8, 6


def new_cache(num_pages=NUM_PAGES, dtype=jnp.float32):
    return PagedKVCache.create(num_pages, PAGE_SIZE, MAX_BATCH, MAX_PAGES, KV_HEADS, HEAD_DIM,
                               value_dim=VALUE_DIM, dtype=dtype)


def tokens(rng, count, dtype=jnp.float32, batch=()):
    k = jnp.asarray(rng.standard_normal((*batch, count, KV_HEADS, HEAD_DIM)), dtype)
    v = jnp.asarray(rng.standard_normal((*batch, count, KV_HEADS, VALUE_DIM)), dtype)
    return k, v


def test_create_layout_and_properties():
    cache = new_cache(dtype=jnp.bfloat16)
    assert cache.k_pages.shape == (NUM_PAGES, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    assert cache.v_pages.shape == (NUM_PAGES, KV_HEADS, PAGE_SIZE, VALUE_DIM)
    assert cache.k_pages.dtype == jnp.bfloat16
    assert (cache.num_pages, cache.page_size, cache.max_batch, cache.max_pages_per_seq,
            cache.max_seq_len, cache.kv_heads, cache.head_dim, cache.value_dim) == (
        NUM_PAGES, PAGE_SIZE, MAX_BATCH, MAX_PAGES, MAX_PAGES * PAGE_SIZE, KV_HEADS, HEAD_DIM,
        VALUE_DIM)
    np.testing.assert_array_equal(cache.page_table, -1)
    np.testing.assert_array_equal(cache.lengths, 0)
    assert cache.page_table.dtype == cache.lengths.dtype == jnp.int32
    assert int(cache.num_free_pages) == NUM_PAGES
    # A pytree of its five arrays, nothing static.
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 5
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, PagedKVCache) and rebuilt.page_table is cache.page_table
    assert PagedKVCache.create(4, 2, 1, 2, 1, 3).v_pages.shape == (4, 1, 2, 3)


@pytest.mark.parametrize("argument, value, message", [
    ("num_pages", 0, r"num_pages must be a positive Python int, got 0"),
    ("page_size", 2.0, r"page_size must be a positive Python int, got 2.0"),
    ("value_dim", -1, r"value_dim must be a positive Python int, got -1"),
    ("dtype", jnp.int32,
     r"dtype must be float32, bfloat16, float16, int8 or float8_e4m3fn, got int32"),
])
def test_create_errors(argument, value, message):
    arguments = dict(num_pages=4, page_size=2, max_batch=1, max_pages_per_seq=2, kv_heads=1,
                     head_dim=3)
    arguments[argument] = value
    with pytest.raises(ValueError, match=message):
        PagedKVCache.create(**arguments)


def test_reserve_takes_the_lowest_free_pages_and_never_shrinks():
    cache = new_cache().reserve(1, 6)                       # 2 pages
    np.testing.assert_array_equal(cache.page_table[1], [0, 1, -1, -1])
    cache = cache.reserve(0, 1).reserve(1, 9)               # row 0: page 2; row 1 grows
    np.testing.assert_array_equal(cache.page_table, [[2, -1, -1, -1], [0, 1, 3, -1],
                                                     [-1, -1, -1, -1]])
    shrunk = cache.reserve(1, 2)
    np.testing.assert_array_equal(shrunk.page_table, cache.page_table)
    np.testing.assert_array_equal(cache.page_owner, [1, 1, 0, 1] + [-1] * 6)
    np.testing.assert_array_equal(cache.reserved_pages, [1, 3, 0])
    assert int(cache.num_free_pages) == NUM_PAGES - 4
    np.testing.assert_array_equal(cache.lengths, 0)         # reserving stores nothing
    assert cache.reserve(2, 0).page_table[2].tolist() == [-1] * MAX_PAGES


def test_erase_frees_pages_for_reuse():
    cache = new_cache().reserve(0, 8).reserve(1, 4).reserve(2, 4)   # pages 0-1, 2, 3
    rng = np.random.default_rng(0)
    cache = cache.assign(0, 0, *tokens(rng, 8))
    cache = cache.erase(0)
    np.testing.assert_array_equal(cache.page_table[0], -1)
    assert int(cache.lengths[0]) == 0
    np.testing.assert_array_equal(cache.page_owner, [-1, -1, 1, 2] + [-1] * 6)
    cache = cache.reserve(2, 13)                             # reuses 0 and 1, then 4
    np.testing.assert_array_equal(cache.page_table[2], [3, 0, 1, 4])
    k, v = tokens(rng, 13)
    cache = cache.assign(2, 0, k, v)
    k_all, v_all = gather_contiguous(cache)
    np.testing.assert_array_equal(k_all[2, :13], k)
    np.testing.assert_array_equal(v_all[2, :13], v)


def test_random_operations_match_a_dense_model():
    """reserve / assign (appends and rewrites) / erase in random order, checked after
    every step against per-row NumPy token lists through gather_contiguous."""
    rng = np.random.default_rng(1)
    cache = new_cache(num_pages=8)
    model = {row: np.zeros((0, KV_HEADS, HEAD_DIM + VALUE_DIM)) for row in range(MAX_BATCH)}
    for _ in range(20):
        row = int(rng.integers(MAX_BATCH))
        length = model[row].shape[0]
        held = int(np.sum(np.asarray(cache.page_table)[row] >= 0))
        action = rng.choice(["append", "rewrite", "erase"], p=[0.6, 0.25, 0.15])
        # Two token counts only, so assign compiles twice (it specializes on S).
        count = int(rng.choice([1, 3]))
        if action == "erase" and held:
            cache = cache.erase(row)
            model[row] = model[row][:0]
        elif action == "rewrite" and length >= count:
            start = int(rng.integers(length - count + 1))
            k, v = tokens(rng, count)
            cache = cache.assign(row, start, k, v)
            model[row][start:start + count] = np.concatenate([k, v], -1)
        else:
            if length + count > cache.max_seq_len:
                continue
            needed = -(-(length + count) // PAGE_SIZE) - held
            if needed > int(np.sum(np.asarray(cache.page_owner) < 0)):
                continue
            k, v = tokens(rng, count)
            cache = cache.reserve(row, length + count).assign(row, length, k, v)
            model[row] = np.concatenate([model[row], np.concatenate([k, v], -1)])
        # NumPy copies: slicing jax arrays eagerly would compile one program per slice.
        k_all, v_all, lengths, table, owners = map(np.asarray, (
            *gather_contiguous(cache), cache.lengths, cache.page_table, cache.page_owner))
        for r in range(MAX_BATCH):
            stored = model[r].shape[0]
            assert lengths[r] == stored
            np.testing.assert_array_equal(k_all[r, :stored], model[r][..., :HEAD_DIM])
            np.testing.assert_array_equal(v_all[r, :stored], model[r][..., HEAD_DIM:])
            np.testing.assert_array_equal(k_all[r, stored:], 0)
        for r in range(MAX_BATCH):  # the bookkeeping agrees with the page table
            listed = table[r][table[r] >= 0]
            assert sorted(np.flatnonzero(owners == r).tolist()) == sorted(listed.tolist())


def test_assign_batch_equals_assign_per_row():
    rng = np.random.default_rng(2)
    cache = new_cache().reserve(0, 9).reserve(1, 3).reserve(2, 7)
    cache = cache.assign(0, 0, *tokens(rng, 5)).assign(2, 0, *tokens(rng, 6))
    k, v = tokens(rng, 3, batch=(MAX_BATCH,))
    input_pos = jnp.array([5, 0, 4], jnp.int32)
    num_tokens = jnp.array([3, 0, 2], jnp.int32)            # row 1 idle, row 2 rewrites
    batched = cache.assign_batch(input_pos, k, v, num_tokens=num_tokens)
    one_by_one = cache.assign(0, 5, k[0], v[0]).assign(2, 4, k[2, :2], v[2, :2])
    for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(one_by_one)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(batched.lengths, [8, 0, 6])
    # Without num_tokens every row writes all S tokens.
    full = cache.reserve(1, 3).assign_batch(jnp.array([5, 0, 4]), k, v)
    np.testing.assert_array_equal(full.lengths, [8, 3, 7])
    np.testing.assert_array_equal(gather_contiguous(full)[0][1, :3], k[1])


def test_decode_loop_under_scan():
    """A jitted decode loop: one assign_batch per step inside lax.scan, cache as carry."""
    rng = np.random.default_rng(3)
    steps = 6
    cache = new_cache().reserve(0, 2 + steps).reserve(2, 1 + steps)
    cache = cache.assign(0, 0, *tokens(rng, 2)).assign(2, 0, *tokens(rng, 1))
    k, v = tokens(rng, 1, batch=(steps, MAX_BATCH))
    active = jnp.array([1, 0, 1], jnp.int32)

    @jax.jit
    def decode(cache, k, v):
        def step(cache, kv):
            return cache.assign_batch(cache.lengths, kv[0], kv[1], num_tokens=active), None
        return jax.lax.scan(step, cache, (k, v))[0]

    out = decode(cache, k, v)
    np.testing.assert_array_equal(out.lengths, [2 + steps, 0, 1 + steps])
    k_all, _ = gather_contiguous(out)
    np.testing.assert_array_equal(k_all[0, 2:2 + steps], k[:, 0, 0])
    np.testing.assert_array_equal(k_all[2, 1:1 + steps], k[:, 2, 0])


def _step(cache, batch_idx, seq_len, input_pos, k, v):
    return cache.reserve(batch_idx, seq_len).assign(batch_idx, input_pos, k, v)


def test_jit_with_donation_matches_eager():
    rng = np.random.default_rng(4)
    cache = new_cache().reserve(1, 3)
    cache = cache.assign(1, 0, *tokens(rng, 3))
    k, v = tokens(rng, 5)
    eager = _step(cache, 1, 8, 3, k, v)
    copy = jax.tree.map(jnp.copy, cache)
    jitted = jax.jit(_step, donate_argnums=0)(copy, jnp.int32(1), jnp.int32(8), jnp.int32(3),
                                               k, v)
    assert copy.k_pages.is_deleted()          # the pages were updated in place
    for got, want in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(got, want)
    # Another row, same compiled program (traced indices).
    other = jax.jit(_step)(cache, jnp.int32(2), jnp.int32(5), jnp.int32(0), k, v)
    np.testing.assert_array_equal(gather_contiguous(other)[0][2, :5], k)


# ---------------------------------------------------------------------------------------
# Errors: ValueError with concrete values, checkify under jit.

def _filled():
    rng = np.random.default_rng(5)
    cache = new_cache(num_pages=5).reserve(0, 12).reserve(1, 4)       # 1 page left
    return cache.assign(0, 0, *tokens(rng, 10))


BAD_CALLS = {
    # name: (operation(cache, k3, v3) with integer arguments, message)
    "out_of_pages": (lambda c, k, v: c.reserve(2, 9),
                     r"out of pages: row 2 needs 3 more pages for 9 tokens but only 1 are free"),
    "seq_len_too_long": (lambda c, k, v: c.reserve(2, 17),
                         r"seq_len must be in \[0, 16\] \(max_pages_per_seq \* page_size = 4 \* "
                         r"4\), got 17"),
    "reserve_row_out_of_range": (lambda c, k, v: c.reserve(3, 1),
                                 r"batch_idx must be in \[0, 3\) \(max_batch\), got 3"),
    "erase_empty_slot": (lambda c, k, v: c.erase(2),
                         r"cannot erase row 2: it holds no pages \(an empty slot\)"),
    "erase_row_out_of_range": (lambda c, k, v: c.erase(-1),
                               r"batch_idx must be in \[0, 3\) \(max_batch\), got -1"),
    "assign_past_reservation": (lambda c, k, v: c.assign(0, 10, k, v),
                                r"writing up to position 13 of row 0 needs a reservation, but "
                                r"the row's pages hold 12 tokens \(call reserve first\)"),
    "assign_to_empty_row": (lambda c, k, v: c.assign(2, 0, k, v),
                            r"writing up to position 3 of row 2 needs a reservation, but the "
                            r"row's pages hold 0 tokens"),
    "assign_gap": (lambda c, k, v: c.assign(1, 1, k, v),
                   r"input_pos 1 would leave a gap in row 1, which holds 0 tokens"),
    "assign_negative_position": (lambda c, k, v: c.assign(0, -1, k, v),
                                 r"input_pos must be >= 0, got -1 for row 0"),
    "assign_row_out_of_range": (lambda c, k, v: c.assign(5, 0, k, v),
                                r"batch_idx must be in \[0, 3\) \(max_batch\), got 5"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_when_concrete(case):
    operation, message = BAD_CALLS[case]
    k, v = tokens(np.random.default_rng(6), 3)
    with pytest.raises(ValueError, match=message):
        operation(_filled(), k, v)


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_are_reported_by_checkify_under_jit(case):
    operation, message = BAD_CALLS[case]
    k, v = tokens(np.random.default_rng(6), 3)
    cache = _filled()
    error, result = checkify.checkify(jax.jit(operation))(cache, k, v)
    reported = error.get()
    assert reported is not None and re.search(message, reported), reported
    # The computation itself (what a plain jit runs) left the cache as it was.
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(got, want)


def test_checkify_reports_nothing_for_good_calls():
    k, v = tokens(np.random.default_rng(7), 3)
    good = jax.jit(lambda c, b, k, v: c.reserve(b, 3).assign(b, 0, k, v).erase(b))
    error, _ = checkify.checkify(good)(_filled(), jnp.int32(2), k, v)
    assert error.get() is None


def test_batch_checks_under_checkify():
    k, v = tokens(np.random.default_rng(8), 2, batch=(MAX_BATCH,))
    # Row 1 holds 0 tokens in one page: writing at 3 leaves a gap. Row 2 is idle.
    assign = jax.jit(lambda c, pos, n: c.assign_batch(pos, k, v, num_tokens=n))
    error, _ = checkify.checkify(assign)(_filled(), jnp.array([10, 3, 7]), jnp.array([2, 1, 0]))
    assert re.search(r"input_pos 3 would leave a gap in row 1, which holds 0 tokens",
                     error.get())
    error, _ = checkify.checkify(assign)(_filled(), jnp.array([10, 0, 7]), jnp.array([2, 1, 0]))
    assert error.get() is None


@pytest.mark.parametrize("operation, message", [
    (lambda c, k, v: c.assign(0, 0, k[None], v),
     r"k must be a 3-D array \[S, Hkv, D\], got shape \(1, 3, 2, 8\)"),
    (lambda c, k, v: c.assign(0, 0, k[:, :1], v),
     r"k must have shape \(3, 2, 8\) \(the cache has 2 kv heads of dim 8\), got \(3, 1, 8\)"),
    (lambda c, k, v: c.assign(0, 0, k, v[..., :4]),
     r"v must have shape \(3, 2, 6\) \(the cache has 2 kv heads of dim 6\)"),
    (lambda c, k, v: c.assign(0, 0, k, v[:2]), r"k and v must hold the same number of tokens, "
                                               r"got 3 and 2"),
    (lambda c, k, v: c.assign(0, 0, k.astype(jnp.bfloat16), v),
     r"k must have the cache's dtype float32, got bfloat16"),
    (lambda c, k, v: c.assign(0.5, 0, k, v), r"batch_idx must be an integer or an integer "
                                             r"scalar array, got float"),
    (lambda c, k, v: c.assign(jnp.array([0]), 0, k, v),
     r"batch_idx must be an integer scalar, got an array of shape \(1,\)"),
    (lambda c, k, v: c.assign_batch(jnp.zeros(3, jnp.int32), k, v),
     r"k must be a 4-D array \[B, S, Hkv, D\], got shape \(3, 2, 8\)"),
    (lambda c, k, v: c.assign_batch(jnp.zeros(2, jnp.int32), jnp.stack([k] * 3),
                                    jnp.stack([v] * 3)),
     r"input_pos must have length 3, got 2"),
    (lambda c, k, v: c.assign_batch(jnp.zeros(3, jnp.int32), jnp.stack([k] * 3),
                                    jnp.stack([v] * 3), num_tokens=jnp.array([1, 4, 0])),
     r"num_tokens must be in \[0, 3\] \(k.shape\[1\]\); num_tokens\[1\] = 4"),
    (lambda c, k, v: gather_contiguous(c.k_pages), r"cache must be a PagedKVCache, got"),
])
def test_bad_arguments(operation, message):
    k, v = tokens(np.random.default_rng(9), 3)
    with pytest.raises(ValueError, match=message):
        operation(_filled(), k, v)


def test_paged_attention_writes_where_assign_writes():
    """The ragged op and the cache share one layout: feeding it the cache's page table
    as block_indices, its cache write equals assign_batch's."""
    rng = np.random.default_rng(10)
    cache = new_cache().reserve(0, 7).reserve(2, 5)
    cache = cache.assign(0, 0, *tokens(rng, 5)).assign(2, 0, *tokens(rng, 2))
    new = {0: 2, 2: 3}                      # row -> new tokens (a decode and a chunk)
    k, v = tokens(rng, 3, batch=(MAX_BATCH,))
    counts = jnp.array([new.get(row, 0) for row in range(MAX_BATCH)], jnp.int32)
    expected = cache.reserve(0, 7).assign_batch(cache.lengths, k, v, num_tokens=counts)

    rows = sorted(new)
    table = np.asarray(cache.page_table)
    blocks = [table[row][table[row] >= 0] for row in rows]
    key = jnp.concatenate([k[row, :new[row]] for row in rows]).reshape(-1, KV_HEADS * HEAD_DIM)
    value = jnp.concatenate([v[row, :new[row]] for row in rows]).reshape(-1, KV_HEADS * VALUE_DIM)
    query = jnp.zeros((key.shape[0], KV_HEADS * HEAD_DIM))
    _, k_pages, v_pages = paged.paged_attention(
        query, key, value, cache.k_pages, cache.v_pages,
        past_lens=cache.lengths[jnp.array(rows)],
        subsequence_begins=jnp.array(np.cumsum([0] + [new[row] for row in rows])),
        block_indices=jnp.array(np.concatenate(blocks)),
        block_indices_begins=jnp.array(np.cumsum([0] + [len(b) for b in blocks])))
    np.testing.assert_array_equal(k_pages, expected.k_pages)
    np.testing.assert_array_equal(v_pages, expected.v_pages)


def test_traced_checks_off_for_the_cache_methods():
    from pallas_flex.paged import traced_checks

    k, v = tokens(np.random.default_rng(9), 3)
    step = lambda c, b: c.reserve(b, 3).assign(b, 0, k, v).erase(b)
    assert jax.make_jaxpr(step)(_filled(), jnp.int32(2)).effects
    with traced_checks(False):
        assert not jax.make_jaxpr(step)(_filled(), jnp.int32(2)).effects
        error, _ = checkify.checkify(jax.jit(lambda c: c.reserve(2, 9)))(_filled())
    assert error.get() is None  # out of pages, unreported: the checks were left out


def test_set_traced_checks_is_the_process_default():
    from pallas_flex.paged import set_traced_checks, traced_checks

    step = jax.jit(lambda c, b: c.reserve(b, 3))
    try:
        set_traced_checks(False)
        assert not jax.make_jaxpr(step)(_filled(), jnp.int32(2)).effects
        with traced_checks(True):  # a context overrides the default
            assert jax.make_jaxpr(step)(_filled(), jnp.int32(2)).effects
    finally:
        set_traced_checks(True)
    assert jax.make_jaxpr(step)(_filled(), jnp.int32(2)).effects
    with pytest.raises(ValueError, match="enabled must be a bool"):
        set_traced_checks("no")
