"""The Mosaic GPU latent-attention decode (`kernels/decode_latent_mosaic.py`).

On CPU it runs in Mosaic GPU's interpret mode (`decode_kernel="mosaic"` with
backend="interpret": TMA copies, barriers, the three warpgroups and the score halves'
exchange are the kernel's own code; the matmuls are plain dots). Interpret mode takes
narrower heads than DeepSeek's (D 128, Dv 128 / 256, the same code with halves of 64 /
128 columns) to stay quick; on the GPU (marker `gpu`) the same cases run compiled, and
the MLA shape itself (Hq 128, D 576, Dv 512).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import dispatch, masks
from pallas_flex.kernels import decode_latent_mosaic
from pallas_flex.kernels.config import resolve_options
from tests.conftest import assert_close_to_golden, golden, random_qkv

MOSAIC = {"decode_kernel": "mosaic"}
GPU = pytest.param("pallas", marks=pytest.mark.gpu)


def _key_padding(valid):
    def mask(b, h, q_idx, kv_idx):
        return valid[b, kv_idx] != 0
    return mask


def _cases():
    """(name, dtype, batch, q_heads, kv_len, head dim, value dim, mask_mod factory)."""
    offsets = jnp.array([190, 61], jnp.int32)  # per row: a partial block, an empty one
    valid = ((jnp.arange(300)[None, :] % 7 != 3) & (jnp.arange(2)[:, None] == 0)).astype(
        jnp.int8)
    return [
        # One head block, ragged keys (the last block partial), no mask.
        ("noop_ragged", jnp.bfloat16, 1, 64, 300, 128, 128, lambda: None),
        # Two head blocks, Dv != D, a decode offset per batch row (full, partial and
        # unlisted blocks).
        ("offset_causal", jnp.float16, 2, 128, 256, 128, 256,
         lambda: masks.offset(masks.causal_mask, offsets)),
        # A captured array read at kv_idx; batch row 1 has no key at all (zeros, -inf).
        ("key_padding_empty_row", jnp.bfloat16, 2, 64, 300, 128, 128,
         lambda: _key_padding(valid)),
    ]


CASES = _cases()


def _run(q, k, v, mask_mod, backend, options=MOSAIC):
    block_mask = pf.create_block_mask(mask_mod or pf.noop_mask, q.shape[0], None, 1,
                                      k.shape[1])
    return pf.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                             backend=backend, kernel_options=options), block_mask


@pytest.mark.parametrize("backend", ["interpret", GPU])
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_matches_float64(case, backend):
    _, dtype, batch, q_heads, kv_len, dim, value_dim, mask_factory = case
    q, k, v = random_qkv(7, batch, 1, kv_len, q_heads, 1, dim, value_dim, dtype)
    mask_mod = mask_factory()
    (out, lse), block_mask = _run(q, k, v, mask_mod, backend)
    choice = dispatch.choose_forward(q, k, v, block_mask, None, backend=backend,
                                     options=resolve_options(MOSAIC, dim, dtype))
    assert choice.kernel == "mosaic_latent_decode"
    expected_out, expected_lse = golden(q, k, v, mask_mod=mask_mod)
    assert out.shape == (batch, 1, q_heads, value_dim) and out.dtype == dtype
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod=mask_mod)
    lse = np.asarray(lse, np.float64)
    empty = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], expected_lse[~empty], atol=2e-3, rtol=1e-4)
    assert not np.any(np.asarray(out.astype(jnp.float32))[np.moveaxis(empty, 2, 1)])


@pytest.mark.gpu
def test_deepseek_shape_on_gpu_matches_float64_and_the_triton_decode():
    """Hq 128, one KV head, D 576, Dv 512: the kernel's own shape, against float64 and
    against the Triton decode on the same call (`decode_kernel="triton"`)."""
    q, k, v = random_qkv(11, 2, 1, 1000, 128, 1, 576, 512, jnp.bfloat16)
    mask_mod = masks.offset(masks.causal_mask, jnp.array([999, 517], jnp.int32))
    (out, lse), _ = _run(q, k, v, mask_mod, "pallas", options={})
    (triton_out, triton_lse), _ = _run(q, k, v, mask_mod, "pallas",
                                       options={"decode_kernel": "triton"})
    expected_out, _ = golden(q, k, v, mask_mod=mask_mod)
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod=mask_mod)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(triton_lse), atol=1e-3)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)),
                               np.asarray(triton_out.astype(jnp.float32)), atol=2e-2)


# Paged: (lengths, page size, Hq, D, Dv, dtype, mask). A tile of 32 keys from two pages of
# 16 (a cluster of two head blocks), or from one page; a row's length inside a tile; an
# empty row.
PAGED_CASES = {
    "page16_causal_clustered": ([200, 77], 16, 128, 128, 256, jnp.bfloat16, "causal"),
    "page64_empty_row": ([0, 200], 64, 64, 128, 128, jnp.float16, None),
    "page32_sliding": ([150, 33], 32, 64, 128, 128, jnp.bfloat16, "sliding"),
}


@pytest.mark.parametrize("case,backend", [
    (case, "interpret") for case in PAGED_CASES if case != "page32_sliding"] + [
    pytest.param(case, "pallas", marks=pytest.mark.gpu) for case in PAGED_CASES])
def test_paged_matches_float64(case, backend):
    """The whole paged_flex_attention (BlockMask clipped to the lengths, pages shuffled
    between the rows) on this kernel, against float64 over the gathered cache."""
    from tests.paged.test_flex_attention import check_paged_against_golden

    lengths, page_size, q_heads, dim, value_dim, dtype, mask_name = PAGED_CASES[case]
    check_paged_against_golden(lengths, page_size, 1, q_heads, 1, dim, value_dim, dtype,
                               mask_name, None, MOSAIC, backend, window=40)


@pytest.mark.parametrize("page_size,stale,backend", [
    (16, np.nan, "interpret"),
    pytest.param(16, np.inf, "pallas", marks=pytest.mark.gpu),
    pytest.param(64, np.nan, "pallas", marks=pytest.mark.gpu)])
def test_paged_never_reads_stale_slots_past_a_length(page_size, stale, backend):
    """Slots past a row's length (a reused page's old contents) hold NaN / inf: the output
    is the one of a clean cache, bit for bit."""
    from tests.paged.test_flex_attention import check_stale_slots_never_read

    # Lengths neither a whole number of 32-key tiles.
    check_stale_slots_never_read([100, 45], page_size=page_size, kv_len=128, q_len=1,
                                 q_heads=64, kv_heads=1, dim=128, stale=stale,
                                 kernel_options=MOSAIC, backend=backend)


@pytest.mark.gpu
def test_deepseek_shape_on_pages_of_64_matches_the_triton_decode():
    """Hq 128, D 576, Dv 512 on pages of 64 (FlashMLA's), chosen automatically, against
    the Triton decode on the same cache and float64 over the gathered one."""
    from tests.paged.test_flex_attention import _filled_cache
    from pallas_flex.paged.cache import gather_contiguous

    cache = _filled_cache([1000, 517], page_size=64, max_pages=16, kv_heads=1, dim=576,
                          value_dim=512, dtype=jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(4), (2, 1, 128, 576)).astype(jnp.bfloat16)
    mask_mod = masks.offset(masks.causal_mask, cache.lengths - 1)
    scale = 1 / np.sqrt(192.0)

    def run(options):
        return pf.paged.paged_flex_attention(q, cache, mask_mod=mask_mod, scale=scale,
                                             return_lse=True, kernel_options=options)

    (out, lse), (triton_out, triton_lse) = run({}), run({"decode_kernel": "triton"})
    k, v = gather_contiguous(cache)
    lengths = cache.lengths

    def in_cache(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & mask_mod(b, h, q_idx, kv_idx)

    expected_out, _ = golden(q, k, v, mask_mod=in_cache, scale=scale)
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod=in_cache, scale=scale)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(triton_lse), atol=1e-3)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)),
                               np.asarray(triton_out.astype(jnp.float32)), atol=2e-2)


def _reason(q_shape=(2, 1, 128, 576), k_shape=(2, 512, 1, 576), v_shape=(2, 512, 1, 512),
            dtype=jnp.bfloat16, mask_mod=pf.noop_mask, score_mod=None, paged=False,
            with_max=False):
    q, k, v = (jax.ShapeDtypeStruct(shape, dtype) for shape in (q_shape, k_shape, v_shape))
    block_mask = pf.create_block_mask(mask_mod, q_shape[0], q_shape[2], q_shape[1], k_shape[1])
    program = None
    if score_mod is not None:
        from pallas_flex.masks.mod_program import SCORE, make_mod_program
        program = make_mod_program(score_mod, SCORE)
    return decode_latent_mosaic.unsupported_reason(q, k, v, block_mask, program, paged=paged,
                                                   with_max=with_max, interpret=True)


def test_unsupported_calls_say_why():
    assert _reason() is None
    pages = dict(paged=True, k_shape=(9, 1, 64, 576), v_shape=(9, 1, 64, 512))
    assert _reason(**pages) is None
    assert _reason(**dict(pages, k_shape=(9, 1, 16, 576), v_shape=(9, 1, 16, 512))) is None
    assert "pages of 8 rows" in _reason(**dict(pages, k_shape=(9, 1, 8, 576),
                                                v_shape=(9, 1, 8, 512)))
    assert "pages of 48 rows" in _reason(**dict(pages, k_shape=(9, 1, 48, 576),
                                                 v_shape=(9, 1, 48, 512)))
    assert "KV heads" in _reason(**dict(pages, k_shape=(9, 2, 64, 576),
                                        v_shape=(9, 2, 64, 512)))
    assert "row max" in _reason(with_max=True)
    assert "Sq = 2" in _reason(q_shape=(2, 2, 128, 576))
    assert "KV heads" in _reason(k_shape=(2, 512, 2, 576), v_shape=(2, 512, 2, 512))
    assert "query heads" in _reason(q_shape=(2, 1, 96, 576))
    assert "head dim 100" in _reason(q_shape=(2, 1, 128, 100), k_shape=(2, 512, 1, 100))
    assert "value dim 640" in _reason(v_shape=(2, 512, 1, 640))
    assert "float32" in _reason(dtype=jnp.float32)
    assert "score_mod" in _reason(score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5)
    assert "reads h" in _reason(mask_mod=lambda b, h, q_idx, kv_idx: h < 64)
    flags = jnp.arange(512) % 3 == 0
    assert "boolean" in _reason(mask_mod=lambda b, h, q_idx, kv_idx: flags[kv_idx])
    bytes_ = flags.astype(jnp.int8)
    assert _reason(mask_mod=lambda b, h, q_idx, kv_idx: bytes_[kv_idx] != 0) is None
    ids = jnp.arange(512) // 100
    assert "q_idx" in _reason(mask_mod=lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx])


def test_dispatch_names_the_kernel_only_where_it_is_asked_or_automatic():
    q, k, v = random_qkv(0, 1, 1, 256, 64, 1, 128, 128, jnp.bfloat16)
    block_mask = pf.create_block_mask(pf.noop_mask, None, None, 1, 256)

    def choose(options, backend="interpret", **flags):
        return dispatch.choose_forward(q, k, v, block_mask, None, backend=backend,
                                       options=resolve_options(options, 128, jnp.bfloat16),
                                       **flags).kernel

    assert choose(MOSAIC) == "mosaic_latent_decode"
    assert choose({}) == "decode"  # interpret mode runs the Mosaic kernel only by name
    assert choose({"decode_kernel": "triton"}) == "decode"
    with pytest.raises(ValueError, match="decode_kernel.*row max"):
        choose(MOSAIC, with_max=True)
    # The Triton decode's own settings select it.
    assert resolve_options({"decode_num_warps": 8}, 128, jnp.bfloat16).decode_kernel == "triton"
    assert resolve_options({"decode_num_splits": 4}, 128, jnp.bfloat16).decode_kernel == "auto"
    with pytest.raises(ValueError, match="decode_kernel"):
        resolve_options({"decode_kernel": "cuda"}, 128, jnp.bfloat16)


def test_vmap_runs_the_kernel_once_per_element():
    """Under jax.vmap (beams, layers) the kernel runs per element, as the calls one by one."""
    q, k, v = random_qkv(5, 1, 1, 200, 64, 1, 128, 128, jnp.bfloat16)
    qs = jnp.stack([q, -q])
    block_mask = pf.create_block_mask(pf.noop_mask, None, None, 1, 200)

    def decode(q):
        return pf.flex_attention(q, k, v, block_mask=block_mask, backend="interpret",
                                 kernel_options=MOSAIC)

    batched = jax.vmap(decode)(qs)
    for index in range(2):
        np.testing.assert_array_equal(np.asarray(batched[index].astype(jnp.float32)),
                                      np.asarray(decode(qs[index]).astype(jnp.float32)))


def test_uneven_splits_match_float64():
    """Splits of a row's tiles in uneven shares (600 keys: 16 full tiles, then the 4 of a
    ragged block, in 3 splits of 7, 7 and 6 tiles, so that a split starts and ends inside
    a block and one holds full and partial tiles; a decode offset per row), merged as
    each split's partial softmax: close to float64 (interpret mode otherwise runs 2
    splits of whole blocks)."""
    q, k, v = random_qkv(11, 2, 1, 600, 64, 1, 128, 128, jnp.bfloat16)
    mask_mod = masks.offset(masks.causal_mask, jnp.array([599, 300], jnp.int32))
    block_mask = pf.create_block_mask(mask_mod, 2, None, 1, 600)
    out, lse = decode_latent_mosaic.latent_decode(q, k, v, block_mask, scale=128 ** -0.5,
                                                  interpret=True, num_splits=3)
    expected_out, expected_lse = golden(q, k, v, mask_mod=mask_mod)
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod=mask_mod)
    np.testing.assert_allclose(np.asarray(lse, np.float64), expected_lse, atol=2e-3,
                               rtol=1e-4)
