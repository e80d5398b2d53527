"""Shared helpers: random inputs, the float64 golden value, dtype-derived tolerances."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

# Four host devices for the multi-device tests (tests/test_context_parallel.py): XLA reads
# the flag when the CPU backend starts, which is after this import, before any test runs.
# Single-device code still runs on device 0; a GPU, where there is one, is unaffected.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex.kernels.reference import reference_attention
from tests import selection


def _compilation_cache_for_this_process():
    """On the CPU, the test processes of one run keep the executables they compile in a
    persistent compilation cache (a temporary directory, removed at exit): a program
    compiled again from the same HLO with the same options loads the executable it got
    the first time instead of compiling it again. Compiling is most of this suite's time
    on the CPU, and much of it is the same programs again: the float64 and low-precision
    references and the helpers jit anew for each call, and every program of a module
    is recompiled in the next one after _release_compiled_programs. Programs with host
    callbacks (the interpret-mode kernels) are not cached by JAX. Not on a GPU (the GPU
    suites record each cell's compile time); PALLAS_FLEX_TEST_COMPILATION_CACHE=0 turns it
    off. Must run before the process's first compile: JAX decides then whether it caches."""
    if os.environ.get("PALLAS_FLEX_TEST_COMPILATION_CACHE") == "0":
        return
    if jax.default_backend() != "cpu":
        return
    path = os.environ.get("PALLAS_FLEX_TEST_JAX_CACHE_DIR")
    if not path:
        # The first process of the run (pytest-xdist's controller, or the one process
        # without xdist) makes the directory and removes it at exit; the workers it starts
        # inherit the variable and share the directory, so a program one worker compiled
        # loads in the other (the golden references and helpers recur across modules that
        # xdist hands to different workers).
        path = tempfile.mkdtemp(prefix="pallas-flex-tests-jax-cache-")
        os.environ["PALLAS_FLEX_TEST_JAX_CACHE_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


_compilation_cache_for_this_process()


def _few_optimizations_on_the_cpu():
    """On the CPU, XLA compiles without LLVM's optimizations (jax_disable_most_optimizations:
    backend optimization level 0, no expensive LLVM passes; JAX's switch for programs that
    cost more to optimize than to run). The tests' programs are small and run once or
    twice, so compiling is their cost: the whole suite took 2508 s with the optimizations
    and 1484 s without on 2 cores (2026-11-27). No fast math either way. The environment
    variable carries it to the processes the tests start (the bench CLI's suites, the
    notebooks' kernels, the examples). Not on a GPU (the GPU suites record compile times
    of the optimized kernels); PALLAS_FLEX_TEST_FEW_OPTIMIZATIONS=0 turns it off. Tests
    that meet XLA:CPU's known wrong result at level 0 take the `xla_cpu_optimized`
    fixture."""
    if os.environ.get("PALLAS_FLEX_TEST_FEW_OPTIMIZATIONS") == "0":
        return
    if jax.default_backend() != "cpu":
        return
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)


_few_optimizations_on_the_cpu()


@pytest.fixture
def xla_cpu_optimized():
    """Compiles the test's programs with XLA's optimizations. At backend optimization
    level 0 XLA:CPU (jaxlib 0.11.2) gives NaN in one query row of the float64 dense
    reference's dq for a score_mod s * (1 + 0.1 tanh(bias[h, q, kv])) under a causal mask
    (tests/test_block_reads.py, long_table), where level 1 and the eager op-by-op run give
    finite values: a compiler fault, not the code under test. Tests whose programs are
    cheap to compile but long to run (the 32768 x 32768 block-mask build: ~40 s at level
    0, ~2 s optimized) take it too. The programs compiled here are separate entries of the
    compilation caches (their options differ)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's caches of compiled programs after each test module. Every XLA:CPU
    executable keeps memory mappings of its own code; a worker that compiled a few
    hundred modules' programs reached the kernel's limit (vm.max_map_count, 65530 by
    default: ~100 mappings a second while test_attention runs) and aborted inside a
    later compile."""
    yield
    jax.clear_caches()
    gc.collect()


# Backends every attention test runs on. "pallas" needs a CUDA GPU (the device machine);
# CPU runs deselect it with `-m "not gpu"`.
BACKENDS = ["interpret", "xla", pytest.param("pallas", marks=pytest.mark.gpu)]

# Small tiles so that short test sequences still span many blocks, tails included.
SMALL_TILES = {"block_q": 16, "block_kv": 16}

# float32 kernels keep float32 arithmetic throughout (full-precision dots): compared with
# the float64 value they land within a few float32 ulps of the output scale.
FLOAT32_TOLERANCE = 2e-5


def random_qkv(seed, batch, q_len, kv_len, q_heads, kv_heads, head_dim, value_dim, dtype):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, q_len, q_heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, value_dim), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def golden(q, k, v, mask_mod=None, score_mod=None, scale=None):
    """The dense result in float64 (numpy arrays), from the same low-precision inputs."""
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
        dense = jax.jit(lambda q, k, v: reference_attention(
            q, k, v, mask_mod=mask_mod, score_mod=score_mod, scale=scale))
        out, lse = dense(q64, k64, v64)
        return np.asarray(out), np.asarray(lse)


def dense_low_precision(q, k, v, mask_mod=None, score_mod=None, scale=None):
    """What plain XLA attention does in q's dtype: scores, softmax and p.v all rounded to
    the input dtype (mods still see float32 scores). The accuracy bar for 16-bit inputs."""
    return jax.jit(lambda q, k, v: _dense_low_precision(q, k, v, mask_mod, score_mod, scale))(
        q, k, v)


def _dense_low_precision(q, k, v, mask_mod, score_mod, scale):
    dtype = q.dtype
    q_heads, kv_heads = q.shape[2], k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    k = jnp.repeat(k, q_heads // kv_heads, axis=2)
    v = jnp.repeat(v, q_heads // kv_heads, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=dtype) * jnp.asarray(scale, dtype)
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    b, h, qi, ki = np.meshgrid(np.arange(batch), np.arange(q_heads), np.arange(q_len),
                               np.arange(kv_len), indexing="ij")
    b, h, qi, ki = (jnp.asarray(x, jnp.int32) for x in (b, h, qi, ki))
    if score_mod is not None:
        scores = jax.vmap(score_mod)(scores.astype(jnp.float32).ravel(), b.ravel(), h.ravel(),
                                     qi.ravel(), ki.ravel()).reshape(scores.shape).astype(dtype)
    if mask_mod is not None:
        mask = jax.vmap(mask_mod)(b.ravel(), h.ravel(), qi.ravel(), ki.ravel()).reshape(scores.shape)
        scores = jnp.where(mask, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(jnp.isnan(weights), 0, weights).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v, preferred_element_type=dtype)


def rmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)))


def assert_close_to_golden(out, expected, q, k, v, mask_mod=None, score_mod=None, scale=None):
    """float32: elementwise within FLOAT32_TOLERANCE. 16-bit: RMSE against float64 no worse
    than the dense XLA computation's in that dtype."""
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), "output has NaN or inf"
    if q.dtype == jnp.float32:
        np.testing.assert_allclose(out, expected, atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)
        return
    baseline = dense_low_precision(q, k, v, mask_mod, score_mod, scale)
    ours, theirs = rmse(out, expected), rmse(baseline, expected)
    assert ours <= theirs, f"RMSE {ours:.3g} worse than dense {q.dtype} XLA's {theirs:.3g}"


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: every shard sees the same items
def pytest_collection_modifyitems(config, items):
    """The GPU runs' shard and smoke selection (tests/selection.py)."""
    selection.select(config, items)
