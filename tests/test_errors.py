"""Every user error raises a ValueError that names the argument and what was expected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import masks
from tests.conftest import SMALL_TILES, golden, random_qkv

B, S, H, D = 2, 32, 4, 16


@pytest.fixture(scope="module")
def qkv():
    return random_qkv(0, B, S, S, H, H, D, D, jnp.float32)


def _zeros(shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


ENTRY_POINTS = {
    "attention": lambda q, k, v, **kw: pf.attention(q, k, v, **kw),
    "flex_attention": lambda q, k, v, **kw: pf.flex_attention(q, k, v, **kw),
}


# ---------------------------------------------------------------------------------------
# q, k, v


BAD_INPUTS = {
    "q_rank": ((B, S, H), (B, S, H, D), (B, S, H, D), r"q must be a 4-D array \[B, S, H, D\]"),
    "k_rank": ((B, S, H, D), (B, S, H, D, 1), (B, S, H, D), r"k must be a 4-D array"),
    "v_rank": ((B, S, H, D), (B, S, H, D), (S, H, D), r"v must be a 4-D array"),
    "batch": ((B, S, H, D), (B + 1, S, H, D), (B + 1, S, H, D),
              rf"k and v must have batch {B} \(q's\), got {B + 1}"),
    "kv_length": ((B, S, H, D), (B, S, H, D), (B, S + 1, H, D),
                  rf"k and v must have the same length, got {S} and {S + 1}"),
    "kv_heads": ((B, S, H, D), (B, S, H, D), (B, S, H // 2, D),
                 rf"k and v must have the same number of heads, got {H} and {H // 2}"),
    "head_dim": ((B, S, H, D), (B, S, H, D + 8), (B, S, H, D),
                 rf"k's head dim must equal q's \({D}\), got {D + 8}"),
    "gqa_ratio": ((B, S, 6, D), (B, S, 4, D), (B, S, 4, D),
                  r"q's heads \(6\) must be a multiple of k's heads \(4\)"),
    "empty_kv_heads": ((B, S, H, D), (B, S, 0, D), (B, S, 0, D), r"q, k, v must be non-empty"),
    "empty_q_len": ((B, 0, H, D), (B, S, H, D), (B, S, H, D), r"q, k, v must be non-empty"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_shapes(entry, case):
    q_shape, k_shape, v_shape, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        ENTRY_POINTS[entry](_zeros(q_shape), _zeros(k_shape), _zeros(v_shape), backend="xla")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_mixed_dtypes(entry, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"q, k and v must share a dtype, got float32, "
                                         r"bfloat16, float32"):
        ENTRY_POINTS[entry](q, k.astype(jnp.bfloat16), v, backend="xla")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.int32, np.float64])
def test_unsupported_dtype(entry, name, dtype, qkv):
    arrays = dict(zip("qkv", qkv))
    # A NumPy array keeps float64 whether or not jax_enable_x64 is on.
    arrays[name] = np.zeros(arrays[name].shape, dtype)
    with pytest.raises(ValueError, match=rf"{name} must be float32, bfloat16 or float16, "
                                         rf"got {np.dtype(dtype).name}"):
        ENTRY_POINTS[entry](arrays["q"], arrays["k"], arrays["v"], backend="xla")


def test_non_array_input(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"k must be a 4-D array \[B, S, H, D\], got .*list"):
        pf.attention(q, [[1.0]], v)


# ---------------------------------------------------------------------------------------
# BlockMask


def test_block_mask_for_other_lengths(qkv):
    q, k, v = qkv
    for q_len, kv_len in [(S + 16, S), (S, S - 1)]:
        block_mask = pf.create_block_mask(masks.causal_mask, None, None, q_len, kv_len,
                                          block_size=16)
        with pytest.raises(ValueError, match=rf"block_mask was built for Q_LEN={q_len}, "
                                             rf"KV_LEN={kv_len}, but q and k have lengths "
                                             rf"{S} and {S}"):
            pf.flex_attention(q, k, v, block_mask=block_mask, backend="xla")


def test_block_mask_with_wrong_batch_or_heads(qkv):
    q, k, v = qkv
    wrong_batch = pf.create_block_mask(masks.causal_mask, B + 1, None, S, S, block_size=16)
    with pytest.raises(ValueError, match=rf"block_mask has batch {B + 1}; expected 1 or {B}"):
        pf.flex_attention(q, k, v, block_mask=wrong_batch, backend="xla")
    wrong_heads = pf.create_block_mask(masks.causal_mask, None, H - 1, S, S, block_size=16)
    with pytest.raises(ValueError, match=rf"block_mask has {H - 1} heads; expected 1 or {H}"):
        pf.attention(q, k, v, block_mask=wrong_heads, backend="xla")


@pytest.mark.parametrize("not_a_block_mask", [masks.causal_mask, np.ones((1, 1, 2, 2)), {}],
                         ids=["mask_mod", "ndarray", "dict"])
def test_block_mask_of_the_wrong_type(qkv, not_a_block_mask):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"block_mask must be a pallas_flex.BlockMask, got "
                                         + type(not_a_block_mask).__name__):
        pf.flex_attention(q, k, v, block_mask=not_a_block_mask, backend="xla")


def test_both_mask_mod_and_block_mask(qkv):
    q, k, v = qkv
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, S, S, block_size=16)
    with pytest.raises(ValueError, match=r"either mask_mod or block_mask, not both"):
        pf.attention(q, k, v, mask_mod=masks.causal_mask, block_mask=block_mask)


# ---------------------------------------------------------------------------------------
# Mods


def _three_arguments(b, q_idx, kv_idx):
    return q_idx >= kv_idx


def _float_mask(b, h, q_idx, kv_idx):
    return jnp.float32(q_idx >= kv_idx)


def _int_mask(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def _python_if_mask(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:
        return jnp.bool_(True)
    return jnp.bool_(False)


def _python_and_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) and (kv_idx > 2)


def _vector_mask(b, h, q_idx, kv_idx):
    return jnp.arange(3) < q_idx


BAD_MASK_MODS = {
    "arity": (_three_arguments,
              r"mask_mod must take 4 positional arguments \(b, h, q_idx, kv_idx\)"),
    "lambda_arity": (lambda q_idx, kv_idx: q_idx >= kv_idx, r"mask_mod must take 4 positional"),
    "float": (_float_mask, r"mask_mod '_float_mask' must return a bool, got float32"),
    "int": (_int_mask, r"mask_mod '_int_mask' must return a bool, got int32"),
    "python_if": (_python_if_mask, r"mask_mod '_python_if_mask' uses Python control flow"),
    "python_and": (_python_and_mask, r"mask_mod '_python_and_mask' uses Python control flow"),
    "non_scalar": (_vector_mask, r"mask_mod '_vector_mask' must return one scalar"),
    "not_callable": (np.ones((S, S), bool), r"mask_mod must be callable, got ndarray"),
}


@pytest.mark.parametrize("case", BAD_MASK_MODS)
def test_bad_mask_mod_in_attention(case, qkv):
    mask_mod, message = BAD_MASK_MODS[case]
    q, k, v = qkv
    with pytest.raises(ValueError, match=message):
        pf.attention(q, k, v, mask_mod=mask_mod, backend="xla")


@pytest.mark.parametrize("case", BAD_MASK_MODS)
def test_bad_mask_mod_in_create_block_mask(case):
    mask_mod, message = BAD_MASK_MODS[case]
    with pytest.raises(ValueError, match=message):
        pf.create_block_mask(mask_mod, None, None, S, S, block_size=16)


def _four_argument_score(score, h, q_idx, kv_idx):
    return score


def _vector_score(score, b, h, q_idx, kv_idx):
    return score + jnp.zeros(3)


def _bool_score(score, b, h, q_idx, kv_idx):
    return score > 0


def _python_if_score(score, b, h, q_idx, kv_idx):
    return score if q_idx > kv_idx else score * 2


BAD_SCORE_MODS = {
    "arity": (_four_argument_score,
              r"score_mod must take 5 positional arguments \(score, b, h, q_idx, kv_idx\)"),
    "mask_signature": (masks.causal_mask, r"score_mod must take 5 positional arguments"),
    "non_scalar": (_vector_score, r"score_mod '_vector_score' must return one scalar"),
    "bool": (_bool_score, r"score_mod '_bool_score' must return a floating score, got bool"),
    "python_if": (_python_if_score, r"score_mod '_python_if_score' uses Python control flow"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", BAD_SCORE_MODS)
def test_bad_score_mod(entry, case, qkv):
    score_mod, message = BAD_SCORE_MODS[case]
    q, k, v = qkv
    with pytest.raises(ValueError, match=message):
        ENTRY_POINTS[entry](q, k, v, score_mod=score_mod, backend="xla")


# ---------------------------------------------------------------------------------------
# Options


def test_unknown_backend(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"backend must be one of \('pallas', 'interpret', "
                                         r"'xla', 'reference'\) or None, got 'triton'"):
        pf.attention(q, k, v, mask_mod=masks.causal_mask, backend="triton")


BAD_KERNEL_OPTIONS = {
    "unknown_key": ({"block_m": 16}, r"kernel_options has unknown keys \['block_m'\]"),
    "block_q": ({"block_q": 24}, r"kernel_options\['block_q'\] must be a power of two, got 24"),
    "block_kv_zero": ({"block_kv": 0}, r"kernel_options\['block_kv'\] must be a power of two"),
    "block_kv_float": ({"block_kv": 16.0}, r"kernel_options\['block_kv'\] must be a power of two"),
    "num_warps": ({"num_warps": 0}, r"kernel_options\['num_warps'\] must be a positive int"),
    "items_per_program": ({"forward_items_per_program": -1},
                          r"kernel_options\['forward_items_per_program'\] must be a "
                          r"non-negative int, got -1"),
    "backward_masked_first": ({"backward_masked_first": 1},
                              r"kernel_options\['backward_masked_first'\] must be a bool, got 1"),
    "not_a_dict": ([("block_q", 16)], r"kernel_options must be a dict or KernelOptions, got list"),
}


@pytest.mark.parametrize("with_mask_mod", [False, True], ids=["no_mask", "mask_mod"])
@pytest.mark.parametrize("case", BAD_KERNEL_OPTIONS)
def test_bad_kernel_options(case, with_mask_mod, qkv):
    """With a mask_mod, attention turns block_q/block_kv into the BlockMask's block size:
    the error must still name kernel_options, not create_block_mask's block_size."""
    options, message = BAD_KERNEL_OPTIONS[case]
    q, k, v = qkv
    mask_mod = masks.causal_mask if with_mask_mod else None
    with pytest.raises(ValueError, match=message):
        pf.attention(q, k, v, mask_mod=mask_mod, backend="xla", kernel_options=options)


@pytest.mark.parametrize("scale", [jnp.float32(0.25), jnp.array([0.25]), "0.25"],
                         ids=["jax_scalar", "jax_vector", "str"])
def test_bad_scale(scale, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"scale must be a Python float"):
        pf.attention(q, k, v, scale=scale, backend="xla")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_non_finite_scale(entry, scale, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=rf"scale must be finite, got {scale}"):
        ENTRY_POINTS[entry](q, k, v, scale=scale, backend="xla")


def test_traced_scale_is_rejected_under_jit(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"scale must be a Python float .* fold a traced scale "
                                         r"into a score_mod"):
        jax.jit(lambda s: pf.attention(q, k, v, scale=s, backend="xla"))(0.25)


# ---------------------------------------------------------------------------------------
# create_block_mask


@pytest.mark.parametrize("block_size", [48, 0, -16, (16, 24), (0, 16)], ids=str)
def test_block_size_not_a_power_of_two(block_size):
    with pytest.raises(ValueError, match=r"block_size must be powers of two .*got "
                                         + rf"{block_size!r}".replace("(", r"\(").replace(")", r"\)")):
        pf.create_block_mask(masks.causal_mask, None, None, 64, 64, block_size=block_size)


@pytest.mark.parametrize("block_size", ["big", "16", (16, 16, 16), None, 16.0, (16.5, 16),
                                        ("16", "16"), (True, 16)], ids=str)
def test_block_size_of_the_wrong_form(block_size):
    with pytest.raises(ValueError, match=r"block_size must be an int or a pair \(block_q, "
                                         r"block_kv\)"):
        pf.create_block_mask(masks.causal_mask, None, None, 64, 64, block_size=block_size)


@pytest.mark.parametrize("argument", ["B", "H", "Q_LEN", "KV_LEN"])
@pytest.mark.parametrize("value", [0, -3, 64.0, True, "64"], ids=repr)
def test_bad_sizes(argument, value):
    sizes = {"B": 2, "H": 2, "Q_LEN": 64, "KV_LEN": 64}
    sizes[argument] = value
    optional = " or None" if argument in ("B", "H") else ""
    with pytest.raises(ValueError, match=rf"{argument} must be a positive int{optional}, got "
                                         + repr(value).replace(".", r"\.")):
        pf.create_block_mask(masks.causal_mask, sizes["B"], sizes["H"], sizes["Q_LEN"],
                             sizes["KV_LEN"], block_size=16)


# ---------------------------------------------------------------------------------------
# merge_attention_states


def test_merge_attention_states_mismatched_shapes():
    out = _zeros((2, 8, 3, 4))
    lse = _zeros((2, 3, 8))
    with pytest.raises(ValueError, match=r"out_a and out_b must have the same shape, got "
                                         r"\(2, 8, 3, 4\) and \(2, 8, 3, 5\)"):
        pf.merge_attention_states(out, lse, _zeros((2, 8, 3, 5)), lse)
    with pytest.raises(ValueError, match=r"lse_a must have shape \[B, H, S\] = \(2, 3, 8\), "
                                         r"got \(2, 8, 3\)"):
        pf.merge_attention_states(out, _zeros((2, 8, 3)), out, lse)
    with pytest.raises(ValueError, match=r"lse_b must have shape \[B, H, S\] = \(2, 3, 8\), "
                                         r"got \(2, 3, 9\)"):
        pf.merge_attention_states(out, lse, out, _zeros((2, 3, 9)))
    with pytest.raises(ValueError, match=r"out_a must be a 4-D array \[B, S, H, Dv\], got "
                                         r"shape \(8, 3\)"):
        pf.merge_attention_states(_zeros((8, 3)), _zeros((8, 3)), _zeros((8, 3)),
                                  _zeros((8, 3)))
    with pytest.raises(ValueError, match=r"out_b must be a 4-D array"):
        pf.merge_attention_states(out, lse, _zeros((2, 8, 3)), lse)


@pytest.mark.parametrize("position", range(4))
def test_merge_attention_states_refuses_lists(position):
    """Non-arrays (nested Python lists) are refused naming the argument, not converted."""
    args = [_zeros((1, 2, 1, 3)), _zeros((1, 1, 2)), _zeros((1, 2, 1, 3)), _zeros((1, 1, 2))]
    name = ("out_a", "lse_a", "out_b", "lse_b")[position]
    args[position] = np.asarray(args[position]).tolist()
    with pytest.raises(ValueError, match=rf"{name} must be an array \(jax.Array or "
                                         r"numpy.ndarray\), got list"):
        pf.merge_attention_states(*args)
    args[position] = np.zeros(np.shape(args[position]), np.int32)
    with pytest.raises(ValueError, match=rf"{name} must be a float array, got dtype int32"):
        pf.merge_attention_states(*args)


# ---------------------------------------------------------------------------------------
# Mods indexing captured Python containers with traced indices

_TABLE_LIST = list(range(S))
_TABLE_TUPLE = tuple(range(S))
_TABLE_NUMPY = np.arange(S)

CONTAINER_MASK_MODS = {
    "list": lambda b, h, q_idx, kv_idx: _TABLE_LIST[q_idx] >= kv_idx,
    "tuple": lambda b, h, q_idx, kv_idx: _TABLE_TUPLE[kv_idx] <= q_idx,
    "numpy": lambda b, h, q_idx, kv_idx: _TABLE_NUMPY[q_idx] >= kv_idx,
}
CONTAINER_SCORE_MODS = {
    "list": lambda score, b, h, q_idx, kv_idx: score + _TABLE_LIST[kv_idx],
    "numpy": lambda score, b, h, q_idx, kv_idx: score + _TABLE_NUMPY[q_idx],
}
_CONTAINER_MESSAGE = (r"{kind}_mod '<lambda>' indexes a Python list/tuple or NumPy array it "
                      r"captured with a traced index .* wrap it with jnp.asarray\(\.\.\.\) "
                      r"so it is captured as an array")


@pytest.mark.parametrize("case", CONTAINER_MASK_MODS)
def test_mask_mod_indexing_a_python_container(case, qkv):
    q, k, v = qkv
    message = _CONTAINER_MESSAGE.format(kind="mask")
    with pytest.raises(ValueError, match=message):
        pf.attention(q, k, v, mask_mod=CONTAINER_MASK_MODS[case], backend="xla")
    with pytest.raises(ValueError, match=message):
        pf.create_block_mask(CONTAINER_MASK_MODS[case], None, None, S, S, block_size=16)


@pytest.mark.parametrize("case", CONTAINER_SCORE_MODS)
def test_score_mod_indexing_a_python_container(case, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=_CONTAINER_MESSAGE.format(kind="score")):
        pf.attention(q, k, v, score_mod=CONTAINER_SCORE_MODS[case], backend="xla")


def test_the_advice_works(qkv):
    """The same mods with the table wrapped in jnp.asarray run and match the reference."""
    q, k, v = qkv
    table = jnp.asarray(_TABLE_NUMPY)
    mask_mod = lambda b, h, q_idx, kv_idx: table[q_idx] >= kv_idx  # noqa: E731
    out = pf.attention(q, k, v, mask_mod=mask_mod, backend="xla")
    expected, _ = golden(q, k, v, mask_mod=masks.causal_mask)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_mod_concretizing_an_index(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"mask_mod '<lambda>' needs a concrete Python value "
                                         r"of a traced argument"):
        pf.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: int(q_idx) >= kv_idx,
                     backend="xla")


# ---------------------------------------------------------------------------------------
# Mods doing arithmetic on a whole captured array


def _whole_array_cases():
    table = jnp.arange(4, dtype=jnp.float32)
    log_slopes = jnp.log(jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32))

    def sum_score(score, b, h, q_idx, kv_idx):
        return score + jnp.sum(table) * 0.01

    def exp_slopes_score(score, b, h, q_idx, kv_idx):
        return score - jnp.exp(log_slopes)[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)

    limits = jnp.arange(S, dtype=jnp.int32)

    def max_limit_mask(b, h, q_idx, kv_idx):  # both positions meet the array's max: one
        # that met a single position would be precomputed per row (`masks.row_reads`)
        return q_idx + kv_idx <= jnp.max(limits)

    return {"sum_score": (None, sum_score), "exp_slopes_score": (None, exp_slopes_score),
            "max_limit_mask": (max_limit_mask, None)}


@pytest.mark.parametrize("case", list(_whole_array_cases()))
def test_whole_captured_array_arithmetic_is_rejected_by_the_tile_interpreter(case, qkv):
    mask_mod, score_mod = _whole_array_cases()[case]
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"captured array.*Compute derived arrays outside the "
                                         r"mod and close over the result"):
        pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend="interpret",
                     kernel_options=SMALL_TILES)
    # The same mod is valid JAX: the blockwise XLA path evaluates it like the reference.
    out = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend="xla",
                       kernel_options=SMALL_TILES)
    expected, _ = golden(q, k, v, mask_mod, score_mod)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)
