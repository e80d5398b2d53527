"""KV-cache quantization: int8 and float8 (e4m3) storage with one float32 scale per
(token, head).

A key or value vector x [D] is stored as round(x / s) (int8, |.| <= 127) or x / s cast to
float8_e4m3fn (|.| <= 448), s = max|x| / 127 or / 448: half the bytes of a 16-bit cache
(on the H100 the decode kernel reaches 1.4-1.5x bf16's tokens per second on int8 and
1.0-1.13x on float8, bound by the conversion to 16 bits: docs/gpu-notes.md). Per-token
scales follow the tokens: a write quantizes exactly the vectors it writes, with no
rescaling of a page's earlier tokens (a per-page scale would need one, or a bound known
in advance). The kernels apply the scales where they are cheapest: a key's scale
multiplies its column of q.k (one multiply per score), a value's scale the probability
column before P.v (the softmax's sum keeps the unscaled probabilities), so no tile is
dequantized.
"""

from __future__ import annotations

import jax.numpy as jnp

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
