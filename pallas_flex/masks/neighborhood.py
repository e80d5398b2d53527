"""2-D neighborhood attention (NATTEN) over an image of `height x width` tokens.

Every query token attends to the `kernel_height x kernel_width` tokens around it. The
window is centred on the query but shifted at the borders so that it stays inside the
image: along an axis of length `length` with kernel size `kernel`, a query at coordinate
`i` sees `start <= j < start + kernel` with
`start = clip(i - kernel // 2, 0, max(length - kernel, 0))`. So every query sees exactly
`min(kernel_height, height) * min(kernel_width, width)` tokens (NATTEN's rule; for even
kernels the window reaches one further to the left than to the right).

Three token orderings share these semantics:
* `neighborhood_2d`: row-major, token `r * width + c` is pixel (r, c);
* `tiled_neighborhood_2d`: tile by tile, row-major within a tile, so that a block of
  queries covers a compact patch of the image and more key blocks are skipped;
* `morton_neighborhood_2d`: Z-order, the same locality recursively.
"""

import numbers

import jax.numpy as jnp
import numpy as np


def _check_positive_ints(**values):
    for argument_name, value in values.items():
        if not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{argument_name} must be an int >= 1, got {value!r}")


def _window_contains(query_coordinate, key_coordinate, length, kernel_size):
    """Whether `key_coordinate` lies in the border-clamped window of `query_coordinate`."""
    start = jnp.clip(query_coordinate - kernel_size // 2, 0, max(length - kernel_size, 0))
    return (key_coordinate >= start) & (key_coordinate < start + kernel_size)


def _neighborhood_mask_from_coordinates(
    read_row, read_col, height, width, kernel_height, kernel_width
):
    def neighborhood_mask(b, h, q_idx, kv_idx):
        rows_near = _window_contains(read_row(q_idx), read_row(kv_idx), height, kernel_height)
        cols_near = _window_contains(read_col(q_idx), read_col(kv_idx), width, kernel_width)
        return rows_near & cols_near

    return neighborhood_mask


def _lookup_neighborhood_mask(row_of, col_of, height, width, kernel_height, kernel_width):
    """Neighborhood mask for a token order given by `row_of[index]`, `col_of[index]`."""
    row_of = jnp.asarray(row_of, dtype=jnp.int32)
    col_of = jnp.asarray(col_of, dtype=jnp.int32)
    return _neighborhood_mask_from_coordinates(
        lambda index: row_of[index],
        lambda index: col_of[index],
        height,
        width,
        kernel_height,
        kernel_width,
    )


def neighborhood_2d(height, width, kernel_height, kernel_width):
    """NATTEN over a row-major image: token `r * width + c` is pixel (r, c).

    Use with Q_LEN = KV_LEN = height * width. All arguments are Python ints >= 1; a kernel
    larger than the image covers the whole axis.

    >>> mask_mod = neighborhood_2d(4, 4, 3, 3)
    >>> mask_mod.__name__
    'neighborhood_2d_4x4_kernel_3x3'
    >>> corner_neighbours = [kv for kv in range(16) if mask_mod(0, 0, 0, kv)]
    >>> corner_neighbours  # pixel (0, 0) sees rows 0-2, cols 0-2
    [0, 1, 2, 4, 5, 6, 8, 9, 10]
    """
    _check_positive_ints(
        height=height, width=width, kernel_height=kernel_height, kernel_width=kernel_width
    )
    mask_mod = _neighborhood_mask_from_coordinates(
        lambda index: index // width,
        lambda index: index % width,
        height,
        width,
        kernel_height,
        kernel_width,
    )
    mask_mod.__name__ = f"neighborhood_2d_{height}x{width}_kernel_{kernel_height}x{kernel_width}"
    return mask_mod


def tiled_neighborhood_2d(height, width, kernel_height, kernel_width, tile_height, tile_width):
    """NATTEN over an image whose tokens are ordered tile by tile.

    The image is cut into `tile_height x tile_width` tiles; tiles are numbered row-major
    over the tile grid, and the pixels of a tile are numbered row-major within it. Token
    `index` is pixel (r, c) with

        tile, within = divmod(index, tile_height * tile_width)
        r = (tile // (width // tile_width)) * tile_height + within // tile_width
        c = (tile %  (width // tile_width)) * tile_width  + within %  tile_width

    precomputed into int32 lookup arrays `row_of[index]`, `col_of[index]` of shape
    [height * width] that the mask_mod closes over.

    Args:
      height, width, kernel_height, kernel_width: as in `neighborhood_2d`.
      tile_height, tile_width: Python ints dividing `height` and `width`.

    >>> mask_mod = tiled_neighborhood_2d(4, 4, 3, 3, 2, 2)
    >>> [kv for kv in range(16) if mask_mod(0, 0, 0, kv)]  # pixel (0, 0) again
    [0, 1, 2, 3, 4, 6, 8, 9, 12]
    """
    _check_positive_ints(
        height=height,
        width=width,
        kernel_height=kernel_height,
        kernel_width=kernel_width,
        tile_height=tile_height,
        tile_width=tile_width,
    )
    if height % tile_height or width % tile_width:
        raise ValueError(
            f"tile_height x tile_width ({tile_height}x{tile_width}) must divide the image "
            f"height x width ({height}x{width})"
        )
    index = np.arange(height * width)
    tile, within = np.divmod(index, tile_height * tile_width)
    tiles_per_row = width // tile_width
    row_of = (tile // tiles_per_row) * tile_height + within // tile_width
    col_of = (tile % tiles_per_row) * tile_width + within % tile_width
    mask_mod = _lookup_neighborhood_mask(
        row_of, col_of, height, width, kernel_height, kernel_width
    )
    mask_mod.__name__ = (
        f"tiled_neighborhood_2d_{height}x{width}_kernel_{kernel_height}x{kernel_width}"
        f"_tile_{tile_height}x{tile_width}"
    )
    return mask_mod


def _morton_coordinates(height, width):
    """`row_of`, `col_of` of shape [height * width] for the Z-order on a power-of-two image.

    Bits of the token index are dealt out from the lowest: column bit, row bit, column bit,
    ... while both coordinates have bits left; the longer side's remaining bits come last.
    On a square image this is the usual Morton code with the column in the even bits.
    """
    row_bits = height.bit_length() - 1
    col_bits = width.bit_length() - 1
    index = np.arange(height * width)
    row_of = np.zeros_like(index)
    col_of = np.zeros_like(index)
    index_bit = 0
    for coordinate_bit in range(max(row_bits, col_bits)):
        if coordinate_bit < col_bits:
            col_of |= ((index >> index_bit) & 1) << coordinate_bit
            index_bit += 1
        if coordinate_bit < row_bits:
            row_of |= ((index >> index_bit) & 1) << coordinate_bit
            index_bit += 1
    return row_of, col_of


def morton_neighborhood_2d(height, width, kernel_height, kernel_width):
    """NATTEN over an image whose tokens are in Morton (Z-) order.

    Token `index` is pixel (row_of[index], col_of[index]), where the int32 lookup arrays of
    shape [height * width] are built here by de-interleaving the bits of `index`: bit 2k is
    bit k of the column and bit 2k + 1 bit k of the row (on a non-square image the longer
    side's extra high bits follow). `height` and `width` must be powers of two.

    >>> mask_mod = morton_neighborhood_2d(4, 4, 3, 3)
    >>> [kv for kv in range(16) if mask_mod(0, 0, 0, kv)]  # pixel (0, 0) again
    [0, 1, 2, 3, 4, 6, 8, 9, 12]
    """
    _check_positive_ints(
        height=height, width=width, kernel_height=kernel_height, kernel_width=kernel_width
    )
    for argument_name, value in (("height", height), ("width", width)):
        if value & (value - 1):
            raise ValueError(f"{argument_name} must be a power of two, got {value}")
    row_of, col_of = _morton_coordinates(height, width)
    mask_mod = _lookup_neighborhood_mask(
        row_of, col_of, height, width, kernel_height, kernel_width
    )
    mask_mod.__name__ = (
        f"morton_neighborhood_2d_{height}x{width}_kernel_{kernel_height}x{kernel_width}"
    )
    return mask_mod
