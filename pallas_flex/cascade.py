"""Cascade (shared-prefix) attention: a batch of requests that share one prefix.

Attention over `prefix ++ suffix_b` for each request `b` splits exactly into two parts
merged by their log-sum-exps: the shared prefix, attended ONCE for the whole batch by
folding the batch into the query axis (`q [B, Sq, Hq, D]` becomes `[1, B·Sq, Hq, D]`
against `prefix_k [1, P, Hkv, D]`, so the prefix K/V is read once, not B times), and
each request's own suffix (`[B, Sq]` queries against `[B, L]` keys).

Coordinates the mods see (int32, always in range): `b` is the request and `q_idx` the
query's row within it, `[0, Sq)`, in every call:

| mod             | applied to      | kv_idx                                          |
| --------------- | --------------- | ----------------------------------------------- |
| prefix_mask_mod | the prefix keys | `[0, P)`                                        |
| suffix_mask_mod | the suffix keys | `[0, L)`, suffix-relative                       |
| score_mod       | both            | absolute: prefix `[0, P)`, suffix `P + [0, L)`  |

Inside the folded prefix call the kernels hand the mods `b = 0` and a folded query index
`f in [0, B·Sq)`; wrappers turn that back into `b = f // Sq, q_idx = f % Sq` (with
`lax.div`/`lax.rem`, which lower everywhere), so a mod indexing a per-request array as
`lengths[b]` reads the right request. The score_mod sees the key's position in the
concatenated sequence, so a position-dependent score (ALiBi, relative bias) gives the
same scores as attention over `prefix ++ suffix`; wrap it with
`pallas_flex.masks.offset_score` when the queries do not sit at positions `0..Sq-1`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_flex.api import attention, flex_attention, merge_attention_states
from pallas_flex.kernels import device
from pallas_flex.masks.block_mask import BlockMask
from pallas_flex.masks.mod_program import MASK, SCORE, make_mod_program



def _validate(q, prefix_k, prefix_v, suffix_k, suffix_v):
    arrays = (("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v),
              ("suffix_k", suffix_k), ("suffix_v", suffix_v))
    for name, x in arrays:
        if not hasattr(x, "shape") or len(x.shape) != 4:
            hint = (f" (add the leading batch axis of 1: {name}[None])"
                    if name.startswith("prefix") and getattr(x, "ndim", None) == 3 else "")
            raise ValueError(f"{name} must be a 4-D array, got shape "
                             f"{getattr(x, 'shape', type(x).__name__)}{hint}")
        if 0 in x.shape:
            raise ValueError(f"{name} must be non-empty, got shape {x.shape}")
        if jnp.dtype(x.dtype) not in device.SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    dtypes = {name: x.dtype for name, x in arrays}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"q, prefix_k, prefix_v, suffix_k and suffix_v must share a dtype, "
                         f"got {', '.join(f'{n}={d}' for n, d in dtypes.items())}")
    batch, q_len, q_heads, head_dim = q.shape
    prefix_len, kv_heads = prefix_k.shape[1], prefix_k.shape[2]
    value_dim = prefix_v.shape[3]
    if prefix_k.shape[0] != 1:
        raise ValueError(f"prefix_k must have shape [1, P, Hkv, D] (one prefix shared by the "
                         f"batch), got {prefix_k.shape}")
    if prefix_v.shape != (1, prefix_len, kv_heads, value_dim):
        raise ValueError(f"prefix_v must have shape [1, P, Hkv, Dv] = "
                         f"{(1, prefix_len, kv_heads, 'Dv')} (prefix_k's), got {prefix_v.shape}")
    suffix_len = suffix_k.shape[1]
    expected = {"prefix_k": (1, prefix_len, kv_heads, head_dim),
                "suffix_k": (batch, suffix_len, kv_heads, head_dim),
                "suffix_v": (batch, suffix_len, kv_heads, value_dim)}
    for name, x in arrays[1:]:
        if name in expected and x.shape != expected[name]:
            raise ValueError(f"{name} must have shape {expected[name]} (from q {q.shape}, "
                             f"prefix_k {prefix_k.shape}, prefix_v {prefix_v.shape} and "
                             f"suffix_k's length {suffix_len}), got {x.shape}")
    if q_heads % kv_heads:
        raise ValueError(f"q's heads ({q_heads}) must be a multiple of the prefix and suffix "
                         f"heads ({kv_heads}) for grouped-query attention")


def _validate_suffix_block_mask(block_mask, q, suffix_k):
    if not isinstance(block_mask, BlockMask):
        raise ValueError(f"suffix_block_mask must be a pallas_flex.BlockMask, got "
                         f"{type(block_mask).__name__}")
    batch, q_len, q_heads, _ = q.shape
    mask_batch, mask_heads, mask_q_len, mask_kv_len = block_mask.shape
    if ((mask_q_len, mask_kv_len) != (q_len, suffix_k.shape[1])
            or mask_batch not in (1, batch) or mask_heads not in (1, q_heads)):
        raise ValueError(f"suffix_block_mask must have shape [1 or {batch}, 1 or {q_heads}, "
                         f"Sq={q_len}, L={suffix_k.shape[1]}] (suffix-relative), got "
                         f"{block_mask.shape}")


def _unfold(folded_q_idx, q_len):
    """(request, q_idx within it) of a folded query index `request * q_len + q_idx`."""
    q_len = jnp.int32(q_len)
    return lax.div(folded_q_idx, q_len), lax.rem(folded_q_idx, q_len)


def _folded_prefix_mask(prefix_mask, q_len):
    def cascade_prefix_mask(b, h, q_idx, kv_idx):
        del b  # always 0 in the folded call
        request, request_q_idx = _unfold(q_idx, q_len)
        return prefix_mask(request, h, request_q_idx, kv_idx)

    cascade_prefix_mask.__name__ = f"cascade_prefix({prefix_mask.name})"
    return cascade_prefix_mask


def _folded_prefix_score(score_mod, q_len):
    def cascade_prefix_score(score, b, h, q_idx, kv_idx):
        del b  # always 0 in the folded call
        request, request_q_idx = _unfold(q_idx, q_len)
        return score_mod(score, request, h, request_q_idx, kv_idx)

    cascade_prefix_score.__name__ = f"cascade_prefix({score_mod.name})"
    return cascade_prefix_score


def _shifted_suffix_score(score_mod, prefix_len):
    def cascade_suffix_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx + jnp.int32(prefix_len))

    cascade_suffix_score.__name__ = f"cascade_suffix({score_mod.name})"
    return cascade_suffix_score


def cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, *, suffix_mask_mod=None,
                      suffix_block_mask=None, prefix_mask_mod=None, score_mod=None,
                      scale=None, return_lse=False, backend=None, kernel_options=None):
    """Attention of B requests over one shared prefix and their own suffixes.

    Equals `pf.attention` of each request over `concat(prefix, suffix_b)` with the mask
    "prefix_mask_mod on the prefix keys, suffix_mask_mod on the suffix keys", but reads
    the prefix K/V once for the whole batch: the prefix part runs as one query block of
    `B·Sq` rows, the suffix part per request, and the two are merged exactly with
    `merge_attention_states`. Differentiable like `pf.attention`.

    Args:
      q: [B, Sq, Hq, D] (decode: Sq = 1, or a few speculative tokens).
      prefix_k: [1, P, Hkv, D], prefix_v: [1, P, Hkv, Dv] — the shared prefix, with a
        leading batch axis of 1 (`prefix_k[None]` adds it).
      suffix_k: [B, L, Hkv, D], suffix_v: [B, L, Hkv, Dv] — each request's own keys and
        values, padded to a common length L (mask the padding with suffix_mask_mod).
      suffix_mask_mod: `mask_mod(b, h, q_idx, kv_idx)` over the suffix, in suffix-relative
        coordinates: `kv_idx in [0, L)` is the position within request b's suffix and
        `q_idx in [0, Sq)` the query's row. Decode with ragged suffix lengths:
        `lambda b, h, q_idx, kv_idx: kv_idx < lengths[b]`; a few causal tokens at the
        suffix's end: `pf.masks.offset(pf.masks.causal_mask, lengths - Sq)`. None: every
        suffix key takes part.
      suffix_block_mask: a prebuilt BlockMask of shape [1 or B, 1 or Hq, Sq, L] for the
        suffix (instead of suffix_mask_mod, not with it).
      prefix_mask_mod: `mask_mod(b, h, q_idx, kv_idx)` over the prefix: `b` is the request,
        `q_idx in [0, Sq)` the query's row within it, `kv_idx in [0, P)`. None: every
        query sees the whole prefix.
      score_mod: `score_mod(score, b, h, q_idx, kv_idx)` applied to both parts with
        `kv_idx` the key's position in `concat(prefix, suffix)` (prefix keys `[0, P)`,
        suffix keys `P + [0, L)`) and `q_idx in [0, Sq)`: a position-dependent score
        sees absolute key positions. Queries past position Sq - 1 (decode) need
        `pf.masks.offset_score(score_mod, query_positions)`.
      scale: Python float; defaults to 1/sqrt(D).
      return_lse: also return lse [B, Hq, Sq] (float32, natural log) of the whole
        attention (prefix and suffix).
      backend, kernel_options: as in `pf.attention`, used for both parts.
    Returns:
      out [B, Sq, Hq, Dv] in q's dtype, or (out, lse) with return_lse=True. A query that
      no key takes part for gets zeros and lse = -inf.

    Example (decode, 4 requests sharing a 1024-token system prompt):
      >>> out = pf.cascade_attention(
      ...     q,                                    # [4, 1, 32, 128]
      ...     prefix_k, prefix_v,                   # [1, 1024, 8, 128]
      ...     suffix_k, suffix_v,                   # [4, 256, 8, 128]
      ...     suffix_mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < lengths[b])
    """
    _validate(q, prefix_k, prefix_v, suffix_k, suffix_v)
    if suffix_mask_mod is not None and suffix_block_mask is not None:
        raise ValueError("pass either suffix_mask_mod or suffix_block_mask, not both (a "
                         "BlockMask already carries its mask_mod)")
    if suffix_block_mask is not None:
        _validate_suffix_block_mask(suffix_block_mask, q, suffix_k)
    # Trace the user's mods here, so that a bad mod is reported under its own name.
    prefix_mask = (None if prefix_mask_mod is None else
                   make_mod_program(prefix_mask_mod, MASK, "prefix_mask_mod"))
    suffix_mask = (None if suffix_mask_mod is None else
                   make_mod_program(suffix_mask_mod, MASK, "suffix_mask_mod"))
    score = None if score_mod is None else make_mod_program(score_mod, SCORE, "score_mod")

    batch, q_len, q_heads, head_dim = q.shape
    prefix_len = prefix_k.shape[1]
    options = {"scale": scale, "return_lse": True, "backend": backend,
               "kernel_options": kernel_options}

    folded_q = q.reshape(1, batch * q_len, q_heads, head_dim)
    prefix_out, prefix_lse = attention(
        folded_q, prefix_k, prefix_v,
        mask_mod=None if prefix_mask is None else _folded_prefix_mask(prefix_mask, q_len),
        score_mod=None if score is None else _folded_prefix_score(score, q_len), **options)
    prefix_out = prefix_out.reshape(batch, q_len, q_heads, prefix_v.shape[3])
    # [1, Hq, B·Sq] -> [B, Hq, Sq]
    prefix_lse = jnp.swapaxes(prefix_lse.reshape(q_heads, batch, q_len), 0, 1)

    suffix_score = None if score is None else _shifted_suffix_score(score, prefix_len)
    if suffix_block_mask is not None:
        suffix_out, suffix_lse = flex_attention(q, suffix_k, suffix_v, suffix_score,
                                                suffix_block_mask, **options)
    else:
        suffix_out, suffix_lse = attention(q, suffix_k, suffix_v, mask_mod=suffix_mask,
                                           score_mod=suffix_score, **options)

    # A query with no key in either part: merge_attention_states's logaddexp(-inf, -inf)
    # has a NaN gradient, so such rows merge finite stand-ins (their outputs are zeros,
    # so the merged output is zeros too) and get lse = -inf back afterwards.
    empty = jnp.isneginf(prefix_lse) & jnp.isneginf(suffix_lse)
    out, lse = merge_attention_states(prefix_out, jnp.where(empty, 0.0, prefix_lse),
                                      suffix_out, jnp.where(empty, 0.0, suffix_lse))
    lse = jnp.where(empty, -jnp.inf, lse)
    return (out, lse) if return_lse else out
