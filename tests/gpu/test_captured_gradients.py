"""Issue 23: gradients of arrays a score_mod captures, against the float64 reference.

Cells (96): captured array x layout {mha: 8:8, gqa: 8:2} x mask {causal, bidirectional} x
(dtype, head dim, S) in {float32, bfloat16} x {64, 128} x {1024}, float16 x 128 x 1024
and bfloat16 x 128 x 4096; B = 1,
Hq = 8, Sq = Skv = S, where the captured array is
  t5_table:        [H, 32], T5 buckets (`pf.masks.t5_relative_bias`; one-directional
                   buckets under the causal mask, as in T5's decoder);
  relative_table:  [H, 2S-1] read at `table[h, q_idx - kv_idx + S - 1]`;
  alibi_slopes:    [H]: `pf.masks.alibi` under the causal mask, the symmetric
                   `-slopes[h] * |q_idx - kv_idx|` without it;
  pair_bias:       [H, S, S] read at `bias[h, q_idx, kv_idx]`.
Each cell checks out, dq, dk, dv and the captured array's gradient of sum(out * d_out):
the captured gradient float32 within 1e-3 of max|ref|, 16-bit RMSE no worse than twice
plain JAX's in the same dtype; the rest as tests/gpu/test_dtype_matrix.py. The float64
values and the plain-JAX baselines take the mods' additive term as a dense [H, S, S]
bias, so that one attention program per (S, mask, head dim, layout) serves every kind
(and, in float64, every dtype); the float64 one runs one head at a time on the device
(an [8, 4096, 4096] float64 buffer is 1 GiB).

Also: `backward_deterministic` gives bitwise-equal gradients run to run, and a
`FlexMultiHeadAttention` trains a T5 bias, learnable ALiBi and a pair bias by plain SGD in
each dtype, its first step's bias gradients matching a float64 dense twin of the model.

Runtime (H100, `make test-gpu` as 14 concurrent shards, 2026-11-24): a cell takes
13-23 s at S = 1024 (16-bit to float32) and ~25 s at S = 4096, compiling being most of
it: ~1900 s for the file, spread over the shards (see the Makefile).

Select a slice with -k, e.g. `-k "pair_bias-S1024"` ("float16" also matches "bfloat16":
write `-k "float16 and not bfloat16"`).
"""

from __future__ import annotations

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels.reference import reference_attention
from pallas_flex.nn import FlexMultiHeadAttention, LearnableAlibi, T5RelativeBias
from tests.gpu.conftest import (BACKEND, attention_inputs, SMALL, as_float64, check_captured_gradient,
                                check_gradient, check_output, numpy_normal, plain_attention,
                                compile_and_time)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KINDS = ["t5_table", "relative_table", "alibi_slopes", "pair_bias"]
HEAD_DIMS = [64, 80, 96, 128]
# The Mosaic backward's tiles and stages differ at 80 and 96 (`backward_mosaic`): those
# dims run in the 16-bit dtype it takes, causal, at the short length.
ODD_HEAD_DIMS = (80, 96)
LAYOUTS = {"mha": (8, 8), "gqa": (8, 2)}
LENGTHS = [40, 72] if SMALL else [1024, 4096]
MASKS = ["causal", "bidirectional"]
HEADS = 8
T5_BUCKETS = 32
NAMES = ("out", "dq", "dk", "dv", "d_captured")


def _captured_array(kind, length, seed):
    if kind == "t5_table":
        return numpy_normal(seed, (HEADS, T5_BUCKETS), 0.5)
    if kind == "relative_table":
        return numpy_normal(seed, (HEADS, 2 * length - 1), 0.5)
    if kind == "alibi_slopes":
        return np.asarray(masks.alibi_slopes(HEADS))
    if kind == "pair_bias":
        return numpy_normal(seed, (HEADS, length, length))
    raise AssertionError(kind)


def _score_mod(kind, mask, length, captured):
    if kind == "t5_table":
        return masks.t5_relative_bias(captured, bidirectional=mask == "bidirectional")
    if kind == "relative_table":
        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + captured[h, q_idx - kv_idx + length - 1]
        return relative_bias
    if kind == "alibi_slopes":
        if mask == "causal":
            return masks.alibi(captured)

        def symmetric_alibi(score, b, h, q_idx, kv_idx):
            return score - captured[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)
        return symmetric_alibi
    if kind == "pair_bias":
        def pair_bias(score, b, h, q_idx, kv_idx):
            return score + captured[h, q_idx, kv_idx]
        return pair_bias
    raise AssertionError(kind)


def _mask_mod(mask):
    return masks.causal_mask if mask == "causal" else None


def _outputs(attention_fn, kind, mask, q, k, v, captured, d_out):
    """(out, dq, dk, dv, d_captured) of sum(out * d_out) through `attention_fn(q, k, v,
    mask_mod, score_mod)`: what the kernels run."""
    def attend(q, k, v, captured):
        return attention_fn(q, k, v, _mask_mod(mask),
                            _score_mod(kind, mask, q.shape[1], captured))

    out, vjp = jax.vjp(attend, q, k, v, captured)
    return (out, *vjp(d_out))


def _ours(q, k, v, mask_mod, score_mod, kernel_options=None):
    return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=BACKEND,
                        kernel_options=kernel_options)


# ----- references ------------------------------------------------------------------------
# The four mods are additive, `score + f(captured)[h, q_idx, kv_idx]`. The float64 value
# and the plain-JAX baseline take f(captured) as a dense [H, S, S] bias: their attention
# programs (the costly compiles) then serve every kind, and d_captured is the bias's
# gradient pulled back through f. The arithmetic is the mods' own: a float32 (float64)
# bias added to the float32 (float64) score.

def _dense_bias(kind, mask, length, captured):
    """f(captured) for every (h, q_idx, kv_idx): [H, S, S] in captured's dtype."""
    score_mod = _score_mod(kind, mask, length, captured)
    heads = jnp.arange(HEADS, dtype=jnp.int32)
    positions = jnp.arange(length, dtype=jnp.int32)
    over_kv = jax.vmap(score_mod, in_axes=(None, None, None, None, 0))
    over_q = jax.vmap(over_kv, in_axes=(None, None, None, 0, None))
    over_h = jax.vmap(over_q, in_axes=(None, None, 0, None, None))
    return over_h(jnp.zeros((), captured.dtype), 0, heads, positions, positions)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pull_back_bias_gradient(kind, mask, captured, d_bias):
    _, vjp = jax.vjp(lambda c: _dense_bias(kind, mask, d_bias.shape[-1], c), captured)
    return vjp(d_bias)[0]


_dense_bias_jit = jax.jit(_dense_bias, static_argnums=(0, 1, 2))


def _float64_bias_attention(q, k, v, mask_mod, bias):
    """The dense reference with `score + bias[h, q_idx, kv_idx]`, one query head at a
    time and rematerialized in the backward: a [1, 1, S, S] float64 score matrix at a
    time (128 MiB at S = 4096) rather than all heads' (1 GiB per buffer)."""
    group = q.shape[2] // k.shape[2]

    def one_head(head_and_bias):
        h, head_bias = head_and_bias
        q_h = jax.lax.dynamic_index_in_dim(q, h, axis=2)
        k_h = jax.lax.dynamic_index_in_dim(k, h // group, axis=2)
        v_h = jax.lax.dynamic_index_in_dim(v, h // group, axis=2)

        def head_score(score, b, _, q_idx, kv_idx):
            return score + head_bias[q_idx, kv_idx]

        out, _ = reference_attention(q_h, k_h, v_h, mask_mod=mask_mod, score_mod=head_score)
        return out[:, :, 0]

    heads = jnp.arange(q.shape[2], dtype=jnp.int32)
    out = jax.lax.map(jax.checkpoint(one_head), (heads, bias))
    return jnp.moveaxis(out, 0, 2)  # [H, B, S, Dv] -> [B, S, H, Dv]


def _plain_bias_attention(q, k, v, mask_mod, bias):
    return plain_attention(q, k, v, mask_mod, bias=bias)


def _bias_outputs(attention_fn, mask, q, k, v, bias, d_out):
    """(out, dq, dk, dv, d_bias) of sum(out * d_out), the bias dense."""
    out, vjp = jax.vjp(lambda q, k, v, bias: attention_fn(q, k, v, _mask_mod(mask), bias),
                       q, k, v, bias)
    return (out, *vjp(d_out))


# Module-level jits: compiled once per (S, mask, head dim, layout), the float64 one shared
# by the three dtypes and every kind, the plain-JAX one by every kind.
_float64_outputs = jax.jit(functools.partial(_bias_outputs, _float64_bias_attention),
                           static_argnums=0)
_plain_outputs = jax.jit(functools.partial(_bias_outputs, _plain_bias_attention),
                         static_argnums=0)


def _reference_values(attention_outputs, kind, mask, inputs):
    """(out, dq, dk, dv, d_captured) through a dense-bias attention program."""
    q, k, v, captured, d_out = inputs
    bias = _dense_bias_jit(kind, mask, q.shape[1], captured)
    *values, d_bias = attention_outputs(mask, q, k, v, bias, d_out)
    return (*values, _pull_back_bias_gradient(kind, mask, captured, d_bias))


def _cell_inputs(kind, dtype_name, head_dim, layout, length, mask):
    dtype = DTYPES[dtype_name]
    q_heads, kv_heads = LAYOUTS[layout]
    seed = zlib.crc32(f"{kind}-{dtype_name}-{head_dim}-{layout}-{length}-{mask}".encode())
    q, k, v, d_out = attention_inputs(seed, length, length, q_heads, kv_heads, head_dim,
                                      dtype)
    captured = jnp.asarray(_captured_array(kind, length, seed + 4))  # float32, learnable
    return q, k, v, captured, d_out


def _float64_values(kind, mask, inputs):
    """The float64 outputs and gradients, left on the device (the pair bias's is 1 GiB)."""
    with jax.enable_x64(True):
        return _reference_values(_float64_outputs, kind, mask, [
            jnp.asarray(x).astype(jnp.float64) for x in inputs])


# Ordered so that the cells sharing reference programs (same S, mask, head dim, layout)
# are neighbours: conftest's shards keep them together. To keep `make test-gpu` within
# one 10-minute device call, the long sequence runs in bfloat16 at head dim 128 only and
# float16 at head dim 128 only: float16 shares bfloat16's kernels but for the dtype, and
# the dtype does not change how the tile walk covers a longer sequence.
def _selected(length, head_dim, dtype_name, mask):
    if head_dim in ODD_HEAD_DIMS:
        return length == LENGTHS[0] and dtype_name == "bfloat16" and mask == "causal"
    if length != LENGTHS[0]:
        return dtype_name == "bfloat16" and head_dim == HEAD_DIMS[-1]
    return dtype_name != "float16" or head_dim == HEAD_DIMS[-1]


CELLS = [pytest.param(kind, dtype_name, head_dim, layout, length, mask,
                      id=f"{kind}-S{length}-{mask}-d{head_dim}-{layout}-{dtype_name}")
         for length, mask, head_dim, layout, kind, dtype_name in itertools.product(
             LENGTHS, MASKS, HEAD_DIMS, LAYOUTS, KINDS, DTYPES)
         if _selected(length, head_dim, dtype_name, mask)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,dtype_name,head_dim,layout,length,mask", CELLS)
def test_captured_array_gradient_matches_float64_reference(kind, dtype_name, head_dim, layout,
                                                           length, mask, cell):
    cell.update(issue=23, kind=kind, dtype=dtype_name, head_dim=head_dim, layout=layout,
                length=length, mask=mask, op="forward_backward")
    inputs = _cell_inputs(kind, dtype_name, head_dim, layout, length, mask)
    results, _ = compile_and_time(functools.partial(_outputs, _ours, kind, mask), inputs, cell)
    expected = _float64_values(kind, mask, inputs)
    baseline = None
    if DTYPES[dtype_name] != jnp.float32:
        baseline = _reference_values(_plain_outputs, kind, mask, inputs)

    failures = []
    for index, (name, result) in enumerate(zip(NAMES, results)):
        plain = None if baseline is None else baseline[index]
        assert result.shape == (inputs[index - 1].shape if index else inputs[0].shape)
        if name == "d_captured":
            failure = check_captured_gradient(result, expected[index], plain, f"d_{kind}")
        else:
            reference = np.asarray(expected[index])
            plain = None if plain is None else as_float64(plain)
            failure = (check_output(result, reference, plain) if name == "out"
                       else check_gradient(result, reference, plain, name))
        if failure:
            failures.append(failure)
    assert not failures, "; ".join(failures)


# ----- determinism -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["alibi_slopes", "t5_table"])
def test_deterministic_backward_is_bitwise_reproducible(kind, cell):
    """With `backward_deterministic`, two runs give bitwise-equal dq, dk, dv and slope /
    T5-table gradients (without it the captured gradients' atomics may differ in the last
    bits). Arrays read at more than a few dozen entries per head (the relative table, the
    pair bias) are refused with a ValueError by that option, so they are not run here."""
    length = LENGTHS[0]
    cell.update(issue=23, kind=kind, dtype="bfloat16", head_dim=64, layout="gqa",
                length=length, mask="causal", op="deterministic_backward")
    inputs = _cell_inputs(kind, "bfloat16", 64, "gqa", length, "causal")
    attention_fn = functools.partial(_ours, kernel_options={"backward_deterministic": True})
    first, compiled = compile_and_time(
        functools.partial(_outputs, attention_fn, kind, "causal"), inputs, cell)
    second = jax.block_until_ready(compiled(*inputs))
    for name, a, b in zip(NAMES, first, second):
        a, b = np.asarray(a), np.asarray(b)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (
            f"{name}: runs differ in {int((a != b).sum())} of {a.size} entries")


# ----- training learnable biases through the layer -------------------------------------

TRAIN_STEPS = 4
LEARNING_RATE = 0.05
TRAIN_BATCH, TRAIN_LENGTH = 2, (40 if SMALL else 200)
TRAIN_FEATURES, TRAIN_HEADS, TRAIN_KV_HEADS = 128, 4, 2  # head dim 32, GQA 2:1


class PairBias(nnx.Module):
    """A learned [H, S, S] bias (Evoformer-style pair bias), as a layer's score_bias."""

    def __init__(self, num_heads, length, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.bias = nnx.Param(jnp.asarray(numpy_normal(7, (num_heads, length, length), 0.5)))

    def __call__(self):
        return _score_mod("pair_bias", "causal", None, self.bias[...])


def _float64_reference(q, k, v, mask_mod, score_mod):
    return reference_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)[0]


def _plain(q, k, v, mask_mod, score_mod):
    return plain_attention(q, k, v, mask_mod, score_mod)


def _bias_module(kind):
    if kind == "t5_table":
        return T5RelativeBias(TRAIN_HEADS, bidirectional=False, rngs=nnx.Rngs(3))
    if kind == "alibi_slopes":
        return LearnableAlibi(TRAIN_HEADS)
    return PairBias(TRAIN_HEADS, TRAIN_LENGTH, rngs=nnx.Rngs(3))


def _bias_score_mod(kind, parameter):
    if kind == "t5_table":
        return masks.t5_relative_bias(parameter, bidirectional=False)
    return _score_mod(kind, "causal", None, parameter)


def _leaf(state, *path):
    for name in path:
        state = state[name]
    return state[...] if isinstance(state, nnx.Variable) else state


def _twin_loss(params, bias_parameter, x, target, kind, dtype, attention_fn):
    """FlexMultiHeadAttention's computation written out (nnx.LinearGeneral promotes
    inputs and weights to the layer's dtype), with any attention function."""
    def linear(inputs, kernel, bias, axes):
        inputs, kernel, bias = (jnp.asarray(a).astype(dtype) for a in (inputs, kernel, bias))
        return jnp.tensordot(inputs, kernel, axes=axes, precision="highest") + bias

    def project(name, inputs):
        return linear(inputs, _leaf(params, name, "kernel"), _leaf(params, name, "bias"),
                      ((2,), (0,)))

    q, k, v = project("query", x), project("key", x), project("value", x)
    out = attention_fn(q, k, v, masks.causal_mask, _bias_score_mod(kind, bias_parameter))
    y = linear(out, _leaf(params, "out", "kernel"), _leaf(params, "out", "bias"),
               ((2, 3), (0, 1)))
    return jnp.mean((y.astype(target.dtype) - target) ** 2)


def _bias_path(kind):
    return ("score_bias", {"t5_table": "table", "alibi_slopes": "slopes",
                           "pair_bias": "bias"}[kind])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("kind", ["t5_table", "alibi_slopes", "pair_bias"])
def test_training_learnable_bias_through_layer(kind, dtype_name, cell):
    """Plain SGD through `FlexMultiHeadAttention(score_bias=...)`: the first step's bias
    gradient matches a float64 dense twin of the model (float32 within 1e-3 of max|ref|,
    16-bit no worse than twice the twin's error in that dtype), and the loss goes down."""
    dtype = DTYPES[dtype_name]
    cell.update(issue=23, kind=kind, dtype=dtype_name, head_dim=TRAIN_FEATURES // TRAIN_HEADS,
                layout="gqa", length=TRAIN_LENGTH, mask="causal", op="train_layer")
    layer = FlexMultiHeadAttention(TRAIN_HEADS, TRAIN_FEATURES, num_kv_heads=TRAIN_KV_HEADS,
                                   dtype=dtype, param_dtype=jnp.float32,
                                   score_bias=_bias_module(kind), backend=BACKEND,
                                   rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    shape = (TRAIN_BATCH, TRAIN_LENGTH, TRAIN_FEATURES)
    x = jnp.asarray(numpy_normal(11, shape))
    target = jnp.asarray(numpy_normal(12, shape))

    def loss_fn(params):
        y = nnx.merge(graphdef, params)(x, mask_mod=masks.causal_mask)
        return jnp.mean((y.astype(jnp.float32) - target) ** 2)

    def step(params):
        # Projections at full float32 precision (no TF32 on the GPU): the kernels set
        # their own dot precision, and the float64 twin then measures them.
        with jax.default_matmul_precision("highest"):
            loss, grads = jax.value_and_grad(loss_fn)(params)
        return loss, grads, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    (loss, grads, params_next), step = compile_and_time(step, (params,), cell)
    losses = [float(loss)]
    bias_gradient = _leaf(grads, *_bias_path(kind))
    bias_parameter = _leaf(params, *_bias_path(kind))

    with jax.enable_x64(True):
        to64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a).astype(jnp.float64), tree)
        twin64 = jax.jit(jax.grad(_twin_loss, argnums=1), static_argnums=(4, 5, 6))
        expected = twin64(to64(params), to64(bias_parameter), to64(x), to64(target), kind,
                          jnp.float64, _float64_reference)
    baseline = None
    if dtype != jnp.float32:
        with jax.default_matmul_precision("highest"):
            baseline = jax.jit(jax.grad(_twin_loss, argnums=1), static_argnums=(4, 5, 6))(
                params, bias_parameter, x, target, kind, dtype, _plain)
    failure = check_captured_gradient(bias_gradient, expected, baseline, f"d_{kind}")

    params = params_next
    for _ in range(TRAIN_STEPS - 1):
        loss, _, params = step(params)
        losses.append(float(loss))
    cell.update(losses=[round(value, 6) for value in losses])
    assert failure is None, failure
    assert np.isfinite(losses).all() and losses[-1] < losses[0], f"losses {losses}"
