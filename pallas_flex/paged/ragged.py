"""paged_attention: ragged mixed prefill + decode over a paged KV cache.

The varlen paged op of OpenVINO's PagedAttention spec, in JAX: one call serves any mix
of sequences (prompt chunks, decode steps), all tokens packed along one axis. The call
runs in four stages:

  (a) validate shapes (always `ValueError`) and metadata (`ValueError` when concrete,
      `checkify.debug_check` when traced; see `pallas_flex.paged._validation`);
  (b) scatter the new keys and values into the caches at their positions;
  (c) attend from the caches (now holding history and new tokens): the ragged Pallas
      kernel (`pallas_flex.kernels.ragged_paged`, backends "pallas" and "interpret") or, on
      "xla", a loop over logical pages with an online softmax in float32;
  (d) optionally, a second pass over the same pages for the aggregated scores.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flex import sharding
from pallas_flex.sinks import check_sinks, merge_sinks
from pallas_flex.api import resolve_backend
from pallas_flex.kernels import device, online_softmax
from pallas_flex.kernels import ragged_paged as ragged_kernel
from pallas_flex.kernels import rotate_blocks as rotate_kernel
from pallas_flex.paged.quantize import dequantize, is_quantized, quantize
from pallas_flex.paged._validation import (
    as_index_scalar, as_index_vector, checking_arrays, first_true, is_traced, require)

_BACKENDS = (None, "pallas", "interpret", "xla")


def paged_attention(query, key, value, key_cache, value_cache, past_lens, subsequence_begins,
                    block_indices, block_indices_begins, *, scale=None, sliding_window=0,
                    alibi_slopes=None, score_aggregation_window=None, return_scores=False,
                    backend=None, num_splits=None, rotated_block_indices=None,
                    rotation_deltas=None, rotation_trig_lut=None, rotation_in_cache=True,
                    sinks=None, key_cache_scales=None, value_cache_scales=None):
    """Attention for a packed batch of new tokens over their sequences' paged history.

    Sequence `s` owns the new tokens `subsequence_begins[s] : subsequence_begins[s+1]`
    (`new_len[s]` of them) and the cache blocks `block_indices[block_indices_begins[s] :
    block_indices_begins[s+1]]`, in logical order. Its `i`-th new token sits at position
    `pos = past_lens[s] + i`: its key and value are written into the caches there
    (block `block_indices[block_indices_begins[s] + pos // block_size]`, offset
    `pos % block_size`), then it attends to positions `[max(0, pos + 1 - sliding_window),
    pos]` of its own sequence (all of `[0, pos]` when `sliding_window` is 0).

    Args:
      query: [T, Hq * D] (token-major; heads are contiguous D-sized chunks).
      key: [T, Hkv * D]; value: [T, Hkv * Dv]. Query head h reads kv head h // (Hq/Hkv).
      key_cache: [num_blocks, Hkv, block_size, D]; value_cache: [num_blocks, Hkv,
        block_size, Dv]. query, key, value and both caches share one float dtype.
      past_lens: int [num_seqs], tokens each sequence already has in the cache.
      subsequence_begins: int [num_seqs + 1], non-decreasing, from 0 to T. Sequences with
        no new tokens are allowed (they only contribute zeros to `scores`).
      block_indices: int [num_listed_blocks], physical block ids.
      block_indices_begins: int [num_seqs + 1], non-decreasing, ending at most at
        num_listed_blocks; each sequence needs `ceil((past_lens[s] + new_len[s]) /
        block_size)` blocks, in range `[0, num_blocks)`.
      scale: None (1/sqrt(D)), a Python number or a float scalar array (may be traced).
      sliding_window: int or int scalar array >= 0; 0 = unlimited.
      alibi_slopes: None, or float [Hq] (one slope per query head) or [1] (shared); adds
        `slope_h * (key_pos - query_pos)` to the scaled scores. (The spec's
        [num_kv_heads] is the Hq = Hkv case.)
      score_aggregation_window: None, an int, or an int array [num_seqs]: the scores of
        sequence s sum over its last `window[s]` new tokens (all of them when None or
        <= 0).
      return_scores: also return the scores (below).
      backend: "pallas" (the ragged Pallas kernel, GPU), "interpret" (the same kernel in
        Pallas interpret mode), "xla" (a blockwise jnp loop, any device), or None:
        "pallas" on a GPU, else "xla". Scores (when asked for) are a second blockwise
        pass in jnp from the attention's lse, on every backend.
      rotated_block_indices, rotation_deltas, rotation_trig_lut: the spec's inputs 13-15,
        all three or none. They re-rotate the RoPE of cached keys whose positions moved
        (after cache eviction): before the new tokens are written, the key at offset
        `off` of block `rotated_block_indices[i]` (int [R], physical block ids, each at
        most once) is rotated by row `r = rotation_deltas[i, off]` (int [R, block_size])
        or `rotation_deltas[i, 0]` (int [R, 1]) of `rotation_trig_lut` (float [rows, D],
        cosines then sines): each pair (2j, 2j + 1) becomes (x0 c - x1 s, x0 s + x1 c)
        with c = lut[r, j], s = lut[r, D / 2 + j]. As in OpenVINO, the rotation is made
        in the cache (the returned key_cache holds the rotated keys, so later steps read
        them as they are), by a scatter over the listed blocks alone; values are not
        rotated.
      rotation_in_cache: True (the default, the spec's contract above), or False: the
        listed blocks' cached keys (positions below past_lens; not the new tokens) are
        rotated in the attention's key reads only, and the returned key_cache keeps them
        as they were. Nothing is written: a step pays for the listed blocks' LUT rows
        and their rotation on every tile that holds one, not a pass over the cache
        (on the H100 slower than the in-cache pass: 1.14-1.26x the call without
        rotation at 10 % of the blocks listed, against 1.02-1.14x). The caller then
        keeps the cache unrotated and passes, every step, each listed block's rotation
        from its stored keys (the deltas accumulated since they were written, not the
        step's change). On an 8-bit cache the stored keys are rotated as read, before
        their scales (which a rotation within the vector commutes with), and neither
        keys nor scales are rewritten.
      sinks: None, or float [Hq]: a logit per query head in every token's softmax with
        no value (attention sinks, as gpt-oss and OpenVINO's `sinks` input): weights
        become exp(s) / (sum exp(s) + exp(sink)), and `scores` count the keys' weights
        only.
      key_cache_scales, value_cache_scales: float32 [num_blocks, Hkv, block_size], for
        int8 or float8_e4m3fn caches (KV-cache compression; `pallas_flex.paged.quantize`):
        one scale per stored token and head; the new tokens are quantized when written
        and their scales set; query, key and value stay 16/32-bit. Both or neither.
        With the rotation inputs, the rotated blocks' keys are dequantized (float32),
        rotated and quantized again (new scales per slot and head, as a write computes
        them); the returned key_cache_scales hold the new scales, other blocks' keys and
        scales are returned unchanged.
      num_splits: programs that share one work item's KV blocks in the Pallas kernel
        (split-KV, merged exactly), or None to choose from the work (about 256
        programs); a Python int >= 1. Ignored by "xla".
    Returns:
      `(output, key_cache, value_cache)`, or `(output, scores, key_cache, value_cache)`
      with `return_scores=True`:
      output: [T, Hq * Dv] in query's dtype.
      key_cache, value_cache: the caches with the new tokens written (same shapes and
        dtype; with `jax.jit(..., donate_argnums=...)` the write happens in place).
        With quantized caches, their scales follow: `(..., key_cache, value_cache,
        key_cache_scales, value_cache_scales)`.
      scores: float32 [num_listed_blocks * block_size]. Per sequence, in sequence
        order, `past_lens[s] + new_len[s]` entries: the softmax weight each position
        received, summed over query heads and over the counted new tokens. The spec's
        output is these entries concatenated (`sum(past_lens) + T` of them, a
        data-dependent length); here they start at offset 0 of a fixed-size buffer
        (enough for every listed block), the rest is zero, so the shape is the same
        eagerly and under `jit`. `score_offsets` gives where each sequence starts.
        float32 rather than the spec's T: the entries are sums of many weights, kept in
        float32 like this package's lse.

    Errors: wrong shapes, dtypes, head counts or options, and zero sequences (past_lens
    of length 0), raise `ValueError`. Bad metadata (begins not monotone or not spanning
    the T tokens, negative past_lens, a sequence longer than its blocks, a block index
    out of range, two new tokens written to one cache slot, a negative sliding window, a
    non-finite scale) raises `ValueError` when the metadata is concrete; under `jit` the same checks are `checkify.debug_check`s, reported by
    `jax.experimental.checkify.checkify(fn)` and free otherwise. Unchecked bad metadata
    under `jit` never reads or writes out of bounds, but its results are unspecified.
    Whatever a listed block holds past its sequence's context (`past_lens[s] +
    new_len[s]`; a reused block's stale contents, NaN included) never reaches the output
    or the scores, on every backend.

    Example (two sequences: an 8-token prompt, and one decode step after 13 tokens):
      >>> out, k_cache, v_cache = paged_attention(
      ...     q, k, v, k_cache, v_cache,                   # q [9, Hq*D], k/v [9, Hkv*D]
      ...     past_lens=jnp.array([0, 13]), subsequence_begins=jnp.array([0, 8, 9]),
      ...     block_indices=jnp.array([5, 2, 7]),          # block_size 8: 1 + 2 blocks
      ...     block_indices_begins=jnp.array([0, 1, 3]))
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    backend = resolve_backend(backend)
    if backend == "interpret":  # its kernel indexes q, k, v and the caches themselves
        sharding.refuse_varying_on_the_interpreter(
            "paged_attention's inputs", query, key, value, key_cache, value_cache)
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a Python int >= 1, got {num_splits!r}")
    if not isinstance(return_scores, (bool, np.bool_)):
        raise ValueError(f"return_scores must be a Python bool (under jit, a static argument: "
                         f"static_argnames=('return_scores',)), got "
                         f"{type(return_scores).__name__}")
    cache_scales = _validate_arrays(query, key, value, key_cache, value_cache,
                                    key_cache_scales, value_cache_scales)
    num_seqs = _num_seqs(past_lens)
    past_lens = as_index_vector(past_lens, "past_lens", num_seqs)
    subsequence_begins = as_index_vector(subsequence_begins, "subsequence_begins", num_seqs + 1)
    block_indices = as_index_vector(block_indices, "block_indices")
    block_indices_begins = as_index_vector(block_indices_begins, "block_indices_begins",
                                           num_seqs + 1)
    head_dim = key_cache.shape[3]
    scale = _resolve_scale(scale, head_dim)
    sliding_window = as_index_scalar(sliding_window, "sliding_window")
    alibi_slopes = _resolve_alibi(alibi_slopes, query.shape[1] // head_dim)
    aggregation_window = _resolve_window(score_aggregation_window, num_seqs)
    _validate_metadata(past_lens, subsequence_begins, block_indices, block_indices_begins,
                       num_tokens=query.shape[0], num_blocks=key_cache.shape[0],
                       block_size=key_cache.shape[2], sliding_window=sliding_window)
    rotation = _resolve_rotation(rotated_block_indices, rotation_deltas, rotation_trig_lut,
                                 key_cache)
    if not isinstance(rotation_in_cache, (bool, np.bool_)):
        raise ValueError(f"rotation_in_cache must be a Python bool, got "
                         f"{type(rotation_in_cache).__name__}")
    sinks = check_sinks(sinks, query.shape[1] // head_dim)
    return _paged_attention_jit(
        query, key, value, key_cache, value_cache, past_lens, subsequence_begins,
        block_indices, block_indices_begins, scale, sliding_window, alibi_slopes,
        aggregation_window, rotation, sinks, cache_scales, return_scores=bool(return_scores),
        backend=backend, num_splits=num_splits or 0,
        rotation_in_reads=rotation is not None and not rotation_in_cache)


def score_offsets(past_lens, subsequence_begins):
    """int32 [num_seqs + 1]: where each sequence's entries start in `paged_attention`'s
    scores (the last entry is `sum(past_lens) + T`, the number of meaningful entries)."""
    past_lens = as_index_vector(past_lens, "past_lens")
    subsequence_begins = as_index_vector(subsequence_begins, "subsequence_begins",
                                         past_lens.shape[0] + 1)
    context = past_lens + jnp.diff(subsequence_begins)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(context, dtype=jnp.int32)])


# -- (a) validation ------------------------------------------------------------------------


def _validate_arrays(query, key, value, key_cache, value_cache, key_cache_scales=None,
                     value_cache_scales=None):
    """Checks the arrays; returns the caches' (key, value) scales or None."""
    arrays = (("query", query, 2, "[T, Hq * D]"), ("key", key, 2, "[T, Hkv * D]"),
              ("value", value, 2, "[T, Hkv * Dv]"),
              ("key_cache", key_cache, 4, "[num_blocks, Hkv, block_size, D]"),
              ("value_cache", value_cache, 4, "[num_blocks, Hkv, block_size, Dv]"))
    for name, x, rank, layout in arrays:
        if not hasattr(x, "shape") or len(x.shape) != rank:
            raise ValueError(f"{name} must be a {rank}-D array {layout}, got shape "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    quantized = (key_cache_scales is not None or value_cache_scales is not None
                 or is_quantized(key_cache.dtype) or is_quantized(value_cache.dtype))
    checked = arrays[:3] if quantized else arrays
    for name, x, _, _ in checked:
        if jnp.dtype(x.dtype) not in device.SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    dtypes = [x.dtype for _, x, _, _ in checked]
    if len(set(dtypes)) != 1:
        names = [n for n, *_ in checked]
        raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must share a dtype, "
                         f"got {', '.join(str(d) for d in dtypes)}")
    cache_scales = None
    if quantized:
        if key_cache.dtype != value_cache.dtype or not is_quantized(key_cache.dtype):
            raise ValueError(f"quantized caches must both be int8 or float8_e4m3fn, got "
                             f"{key_cache.dtype} and {value_cache.dtype}")
        expected = tuple(key_cache.shape[:3])
        for name, x in (("key_cache_scales", key_cache_scales),
                        ("value_cache_scales", value_cache_scales)):
            if x is None or tuple(getattr(x, "shape", ())) != expected or \
                    jnp.dtype(x.dtype) != jnp.float32:
                raise ValueError(f"{name} must be float32 [num_blocks, Hkv, block_size] = "
                                 f"{list(expected)} for {key_cache.dtype} caches, got "
                                 f"{getattr(x, 'shape', x)}")
        cache_scales = (key_cache_scales, value_cache_scales)
    num_blocks, kv_heads, block_size, head_dim = key_cache.shape
    if 0 in key_cache.shape or 0 in value_cache.shape:
        raise ValueError(f"key_cache and value_cache must be non-empty, got shapes "
                         f"{key_cache.shape} and {value_cache.shape}")
    if value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(f"value_cache must have key_cache's [num_blocks, Hkv, block_size] = "
                         f"{list(key_cache.shape[:3])}, got {list(value_cache.shape[:3])}")
    value_dim = value_cache.shape[3]
    num_tokens = query.shape[0]
    for name, x in (("key", key), ("value", value)):
        if x.shape[0] != num_tokens:
            raise ValueError(f"{name} must have query's {num_tokens} tokens, got {x.shape[0]}")
    if key.shape[1] != kv_heads * head_dim:
        raise ValueError(f"key must have shape [T, Hkv * D] = [{num_tokens}, "
                         f"{kv_heads * head_dim}] (key_cache has {kv_heads} heads of dim "
                         f"{head_dim}), got {key.shape}")
    if value.shape[1] != kv_heads * value_dim:
        raise ValueError(f"value must have shape [T, Hkv * Dv] = [{num_tokens}, "
                         f"{kv_heads * value_dim}] (value_cache has {kv_heads} heads of dim "
                         f"{value_dim}), got {value.shape}")
    query_width = query.shape[1]
    if query_width == 0 or query_width % (kv_heads * head_dim):
        raise ValueError(f"query's width ({query_width}) must be Hq * D with D = {head_dim} "
                         f"(key_cache's head dim) and Hq a positive multiple of Hkv = "
                         f"{kv_heads}")
    return cache_scales


def _num_seqs(past_lens):
    shape = getattr(past_lens, "shape", None)
    if shape is None:
        shape = np.shape(past_lens)
    if len(shape) != 1:
        raise ValueError(f"past_lens must be a 1-D integer array [num_seqs], got shape "
                         f"{tuple(shape)}")
    if shape[0] == 0:
        raise ValueError("past_lens must list at least one sequence, got 0 sequences "
                         "(past_lens of length 0); a step with nothing to attend needs no "
                         "call")
    return shape[0]


def _resolve_scale(scale, head_dim):
    if scale is None:
        return jnp.float32(1.0 / math.sqrt(head_dim))
    if isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, bool):
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        return jnp.float32(scale)
    if hasattr(scale, "shape") and scale.shape == () and jnp.issubdtype(scale.dtype, jnp.floating):
        # A concrete array is checked at once; a traced one by a checkify.debug_check.
        require(jnp.isfinite(scale) if is_traced(scale) else np.isfinite(np.asarray(scale)),
                "scale must be finite, got {value}", value=scale)
        return jnp.asarray(scale, jnp.float32)
    raise ValueError(f"scale must be None, a Python number or a float scalar array, got "
                     f"{getattr(scale, 'shape', type(scale).__name__)}")


def _resolve_alibi(alibi_slopes, q_heads):
    if alibi_slopes is None:
        # Zero slopes rather than None: one compiled program serves both cases, at the
        # price of a multiply-add per score.
        return jnp.zeros((q_heads,), jnp.float32)
    if not hasattr(alibi_slopes, "shape"):
        alibi_slopes = np.asarray(alibi_slopes)
    shape, dtype = tuple(alibi_slopes.shape), alibi_slopes.dtype
    if shape not in ((q_heads,), (1,)) or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"alibi_slopes must be a float array of shape ({q_heads},) (one slope "
                         f"per query head) or (1,) (shared), got shape {shape} and dtype "
                         f"{dtype}")
    return jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (q_heads,))


def _resolve_window(window, num_seqs):
    if window is None:
        return jnp.zeros((num_seqs,), jnp.int32)
    if hasattr(window, "shape") and len(window.shape) == 1:
        return as_index_vector(window, "score_aggregation_window", num_seqs)
    if hasattr(window, "shape") and len(window.shape) > 1:
        raise ValueError(f"score_aggregation_window must be None, an int or an int array "
                         f"[num_seqs] = [{num_seqs}], got shape {tuple(window.shape)}")
    return jnp.broadcast_to(as_index_scalar(window, "score_aggregation_window"), (num_seqs,))


def _resolve_rotation(rotated_block_indices, rotation_deltas, rotation_trig_lut, key_cache):
    """(indices int32 [R], deltas int32 [R, block_size] within the LUT's rows, lut
    float32 [rows, D]) of the spec's inputs 13-15, checked (None when none is given)."""
    given = {"rotated_block_indices": rotated_block_indices,
             "rotation_deltas": rotation_deltas, "rotation_trig_lut": rotation_trig_lut}
    if all(value is None for value in given.values()):
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(f"rotated_block_indices, rotation_deltas and rotation_trig_lut go "
                         f"together: {', '.join(missing)} missing")
    num_blocks, _, block_size, head_dim = key_cache.shape
    indices = as_index_vector(rotated_block_indices, "rotated_block_indices")
    rotated = indices.shape[0]
    deltas, lut = rotation_deltas, rotation_trig_lut
    if not hasattr(deltas, "shape"):
        deltas = np.asarray(deltas)
    if (len(deltas.shape) != 2 or deltas.shape[0] != rotated
            or deltas.shape[1] not in (block_size, 1)
            or not jnp.issubdtype(deltas.dtype, jnp.integer)):
        raise ValueError(f"rotation_deltas must be an int array [{rotated}, {block_size}] or "
                         f"[{rotated}, 1] (one row per rotated block: per slot, or one for "
                         f"the block), got shape {tuple(deltas.shape)} and dtype "
                         f"{deltas.dtype}")
    if not hasattr(lut, "shape"):
        lut = np.asarray(lut)
    if (len(lut.shape) != 2 or lut.shape[1] != head_dim or lut.shape[0] < 1
            or not jnp.issubdtype(lut.dtype, jnp.floating)):
        raise ValueError(f"rotation_trig_lut must be a float array [rows >= 1, {head_dim}] "
                         f"(key_cache's head size: cosines, then sines), got shape "
                         f"{tuple(lut.shape)} and dtype {lut.dtype}")
    if head_dim % 2:
        raise ValueError(f"rotating keys pairs their features: the head size must be even, "
                         f"got {head_dim}")
    rows = lut.shape[0]
    xp, (checked_indices, checked_deltas) = checking_arrays(indices, deltas)
    bad = (checked_indices < 0) | (checked_indices >= num_blocks)
    index = first_true(bad)
    require(~xp.any(bad), "rotated_block_indices[{index}] = {value} is out of range "
            f"[0, {num_blocks}) (key_cache.shape[0])", index=index,
            value=checked_indices[index] if rotated else 0)
    flat = checked_deltas.reshape(-1)
    bad = (flat < 0) | (flat >= rows)
    index = first_true(bad)
    require(~xp.any(bad), "rotation_deltas entry {index} (flattened) = {value} is not a "
            f"row of rotation_trig_lut [0, {rows})", index=index,
            value=flat[index] if flat.shape[0] else 0)
    if rotated > 1:
        ordered = xp.sort(checked_indices)
        same = ordered[1:] == ordered[:-1]
        require(~xp.any(same), "rotated_block_indices lists block {value} twice",
                value=ordered[first_true(same)])
    # Clamped into the LUT here, once: unchecked metadata under jit never reads past it.
    deltas = jnp.broadcast_to(jnp.clip(jnp.asarray(deltas, jnp.int32), 0, rows - 1),
                              (rotated, block_size))
    return indices, deltas, jnp.asarray(lut, jnp.float32)


def _rotate_blocks(key_cache, indices, deltas, lut, key_scales=None):
    """key_cache with the keys of blocks `indices` [R] rotated by LUT rows `deltas`
    [R, block_size], pairs (2j, 2j + 1) by (cos, sin) = (lut[r, j], lut[r, D/2 + j]),
    in float32; a scatter over those blocks alone, in place (`_store`: entries clamped
    into the pool when read, out of range ones dropped when written, so unchecked
    metadata under jit never reads or writes outside it).

    With `key_scales` [num_blocks, Hkv, block_size] (an int8 / float8 cache) the listed
    blocks' keys are dequantized (values times scales, float32), rotated, and quantized
    again as `quantize` does when a token is written (a new scale per slot and head).
    Returns (key_cache, key_scales), both changed in the listed blocks alone (key_scales
    None for a 16/32-bit cache)."""
    num_blocks, kv_heads, block_size, head_dim = key_cache.shape
    if indices.shape[0] == 0:
        return key_cache, key_scales
    gathered = jnp.clip(indices, 0, num_blocks - 1)
    if key_scales is None:
        blocks = key_cache[gathered].astype(jnp.float32)
    else:
        blocks = dequantize(key_cache[gathered], key_scales[gathered])
    trig = lut[jnp.clip(deltas, 0, lut.shape[0] - 1)][:, None]  # [R, 1, block_size, D]
    rotated = _rotated_pairs(blocks, trig)
    target = _unique_targets(indices, (indices >= 0) & (indices < num_blocks), num_blocks)
    if key_scales is None:
        return _store(key_cache, (target,), rotated.astype(key_cache.dtype)), None
    rotated, scales = quantize(rotated, key_cache.dtype)
    return _store(key_cache, (target,), rotated), _store(key_scales, (target,), scales)


def _rotated_pairs(keys, trig):
    """float32 keys [..., D] with each pair (2j, 2j + 1) rotated by (cos, sin) = trig
    [..., j], trig[..., D/2 + j] (trig broadcast against keys, float32)."""
    half = keys.shape[-1] // 2
    cos, sin = trig[..., :half], trig[..., half:]
    pairs = keys.reshape(*keys.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(keys.shape)


def _unique_targets(blocks, valid, num_blocks):
    """`blocks` where `valid`, else a distinct block past the pool (`num_blocks + i` for
    entry i, dropped by the write): indices that are all distinct when the valid blocks
    are (checked metadata), as `_store` promises XLA."""
    spare = num_blocks + jnp.arange(blocks.shape[0], dtype=jnp.int32)
    return jnp.where(valid, blocks, spare)


def _store(cache, index, updates):
    """`cache.at[index].set(updates)` in place, out-of-range entries dropped, with
    `unique_indices=True` (the caller makes the in-range entries distinct).

    Without it XLA's GPU scatter must allow two updates of one element: it writes each
    element with an atomic, and for 16- and 8-bit caches (bf16, int8, float8) with a
    compare-and-swap loop on the 32-bit word around it (XLA's `rewriteAsAtomicCAS`;
    only 32/64-bit overwrites become atomic exchanges), whose neighbours in the word
    collide: the likely cause of issue 20's rotation cost (10 % of the blocks of a 537 MB
    bf16 key cache added 0.29 ms to a 0.40 ms decode step on the H100, several times
    what reading and writing those blocks takes; the compiled step copies no cache). With
    unique indices the scatter is plain (vectorized) stores of the listed blocks alone."""
    return cache.at[index].set(updates, mode="drop", unique_indices=True)


def _validate_metadata(past_lens, subsequence_begins, block_indices, block_indices_begins, *,
                       num_tokens, num_blocks, block_size, sliding_window):
    xp, (past_lens, begins, block_indices, block_begins, sliding_window) = checking_arrays(
        past_lens, subsequence_begins, block_indices, block_indices_begins, sliding_window)
    require(sliding_window >= 0, "sliding_window must be >= 0 (0 = unlimited), got {value}",
            value=sliding_window)
    require(begins[0] == 0, "subsequence_begins[0] must be 0, got {value}", value=begins[0])
    _require_non_decreasing(begins, "subsequence_begins")
    require(begins[-1] == num_tokens,
            f"subsequence_begins[-1] must equal the number of tokens T = {num_tokens} "
            "(query.shape[0]), got {value}", value=begins[-1])
    bad = past_lens < 0
    index = first_true(bad)
    require(~xp.any(bad), "past_lens must be >= 0, got past_lens[{index}] = {value}",
            index=index, value=past_lens[index] if past_lens.shape[0] else 0)
    num_listed = block_indices.shape[0]
    require(block_begins[0] >= 0, "block_indices_begins[0] must be >= 0, got {value}",
            value=block_begins[0])
    _require_non_decreasing(block_begins, "block_indices_begins")
    require(block_begins[-1] <= num_listed,
            f"block_indices_begins[-1] must be <= len(block_indices) = {num_listed}, "
            "got {value}", value=block_begins[-1])
    if past_lens.shape[0] == 0:
        return
    new_lens = xp.diff(begins)
    context = past_lens + new_lens
    blocks = xp.diff(block_begins)
    bad = context > blocks * block_size
    seq = first_true(bad)
    require(~xp.any(bad),
            "sequence {seq} needs {context} cache positions (past_lens {past} + {new} new "
            f"tokens) but block_indices_begins gives it {{blocks}} blocks of {block_size} "
            "positions", seq=seq, context=context[seq], past=past_lens[seq],
            new=new_lens[seq], blocks=blocks[seq])
    if num_listed:
        entries = xp.arange(num_listed)
        owner = _sequence_of(xp, block_begins, entries)
        used = ((entries >= block_begins[0]) & (entries < block_begins[-1])
                & (entries - block_begins[owner] < _ceil_div(context[owner], block_size)))
        bad = used & ((block_indices < 0) | (block_indices >= num_blocks))
        index = first_true(bad)
        require(~xp.any(bad),
                "block_indices[{index}] = {value} (a block of sequence {seq}) is out of range "
                f"[0, {num_blocks}) (key_cache.shape[0])",
                index=index, value=block_indices[index], seq=owner[index])
    if num_tokens > 1:
        layout = _token_layout(xp, past_lens, begins, block_indices, block_begins, num_tokens,
                               block_size, sliding_window)
        slots = layout.write_block * block_size + layout.write_offset
        order = xp.argsort(slots)
        same = slots[order][1:] == slots[order][:-1]
        clash = first_true(same)
        require(~xp.any(same),
                "new tokens {first} and {second} would both be written to block {block}, "
                "offset {offset}: block_indices gives one block to two sequences",
                first=xp.minimum(order[clash], order[clash + 1]),
                second=xp.maximum(order[clash], order[clash + 1]),
                block=layout.write_block[order[clash]], offset=layout.write_offset[order[clash]])


def _require_non_decreasing(begins, name):
    bad = begins[1:] < begins[:-1]
    index = first_true(bad)
    require(~bad.any(), f"{name} must be non-decreasing, but {name}[{{index}}] = {{value}} "
            f"> {name}[{{next_index}}] = {{next_value}}",
            index=index, value=begins[index], next_index=index + 1,
            next_value=begins[index + 1])


# -- shared layout (written against `xp`: NumPy for concrete checks, jnp when traced) -----


def _ceil_div(a, b):
    return (a + b - 1) // b


def _sequence_of(xp, begins, items):
    """The s with begins[s] <= item < begins[s + 1] (empty ranges skipped), clamped."""
    num_seqs = begins.shape[0] - 1
    # jnp: unrolled (no while loop, whose every iteration syncs with the host on a GPU).
    method = {} if xp is np else {"method": "scan_unrolled"}
    return xp.clip(xp.searchsorted(begins[1:], items, side="right", **method), 0, num_seqs - 1)


class _TokenLayout(NamedTuple):
    """Per new token, all [T] integers."""
    seq: jax.Array            # its sequence
    index: jax.Array          # its index among the sequence's new tokens
    position: jax.Array       # its cache position, past_lens[seq] + index
    first_visible: jax.Array  # the first position it attends to (sliding window)
    write_block: jax.Array    # the block its key and value go to (-1: none listed)
    write_offset: jax.Array   # the offset in that block


def _token_layout(xp, past_lens, subsequence_begins, block_indices, block_indices_begins,
                  num_tokens, block_size, sliding_window):
    tokens = xp.arange(num_tokens, dtype=np.int32)
    seq = _sequence_of(xp, subsequence_begins, tokens)
    index = tokens - subsequence_begins[seq]
    position = past_lens[seq] + index
    first_visible = xp.where(sliding_window > 0,
                             xp.maximum(position + 1 - sliding_window, 0), 0)
    write_block = _block_of(xp, block_indices, block_indices_begins, seq, position // block_size)
    return _TokenLayout(seq, index, position, first_visible, write_block,
                        position % block_size)


def _block_of(xp, block_indices, block_indices_begins, seq, logical_block):
    """block_indices[block_indices_begins[seq] + logical_block], -1 past the list's end."""
    entry = block_indices_begins[seq] + logical_block
    if block_indices.shape[0] == 0:
        return xp.full(entry.shape, -1, np.int32)
    listed = (entry >= 0) & (entry < block_indices.shape[0])
    return xp.where(listed, block_indices[xp.clip(entry, 0, block_indices.shape[0] - 1)], -1)


# -- (b) cache write, (c) attention, (d) scores ----------------------------------------------


@functools.partial(jax.jit, static_argnames=("return_scores", "backend", "num_splits",
                                             "rotation_in_reads"))
def _paged_attention_jit(query, key, value, key_cache, value_cache, past_lens, subsequence_begins,
                         block_indices, block_indices_begins, scale, sliding_window,
                         alibi_slopes, aggregation_window, rotation=None, sinks=None,
                         cache_scales=None, *, return_scores, backend="xla", num_splits=0,
                         rotation_in_reads=False):
    # Tensor-parallel serving: caches split over KV heads ([blocks, Hkv, block, D]) with
    # the tokens' heads (query [T, Hq * D] split between heads) run each device's heads
    # alone; the scores, summed over heads, are summed over the devices.
    operands = (query, key, value, key_cache, value_cache, past_lens, subsequence_begins,
                block_indices, block_indices_begins, scale, sliding_window, alibi_slopes,
                aggregation_window, rotation, sinks, cache_scales)
    roles = ((sharding.TOKENS, sharding.TOKEN_KV, sharding.TOKEN_KV, sharding.PAGES,
              sharding.PAGES) + (sharding.WHOLE,) * 6
             + (sharding.PER_HEAD, sharding.WHOLE, sharding.WHOLE, sharding.PER_HEAD,
                None if cache_scales is None else (sharding.PAGES, sharding.PAGES)))
    caches = (sharding.PAGES,) * (2 if cache_scales is None else 4)
    result_roles = ((sharding.TOKENS, sharding.SUM) + caches if return_scores
                    else (sharding.TOKENS,) + caches)
    return sharding.call(
        lambda operands, offsets: _paged_attention_shard(
            *operands, return_scores=return_scores, backend=backend, num_splits=num_splits,
            rotation_in_reads=rotation_in_reads),
        operands, roles, lambda results: result_roles, batch=1,
        q_heads=query.shape[1] // key_cache.shape[3], kv_heads=key_cache.shape[1],
        split_batch=False)


def _paged_attention_shard(query, key, value, key_cache, value_cache, past_lens,
                           subsequence_begins, block_indices, block_indices_begins, scale,
                           sliding_window, alibi_slopes, aggregation_window, rotation,
                           sinks, cache_scales, *, return_scores, backend, num_splits,
                           rotation_in_reads=False):
    """The op on one device's heads (all of them without a head split)."""
    num_blocks, kv_heads, block_size, head_dim = key_cache.shape
    # Keys rotated as read: (each block's entry in the list or -1, deltas, lut), for the
    # kernel and the XLA walk alike.
    read_rotation = None
    if rotation_in_reads:
        indices, deltas, lut = rotation
        read_rotation = (rotate_kernel.slot_of_block(indices, num_blocks), deltas, lut)
    if rotation is not None and not rotation_in_reads:  # (a') before the new tokens land
        if (backend in ("pallas", "interpret") and cache_scales is None
                and rotate_kernel.supported(key_cache)):
            # The listed blocks read and written once, by a kernel of their own.
            key_cache = rotate_kernel.rotate_blocks(key_cache, *rotation,
                                                    interpret=backend == "interpret")
        else:
            key_cache, key_scales = _rotate_blocks(
                key_cache, *rotation,
                key_scales=None if cache_scales is None else cache_scales[0])
            if cache_scales is not None:  # dequantized, rotated, quantized again
                cache_scales = (key_scales, cache_scales[1])
    value_dim = value_cache.shape[3]
    num_tokens = query.shape[0]
    q_heads = query.shape[1] // head_dim
    group = q_heads // kv_heads
    layout = _token_layout(jnp, past_lens, subsequence_begins, block_indices,
                           block_indices_begins, num_tokens, block_size, sliding_window)

    # (b) One scatter per cache; indices (block, :, offset) put the token axis first.
    # Checked metadata gives every new token its own slot: the writes are unique stores.
    in_range = (layout.write_block >= 0) & (layout.write_block < num_blocks)
    target = _unique_targets(layout.write_block, in_range, num_blocks)  # else dropped
    slots = (target, slice(None), layout.write_offset)
    key = key.reshape(num_tokens, kv_heads, head_dim)
    value = value.reshape(num_tokens, kv_heads, value_dim)
    if cache_scales is not None:  # quantized per token and head as they are written
        (key, key_scales), (value, value_scales) = (
            quantize(x, key_cache.dtype) for x in (key, value))
        cache_scales = tuple(_store(scales, slots, new)
                             for scales, new in zip(cache_scales, (key_scales, value_scales)))
    key_cache = _store(key_cache, slots, key)
    value_cache = _store(value_cache, slots, value)

    # (c)
    context = (past_lens + jnp.diff(subsequence_begins))[layout.seq]  # [T]
    pages = _PageWalk(query.reshape(num_tokens, kv_heads, group, head_dim), key_cache, layout,
                      context, block_indices, block_indices_begins, scale, alibi_slopes,
                      cache_scales, read_rotation)
    if backend == "xla":
        out, lse = pages.attend(value_cache)
    else:  # the Pallas kernel reads the updated caches in place
        out, lse = ragged_kernel.ragged_paged_attention(
            query.reshape(num_tokens, q_heads, head_dim), key_cache, value_cache, past_lens,
            subsequence_begins, block_indices, block_indices_begins, scale, sliding_window,
            alibi_slopes, interpret=backend == "interpret", num_splits=num_splits,
            cache_scales=cache_scales, read_rotation=read_rotation)
        lse = lse.reshape(num_tokens, kv_heads, group)
    if sinks is not None:  # one more part of every row, with no value
        out, lse = merge_sinks(out.reshape(num_tokens, q_heads, value_dim),
                               lse.reshape(num_tokens, q_heads), sinks,
                               head_axis_of_out=1, head_axis_of_lse=1)
        lse = lse.reshape(num_tokens, kv_heads, group)
    output = out.reshape(num_tokens, q_heads * value_dim).astype(query.dtype)
    caches = (key_cache, value_cache) + tuple(cache_scales or ())
    if not return_scores:
        return (output,) + caches

    # (d)
    new_lens = jnp.diff(subsequence_begins)
    window = aggregation_window[layout.seq]
    counted = (window <= 0) | (layout.index >= new_lens[layout.seq] - window)
    offsets = score_offsets(past_lens, subsequence_begins)
    scores = pages.scores(lse, counted, offsets[layout.seq], block_indices.shape[0] * block_size)
    return (output, scores) + caches


class _PageWalk:
    """Each token's visible positions, one logical block per step for all T tokens at once.

    Step j loads, for every token, logical block `first_visible // block_size + j` of its
    sequence: [T, Hkv, block_size, D] per step, never a [T, context] score matrix. The
    number of steps is the most blocks any token sees (a dynamic trip count).
    """

    def __init__(self, query, key_cache, layout, context, block_indices, block_indices_begins,
                 scale, alibi_slopes, cache_scales=None, read_rotation=None):
        self.query = query  # [T, Hkv, G, D]
        self.key_cache = key_cache
        # (slot_of_block [num_blocks], deltas [R, block_size], lut [rows, D]): listed
        # blocks' history keys rotated as read (`rotation_in_cache=False`).
        self.read_rotation = read_rotation
        self.cache_scales = cache_scales  # a quantized cache's (key, value) scales
        self.layout = layout
        self.context = context  # [T]: positions its sequence holds (past + new tokens)
        self.block_indices = block_indices
        self.block_indices_begins = block_indices_begins
        self.scale = scale
        self.block_size = key_cache.shape[2]
        num_tokens, kv_heads, group, _ = query.shape
        self.slopes = alibi_slopes.reshape(kv_heads, group)  # [Hkv, G]
        self.first_block = layout.first_visible // self.block_size
        last_block = layout.position // self.block_size
        self.blocks_seen = last_block - self.first_block + 1  # [T]
        self.precision = online_softmax.dot_precision(query.dtype)

    def _tile(self, step):
        """Scores (log2 domain, -inf where not visible) [T, Hkv, G, block_size], the
        visible mask [T, block_size], key positions [T, block_size] and blocks [T]."""
        layout, block_size = self.layout, self.block_size
        logical_block = self.first_block + step
        block = _block_of(jnp, self.block_indices, self.block_indices_begins, layout.seq,
                          logical_block)
        block = jnp.clip(block, 0, self.key_cache.shape[0] - 1)
        keys = self.key_cache[block]  # [T, Hkv, block_size, D]
        if self.cache_scales is not None:
            keys = dequantize(keys, self.cache_scales[0][block], self.query.dtype)
        key_pos = (logical_block[:, None] * block_size
                   + jnp.arange(block_size, dtype=jnp.int32)[None, :])  # [T, block_size]
        if self.read_rotation is not None:
            keys = self._rotated(keys, block, key_pos)
        logits = jnp.einsum("thgd,thkd->thgk", self.query, keys,
                            preferred_element_type=jnp.float32,
                            precision=self.precision) * self.scale
        distance = (key_pos - layout.position[:, None]).astype(jnp.float32)
        logits = logits + self.slopes[None, :, :, None] * distance[:, None, None, :]
        visible = ((key_pos >= layout.first_visible[:, None])
                   & (key_pos <= layout.position[:, None])
                   & (step < self.blocks_seen)[:, None])
        logits = jnp.where(visible[:, None, None, :], logits * online_softmax.LOG2_E, -jnp.inf)
        return logits, visible, key_pos, block

    def _rotated(self, keys, block, key_pos):
        """keys [T, Hkv, block_size, D] of blocks [T] with the listed blocks' history
        (positions below the token's past_lens) rotated, as `_rotate_blocks` rotates
        them in the cache (float32, then the keys' dtype)."""
        slot_of_block, deltas, lut = self.read_rotation
        slot = slot_of_block[block]  # [T]
        rows = deltas[jnp.maximum(slot, 0)]  # [T, block_size]
        rotated = _rotated_pairs(keys.astype(jnp.float32), lut[rows][:, None])
        past = self.layout.position - self.layout.index  # [T]
        listed = (slot[:, None] >= 0) & (key_pos < past[:, None])  # [T, block_size]
        return jnp.where(listed[:, None, :, None], rotated.astype(keys.dtype), keys)

    def _varying_axes(self, *more):
        """The manual mesh axes the walk's inputs vary over (inside a shard_map that
        checks them): its loops' initial states vary as their bodies' results do."""
        return sharding.varying_axes(self.query, self.key_cache, self.cache_scales,
                                     self.read_rotation,
                                     self.layout, self.context, self.block_indices,
                                     self.block_indices_begins, self.slopes, *more)

    def _steps(self, tokens):
        return jnp.max(jnp.where(tokens, self.blocks_seen, 0), initial=0)

    def attend(self, value_cache):
        """out [T, Hkv, G, Dv] float32 and natural-log lse [T, Hkv, G]."""
        num_tokens, kv_heads, group, _ = self.query.shape
        value_dim = value_cache.shape[3]
        update = jax.vmap(jax.vmap(functools.partial(online_softmax.update,
                                                     precision=self.precision)))

        def step(j, state):
            logits, _, key_pos, block = self._tile(j)
            # Slots past the sequence's context (a reused block's stale contents, never
            # written by this sequence) are zeroed: their weight is 0, but 0 * NaN = NaN
            # in the product. The Pallas kernel zeroes the same rows on load.
            written = key_pos < self.context[:, None]  # [T, block_size]
            values = value_cache[block]
            if self.cache_scales is not None:
                values = dequantize(values, self.cache_scales[1][block], self.query.dtype)
            values = jnp.where(written[:, None, :, None], values,
                               jnp.zeros((), values.dtype))  # [T, Hkv, bs, Dv]
            return update(state, logits, values)

        state = (jnp.full((num_tokens, kv_heads, group), -jnp.inf, jnp.float32),
                 jnp.zeros((num_tokens, kv_heads, group), jnp.float32),
                 jnp.zeros((num_tokens, kv_heads, group, value_dim), jnp.float32))
        state = sharding.vary(state, self._varying_axes(value_cache))
        state = lax.fori_loop(0, self._steps(jnp.ones((num_tokens,), bool)), step, state)
        return jax.vmap(jax.vmap(online_softmax.finalize))(state)

    def scores(self, lse, counted, offset, size):
        """float32 [size]: softmax weights summed over heads and counted tokens, at
        `offset[t] + key_pos` (offset [T], counted [T] bool)."""
        lse_log2 = lse * online_softmax.LOG2_E

        def step(j, scores):
            logits, visible, key_pos, _ = self._tile(j)
            weights = jnp.sum(jnp.exp2(logits - lse_log2[..., None]), axis=(1, 2))  # [T, bs]
            target = jnp.where(visible & counted[:, None], offset[:, None] + key_pos, size)
            return scores.at[target].add(weights, mode="drop")

        initial = sharding.vary(jnp.zeros((size,), jnp.float32),
                                sharding.varying_axes(self._varying_axes(), lse, counted,
                                                      offset))
        return lax.fori_loop(0, self._steps(counted), step, initial)
