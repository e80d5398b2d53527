"""Fault injection (issue 24): nothing leaks, nothing is silently wrong.

Stale memory past a sequence's length (NaN / inf in reused pages and blocks), corrupt
page tables, lengths past the reserved pages, NaN / inf in the inputs, and the bad
arguments of the issue: each call gives the reference result or a ValueError naming the
problem (a checkify error under jit), and never mutates what the caller passed. The
"pallas" parameters run on the GPU machine (`-m gpu`).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_flex as pf
from pallas_flex import masks, paged
from pallas_flex.paged.cache import PagedKVCache, gather_contiguous
from tests.conftest import FLOAT32_TOLERANCE, golden
from tests.paged.ragged_reference import reference_paged_attention

BACKENDS = ["xla", "interpret", pytest.param("pallas", marks=pytest.mark.gpu)]
STALE = [np.nan, np.inf]

PAGE_SIZE, MAX_PAGES, NUM_PAGES = 8, 4, 16
Q_HEADS, KV_HEADS, DIM = 4, 2, 16


def _tolerance(backend):
    # On the GPU float32 dots are three TF32 products (tests/gpu/conftest.py).
    return 1e-4 if backend == "pallas" else FLOAT32_TOLERANCE


def _snapshot(*arrays):
    return [np.array(x) for x in jax.tree.leaves(arrays)]


def _assert_unchanged(before, *arrays):
    after = jax.tree.leaves(arrays)
    assert len(before) == len(after)
    for old, new in zip(before, after):
        np.testing.assert_array_equal(np.asarray(new), old)


def _tokens(rng, count, dim=DIM):
    return jnp.asarray(rng.standard_normal((count, KV_HEADS, dim)), jnp.float32)


def _cache(lengths, seed=0):
    """A float32 cache whose rows hold `lengths` random tokens, pages of the rows
    interleaved in the pool."""
    rng = np.random.default_rng(seed)
    cache = PagedKVCache.create(num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                max_batch=len(lengths), max_pages_per_seq=MAX_PAGES,
                                kv_heads=KV_HEADS, head_dim=DIM, dtype=jnp.float32)
    filled = [0] * len(lengths)
    while any(f < n for f, n in zip(filled, lengths)):
        for row, length in enumerate(lengths):
            chunk = min(PAGE_SIZE, length - filled[row])
            if chunk > 0:
                cache = cache.reserve(row, filled[row] + chunk)
                cache = cache.assign(row, filled[row], _tokens(rng, chunk), _tokens(rng, chunk))
                filled[row] += chunk
    return cache


def _poison_past_lengths(cache, value):
    """Every page slot no row's length covers (unused pages included) set to `value`."""
    written = np.zeros(cache.num_pages * cache.page_size, bool)
    table, lengths = np.asarray(cache.page_table), np.asarray(cache.lengths)
    for row, length in enumerate(lengths):
        for position in range(length):
            page = table[row, position // cache.page_size]
            written[page * cache.page_size + position % cache.page_size] = True
    stale = jnp.asarray(~written.reshape(-1, 1, cache.page_size, 1))
    return dataclasses.replace(cache, k_pages=jnp.where(stale, value, cache.k_pages),
                               v_pages=jnp.where(stale, value, cache.v_pages))


def _paged_golden(q, cache, mask_mod=None):
    """float64 attention over the cache's stored tokens (gathered; zero past lengths)."""
    k, v = gather_contiguous(cache)
    lengths = cache.lengths

    def stored(b, h, q_idx, kv_idx):
        keep = kv_idx < lengths[b]
        return keep if mask_mod is None else keep & mask_mod(b, h, q_idx, kv_idx)

    return golden(q, k, v, mask_mod=stored)


def _queries(batch, q_len, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, q_len, Q_HEADS, DIM))


# ---------------------------------------------------------------------------------------
# paged_flex_attention: stale pages, reused pages


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [1, 32], ids=["decode", "prefill"])
@pytest.mark.parametrize("value", STALE, ids=str)
def test_paged_stale_slots_never_reach_the_output(value, q_len, backend):
    """NaN / inf in every slot past `lengths` (lengths mid-page and page-aligned): the
    output is the clean cache's, bit for bit, and the float64 golden value's."""
    cache = _cache([21, 16, 3])
    q = _queries(3, q_len)
    mask_mod = masks.offset(masks.causal_mask, jnp.maximum(cache.lengths - q_len, 0))
    clean = pf.paged.paged_flex_attention(q, cache, mask_mod=mask_mod, backend=backend)
    poisoned = _poison_past_lengths(cache, value)
    before = _snapshot(q, poisoned)
    out = pf.paged.paged_flex_attention(q, poisoned, mask_mod=mask_mod, backend=backend)
    _assert_unchanged(before, q, poisoned)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(out, clean)
    expected, _ = _paged_golden(q, cache, mask_mod)
    np.testing.assert_allclose(out, expected, atol=_tolerance(backend), rtol=_tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reused_pages_after_erase_hold_old_nan(backend):
    """A finished request filled its pages with NaN (its own data); after `erase` the next
    request reserves the same pages and writes fewer tokens: the old NaN past its length
    reaches neither decode (Sq 1) nor prefill (Sq 32)."""
    rng = np.random.default_rng(3)
    cache = _cache([0, 10], seed=2)
    nan_tokens = jnp.full((24, KV_HEADS, DIM), jnp.nan, jnp.float32)
    cache = cache.reserve(0, 24).assign(0, 0, nan_tokens, nan_tokens)
    old_pages = np.asarray(cache.page_table[0, :3])
    cache = cache.erase(0).reserve(0, 13)
    np.testing.assert_array_equal(cache.page_table[0, :2], old_pages[:2])  # reused
    cache = cache.assign(0, 0, _tokens(rng, 13), _tokens(rng, 13))
    for q_len in (1, 32):
        q = _queries(2, q_len, seed=q_len)
        out = pf.paged.paged_flex_attention(q, cache, backend=backend)
        assert np.isfinite(np.asarray(out)).all(), q_len
        expected, _ = _paged_golden(q, cache)
        np.testing.assert_allclose(out, expected, atol=_tolerance(backend),
                                   rtol=_tolerance(backend))


# ---------------------------------------------------------------------------------------
# paged_flex_attention and PagedKVCache: corrupt page tables, lengths past reservations


def _corrupt(field, row, column, value):
    def corrupt(cache):
        if field == "page_table":
            return dataclasses.replace(
                cache, page_table=cache.page_table.at[row, column].set(value))
        return dataclasses.replace(cache, lengths=cache.lengths.at[row].set(value))
    return corrupt


# Rows of `_cache([21, 5])`: row 0 holds 3 pages (21 tokens), row 1 one page (5 tokens).
CORRUPT = {
    "entry_past_pool": (_corrupt("page_table", 1, 0, 999),
                        r"page_table\[1, 0\] = 999 is out of range: page table entries must "
                        r"be -1 \(no page\) or a page of the pool, in \[0, 16\) \(num_pages\)"),
    "negative_entry": (_corrupt("page_table", 0, 1, -5),
                       r"page_table\[0, 1\] = -5 is out of range: page table entries must "
                       r"be -1 \(no page\) or a page of the pool, in \[0, 16\)"),
    "hole": (_corrupt("page_table", 0, 1, -1),
             r"page_table\[0, 2\] = \d+ follows an empty entry \(-1\) in row 0: a row's "
             r"pages must fill a prefix of its table row"),
    "length_past_reserved": (_corrupt("lengths", 1, None, 9),
                             r"lengths\[1\] = 9 is out of range: row 1 has 1 pages reserved, "
                             r"so its length must be in \[0, 8\] \(pages \* page_size 8\)"),
    "negative_length": (_corrupt("lengths", 0, None, -1),
                        r"lengths\[0\] = -1 is out of range: row 0 has 3 pages reserved"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_page_tables_and_lengths(case, backend):
    """A ValueError naming the row, the entry and the pool eagerly, from
    paged_flex_attention and from the cache methods that read the table; the same
    message from checkify under jit; nothing mutated."""
    corrupt, message = CORRUPT[case]
    cache = corrupt(_cache([21, 5]))
    q = _queries(2, 1)
    before = _snapshot(q, cache)
    with pytest.raises(ValueError, match=message):
        pf.paged.paged_flex_attention(q, cache, backend=backend)
    k = _tokens(np.random.default_rng(0), 1)
    for method in (lambda c: c.validate(), lambda c: c.reserve(1, 8),
                   lambda c: c.assign(1, 0, k, k),
                   lambda c: c.assign_batch(jnp.zeros(2, jnp.int32), k[None].repeat(2, 0),
                                            k[None].repeat(2, 0)),
                   gather_contiguous):
        with pytest.raises(ValueError, match=message):
            method(cache)
    _assert_unchanged(before, q, cache)
    # Under jit the read path leaves the checks to cache.validate() (a debug check's
    # effect would tax every call's dispatch): checkify reports them from there.
    attend = jax.jit(lambda q, cache: pf.paged.paged_flex_attention(
        q, cache.validate(), backend=backend))
    error, _ = checkify.checkify(attend)(q, cache)
    assert error.get() is not None and re.search(message, error.get()), error.get()


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_traced_paged_attention_has_no_effects(backend):
    """paged_flex_attention under jit emits no checks: an effect-free program keeps
    JAX's fast dispatch (the kernels clamp page-table entries into the pool instead)."""
    cache = _cache([21, 5])
    jaxpr = jax.make_jaxpr(lambda q, cache: pf.paged.paged_flex_attention(
        q, cache, backend=backend))(_queries(2, 1), cache)
    assert not jaxpr.effects


def test_valid_caches_pass_the_checks_under_checkify():
    cache = _cache([21, 0])  # an empty row: no pages, length 0
    q = _queries(2, 1)
    attend = jax.jit(lambda q, cache: pf.paged.paged_flex_attention(q, cache.validate(),
                                                                    backend="xla"))
    error, _ = checkify.checkify(attend)(q, cache)
    assert error.get() is None


# ---------------------------------------------------------------------------------------
# The ragged op: stale blocks, bad arguments


def _ragged_case(seed=0, block_size=4):
    """Three sequences (a prompt, a decode step, a chunk on history), each listed with one
    spare block, plus unused blocks: every block slot past a context is stale."""
    rng = np.random.default_rng(seed)
    past, new = np.array([0, 9, 5], np.int32), np.array([6, 1, 3], np.int32)
    counts = -(-(past + new) // block_size) + 1
    num_blocks = int(counts.sum()) + 2
    block_indices = rng.permutation(num_blocks)[:counts.sum()].astype(np.int32)
    tokens = int(new.sum())

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    case = dict(query=normal(tokens, Q_HEADS * DIM), key=normal(tokens, KV_HEADS * DIM),
                value=normal(tokens, KV_HEADS * DIM),
                key_cache=normal(num_blocks, KV_HEADS, block_size, DIM),
                value_cache=normal(num_blocks, KV_HEADS, block_size, DIM),
                past_lens=jnp.asarray(past),
                subsequence_begins=jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32),
                block_indices=jnp.asarray(block_indices),
                block_indices_begins=jnp.asarray(np.concatenate([[0], np.cumsum(counts)]),
                                                 jnp.int32))
    written = np.zeros(num_blocks * block_size, bool)
    begins = np.asarray(case["block_indices_begins"])
    for s in range(len(past)):
        for p in range(past[s] + new[s]):
            block = block_indices[begins[s] + p // block_size]
            written[block * block_size + p % block_size] = True
    return case, jnp.asarray(~written.reshape(num_blocks, 1, block_size, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", STALE, ids=str)
def test_ragged_stale_slots_never_reach_output_or_scores(value, backend):
    case, stale = _ragged_case()
    clean_out, clean_scores, *_ = paged.paged_attention(**case, backend=backend,
                                                        return_scores=True)
    poisoned = dict(case, key_cache=jnp.where(stale, value, case["key_cache"]),
                    value_cache=jnp.where(stale, value, case["value_cache"]))
    before = _snapshot(poisoned)
    out, scores, *_ = paged.paged_attention(**poisoned, backend=backend, return_scores=True)
    _assert_unchanged(before, poisoned)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(scores)).all()
    np.testing.assert_array_equal(out, clean_out)
    # The scores are sums over tokens whose order on the GPU is not fixed run to run
    # (1-ulp differences seen on the H100): equal to float32 rounding, not bitwise.
    np.testing.assert_allclose(scores, clean_scores, rtol=1e-6, atol=0)
    expected = reference_paged_attention(**case)
    np.testing.assert_allclose(out, expected[0], atol=_tolerance(backend),
                               rtol=_tolerance(backend))


def _ragged_call(**changes):
    case, _ = _ragged_case()
    case.update(changes)
    return lambda: paged.paged_attention(**case, backend="xla")


RAGGED_ERRORS = {
    "zero_sequences": (dict(past_lens=jnp.zeros((0,), jnp.int32),
                            subsequence_begins=jnp.zeros((1,), jnp.int32),
                            block_indices_begins=jnp.zeros((1,), jnp.int32)),
                       r"past_lens must list at least one sequence, got 0 sequences"),
    "nan_scale": (dict(scale=float("nan")), r"scale must be finite, got nan"),
    "inf_scale_array": (dict(scale=jnp.float32(np.inf)), r"scale must be finite, got inf"),
    "block_past_pool": (dict(block_indices=jnp.full((10,), 999, jnp.int32)),
                        r"block_indices\[0\] = 999 \(a block of sequence 0\) is out of range "
                        r"\[0, 12\)"),
    "negative_block": (dict(block_indices=jnp.full((10,), -5, jnp.int32)),
                       r"block_indices\[0\] = -5 \(a block of sequence 0\) is out of range"),
    "context_past_blocks": (dict(past_lens=jnp.asarray([0, 20, 5], jnp.int32)),
                            r"sequence 1 needs 21 cache positions"),
}


@pytest.mark.parametrize("case", RAGGED_ERRORS)
def test_ragged_bad_arguments(case):
    changes, message = RAGGED_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        _ragged_call(**changes)()


def test_ragged_traced_non_finite_scale_under_checkify():
    case, _ = _ragged_case()
    attend = jax.jit(lambda scale: paged.paged_attention(**case, scale=scale, backend="xla"))
    error, _ = checkify.checkify(attend)(jnp.float32(np.nan))
    assert re.search(r"scale must be finite, got nan", error.get() or ""), error.get()
    error, _ = checkify.checkify(attend)(jnp.float32(0.3))
    assert error.get() is None


# ---------------------------------------------------------------------------------------
# NaN / inf in q, k, v: used positions propagate, masked values are not inert (README,
# "Semantics"), skipped blocks are never read. Causal over 256 positions, BlockMask blocks
# of 128: query block 0 (rows 0-127) never visits KV block 1, where the poison sits.

S_LONG, POISONED_KEY, HEAD_OF_GROUP_1 = 256, 130, 2


def _long_qkv():
    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    shapes = [(1, S_LONG, Q_HEADS, DIM), (1, S_LONG, KV_HEADS, DIM), (1, S_LONG, KV_HEADS, DIM)]
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]


def _check_poison(tensor, value, nonfinite_rows, backend):
    """Poisons `tensor` ("q": row 5 of query head 2; "k"/"v": key 130 of kv head 1, read
    by query heads 2 and 3); rows in `nonfinite_rows` (of the heads reading the poison)
    must be non-finite, all others equal the reference with the poison replaced by 0."""
    q, k, v = _long_qkv()
    inputs = {"q": q, "k": k, "v": v}
    index = (0, 5, HEAD_OF_GROUP_1) if tensor == "q" else (0, POISONED_KEY, 1)
    inputs[tensor] = inputs[tensor].at[index].set(jnp.zeros(DIM).at[3].set(value))
    cleaned = dict(inputs, **{tensor: inputs[tensor].at[index].set(0.0)})
    before = _snapshot(inputs)
    out = np.asarray(pf.attention(inputs["q"], inputs["k"], inputs["v"],
                                  mask_mod=masks.causal_mask, backend=backend))
    _assert_unchanged(before, inputs)
    expected, _ = golden(cleaned["q"], cleaned["k"], cleaned["v"], mask_mod=masks.causal_mask)
    heads = [HEAD_OF_GROUP_1] if tensor == "q" else [HEAD_OF_GROUP_1, HEAD_OF_GROUP_1 + 1]
    bad = np.zeros(out.shape[1:3], bool)
    bad[np.ix_(nonfinite_rows, heads)] = True
    assert (~np.isfinite(out[0][bad])).any(axis=-1).all(), "poisoned rows must be non-finite"
    np.testing.assert_allclose(out[0][~bad], expected[0][~bad], atol=_tolerance(backend),
                               rtol=_tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_documented_masked_value_contract(backend):
    """NaN in v at key 130: query block 0 never visits KV block 1, so rows 0-127 are
    exact; rows 130+ use the key (NaN); rows 128-129 mask it, but their tile reads it and
    0 * NaN = NaN: documented behaviour (README, "Semantics")."""
    _check_poison("v", np.nan, np.arange(128, S_LONG), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tensor, value, first_bad", [
    ("q", np.nan, None),              # only the poisoned query row
    ("k", np.nan, POISONED_KEY),      # rows that use the key; a masked NaN score is inert
    ("v", np.inf, 128),               # as NaN: 0 * inf = NaN in the masked rows' tile
], ids=["q_nan", "k_nan", "v_inf"])
def test_non_finite_inputs_at_used_positions_propagate(tensor, value, first_bad, backend):
    rows = np.array([5]) if first_bad is None else np.arange(first_bad, S_LONG)
    _check_poison(tensor, value, rows, backend)


# ---------------------------------------------------------------------------------------
# The issue's bad arguments, one call each (details in the files of each feature).

_Q = jnp.ones((1, 16, 2, 8))
_TABLE = np.arange(16)

BAD_CALLS = {
    "attention_nan_scale": (lambda: pf.attention(_Q, _Q, _Q, scale=float("nan"), backend="xla"),
                            r"scale must be finite, got nan"),
    "flex_attention_inf_scale": (lambda: pf.flex_attention(_Q, _Q, _Q, scale=float("inf"),
                                                           backend="interpret"),
                                 r"scale must be finite, got inf"),
    "from_kv_blocks_past_kv_len": (
        lambda: pf.BlockMask.from_kv_blocks(np.ones((1, 1, 1), np.int32),
                                            np.full((1, 1, 1, 2), 2, np.int32), block_size=16),
        r"kv_indices\[0, 0, 0, 0\] = 2 is out of range: KV block indices must be in \[0, 2\)"),
    "merge_lists": (lambda: pf.merge_attention_states([[[[0.0]]]], [[[0.0]]], [[[[0.0]]]],
                                                      [[[0.0]]]),
                    r"out_a must be an array \(jax.Array or numpy.ndarray\), got list"),
    "mask_mod_numpy_table": (
        lambda: pf.attention(_Q, _Q, _Q, mask_mod=lambda b, h, q, kv: _TABLE[q] >= kv,
                             backend="xla"),
        r"mask_mod '<lambda>' indexes a Python list/tuple or NumPy array .* wrap it with "
        r"jnp.asarray"),
    "score_mod_list": (
        lambda: pf.attention(_Q, _Q, _Q, score_mod=lambda s, b, h, q, kv: s + list(_TABLE)[kv],
                             backend="interpret"),
        r"score_mod '<lambda>' indexes a Python list/tuple or NumPy array"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_of_the_issue(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call()
