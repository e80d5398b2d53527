"""Padding helpers shared by the kernels' wrappers."""

from __future__ import annotations

import jax.numpy as jnp


def padded_head_dim(dim: int) -> int:
    """The power of two >= dim (and >= 16, the smallest tensor-core tile) kernels use."""
    return max(16, 1 << (dim - 1).bit_length())


def pad_axis(x, axis: int, size: int):
    """Zero-pads `x` along `axis` up to `size` (no copy when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
