"""Chunked causal attention (Llama 4's local layers): causal within fixed-size chunks."""

import numbers


def chunked_causal(chunk_size):
    """A mask_mod keeping the causal keys in the query's own chunk.

    True where `q_idx >= kv_idx` and `q_idx // chunk_size == kv_idx // chunk_size`: the
    sequence is cut into chunks of `chunk_size` positions starting at 0, and no query
    looks across a chunk boundary.

    Args:
      chunk_size: a Python int >= 1 (a compile-time constant: it sets the block pattern).

    >>> mask_mod = chunked_causal(4)
    >>> mask_mod.__name__
    'chunked_causal_4'
    >>> [bool(mask_mod(0, 0, 5, kv)) for kv in range(8)]
    [False, False, False, False, True, True, False, False]
    """
    if not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")

    def chunked_causal_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // chunk_size == kv_idx // chunk_size)

    chunked_causal_mask.__name__ = f"chunked_causal_{chunk_size}"
    return chunked_causal_mask
