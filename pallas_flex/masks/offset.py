"""Query offsets: run a mod written for absolute positions on a block of queries that
starts later in the sequence (decoding, chunked prefill)."""

import numbers

from pallas_flex.masks._per_batch import per_batch_scalar


def _offset_name(mod, q_offset):
    base_name = getattr(mod, "__name__", repr(mod))
    if isinstance(q_offset, numbers.Integral):
        return f"offset_{q_offset}({base_name})"
    return f"offset({base_name})"


def offset(mask_mod, q_offset):
    """A mask_mod that calls `mask_mod(b, h, q_idx + q_offset, kv_idx)`.

    Query row 0 is at absolute position `q_offset`: when decoding one token after a cache
    of `n` positions, `offset(causal_mask, n)` lets it see keys `0..n`.

    Args:
      mask_mod: the mask_mod(b, h, q_idx, kv_idx) written for absolute positions.
      q_offset: a Python int (a compile-time constant), a 0-d int array, or an int array of
        shape [B] with one offset per batch row (read as `q_offset[b]`). Pass an array when
        the offset changes every step, so that no step recompiles.

    >>> from pallas_flex.masks.causal import causal_mask
    >>> import jax.numpy as jnp
    >>> decode_mask = offset(causal_mask, jnp.array([2, 5]))
    >>> bool(decode_mask(0, 0, 0, 3)), bool(decode_mask(1, 0, 0, 3))
    (False, True)
    """
    if not callable(mask_mod):
        raise ValueError(f"offset: mask_mod must be callable, got {mask_mod!r}")
    read_offset = per_batch_scalar(q_offset, "q_offset")

    def offset_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + read_offset(b), kv_idx)

    offset_mask.__name__ = _offset_name(mask_mod, q_offset)
    return offset_mask


def offset_score(score_mod, q_offset):
    """A score_mod that calls `score_mod(score, b, h, q_idx + q_offset, kv_idx)`.

    Args:
      score_mod: the score_mod(score, b, h, q_idx, kv_idx) written for absolute positions.
      q_offset: as in `offset`: a Python int, a 0-d int array or an int array of shape [B].

    >>> from pallas_flex.scores.relative_position import relative_position
    >>> shifted = offset_score(relative_position(), 10)
    >>> float(shifted(0.0, 0, 0, 0, 4))
    -6.0
    """
    if not callable(score_mod):
        raise ValueError(f"offset_score: score_mod must be callable, got {score_mod!r}")
    read_offset = per_batch_scalar(q_offset, "q_offset")

    def offset_score_mod(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx + read_offset(b), kv_idx)

    offset_score_mod.__name__ = _offset_name(score_mod, q_offset)
    return offset_score_mod
