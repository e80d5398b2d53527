"""Padding helpers shared by the kernels' wrappers."""

from __future__ import annotations

import jax.numpy as jnp


def tile_extent(size: int) -> int:
    """The power of two >= size and >= 16 (the smallest tensor-core tile): the extent a
    Triton tile needs for `size` rows or columns."""
    return max(16, 1 << (size - 1).bit_length())


def padded_head_dim(dim: int) -> int:
    """The head dim the forward/backward kernels pad to (zeros add nothing to q.k)."""
    return tile_extent(dim)


def pad_axis(x, axis: int, size: int):
    """Zero-pads `x` along `axis` up to `size` (no copy when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def column_chunks(dim: int) -> tuple[tuple[int, int], ...]:
    """(start, width) power-of-two chunks covering `dim` (a multiple of 16): kernels that
    read K/V in place (paged, decode) load 576 columns as 512 + 64 instead of padding."""
    chunks, start = [], 0
    while start < dim:
        width = 1 << ((dim - start).bit_length() - 1)
        chunks.append((start, width))
        start += width
    return tuple(chunks)
