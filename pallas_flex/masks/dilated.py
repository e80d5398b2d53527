"""Dilated sliding-window attention: a sliding window that keeps every `dilation`-th key."""

import numbers

from pallas_flex.masks.sliding_window import _check_window_size, _window_name, sliding_window


def dilated_sliding_window(window_size, dilation, *, causal=True):
    """A mask_mod keeping the keys of `sliding_window(window_size, causal=causal)` whose
    distance to the query is a multiple of `dilation`.

    The window is measured in positions, as in `sliding_window`: the causal version keeps
    `0 <= q_idx - kv_idx < window_size` and `(q_idx - kv_idx) % dilation == 0`, that is
    `ceil(window_size / dilation)` keys at most; causal=False keeps
    `|q_idx - kv_idx| < window_size` with the same divisibility rule.

    Args:
      window_size: as in `sliding_window`: a Python int >= 1, or a 0-d / [B] int array.
      dilation: a Python int >= 1, the stride between kept keys (a compile-time constant:
        it sets the sparsity pattern).
      causal: whether to drop the keys after the query.

    >>> mask_mod = dilated_sliding_window(6, 2)
    >>> mask_mod.__name__
    'dilated_sliding_window_6_dilation_2'
    >>> [bool(mask_mod(0, 0, 6, kv)) for kv in range(8)]
    [False, False, True, False, True, False, True, False]
    """
    _check_window_size(window_size)
    if not isinstance(dilation, numbers.Integral) or dilation < 1:
        raise ValueError(f"dilation must be an int >= 1, got {dilation!r}")
    window_mask = sliding_window(window_size, causal=causal)

    def dilated_sliding_window_mask(b, h, q_idx, kv_idx):
        return window_mask(b, h, q_idx, kv_idx) & ((q_idx - kv_idx) % dilation == 0)

    name = _window_name("dilated_sliding_window", window_size) + f"_dilation_{dilation}"
    dilated_sliding_window_mask.__name__ = name if causal else name + "_bidirectional"
    return dilated_sliding_window_mask
