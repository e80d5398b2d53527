"""The warp-specialized Mosaic GPU forward kernel (`kernels/forward_mosaic.py`).

On CPU it runs in Mosaic GPU's interpret mode (`forward_kernel="mosaic"` with
backend="interpret"; the matmuls are plain dots there, everything else is the kernel's
own code: TMA copies, barriers, the memory and compute warpgroups, the block walk and
the mods). On the GPU (marker `gpu`) the same cases run the compiled kernel.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import dispatch, masks
from pallas_flex.kernels import mosaic_eligibility, relative_reads
from pallas_flex.kernels.config import resolve_options
from pallas_flex.kernels.forward_mosaic import fixed_softmax_shift
from pallas_flex.masks.mod_program import SCORE, make_mod_program, score_bounds
from tests.conftest import assert_close_to_golden, golden, random_qkv
from tests.test_attention import LAYOUTS, VARIANTS

MOSAIC = {"forward_kernel": "mosaic"}
# Variants of the shared gallery whose mods the kernel takes (elementwise operations,
# captured arrays read at b/h-only indices or, T5, at indices of kv_idx - q_idx:
# `relative_reads`), and those it hands to the Triton kernel.
SUPPORTED = ["noop", "causal", "sliding_window", "sliding_window_bidirectional", "prefix_lm",
             "prefix_lm_per_batch", "dilated", "chunked_causal", "and_or_not",
             "alibi_causal", "softcap_causal", "softcap_approx", "relative_position",
             "t5_bias"]
# Supported through mosaic_eligibility.contiguous_reads (reads at q_idx / kv_idx as slices;
# a bias tensor's [q, kv] blocks: `test_bias_tensor_blocks`).
SLICED = ["document", "document_causal_wrapper"]
# (dtype, layout, q_len, kv_len, head dim), cycled over the variants.
SHAPES = [(jnp.bfloat16, "MHA", 256, 256, 64), (jnp.float16, "GQA4", 128, 384, 128),
          (jnp.bfloat16, "MQA", 300, 130, 64), (jnp.float16, "MHA", 200, 128, 128),
          (jnp.bfloat16, "GQA4", 17, 250, 64)]
# Head counts of the layouts in interpret mode. The interpreter runs the grid's programs one
# after another on the CPU, so a case's time grows with batch x heads: the CPU runs take
# half of LAYOUTS' heads (still two KV heads shared by two query heads each for GQA, one
# for MQA, and batch 2); the GPU runs keep LAYOUTS' own.
INTERPRET_LAYOUTS = {"MHA": (2, 2), "GQA4": (4, 2), "MQA": (2, 1)}
# Lengths of the slice-read and head-dim cases in interpret mode: 300 and 384 run at 200
# and 256, two tiles where there were three (200 still ragged, 256 still whole tiles, Sq !=
# Skv where it was); the GPU keeps the cases' own.
INTERPRET_LENGTHS = {300: 200, 384: 256}


def interpret_lengths(q_len, kv_len, backend):
    if backend != "interpret":
        return q_len, kv_len
    return INTERPRET_LENGTHS.get(q_len, q_len), INTERPRET_LENGTHS.get(kv_len, kv_len)


def _mods(variant, batch, q_heads, q_len, kv_len):
    mask_factory, score_factory, _ = VARIANTS[variant]
    args = (batch, q_heads, q_len, kv_len)
    return (mask_factory(*args) if mask_factory else None,
            score_factory(*args) if score_factory else None)


def heads_of(layout, backend):
    return (INTERPRET_LAYOUTS if backend == "interpret" else LAYOUTS)[layout]


def _check(variant, dtype, layout, q_len, kv_len, dim, backend, seed=0):
    q_heads, kv_heads = heads_of(layout, backend)
    batch = 2
    q, k, v = random_qkv(seed, batch, q_len, kv_len, q_heads, kv_heads, dim, dim, dtype)
    mask_mod, score_mod = _mods(variant, batch, q_heads, q_len, kv_len)
    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            return_lse=True, kernel_options=MOSAIC)
    _check_forward(out, lse, q, k, v, mask_mod, score_mod)


def _check_forward(out, lse, q, k, v, mask_mod, score_mod):
    """out and lse against the float64 golden: the 16-bit rule for out, lse to 2e-2 with
    the same rows -inf (rows that see no key)."""
    expected_out, expected_lse = golden(q, k, v, mask_mod, score_mod)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod, score_mod)
    masked_rows = np.isneginf(expected_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), masked_rows)
    np.testing.assert_allclose(np.asarray(lse)[~masked_rows], expected_lse[~masked_rows],
                               atol=2e-2, rtol=2e-2)


def layout_id(layout, backend):
    """The layout's name in a test id, with its head counts where they are the CPU's."""
    return layout if backend != "interpret" else "{}_h{}kv{}".format(
        layout, *heads_of(layout, backend))


def _cases(backend="pallas"):
    for index, variant in enumerate(SUPPORTED):
        dtype, layout, q_len, kv_len, dim = SHAPES[index % len(SHAPES)]
        yield pytest.param(variant, dtype, layout, q_len, kv_len, dim,
                           id=f"{variant}-{jnp.dtype(dtype).name}-{layout_id(layout, backend)}"
                              f"-{q_len}x{kv_len}-d{dim}")


# In interpret mode the gallery runs in tests/kernels/test_backward_mosaic.py's
# test_gallery_in_interpret_mode: every variant of SUPPORTED at its dtype, layout and head
# dim, the forward's output and lse checked against the float64 golden as here (the
# primal outputs of the jax.vjp whose gradients that test checks: one forward run serves
# both), at its interpret lengths (300 and 384 as 200 and 256) and one batch row unless
# the mod reads b. Batch 2 runs in the slice-read, head-dim, paged, items-per-program,
# vmap and soft-cap tests here; three K/V tiles (384 keys) in the hand-over and
# items-per-program tests.
@pytest.mark.gpu
@pytest.mark.parametrize("variant,dtype,layout,q_len,kv_len,dim", list(_cases()))
def test_gallery_on_gpu(variant, dtype, layout, q_len, kv_len, dim):
    _check(variant, dtype, layout, 4 * q_len, 4 * kv_len, dim, "pallas")


_SLICE_SHAPES = [(jnp.bfloat16, "GQA4", 300, 300, 64), (jnp.float16, "MHA", 256, 256, 128)]


def _slice_cases():
    """On the GPU each variant at both shapes; in interpret mode each variant at one of
    them, in rotation (both variants, both shapes, the ragged 300 included, still run)."""
    for index, variant in enumerate(SLICED):
        for shape_index, shape in enumerate(_SLICE_SHAPES):
            case_id = "-".join([jnp.dtype(shape[0]).name, *map(str, shape[1:]), variant])
            if shape_index == index % len(_SLICE_SHAPES):
                yield pytest.param("interpret", variant, *shape, id=f"{case_id}-interpret")
            yield pytest.param("pallas", variant, *shape, marks=pytest.mark.gpu,
                               id=f"{case_id}-pallas")


@pytest.mark.parametrize("backend,variant,dtype,layout,q_len,kv_len,dim", list(_slice_cases()))
def test_slice_reads_of_document_ids(backend, variant, dtype, layout, q_len, kv_len, dim):
    """`doc_ids[q_idx]` / `doc_ids[kv_idx]` load as vectors (ragged lengths read the
    edge-padded ids)."""
    _check(variant, dtype, layout, *interpret_lengths(q_len, kv_len, backend), dim, backend)


def test_contiguous_reads_recognizes_index_reads_only():
    table = jnp.zeros((4, 64))

    def score_mod(score, b, h, q_idx, kv_idx):
        # a slice read at kv_idx (row h), and a gather at a computed index
        return score + table[h, kv_idx] + table[h, q_idx // 2]

    reads = mosaic_eligibility.contiguous_reads(make_mod_program(score_mod, SCORE))
    assert sorted(reads.values()) == [(0, 1, "kv")]

    offset = 0  # `ids[q_idx + offset]` as a prefill-with-cache mask writes it: exact at 0

    def shifted(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx + offset] + table[h, kv_idx - 0] + table[h, q_idx + 1]

    reads = mosaic_eligibility.contiguous_reads(make_mod_program(shifted, SCORE))
    assert sorted(reads.values()) == [(0, 1, "kv"), (0, 1, "q")]

    # Blocks of a bias tensor at (q_idx, kv_idx) (`blocks=True`): float arrays, q
    # before kv (the tile's order), other indices of b and h.
    bias, keep = jnp.zeros((2, 4, 64, 64), jnp.bfloat16), jnp.ones((2, 64, 64), bool)

    def blocks(score, b, h, q_idx, kv_idx):
        return (score + bias[b // 2, h, q_idx, kv_idx] + bias[b, h, kv_idx, q_idx]
                + jnp.where(keep[b, q_idx, kv_idx], 0.0, 1.0))
    program = make_mod_program(blocks, SCORE)
    assert not mosaic_eligibility.contiguous_reads(program)
    assert sorted(mosaic_eligibility.contiguous_reads(program, blocks=True).values()) == [
        (0, (2, 3), "block")]
    assert mosaic_eligibility.mod_unsupported_reason(make_mod_program(shifted, SCORE))
    assert mosaic_eligibility.mod_unsupported_reason(make_mod_program(
        lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx + offset], SCORE)) is None


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_fully_masked_rows_and_empty_block_rows(backend):
    """Rows 0-127 see nothing (their BlockMask row lists no block at all); in the second
    query block even rows see nothing and odd rows only key 0 (a partial block in which
    whole rows are masked)."""
    q, k, v = random_qkv(1, 1, 256, 256, 2, 2, 64, 64, jnp.bfloat16)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 128) & (q_idx % 2 == 1) & (kv_idx == 0)

    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, backend=backend, return_lse=True,
                            kernel_options=MOSAIC)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert np.all(out[:, :128] == 0.0) and np.all(out[:, 128::2] == 0.0)
    assert np.all(np.isneginf(lse[:, :, :128])) and np.all(np.isneginf(lse[:, :, 128::2]))
    np.testing.assert_allclose(out[:, 129::2],
                               np.broadcast_to(np.asarray(v[:, :1].astype(jnp.float32)),
                                               out[:, 129::2].shape))
    np.testing.assert_allclose(lse[:, :, 129::2], np.asarray(
        jnp.einsum("bqhd,bhd->bhq", q[:, 129::2].astype(jnp.float32),
                   k[:, 0].astype(jnp.float32)) / 8.0), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_explicit_scale_and_negative_scale(backend):
    """The scale folds into the exponent only when positive; a negative one (legal, if
    odd) multiplies the scores first."""
    q, k, v = random_qkv(2, 1, 128, 256, 2, 1, 128, 128, jnp.bfloat16)
    for scale in (0.3, -0.05):
        out = pf.attention(q, k, v, mask_mod=masks.causal_mask, scale=scale, backend=backend,
                           kernel_options=MOSAIC)
        expected, _ = golden(q, k, v, masks.causal_mask, scale=scale)
        assert_close_to_golden(out, expected, q, k, v, masks.causal_mask, scale=scale)


def test_gathering_mods_are_refused_with_the_reason():
    q, k, v = random_qkv(0, 2, 256, 256, 2, 2, 64, 64, jnp.bfloat16)
    table = jnp.zeros((2, 512))

    def gathering(score, b, h, q_idx, kv_idx):  # a computed index: one load per element
        return score + table[h, q_idx // 2 + kv_idx]
    bias = jnp.zeros((2, 2, 256, 256))

    def transposed(score, b, h, q_idx, kv_idx):  # a [kv, q] block: not the tile's order
        return score + bias[b, h, kv_idx, q_idx]
    for score_mod in (gathering, transposed):
        with pytest.raises(ValueError, match="gather"):
            pf.attention(q, k, v, score_mod=score_mod, backend="interpret",
                         kernel_options=MOSAIC)


def test_a_read_indexed_by_the_score_is_a_gather_not_a_block():
    """A bias read whose batch index depends on the score varies over the tile in a way
    no block load can follow: `tile_reads` takes none and the reason names the gather."""
    bias = jnp.arange(2 * 3 * 256 * 256, dtype=jnp.float32).reshape(2, 3, 256, 256)

    def by_row(score, b, h, q_idx, kv_idx):
        return score + bias[b // 2, h, q_idx, kv_idx]

    def by_score(score, b, h, q_idx, kv_idx):
        return score + bias[(score > 0).astype(jnp.int32), h, q_idx, kv_idx]
    assert not mosaic_eligibility.tile_reads(make_mod_program(by_score, SCORE), blocks=True)
    assert "gather" in mosaic_eligibility.mod_unsupported_reason(
        make_mod_program(by_score, SCORE), blocks=True)
    reads = mosaic_eligibility.tile_reads(make_mod_program(by_row, SCORE), blocks=True)
    assert [kind for _, _, kind in reads.values()] == ["block"]


# Bias tensors read at (q_idx, kv_idx) (`bias_lookup`: [B, H, Sq, Skv], B and H shared or
# not; 16-bit or float32): the forward's memory warpgroup copies each K/V tile's [128, keys]
# block of the (edge-padded) array into a ring beside the K/V stages; ragged lengths and
# Sq != Skv read the padding, which no kept score uses. D 128 walks 64-key tiles then
# (`forward_mosaic.stages_and_parts`); three items a program share one ring.
_BLOCK_SHAPES = [(jnp.bfloat16, "GQA4", 200, 300, 64, (2, 4), jnp.bfloat16, 1),
                 (jnp.bfloat16, "MHA", 128, 192, 96, (1, 4), jnp.bfloat16, 2),
                 (jnp.float16, "MHA", 256, 128, 128, (1, 1), jnp.float32, 3),
                 (jnp.bfloat16, "MHA", 384, 256, 128, (2, 4), jnp.bfloat16, 2)]


def bias_block_call(backend, dtype, layout, q_len, kv_len, dim, bias_shape, bias_dtype):
    """(q, k, v, bias) of a batch-2 call reading a bias tensor (`bias_lookup`) of shape
    [B, H, q_len, kv_len] (B and H 1 where bias_shape's entries are 1)."""
    q_heads, kv_heads = heads_of(layout, backend)
    q, k, v = random_qkv(3, 2, q_len, kv_len, q_heads, kv_heads, dim, dim, dtype)
    shape = (bias_shape[0] if bias_shape[0] == 1 else 2,
             1 if bias_shape[1] == 1 else q_heads, q_len, kv_len)
    bias = (jax.random.normal(jax.random.key(7), shape) * 2).astype(bias_dtype)
    return q, k, v, bias


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype,layout,q_len,kv_len,dim,bias_shape,bias_dtype,items",
                         _BLOCK_SHAPES)
def test_bias_tensor_blocks(backend, dtype, layout, q_len, kv_len, dim, bias_shape,
                            bias_dtype, items):
    q, k, v, bias = bias_block_call(backend, dtype, layout, q_len, kv_len, dim, bias_shape,
                                    bias_dtype)
    score_mod = masks.bias_lookup(bias)
    options = {**MOSAIC, "forward_items_per_program": items}
    for mask_mod in (None, masks.causal_mask):
        choice = pf.explain(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                            backend=backend, kernel_options=options)
        assert "forward: mosaic_forward" in choice, choice
        if backend == "pallas":  # and by default
            choice = pf.explain(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                backend=backend)
            assert "forward: mosaic_forward" in choice, choice
        # (the backward's blocks: tests/kernels/test_backward_mosaic.py)
        out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                backend=backend, return_lse=True, kernel_options=options)
        _check_forward(out, lse, q, k, v, mask_mod, score_mod)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_pair_bias_blocks_addressed_by_batch_row(backend):
    """A pair bias shared by the rows of each MSA (`bias[b // 2, h, q_idx, kv_idx]`, as
    `pf.variants.gated_self_attention` folds its rows into the batch): the memory
    warpgroup evaluates the index slice `b // 2` per item (`block_indices`); a second
    read whose batch index comes from a captured array stays a gather (the Triton
    forward's)."""
    q, k, v = random_qkv(5, 4, 256, 256, 2, 2, 64, 64, jnp.bfloat16)
    bias = (jax.random.normal(jax.random.key(8), (2, 2, 256, 256)) * 2).astype(jnp.bfloat16)

    def pair_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b // 2, h, q_idx, kv_idx]
    out, lse = pf.attention(q, k, v, score_mod=pair_bias, backend=backend, return_lse=True,
                            kernel_options={**MOSAIC, "forward_items_per_program": 2})
    _check_forward(out, lse, q, k, v, None, pair_bias)
    rows = jnp.array([1, 0, 1, 0], jnp.int32)

    def by_table(score, b, h, q_idx, kv_idx):
        return score + bias[rows[b], h, q_idx, kv_idx]
    with pytest.raises(ValueError, match="gather"):
        pf.explain(q, k, v, score_mod=by_table, backend=backend, kernel_options=MOSAIC)


def test_block_indices_slice_the_mod_to_b_and_h():
    """`block_indices` runs the part of the mod that addresses a block (on b and h only)
    and refuses an index that depends on anything else."""
    bias = jnp.zeros((3, 4, 64, 64), jnp.float32)
    table = jnp.zeros((8,), jnp.int32)

    def mod(score, b, h, q_idx, kv_idx):
        return (score + bias[b // 3, (h + 1) % 4, q_idx, kv_idx]
                + bias[table[b], 0, q_idx, kv_idx])
    program = make_mod_program(mod, SCORE)
    reads = mosaic_eligibility.contiguous_reads(program, blocks=True)
    equations = [e for e in program.jaxpr.eqns if id(e) in reads]
    assert len(equations) == 1  # the second read is a gather
    indices = mosaic_eligibility.block_indices(program, equations[0])
    assert [None if i is None else int(i) for i in indices(jnp.int32(7), jnp.int32(3))] == [
        2, 0, None, None]
    gathered = next(e for e in program.jaxpr.eqns if e.primitive.name == "dynamic_slice"
                    and id(e) not in reads and e.invars[0] is equations[0].invars[0])
    assert mosaic_eligibility.block_indices(program, gathered) is None


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dim,items", [(64, 1), (128, 3)])
def test_output_gate_in_the_epilogue(backend, dim, items):
    """The gate's tile copied into the output's staging buffer, the output times its
    sigmoid: one item a program (copied after the walk, into q_smem) and three (a
    persistent program copies it before the walk, once the previous item's store has
    left the buffer), ragged query rows, against the float64 model."""
    q, k, v = random_qkv(4, 2, 200, 256, 4, 2, dim, dim, jnp.bfloat16)
    gate = (jax.random.normal(jax.random.key(5), q.shape) * 3).astype(jnp.bfloat16)
    options = {**MOSAIC, "forward_items_per_program": items}
    assert "forward: mosaic_forward" in pf.explain(q, k, v, mask_mod=masks.causal_mask,
                                                   backend=backend, kernel_options=options)
    out = pf.attention(q, k, v, mask_mod=masks.causal_mask, output_gate=gate,
                       backend=backend, kernel_options=options)
    want, _ = golden(q, k, v, masks.causal_mask)
    want = want / (1.0 + np.exp(-np.asarray(gate, np.float64)))
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, atol=2e-2, rtol=2e-2)
    # The sigmoid runs inside the kernel, nowhere outside it.
    jaxpr = jax.make_jaxpr(lambda q, k, v, gate: pf.attention(
        q, k, v, mask_mod=masks.causal_mask, output_gate=gate, backend="interpret",
        kernel_options=options))(q, k, v, gate)

    def logistic_sites(jaxpr, inside=False):
        for equation in jaxpr.eqns:
            if equation.primitive.name == "logistic":
                yield inside
            for sub in jax.extend.core.jaxprs_in_params(equation.params):
                yield from logistic_sites(sub, inside or equation.primitive.name
                                          in ("pallas_call", "mpmd_map"))  # (the kernels)
    assert set(logistic_sites(jaxpr.jaxpr)) == {True}


@pytest.mark.gpu
def test_long_walks_with_few_programs_repeat_bit_for_bit():
    """Few work items (B1 H2: 64 query blocks) walking 32 K/V tiles each, called again
    and again: every call returns (a race in the warp-specialized hand-over would hang
    here; the bias-tensor blocks this kernel once loaded did, at this shape), with the
    same bits, and within 16-bit rounding of the Triton forward."""
    q, k, v = random_qkv(5, 1, 4096, 4096, 2, 2, 128, 128, jnp.bfloat16)
    documents = jnp.repeat(jnp.arange(8), 512)
    for mask_mod in (None, masks.causal_mask, masks.document_mask(documents)):
        def run(options, mask_mod=mask_mod):
            return jax.jit(lambda q, k, v: pf.attention(
                q, k, v, mask_mod=mask_mod, backend="pallas", kernel_options=options))
        mosaic, triton = run(MOSAIC), run({"forward_kernel": "triton"})
        first = np.asarray(mosaic(q, k, v).astype(jnp.float32))
        for _ in range(8):
            np.testing.assert_array_equal(np.asarray(mosaic(q, k, v).astype(jnp.float32)),
                                          first)
        want = np.asarray(triton(q, k, v).astype(jnp.float32))
        assert np.max(np.abs(first - want)) <= 2e-2 * np.max(np.abs(want))


@pytest.mark.parametrize("change,reason", [
    (dict(dtype=jnp.float32), "dtype"),
    (dict(dim=48), "head dims"),
    (dict(value_dim=128), "head dims"),
    (dict(block_size=64), "block size"),
])
def test_uncovered_calls_are_refused_with_the_reason(change, reason):
    shape = dict(dtype=jnp.bfloat16, dim=64, value_dim=None, q_len=200, block_size=128)
    shape.update(change)
    q, k, v = random_qkv(0, 1, shape["q_len"], 256, 2, 2, shape["dim"],
                         shape["value_dim"] or shape["dim"], shape["dtype"])
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, shape["q_len"], 256,
                                      block_size=shape["block_size"])
    assert reason in mosaic_eligibility.unsupported_reason(q, k, v, block_mask, None,
                                                       interpret=True)
    with pytest.raises(ValueError, match="Mosaic GPU forward kernel does not take"):
        pf.flex_attention(q, k, v, block_mask=block_mask, backend="interpret",
                          kernel_options=MOSAIC)


def test_unknown_primitive_is_refused():
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + jnp.floor(kv_idx / 3.0)  # floor has no Mosaic GPU rule

    program = make_mod_program(score_mod, SCORE)
    q, k, v = random_qkv(0, 1, 128, 128, 1, 1, 64, 64, jnp.bfloat16)
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 128, 128)
    assert "floor" in mosaic_eligibility.unsupported_reason(q, k, v, block_mask, program,
                                                        interpret=True)


def test_forward_kernel_option():
    assert resolve_options(None, 128).forward_kernel == "auto"
    # Tuning the Triton kernel's tiles selects it; naming a kernel wins.
    assert resolve_options({"block_q": 64}, 128).forward_kernel == "triton"
    named = resolve_options({"num_warps": 8, "forward_kernel": "auto"}, 128)
    assert named.forward_kernel == "auto"
    with pytest.raises(ValueError, match="forward_kernel"):
        resolve_options({"forward_kernel": "cuda"}, 128)


@pytest.mark.gpu
def test_auto_runs_the_mosaic_kernel_on_hopper_and_gradients_flow():
    """With default options a covered call lowers to a Mosaic GPU kernel, and the Triton
    backward kernels take its lse: gradients match the float64 reference's."""
    q, k, v = random_qkv(3, 2, 512, 512, 4, 2, 128, 128, jnp.bfloat16)
    score_mod = masks.alibi(4)

    def loss(q, k, v):
        return jnp.sum(pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod)
                       .astype(jnp.float32) * jnp.cos(jnp.arange(128.0)))

    hlo = jax.jit(loss).lower(q, k, v).as_text()
    assert "mosaic_gpu" in hlo
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def reference_loss(q, k, v):
        out = pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                           backend="reference")
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(128.0)))

    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    expected = jax.grad(reference_loss, argnums=(0, 1, 2))(q32, k32, v32)
    for got, want in zip(grads, expected):
        got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want)
        assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_vmap_grad_and_checkpoint(backend):
    """Under jax.vmap (and jax.checkpoint, on the GPU) the kernel runs with its own
    batching rule (Pallas would batch the kernel body, which the compiled kernel cannot
    run): the vmapped axis folds into the batch when only q, k, v carry it, and otherwise
    (a mod reading b, or a vmapped captured array) the kernel runs once per element."""
    q, k, v = random_qkv(4, 2, 130, 256, 2, 2, 64, 64, jnp.bfloat16)
    stacked = [jnp.stack([x, (2 * x).astype(x.dtype)]) for x in (q, k, v)]
    slopes = jnp.stack([jnp.asarray([0.5, 0.25]), jnp.asarray([0.125, 1.0])])
    per_batch_prefix = masks.prefix_lm(jnp.asarray([3, 100], jnp.int32))

    def attend(q, k, v, slopes, mask_mod, backend, options):
        return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=masks.alibi(slopes),
                            backend=backend, kernel_options=options)

    for mask_mod, slope_axis in [(masks.causal_mask, None), (per_batch_prefix, None),
                                 (masks.causal_mask, 0)]:
        def step(q, k, v, s, backend, options, mask_mod=mask_mod):
            call = lambda q, k, v: attend(q, k, v, s, mask_mod, backend, options)
            # Mosaic GPU's interpreter runs on ordered IO callbacks, which AD of
            # jax.checkpoint refuses: remat is checked on the GPU only.
            return (jax.checkpoint(call) if backend == "pallas" else call)(q, k, v)

        run = jax.vmap(step, in_axes=(0, 0, 0, slope_axis, None, None))
        chosen_slopes = slopes if slope_axis == 0 else slopes[0]

        def out_and_grads(q, k, v, backend, options):
            # The output and the gradients of sum(out * cos) from one forward (jax.vjp):
            # the interpreter's forward is most of the time of jax.grad's.
            out, pullback = jax.vjp(lambda q, k, v: run(q, k, v, chosen_slopes, backend,
                                                        options), q, k, v)
            d_out = jnp.broadcast_to(jnp.cos(jnp.arange(64.0)), out.shape).astype(out.dtype)
            return out, pullback(d_out)

        out, grads = out_and_grads(*stacked, backend, MOSAIC)
        expected, expected_grads = out_and_grads(*[x.astype(jnp.float32) for x in stacked],
                                                 "reference", None)
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(expected),
                                   atol=3e-2, rtol=3e-2)
        for got, want in zip(grads, expected_grads):
            got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want)
            assert np.max(np.abs(got - want)) <= 3e-2 * np.max(np.abs(want))


_HAND_OVER_CASES = {  # (head dim, score_mod, whether the hand-over is early)
    "d128_alibi": (128, masks.alibi(2), True),
    "d128_softcap": (128, masks.tanh_softcap(5.0), False),
    "d64_alibi": (64, masks.alibi(2), True),
    "d64_no_score_mod": (64, None, False),
}


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", sorted(_HAND_OVER_CASES))
def test_both_hand_over_forms_give_the_same_values(backend, case):
    """Handing the tensor cores over before q·kᵀ lands, or after (`hand_over_early`)."""
    dim, score_mod, early = _HAND_OVER_CASES[case]
    program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
    assert mosaic_eligibility.hand_over_early(dim, program) == early
    q, k, v = random_qkv(7, 1, 256, 384, 2, 2, dim, dim, jnp.bfloat16)
    out = pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                       backend=backend, kernel_options=MOSAIC)
    expected, _ = golden(q, k, v, masks.causal_mask, score_mod)
    assert_close_to_golden(out, expected, q, k, v, masks.causal_mask, score_mod)


def test_hand_over_is_early_with_score_mods_unless_transcendental_at_d128():
    program = lambda mod: make_mod_program(mod, SCORE)  # noqa: E731
    assert mosaic_eligibility.hand_over_early(128, None)
    assert mosaic_eligibility.hand_over_early(128, program(masks.alibi(4)))
    assert not mosaic_eligibility.hand_over_early(128, program(masks.tanh_softcap(30.0)))
    assert not mosaic_eligibility.hand_over_early(64, None)
    assert mosaic_eligibility.hand_over_early(64, program(masks.alibi(4)))
    assert mosaic_eligibility.hand_over_early(64, program(masks.tanh_softcap(30.0)))


def test_dead_index_code_in_a_mod_is_skipped():
    """A mod computing something from q_idx that it never uses: no index vector is built
    for it (Mosaic GPU fails layout inference on unused vectors) and the dead code is not
    evaluated."""
    def score_mod(score, b, h, q_idx, kv_idx):
        unused = q_idx * 3 + kv_idx  # noqa: F841
        return score * 0.5

    q, k, v = random_qkv(8, 1, 128, 128, 2, 2, 64, 64, jnp.bfloat16)
    out = pf.attention(q, k, v, score_mod=score_mod, backend="interpret", kernel_options=MOSAIC)
    expected, _ = golden(q, k, v, None, score_mod)
    assert_close_to_golden(out, expected, q, k, v, None, score_mod)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_ragged_keys_with_a_score_mod_that_reads_no_index(backend):
    """Padded keys are masked in the partial tail block although neither mod reads
    kv_idx (the kernel builds the key positions for the tail mask alone)."""
    q, k, v = random_qkv(9, 1, 256, 200, 2, 2, 128, 128, jnp.bfloat16)
    score_mod = masks.tanh_softcap(5.0)
    out = pf.attention(q, k, v, score_mod=score_mod, backend=backend, kernel_options=MOSAIC)
    expected, _ = golden(q, k, v, None, score_mod)
    assert_close_to_golden(out, expected, q, k, v, None, score_mod)


ITEM_CASES = {  # (batch, q_len, kv_len, Hq, Hkv, D, mask, score, sinks, with_max)
    "causal_ragged_gqa": (2, 300, 200, 4, 2, 64, "causal", None, False, False),
    "document_alibi_max": (1, 384, 384, 2, 1, 128, "document", "alibi", False, True),
    "empty_rows_sinks": (1, 256, 256, 3, 3, 64, "empty_rows", None, True, False),
}


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", ITEM_CASES)
def test_items_per_program_give_the_same_bits(case, backend):
    """A program walking several (head, query block, batch) items with one K/V pipeline
    (`forward_items_per_program`, persistent over them, its output staged in a buffer of
    its own) computes each item exactly as a program of one item does: outputs, lse and
    the row max bitwise equal, and equal to the reference. 5 items per program leave a
    shorter last program (2, the default, runs in every other test of this kernel); rows
    with nothing to attend to (a BlockMask row with no block) sit between items that
    have some."""
    batch, q_len, kv_len, q_heads, kv_heads, dim, mask_name, score_name, with_sinks, \
        with_max = ITEM_CASES[case]
    if backend == "interpret" and case == "causal_ragged_gqa":
        # 2 x 2 tiles instead of 3 x 2 (still ragged, Sq != Skv): 16 items, 5 a program
        # still leave a shorter last program (1).
        q_len, kv_len = 200, 130
    q, k, v = random_qkv(3, batch, q_len, kv_len, q_heads, kv_heads, dim, dim, jnp.bfloat16)
    ids = jnp.asarray(np.repeat(np.arange(4), [70, 100, 90, 124]).astype(np.int32))
    mask_mod = {"causal": masks.causal_mask,
                "document": lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx])
                & (q_idx >= kv_idx),
                "empty_rows": lambda b, h, q_idx, kv_idx: (q_idx < 128) & (kv_idx <= q_idx),
                }[mask_name]
    slopes = jnp.asarray([0.25, 0.5], jnp.float32)
    score_mod = None if score_name is None else (
        lambda s, b, h, q_idx, kv_idx: s - slopes[h] * (q_idx - kv_idx))
    sinks = jnp.linspace(-1.0, 1.0, q_heads).astype(jnp.float32) if with_sinks else None
    results = []
    for items in (1, 5):
        options = dict(MOSAIC, forward_items_per_program=items)
        out, aux = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks,
                                backend=backend, kernel_options=options,
                                return_aux=pf.AuxRequest(lse=True, max_scores=with_max))
        results.append([np.asarray(x.astype(jnp.float32)) for x in
                        (out, aux.lse) + ((aux.max_scores,) if with_max else ())])
    for other in results[1:]:
        for expected, got in zip(results[0], other):
            np.testing.assert_array_equal(got, expected)
    if not with_sinks:
        expected_out, _ = golden(q, k, v, mask_mod, score_mod)
        assert_close_to_golden(jnp.asarray(results[0][0]).astype(q.dtype), expected_out,
                               q, k, v, mask_mod, score_mod)


def test_items_per_program_by_head_dim_and_mask():
    """2 items per program, 8 at D 64 where every query block of a head walks the same
    blocks (a mask that reads no q_idx); there, at D 64 and 128 on a contiguous cache,
    as many as make one wave of programs on the device's SMs (132 off the GPU) where
    that is at most the query heads, else 8 (the heads at most) where keys are few (at
    most SHORT_KEYS); 1 at D 256; a number given in kernel_options is
    kept."""
    from pallas_flex.kernels.forward_mosaic import choose_items_per_program
    from pallas_flex.masks.mod_program import MASK

    lengths = jnp.asarray([100, 200], jnp.int32)
    ids = jnp.zeros((256,), jnp.int32)
    program = {
        "none": make_mod_program(masks.noop_mask, MASK),
        "key_padding": make_mod_program(lambda b, h, q_idx, kv_idx: kv_idx < lengths[b], MASK),
        "causal": make_mod_program(masks.causal_mask, MASK),
        "document": make_mod_program(lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx],
                                     MASK),
    }
    choose = choose_items_per_program
    items = 2048  # B8 H16 S2048: 16 a program (one query block's heads), 128 programs
    assert choose(0, 64, program["none"], items, 16) == 16
    assert choose(0, 64, program["key_padding"], items, 16) == 16
    assert choose(0, 128, program["none"], items, 16) == 16
    assert choose(0, 128, program["none"], 4096, 32) == 32  # GQA 32:8
    assert choose(0, 128, program["none"], 2113, 16) == 2  # 17 > 16 heads: default
    assert choose(0, 64, program["none"], 16384, 16) == 8
    assert choose(0, 128, program["none"], 100, 4) == 2  # never under the default
    assert choose(0, 64, program["none"], 100, 4) == 8
    assert choose(0, 64, program["none"], items, 16, paged=True) == 8
    assert choose(0, 128, program["none"], items, 16, paged=True) == 2
    assert choose(0, 64, program["causal"], items, 16) == 2
    assert choose(0, 64, program["document"], items, 16) == 2
    assert choose(0, 96, program["none"], items, 16) == 2
    assert choose(0, 256, program["none"], items, 16) == 1
    assert choose(3, 64, program["none"], items, 16) == 3
    # Evoformer rows R256 S256 H8 (4096 items, one wave would be 32 > 8 heads)
    assert choose(0, 128, program["none"], 4096, 8) == 2
    assert choose(0, 128, program["none"], 4096, 8, kv_len=256) == 8
    assert choose(0, 128, program["none"], 4096, 8, kv_len=512) == 8
    assert choose(0, 128, program["none"], 4096, 8, kv_len=513) == 2
    assert choose(0, 128, program["causal"], 4096, 8, kv_len=256) == 2
    assert choose(0, 128, program["none"], 4096, 8, kv_len=256, paged=True) == 2
    assert choose(0, 128, program["none"], items, 16, kv_len=256) == 16  # one wave
    assert choose(0, 96, program["none"], 4096, 8, kv_len=256) == 2
    assert choose(0, 128, program["none"], 2048, 4, kv_len=256) == 4  # the heads at most
    assert choose(0, 128, program["none"], 2048, 2, kv_len=256) == 2


# Paged prefill: (lengths, page_size, q_len, Hq, Hkv, D, dtype, mask, score). Page sizes
# below 128 fill a tile with one TMA copy per page; 128 and above copy 128 rows of one
# page. Logical lengths (max_pages * page_size) that are not whole blocks, an empty row.
PAGED_CASES = {
    "page16_gqa_alibi": ([300, 130], 16, 140, 4, 2, 64, jnp.bfloat16, "causal", "alibi"),
    "page8_empty_row": ([0, 90], 8, 40, 2, 2, 64, jnp.float16, "causal", None),
    "page32_softcap": ([200, 257], 32, 70, 2, 1, 128, jnp.bfloat16, None, "softcap"),
    "page128_sliding": ([260, 100], 128, 150, 2, 2, 128, jnp.float16, "sliding", None),
    "page256_causal": ([300, 511], 256, 129, 4, 1, 64, jnp.bfloat16, "causal", None),
}


# In interpret mode every case but page32_softcap: pages below 128 rows still run at 8 and
# 16, MQA at page 256, D 128 at page 128, a score_mod (ALiBi) at page 16; the soft-cap is
# the score-mod path the gallery checks. The GPU runs every case.
@pytest.mark.parametrize("case,backend", [
    (case, "interpret") for case in PAGED_CASES if case != "page32_softcap"] + [
    pytest.param(case, "pallas", marks=pytest.mark.gpu) for case in PAGED_CASES])
def test_paged_prefill(case, backend):
    """The whole paged_flex_attention, BlockMask clipping included, on the Mosaic kernel."""
    from tests.paged.test_flex_attention import check_paged_against_golden

    lengths, page_size, q_len, q_heads, kv_heads, dim, dtype, mask_name, score_name = \
        PAGED_CASES[case]
    # Three items per program: the K/V pipeline runs on across rows of the page table.
    check_paged_against_golden(lengths, page_size, q_len, q_heads, kv_heads, dim, dim, dtype,
                               mask_name, score_name, dict(MOSAIC, forward_items_per_program=3),
                               backend, window=40)


def test_paged_page_sizes_it_does_not_take_are_refused():
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    pages = jnp.zeros((8, 2, 48, 64), jnp.bfloat16)  # 48 rows: neither divides 128 nor a multiple
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 256, 384)
    reason = mosaic_eligibility.unsupported_reason(q, pages, pages, block_mask, None,
                                               interpret=True, paged=True)
    assert "page size 48" in reason


def _stale_cases():
    """On the GPU every page size x stale value; in interpret mode each page size (a TMA
    copy per page, 128 rows of one page) once, NaN at one and inf at the other."""
    for page_size in (16, 128):
        for stale in (np.nan, np.inf):
            case_id = f"{stale}-{page_size}"
            if (page_size == 16) == bool(np.isnan(stale)):
                yield pytest.param(page_size, stale, "interpret", id=f"{case_id}-interpret")
            yield pytest.param(page_size, stale, "pallas", marks=pytest.mark.gpu,
                               id=f"{case_id}-pallas")


@pytest.mark.parametrize("page_size,stale,backend", list(_stale_cases()))
def test_paged_prefill_never_reads_stale_slots_past_a_length(page_size, stale, backend):
    """Slots past a row's length (a reused page's old contents) hold NaN / inf: the output
    is the one of a clean cache, bit for bit."""
    from tests.paged.test_flex_attention import check_stale_slots_never_read

    # Lengths neither a whole number of 128-row tiles.
    check_stale_slots_never_read([200, 77], page_size=page_size, kv_len=256, q_len=64,
                                 q_heads=4, kv_heads=2, dim=64, stale=stale,
                                 kernel_options=MOSAIC, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [30.0, 2.0])
def test_soft_cap_on_the_approximate_tanh_keeps_16_bit_accuracy(cap):
    """The Mosaic forward runs tanh as tanh.approx.f32 (relative error about 2**-11):
    with queries scaled up so that many scores sit in tanh's saturated range, where its
    absolute error is largest, the output stays within the bf16 tolerance of the float64
    golden, and gradients through it (the Triton backward recomputes scores with an exact
    tanh against the forward's lse) agree with those through the Triton forward."""
    q, k, v = random_qkv(11, 2, 512, 512, 4, 2, 128, 128, jnp.bfloat16)
    q = q * 4
    score_mod = masks.tanh_softcap(cap)

    def attention(q, k, v, forward_kernel):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                            backend="pallas", kernel_options={"forward_kernel": forward_kernel})
    out = attention(q, k, v, "mosaic")
    expected, _ = golden(q, k, v, masks.causal_mask, score_mod)
    assert_close_to_golden(out, expected, q, k, v, masks.causal_mask, score_mod)
    d_out = jax.random.normal(jax.random.key(3), out.shape, jnp.float32)

    def gradients(forward_kernel):
        loss = lambda q, k, v: jnp.sum(attention(q, k, v, forward_kernel).astype(jnp.float32)
                                       * d_out)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for approximate, exact in zip(gradients("mosaic"), gradients("triton")):
        approximate, exact = approximate.astype(jnp.float32), exact.astype(jnp.float32)
        assert float(jnp.max(jnp.abs(approximate - exact))) <= 2e-2 * float(
            jnp.max(jnp.abs(exact)))


def test_score_bounds_are_found_for_mods_that_read_the_score_only():
    """Interval arithmetic on the mod's jaxpr: a soft-cap, a clip (a nested jit), a
    sigmoid are bounded; anything reading an index or a captured array, the exp2 form
    of tanh (a division by an interval the rules cannot bound) or an unbounded score
    is not, and those keep the running max."""
    def bounds(score_mod):
        return score_bounds(make_mod_program(score_mod, SCORE))
    assert bounds(masks.tanh_softcap(30.0)) == pytest.approx((-30.0, 30.0))
    assert bounds(lambda s, b, h, q, kv: jnp.clip(s, -5, 5) + 1.0) == pytest.approx((-4, 6))
    assert bounds(lambda s, b, h, q, kv: 2 * jax.nn.sigmoid(s) - 1) == pytest.approx((-1, 1))
    assert bounds(lambda s, b, h, q, kv: s) is None
    assert bounds(lambda s, b, h, q, kv: jnp.tanh(s) * s) is None
    assert bounds(lambda s, b, h, q, kv: jnp.tanh(s) + 0 * q) is None
    assert bounds(masks.tanh_softcap(jnp.float32(30.0))) is None  # a captured cap
    assert bounds(masks.tanh_softcap(30.0, approx=True)) is None
    soft_cap = make_mod_program(masks.tanh_softcap(30.0), SCORE)
    assert fixed_softmax_shift(soft_cap, jnp.bfloat16, with_max=False) == 0.0
    assert fixed_softmax_shift(soft_cap, jnp.float16, with_max=False) is None
    assert fixed_softmax_shift(soft_cap, jnp.bfloat16, with_max=True) is None
    wide = make_mod_program(masks.tanh_softcap(61.0), SCORE)
    assert fixed_softmax_shift(wide, jnp.bfloat16, with_max=False) is None


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_bounded_score_mod_with_a_fixed_shift_matches_the_running_max(backend):
    """A soft-cap's exponentials shifted by the centre of its range instead of the row
    max (`forward_mosaic.fixed_softmax_shift`): scores driven to both ends of the cap,
    rows that see no key (zeros, lse -inf), sinks and a ragged length give the float64
    golden's output within the bf16 tolerance, the lse to float32 accuracy, and the same
    result as the running max (the call with the row max asked for) within a bf16 ulp."""
    length = 130 if backend == "interpret" else 1000
    q, k, v = random_qkv(12, 1, length, length, 4, 2, 64, 64, jnp.bfloat16)
    q = q * 6  # scores far past the cap in both directions
    score_mod = masks.tanh_softcap(20.0)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 5) & (kv_idx <= q_idx)

    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            return_lse=True, kernel_options={"forward_kernel": "mosaic"})
    expected, expected_lse = golden(q, k, v, mask_mod, score_mod)
    assert_close_to_golden(out, expected, q, k, v, mask_mod, score_mod)
    assert np.all(np.asarray(out[:, :5], np.float32) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :5]))
    np.testing.assert_allclose(np.asarray(lse)[:, :, 5:], np.asarray(expected_lse)[:, :, 5:],
                               rtol=1e-5, atol=1e-4)
    # The row max asked for runs the running max: the two differ by bf16 rounding only.
    running, aux = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                backend=backend, return_aux=pf.AuxRequest(max_scores=True),
                                kernel_options={"forward_kernel": "mosaic"})
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(running, np.float32),
                               atol=2 ** -7 * float(np.max(np.abs(np.asarray(v, np.float32)))))
    sinks = jnp.asarray([0.0, 25.0, -3.0, 10.0], jnp.float32)
    with_sinks, sink_lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                        sinks=sinks, backend=backend, return_lse=True,
                                        kernel_options={"forward_kernel": "mosaic"})
    reference, reference_lse = pf.attention(
        *[x.astype(jnp.float32) for x in (q, k, v)], mask_mod=mask_mod, score_mod=score_mod,
        sinks=sinks, backend="reference", return_lse=True)
    np.testing.assert_allclose(np.asarray(with_sinks, np.float32), np.asarray(reference),
                               atol=2e-2 * float(np.max(np.abs(np.asarray(reference)))))
    np.testing.assert_allclose(np.asarray(sink_lse), np.asarray(reference_lse), rtol=1e-5,
                               atol=1e-4)


HEAD_DIM_CASES = [(32, "causal", jnp.bfloat16, "GQA4", 300, 300),
                  (32, "alibi_causal", jnp.float16, "MHA", 256, 130),
                  (80, "causal", jnp.bfloat16, "GQA4", 300, 300),
                  (80, "softcap_causal", jnp.float16, "MHA", 200, 256),
                  (96, "noop", jnp.float16, "MQA", 256, 130),
                  (96, "alibi_causal", jnp.bfloat16, "MHA", 256, 256),
                  (96, "document", jnp.bfloat16, "GQA4", 300, 300),
                  (192, "causal", jnp.bfloat16, "MHA", 256, 200),
                  (192, "softcap_causal", jnp.bfloat16, "GQA4", 130, 384),
                  (256, "causal", jnp.float16, "MHA", 256, 200),
                  (256, "softcap_causal", jnp.bfloat16, "GQA4", 130, 384)]


# The interpreter does not model shared-memory layouts (what these head dims change):
# one case a head dim on the CPU, every case on the GPU. D 32's and 80's (cases 0 and 2,
# at 200 x 200) run in tests/kernels/test_backward_mosaic.py's
# test_head_dims_32_80_and_96, whose jax.vjp's forward output and lse are checked
# against the float64 golden as here (one batch row; batch 2 runs at D 96, 192 and 256
# here).
@pytest.mark.parametrize("backend,dim,variant,dtype,layout,q_len,kv_len", [
    ("interpret",) + HEAD_DIM_CASES[index] for index in (6, 8, 10)
] + [pytest.param("pallas", *case, marks=pytest.mark.gpu) for case in HEAD_DIM_CASES])
def test_head_dims_32_80_96_192_256(dim, variant, dtype, layout, q_len, kv_len, backend):
    """Head dims whose rows are not a whole 128-byte swizzle (80: 32-byte, 32 and 96:
    64-byte swizzles, `forward_mosaic.tile_transforms`), 192 and 256 (64-key K/V tiles,
    `forward_mosaic._PARTS_PER_BLOCK`; 256 one item a program): the gallery's check against the float64 golden;
    the backward of 32 (when named), 80 and 96 is the Mosaic one too
    (tests/kernels/test_backward_mosaic.py), of 192 and 256 the Triton one."""
    _check(variant, dtype, layout, *interpret_lengths(q_len, kv_len, backend), dim, backend)


def test_head_dims_the_mosaic_backward_and_paged_forward_keep():
    q, k, v = random_qkv(0, 1, 256, 256, 2, 2, 192, 192, jnp.bfloat16)
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 256, 256)
    options = resolve_options({"forward_kernel": "mosaic", "backward_kernel": "auto"}, 192)
    assert dispatch.choose_forward(q, k, v, block_mask, None, backend="interpret",
                                   options=options).kernel == "mosaic_forward"
    assert mosaic_eligibility.backward_unsupported_reason(None, 192) == (
        "head dim 192 (the Mosaic backward takes D in (32, 64, 80, 96, 128))")
    for dim in (32, 64, 80, 96, 128):
        assert mosaic_eligibility.backward_unsupported_reason(None, dim) is None
    with pytest.raises(ValueError, match="head dim 192"):
        dispatch.choose_backward(q, k, v, block_mask, None, backend="interpret",
                                 options=resolve_options({"backward_kernel": "mosaic"}, 192))
    pages = jnp.zeros((4, 2, 64, 96), jnp.bfloat16)
    assert "on pages" in mosaic_eligibility.unsupported_reason(
        q[..., :96], pages, pages, block_mask, None, interpret=True, paged=True)


def test_relative_reads_are_found_where_indices_depend_on_kv_minus_q_only():
    """`relative_reads` takes reads whose indices depend on q_idx and kv_idx through
    kv_idx - q_idx alone (through linear arithmetic, then anything), not others."""
    table = jnp.zeros((2, 64))

    def found(score_mod):
        return [read.kind for read in relative_reads.relative_reads(
            make_mod_program(score_mod, SCORE)).values()]

    assert found(masks.t5_relative_bias(jnp.zeros((2, 32)))) == ["relative"]
    assert found(lambda s, b, h, q, kv: s + table[h, jnp.clip(q - kv, -31, 32) + 31]) == [
        "relative"]
    assert found(lambda s, b, h, q, kv: s + table[h, jnp.clip(2 * kv - 2 * q + 5, 0, 63)]) == [
        "relative"]
    assert found(lambda s, b, h, q, kv: s + table[b, jnp.abs((kv + 3) - (q + 3))]) == [
        "relative"]
    assert found(lambda s, b, h, q, kv: s + table[h, jnp.clip(kv + q, 0, 63)]) == []
    assert found(lambda s, b, h, q, kv: s + table[h, jnp.clip(2 * kv - q, 0, 63)]) == []
    assert found(lambda s, b, h, q, kv: s + table[h, kv]) == []  # a contiguous read
    assert found(lambda s, b, h, q, kv: s + table[h, (s > 0).astype(jnp.int32)]) == []


def test_relative_tables_hold_the_read_per_diagonal():
    """Each block diagonal's runs rebuild the read's value on all its 255 diagonals."""
    table = jnp.asarray(np.random.default_rng(1).standard_normal((3, 32)), jnp.float32)
    for bidirectional in (False, True):
        program = make_mod_program(
            masks.t5_relative_bias(table, bidirectional=bidirectional), SCORE)
        reads = relative_reads.relative_reads(program)
        counts, starts, values = relative_reads.relative_tables(program, reads, 2, 3, 384,
                                                                256)
        assert counts.shape == (1, 3, 5) and starts.shape == values.shape == (1, 3, 5, 255)
        for head in range(3):
            for diagonal in range(-2, 3):
                differences = np.arange(diagonal * 128 - 127, diagonal * 128 + 128)
                expected = np.asarray(table[head, masks.t5_relative_bucket(
                    jnp.asarray(differences), bidirectional=bidirectional)])
                runs = int(counts[0, head, diagonal + 2])
                rebuilt = np.full(255, np.nan, np.float32)
                for run in range(runs):
                    rebuilt[differences >= int(starts[0, head, diagonal + 2, run])] = float(
                        values[0, head, diagonal + 2, run])
                np.testing.assert_array_equal(rebuilt, expected)
                assert runs == len(np.unique(expected)) or bidirectional


RELATIVE_CASES = {  # (mask, score, dtype, layout, q_len, kv_len, dim)
    "t5_one_way_ragged": ("none", "t5_one_way", jnp.bfloat16, "GQA4", 300, 200, 64),
    "clipped_table_per_batch": ("sliding_bidirectional", "clipped_bf16", jnp.float16, "MHA",
                                256, 384, 128),
}


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", RELATIVE_CASES)
def test_reads_at_relative_positions(case, backend):
    """Mods reading a table at indices of kv_idx - q_idx run on the kernel (no gather):
    a one-way T5 bias with no mask and ragged lengths (diagonals past the keys' end), and
    a bf16 table per batch row and head read at a clipped relative position."""
    mask_name, score_name, dtype, layout, q_len, kv_len, dim = RELATIVE_CASES[case]
    q_heads, kv_heads = heads_of(layout, backend)
    # The T5 table is per head: one batch row in interpret mode (the clipped table, read
    # at b, runs two; the GPU runs two in both).
    batch = 1 if backend == "interpret" and score_name == "t5_one_way" else 2
    q, k, v = random_qkv(7, batch, q_len, kv_len, q_heads, kv_heads, dim, dim, dtype)
    rng = np.random.default_rng(2)
    t5_table = jnp.asarray(rng.standard_normal((q_heads, 32)), jnp.float32)
    clipped = jnp.asarray(rng.standard_normal((batch, q_heads, 41)), jnp.bfloat16)
    score_mod = {
        "t5_one_way": masks.t5_relative_bias(t5_table, bidirectional=False),
        "clipped_bf16": lambda s, b, h, q_idx, kv_idx: s + clipped[
            b, h, jnp.clip(kv_idx - q_idx, -20, 20) + 20],
    }[score_name]
    mask_mod = {"none": None, "sliding_bidirectional": lambda b, h, q_idx, kv_idx:
                jnp.abs(q_idx - kv_idx) < 150}[mask_name]
    program = make_mod_program(score_mod, SCORE)
    assert list(relative_reads.relative_reads(program).values())
    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            return_lse=True, kernel_options=MOSAIC)
    expected_out, expected_lse = golden(q, k, v, mask_mod, score_mod)
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod, score_mod)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, atol=2e-2, rtol=2e-2)


def test_dense_block_diagonals_come_from_their_tiles(monkeypatch):
    """A two-way T5 bias's block diagonals near the main one
    (`relative_reads.diagonal_blocks`: -1, 0 and 1) are read from their tiles in global
    memory (`mosaic_tiles.diagonal_loads`), the others take one value per side
    (`test_reads_at_relative_positions` checks both against the golden): the runs alone
    (DENSE_DIAGONALS off) give the same lse within float32 rounding; tiles raised by 1
    raise the lse of every row (each has keys on those diagonals); sides raised by 1 only
    the first query block's, whose last key block lies on block diagonal 2."""
    from pallas_flex.kernels import forward_mosaic
    q, k, v = random_qkv(9, 1, 256, 384, 2, 2, 64, 64, jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(4).standard_normal((2, 32)), jnp.float32)
    score_mod = masks.t5_relative_bias(table, bidirectional=True)

    def lse_of():
        jax.clear_caches()
        _, lse = pf.attention(q, k, v, score_mod=score_mod, backend="interpret",
                              return_lse=True, kernel_options=MOSAIC)
        return np.asarray(lse)
    dense = lse_of()
    monkeypatch.setattr(forward_mosaic, "DENSE_DIAGONALS", False)
    np.testing.assert_allclose(lse_of(), dense, rtol=1e-5, atol=0)
    monkeypatch.setattr(forward_mosaic, "DENSE_DIAGONALS", True)
    found = forward_mosaic.diagonal_blocks
    for field in ("tiles", "sides"):
        monkeypatch.setattr(forward_mosaic, "diagonal_blocks", lambda *args: {
            number: blocks._replace(**{field: getattr(blocks, field) + 1.0})
            for number, blocks in found(*args).items()})
        raised = lse_of()
        if field == "tiles":
            assert np.all(raised > dense + 0.05)
        else:
            assert np.all(raised[..., :128] > dense[..., :128] + 0.01)
            np.testing.assert_array_equal(raised[..., 128:], dense[..., 128:])


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_soft_cap_at_head_dim_64_with_exp2_on_the_fma_units(dtype, backend):
    """At head dim 64 a soft-cap's exponentials run 5 of 8 registers on the FMA units
    (`fma_exp2`; interpret mode runs the polynomial on every score): float16 takes the
    running max, bfloat16 the fixed shift. Rows that see no key are zeros with lse -inf, a
    ragged length masks the key tail; the output is within the 16-bit tolerance of the
    float64 golden and the lse within 2e-4 of it. On the GPU the kernel with every
    exponential on the transcendental unit gives the same output within a 16-bit ulp."""
    length = 130 if backend == "interpret" else 1000
    q, k, v = random_qkv(13, 2, length, length, 4, 2, 64, 64, dtype)
    q = q * 3
    score_mod = masks.tanh_softcap(30.0)
    program = make_mod_program(score_mod, SCORE)
    assert mosaic_eligibility.exp2_fma_share(64, program) is not None

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 3) & (kv_idx <= q_idx)

    def run():
        return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            return_lse=True, kernel_options=MOSAIC)
    out, lse = run()
    expected, expected_lse = golden(q, k, v, mask_mod, score_mod)
    assert_close_to_golden(out, expected, q, k, v, mask_mod, score_mod)
    assert np.all(np.asarray(out[:, :3], np.float32) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :3]))
    np.testing.assert_allclose(np.asarray(lse)[:, :, 3:], np.asarray(expected_lse)[:, :, 3:],
                               rtol=1e-5, atol=2e-4)
    if backend == "pallas":
        from pallas_flex.kernels import forward_mosaic
        original = forward_mosaic.exp2_fma_share
        try:
            forward_mosaic.exp2_fma_share = lambda head_dim, score_program: None
            jax.clear_caches()
            transcendental, _ = run()
        finally:
            forward_mosaic.exp2_fma_share = original
            jax.clear_caches()
        ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -10
        np.testing.assert_allclose(np.asarray(out, np.float32),
                                   np.asarray(transcendental, np.float32),
                                   atol=ulp * float(np.max(np.abs(np.asarray(v, np.float32)))))


@pytest.mark.parametrize("with_max", [False, True])
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_row_sums_of_captured_reads_derivatives(backend, with_max):
    """`row_sums_of`: per captured array the mod reads once, each row's sum over its keys
    of P g (P the softmax's probabilities, sinks included; g the score's derivative with
    respect to the value read), which the fused backward takes a captured array's
    gradient from: a temperature (g = the scaled score), ALiBi slopes (g = -|q - kv|, a
    query-only part and a varying one) and a bias shared by head pairs (g = 1: P's own
    mass, 1 less the sink's weight), against float64 on GQA with a ragged length and
    rows that see no key (0 there); after the row max where that is asked for too."""
    from pallas_flex.kernels.forward_mosaic import flex_attention_forward_mosaic

    length, heads, dim = 200, 4, 64
    q, k, v = random_qkv(11, 1, length, length, heads, 2, dim, dim, jnp.bfloat16)
    temperature = jnp.float32(0.9)
    slopes = jnp.asarray(masks.alibi_slopes(heads))
    pair_bias = jnp.asarray([0.3, -0.7], jnp.float32)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s * temperature - slopes[h] * jnp.abs(q_idx - kv_idx) + pair_bias[h // 2]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 8) & (kv_idx <= q_idx)

    block_mask = pf.create_block_mask(mask_mod, None, None, length, length)
    program = make_mod_program(score_mod, SCORE)
    out, lse, *rows = flex_attention_forward_mosaic(
        q, k, v, block_mask, program, scale=1 / 8, interpret=backend == "interpret",
        sinks=sinks, items_per_program=2, row_sums_of=(0, 1, 2), with_max=with_max)
    assert len(rows) == 3 + with_max
    sums = rows[with_max:]

    # float64: P over the keys with the sink in the denominator.
    qf, kf = (np.asarray(x, np.float64) for x in (q, k))
    kf = np.repeat(kf, 2, axis=2)
    raw = np.einsum("bqhd,bkhd->bhqk", qf, kf) / 8
    distance = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
    scores = (raw * 0.9 - np.asarray(slopes, np.float64)[None, :, None, None] * distance
              + np.asarray(pair_bias, np.float64)[np.arange(heads) // 2][None, :, None, None])
    keep = (np.arange(length)[:, None] >= 8) & (np.arange(length)[None, :]
                                                <= np.arange(length)[:, None])
    scores = np.where(keep, scores, -np.inf)
    row_max = np.maximum(scores.max(axis=-1, keepdims=True),
                         np.asarray(sinks, np.float64)[None, :, None, None])
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True) + np.exp(
        np.asarray(sinks, np.float64)[None, :, None, None] - row_max)
    probabilities = weights / total
    if with_max:  # the row max of the logits, as the call without row sums gives it
        got_max = np.asarray(rows[0])[:, :, 8:]
        np.testing.assert_allclose(got_max, scores.max(axis=-1)[:, :, 8:], rtol=1e-2,
                                   atol=1e-2)
    for got, derivative in zip(sums, (raw, -1.0 * distance, np.ones_like(raw))):
        want = np.sum(probabilities * np.broadcast_to(derivative, probabilities.shape), axis=-1)
        got = np.asarray(got)
        assert np.all(got[:, :, :8] == 0.0)  # rows without keys
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.max(np.abs(want)))
