"""The split-KV decode kernel (short Sq): contiguous and paged KV, against float64 golden
values. `pf.attention` dispatches here for Sq <= decode_max_q_len."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.dispatch import uses_decode_kernel
from pallas_flex.kernels.config import resolve_options
from pallas_flex.kernels.decode import flex_decode
from pallas_flex.kernels.padding import column_chunks
from pallas_flex.masks.mod_program import SCORE, make_mod_program
from tests.conftest import assert_close_to_golden, golden, random_qkv

DECODE_BACKENDS = ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)]


def test_column_chunks_cover_the_dim_with_powers_of_two():
    assert column_chunks(128) == ((0, 128),)
    assert column_chunks(576) == ((0, 512), (512, 64))
    assert column_chunks(80) == ((0, 64), (64, 16))


def test_short_queries_dispatch_to_decode():
    options = resolve_options(None, 64)
    one_block = pf.create_block_mask(None, None, None, 4, 1000)
    assert uses_decode_kernel(4, one_block, options)
    assert not uses_decode_kernel(32, pf.create_block_mask(None, None, None, 32, 1000), options)
    two_blocks = pf.create_block_mask(None, None, None, 12, 1000, block_size=8)
    assert not uses_decode_kernel(12, two_blocks, options)


# (batch, Sq, Skv, Hq, Hkv, D, Dv, dtype, mask, score, options)
CASES = {
    "mha_noop": (2, 1, 300, 4, 4, 64, 64, jnp.float32, None, None, {}),
    "gqa_causal_offset": (2, 3, 257, 8, 2, 64, 48, jnp.float32, "causal_offset", None,
                          {"decode_num_splits": 3}),
    "mqa_alibi_bf16": (1, 2, 200, 4, 1, 32, 32, jnp.bfloat16, "causal_offset", "alibi", {}),
    "gqa_softcap_f16": (2, 1, 130, 4, 2, 32, 32, jnp.float16, None, "softcap", {}),
    "per_head_mask": (1, 2, 190, 4, 2, 32, 32, jnp.float32, "per_head", None,
                      {"decode_num_splits": 2}),
    "latent_576_512": (1, 1, 96, 8, 1, 576, 512, jnp.float32, "causal_offset", None, {}),
    "latent_heads_split_across_programs": (1, 2, 64, 48, 1, 576, 512, jnp.bfloat16,
                                           "causal_offset", None, {}),
    "odd_head_dim_72": (1, 2, 70, 2, 1, 72, 40, jnp.float32, None, None, {}),
    "more_splits_than_tiles": (1, 1, 40, 2, 2, 32, 32, jnp.float32, None, None,
                               {"decode_num_splits": 9}),
    "fully_masked_rows": (2, 2, 64, 2, 2, 32, 32, jnp.float32, "nothing_for_batch_1", None, {}),
}


def _mods(name_mask, name_score, batch, q_len, kv_len, q_heads):
    positions = jnp.asarray([kv_len - q_len - 3 * b for b in range(batch)], jnp.int32)
    mask_mod = {
        None: None,
        "causal_offset": masks.offset(masks.causal_mask, positions),
        "per_head": lambda b, h, q_idx, kv_idx: (kv_idx % (h + 2)) != 0,
        "nothing_for_batch_1": lambda b, h, q_idx, kv_idx: b == 0,
    }[name_mask]
    score_mod = {None: None, "alibi": masks.alibi(q_heads),
                 "softcap": masks.tanh_softcap(3.0)}[name_score]
    return mask_mod, score_mod


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_decode_matches_golden(case, backend):
    batch, q_len, kv_len, q_heads, kv_heads, dim, value_dim, dtype, mask_name, score_name, \
        options = CASES[case]
    q, k, v = random_qkv(3, batch, q_len, kv_len, q_heads, kv_heads, dim, value_dim, dtype)
    mask_mod, score_mod = _mods(mask_name, score_name, batch, q_len, kv_len, q_heads)
    options = {"block_kv": 32, **options}
    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            return_lse=True, kernel_options=options)
    expected_out, expected_lse = golden(q, k, v, mask_mod, score_mod)
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod, score_mod)
    finite = np.isfinite(expected_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], expected_lse[finite],
                               atol=1e-4 if dtype == jnp.float32 else 2e-2)
    if mask_name == "nothing_for_batch_1":
        np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)


def test_decode_gradients_match_the_forward_kernel_path():
    """Decode is a forward kernel only; its gradients come from the general backward."""
    q, k, v = random_qkv(5, 1, 2, 100, 4, 2, 32, 32, jnp.float32)
    mask_mod = masks.offset(masks.causal_mask, jnp.asarray([90], jnp.int32))

    def loss(q, k, v, backend):
        return jnp.sum(pf.attention(q, k, v, mask_mod=mask_mod, backend=backend,
                                    kernel_options={"block_kv": 32}) ** 2)

    ours = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "interpret")
    expected = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "reference")
    for a, b in zip(ours, expected):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def _paginate(k, v, page_size, rng):
    """Scatters contiguous k/v [B, S, Hkv, D] into shuffled pages [P, Hkv, page_size, D]."""
    batch, kv_len = k.shape[:2]
    pages_per_row = kv_len // page_size
    num_pages = batch * pages_per_row + 3  # a few pages nobody owns
    page_table = rng.permutation(num_pages)[:batch * pages_per_row].reshape(batch, pages_per_row)
    k_pages = np.zeros((num_pages,) + (k.shape[2], page_size, k.shape[3]), np.float32)
    v_pages = np.zeros((num_pages,) + (v.shape[2], page_size, v.shape[3]), np.float32)
    for b in range(batch):
        for slot in range(pages_per_row):
            rows = slice(slot * page_size, (slot + 1) * page_size)
            k_pages[page_table[b, slot]] = np.asarray(k[b, rows], np.float32).transpose(1, 0, 2)
            v_pages[page_table[b, slot]] = np.asarray(v[b, rows], np.float32).transpose(1, 0, 2)
    return (jnp.asarray(k_pages, k.dtype), jnp.asarray(v_pages, v.dtype),
            jnp.asarray(page_table, jnp.int32))


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("page_size,block_kv", [(16, 32), (32, 16), (16, 16)])
def test_paged_decode_matches_contiguous(page_size, block_kv, backend):
    batch, q_len, q_heads, kv_heads, dim = 2, 2, 4, 2, 32
    kv_len = 8 * page_size
    q, k, v = random_qkv(7, batch, q_len, kv_len, q_heads, kv_heads, dim, dim, jnp.float32)
    k_pages, v_pages, page_table = _paginate(k, v, page_size, np.random.default_rng(0))
    lengths = jnp.asarray([kv_len - 5, 37], jnp.int32)
    page_table = page_table.at[1, 37 // page_size + 1:].set(-1)  # unallocated tail
    mask_mod = masks.offset(masks.causal_mask, lengths - q_len)
    score_mod = masks.alibi(q_heads)
    block_mask = pf.create_block_mask(mask_mod, batch, None, q_len, kv_len, block_size=(64, 32))
    out, lse = flex_decode(
        q, k_pages, v_pages, block_mask, make_mod_program(score_mod, SCORE), scale=dim ** -0.5,
        options=resolve_options({"decode_block_kv": block_kv, "decode_num_splits": 2}, dim),
        interpret=backend == "interpret", page_table=page_table, lengths=lengths)

    def in_cache(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & (kv_idx < lengths[b])

    expected_out, expected_lse = golden(q, k, v, in_cache, score_mod)
    np.testing.assert_allclose(out, expected_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, expected_lse, atol=2e-5, rtol=2e-5)
