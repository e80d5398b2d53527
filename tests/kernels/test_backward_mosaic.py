"""The Mosaic GPU backward kernels (`kernels/backward_mosaic.py`).

On CPU they run in Mosaic GPU's interpret mode (`backward_kernel="mosaic"` with
backend="interpret": the matmuls are plain dots, everything else is the kernels' own
code); on the GPU (marker `gpu`) the same cases run the compiled kernels. Gradients are
compared with autodiff of the float64 dense reference, by the rule of
tests/test_backward.py (RMSE no worse than the dense 16-bit XLA computation's).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import dispatch, masks
from pallas_flex.api import attention_backward
from pallas_flex.kernels import relative_reads
from pallas_flex.kernels.config import resolve_options
from pallas_flex.masks.mod_program import SCORE, make_mod_program
from tests.conftest import dense_low_precision, random_qkv
from tests.kernels.test_forward_mosaic import (HEAD_DIM_CASES, SHAPES, SLICED, SUPPORTED,
                                              _check_forward, _mods, bias_block_call,
                                              heads_of, layout_id)
from tests.test_backward import _assert_gradient_close, _cotangent, _golden_gradients

MOSAIC = {"forward_kernel": "mosaic", "backward_kernel": "mosaic"}


@pytest.fixture
def fused_launches(monkeypatch):
    """A list that gets an entry each time the dK/dV kernel computing dQ too launches."""
    from pallas_flex.kernels import backward_mosaic
    launches, launch = [], backward_mosaic._launch_fused
    monkeypatch.setattr(backward_mosaic, "_launch_fused",
                        lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs))
    return launches


def _check_gradients(variant, dtype, layout, q_len, kv_len, dim, backend, seed=5, batch=2,
                     options=None, check_forward=False):
    """The Mosaic backward's dq, dk, dv against the float64 golden gradients; with
    check_forward, also the Mosaic forward's output and lse (the primal outputs of the
    same jax.vjp, the lse an aux output: no cotangent) against the float64 golden, as
    tests/kernels/test_forward_mosaic.py's `_check` does."""
    q_heads, kv_heads = heads_of(layout, backend)
    q, k, v = random_qkv(seed, batch, q_len, kv_len, q_heads, kv_heads, dim, dim, dtype)
    mask_mod, score_mod = _mods(variant, batch, q_heads, q_len, kv_len)
    d_out = _cotangent((batch, q_len, q_heads, dim), seed + 1).astype(dtype)

    def ours(q, k, v):
        return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            return_lse=True, kernel_options={**MOSAIC, **(options or {})})

    out, pullback, lse = jax.vjp(ours, q, k, v, has_aux=True)
    if check_forward:
        _check_forward(out, lse, q, k, v, mask_mod, score_mod)
    grads = pullback(d_out)
    expected = _golden_gradients(q, k, v, d_out, mask_mod or masks.noop_mask, score_mod)
    _, dense_vjp = jax.vjp(lambda q, k, v: dense_low_precision(q, k, v, mask_mod, score_mod),
                           q, k, v)
    for name, grad, golden_grad, baseline, primal in zip(
            "qkv", grads, expected, dense_vjp(d_out), (q, k, v)):
        assert grad.shape == primal.shape and grad.dtype == primal.dtype
        _assert_gradient_close(grad, golden_grad, baseline, name=f"d{name}")
    return grads


# In interpret mode the gallery's 300-row and 384-key lengths run at 200 and 256: two
# tiles where there were three (ragged 200 still has a partial tail, 256 is still whole
# tiles, Sq != Skv where it was), as the interpreter's time grows with the tiles; the GPU
# keeps SHAPES' lengths.
INTERPRET_LENGTHS = {300: 200, 384: 256}


def _cases(variants, shape_offset=0, backend="pallas"):
    for index, variant in enumerate(variants):
        dtype, layout, q_len, kv_len, dim = SHAPES[(index + shape_offset) % len(SHAPES)]
        if backend == "interpret":
            q_len, kv_len = (INTERPRET_LENGTHS.get(n, n) for n in (q_len, kv_len))
        yield pytest.param(variant, dtype, layout, q_len, kv_len, dim,
                           id=f"{variant}-{jnp.dtype(dtype).name}-{layout_id(layout, backend)}"
                              f"-{q_len}x{kv_len}-d{dim}")


# The gallery's variants whose mods read the batch index.
READS_B = {"prefix_lm_per_batch"}


@pytest.mark.parametrize("variant,dtype,layout,q_len,kv_len,dim",
                         list(_cases(SUPPORTED, backend="interpret"))
                         + list(_cases(SLICED, 1, backend="interpret")))
def test_gallery_in_interpret_mode(variant, dtype, layout, q_len, kv_len, dim,
                                   fused_launches):
    """The Mosaic forward's output and lse and the Mosaic backward's gradients against
    the float64 golden (the forward gallery's interpret cases: every variant of
    SUPPORTED at its dtype, layout and head dim, as tests/kernels/test_forward_mosaic.py
    names them). One batch row unless the variant reads b: the interpreter runs the
    programs one after another, and the kernels' batch offsets are the same code for
    every mod (batch 2 runs in prefix_lm_per_batch here, in the T5 and captured-array
    tests, in the forward's slice-read, head-dim, paged, items-per-program, vmap and
    soft-cap tests, and on the GPU)."""
    batch = 2 if variant in READS_B else 1
    _check_gradients(variant, dtype, layout, q_len, kv_len, dim, "interpret", batch=batch,
                     check_forward=True)
    # dQ fused into the dK/dV kernel at D 64 (no captured-array gradient here, not
    # deterministic), two kernels otherwise (test_fused_dq_rule).
    assert bool(fused_launches) == (dim == 64)


@pytest.mark.gpu
@pytest.mark.parametrize("variant,dtype,layout,q_len,kv_len,dim",
                         list(_cases(SUPPORTED)) + list(_cases(SLICED, 1)))
def test_gallery_on_gpu(variant, dtype, layout, q_len, kv_len, dim):
    _check_gradients(variant, dtype, layout, 4 * q_len, 4 * kv_len, dim, "pallas")


# Head dims 32, 80 and 96 (tiles swizzled by 64, 32 and 64 bytes,
# `forward_mosaic.tile_transforms`; stages by head dim): the interpreter does not model
# the shared-memory layouts they change, so one case each on the CPU and every case on
# the GPU.
BACKWARD_HEAD_DIM_CASES = [c for c in HEAD_DIM_CASES if c[0] in (32, 80, 96)]


# In interpret mode the 300 x 300 case runs at 200 x 200: 2 x 2 tiles with partial tails
# instead of 3 x 3 (the interpreter's time grows with the tiles).
@pytest.mark.parametrize("backend,dim,variant,dtype,layout,q_len,kv_len", [
    ("interpret",) + tuple(200 if x == 300 else x for x in BACKWARD_HEAD_DIM_CASES[index])
    for index in (0, 2, 5)
] + [pytest.param("pallas", *case, marks=pytest.mark.gpu) for case in BACKWARD_HEAD_DIM_CASES])
def test_head_dims_32_80_and_96(dim, variant, dtype, layout, q_len, kv_len, backend):
    """The Mosaic backward at D 32, 80 and 96 against the float64 golden gradients, and
    the Mosaic forward's output and lse from the same jax.vjp against the float64 golden
    (in interpret mode the D 32 and 80 cases are the forward's own,
    tests/kernels/test_forward_mosaic.py). One batch row in interpret mode, as in the
    gallery (no mod here reads b; the kernels' batch offsets are the same code at every
    head dim); two on the GPU."""
    _check_gradients(variant, dtype, layout, q_len, kv_len, dim, backend,
                     batch=1 if backend == "interpret" else 2, check_forward=True)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_fully_masked_rows_have_zero_gradients(backend):
    """Rows 0-127 see nothing (their BlockMask row lists no block); in the second block
    even rows see nothing, odd rows only key 0. No NaN anywhere; the empty rows' dq is 0,
    and keys no row attends to get dk = dv = 0."""
    q, k, v = random_qkv(1, 1, 256, 256, 2, 2, 64, 64, jnp.bfloat16)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 128) & (q_idx % 2 == 1) & (kv_idx == 0)

    def loss(q, k, v):
        return jnp.sum(pf.attention(q, k, v, mask_mod=mask_mod, backend=backend,
                                    kernel_options=MOSAIC).astype(jnp.float32))

    d_q, d_k, d_v = (np.asarray(g.astype(jnp.float32))
                     for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    assert np.isfinite(d_q).all() and np.isfinite(d_k).all() and np.isfinite(d_v).all()
    assert np.all(d_q == 0.0)  # one key per row: the output is v[0], whatever q is
    assert np.all(d_k[:, 1:] == 0.0) and np.all(d_v[:, 1:] == 0.0)
    np.testing.assert_allclose(d_v[:, 0], 64.0)  # 64 rows, each with weight 1 on key 0


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_lse_gradient_and_explicit_scale(backend):
    """A loss on the lse too (delta gets dlse folded in), with a scale of its own."""
    # Interpret mode: two query heads on one KV head (GQA still), half the programs.
    q_heads, kv_heads = (2, 1) if backend == "interpret" else (4, 2)
    q, k, v = random_qkv(2, 1, 200, 256, q_heads, kv_heads, 128, 128, jnp.float16)

    def loss(q, k, v, backend, options):
        out, lse = pf.attention(q, k, v, mask_mod=masks.causal_mask, scale=0.3,
                                return_lse=True, backend=backend, kernel_options=options)
        return jnp.sum(out.astype(jnp.float32) * jnp.sin(jnp.arange(128.0))) + jnp.sum(
            jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.1)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, backend, MOSAIC)
    expected = jax.grad(loss, argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)), "reference", None)
    for got, want in zip(grads, expected):
        got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want)
        assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_vmap_of_grad(backend):
    """Under jax.vmap the kernels run once per element (their own batching rule)."""
    q, k, v = random_qkv(4, 1, 130, 256, 2, 1, 64, 64, jnp.bfloat16)
    stacked = [jnp.stack([x, (0.5 * x).astype(x.dtype)]) for x in (q, k, v)]

    def loss(q, k, v, backend, options):
        return jnp.sum(pf.attention(q, k, v, mask_mod=masks.causal_mask,
                                    score_mod=masks.alibi(2), backend=backend,
                                    kernel_options=options).astype(jnp.float32)
                       * jnp.cos(jnp.arange(64.0)))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    grads = jax.vmap(grad, in_axes=(0, 0, 0, None, None))(*stacked, backend, MOSAIC)
    expected = jax.vmap(grad, in_axes=(0, 0, 0, None, None))(
        *[x.astype(jnp.float32) for x in stacked], "reference", None)
    for got, want in zip(grads, expected):
        got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want)
        assert np.max(np.abs(got - want)) <= 3e-2 * np.max(np.abs(want))


def _choice(score_mod=None, wanted=None, dtype=jnp.bfloat16, dim=64, backend="pallas",
            **options):
    q, k, v = random_qkv(0, 1, 256, 256, 2, 2, dim, dim, dtype)
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, 256, 256)
    program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
    return dispatch.choose_backward(q, k, v, block_mask, program, backend=backend,
                                    options=resolve_options(options or None, dim),
                                    wanted_const_grads=wanted)


def test_the_dispatcher_sends_per_element_captured_reads_to_the_triton_backward():
    """Arrays read once at indices of b and h (learnable ALiBi slopes) or of kv_idx - q_idx
    into at most 64 entries a head (a T5 table) train on the Mosaic backward; a larger
    relative table, a read at q_idx alone or an array read twice on the Triton one, with
    the reason, and naming the Mosaic backward for them is a ValueError."""
    slopes = jnp.asarray([0.5, 0.25])
    assert _choice(masks.alibi(slopes), wanted=(True,), backend="interpret",
                   backward_kernel="mosaic").kernel == "mosaic_backward"
    table = jnp.ones((2, 32))
    assert _choice(masks.t5_relative_bias(table), wanted=(True,), backend="interpret",
                   backward_kernel="mosaic").kernel == "mosaic_backward"
    wide = jnp.ones((2, 201))
    with pytest.raises(ValueError, match="201 entries of kv_idx - q_idx"):
        _choice(lambda s, b, h, q, kv: s + wide[h, jnp.clip(kv - q, -100, 100) + 100],
                wanted=(True,), backend="interpret", backward_kernel="mosaic")
    per_query = jnp.ones((2, 256))
    choice = _choice(lambda s, b, h, q, kv: s + per_query[h, q] * per_query[h, kv],
                     wanted=(True,), backend="interpret", backward_kernel="auto",
                     forward_kernel="mosaic")
    assert choice.kernel == "triton_backward"
    with pytest.raises(ValueError, match="read 2 times"):
        _choice(lambda s, b, h, q, kv: s + slopes[h] * slopes[h], wanted=(True,),
                backend="interpret", backward_kernel="mosaic")


# Bias tensors read at (q_idx, kv_idx) (`bias_lookup`, [B, H, Sq, Skv], B and H shared
# or not): the dQ kernel copies [128, 128] blocks beside its K/V stages, the dK/dV kernel
# [128 keys, 64 queries] blocks of the transposed array beside its query tiles. D 64
# runs the fused dK/dV kernel (the two kernels where the bias trains), D 80, 96 and 128
# the two kernels (D 128's dQ kernel on 64-key tiles, its float32 bias fixed only: a
# trained one does not fit); ragged lengths and Sq != Skv read the edge padding, which
# no kept score uses. The bias's gradient: each dK/dV tile's dS' reduce-added into it (in interpret
# mode summed per (batch, head)), shared rows and heads summed there.
# Fixed biases where that takes another path (D 64's fused kernel; D 128's float32 bias,
# which does not fit trained), trained ones where the two kernels run either way.
_BIAS_BLOCK_CASES = [
    (jnp.bfloat16, "GQA4", 200, 300, 64, (2, 4), jnp.bfloat16, True, False),
    (jnp.bfloat16, "GQA4", 200, 300, 64, (2, 4), jnp.bfloat16, True, True),
    (jnp.bfloat16, "MHA", 128, 192, 96, (1, 4), jnp.bfloat16, False, True),
    (jnp.float16, "GQA4", 256, 130, 80, (1, 1), jnp.float16, True, True),
    (jnp.bfloat16, "MHA", 200, 256, 128, (2, 1), jnp.float32, False, False),
    (jnp.bfloat16, "MHA", 200, 256, 128, (2, 1), jnp.float32, False, True)]


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "dtype,layout,q_len,kv_len,dim,bias_shape,bias_dtype,causal,train_bias",
    [pytest.param(*case, id=f"d{case[4]}-{jnp.dtype(case[6]).name}-bias{case[5][0]}x"
                            f"{case[5][1]}-{'causal' if case[7] else 'noop'}-"
                            f"{'trained' if case[8] else 'fixed'}")
     for case in _BIAS_BLOCK_CASES])
def test_bias_tensor_blocks_in_the_backward(backend, dtype, layout, q_len, kv_len, dim,
                                            bias_shape, bias_dtype, causal, train_bias,
                                            fused_launches):
    q, k, v, bias = bias_block_call(backend, dtype, layout, q_len, kv_len, dim, bias_shape,
                                    bias_dtype)
    mask_mod = masks.causal_mask if causal else None
    choice = pf.explain(q, k, v, mask_mod=mask_mod, score_mod=masks.bias_lookup(bias),
                        backend=backend, kernel_options=MOSAIC)
    assert "backward: mosaic_backward" in choice, choice
    d_out = _cotangent(q.shape, 9).astype(dtype)

    def ours(q, k, v, bias):
        return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=masks.bias_lookup(bias),
                            backend=backend, kernel_options=MOSAIC)
    if train_bias and dim == 128:
        with pytest.raises(ValueError, match="do not fit"):
            pf.explain(q, k, v, mask_mod=mask_mod, score_mod=masks.bias_lookup(bias),
                       backend=backend, kernel_options=MOSAIC)  # (untrained: it fits)
            jax.grad(lambda bias: ours(q, k, v, bias).astype(jnp.float32).sum())(bias)
        return
    argnums = (0, 1, 2, 3) if train_bias else (0, 1, 2)
    grads = jax.vjp(lambda *args: ours(*args, *[bias][len(args) - 3:]),
                    *(q, k, v, bias)[:len(argnums)])[1](d_out)
    assert len(fused_launches) == (dim == 64 and not train_bias)
    expected = _golden_gradients(q, k, v, d_out, lambda bias: mask_mod or masks.noop_mask,
                                 masks.bias_lookup, argnums=argnums, extra=(bias,))
    _, dense_vjp = jax.vjp(
        lambda *args: dense_low_precision(*args[:3], mask_mod, masks.bias_lookup(
            args[3] if train_bias else bias)), *(q, k, v, bias)[:len(argnums)])
    for name, grad, golden_grad, baseline in zip(("dq", "dk", "dv", "dbias"), grads,
                                                 expected, dense_vjp(d_out)):
        _assert_gradient_close(grad, golden_grad, baseline, name=name)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_trained_slopes_beside_a_key_bias(backend):
    """Learnable ALiBi slopes beside a fixed key bias `kb[b, kv_idx]`: the slopes'
    derivative program reads the key bias through clamped indices
    (`with_read_derivatives`), exact up to the array's end (`tile_mods.ExactIndices`),
    so it stays a slice read and the call trains on the Mosaic backward."""
    q, k, v = random_qkv(3, 2, 200, 200, 2, 2, 64, 64, jnp.bfloat16)
    key_bias = jax.random.normal(jax.random.key(5), (2, 200))
    slopes = jnp.asarray([0.1, 0.05], jnp.float32)
    d_out = _cotangent(q.shape, 9).astype(jnp.bfloat16)

    def score_mod(slopes):
        return lambda s, b, h, i, j: s + key_bias[b, j] - slopes[h] * jnp.abs(i - j)
    program = make_mod_program(score_mod(slopes), SCORE)
    wanted = tuple(const is slopes for const in program.consts)  # (the slopes only)
    assert sum(wanted) == 1 and _choice(score_mod(slopes), wanted=wanted,
                                        backend="interpret",
                                        backward_kernel="mosaic").kernel == "mosaic_backward"

    def ours(q, k, v, slopes):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod(slopes),
                            backend=backend, kernel_options=MOSAIC)
    grads = jax.vjp(ours, q, k, v, slopes)[1](d_out)
    expected = _golden_gradients(q, k, v, d_out, lambda *_: masks.causal_mask, score_mod,
                                 argnums=(0, 1, 2, 3), extra=(slopes,))
    _, dense_vjp = jax.vjp(lambda q, k, v, slopes: dense_low_precision(
        q, k, v, masks.causal_mask, score_mod(slopes)), q, k, v, slopes)
    for name, grad, golden_grad, baseline in zip(("dq", "dk", "dv", "dslopes"), grads,
                                                 expected, dense_vjp(d_out)):
        _assert_gradient_close(grad, golden_grad, baseline, name=name)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_a_trained_bias_beside_trained_slopes(backend):
    """A bias tensor read as blocks and ALiBi slopes read at h, both trained: the slopes'
    gradient from the forward's row sums and the dQ kernel (D 64: the two kernels, the
    bias's tiles reduce-added by the dK/dV kernel), against float64."""
    q, k, v = random_qkv(3, 2, 200, 200, 2, 2, 64, 64, jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(7), (1, 2, 200, 200)).astype(jnp.bfloat16)
    slopes = jnp.asarray([0.1, 0.05], jnp.float32)
    d_out = _cotangent(q.shape, 9).astype(jnp.bfloat16)

    def score_mod(bias, slopes):
        return lambda s, b, h, i, j: s + bias[0, h, i, j] - slopes[h] * jnp.abs(i - j)

    def ours(q, k, v, bias, slopes):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask,
                            score_mod=score_mod(bias, slopes), backend=backend,
                            kernel_options=MOSAIC)
    grads = jax.vjp(ours, q, k, v, bias, slopes)[1](d_out)
    expected = _golden_gradients(q, k, v, d_out, lambda *_: masks.causal_mask, score_mod,
                                 argnums=(0, 1, 2, 3, 4), extra=(bias, slopes))
    _, dense_vjp = jax.vjp(lambda q, k, v, bias, slopes: dense_low_precision(
        q, k, v, masks.causal_mask, score_mod(bias, slopes)), q, k, v, bias, slopes)
    for name, grad, golden_grad, baseline in zip(("dq", "dk", "dv", "dbias", "dslopes"),
                                                 grads, expected, dense_vjp(d_out)):
        _assert_gradient_close(grad, golden_grad, baseline, name=name)


def test_bias_tensor_blocks_dispatch():
    """`backward_kernel` "auto" keeps the Triton backward for bias blocks until they are
    timed on the GPU (`awaiting_measurement`); named, the Mosaic one takes them
    where their rings fit shared memory beside at least two stages of each kernel
    (`stages_beside_bias_blocks`: at D 128 the dQ kernel walks 64-key tiles, and a
    trained float32 bias does not fit there at all)."""
    from pallas_flex.kernels import backward_mosaic, mosaic_eligibility
    bias = jnp.zeros((1, 2, 256, 256), jnp.bfloat16)
    assert _choice(masks.bias_lookup(bias), backend="interpret",
                   backward_kernel="mosaic").kernel == "mosaic_backward"
    program = make_mod_program(masks.bias_lookup(bias), SCORE)
    assert mosaic_eligibility.reads_bias_blocks(program)
    assert not mosaic_eligibility.reads_bias_blocks(make_mod_program(masks.alibi(8), SCORE))
    # Its gradient too (the dK/dV kernel's reduce-adds, in varying order: not with
    # backward_deterministic, which refuses so large a table).
    assert _choice(masks.bias_lookup(bias), wanted=(True,), backend="interpret",
                   backward_kernel="mosaic").kernel == "mosaic_backward"
    with pytest.raises(ValueError, match="backward_deterministic"):
        _choice(masks.bias_lookup(bias), wanted=(True,), backend="interpret",
                backward_kernel="mosaic", backward_deterministic=True)
    small = jnp.zeros((1, 1, 8, 8), jnp.bfloat16)  # (a table the one-hot sums could take)
    with pytest.raises(ValueError, match="backward_deterministic"):
        _choice(masks.bias_lookup(small), wanted=(True,), backend="interpret",
                backward_kernel="mosaic", backward_deterministic=True)
    # (what "auto" does on Hopper: tests/test_dispatch.py)
    assert not mosaic_eligibility.BACKWARD_BIAS_BLOCKS_BY_DEFAULT
    assert "bias tensor" in mosaic_eligibility.awaiting_measurement(program, 64)
    assert mosaic_eligibility.awaiting_measurement(None, 64) is None
    float_bias = masks.bias_lookup(bias.astype(jnp.float32))
    for dim in (64, 128):
        assert _choice(float_bias, dim=dim, backend="interpret",
                       backward_kernel="mosaic").kernel == "mosaic_backward"
    with pytest.raises(ValueError, match="do not fit the backward's shared memory"):
        _choice(float_bias, dim=128, wanted=(True,), backend="interpret",
                backward_kernel="mosaic")
    # The layouts: fewer stages beside the rings (the fused kernel's own), 64-key dQ
    # tiles where 128-key ones leave room for less than two stages, one staging buffer
    # a bias gradient where two leave no room.
    layout, b16, f32 = (backward_mosaic.stages_beside_bias_blocks, jnp.bfloat16,
                        jnp.float32)
    assert layout(64, b16) == (backward_mosaic._DQ_STAGES[64], 1,
                               backward_mosaic._DKV_STAGES[64], 2)
    assert layout(64, b16, [b16], [b16]) == (2, 1, 4, 2)
    assert layout(64, b16, (), [b16], fused=True) == (None, 1, 3, 2)
    assert layout(64, b16, [f32], [f32]) == (3, 2, 3, 2)
    assert layout(128, b16, [b16], [b16]) == (3, 2, 3, 2)
    assert layout(128, b16, [b16], [b16], gradient_tiles=1) == (3, 2, 2, 1)
    assert layout(128, b16, [f32], [f32], gradient_tiles=1) is None


@pytest.mark.parametrize("dim,batch_sum", [(32, "auto"), (64, "loop"), (128, "auto")])
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_pair_bias_gradient_on_the_mosaic_backward(backend, dim, batch_sum, fused_launches,
                                                  monkeypatch):
    """Evoformer's gated row attention (`pf.variants.gated_self_attention`: a pair bias
    shared by the 4 rows of each MSA, read as blocks at b // 4) on the Mosaic backward:
    dQ, dK, dV from its kernels, the pair bias's gradient from its dK/dV kernel's
    reduce-adds (D 64's: test_bias_tensor_blocks_in_the_backward) or, with
    backward_batch_sum "loop", from the Triton backward's batch loop
    (`backward.batch_loop_positions`, after the fused dK/dV kernel at D 64), the gate's
    from XLA; all against plain float64 JAX. A ragged residue count reads the blocks'
    edge padding. D 128: the dQ kernel's 64-key tiles, one staging buffer."""
    from pallas_flex.kernels import backward_mosaic
    calls, backward = [], backward_mosaic.flex_attention_backward_mosaic
    monkeypatch.setattr(backward_mosaic, "flex_attention_backward_mosaic",
                        lambda *args, **kwargs: calls.append(1) or backward(*args, **kwargs))
    batch, rows, residues, heads = 1, 4, 130, 2
    shape = (batch, rows, residues, heads, dim)
    q, k, v, gate = (_cotangent(shape, seed).astype(jnp.bfloat16) for seed in range(4))
    pair_bias = _cotangent((batch, heads, residues, residues), 4).astype(jnp.bfloat16)
    d_out = _cotangent(shape, 7)

    def ours(q, k, v, gate, pair_bias):
        return pf.variants.gated_self_attention(
            q, k, v, gate, pair_bias=pair_bias, backend=backend,
            kernel_options={**MOSAIC, "backward_batch_sum": batch_sum})
    args = (q, k, v, gate, pair_bias)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * d_out)  # noqa: E731
    looped = "flex_attention_backward_batch_loop" in str(
        jax.make_jaxpr(jax.grad(loss(ours), tuple(range(5))))(*args))
    assert looped == (batch_sum == "loop")
    grads = jax.grad(loss(ours), tuple(range(5)))(*args)
    assert calls and len(fused_launches) == looped  # dQ, dK, dV: the Mosaic backward

    def plain(q, k, v, gate, pair_bias):
        q, k, v, gate, pair_bias = (np.asarray(x, np.float64)
                                    for x in (q, k, v, gate, pair_bias))
        fold = lambda x: x.reshape((batch * rows,) + x.shape[2:])  # noqa: E731
        scores = (np.einsum("bqhd,bkhd->bhqk", fold(q), fold(k)) / np.sqrt(dim)
                  + np.repeat(pair_bias, rows, axis=0))
        return scores, fold(v), gate
    scores, values, gate64 = plain(*args)
    probabilities = np.exp(scores - scores.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probabilities, values).reshape(shape)
    sigmoid = 1 / (1 + np.exp(-gate64))
    d_out64 = np.asarray(d_out, np.float64)
    d_gate = d_out64 * out * sigmoid * (1 - sigmoid)
    d_attention = (d_out64 * sigmoid).reshape((batch * rows, residues, heads, dim))
    d_probabilities = np.einsum("bqhd,bkhd->bhqk", d_attention, values)
    d_scores = probabilities * (d_probabilities
                                - (d_probabilities * probabilities).sum(-1, keepdims=True))
    d_pair_bias = d_scores.reshape((batch, rows) + d_scores.shape[1:]).sum(1)
    fold = lambda x: np.asarray(x, np.float64).reshape(  # noqa: E731
        (batch * rows, residues, heads, dim))
    wanted = [np.einsum("bhqk,bkhd->bqhd", d_scores, fold(k)) / np.sqrt(dim),
              np.einsum("bhqk,bqhd->bkhd", d_scores, fold(q)) / np.sqrt(dim),
              np.einsum("bhqk,bqhd->bkhd", probabilities, d_attention)]
    wanted = [x.reshape(shape) for x in wanted] + [d_gate, d_pair_bias]
    for name, grad, want in zip(("dq", "dk", "dv", "dgate", "dpair_bias"), grads, wanted):
        assert grad.shape == want.shape, name
        # (bf16 gradients: RMS error within 2 % of the gradient's RMS)
        error = np.sqrt(np.mean((np.asarray(grad, np.float64) - want) ** 2))
        assert error <= 0.02 * np.sqrt(np.mean(want ** 2)), (name, error)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_t5_tables_train_on_the_mosaic_backward(backend, causal, monkeypatch):
    """A T5 table [Hq, 32] (and, for the causal case, a one-way table [Hq, 16] read at b
    and a per-batch offset: two tables at once), GQA, ragged lengths Sq != Skv, a loss
    on out and lse, two buckets of equal value: the tables' gradients match autodiff of
    the dense float32 reference to float32 precision (the dK/dV kernel sums dS by table
    entry with each row's exact delta), dq, dk, dv to 16-bit precision, and two runs give
    the same bits. The causal case dumps both tables' tiles near the diagonal to HBM
    (`relative_reads.Dump`); the bidirectional one sums their runs in the kernel, as
    where the buckets are traced."""
    if not causal:
        monkeypatch.setattr(relative_reads.Dump, "of", staticmethod(lambda *args: None))
    # The interpreter runs the grid's programs one after another: on the CPU two query
    # heads on one KV head (GQA still, half the programs) and 2 x 2 tiles, both lengths
    # ragged and unequal; on the GPU four heads on two.
    q_len, kv_len, q_heads, kv_heads = ((200, 250, 2, 1) if backend == "interpret"
                                        else (1000, 1500, 4, 2))
    # The bidirectional case reads no table at b: on the CPU it runs one batch row (the
    # kernels' batch offsets are the same code; batch 2 runs in the causal case, whose
    # one-way table is read at b, and on the GPU).
    batch = 1 if backend == "interpret" and not causal else 2
    q, k, v = random_qkv(11, batch, q_len, kv_len, q_heads, kv_heads, 64, 64, jnp.bfloat16)
    table = jax.random.normal(jax.random.key(12), (q_heads, 32), jnp.float32)
    # Buckets 4 and 5 hold one value: one run of the values, two of the entries.
    table = table.at[:, 5].set(table[:, 4])
    one_way = jax.random.normal(jax.random.key(13), (2, 16), jnp.float32)
    d_out = _cotangent(q.shape, 14).astype(jnp.bfloat16).astype(jnp.float32)
    d_lse = _cotangent((batch, q_heads, q_len), 15)
    mask_mod = (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 64) if causal else None

    def loss(q, k, v, table, one_way, backend, options):
        bias = pf.scores.t5_relative_bias(table, max_distance=96)
        one_way_bias = pf.scores.t5_relative_bias(one_way, max_distance=64,
                                                  bidirectional=False)

        def score_mod(s, b, h, q_idx, kv_idx):
            s = bias(s, b, h, q_idx, kv_idx)
            # Read at b: the tables are per batch element.
            return one_way_bias(s, b, b, q_idx, kv_idx) if causal else s
        out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                return_lse=True, backend=backend, kernel_options=options)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse)

    def grad(backend, options):
        return jax.jit(jax.grad(functools.partial(loss, backend=backend, options=options),
                                argnums=range(5)))

    ours = grad(backend, MOSAIC)(q, k, v, table, one_way)
    again = grad(backend, MOSAIC)(q, k, v, table, one_way) if backend == "pallas" else ours
    want = grad("reference", None)(*[x.astype(jnp.float32) for x in (q, k, v)], table,
                                    one_way)
    names = ("dq", "dk", "dv", "d_table", "d_one_way")
    for name, got, repeat, expected in zip(names, ours, again, want):
        if name == "d_one_way" and not causal:
            continue
        np.testing.assert_array_equal(np.asarray(got), np.asarray(repeat))
        got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
        tolerance = 2e-2 if name in ("dq", "dk", "dv") else 1e-4
        assert np.max(np.abs(got - expected)) <= tolerance * np.max(np.abs(expected)), name


def test_a_t5_tables_tiles_before_its_dump_are_summed_from_the_rows_totals(monkeypatch):
    """Causal one-way T5 (its buckets change near the diagonal only: the tiles there are
    dumped, `relative_reads.Dump`), a loss on out and lse, ragged rows: the dK/dV kernel
    leaves the tiles before the dumped offsets out, and `relative_totals` gives their sum
    from each row's total dS' (the dQ kernel's sum dS' and sum P). The table's gradient
    equals the one with those tiles summed in the kernel (the read's derivative not
    recognised as 1) to float32 rounding, and the totals raised by 1 raise one entry a
    head (the far bucket) by 1 per batch row."""
    from pallas_flex.kernels import backward_mosaic
    batch, length, heads = 2, 300, 2
    q, k, v = random_qkv(31, batch, length, length, heads, heads, 64, 64, jnp.bfloat16)
    table = jax.random.normal(jax.random.key(32), (heads, 32), jnp.float32)
    d_out = _cotangent(q.shape, 33)
    d_lse = _cotangent((batch, heads, length), 34)

    def table_gradient():
        jax.clear_caches()  # the backward's trace is cached past the patches otherwise

        def loss(table):
            out, lse = pf.attention(
                q, k, v, mask_mod=masks.causal_mask,
                score_mod=pf.scores.t5_relative_bias(table, max_distance=64,
                                                     bidirectional=False),
                return_lse=True, backend="interpret", kernel_options=MOSAIC)
            return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse)
        return np.asarray(jax.jit(jax.grad(loss))(table))

    from_totals = table_gradient()
    with monkeypatch.context() as patch:
        patch.setattr(backward_mosaic, "constant_output", lambda *args: None)
        in_kernel = table_gradient()
    assert np.max(np.abs(from_totals - in_kernel)) <= 1e-5 * np.max(np.abs(in_kernel))
    real = backward_mosaic.relative_totals
    monkeypatch.setattr(backward_mosaic, "relative_totals", lambda *a: real(*a) + 1.0)
    raised = table_gradient() - from_totals
    np.testing.assert_allclose(raised.sum(axis=1), batch, rtol=1e-3)
    np.testing.assert_allclose(raised.max(axis=1), batch, rtol=1e-3)


@pytest.mark.parametrize("train_table", [True, False], ids=["table_gradient", "fixed_table"])
def test_dense_block_diagonals_in_the_backward(monkeypatch, fused_launches, train_table):
    """A two-way T5 bias whose buckets change within 16 positions of the main diagonal
    (`relative_reads.diagonal_blocks`: block diagonals -1 .. 1 of 4 x 4) is read by the
    backward kernels from its dense tiles there (loaded from global memory) and as one
    value per side elsewhere (`dense_diagonals_in_backward`: at head dim 64, whether or
    not a table's gradient is summed): the gradients, the table's
    included, equal those of the runs on every tile (DENSE_DIAGONALS off) to rounding,
    and the backward's tiles or sides raised by 1 (the forward's left alone) move dq and
    dv (= P^T dO: the dK/dV kernel's own P), and the table's gradient. With the table's
    gradient the two kernels run (dq from the dQ kernel); with a fixed table at head dim
    64 the dK/dV kernel computes dQ too (`fuses_dq`)."""
    from pallas_flex.kernels import backward_mosaic, forward_mosaic
    q, k, v = random_qkv(21, 1, 512, 512, 1, 1, 64, 64, jnp.bfloat16)
    table = jax.random.normal(jax.random.key(22), (1, 8), jnp.float32)
    d_out = _cotangent(q.shape, 23)
    score_mod = pf.scores.t5_relative_bias(table, num_buckets=8, max_distance=16)
    names = ("dq", "dk", "dv", "d_table")[:4 if train_table else 3]

    def loss(q, k, v, table):
        score_mod = pf.scores.t5_relative_bias(table, num_buckets=8, max_distance=16)
        out = pf.attention(q, k, v, score_mod=score_mod, backend="interpret",
                           kernel_options=MOSAIC)
        return jnp.sum(out.astype(jnp.float32) * d_out)

    def gradients():
        jax.clear_caches()
        fused_launches.clear()
        grads = jax.jit(jax.grad(loss, argnums=range(len(names))))(q, k, v, table)
        assert fused_launches == ([] if train_table else [1]), fused_launches
        return [np.asarray(g, np.float32) for g in grads]
    rule = backward_mosaic.dense_diagonals_in_backward
    assert rule(64) and not rule(128)
    program = make_mod_program(score_mod, SCORE)
    found = relative_reads.diagonal_blocks(program, backward_mosaic.tile_reads(program),
                                           1, 1, 512, 512)
    assert [(blocks.first, blocks.count) for blocks in found.values()] == [(-1, 3)]
    dense = gradients()
    monkeypatch.setattr(forward_mosaic, "DENSE_DIAGONALS", False)
    runs = gradients()
    for name, got, expected in zip(names, dense, runs):
        # dq, dk, dv come out in bfloat16: a sum rounded otherwise may flip its last bit.
        tolerance = 1e-4 if name == "d_table" else 1e-2
        assert np.max(np.abs(got - expected)) <= tolerance * np.abs(expected).max(), name
    monkeypatch.setattr(forward_mosaic, "DENSE_DIAGONALS", True)
    inputs = backward_mosaic.diagonal_inputs
    for part in (1, 2):  # the tiles, the sides
        def raised(*args, part=part, **kwargs):
            found = list(inputs(*args, **kwargs))
            found[part] = [array + 1.0 for array in found[part]]
            return tuple(found)
        monkeypatch.setattr(backward_mosaic, "diagonal_inputs", raised)
        moved = gradients()
        for index, name in enumerate(names):
            if name == "dk":
                continue
            change = np.max(np.abs(moved[index] - dense[index]))
            assert change > 5e-2 * np.abs(dense[index]).max(), (part, name)


def test_a_table_read_times_an_index_expression_trains(monkeypatch):
    """A T5 table whose value the mod scales by an expression of kv_idx - q_idx: the
    read's derivative has a part varying along the keys and one per query, which add
    (`mosaic_tiles.split_rows`); taken as a product they gave a gradient 63 % off. The
    table's gradient (summed per run of entries in the dK/dV kernel) matches autodiff of
    the float32 reference."""
    monkeypatch.setattr(relative_reads.Dump, "of", staticmethod(lambda *args: None))
    q, k, v = random_qkv(3, 1, 130, 130, 2, 1, 64, 64, jnp.bfloat16)
    table = jax.random.normal(jax.random.key(1), (2, 32), jnp.float32)
    d_out = _cotangent(q.shape, 2).astype(jnp.bfloat16).astype(jnp.float32)

    def loss(q, k, v, table, backend, options):
        bias = pf.scores.t5_relative_bias(table, max_distance=96)

        def score_mod(s, b, h, q_idx, kv_idx):
            factor = (kv_idx - q_idx).astype(jnp.float32) * 0.01 + 1.0
            return s + bias(jnp.float32(0), b, h, q_idx, kv_idx) * factor
        out = pf.attention(q, k, v, score_mod=score_mod, backend=backend,
                           kernel_options=options)
        return jnp.sum(out.astype(jnp.float32) * d_out)

    ours = jax.grad(functools.partial(loss, backend="interpret", options=MOSAIC),
                    argnums=3)(q, k, v, table)
    want = jax.grad(functools.partial(loss, backend="reference", options=None), argnums=3)(
        *[x.astype(jnp.float32) for x in (q, k, v)], table)
    ours, want = np.asarray(ours), np.asarray(want)
    # 1.1e-4 of the largest entry (4e-5 without the factor; the Triton backward 6e-4).
    assert np.max(np.abs(ours - want)) <= 3e-4 * np.max(np.abs(want))


@pytest.fixture(params=[(False, False), (True, False), (True, True)],
                ids=["exact_deltas", "row_sums", "row_sums_fused"])
def fuse_captured(request, monkeypatch):
    """How gradients of captured arrays read at b and h are taken: from the exact deltas
    the dQ kernel sums (D 128), or from the forward's row sums
    (`mosaic_eligibility.captured_row_sums`: D 64) in the dQ kernel or in the fused D 64
    kernel (`FUSE_CAPTURED_GRADIENTS`), whatever the head dim. Yields whether it fuses."""
    from pallas_flex.kernels import mosaic_eligibility
    row_sums, fuse = request.param
    monkeypatch.setattr(mosaic_eligibility, "captured_row_sums", lambda head_dim: row_sums)
    monkeypatch.setattr(mosaic_eligibility, "FUSE_CAPTURED_GRADIENTS", fuse)
    # The flags are read when a call is traced: no call traced under other values.
    jax.clear_caches()
    yield row_sums and fuse
    jax.clear_caches()


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_captured_arrays_read_per_head_train_on_the_mosaic_backward(backend, fuse_captured,
                                                                   xla_cpu_optimized,
                                                                   fused_launches):
    """A 0-d temperature, bidirectional ALiBi slopes [Hq] and a bias shared by head pairs
    [Hq / 2], all differentiated at once with a loss on out and lse, GQA, a ragged
    length: every gradient matches autodiff of the dense float32 reference, the captured
    ones to float32 precision (the Triton backward's error is 0.9 % on the temperature
    here): the dQ kernel sums the rows' exact deltas (`captured_gradients`), or with
    the forward's row sums C (`captured_row_sums`) P dP (g - C) per row, or fused (the
    dK/dV kernel computing dQ too) per key (`captured_gradients_mosaic.pair_gradients`). Two runs
    give the same bits of every gradient but the fused dq (reduce-adds in whatever order
    the programs reach them).
    (XLA's optimizations on: unoptimized XLA:CPU gives NaN in the reference's dq,
    `conftest.xla_cpu_optimized`.)"""
    # Interpret mode: one batch row (no mod here reads b: the arrays are per head; batch
    # 2 runs in the T5 test's causal case and on the GPU).
    length, batch = (200, 1) if backend == "interpret" else (1000, 2)
    q, k, v = random_qkv(4, batch, length, length, 4, 2, 64, 64, jnp.bfloat16)
    temperature = jnp.float32(0.9)
    slopes = jnp.asarray(masks.alibi_slopes(4))
    pair_bias = jnp.asarray([0.3, -0.7], jnp.float32)
    # The cotangent of a 16-bit output is rounded to 16 bits: round it here, so that the
    # reference sees the same one.
    d_out = _cotangent(q.shape, 6).astype(jnp.bfloat16).astype(jnp.float32)
    d_lse = _cotangent((batch, 4, length), 7)

    def loss(q, k, v, temperature, slopes, pair_bias, backend, options):
        def score_mod(s, b, h, q_idx, kv_idx):
            return s * temperature - slopes[h] * jnp.abs(q_idx - kv_idx) + pair_bias[h // 2]
        out, lse = pf.attention(q, k, v, score_mod=score_mod, return_lse=True,
                                backend=backend, kernel_options=options)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse)

    def grad(backend, options):
        return jax.jit(jax.grad(functools.partial(loss, backend=backend, options=options),
                                argnums=range(6)))

    captured = (temperature, slopes, pair_bias)
    options = MOSAIC
    ours = grad(backend, options)(q, k, v, *captured)
    # Run to run on the GPU (the interpreter on the CPU is reproducible anyway).
    again = grad(backend, options)(q, k, v, *captured) if backend == "pallas" else ours
    want = grad("reference", None)(*[x.astype(jnp.float32) for x in (q, k, v)], *captured)
    assert bool(fused_launches) == fuse_captured
    for name, got, repeat, expected in zip(("dq", "dk", "dv", "d_temperature", "d_slopes",
                                            "d_pair_bias"), ours, again, want):
        if not fuse_captured or name != "dq":
            np.testing.assert_array_equal(np.asarray(got), np.asarray(repeat))
        got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
        tolerance = 2e-2 if name in ("dq", "dk", "dv") else 1e-4
        assert np.max(np.abs(got - expected)) <= tolerance * np.max(np.abs(expected)), name


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_captured_gradients_with_sinks_and_rows_without_keys(backend, fuse_captured,
                                                            fused_launches):
    """Learnable ALiBi slopes next to learnable sinks, with query rows that see no key:
    each row's probability mass over its keys (which the captured-array gradients'
    exact delta, or fused the forward's row sums, take in) is 1 less the sink's weight,
    0 on the empty rows; the backward given the same out and lse from elsewhere
    (`api.attention_backward`, as context parallelism calls it: no row sums, two
    kernels) agrees."""
    length, heads = (130, 2) if backend == "interpret" else (1000, 4)
    q, k, v = random_qkv(8, 1, length, length, heads, heads, 64, 64, jnp.bfloat16)
    slopes = jnp.asarray(masks.alibi_slopes(heads))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0][:heads], jnp.float32)
    d_out = _cotangent(q.shape, 9).astype(jnp.bfloat16).astype(jnp.float32)
    d_lse = _cotangent((1, heads, length), 10)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 8) & (kv_idx <= q_idx)

    def score_mod_of(slopes):
        return lambda s, b, h, q_idx, kv_idx: s - slopes[h] * jnp.abs(q_idx - kv_idx)

    def loss(q, k, v, slopes, sinks, backend, options):
        out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod_of(slopes),
                                sinks=sinks, return_lse=True, backend=backend,
                                kernel_options=options)
        finite_lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(finite_lse * d_lse), (
            out, lse)

    def grad(backend, options, *args):
        """The gradients, and out and lse (aux: the forward the gradients came from)."""
        return jax.jit(jax.grad(functools.partial(loss, backend=backend, options=options),
                                argnums=range(5), has_aux=True))(*args)

    ours, (out, lse) = grad(backend, MOSAIC, q, k, v, slopes, sinks)
    assert bool(fused_launches) == fuse_captured
    want, _ = grad("reference", None, *[x.astype(jnp.float32) for x in (q, k, v)], slopes,
                   sinks)
    for name, got, expected in zip(("dq", "dk", "dv", "d_slopes", "d_sinks"), ours, want):
        got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
        # The sinks' gradient takes its rows' delta from the 16-bit output
        # (`pallas_flex.sinks.sink_gradient`): 16-bit accuracy, as dq, dk, dv.
        tolerance = 1e-4 if name == "d_slopes" else 2e-2
        assert np.max(np.abs(got - expected)) <= tolerance * np.max(np.abs(expected)), name

    # The same backward from statistics handed in (as context parallelism's ring does),
    # out and lse those of the forward above.
    block_mask = pf.create_block_mask(mask_mod, None, None, length, length)
    d_lse_kernel = jnp.where(jnp.isneginf(lse), 0.0, d_lse)
    *_, (d_slopes,) = attention_backward(
        q, k, v, out, lse, d_out.astype(q.dtype), d_lse_kernel, block_mask=block_mask,
        score_mod=score_mod_of(slopes), backend=backend, kernel_options=MOSAIC)
    np.testing.assert_allclose(np.asarray(d_slopes), np.asarray(ours[3]), rtol=1e-4,
                               atol=1e-4 * float(np.max(np.abs(np.asarray(ours[3])))))


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_a_t5_table_and_slopes_train_together(backend, fuse_captured, fused_launches):
    """A T5 table (read at kv_idx - q_idx: its sums by entry take the exact deltas) and
    ALiBi slopes (read at h) differentiated in one call: the dQ kernel's rows are sum
    P dP for the exact deltas and, with the forward's row sums, then one row for the
    slopes (`accumulate_rows_from_forward`); never fused (a relative read). Both
    gradients against float64 autodiff of the dense reference, ragged Sq != Skv, GQA."""
    q_len, kv_len, q_heads, kv_heads = ((200, 250, 2, 1) if backend == "interpret"
                                        else (1000, 1500, 4, 2))
    q, k, v = random_qkv(21, 1, q_len, kv_len, q_heads, kv_heads, 64, 64, jnp.bfloat16)
    table = jax.random.normal(jax.random.key(22), (q_heads, 32), jnp.float32)
    slopes = jnp.asarray(masks.alibi_slopes(q_heads))
    d_out = _cotangent(q.shape, 23).astype(jnp.bfloat16).astype(jnp.float32)

    def loss(q, k, v, table, slopes, backend, options):
        bias = pf.scores.t5_relative_bias(table, max_distance=96)

        def score_mod(s, b, h, q_idx, kv_idx):
            return bias(s, b, h, q_idx, kv_idx) - slopes[h] * jnp.abs(q_idx - kv_idx)
        out = pf.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 64,
                           score_mod=score_mod, backend=backend, kernel_options=options)
        return jnp.sum(out.astype(jnp.float32) * d_out)

    def grad(backend, options, *args):
        return jax.jit(jax.grad(functools.partial(loss, backend=backend, options=options),
                                argnums=(3, 4)))(*args)

    ours = grad(backend, MOSAIC, q, k, v, table, slopes)
    assert not fused_launches
    want = grad("reference", None, *[x.astype(jnp.float32) for x in (q, k, v)], table,
                slopes)
    for name, got, expected in zip(("d_table", "d_slopes"), ours, want):
        got, expected = np.asarray(got), np.asarray(expected)
        assert np.max(np.abs(got - expected)) <= 1e-4 * np.max(np.abs(expected)), name


def test_one_array_trains_beside_constant_ones_the_mod_reads(fuse_captured):
    """Differentiating one captured array of a mod that reads others it does not
    differentiate (a T5 table beside constant ALiBi slopes and per-head offsets, then the
    slopes beside a constant table): the derivative programs read the constant arrays as
    the kernels do (`tile_mods.TracedReads`; as plain arrays their reads were broadcast
    like tiles and failed to trace). Against autodiff of the dense reference (float32,
    within 3e-7 of float64's here). The slopes' gradient from the exact deltas is 3.8e-4
    off float64 on this bidirectional call, from the forward's row sums 2.7e-5
    (`captured_row_sums`: D 64, this call's head dim)."""
    from pallas_flex.kernels import mosaic_eligibility
    row_sums = mosaic_eligibility.captured_row_sums(64)
    q, k, v = random_qkv(31, 1, 130, 200, 2, 1, 64, 64, jnp.bfloat16)
    table = jax.random.normal(jax.random.key(32), (2, 32), jnp.float32)
    slopes = jnp.asarray(masks.alibi_slopes(2))
    offsets = jnp.asarray([0.3, -0.2], jnp.float32)
    d_out = _cotangent(q.shape, 33).astype(jnp.bfloat16).astype(jnp.float32)

    def loss(q, k, v, table, slopes, backend, options):
        bias = pf.scores.t5_relative_bias(table, max_distance=96)

        def score_mod(s, b, h, q_idx, kv_idx):
            return (bias(s + offsets[h], b, h, q_idx, kv_idx)
                    - slopes[h] * jnp.abs(q_idx - kv_idx))
        out = pf.attention(q, k, v, score_mod=score_mod, backend=backend,
                           kernel_options=options)
        return jnp.sum(out.astype(jnp.float32) * d_out)

    for argnum in (3, 4):
        ours = jax.grad(functools.partial(loss, backend="interpret", options=MOSAIC),
                        argnums=argnum)(q, k, v, table, slopes)
        want = jax.grad(functools.partial(loss, backend="reference", options=None),
                        argnums=argnum)(*[x.astype(jnp.float32) for x in (q, k, v)], table,
                                        slopes)
        ours, want = np.asarray(ours), np.asarray(want)
        tolerance = 1e-4 if row_sums or argnum == 3 else 5e-4
        assert np.max(np.abs(ours - want)) <= tolerance * np.max(np.abs(want)), argnum


def test_the_dispatcher_rules():
    # Interpret mode runs the Triton backward unless the Mosaic one is named.
    assert _choice(backend="interpret").kernel == "triton_backward"
    assert _choice(backend="interpret", backward_kernel="mosaic").kernel == "mosaic_backward"
    assert _choice(backend="xla", backward_kernel="auto").kernel == "triton_backward"
    assert _choice(backend="interpret", backward_kernel="triton").kernel == "triton_backward"
    with pytest.raises(ValueError, match="dtype float32"):
        _choice(backend="interpret", dtype=jnp.float32, backward_kernel="mosaic")
    # Tuning the Triton backward's tiles selects it.
    assert resolve_options({"backward_block_q": 64}, 64).backward_kernel == "triton"
    assert resolve_options({"backward_block_q": 64, "backward_kernel": "auto"},
                           64).backward_kernel == "auto"
    with pytest.raises(ValueError, match="backward_kernel"):
        resolve_options({"backward_kernel": "cuda"}, 64)


def test_fused_dq_rule(monkeypatch):
    """dQ is fused into the dK/dV kernel at head dim 64 only, never in deterministic
    mode, with gradients of captured arrays only where FUSE_CAPTURED_GRADIENTS is set,
    the forward gave their row sums and none is read at kv_idx - q_idx."""
    from pallas_flex.kernels import mosaic_eligibility
    from pallas_flex.kernels.mosaic_eligibility import fuses_dq
    assert fuses_dq(64, (), False)
    assert not fuses_dq(64, (), True)
    monkeypatch.setattr(mosaic_eligibility, "FUSE_CAPTURED_GRADIENTS", False)
    assert not fuses_dq(64, (0,), False, forward_row_sums=True)
    monkeypatch.setattr(mosaic_eligibility, "FUSE_CAPTURED_GRADIENTS", True)
    assert fuses_dq(64, (0,), False, forward_row_sums=True)
    assert not fuses_dq(64, (0,), False)  # (the statistics handed in: no row sums)
    assert not fuses_dq(64, (0,), False, relative_positions=(0,), forward_row_sums=True)
    assert not fuses_dq(64, (0,), True, forward_row_sums=True)
    for dim in (80, 96, 128):
        assert not fuses_dq(dim, (), False)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_captured_row_sums_by_default_at_head_dim_64_only(head_dim, fused_launches,
                                                          monkeypatch):
    """Unpatched, a call training ALiBi slopes takes the forward's row sums and the fused
    kernel at head dim 64, and the exact deltas in the dQ kernel at 128 (where the
    forward's sums cost more than they save: `mosaic_eligibility.captured_row_sums`).
    Traced only: the choice is made when the call is traced."""
    from pallas_flex import api
    chosen, choose = [], api._forward_row_sums
    monkeypatch.setattr(api, "_forward_row_sums",
                        lambda *args: chosen.append(choose(*args)) or chosen[-1])
    q, k, v = random_qkv(3, 1, 128, 128, 2, 2, head_dim, head_dim, jnp.bfloat16)
    slopes = jnp.asarray(masks.alibi_slopes(2))

    def loss(q, k, v, slopes):
        return jnp.sum(pf.attention(q, k, v, mask_mod=pf.masks.causal_mask,
                                    score_mod=pf.scores.alibi(slopes), backend="interpret",
                                    kernel_options=MOSAIC).astype(jnp.float32))
    jax.clear_caches()
    jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, slopes)
    assert chosen == [(0,) if head_dim == 64 else ()]
    assert bool(fused_launches) == (head_dim == 64)


# The fused path (deterministic False, the default) runs and is asserted in every D 64
# case of test_gallery_in_interpret_mode: GQA and MQA, ragged lengths, Sq != Skv, causal
# masks' partial blocks (sliding_window at 200 x 130, alibi_causal at 17 x 250).
def test_deterministic_backward_does_not_fuse_dq_in_interpret_mode(fused_launches):
    """With `backward_deterministic` the D 64 backward keeps dQ in a kernel of its own
    (the fused dK/dV kernel's reduce-adds vary in order), and agrees with the float64
    reference (GQA, ragged lengths, Sq != Skv, the causal mask's partial blocks)."""
    _check_gradients("causal", jnp.bfloat16, "GQA4", 200, 250, 64, "interpret", batch=1,
                     options={"backward_deterministic": True})
    assert not fused_launches


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_auto_runs_the_mosaic_backward_on_hopper_bitwise_reproducibly(dim):
    """With default options a covered call's backward lowers to Mosaic GPU kernels (at D
    64 one: dQ fused into the dK/dV kernel by TMA reduce-adds), with
    backward_deterministic to two, whose results are the same bits run to run; the Triton
    backward agrees with both."""
    q, k, v = random_qkv(3, 2, 1024, 1024, 8, 2, dim, dim, jnp.bfloat16)
    d_out = _cotangent(q.shape, 9).astype(q.dtype)

    def grads(options):
        def ours(q, k, v):
            return pf.attention(q, k, v, mask_mod=masks.causal_mask,
                                score_mod=masks.tanh_softcap(20.0), kernel_options=options)
        return jax.jit(lambda q, k, v: jax.vjp(ours, q, k, v)[1](d_out))(q, k, v)

    def kernels(options):
        return jax.jit(lambda q, k, v: jax.vjp(
            lambda q, k, v: pf.attention(q, k, v, mask_mod=masks.causal_mask,
                                         kernel_options=options), q, k, v)[1](
                d_out)).lower(q, k, v).as_text().count("mosaic_gpu")

    deterministic = {"backward_deterministic": True}
    # The forward and the backward's kernels: one fused at D 64, two otherwise.
    two_kernels, default_kernels = kernels(deterministic), kernels(None)
    assert two_kernels >= 3
    assert default_kernels < two_kernels if dim == 64 else default_kernels == two_kernels
    first, second = grads(deterministic), grads(deterministic)
    default = grads(None)
    triton = grads({"backward_kernel": "triton"})
    for a, b, c, d in zip(first, second, triton, default):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        a, c, d = (np.asarray(x.astype(jnp.float32)) for x in (a, c, d))
        assert np.max(np.abs(a - c)) <= 2e-2 * np.max(np.abs(c))
        assert np.max(np.abs(d - c)) <= 2e-2 * np.max(np.abs(c))


@pytest.mark.parametrize("summed_over_batch", [False, True])
def test_reduced_dumps_give_the_table_gradient_of_the_per_tile_dumps(summed_over_batch):
    """`REDUCED_DUMPS` (the default; GPU only: TMA reduce-adds): the dK/dV kernel adds
    a dumped read's tiles into one [64, 64] tile a (batch, head, offset), or a (head,
    offset) where the read's entries do not depend on b, in place of one a key tile. Given
    what those adds leave (the visited tiles of the keys within the length, summed), the
    table's gradient (`relative_gradient`, with and without the rows' totals) is the one
    of the per-tile dumps, ragged keys included."""
    from pallas_flex.kernels import captured_gradients_mosaic as cg
    batch, heads, entries, length = 2, 3, 7, 300
    rng = np.random.default_rng(0)
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, length, length)
    key_tiles, count = 2 * block_mask.num_blocks[1], 3
    dump = relative_reads.Dump(-2, count, rng.integers(0, entries, (1, heads, count, 127),
                                                        dtype=np.int32))
    flat = np.arange(heads)[None, :, None] * entries + np.arange(entries)
    const = jnp.zeros((heads, entries), jnp.float32)
    run_sums = jnp.asarray(rng.normal(size=(batch, heads, key_tiles, 2, 64)), jnp.float32)
    dumped = jnp.asarray(rng.normal(size=(batch * heads * key_tiles * count, 64, 64)),
                         jnp.float32)
    totals = jnp.asarray(rng.normal(size=(batch, heads)), jnp.float32)
    reduced_tiles = cg._summed_dumps(dumped, dump, cg._visited_tiles(block_mask, dump),
                                     length)
    reduced = cg.ReducedDump(batch=1 if summed_over_batch else batch, keys_below=length)
    if summed_over_batch:
        reduced_tiles = reduced_tiles.sum(axis=0, keepdims=True)
    for with_totals in (None, totals):
        want = cg.relative_gradient(run_sums, dumped, flat, dump, const, block_mask, length,
                                    totals=with_totals)
        got = cg.relative_gradient(run_sums, reduced_tiles.reshape(-1, 64, 64), flat, dump,
                                   const, block_mask, length, totals=with_totals,
                                   reduced=reduced)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                   atol=1e-4 * float(np.max(np.abs(np.asarray(want)))))


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_reduced_dumps_on_the_gpu(monkeypatch, dim):
    """`REDUCED_DUMPS` on the GPU (TMA reduce-adds of a T5 table's dumped tiles): the
    table's gradient is the per-tile dumps' to float32 rounding, dq, dk and dv the same
    bits; causal one-way T5, GQA, ragged lengths, a loss on out and lse."""
    from pallas_flex.kernels import backward_mosaic
    q, k, v = random_qkv(41, 2, 1000, 1000, 4, 2, dim, dim, jnp.bfloat16)
    table = jax.random.normal(jax.random.key(42), (4, 32), jnp.float32)
    d_out = _cotangent(q.shape, 43)
    d_lse = _cotangent((2, 4, 1000), 44)

    def gradients(reduced):
        monkeypatch.setattr(backward_mosaic, "REDUCED_DUMPS", reduced)
        jax.clear_caches()

        def loss(q, k, v, table):
            out, lse = pf.attention(
                q, k, v, mask_mod=masks.causal_mask,
                score_mod=pf.scores.t5_relative_bias(table, bidirectional=False),
                return_lse=True, backend="pallas", kernel_options=MOSAIC)
            return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse)
        return [np.asarray(g, np.float32)
                for g in jax.jit(jax.grad(loss, argnums=range(4)))(q, k, v, table)]

    per_tile, reduced = gradients(False), gradients(True)
    for name, want, got in zip(("dq", "dk", "dv"), per_tile, reduced):
        np.testing.assert_array_equal(got, want, err_msg=name)
    np.testing.assert_allclose(reduced[3], per_tile[3], rtol=0,
                               atol=1e-5 * float(np.max(np.abs(per_tile[3]))))
