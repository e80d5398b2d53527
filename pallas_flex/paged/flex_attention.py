"""FlexAttention over a paged KV cache: any BlockMask and mods, read through the page table.

The BlockMask and the mods are written for *logical* positions (position p of row b
is the p-th token stored for that row) and stay that way: the kernels translate each KV
tile's logical rows to physical pages when they load it, so mods see logical indices,
block sparsity still skips whole tiles, and nothing is gathered or copied. Positions at
or past `cache.lengths[b]` are masked automatically.

Short queries (decoding) run the split-KV decode kernel, longer ones (prefill on top of
a cache) the forward kernel; both read the pages in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flex.api import (
    build_block_mask, resolve_backend, resolve_scale, uses_decode_kernel, validate_block_mask)
from pallas_flex.kernels.config import resolve_options
from pallas_flex.kernels.decode import flex_decode
from pallas_flex.kernels.forward import flex_attention_forward
from pallas_flex.kernels.reference import reference_attention
from pallas_flex.kernels.tile_mods import captured_read_positions
from pallas_flex.masks.block_mask import EMPTY, FULL, PARTIAL, BlockMask
from pallas_flex.masks.mod_program import SCORE, make_mod_program
from pallas_flex.paged.cache import PagedKVCache, gather_contiguous


def _validate(q, cache):
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a pallas_flex.paged.PagedKVCache, got "
                         f"{type(cache).__name__}")
    if not hasattr(q, "shape") or len(q.shape) != 4:
        raise ValueError(f"q must be a 4-D array [B, Sq, Hq, D], got shape "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    batch, q_len, q_heads, head_dim = q.shape
    if batch != cache.max_batch:
        raise ValueError(f"q must have one batch row per cache row: batch {cache.max_batch}, "
                         f"got {batch}")
    if head_dim != cache.head_dim:
        raise ValueError(f"q's head dim must equal the cache's ({cache.head_dim}), got {head_dim}")
    if q.dtype != cache.dtype:
        raise ValueError(f"q must have the cache's dtype {cache.dtype}, got {q.dtype}")
    if q_len == 0 or q_heads == 0:
        raise ValueError(f"q must be non-empty, got shape {q.shape}")
    if q_heads % cache.kv_heads:
        raise ValueError(f"q's heads ({q_heads}) must be a multiple of the cache's KV heads "
                         f"({cache.kv_heads}) for grouped-query attention")


def clip_block_mask_to_lengths(block_mask, lengths):
    """The BlockMask per batch row with blocks at or past `lengths[b]` dropped and full
    blocks that cross it made partial, so that the kernels check the length on partial
    tiles only (and skip the empty tail of short rows)."""
    state = block_mask.block_state()
    batch = lengths.shape[0]
    state = jnp.broadcast_to(state, (batch,) + state.shape[1:])
    mask_block_kv = block_mask.block_size[1]
    starts = jnp.arange(state.shape[-1], dtype=jnp.int32) * mask_block_kv
    length = lengths.astype(jnp.int32)[:, None, None, None]
    beyond = starts >= length
    crossing = starts + mask_block_kv > length
    state = jnp.where(beyond, EMPTY, jnp.where(crossing & (state == FULL), PARTIAL, state))
    # Runs inside every paged call. On the H100 (prefill, 2048 new tokens on 6144 cached)
    # the contiguous call with this clipping added measured 0.80-0.85 ms against
    # 0.77-0.84 without (noisy); listing the tables with a scan instead of argsorts made
    # no measurable difference (benchmarks/probe_paged_mosaic.py).
    return BlockMask.from_block_state(state.astype(jnp.int8), block_size=block_mask.block_size,
                                      seq_lengths=block_mask.shape[2:],
                                      mask_mod=block_mask.mask_mod)


def _paged_attention_impl(q, k_pages, v_pages, page_table, lengths, block_mask,
                          score_program, config):
    backend, scale, options = config
    kwargs = dict(scale=scale, options=options, interpret=backend == "interpret",
                  page_table=page_table, lengths=lengths)
    if uses_decode_kernel(q.shape[1], block_mask, options):
        # Decode checks the length on every tile: clipping the BlockMask would cost more
        # (a few small XLA ops, ~15 us) than the check does in a 0.2 ms call.
        return flex_decode(q, k_pages, v_pages, block_mask, score_program, **kwargs)
    # Prefill: full tiles skip the length check once the BlockMask is clipped to the
    # lengths (measured: paged +5-6 % -> within 0.5 % of contiguous at pages of 64, 128).
    block_mask = clip_block_mask_to_lengths(block_mask, lengths)
    return flex_attention_forward(q, k_pages, v_pages, block_mask, score_program, **kwargs)


_paged_attention = jax.custom_vjp(_paged_attention_impl, nondiff_argnums=(7,))


def _no_gradients(*args):
    raise ValueError("paged_flex_attention is for inference and has no gradients; train "
                     "with pallas_flex.attention on contiguous K/V")


_paged_attention.defvjp(lambda *args: (_paged_attention_impl(*args), None), _no_gradients)


@functools.partial(jax.jit, static_argnames=("config",))
def _paged_attention_jit(q, k_pages, v_pages, page_table, lengths, block_mask, score_program,
                         *, config):
    return _paged_attention(q, k_pages, v_pages, page_table, lengths, block_mask,
                            score_program, config)


@functools.partial(jax.jit, static_argnames=("scale",))
def _gathered_reference(q, cache, block_mask, score_program, *, scale):
    """The dense oracle ("reference" and "xla" backends): O(cache) memory, for tests."""
    k, v = gather_contiguous(cache)
    mask_program = block_mask.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_program(b, h, q_idx, kv_idx) & (kv_idx < cache.lengths[b])

    out, lse = reference_attention(q, k, v, mask_mod=mask_mod, score_mod=score_program,
                                   scale=scale)
    return out.astype(q.dtype), lse


def paged_flex_attention(q, cache, *, mask_mod=None, score_mod=None, block_mask=None,
                         scale=None, return_lse=False, backend=None, kernel_options=None):
    """FlexAttention of q over the keys and values stored in a `PagedKVCache`.

    Args:
      q: [B, Sq, Hq, D] with B = cache.max_batch (row b attends to cache row b) and the
        cache's dtype; Hq a multiple of the cache's KV heads.
      cache: the `PagedKVCache`; its logical length is `cache.max_seq_len`, and
        positions >= `cache.lengths[b]` are masked.
      mask_mod / block_mask: the mask over (q_idx in [0, Sq), logical kv_idx in
        [0, max_seq_len)); for decoding, shift queries to their absolute positions with
        `pallas_flex.masks.offset(mask_mod, positions)`. Pass one or neither.
      score_mod, scale, return_lse, kernel_options: as in `pallas_flex.flex_attention`.
      backend: "pallas" / "interpret" run the kernels on the pages in place; "xla" and
        "reference" gather the cache into contiguous arrays and compute densely
        (O(cache) memory: a correctness oracle, not a serving path).
    Returns:
      out [B, Sq, Hq, Dv], or (out, lse [B, Hq, Sq]) with return_lse=True. Inference
      only: differentiating raises a ValueError.

    Example:
      >>> step_mask = pf.masks.offset(pf.masks.causal_mask, cache.lengths - 1)
      >>> out = pf.paged.paged_flex_attention(q, cache, mask_mod=step_mask)
    """
    _validate(q, cache)
    batch, q_len, q_heads, head_dim = q.shape
    kv_len = cache.max_seq_len
    if mask_mod is not None and block_mask is not None:
        raise ValueError("pass either mask_mod or block_mask, not both")
    options = resolve_options(kernel_options, max(head_dim, cache.value_dim))
    if block_mask is None:
        block_mask = build_block_mask(mask_mod, batch, q_heads, q_len, kv_len, kernel_options)
    reference_k = jax.ShapeDtypeStruct((batch, kv_len, cache.kv_heads, head_dim), q.dtype)
    validate_block_mask(block_mask, q, reference_k)
    score_program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
    backend = resolve_backend(backend)
    scale = resolve_scale(scale, head_dim)
    if backend in ("pallas", "interpret"):
        captured_read_positions(block_mask.mask_mod)
        captured_read_positions(score_program)
        out, lse = _paged_attention_jit(q, cache.k_pages, cache.v_pages, cache.page_table,
                                        cache.lengths, block_mask, score_program,
                                        config=(backend, scale, options))
    else:
        out, lse = _gathered_reference(q, cache, block_mask, score_program, scale=scale)
    return (out, lse) if return_lse else out


__all__ = ["paged_flex_attention"]
