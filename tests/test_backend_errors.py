"""backend="pallas" without a GPU is a ValueError that says what to use instead.

Without it, the call ends deep in JAX's Pallas lowering with "Only interpret mode is
supported on CPU backend". Every entry point that takes a `backend` says the same, eagerly
and under `jit`; "interpret" and "xla" still run, and lowering the kernels for a GPU
from this machine (benchmarks/inspect_kernels.py, tests/test_inspect_kernels.py) still
works inside `pallas_flex.api.lowering_for_gpu()`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_flex as pf
from pallas_flex import masks

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu",
                                reason="checks the error raised on a machine without a GPU")

NEEDS_A_GPU = (rf'backend="pallas" needs a GPU \(jax.default_backend\(\) is '
               rf'"{jax.default_backend()}"\); use backend="interpret" to run the kernels in '
               r'the Pallas interpreter, or "xla"')

B, S, H, D = 1, 32, 2, 16


def _qkv(q_len=S, kv_len=S):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (B, q_len, H, D)),
            jax.random.normal(keys[1], (B, kv_len, H, D)),
            jax.random.normal(keys[2], (B, kv_len, H, D)))


def _attention(q, k, v):
    return pf.attention(q, k, v, mask_mod=masks.causal_mask, backend="pallas")


def _flex_attention(q, k, v):
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, S, S, block_size=16)
    return pf.flex_attention(q, k, v, block_mask=block_mask, backend="pallas")


def _decode(q, k, v):  # one query token: the split-KV decode kernel's path
    return pf.attention(q[:, :1], k, v, backend="pallas")


def _cascade(q, k, v):
    return pf.cascade_attention(q[:, :1], k[:1], v[:1], k, v, backend="pallas")


def _paged(q, k, v):
    cache = pf.paged.PagedKVCache.create(num_pages=4, page_size=16, max_batch=B,
                                         max_pages_per_seq=2, kv_heads=H, head_dim=D,
                                         dtype=jnp.float32)
    return pf.paged.paged_flex_attention(q[:, :1], cache, backend="pallas")


ENTRY_POINTS = {"attention": _attention, "flex_attention": _flex_attention,
                "decode": _decode, "cascade_attention": _cascade,
                "paged_flex_attention": _paged}


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_pallas_backend_without_a_gpu(entry, jitted):
    fn = ENTRY_POINTS[entry]
    with pytest.raises(ValueError, match=NEEDS_A_GPU):
        (jax.jit(fn) if jitted else fn)(*_qkv())


def test_ragged_paged_attention_pallas_backend_without_a_gpu():
    tokens, block_size = 4, 8
    keys = jax.random.split(jax.random.key(1), 5)
    with pytest.raises(ValueError, match=NEEDS_A_GPU):
        pf.paged.paged_attention(
            jax.random.normal(keys[0], (tokens, H * D)),
            jax.random.normal(keys[1], (tokens, H * D)),
            jax.random.normal(keys[2], (tokens, H * D)),
            jax.random.normal(keys[3], (2, H, block_size, D)),
            jax.random.normal(keys[4], (2, H, block_size, D)),
            past_lens=jnp.array([0]), subsequence_begins=jnp.array([0, tokens]),
            block_indices=jnp.array([1]), block_indices_begins=jnp.array([0, 1]),
            backend="pallas")


@pytest.mark.parametrize("backend", ["interpret", "xla", None])
def test_other_backends_still_run_without_a_gpu(backend):
    q, k, v = _qkv()
    out = pf.attention(q, k, v, mask_mod=masks.causal_mask, backend=backend)
    expected = pf.attention(q, k, v, mask_mod=masks.causal_mask, backend="reference")
    assert jnp.allclose(out, expected, atol=1e-5)


def test_tracing_to_lower_for_a_gpu_from_this_machine_is_still_allowed():
    """Inside lowering_for_gpu() backend="pallas" traces (tests/test_inspect_kernels.py
    lowers what it traces for an H100); outside it, the error comes back."""
    q = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)
    with pf.api.lowering_for_gpu():
        traced = jax.jit(_attention).trace(q, q, q)
    assert "pallas_call" in str(traced.jaxpr)
    # A new function: jit would hand back the trace cached for _attention above.
    with pytest.raises(ValueError, match=NEEDS_A_GPU):
        jax.jit(lambda q, k, v: _attention(q, k, v)).trace(q, q, q)
