"""Arrays a mod closes over are kernel inputs: new values reuse the compiled kernel.

Python numbers a mod closes over are compile-time constants, and every index a mod sees
is in range, whatever the sequence length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import api, masks
from pallas_flex.masks import block_mask as block_mask_module
from tests.conftest import SMALL_TILES, assert_close_to_golden, golden, random_qkv

BATCH, LENGTH, HEADS, DIM = 1, 40, 2, 16  # 40 is not a multiple of the 16-row tiles


def _document_ids(length, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 4, size=length)), jnp.int32)


def _slopes(seed):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.05, 1.0, size=HEADS), jnp.float32)


@pytest.fixture(scope="module")
def qkv():
    return random_qkv(0, BATCH, LENGTH, LENGTH, HEADS, HEADS, DIM, DIM, jnp.float32)


@pytest.fixture(scope="module", autouse=True)
def interpret_mode_imported(qkv):
    """The first Pallas interpret-mode call in a process imports
    jax._src.pallas.mosaic.interpret (lazily, inside JAX), which registers a JAX config
    option that is part of every jit cache key: every jitted function traced before that
    call misses its cache once afterwards. That is a one-off of the process, not a
    recompilation caused by new captured values, so it happens here, before counting."""
    q, k, v = qkv
    pf.attention(q, k, v, backend="interpret", kernel_options=SMALL_TILES).block_until_ready()


def _assert_matches_reference(out, q, k, v, mask_mod, score_mod):
    expected, _ = golden(q, k, v, mask_mod, score_mod)
    assert_close_to_golden(out, expected, q, k, v, mask_mod, score_mod)


def test_new_captured_values_do_not_retrace_under_jit(qkv):
    q, k, v = qkv
    traces = []

    @jax.jit
    def document_alibi_attention(q, k, v, ids, slopes):
        traces.append(1)
        return pf.attention(q, k, v, mask_mod=masks.document_mask(ids),
                            score_mod=masks.alibi(slopes), backend="interpret",
                            kernel_options=SMALL_TILES)

    outputs = []
    for seed in (1, 2):
        ids, slopes = _document_ids(LENGTH, seed), _slopes(seed)
        out = document_alibi_attention(q, k, v, ids, slopes)
        _assert_matches_reference(out, q, k, v, masks.document_mask(ids), masks.alibi(slopes))
        outputs.append(np.asarray(out))
    assert len(traces) == 1
    # The second call really used the new values (not the first call's baked in).
    assert np.abs(outputs[0] - outputs[1]).max() > 1e-2


def test_new_captured_values_do_not_recompile_eagerly(qkv):
    """Without an outer jit: each call builds new closures (new Python functions) over new
    arrays of the same shape; the internal jitted functions must hit their caches."""
    q, k, v = qkv

    def call(seed):
        mask_mod = masks.document_mask(_document_ids(LENGTH, seed))
        score_mod = masks.alibi(_slopes(seed))
        out = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                           backend="interpret", kernel_options=SMALL_TILES)
        _assert_matches_reference(out, q, k, v, mask_mod, score_mod)
        return np.asarray(out)

    def cache_sizes():
        return api._attention._cache_size(), block_mask_module._build_jitted._cache_size()

    first = call(4)
    sizes = cache_sizes()
    second = call(5)
    assert cache_sizes() == sizes
    third = call(6)
    assert cache_sizes() == sizes
    assert np.abs(first - second).max() > 1e-2 and np.abs(second - third).max() > 1e-2


def test_new_slopes_alone_do_not_recompile(qkv):
    q, k, v = qkv
    outputs = []
    sizes = []
    for seed in (7, 8, 9):
        score_mod = masks.alibi(_slopes(seed))
        out = pf.attention(q, k, v, mask_mod=masks.causal_mask, score_mod=score_mod,
                           backend="xla", kernel_options=SMALL_TILES)
        _assert_matches_reference(out, q, k, v, masks.causal_mask, score_mod)
        outputs.append(np.asarray(out))
        sizes.append(api._attention._cache_size())
    assert sizes[1] == sizes[2]
    assert np.abs(outputs[1] - outputs[2]).max() > 1e-2


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_python_number_closures_are_constants(backend, qkv):
    """sliding_window(8) and sliding_window(16) are different programs: no cache reuse may
    give the second the first's window."""
    q, k, v = qkv
    outputs = []
    for window in (8, 16):
        mask_mod = masks.sliding_window(window)
        out = pf.attention(q, k, v, mask_mod=mask_mod, backend=backend,
                           kernel_options=SMALL_TILES)
        _assert_matches_reference(out, q, k, v, mask_mod, None)
        outputs.append(np.asarray(out))
    # Queries 8 and later see different keys under the two windows.
    assert np.abs(outputs[0][:, 8:] - outputs[1][:, 8:]).max() > 1e-2
    np.testing.assert_allclose(outputs[0][:, :8], outputs[1][:, :8], atol=1e-6)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("q_len,kv_len", [(70, 70), (37, 70)])
def test_mods_see_only_in_range_indices(backend, q_len, kv_len):
    """Arrays exactly as long as the sequences, read at q_idx and kv_idx, on lengths that
    are not multiples of the 16-row tiles. The last document runs into the ragged tail and
    the last key carries a large bias: a padded key clamped to the last position but left
    unmasked would join that document with a large weight and change the output."""
    q, k, v = random_qkv(q_len, 2, q_len, kv_len, 2, 1, DIM, DIM, jnp.float32)
    q_ids = jnp.asarray(np.repeat([0, 1, 2], [q_len // 4, q_len // 4, q_len - 2 * (q_len // 4)]),
                        jnp.int32)
    kv_ids = jnp.asarray(np.repeat([0, 1, 2], [20, 25, kv_len - 45]), jnp.int32)
    kv_bias = jnp.zeros(kv_len, jnp.float32).at[-1].set(6.0)
    q_bias = jnp.linspace(-1.0, 1.0, q_len, dtype=jnp.float32)
    assert q_ids.shape == (q_len,) and kv_bias.shape == (kv_len,)

    mask_mod = masks.document_mask(q_ids, kv_ids)

    def position_bias(score, b, h, q_idx, kv_idx):
        return score + kv_bias[kv_idx] + q_bias[q_idx]

    out, lse = pf.attention(q, k, v, mask_mod=mask_mod, score_mod=position_bias,
                            backend=backend, return_lse=True, kernel_options=SMALL_TILES)
    expected_out, expected_lse = golden(q, k, v, mask_mod, position_bias)
    assert_close_to_golden(out, expected_out, q, k, v, mask_mod, position_bias)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, atol=2e-5, rtol=2e-5)
