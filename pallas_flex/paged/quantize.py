"""KV-cache quantization: int8 and float8 (e4m3) storage with one float32 scale per
(token, head).

A key or value vector x [D] is stored as round(x / s) (int8, |.| <= 127) or x / s cast to
float8_e4m3fn (|.| <= 448), s = max|x| / 127 or / 448: half the bytes of a 16-bit cache.
Per-token scales follow the tokens: a write quantizes exactly the vectors it writes, with
no rescaling of a page's earlier tokens (a per-page scale would need one, or a bound
known in advance). The decode kernel applies the scales where they are cheapest: a key's
scale multiplies its column of q.k (one multiply per score), a value's scale the
probability column before P.v (the softmax's sum keeps the unscaled probabilities), so
no tile is dequantized. A prefill attends to the pages dequantized first
(`dequantized_pages`), where converting in its kernel cost more (docs/gpu-notes.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_flex.kernels.kv_tiles import in_pool

# Storage dtype -> the largest magnitude it holds.
QUANTIZED_DTYPES = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANTIZED_DTYPES


def quantize(x, dtype):
    """(values in `dtype` [..., D], float32 scales [...]) of float vectors x [..., D]."""
    limit = QUANTIZED_DTYPES[jnp.dtype(dtype)]
    x = x.astype(jnp.float32)
    largest = jnp.max(jnp.abs(x), axis=-1)
    scales = jnp.where(largest > 0, largest / limit, 1.0)
    scaled = jnp.clip(x / scales[..., None], -limit, limit)
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scales


def dequantize(values, scales, dtype=jnp.float32):
    """values [..., D] times scales [...], in `dtype`."""
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def dequantized_pages(pages, scales, page_table, dtype):
    """A quantized cache's pages that the rows of `page_table` [B, max_pages] hold,
    dequantized to `dtype` into a pool of their own: (pages [B * max_pages, Hkv,
    page_size, D], its page table [B, max_pages]: row b's pages in order). One XLA
    fusion reads the 8-bit pages and their scales and writes the 16-bit ones; entries of
    -1 read page 0, whose values lie past the row's length (the kernels mask them).

    The prefill over a quantized cache attends to these (`KernelOptions.quantized_prefill`):
    the 16-bit forward kernels run at their own speed, where converting each 8-bit tile
    in the Triton forward made every query tile's program pay for it (H200, B4, 32 to
    2048 new tokens on 8192, D 128, pages of 64, paired rounds: 1.3-2.5x faster with the
    pages dequantized first; docs/gpu-notes.md). The price is transient memory: the
    rows' reserved pages, K and V, in 16 bits during the call (which "auto" bounds)."""
    batch, max_pages = page_table.shape
    rows = in_pool(page_table, pages.shape[0]).reshape(-1)
    values = dequantize(pages[rows], scales[rows], dtype)  # [B * max_pages, Hkv, page, D]
    return values, jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages)
