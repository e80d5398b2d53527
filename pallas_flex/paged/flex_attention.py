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

from pallas_flex import dispatch, sharding
from pallas_flex.api import (
    build_block_mask, call_results, check_aux, resolve_backend, resolve_scale,
    validate_block_mask)
from pallas_flex.kernels.config import resolve_options
from pallas_flex.kernels.reference import reference_attention
from pallas_flex.masks.mod_program import SCORE, make_mod_program
from pallas_flex.paged._validation import is_traced
from pallas_flex.paged.cache import PagedKVCache, _gather_contiguous
from pallas_flex.sinks import check_sinks, merge_sinks


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
    if cache.quantized and q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"q must be bfloat16, float16 or float32 over a quantized "
                         f"({cache.dtype}) cache, got {q.dtype}")
    if not cache.quantized and q.dtype != cache.dtype:
        raise ValueError(f"q must have the cache's dtype {cache.dtype}, got {q.dtype}")
    if q_len == 0 or q_heads == 0:
        raise ValueError(f"q must be non-empty, got shape {q.shape}")
    if q_heads % cache.kv_heads:
        raise ValueError(f"q's heads ({q_heads}) must be a multiple of the cache's KV heads "
                         f"({cache.kv_heads}) for grouped-query attention")


def _paged_attention_impl(q, k_pages, v_pages, page_table, lengths, block_mask,
                          score_program, scales, config):
    """scales: None, or a quantized cache's (k_scales, v_scales). config: (backend, scale,
    options, with_max); with_max adds the row max of the logits to (out, lse)."""
    backend, scale, options, with_max = config
    choice = dispatch.choose_forward(q, k_pages, v_pages, block_mask, score_program,
                                     backend=backend, options=options, paged=True,
                                     quantized=scales is not None, with_max=with_max)

    def attend(operands, offsets):
        q, k_pages, v_pages, page_table, lengths, block_mask, score_program, scales = operands
        block_mask, score_program, _ = sharding.shift_mods(block_mask, score_program, offsets)
        if choice.kernel != "decode":
            # Decode checks the length on every tile: clipping the BlockMask would cost
            # more (a few small XLA ops, ~15 us) than the check does in a 0.2 ms call.
            # Prefill: full tiles skip the length check once the BlockMask is clipped to
            # the lengths, and tiles past a row's length are not visited at all (the
            # clipping costs about 1 % of the H100 prefill in `pallas-flex bench paged`;
            # checking the length on every tile instead cost 5-6 % on the Triton kernel).
            block_mask = block_mask.clip_to_lengths(lengths)
        k_scales, v_scales = scales if scales is not None else (None, None)
        return dispatch.run_forward(choice, q, k_pages, v_pages, block_mask, score_program,
                                    scale=scale, options=options,
                                    interpret=backend == "interpret", page_table=page_table,
                                    lengths=lengths, k_scales=k_scales, v_scales=v_scales,
                                    with_max=with_max)

    # Tensor-parallel serving: a cache split over KV heads (pages [P, Hkv, page, D])
    # runs each device's heads on its own pages; batch rows share the page pool, so a
    # batch split is gathered.
    return sharding.call(
        attend, (q, k_pages, v_pages, page_table, lengths, block_mask, score_program, scales),
        (sharding.QUERY, sharding.PAGES, sharding.PAGES, sharding.WHOLE, sharding.WHOLE,
         sharding.roles_of(block_mask, None), sharding.WHOLE,
         None if scales is None else (sharding.PAGES, sharding.PAGES)),
        sharding.query_and_rows, batch=q.shape[0], q_heads=q.shape[2],
        kv_heads=k_pages.shape[1], split_batch=False)


_paged_attention = jax.custom_vjp(_paged_attention_impl, nondiff_argnums=(8,))


def _no_gradients(*args):
    raise ValueError("paged_flex_attention is for inference and has no gradients; train "
                     "with pallas_flex.attention on contiguous K/V")


_paged_attention.defvjp(lambda *args: (_paged_attention_impl(*args), None), _no_gradients)


@functools.partial(jax.jit, static_argnames=("config",))
def _paged_attention_jit(q, k_pages, v_pages, page_table, lengths, block_mask, score_program,
                         sinks=None, scales=None, *, config):
    out, lse, *row_max = _paged_attention(q, k_pages, v_pages, page_table, lengths,
                                          block_mask, score_program, scales, config)
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
    return (out, lse, *row_max)


@functools.partial(jax.jit, static_argnames=("scale", "with_max"))
def _gathered_reference(q, cache, block_mask, score_program, sinks=None, *, scale,
                        with_max=False):
    """The dense oracle ("reference" and "xla" backends): O(cache) memory, for tests."""
    k, v = _gather_contiguous(cache)  # checked by the caller when concrete
    mask_program = block_mask.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_program(b, h, q_idx, kv_idx) & (kv_idx < cache.lengths[b])

    out, lse, *row_max = reference_attention(q, k, v, mask_mod=mask_mod,
                                             score_mod=score_program, scale=scale,
                                             return_max=with_max)
    out = out.astype(q.dtype)
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
    return (out, lse, *row_max)


def paged_flex_attention(q, cache, *, mask_mod=None, score_mod=None, block_mask=None,
                         scale=None, return_lse=False, backend=None, kernel_options=None,
                         sinks=None, return_aux=None):
    """FlexAttention of q over the keys and values stored in a `PagedKVCache`.

    Args:
      q: [B, Sq, Hq, D] with B = cache.max_batch (row b attends to cache row b) and the
        cache's dtype (over a quantized int8 / float8 cache: bfloat16, float16 or
        float32, the kernels applying the per-token scales); Hq a multiple of the cache's
        KV heads.
      cache: the `PagedKVCache`; its logical length is `cache.max_seq_len`, and
        positions >= `cache.lengths[b]` are masked. A latent cache's values (its key
        pages' first Dv columns) are read from the key pages in place by the latent
        decode; the other kernels take that slice of the pages (a copy).
      mask_mod / block_mask: the mask over (q_idx in [0, Sq), logical kv_idx in
        [0, max_seq_len)); for decoding, shift queries to their absolute positions with
        `pallas_flex.masks.offset(mask_mod, positions)`. Pass one or neither.
      score_mod, scale, return_lse, kernel_options, sinks, return_aux: as in
        `pallas_flex.flex_attention` (the row max of `pf.AuxRequest(max_scores=True)`
        over the row's keys within its length).
      backend: "pallas" / "interpret" run the kernels on the pages in place; "xla" and
        "reference" gather the cache into contiguous arrays and compute densely
        (O(cache) memory: a correctness oracle, not a serving path).
    Returns:
      out [B, Sq, Hq, Dv], or (out, lse [B, Hq, Sq]) with return_lse=True, or
      (out, pf.AuxOutput) with return_aux. Inference
      only: differentiating raises a ValueError.

    Errors: besides shapes and arguments, a concrete cache's page table and lengths are
    checked (`PagedKVCache.validate`: entries -1 or in `[0, num_pages)`, each row's pages
    a prefix of its table row, `lengths[b]` within row b's reserved pages): a ValueError
    naming the row, the entry and the pool size. A traced cache (under `jit`) is not
    re-checked here: a check there is a `checkify.debug_check`, whose effect costs ~0.5
    ms of host dispatch per call on the H100 machine (3.4x a B8 decode step). The cache's
    own methods check the tables they write, under `jit` too, and the kernels clamp every
    entry into the pool, so a corrupt table never reads outside it; to check a traced
    cache, call `cache.validate()` inside a `checkify`-ed function. Whatever the pages
    hold past `lengths[b]` (a reused page's old contents) never reaches the output.

    Example:
      >>> step_mask = pf.masks.offset(pf.masks.causal_mask, cache.lengths - 1)
      >>> out = pf.paged.paged_flex_attention(q, cache, mask_mod=step_mask)
    """
    _validate(q, cache)
    if not is_traced(cache.page_table, cache.lengths):  # see "Errors" above
        cache.validate()
    batch, q_len, q_heads, head_dim = q.shape
    kv_len = cache.max_seq_len
    if mask_mod is not None and block_mask is not None:
        raise ValueError("pass either mask_mod or block_mask, not both")
    options = resolve_options(kernel_options, max(head_dim, cache.value_dim), q.dtype)
    if block_mask is None:
        block_mask = build_block_mask(mask_mod, batch, q_heads, q_len, kv_len, kernel_options)
    reference_k = jax.ShapeDtypeStruct((batch, kv_len, cache.kv_heads, head_dim), q.dtype)
    validate_block_mask(block_mask, q, reference_k)
    score_program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
    backend = resolve_backend(backend)
    scale = resolve_scale(scale, head_dim)
    sinks = check_sinks(sinks, q_heads)
    with_max = check_aux(return_aux, return_lse)
    if backend in ("pallas", "interpret"):
        dispatch.check_mods_run_on_tiles(block_mask, score_program)
        scales = (cache.k_scales, cache.v_scales) if cache.quantized else None
        if cache.latent:  # the latent decode reads the values from the key pages
            options = options.replace(values_in_keys=True)
        out, lse, *row_max = _paged_attention_jit(
            q, cache.k_pages, cache.value_pages(), cache.page_table, cache.lengths,
            block_mask, score_program, sinks, scales,
            config=(backend, scale, options, with_max))
    else:
        out, lse, *row_max = _gathered_reference(q, cache, block_mask, score_program, sinks,
                                                 scale=scale, with_max=with_max)
    return call_results(out, lse, row_max, return_lse, return_aux)


__all__ = ["paged_flex_attention"]
