"""Backward: gradients of every backend against autodiff of the float64 dense reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels.reference import reference_attention
from tests.conftest import BACKENDS, SMALL_TILES, dense_low_precision, random_qkv, rmse
from tests.test_attention import CASES, DTYPES, LAYOUTS, VARIANTS, _shape_for

GRADIENT_VARIANTS = ["noop", "causal", "sliding_window", "prefix_lm_per_batch", "document",
                     "document_causal_wrapper", "chunked_causal", "alibi_causal",
                     "softcap_causal", "softcap_approx", "t5_bias", "bias_lookup",
                     "relative_position", "and_or_not"]
# float32 gradients sum many products; relative to the gradient's scale they stay within
# this of the float64 value.
FLOAT32_GRADIENT_TOLERANCE = 1e-4


def _cotangent(shape, seed):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _golden_gradients(q, k, v, d_out, mask_mod, score_mod, argnums=(0, 1, 2), extra=()):
    """Gradients of sum(out * d_out) through the dense reference in float64."""
    with jax.enable_x64(True):
        def loss(q, k, v, *extra_args):
            out, _ = reference_attention(q, k, v, mask_mod=mask_mod(*extra_args) if extra else
                                         mask_mod, score_mod=score_mod(*extra_args) if extra
                                         else score_mod)
            return jnp.sum(out * d_out)
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, *extra)]
        d_out = jnp.asarray(np.asarray(d_out, np.float64))
        grads = jax.jit(jax.grad(loss, argnums=argnums))(*args)
        return [np.asarray(g) for g in grads]


def _assert_gradient_close(ours, expected, baseline=None, name="gradient"):
    ours = np.asarray(jnp.asarray(ours, jnp.float32), np.float64)
    assert np.isfinite(ours).all(), f"{name} has NaN or inf"
    if baseline is None:  # float32
        scale = max(np.abs(expected).max(), 1.0)
        np.testing.assert_allclose(ours, expected, atol=FLOAT32_GRADIENT_TOLERANCE * scale,
                                   rtol=FLOAT32_GRADIENT_TOLERANCE, err_msg=name)
    else:
        # Where the dense computation is exact (e.g. a row with one key has a zero
        # gradient), ours may still carry float32 accumulation rounding.
        floor = FLOAT32_GRADIENT_TOLERANCE * max(np.abs(expected).max(), 1.0) * 1e-2
        ours_error, baseline_error = rmse(ours, expected), rmse(baseline, expected)
        assert ours_error <= max(baseline_error, floor), (
            f"{name}: RMSE {ours_error:.3g} worse than dense low-precision XLA's "
            f"{baseline_error:.3g}")


# The 14 variants meet CASES' 9 cases in rotation, the first 5 cases twice. On the xla
# backend (CPU) the second variant of each of those cases stands in for the first: xla
# still meets all 9 cases (every dtype, layout, length pair and head dims), the
# interpret and pallas backends run every variant.
XLA_SKIPS = {"noop", "causal", "sliding_window", "prefix_lm_per_batch", "document"}


def _gradient_cases():
    # One case per variant; the rotation through CASES covers every dtype and layout.
    for index, name in enumerate(GRADIENT_VARIANTS):
        case = CASES[index % len(CASES)]
        dtype, layout, q_len, kv_len, (dim, value_dim) = _shape_for(case, VARIANTS[name][2])
        case_id = f"{name}-{dtype}-{layout}-{q_len}x{kv_len}-d{dim}v{value_dim}"
        for backend in BACKENDS:
            backend_name = getattr(backend, "values", (backend,))[0]
            if backend_name == "xla" and name in XLA_SKIPS:
                continue
            marks = getattr(backend, "marks", ())
            yield pytest.param(backend_name, name, dtype, layout, q_len, kv_len, dim,
                               value_dim, marks=marks, id=f"{case_id}-{backend_name}")


@pytest.mark.parametrize("backend,variant,dtype,layout,q_len,kv_len,dim,value_dim",
                         list(_gradient_cases()))
def test_gradients_match_float64_reference(backend, variant, dtype, layout, q_len, kv_len, dim,
                                           value_dim):
    mask_factory, score_factory, _ = VARIANTS[variant]
    q_heads, kv_heads = LAYOUTS[layout]
    batch = 2
    q, k, v = random_qkv(11, batch, q_len, kv_len, q_heads, kv_heads, dim, value_dim,
                         DTYPES[dtype])
    shape_args = (batch, q_heads, q_len, kv_len)
    mask_mod = mask_factory(*shape_args) if mask_factory else None
    score_mod = score_factory(*shape_args) if score_factory else None
    d_out = _cotangent((batch, q_len, q_heads, value_dim), 12).astype(q.dtype)

    def ours(q, k, v):
        return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend=backend,
                            kernel_options=SMALL_TILES)

    _, vjp = jax.vjp(ours, q, k, v)
    grads = vjp(d_out)
    expected = _golden_gradients(q, k, v, d_out, mask_mod, score_mod)
    baselines = [None] * 3
    if q.dtype != jnp.float32:
        _, dense_vjp = jax.vjp(lambda q, k, v: dense_low_precision(q, k, v, mask_mod, score_mod),
                               q, k, v)
        baselines = dense_vjp(d_out)
    for name, grad, golden_grad, baseline, primal in zip("qkv", grads, expected, baselines,
                                                         (q, k, v)):
        assert grad.shape == primal.shape and grad.dtype == primal.dtype
        _assert_gradient_close(grad, golden_grad, baseline, name=f"d{name}")


def _learnable_case(kind, batch, q_heads, q_len, kv_len):
    """(parameter, score_mod factory taking the parameter) for a learnable-bias case."""
    key = jax.random.PRNGKey(21)
    if kind == "alibi_slopes":
        return jnp.linspace(0.05, 0.6, q_heads), lambda slopes: masks.alibi(slopes)
    if kind == "t5_table":
        return (0.5 * jax.random.normal(key, (q_heads, 12)),
                lambda table: masks.t5_relative_bias(table, max_distance=30))
    if kind == "pair_bias":  # Evoformer-style [B, H, Sq, Skv] bias
        return (jax.random.normal(key, (batch, q_heads, q_len, kv_len)),
                lambda bias: masks.bias_lookup(bias))
    if kind == "row_shared_bias":  # one [H, Sq, Skv] table for pairs of batch rows
        def shared(bias):
            return lambda score, b, h, q_idx, kv_idx: score + bias[b // 2, h, q_idx, kv_idx]
        return jax.random.normal(key, (batch // 2, q_heads, q_len, kv_len)), shared
    raise AssertionError(kind)


def _check_learnable_gradients(backend, kind, q_heads, kv_heads, seed,
                               kernel_options=SMALL_TILES):
    """Gradients for q, k, v and a learnable score_mod array (causal mask) match the
    float64 reference; returns the learnable array's gradient."""
    batch, q_len, kv_len = 2, 45, 38
    q, k, v = random_qkv(seed, batch, q_len, kv_len, q_heads, kv_heads, 32, 32, jnp.float32)
    parameter, make_score_mod = _learnable_case(kind, batch, q_heads, q_len, kv_len)
    d_out = _cotangent((batch, q_len, q_heads, 32), seed + 1)

    def loss(q, k, v, parameter):
        out = pf.attention(q, k, v, mask_mod=masks.causal_mask,
                           score_mod=make_score_mod(parameter), backend=backend,
                           kernel_options=kernel_options)
        return jnp.sum(out * d_out)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, parameter)
    expected = _golden_gradients(q, k, v, d_out, lambda p: masks.causal_mask, make_score_mod,
                                 argnums=(0, 1, 2, 3), extra=(parameter,))
    for name, grad, golden_grad in zip(["dq", "dk", "dv", f"d_{kind}"], grads, expected):
        _assert_gradient_close(grad, golden_grad, name=name)
    return grads[3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["alibi_slopes", "t5_table", "pair_bias"])
def test_gradients_of_captured_arrays(backend, kind):
    parameter_gradient = _check_learnable_gradients(backend, kind, q_heads=4, kv_heads=2,
                                                    seed=13)
    assert np.abs(np.asarray(parameter_gradient)).max() > 0


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("order", ["full_blocks_first", "masked_blocks_first"])
def test_walk_orders_give_the_same_gradients(backend, order):
    """Either walk order of full and masked blocks computes the float64 reference's
    gradients (one launch without GQA here; GQA's two launches: the tests above)."""
    options = dict(SMALL_TILES, backward_masked_first=order == "masked_blocks_first")
    _check_learnable_gradients(backend, "alibi_slopes", q_heads=2, kv_heads=2, seed=21,
                               kernel_options=options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mod_closing_over_two_arrays_differentiates_only_one(backend):
    batch, heads, length = 1, 2, 40
    q, k, v = random_qkv(15, batch, length, length, heads, heads, 32, 32, jnp.float32)
    slopes = jnp.array([0.3, 0.7])
    offsets = jnp.array([1.0, -2.0])  # captured too, held constant

    def loss(slopes):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx) * 0.1 + offsets[h]
        out = pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                           backend=backend, kernel_options=SMALL_TILES)
        return jnp.sum(out ** 2)

    def reference_loss(slopes):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx) * 0.1 + offsets[h]
        out, _ = reference_attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod)
        return jnp.sum(out ** 2)

    np.testing.assert_allclose(jax.grad(loss)(slopes), jax.grad(reference_loss)(slopes),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_have_finite_zero_gradients(backend):
    q, k, v = random_qkv(16, 1, 40, 33, 2, 2, 32, 32, jnp.float32)

    def mask_mod(b, h, q_idx, kv_idx):  # even rows see nothing, odd rows one key
        return (q_idx % 2 == 1) & (kv_idx == 0)

    def loss(q, k, v):
        out = pf.attention(q, k, v, mask_mod=mask_mod, backend=backend,
                           kernel_options=SMALL_TILES)
        return jnp.sum(out * jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) / out.size)

    d_q, d_k, d_v = (np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    for grad in (d_q, d_k, d_v):
        assert np.isfinite(grad).all()
    # Rows that see nothing contribute exactly nothing; keys nobody sees get exactly zero.
    assert np.all(d_q[:, 0::2] == 0.0)
    assert np.all(d_v[:, 1:] == 0.0) and np.abs(d_v[:, 0]).max() > 0
    # A row with one key has softmax weight 1 whatever q.k is: its gradient to q and k is
    # zero up to float32 rounding of rowsum(dO * O) against dO . v (about 1e-7 per row,
    # times |q| ~ 3, summed over the 20 rows that reach each key).
    np.testing.assert_allclose(d_q, 0.0, atol=1e-5)
    np.testing.assert_allclose(d_k, 0.0, atol=1e-5)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_check_grads_numerically(backend):
    q, k, v = random_qkv(17, 1, 20, 24, 2, 1, 16, 16, jnp.float32)

    def f(q, k, v):
        return pf.attention(q, k, v, mask_mod=masks.causal_mask,
                            score_mod=masks.tanh_softcap(3.0), backend=backend,
                            kernel_options=SMALL_TILES)

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_gradient_of_lse_output():
    q, k, v = random_qkv(18, 1, 33, 33, 2, 2, 16, 16, jnp.float32)

    def loss(q, k, v, backend):
        out, lse = pf.attention(q, k, v, mask_mod=masks.causal_mask, backend=backend,
                                return_lse=True, kernel_options=SMALL_TILES)
        return jnp.sum(out) + jnp.sum(jnp.sin(lse))

    ours = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "interpret")
    expected = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "reference")
    for a, b in zip(ours, expected):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_works_under_vmap_and_checkpoint():
    q, k, v = random_qkv(19, 2, 24, 24, 2, 2, 16, 16, jnp.float32)
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]  # an extra leading axis

    def single(q, k, v, backend):
        return jnp.sum(jax.checkpoint(lambda q, k, v: pf.attention(
            q, k, v, mask_mod=masks.causal_mask, score_mod=masks.alibi(2), backend=backend,
            kernel_options=SMALL_TILES))(q, k, v) ** 2)

    def batched(backend):
        return jax.vmap(jax.grad(single, argnums=(0, 1, 2)), in_axes=(0, 0, 0, None))(
            *stacked, backend)

    for ours, expected in zip(jax.jit(batched, static_argnums=0)("interpret"),
                              batched("reference")):
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-4)


def test_launch_parameters_keep_eight_warps_for_128_row_tiles_only():
    """8 warps on 64-row tiles split columns and ran 2x slower on the H100: launches whose
    owned tiles are shorter than 128 rows take at most 4 warps and 2 stages."""
    from pallas_flex.kernels.backward import _launch_parameters
    assert _launch_parameters(8, 3, 128) == (8, 3)
    assert _launch_parameters(8, 3, 64) == (4, 2)
    assert _launch_parameters(4, 2, 32) == (4, 2)
    assert _launch_parameters(2, 1, 16) == (2, 1)


def test_deterministic_option_refuses_tables_scatter_added_with_atomics():
    q, k, v = random_qkv(3, 1, 40, 40, 2, 2, 16, 16, jnp.float32)
    table = jnp.zeros((2, 79))  # a relative table [H, 2S-1]: 79 entries per head

    def loss(table):
        score_mod = lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + 39]  # noqa: E731
        return jnp.sum(pf.attention(q, k, v, score_mod=score_mod, backend="interpret",
                                    kernel_options={"backward_deterministic": True}))

    with pytest.raises(ValueError, match="backward_deterministic"):
        jax.grad(loss)(table)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind,rows", [("row_shared_bias", 1), ("pair_bias", 2)])
def test_batch_loop_sums_table_gradients_over_rows(backend, kind, rows):
    """backward_batch_sum "loop": the gradient of a table read per element comes from
    the batch-loop launch (rows summed in registers), causal blocks (empty, partial,
    full), GQA and ragged tails included. One row per program: both programs
    scatter-add into the shared table; two rows of a per-row table: the sum is flushed
    when the table entries change within a program."""
    options = dict(SMALL_TILES, backward_batch_sum="loop", backward_batch_rows=rows)
    _check_learnable_gradients(backend, kind, q_heads=4, kv_heads=2, seed=25,
                               kernel_options=options)


def test_batch_sum_plans():
    """Which reads the batch loop takes ("auto": tables shared by at least
    BATCH_LOOP_MIN_SHARING rows; never indices that vary over the tile with b)."""
    from pallas_flex.kernels.backward import _site_plans
    from pallas_flex.kernels.tile_mods import captured_read_batch_axes
    from pallas_flex.masks.mod_program import SCORE, make_mod_program

    pair_bias, per_row = jnp.zeros((2, 4, 16, 16)), jnp.zeros((256, 4, 16, 16))
    table, offsets = jnp.zeros((4, 200)), jnp.zeros((256,), jnp.int32)
    programs = {
        "msa": lambda s, b, h, i, j: s + pair_bias[b // 128, h, i, j],
        "per_row": lambda s, b, h, i, j: s + per_row[b, h, i, j],
        "shifted": lambda s, b, h, i, j: s + table[h, i - j + offsets[b] + 20],
        "shared": lambda s, b, h, i, j: s + table[h, i - j + 20],
    }
    programs = {name: make_mod_program(mod, SCORE) for name, mod in programs.items()}
    assert captured_read_batch_axes(programs["msa"]) == [(True, False, False, False)]
    assert captured_read_batch_axes(programs["shifted"]) == [(True,), (False, True)]

    def modes(name, batch, batch_sum="auto"):
        return [plan.mode for plan in _site_plans(programs[name], batch=batch,
                                                   batch_sum=batch_sum)]
    assert modes("msa", 256) == ["batch_loop"]
    assert modes("msa", 256, "atomic") == ["atomic"]
    assert modes("msa", 4) == ["atomic"]  # two rows a table: atomics
    assert modes("msa", 4, "loop") == ["batch_loop"]
    assert modes("per_row", 256) == ["atomic"]
    assert modes("per_row", 256, "loop") == ["batch_loop"]
    assert modes("shifted", 256, "loop") == ["atomic"]  # offsets is integer: no gradient
    assert modes("shared", 256) == ["batch_loop"]
    with pytest.raises(ValueError, match="backward_batch_sum"):
        pf.attention(*random_qkv(0, 1, 8, 8, 1, 1, 16, 16, jnp.float32),
                     kernel_options={"backward_batch_sum": "sometimes"})
