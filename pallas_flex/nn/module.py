"""`FlexMultiHeadAttention`: an `nnx.MultiHeadAttention`-shaped layer on pallas_flex.

The projections are the same `nnx.LinearGeneral` layers, under the same names
(`query`, `key`, `value`, `out`), so weights move between the two modules with
`nnx.update(flex_layer, nnx.state(flax_layer, nnx.Param))`. What differs is the call:
attention patterns are mods (or a prebuilt BlockMask), not dense masks, and the decode
cache keeps one length per batch row.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from pallas_flex.api import attention, flex_attention
from pallas_flex.masks.combinators import and_masks
from pallas_flex.masks.offset import offset, offset_score
from pallas_flex.output_gate import gated
from pallas_flex.paged._validation import checking_arrays, first_true, require
from pallas_flex.paged.cache import PagedKVCache
from pallas_flex.paged.flex_attention import paged_flex_attention


def _compose_score_mods(first, second):
    """score_mod applying `first`, then `second` (either may be None)."""
    if first is None or second is None:
        return first if second is None else second

    def composed_score(score, b, h, q_idx, kv_idx):
        return second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    composed_score.__name__ = (f"{getattr(second, '__name__', 'score_mod')}"
                               f"({getattr(first, '__name__', 'score_mod')})")
    return composed_score


def _filled_mask(filled_lengths):
    """mask_mod keeping the keys a cache row holds: `kv_idx < filled_lengths[b]`."""

    def filled_cache_mask(b, h, q_idx, kv_idx):
        return kv_idx < filled_lengths[b]

    return filled_cache_mask


def _write_rows(cache, new, positions):
    """cache [B, L, H, D] with new [B, S, H, D] written at rows' `positions[b] + s`.

    Writes past L are dropped (a dynamic_update_slice would clamp the start instead and
    overwrite valid entries).
    """
    batch, new_len = new.shape[:2]
    rows = jnp.arange(batch)[:, None]
    columns = positions[:, None] + jnp.arange(new_len)[None, :]
    return cache.at[rows, columns].set(new.astype(cache.dtype), mode="drop")


class FlexMultiHeadAttention(nnx.Module):
    """Multi-head attention whose pattern is a mask_mod / score_mod (FlexAttention).

    Shaped like `nnx.MultiHeadAttention`: same constructor arguments (those that apply),
    same parameter names and shapes. Inputs are `[B, S, features]`; the output is
    `[B, Sq, out_features]`.

    Args:
      num_heads: query heads Hq.
      in_features: features of `inputs_q`.
      qkv_features: total query/key/value features (defaults to in_features); the head
        dim is `qkv_features // num_heads`.
      out_features: features of the output (defaults to in_features).
      num_kv_heads: key/value heads Hkv (defaults to num_heads); fewer gives grouped-query
        attention, 1 multi-query attention. Must divide num_heads.
      in_kv_features: features of `inputs_k` / `inputs_v` (defaults to in_features).
      dtype: computation dtype (None: inferred from inputs and params, as in nnx).
      param_dtype: parameter dtype.
      kernel_init, bias_init, out_kernel_init, out_bias_init, use_bias: as in nnx (the
        `out_*` initializers default to `kernel_init` / `bias_init`).
      decode: default of the call's `decode` flag.
      score_bias: optional module whose call returns a score_mod (`T5RelativeBias`,
        `LearnableAlibi`); it is applied after the call's `score_mod` and its parameters
        are this layer's.
      output_gate: gated attention (Qwen3-Next; "Gated Attention for Large Language
        Models"): a projection `gate` of `inputs_q` to [Hq, head_dim], and each head's
        output multiplied by its sigmoid before `out` (`pallas_flex.attention`'s
        output_gate: in the forward kernel's epilogue when not differentiated).
      backend, kernel_options: passed to `pallas_flex.attention` (None: best for the
        device).
      rngs: `nnx.Rngs` for the initializers.

    Decoding: `init_cache(batch_size, max_length)` creates `cached_key`, `cached_value`
    [B, max_length, Hkv, D] and `cache_index` [B] (int32, the filled length of each row).
    A call with `decode=True` appends its keys/values to each row at `cache_index[b]` and
    attends its queries to the row's filled keys, with the mods shifted to absolute
    positions by `pallas_flex.masks.offset`. Positions are traced arrays, so advancing a
    token never recompiles.

    Paged decoding: `init_paged_cache(num_pages, page_size, batch_size,
    max_pages_per_seq)` holds a `pallas_flex.paged.PagedKVCache` instead (`paged_cache`;
    its `lengths` are the rows' filled lengths). A decode call reserves pages for the new
    tokens of each row (lowest free pages first), writes them with `assign_batch`, and
    attends with `pallas_flex.paged.paged_flex_attention`, the pages read in place.
    Running out of pages is a `ValueError` eagerly, a checkify check under `jit`.
    `erase_rows(rows)` frees the pages of finished requests.

    Example:
      >>> layer = FlexMultiHeadAttention(num_heads=4, in_features=64, rngs=nnx.Rngs(0))
      >>> y = layer(x, mask_mod=pf.masks.causal_mask)               # x [B, S, 64]
      >>> layer.init_cache(batch_size=B, max_length=256)
      >>> y_new = layer(x_new, mask_mod=pf.masks.causal_mask, decode=True)  # [B, 1, 64]
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None,
                 in_kv_features: int | None = None, *, dtype=None,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init,
                 out_kernel_init=None, bias_init=initializers.zeros_init(),
                 out_bias_init=None, use_bias: bool = True, decode: bool = False,
                 score_bias: nnx.Module | None = None, output_gate: bool = False,
                 backend: str | None = None,
                 kernel_options: dict[str, Any] | None = None, rngs: nnx.Rngs):
        for name, value in (("num_heads", num_heads), ("in_features", in_features)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = in_features if qkv_features is None else qkv_features
        self.out_features = in_features if out_features is None else out_features
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 1 or (
                num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads must be a positive divisor of num_heads "
                             f"({num_heads}), got {self.num_kv_heads!r}")
        if self.qkv_features % num_heads:
            raise ValueError(f"qkv_features ({self.qkv_features}) must be divisible by "
                             f"num_heads ({num_heads})")
        if kernel_options is not None and not isinstance(kernel_options, dict):
            raise ValueError(f"kernel_options must be a dict, got "
                             f"{type(kernel_options).__name__}")
        score_bias_heads = getattr(score_bias, "num_heads", num_heads)
        if score_bias_heads != num_heads:
            raise ValueError(f"score_bias has {score_bias_heads} heads; expected num_heads "
                             f"({num_heads})")
        self.head_dim = self.qkv_features // num_heads
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.decode = decode
        self.backend = backend
        # A tuple, not a dict: static module attributes must be hashable under nnx.jit.
        self.kernel_options = (None if kernel_options is None
                               else tuple(sorted(kernel_options.items())))

        def linear(in_features, out_features, **overrides):
            options = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                           bias_init=bias_init, use_bias=use_bias, rngs=rngs)
            options.update(overrides)
            return nnx.LinearGeneral(in_features, out_features, **options)

        self.query = linear(self.in_features, (num_heads, self.head_dim))
        self.key = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.value = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.out = linear((num_heads, self.head_dim), self.out_features, axis=(-2, -1),
                          kernel_init=out_kernel_init or kernel_init,
                          bias_init=out_bias_init or bias_init)
        self.score_bias = nnx.data(score_bias)
        self.gate = nnx.data(linear(self.in_features, (num_heads, self.head_dim))
                             if output_gate else None)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)
        self.paged_cache: nnx.Cache | None = nnx.data(None)

    def init_paged_cache(self, num_pages: int, page_size: int, batch_size: int,
                         max_pages_per_seq: int, dtype=None):
        """Creates an empty paged decode cache (replacing a contiguous one).

        Args:
          num_pages, page_size: the page pool, `[num_pages, Hkv, page_size, D]` for keys
            and for values.
          batch_size: rows B of the decode calls; max_pages_per_seq: pages a row may hold.
          dtype: as in `init_cache`.
        """
        dtype = dtype or self.dtype or self.param_dtype
        self.paged_cache = nnx.Cache(PagedKVCache.create(
            num_pages=num_pages, page_size=page_size, max_batch=batch_size,
            max_pages_per_seq=max_pages_per_seq, kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=dtype))
        self.cached_key = self.cached_value = self.cache_index = None

    def erase_rows(self, rows):
        """Frees the paged cache's pages of the given rows (finished requests)."""
        if self.paged_cache is None:
            raise ValueError("erase_rows needs a paged cache: call init_paged_cache first")
        cache = self.paged_cache.get_value()
        for row in rows:
            cache = cache.erase(row)
        self.paged_cache.set_value(cache)

    def init_cache(self, batch_size: int, max_length: int, dtype=None):
        """Creates an empty contiguous decode cache.

        Args:
          batch_size: rows B of the decode calls.
          max_length: positions per row. A decode call that would fill a row past it
            raises a ValueError (under `jit`: a `checkify.debug_check`; unchecked, the
            tokens past it are dropped).
          dtype: cache dtype (default: the layer's dtype, else param_dtype). Decode calls
            cast queries, keys and values to it.
        """
        dtype = dtype or self.dtype or self.param_dtype
        shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))
        self.paged_cache = None

    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
                 inputs_v: jax.Array | None = None, *, mask_mod: Callable | None = None,
                 score_mod: Callable | None = None, block_mask=None,
                 decode: bool | None = None, input_lengths: jax.Array | None = None):
        """Attention of `inputs_q` to `inputs_k` / `inputs_v` (default: self-attention).

        Args:
          inputs_q: [B, Sq, in_features].
          inputs_k, inputs_v: [B, Skv, in_kv_features]; inputs_v defaults to inputs_k.
          mask_mod: `mask_mod(b, h, q_idx, kv_idx) -> bool` (None: no mask).
          score_mod: `score_mod(score, b, h, q_idx, kv_idx) -> score`.
          block_mask: a prebuilt `BlockMask` for [Sq, Skv] (reuse one across layers);
            exclusive with mask_mod. Not accepted with decode (the layer builds the
            shifted one).
          decode: use the cache (default: the constructor's `decode`). Mods see
            absolute positions: query s of row b is at `cache_index[b] + s`.
          input_lengths: decode only, int [B]: how many of the Sq new tokens of each row
            are real (right padding; default all). The rest are written but not counted
            as filled, so the next call overwrites them: this prefills prompts of
            different lengths in one call.
        Returns:
          [B, Sq, out_features].
        """
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_k cannot be None when inputs_v is given; pass the "
                                 "same array as inputs_k to use it for both")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        for name, inputs, features in (("inputs_q", inputs_q, self.in_features),
                                       ("inputs_k", inputs_k, self.in_kv_features),
                                       ("inputs_v", inputs_v, self.in_kv_features)):
            if inputs.ndim != 3 or inputs.shape[-1] != features:
                raise ValueError(f"{name} must have shape [B, S, {features}], got "
                                 f"{inputs.shape}")
        query = self.query(inputs_q)
        key = self.key(inputs_k)
        value = self.value(inputs_v)
        gate = None if self.gate is None else self.gate(inputs_q)
        if self.score_bias is not None:
            score_mod = _compose_score_mods(score_mod, self.score_bias())
        decode = self.decode if decode is None else decode
        if decode:
            out = self._decode_attention(query, key, value, mask_mod, score_mod, block_mask,
                                         input_lengths, gate)
        else:
            if input_lengths is not None:
                raise ValueError("input_lengths is only used with decode=True")
            out = self._attention(query, key, value, mask_mod, score_mod, block_mask, gate)
        return self.out(out)

    def _attention(self, query, key, value, mask_mod, score_mod, block_mask, gate=None):
        options = dict(backend=self.backend, kernel_options=(
            None if self.kernel_options is None else dict(self.kernel_options)))
        if block_mask is not None:
            if mask_mod is not None:
                raise ValueError("pass either mask_mod or block_mask, not both (a BlockMask "
                                 "already carries its mask_mod)")
            return flex_attention(query, key, value, score_mod, block_mask,
                                  output_gate=gate, **options)
        return attention(query, key, value, mask_mod=mask_mod, score_mod=score_mod,
                         output_gate=gate, **options)

    def _decode_attention(self, query, key, value, mask_mod, score_mod, block_mask,
                          input_lengths, gate):
        if self.cached_key is None and self.paged_cache is None:
            raise ValueError("decode=True needs a cache: call init_cache(batch_size, "
                             "max_length) or init_paged_cache(...) first")
        if block_mask is not None:
            raise ValueError("block_mask is not accepted with decode=True: pass mask_mod, "
                             "which the layer shifts to each row's cache position")
        batch, new_len = query.shape[:2]
        cache_batch = (self.paged_cache.get_value().max_batch if self.paged_cache is not None
                       else self.cached_key.shape[0])
        if batch != cache_batch:
            raise ValueError(f"decode inputs have batch {batch}, but the cache was "
                             f"initialized for batch_size={cache_batch}")
        if input_lengths is None:
            input_lengths = jnp.full((batch,), new_len, jnp.int32)
        input_lengths = jnp.asarray(input_lengths)
        if input_lengths.shape != (batch,) or not jnp.issubdtype(input_lengths.dtype,
                                                                 jnp.integer):
            raise ValueError(f"input_lengths must be an int array of shape [B] = ({batch},), "
                             f"got {input_lengths.dtype} {input_lengths.shape}")
        if self.paged_cache is not None:
            return gated(self._paged_decode_attention(query, key, value, mask_mod,
                                                      score_mod, input_lengths), gate)
        positions = self.cache_index[...]
        self._check_cache_room(positions, input_lengths, new_len)
        keys, values, filled = self._append_to_cache(key, value, positions, input_lengths)
        masks = [_filled_mask(filled)]
        if mask_mod is not None:
            masks.insert(0, offset(mask_mod, positions))
        if score_mod is not None:
            score_mod = offset_score(score_mod, positions)
        return self._attention(query.astype(keys.dtype), keys, values, and_masks(*masks),
                               score_mod, None, gate)

    def _check_cache_room(self, positions, input_lengths, new_len):
        """Each row's real new tokens must fit in the contiguous cache: a ValueError when
        the values are concrete, a `checkify.debug_check` under `jit` (as the paged
        cache's checks; `pallas_flex.paged.traced_checks(False)` leaves it out)."""
        max_length = self.cached_key.shape[1]
        xp, (start, count) = checking_arrays(positions, input_lengths)
        bad = (count < 0) | (count > new_len)
        row = first_true(bad)
        require(~xp.any(bad), f"input_lengths must be in [0, {new_len}] (the call's Sq); "
                "input_lengths[{row}] = {value}", row=row, value=count[row])
        end = start + count
        bad = end > max_length
        row = first_true(bad)
        require(~xp.any(bad),
                f"decoding past the cache's max_length: row {{row}} is at position "
                f"{{position}} and {{new}} new tokens would make {{end}}, but "
                f"init_cache(max_length={max_length}) holds {max_length} per row; call "
                f"init_cache with a larger max_length",
                row=row, position=start[row], new=count[row], end=end[row])

    def _append_to_cache(self, key, value, positions, input_lengths):
        """Writes the new keys/values at each row's position; returns the whole cache
        (keys, values [B, max_length, Hkv, D]) and the rows' new filled lengths [B].

        Padding tokens (past `input_lengths[b]`) are written as zeros: they sit past the
        row's filled length, masked, but a NaN there (from padding inputs) would still
        reach the rows of every tile that reads it (0 * NaN = NaN)."""
        real = (jnp.arange(key.shape[1])[None, :] < input_lengths[:, None])[..., None, None]
        key = jnp.where(real, key, jnp.zeros((), key.dtype))
        value = jnp.where(real, value, jnp.zeros((), value.dtype))
        keys = _write_rows(self.cached_key[...], key, positions)
        values = _write_rows(self.cached_value[...], value, positions)
        filled = positions + input_lengths.astype(positions.dtype)
        self.cached_key[...] = keys
        self.cached_value[...] = values
        self.cache_index[...] = filled
        return keys, values, filled

    def _paged_decode_attention(self, query, key, value, mask_mod, score_mod, input_lengths):
        cache = self.paged_cache.get_value()
        positions = cache.lengths
        filled = positions + input_lengths.astype(jnp.int32)
        for row in range(cache.max_batch):  # pages for the new tokens, lowest free first
            cache = cache.reserve(row, filled[row])
        cache = cache.assign_batch(positions, key.astype(cache.dtype),
                                   value.astype(cache.dtype), input_lengths)
        self.paged_cache.set_value(cache)
        if mask_mod is not None:
            mask_mod = offset(mask_mod, positions)
        if score_mod is not None:
            score_mod = offset_score(score_mod, positions)
        backend = self.backend
        return paged_flex_attention(
            query.astype(cache.dtype), cache, mask_mod=mask_mod, score_mod=score_mod,
            backend=backend, kernel_options=(None if self.kernel_options is None
                                             else dict(self.kernel_options)))
