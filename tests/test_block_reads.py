"""Mods that read a captured array at exactly q_idx and / or kv_idx (a pair bias
`bias[b // rows, h, q_idx, kv_idx]`, a key bias `bias[b, kv_idx]`): the Triton kernels
load a block (or vector) of the array per tile instead of a per-element gather
(`tile_mods.block_reads`), and the backward adds the cotangent tile as one block. These
check which reads qualify, that the kernels take the block path, and outputs and
gradients (the arrays' included) against the float64 reference in interpret mode:
ragged lengths (tiles past the sequences' ends, arrays shorter than the sequences:
clamped reads), GQA, transposed reads and the batch-loop launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.kernels import tile_mods
from pallas_flex.masks.mod_program import MASK, SCORE, make_mod_program
from tests.conftest import SMALL_TILES, golden, random_qkv
from tests.test_backward import _assert_gradient_close, _cotangent, _golden_gradients

BATCH, Q_LEN, KV_LEN, Q_HEADS, KV_HEADS, DIM = 4, 45, 38, 4, 2, 16


def _arrays(kind, seed=7):
    """(captured arrays, score_mod factory taking them) for each kind of read."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    if kind == "pair_bias_rows":  # Evoformer: rows of an MSA share one pair bias
        return ((normal(keys[0], (BATCH // 2, Q_HEADS, Q_LEN, KV_LEN)),),
                lambda bias: lambda s, b, h, q, kv: s + bias[b // 2, h, q, kv])
    if kind == "transposed":  # the array's axes are (kv, q)
        return ((normal(keys[0], (Q_HEADS, KV_LEN, Q_LEN)),),
                lambda bias: lambda s, b, h, q, kv: s + bias[h, kv, q])
    if kind == "vectors":  # one index each: a query bias per head, a key bias per row
        return ((normal(keys[0], (Q_HEADS, Q_LEN)), normal(keys[1], (BATCH, KV_LEN))),
                lambda qb, kb: lambda s, b, h, q, kv: s + qb[h, q] + 0.5 * kb[b, kv])
    if kind == "short_table":  # shorter than both sequences: reads past it are clamped
        return ((normal(keys[0], (Q_HEADS, Q_LEN - 5, KV_LEN - 9)),),
                lambda bias: lambda s, b, h, q, kv: s + bias[h, q, kv])
    if kind == "long_table":  # longer than the sequences: their prefix is read
        return ((normal(keys[0], (Q_HEADS, Q_LEN + 20, KV_LEN + 30)),),
                lambda bias: lambda s, b, h, q, kv: s * (1.0 + 0.1 * jnp.tanh(bias[h, q, kv])))
    raise AssertionError(kind)


def _program(score_mod, *arrays):
    return make_mod_program(score_mod(*arrays), SCORE)


# ---------------------------------------------------------------- which reads qualify


def test_block_reads_are_the_reads_at_exactly_q_idx_and_kv_idx():
    pair, table = jnp.zeros((2, 4, 16, 16)), jnp.zeros((4, 40))
    key, heads, allowed = jnp.zeros((8, 16)), jnp.array([1, 0, 3, 2]), jnp.zeros((16, 16), bool)

    def axes(mod, kind=SCORE):
        program = make_mod_program(mod, kind)
        return sorted(axes for _, axes in tile_mods.block_reads(program).values())

    q, kv = "q", "kv"
    assert axes(lambda s, b, h, i, j: s + pair[b // 4, h, i, j]) == [((2, q), (3, kv))]
    assert axes(lambda s, b, h, i, j: s + pair[0, h, j, i]) == [((2, kv), (3, q))]
    assert axes(lambda s, b, h, i, j: s + key[b, j] + table[h, i]) == [((1, kv),), ((1, q),)]
    # leading indices read from another array at b / h: uniform over the tile
    assert axes(lambda s, b, h, i, j: s + pair[0, heads[h], i, j]) == [((2, q), (3, kv))]
    assert axes(lambda b, h, i, j: allowed[i, j], MASK) == [((0, q), (1, kv))]
    # computed indices, leading indices of q_idx or of the score, an index twice: gathers
    assert axes(lambda s, b, h, i, j: s + table[h, j - i + 20]) == []
    assert axes(lambda s, b, h, i, j: s + pair[0, h, i + 1, j]) == []
    assert axes(lambda s, b, h, i, j: s + pair[0, i // 4, i, j]) == []
    assert axes(lambda s, b, h, i, j: s + pair[0, (s > 0).astype(jnp.int32), i, j]) == []
    assert axes(lambda s, b, h, i, j: s + pair[0, h, i, i]) == []
    assert axes(lambda s, b, h, i, j: s + pair[0, h, heads[i % 4], j]) == []


def test_padded_for_blocks_edge_pads_tile_axes_and_the_gradient_folds_back():
    bias = jnp.arange(2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5)
    program = _program(lambda bias: lambda s, b, h, q, kv: s + bias[h, kv, q], bias)
    (padded,) = tile_mods.padded_for_blocks(program, q_limit=8, kv_limit=4)
    assert padded.shape == (2, 4, 8)  # kv axis 3 -> 4, q axis 5 -> 8
    np.testing.assert_array_equal(padded, jnp.pad(bias, ((0, 0), (0, 1), (0, 3)), mode="edge"))
    cotangent = jax.random.normal(jax.random.PRNGKey(0), padded.shape)
    _, pad_vjp = jax.vjp(lambda x: jnp.pad(x, ((0, 0), (0, 1), (0, 3)), mode="edge"), bias)
    np.testing.assert_allclose(tile_mods.unpadded_gradient(cotangent, bias.shape),
                               pad_vjp(cotangent)[0], rtol=1e-6)


# ------------------------------------------------------------ the kernels take the path


def _table_reads(jaxpr, ndim, dtype, kernel=None, found=None):
    """(kernel name, gathered) for every load of an array of `ndim` dimensions and
    `dtype` in the Pallas kernels of `jaxpr`; gathered: its indexer has integer arrays."""
    found = [] if found is None else found
    for equation in jaxpr.eqns:
        name = equation.params["name"] if equation.primitive.name == "pallas_call" else kernel
        for param in equation.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jex_core.Jaxpr):
                    _table_reads(inner, ndim, dtype, name, found)
        ref = equation.invars[0].aval if equation.invars else None
        if (equation.primitive.name in ("get", "masked_load") and kernel is not None
                and len(getattr(ref, "shape", ())) == ndim and ref.dtype == dtype):
            found.append((kernel, any(jnp.issubdtype(atom.aval.dtype, jnp.integer)
                                      and atom.aval.ndim for atom in equation.invars[1:])))
    return found


@pytest.mark.parametrize("kind,batch_sum", [("pair_bias_rows", "atomic"),
                                            ("pair_bias_rows", "loop"), ("transposed", "atomic"),
                                            ("relative_position", "auto")])
def test_kernels_load_blocks_instead_of_gathers(kind, batch_sum):
    """Every kernel's reads of the table (forward, dQ, dK/dV, batch loop) are slices, and
    a relative-position table (read at kv_idx - q_idx) still gathers."""
    q, k, v = random_qkv(0, BATCH, Q_LEN, KV_LEN, Q_HEADS, KV_HEADS, DIM, DIM, jnp.float32)
    if kind == "relative_position":
        table = jnp.zeros((Q_HEADS, Q_LEN + KV_LEN), jnp.bfloat16)
        make = lambda t: lambda s, b, h, i, j: s + t[h, j - i + Q_LEN]  # noqa: E731
    else:
        (table,), make = _arrays(kind)
        table = table.astype(jnp.bfloat16)  # its gradient buffers are float32

    def forward_and_backward(q, k, v, table):
        def attend(q, k, v, table):
            return pf.attention(q, k, v, score_mod=make(table), mask_mod=masks.causal_mask,
                                backend="interpret",
                                kernel_options=dict(SMALL_TILES, backward_batch_sum=batch_sum))
        out, vjp = jax.vjp(attend, q, k, v, table)
        return vjp(out)

    jaxpr = jax.make_jaxpr(forward_and_backward)(q, k, v, table).jaxpr
    # (no other bfloat16 arrays of its rank: q, k, v are float32)
    reads = _table_reads(jaxpr, table.ndim, table.dtype)
    kernels = {kernel for kernel, _ in reads}
    expected = {"flex_attention_forward", "flex_attention_backward_dq",
                "flex_attention_backward_dkdv"}
    if batch_sum == "loop":
        expected.add("flex_attention_backward_batch_loop")
    if kind == "relative_position":
        assert reads and all(gathered for _, gathered in reads)
        return
    assert kernels == expected, kernels
    assert not any(gathered for _, gathered in reads)


# ---------------------------------------------------------- against the float64 reference


@pytest.mark.parametrize("kind,options", [
    ("pair_bias_rows", {}),
    ("pair_bias_rows", {"backward_batch_sum": "loop", "backward_batch_rows": 4}),
    ("transposed", {}),
    ("vectors", {}),
    ("short_table", {}),
    ("long_table", {"backward_batch_sum": "loop"}),
])
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_outputs_and_gradients_match_float64(kind, options, backend, request):
    """Causal mask, GQA 4:2, 45 queries over 38 keys on 16x16 tiles: partial tiles at
    both ends, arrays padded to whole mask blocks and gradients folded back (on the GPU:
    the compiled Triton kernels, float32 dots at full precision). long_table with XLA's
    optimizations on: unoptimized XLA:CPU gives NaN in the float64 reference's dq there
    (`conftest.xla_cpu_optimized`)."""
    if kind == "long_table":
        request.getfixturevalue("xla_cpu_optimized")
    q, k, v = random_qkv(3, BATCH, Q_LEN, KV_LEN, Q_HEADS, KV_HEADS, DIM, DIM, jnp.float32)
    arrays, make = _arrays(kind)
    d_out = _cotangent((BATCH, Q_LEN, Q_HEADS, DIM), 4)
    kernel_options = dict(SMALL_TILES, **options)

    def loss(q, k, v, *arrays):
        out = pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=make(*arrays),
                           backend=backend, kernel_options=kernel_options)
        return jnp.sum(out * d_out), out

    argnums = tuple(range(3 + len(arrays)))
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
        q, k, v, *arrays)
    expected_out, _ = golden(q, k, v, mask_mod=masks.causal_mask, score_mod=make(*arrays))
    np.testing.assert_allclose(np.asarray(out), expected_out, atol=2e-5, rtol=2e-5)
    expected = _golden_gradients(q, k, v, d_out, lambda *a: masks.causal_mask, make,
                                 argnums=argnums, extra=arrays)
    names = ["dq", "dk", "dv"] + [f"d_array{i}" for i in range(len(arrays))]
    for name, grad, golden_grad in zip(names, grads, expected):
        assert grad.shape == golden_grad.shape, name
        _assert_gradient_close(grad, golden_grad, name=f"{kind}: {name}")


def test_mask_mod_reading_a_table_as_blocks():
    """A mask_mod reading a bool [Sq, Skv] table at (q_idx, kv_idx): the forward and the
    backward's partial tiles load its blocks (the table padded to whole blocks)."""
    q, k, v = random_qkv(5, 2, Q_LEN, KV_LEN, 2, 2, DIM, DIM, jnp.float32)
    allowed = jax.random.bernoulli(jax.random.PRNGKey(6), 0.7, (Q_LEN, KV_LEN))
    allowed = allowed.at[:, 0].set(True)  # every row attends somewhere

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx] & (kv_idx <= q_idx + 4)

    d_out = _cotangent((2, Q_LEN, 2, DIM), 8)

    def loss(q, k, v):
        out = pf.attention(q, k, v, mask_mod=mask_mod, backend="interpret",
                           kernel_options=SMALL_TILES)
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    expected_out, _ = golden(q, k, v, mask_mod=mask_mod)
    np.testing.assert_allclose(np.asarray(out), expected_out, atol=2e-5, rtol=2e-5)
    for name, grad, golden_grad in zip(["dq", "dk", "dv"], grads,
                                       _golden_gradients(q, k, v, d_out, mask_mod, None)):
        _assert_gradient_close(grad, golden_grad, name=name)
