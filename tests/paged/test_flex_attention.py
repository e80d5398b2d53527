"""paged_flex_attention: kernels reading pages in place vs the same attention on the
contiguous logical K/V (float64 golden values)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.paged.cache import PagedKVCache, gather_contiguous
from pallas_flex.paged.flex_attention import paged_flex_attention
from tests.conftest import assert_close_to_golden, golden

PAGED_BACKENDS = ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)]


def _filled_cache(lengths, *, page_size, max_pages, kv_heads, dim, value_dim, dtype, seed=0,
                  latent=False):
    """A cache whose rows hold random tokens; rows reserved in an interleaved order so
    that pages of different rows alternate in memory. latent: a latent cache (the values
    are the keys' first value_dim columns)."""
    batch = len(lengths)
    cache = PagedKVCache.create(num_pages=batch * max_pages + 2, page_size=page_size,
                                max_batch=batch, max_pages_per_seq=max_pages,
                                kv_heads=kv_heads, head_dim=dim, value_dim=value_dim,
                                dtype=dtype, latent=latent)
    rng = np.random.default_rng(seed)
    filled = [0] * batch
    while any(f < n for f, n in zip(filled, lengths)):
        for b, length in enumerate(lengths):
            chunk = min(page_size, length - filled[b])
            if chunk <= 0:
                continue
            cache = cache.reserve(b, filled[b] + chunk)
            k = jnp.asarray(rng.normal(size=(chunk, kv_heads, dim)), dtype)
            v = jnp.asarray(rng.normal(size=(chunk, kv_heads, value_dim)), dtype)
            cache = cache.assign(b, filled[b], k, None if latent else v)
            filled[b] += chunk
    return cache


def _poisoned_past_lengths(cache, value):
    """The cache with every page slot that no row's length covers set to `value` (stale
    memory of earlier requests, unused pages included)."""
    page_size = cache.page_size
    written = np.zeros(cache.k_pages.shape[0] * page_size, bool)
    table, lengths = np.asarray(cache.page_table), np.asarray(cache.lengths)
    for row, length in enumerate(lengths):
        for position in range(length):
            written[table[row, position // page_size] * page_size + position % page_size] = True
    stale = ~written.reshape(-1, 1, page_size, 1)
    return dataclasses.replace(
        cache, k_pages=jnp.where(stale, value, cache.k_pages),
        v_pages=None if cache.v_pages is None else jnp.where(stale, value, cache.v_pages))


def check_stale_slots_never_read(lengths, *, page_size, kv_len, q_len, q_heads, kv_heads,
                                 dim, stale, kernel_options, backend, latent=False):
    """paged_flex_attention over a bfloat16 cache of `lengths` random tokens (logical
    length kv_len), its queries the rows' last q_len positions under a causal mask, with
    every slot past the lengths (a reused page's old contents) holding `stale` (NaN /
    inf): the clean cache's output and lse, bit for bit. latent: a latent cache (the
    values are the keys, Dv = D)."""
    cache = _filled_cache(lengths, page_size=page_size, max_pages=-(-kv_len // page_size),
                          kv_heads=kv_heads, dim=dim, value_dim=dim, dtype=jnp.bfloat16,
                          latent=latent)
    q = jax.random.normal(jax.random.PRNGKey(3), (len(lengths), q_len, q_heads, dim)).astype(
        jnp.bfloat16)
    mask_mod = masks.offset(masks.causal_mask, jnp.maximum(cache.lengths - q_len, 0))

    def run(cache):
        return paged_flex_attention(q, cache, mask_mod=mask_mod, backend=backend,
                                    return_lse=True, kernel_options=kernel_options)

    clean_out, clean_lse = run(cache)
    out, lse = run(_poisoned_past_lengths(cache, stale))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))


# (lengths, page_size, Sq, Hq, Hkv, D, Dv, dtype, mask, score, kernel_options)
CASES = {
    "decode_gqa_causal": ([70, 5, 33], 16, 1, 4, 2, 32, 32, jnp.float32, "causal", None,
                          {"block_kv": 16}),
    "decode_tile_spans_pages_alibi": ([61, 128], 8, 2, 4, 1, 32, 48, jnp.float32, "causal",
                                      "alibi", {"decode_block_kv": 32}),
    "decode_bf16_softcap": ([100, 64], 32, 1, 4, 4, 64, 64, jnp.bfloat16, None, "softcap", {}),
    "decode_empty_row": ([0, 40], 16, 1, 2, 2, 32, 32, jnp.float32, "causal", None, {}),
    "prefill_on_history": ([90, 47], 16, 24, 4, 2, 32, 32, jnp.float32, "causal", "alibi",
                           {"block_q": 16, "block_kv": 16}),
    "prefill_tile_spans_pages_sliding": ([80, 30], 8, 20, 2, 1, 32, 32, jnp.float32,
                                         "sliding", None, {"block_q": 16, "block_kv": 32}),
}


def check_paged_against_golden(lengths, page_size, q_len, q_heads, kv_heads, dim, value_dim,
                               dtype, mask_name, score_name, kernel_options, backend, *,
                               window=12, latent=False):
    """paged_flex_attention over a cache holding `lengths` random tokens per row, the
    queries being each row's last q_len tokens (mask "causal" or "sliding" (`window`),
    offset to those positions; score "alibi" or "softcap"), against the golden attention
    over the gathered contiguous K/V: outputs, lse, and zeros for an empty row. latent:
    on a latent cache (values = the keys' first value_dim columns)."""
    max_pages = -(-max(lengths) // page_size) + 1
    cache = _filled_cache(lengths, page_size=page_size, max_pages=max_pages,
                          kv_heads=kv_heads, dim=dim, value_dim=value_dim, dtype=dtype,
                          latent=latent)
    batch = len(lengths)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, q_len, q_heads, dim)).astype(dtype)
    # The queries are the last q_len tokens of each row (absolute positions).
    positions = jnp.maximum(cache.lengths - q_len, 0)
    base_mask = {"causal": masks.causal_mask, "sliding": masks.sliding_window(window),
                 None: None}[mask_name]
    mask_mod = masks.offset(base_mask, positions) if base_mask is not None else None
    score_mod = {None: None, "alibi": masks.alibi(q_heads),
                 "softcap": masks.tanh_softcap(3.0)}[score_name]
    out, lse = paged_flex_attention(q, cache, mask_mod=mask_mod, score_mod=score_mod,
                                    backend=backend, return_lse=True,
                                    kernel_options=kernel_options)

    k, v = gather_contiguous(cache)
    lengths_array = cache.lengths

    def in_cache(b, h, q_idx, kv_idx):
        keep = kv_idx < lengths_array[b]
        return keep if mask_mod is None else keep & mask_mod(b, h, q_idx, kv_idx)

    expected_out, expected_lse = golden(q, k, v, in_cache, score_mod)
    assert_close_to_golden(out, expected_out, q, k, v, in_cache, score_mod)
    finite = np.isfinite(expected_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], expected_lse[finite],
                               atol=1e-4 if dtype == jnp.float32 else 3e-2)
    if 0 in lengths:
        np.testing.assert_array_equal(np.asarray(out[lengths.index(0)], np.float32), 0.0)


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_paged_matches_contiguous_golden(case, backend):
    check_paged_against_golden(*CASES[case], backend)


def test_paged_jits_and_does_not_recompile_across_steps():
    cache = _filled_cache([20, 9], page_size=16, max_pages=3, kv_heads=2, dim=32,
                          value_dim=32, dtype=jnp.float32)
    q = jnp.ones((2, 1, 2, 32), jnp.float32)

    @jax.jit
    def step(q, cache):
        mask_mod = masks.offset(masks.causal_mask, cache.lengths - 1)
        return paged_flex_attention(q, cache, mask_mod=mask_mod, backend="interpret")

    first = step(q, cache)
    cache = cache.reserve(1, 10).assign(1, 9, jnp.ones((1, 2, 32)), jnp.ones((1, 2, 32)))
    second = step(q, cache)
    assert step._cache_size() == 1
    assert not np.allclose(first[1], second[1])


def test_paged_errors():
    cache = PagedKVCache.create(num_pages=4, page_size=16, max_batch=2, max_pages_per_seq=2,
                                kv_heads=2, head_dim=32, dtype=jnp.float32)
    good = jnp.zeros((2, 1, 4, 32), jnp.float32)
    with pytest.raises(ValueError, match="batch 2"):
        paged_flex_attention(jnp.zeros((3, 1, 4, 32)), cache)
    with pytest.raises(ValueError, match="head dim"):
        paged_flex_attention(jnp.zeros((2, 1, 4, 16)), cache)
    with pytest.raises(ValueError, match="dtype"):
        paged_flex_attention(good.astype(jnp.bfloat16), cache)
    with pytest.raises(ValueError, match="multiple"):
        paged_flex_attention(jnp.zeros((2, 1, 3, 32)), cache)
    with pytest.raises(ValueError, match="PagedKVCache"):
        paged_flex_attention(good, (cache.k_pages, cache.v_pages))
    with pytest.raises(ValueError, match="KV_LEN"):
        paged_flex_attention(good, cache, block_mask=pf.create_block_mask(None, None, None, 1, 64))
    with pytest.raises(ValueError, match="no gradients"):
        jax.grad(lambda q: paged_flex_attention(q, cache, backend="interpret").sum())(good)


def test_clip_block_mask_to_lengths_drops_and_demotes_blocks():
    from pallas_flex.masks.block_mask import EMPTY, FULL, PARTIAL

    block_mask = pf.create_block_mask(None, None, None, 16, 64, block_size=16)  # all full
    clipped = block_mask.clip_to_lengths(jnp.asarray([64, 20, 0], jnp.int32))
    state = np.asarray(clipped.block_state())
    assert state.shape == (3, 1, 1, 4)
    np.testing.assert_array_equal(state[0, 0, 0], [FULL] * 4)
    np.testing.assert_array_equal(state[1, 0, 0], [FULL, PARTIAL, EMPTY, EMPTY])
    np.testing.assert_array_equal(state[2, 0, 0], [EMPTY] * 4)
    assert clipped.q_num_blocks is None  # forward-only: inference runs no backward


@pytest.mark.parametrize("seed", range(4))
def test_clip_block_mask_to_lengths_matches_the_block_state_definition(seed):
    """On random block states and lengths (block-aligned, mid-block, zero, past the end):
    blocks at or past the length become EMPTY, full blocks crossing it PARTIAL, the rest
    stay; the clipped lists stay ascending."""
    from pallas_flex.masks.block_mask import EMPTY, FULL, PARTIAL, BlockMask

    rng = np.random.default_rng(seed)
    block, num_q_blocks, num_kv_blocks, batch = 16, 3, 7, 6
    heads = 1 if seed % 2 else 2
    state = rng.choice([EMPTY, PARTIAL, FULL], size=(1 if seed < 2 else batch, heads,
                                                     num_q_blocks, num_kv_blocks))
    block_mask = BlockMask.from_block_state(
        jnp.asarray(state, jnp.int8), block_size=block,
        seq_lengths=(num_q_blocks * block, num_kv_blocks * block),
        mask_mod=pf.create_block_mask(None, None, None, 16, 16).mask_mod)
    lengths = np.array([0, 16, 37, 64, 111, 112][:batch])
    clipped = block_mask.clip_to_lengths(jnp.asarray(lengths, jnp.int32))

    starts = np.arange(num_kv_blocks) * block
    expected = np.broadcast_to(state, (batch,) + state.shape[1:]).copy()
    for b, length in enumerate(lengths):
        row = expected[b]
        row[..., starts >= length] = EMPTY
        crossing = (starts < length) & (starts + block > length)
        row[..., crossing] = np.where(row[..., crossing] == FULL, PARTIAL, row[..., crossing])
    np.testing.assert_array_equal(np.asarray(clipped.block_state()), expected)
    for num, indices in ((clipped.kv_num_blocks, clipped.kv_indices),
                         (clipped.full_kv_num_blocks, clipped.full_kv_indices)):
        num, indices = np.asarray(num), np.asarray(indices)
        for row in np.ndindex(num.shape):
            assert np.all(np.diff(indices[row][:num[row]]) > 0)

