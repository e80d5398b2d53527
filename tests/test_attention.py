"""The shared forward suite: every backend against the float64 dense reference.

Each gallery variant runs on two (dtype, head layout, lengths, head dims) cases drawn
in rotation from CASES (on the CPU, one on each of its two backends), so across the
gallery every dtype, layout, awkward length pair and Dv != D combination is exercised on
every backend without the full product's compile time. A full product over dtypes x layouts x lengths runs on one variant (on
the GPU; the CPU backends take one of the two length pairs per dtype x layout).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from tests.conftest import BACKENDS, SMALL_TILES, assert_close_to_golden, golden, random_qkv

LAYOUTS = {"MHA": (4, 4), "GQA4": (8, 2), "MQA": (4, 1)}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
LENGTHS = [(1, 17), (17, 17), (127, 130), (130, 127), (300, 300)]
HEAD_DIMS = [(32, 32), (32, 48), (64, 40)]

# (dtype, layout, (Sq, Skv), (D, Dv)): a Latin-square style rotation.
CASES = [(dtype, layout, LENGTHS[i % len(LENGTHS)], HEAD_DIMS[i % len(HEAD_DIMS)])
         for i, (dtype, layout) in enumerate(itertools.product(DTYPES, LAYOUTS))]


def _document_ids(length, seed=0):
    """Packed documents of random lengths covering `length` positions: [length] int32."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 4, size=length)), jnp.int32)


# name -> (mask_mod factory, score_mod factory, needs Sq == Skv); factories take
# (batch, q_heads, q_len, kv_len).
VARIANTS = {
    "noop": (None, None, False),
    "causal": (lambda *_: masks.causal_mask, None, False),
    "sliding_window": (lambda *_: masks.sliding_window(9), None, False),
    "sliding_window_bidirectional": (lambda *_: masks.sliding_window(7, causal=False), None, False),
    "prefix_lm": (lambda *_: masks.prefix_lm(5), None, False),
    "prefix_lm_per_batch": (lambda b, *_: masks.prefix_lm(jnp.arange(b, dtype=jnp.int32) * 7 + 3),
                            None, False),
    "document": (lambda b, h, sq, skv: masks.document_mask(_document_ids(sq)), None, True),
    "document_causal_wrapper": (
        lambda b, h, sq, skv: masks.document(masks.causal_mask, _document_ids(sq)), None, True),
    "dilated": (lambda *_: masks.dilated_sliding_window(12, 3), None, False),
    "chunked_causal": (lambda *_: masks.chunked_causal(10), None, False),
    "neighborhood": (lambda *_: masks.neighborhood_2d(10, 13, 3, 5), None, "130"),
    "tiled_neighborhood": (lambda *_: masks.tiled_neighborhood_2d(10, 12, 3, 3, 5, 4), None,
                           "120"),
    "morton_neighborhood": (lambda *_: masks.morton_neighborhood_2d(8, 16, 3, 3), None, "128"),
    "and_or_not": (lambda *_: pf.or_masks(pf.and_masks(masks.causal_mask, masks.sliding_window(20)),
                                          pf.not_mask(masks.causal_mask)), None, False),
    "alibi_causal": (lambda *_: masks.causal_mask, lambda b, h, *_: masks.alibi(h), False),
    "softcap_causal": (lambda *_: masks.causal_mask, lambda *_: masks.tanh_softcap(2.0), False),
    "softcap_approx": (None, lambda *_: masks.tanh_softcap(2.0, approx=True), False),
    "relative_position": (None, lambda *_: masks.relative_position(0.05), False),
    "t5_bias": (lambda *_: masks.causal_mask, lambda b, h, *_: masks.t5_relative_bias(
        jax.random.normal(jax.random.PRNGKey(3), (h, 16)), max_distance=40), False),
    "bias_lookup": (None, lambda b, h, sq, skv: masks.bias_lookup(
        jax.random.normal(jax.random.PRNGKey(4), (b, 1, sq, skv))), False),
}


def _shape_for(case, needs):
    dtype, layout, (q_len, kv_len), dims = case
    if needs is True:
        kv_len = q_len
    elif isinstance(needs, str):  # the image size fixes both lengths
        q_len = kv_len = int(needs)
    return dtype, layout, q_len, kv_len, dims


# The variants the xla backend also runs on the CPU (its second case of each variant): one
# per case of CASES (offset 4 in the rotation meets all 9), picked for their mods' reads
# (per batch, gathers at q_idx / kv_idx, a [B, H, Sq, Skv] table, score mods, windows,
# combinators). The other variants' xla cases ran the blockwise loop's mask evaluation
# again on other pure index arithmetic: every variant still runs on the interpret backend,
# alibi_causal on xla in every dtype x layout (test_full_product_on_alibi_causal), and
# each mask's definition is checked in tests/masks.
XLA_GALLERY = {"prefix_lm_per_batch", "document", "softcap_causal", "softcap_approx",
               "relative_position", "t5_bias", "bias_lookup", "sliding_window",
               "sliding_window_bidirectional", "and_or_not"}


def _variant_cases():
    """Each variant on two cases of CASES (offsets 0 and 4 in the rotation). The GPU runs
    both on its backend; on the CPU, where a case is mostly compile time, the interpret
    backend runs the first and the xla backend the second for the variants of XLA_GALLERY:
    each CPU backend still meets every dtype, layout, length pair and head dims of CASES
    (20 variants, 10 on xla, over 9 cases)."""
    for index, (name, (_, _, needs)) in enumerate(VARIANTS.items()):
        for offset, cpu_backend in enumerate(("interpret", "xla")):
            case = CASES[(index + 4 * offset) % len(CASES)]
            dtype, layout, q_len, kv_len, (dim, value_dim) = _shape_for(case, needs)
            shape_id = f"{name}-{dtype}-{layout}-{q_len}x{kv_len}-d{dim}v{value_dim}"
            for backend, marks in ((cpu_backend, ()), ("pallas", pytest.mark.gpu)):
                if backend == "xla" and name not in XLA_GALLERY:
                    continue
                yield pytest.param(backend, name, dtype, layout, q_len, kv_len, dim, value_dim,
                                   marks=marks, id=f"{shape_id}-{backend}")


def _run(backend, variant, dtype, layout, q_len, kv_len, dim, value_dim, seed=0):
    mask_factory, score_factory, _ = VARIANTS[variant]
    q_heads, kv_heads = LAYOUTS[layout]
    batch = 2
    q, k, v = random_qkv(seed, batch, q_len, kv_len, q_heads, kv_heads, dim, value_dim,
                         DTYPES[dtype])
    args = (batch, q_heads, q_len, kv_len)
    mask_mod = mask_factory(*args) if mask_factory else None
    score_mod = score_factory(*args) if score_factory else None
    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            return_lse=True, kernel_options=SMALL_TILES)
    return (q, k, v, mask_mod, score_mod), out, lse


@pytest.mark.parametrize("backend,variant,dtype,layout,q_len,kv_len,dim,value_dim",
                         list(_variant_cases()))
def test_gallery_matches_float64_reference(backend, variant, dtype, layout, q_len, kv_len, dim,
                                           value_dim):
    (q, k, v, mask_mod, score_mod), out, lse = _run(backend, variant, dtype, layout, q_len,
                                                    kv_len, dim, value_dim)
    assert out.shape == (q.shape[0], q_len, q.shape[2], value_dim)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    expected_out, expected_lse = golden(q, k, v, mask_mod, score_mod)
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod, score_mod)
    masked_rows = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), masked_rows)
    lse_tolerance = 2e-5 if dtype == "f32" else 2e-2
    np.testing.assert_allclose(np.asarray(lse)[~masked_rows], expected_lse[~masked_rows],
                               atol=lse_tolerance, rtol=lse_tolerance)


def _product_lengths(backend, dtype, layout):
    """The GPU runs both length pairs on every dtype x layout; the CPU backends (whose time
    is mostly compiling, once per shape) one of them, alternating like a checkerboard, so
    that every dtype and every layout still meets both."""
    pairs = (LENGTHS[0], LENGTHS[3])
    if backend == "pallas":
        return pairs
    return pairs[(list(DTYPES).index(dtype) + list(LAYOUTS).index(layout)) % 2:][:1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_product_on_alibi_causal(backend, dtype, layout):
    """Every dtype x layout, on a ragged Sq < Skv and Sq > Skv pair each (on the CPU, one
    pair each: see _product_lengths)."""
    for q_len, kv_len in _product_lengths(backend, dtype, layout):
        (q, k, v, mask_mod, score_mod), out, _ = _run(backend, "alibi_causal", dtype, layout,
                                                      q_len, kv_len, 32, 48, seed=q_len)
        expected, _ = golden(q, k, v, mask_mod, score_mod)
        assert_close_to_golden(out, expected, q, k, v, mask_mod, score_mod)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_give_zeros_and_negative_infinite_lse(backend):
    q, k, v = random_qkv(1, 2, 40, 33, 4, 2, 32, 32, jnp.float32)
    # Even query rows see nothing; odd rows see only kv 0 (a row masked but for one key).
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx % 2 == 1) & (kv_idx == 0)

    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, backend=backend, return_lse=True,
                            kernel_options=SMALL_TILES)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(out[:, 0::2] == 0.0)
    assert np.all(np.isneginf(lse[:, :, 0::2]))
    np.testing.assert_allclose(out[:, 1::2], np.repeat(np.asarray(v)[:, :1], 2, axis=2)
                               .repeat(20, axis=1), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flex_attention_with_prebuilt_block_mask_and_default_tiles(backend):
    """A 128-block BlockMask reused across calls; kernel tiles (128x64) split its blocks."""
    q, k, v = random_qkv(2, 1, 200, 300, 2, 2, 64, 64, jnp.float32)
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 200, 300)
    score_mod = masks.tanh_softcap(5.0)
    out = pf.flex_attention(q, k, v, score_mod, block_mask, backend=backend)
    expected, _ = golden(q, k, v, masks.causal_mask, score_mod)
    assert_close_to_golden(out, expected, q, k, v, masks.causal_mask, score_mod)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_scale_and_head_dims_up_to_256(backend):
    for dim, value_dim in [(96, 80), (256, 128)]:
        q, k, v = random_qkv(dim, 1, 40, 40, 2, 1, dim, value_dim, jnp.float32)
        out = pf.attention(q, k, v, mask_mod=masks.causal_mask, scale=0.3, backend=backend,
                           kernel_options=SMALL_TILES)
        expected, _ = golden(q, k, v, masks.causal_mask, scale=0.3)
        assert_close_to_golden(out, expected, q, k, v)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_deterministic_and_inputs_are_not_mutated(backend):
    """Two calls give the same bits, and leave q, k, v as they were."""
    q, k, v = random_qkv(5, 1, 70, 70, 2, 2, 32, 32, jnp.bfloat16)
    copies = [np.array(x) for x in (q, k, v)]
    first = pf.attention(q, k, v, mask_mod=masks.causal_mask, backend=backend,
                         kernel_options=SMALL_TILES)
    second = pf.attention(q, k, v, mask_mod=masks.causal_mask, backend=backend,
                          kernel_options=SMALL_TILES)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    for original, copy in zip((q, k, v), copies):
        np.testing.assert_array_equal(np.asarray(original), copy)
