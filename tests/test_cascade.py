"""cascade_attention: a shared prefix attended once, suffixes per request, merged exactly.

The oracle is ordinary attention of each request over `concat(prefix, suffix)` with the
combined mask (prefix_mask_mod on keys [0, P), suffix_mask_mod on keys [P, P + L) in
suffix coordinates), computed densely in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from tests.conftest import SMALL_TILES, assert_close_to_golden, golden, random_qkv

FLOAT32_LSE_TOLERANCE = 2e-5


def cascade_inputs(seed, batch, q_len, prefix_len, suffix_len, q_heads, kv_heads, head_dim,
                   value_dim, dtype):
    """q [B, Sq, Hq, D], prefix k/v [1, P, Hkv, D|Dv], suffix k/v [B, L, Hkv, D|Dv]."""
    q, suffix_k, suffix_v = random_qkv(seed, batch, q_len, suffix_len, q_heads, kv_heads,
                                       head_dim, value_dim, dtype)
    _, prefix_k, prefix_v = random_qkv(seed + 1000, 1, 1, prefix_len, q_heads, kv_heads,
                                       head_dim, value_dim, dtype)
    return q, prefix_k, prefix_v, suffix_k, suffix_v


def concatenated(prefix_k, prefix_v, suffix_k, suffix_v, prefix_mask_mod=None,
                 suffix_mask_mod=None):
    """Per-request k, v [B, P + L, Hkv, ...] and the combined mask_mod over them."""
    batch, prefix_len = suffix_k.shape[0], prefix_k.shape[1]
    k = jnp.concatenate([jnp.broadcast_to(prefix_k, (batch, *prefix_k.shape[1:])), suffix_k], 1)
    v = jnp.concatenate([jnp.broadcast_to(prefix_v, (batch, *prefix_v.shape[1:])), suffix_v], 1)
    prefix_mask = prefix_mask_mod or (lambda b, h, q_idx, kv_idx: kv_idx >= 0)
    suffix_mask = suffix_mask_mod or (lambda b, h, q_idx, kv_idx: kv_idx >= 0)

    def combined_mask(b, h, q_idx, kv_idx):
        # Both sides are evaluated: keep each one's indices in its own range.
        in_prefix = prefix_mask(b, h, q_idx, jnp.minimum(kv_idx, prefix_len - 1))
        in_suffix = suffix_mask(b, h, q_idx, jnp.maximum(kv_idx - prefix_len, 0))
        return jnp.where(kv_idx < prefix_len, in_prefix, in_suffix)

    return k, v, combined_mask


# ---------------------------------------------------------------------------------------
# forward against the concatenated computation

# Every forward case: 5 requests, a 37-token prefix, 21-token suffixes, GQA 8:2, D 32,
# Dv 16 (Dv != D), run under jax.jit with the arrays the mods close over as arguments.
BATCH, PREFIX_LEN, SUFFIX_LEN, Q_HEADS, KV_HEADS, HEAD_DIM, VALUE_DIM = 5, 37, 21, 8, 2, 32, 16


def _tables():
    """lengths: tokens in each request's suffix (>= 4, one full, the rest padding);
    visible: how many prefix keys row 0 of each request sees in the prefix-mask case."""
    return {"lengths": jnp.array([5, 13, SUFFIX_LEN, 4, 17], jnp.int32),
            "visible": jnp.array([0, 9, 30, 36, 2], jnp.int32)}


def _decode_ragged_alibi(tables, q_len):
    """Decode: request b's suffix holds lengths[b] tokens (the rest is padding) and its
    query sits at absolute position P + lengths[b] - 1, where ALiBi measures from."""
    lengths = tables["lengths"]
    alibi = masks.offset_score(masks.alibi(Q_HEADS), PREFIX_LEN + lengths - q_len)
    return {"suffix_mask_mod": lambda b, h, q_idx, kv_idx: kv_idx < lengths[b],
            "score_mod": alibi}


def _tokens_prefix_mask_softcap(tables, q_len):
    """A few tokens at the end of each ragged suffix, causal among themselves. After
    folding, the prefix mask still gets the request as b and the row within the request
    as q_idx: request b's row j sees the first visible[b] + j prefix keys. Soft-cap and a
    scale of its own."""
    visible = tables["visible"]
    return {"prefix_mask_mod": lambda b, h, q_idx, kv_idx: kv_idx < visible[b] + q_idx,
            "suffix_mask_mod": masks.offset(masks.causal_mask, tables["lengths"] - q_len),
            "score_mod": masks.tanh_softcap(1.5), "scale": 0.3}


# name -> (Sq, mods(tables, Sq) -> cascade keywords)
VARIANTS = {
    "decode_ragged_alibi": (1, _decode_ragged_alibi),
    "tokens_prefix_mask_softcap": (4, _tokens_prefix_mask_softcap),
}

# (variant, backend, dtype, suffix as): each variant on both CPU backends, dtypes in
# rotation, the suffix mask passed as a mask_mod or as a prebuilt suffix_block_mask; and
# on the GPU in both dtypes.
CPU_CASES = [
    ("decode_ragged_alibi", "xla", "f32", "block_mask"),
    ("decode_ragged_alibi", "interpret", "bf16", "mask_mod"),
    ("tokens_prefix_mask_softcap", "xla", "bf16", "mask_mod"),
    ("tokens_prefix_mask_softcap", "interpret", "f32", "block_mask"),
]
ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
GPU_CASES = [pytest.param(variant, "pallas", dtype, "mask_mod", marks=[pytest.mark.gpu, ON_GPU])
             for variant in VARIANTS for dtype in ("f32", "bf16")]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# "xla" is cheap to run with small tiles: there the 5 x 4 folded prefix rows span two
# 16-row tiles (the interpreted kernels keep the default tiles, to keep CI short).
KERNEL_OPTIONS = {"xla": SMALL_TILES}


@pytest.mark.parametrize("variant, backend, dtype, suffix_as", CPU_CASES + GPU_CASES)
def test_equals_attention_over_the_concatenation(variant, backend, dtype, suffix_as):
    q_len, make_mods = VARIANTS[variant]
    inputs = cascade_inputs(sum(map(ord, variant)), BATCH, q_len, PREFIX_LEN, SUFFIX_LEN,
                            Q_HEADS, KV_HEADS, HEAD_DIM, VALUE_DIM, DTYPES[dtype])
    tables = _tables()
    kernel_options = KERNEL_OPTIONS.get(backend)

    @jax.jit
    def cascade(tables, *inputs):
        mods = make_mods(tables, q_len)
        if suffix_as == "block_mask":
            block_size = 16 if kernel_options else 128
            mods["suffix_block_mask"] = pf.create_block_mask(
                mods.pop("suffix_mask_mod"), BATCH, None, q_len, SUFFIX_LEN,
                block_size=block_size)
        return pf.cascade_attention(*inputs, **mods, return_lse=True, backend=backend,
                                    kernel_options=kernel_options)

    out, lse = cascade(tables, *inputs)
    mods = make_mods(tables, q_len)
    score_mod, scale = mods.get("score_mod"), mods.get("scale")
    q, prefix_k, prefix_v, suffix_k, suffix_v = inputs
    k, v, combined_mask = concatenated(prefix_k, prefix_v, suffix_k, suffix_v,
                                       mods.get("prefix_mask_mod"), mods.get("suffix_mask_mod"))
    expected_out, expected_lse = golden(q, k, v, combined_mask, score_mod, scale)
    assert out.shape == (BATCH, q_len, Q_HEADS, VALUE_DIM) and out.dtype == q.dtype
    assert lse.shape == (BATCH, Q_HEADS, q_len) and lse.dtype == jnp.float32
    assert_close_to_golden(out, expected_out, q, k, v, combined_mask, score_mod, scale)
    if q.dtype == jnp.float32:
        np.testing.assert_allclose(lse, expected_lse, atol=FLOAT32_LSE_TOLERANCE,
                                   rtol=FLOAT32_LSE_TOLERANCE)


# ---------------------------------------------------------------------------------------
# gradients and empty rows


def test_gradients_equal_the_concatenated_computations_and_empty_rows_stay_finite():
    """d/dq and d/dsuffix_k through the fused backward kernels (lse included, via the
    merge) against autodiff of dense attention over the concatenation. Request 0 has no
    key at all (no prefix key through prefix_mask_mod, an empty suffix): zeros, lse = -inf
    and zero, finite gradients."""
    batch, q_len, q_heads, value_dim = 2, 2, 4, 8
    inputs = cascade_inputs(7, batch, q_len, 24, 10, q_heads, 2, 16, value_dim, jnp.float32)
    q, prefix_k, prefix_v, suffix_k, suffix_v = inputs
    lengths = jnp.array([0, 9], jnp.int32)
    mods = {"prefix_mask_mod": lambda b, h, q_idx, kv_idx: b > 0,
            "suffix_mask_mod": masks.offset(masks.causal_mask, lengths - q_len)}
    cotangent = jax.random.normal(jax.random.PRNGKey(8), (batch, q_len, q_heads, value_dim))

    def cascade_loss(q, suffix_k):
        out, lse = pf.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, **mods,
                                        return_lse=True, backend="xla")
        return jnp.sum(out * cotangent), (out, lse)

    def concatenated_loss(q, suffix_k):
        k, v, combined_mask = concatenated(prefix_k, prefix_v, suffix_k, suffix_v, **mods)
        out = pf.attention(q, k, v, mask_mod=combined_mask, backend="reference")
        return jnp.sum(out * cotangent)

    ours, (out, lse) = jax.jit(jax.grad(cascade_loss, (0, 1), has_aux=True))(q, suffix_k)
    expected = jax.jit(jax.grad(concatenated_loss, (0, 1)))(q, suffix_k)
    for name, got, want in zip(("q", "suffix_k"), ours, expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(np.asarray(lse[0])))
    assert np.isfinite(np.asarray(lse[1])).all()
    assert np.all(np.asarray(ours[0][0]) == 0)


# ---------------------------------------------------------------------------------------
# errors


B, SQ, P, L, HQ, HKV, D, DV = 2, 1, 16, 8, 4, 2, 16, 8


def _shapes(**changes):
    shapes = {"q": (B, SQ, HQ, D), "prefix_k": (1, P, HKV, D), "prefix_v": (1, P, HKV, DV),
              "suffix_k": (B, L, HKV, D), "suffix_v": (B, L, HKV, DV)}
    shapes.update(changes)
    return shapes


BAD_SHAPES = {
    "prefix_without_batch_axis": (_shapes(prefix_k=(P, HKV, D)),
                                  r"prefix_k must be a 4-D array.*prefix_k\[None\]"),
    "q_rank": (_shapes(q=(B, HQ, D)), r"q must be a 4-D array"),
    "prefix_batch": (_shapes(prefix_k=(B, P, HKV, D), prefix_v=(B, P, HKV, DV)),
                     r"prefix_k must have shape \[1, P, Hkv, D\]"),
    "prefix_v_length": (_shapes(prefix_v=(1, P + 1, HKV, DV)), r"prefix_v must have shape"),
    "prefix_head_dim": (_shapes(prefix_k=(1, P, HKV, D + 1)), r"prefix_k must have shape"),
    "suffix_batch": (_shapes(suffix_k=(B + 1, L, HKV, D), suffix_v=(B + 1, L, HKV, DV)),
                     r"suffix_k must have shape \(2, 8, 2, 16\)"),
    "suffix_heads": (_shapes(suffix_k=(B, L, 1, D), suffix_v=(B, L, 1, DV)),
                     r"suffix_k must have shape"),
    "suffix_value_dim": (_shapes(suffix_v=(B, L, HKV, DV + 2)), r"suffix_v must have shape"),
    "suffix_v_length": (_shapes(suffix_v=(B, L + 1, HKV, DV)), r"suffix_v must have shape"),
    "gqa_ratio": (_shapes(q=(B, SQ, 3, D)), r"q's heads \(3\) must be a multiple"),
    "empty_suffix": (_shapes(suffix_k=(B, 0, HKV, D), suffix_v=(B, 0, HKV, DV)),
                     r"suffix_k must be non-empty"),
}


@pytest.mark.parametrize("case", BAD_SHAPES)
def test_bad_shapes(case):
    shapes, message = BAD_SHAPES[case]
    arrays = {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}
    with pytest.raises(ValueError, match=message):
        pf.cascade_attention(**arrays)


def _arrays(dtype=jnp.float32, **dtypes):
    return {name: jnp.zeros(shape, dtypes.get(name, dtype)) for name, shape in _shapes().items()}


def test_mixed_dtypes():
    with pytest.raises(ValueError, match=r"must share a dtype.*suffix_v=bfloat16"):
        pf.cascade_attention(**_arrays(suffix_v=jnp.bfloat16))


def test_unsupported_dtype():
    with pytest.raises(ValueError, match=r"q must be float32, bfloat16 or float16"):
        pf.cascade_attention(**_arrays(jnp.int32))


def test_both_suffix_mask_mod_and_suffix_block_mask():
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, SQ, L)
    with pytest.raises(ValueError, match="either suffix_mask_mod or suffix_block_mask"):
        pf.cascade_attention(**_arrays(), suffix_mask_mod=masks.causal_mask,
                             suffix_block_mask=block_mask)


@pytest.mark.parametrize("block_mask", [
    lambda: pf.create_block_mask(None, None, None, SQ, L + P),  # built for the concatenation
    lambda: pf.create_block_mask(None, B + 1, None, SQ, L),
    lambda: "not a block mask",
], ids=["concatenated_length", "batch", "type"])
def test_bad_suffix_block_mask(block_mask):
    with pytest.raises(ValueError, match="suffix_block_mask must"):
        pf.cascade_attention(**_arrays(), suffix_block_mask=block_mask())


@pytest.mark.parametrize("argument, mod, message", [
    ("prefix_mask_mod", "not callable", "prefix_mask_mod must be callable"),
    ("suffix_mask_mod", lambda b, h, q_idx: q_idx > 0, "suffix_mask_mod must take 4"),
    ("suffix_mask_mod", lambda b, h, q_idx, kv_idx: kv_idx * 1.0, "suffix_mask_mod .* bool"),
    ("score_mod", lambda score, b, h, q_idx, kv_idx: kv_idx, "score_mod .* floating"),
])
def test_bad_mods_are_named(argument, mod, message):
    with pytest.raises(ValueError, match=message):
        pf.cascade_attention(**_arrays(), **{argument: mod})
