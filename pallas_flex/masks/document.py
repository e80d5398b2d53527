"""Document (jagged) masking: several documents packed into one sequence attend only
within their own document."""

import numbers

import jax
import jax.numpy as jnp


def _check_document_ids(document_ids, argument_name):
    array = jnp.asarray(document_ids)
    if array.ndim not in (1, 2):
        raise ValueError(
            f"{argument_name} must have shape [S] (shared by the batch) or [B, S], "
            f"got shape {array.shape}"
        )
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise ValueError(f"{argument_name} must be an integer array, got dtype {array.dtype}")
    return array


def _per_position_reader(array):
    """`read(b, position)`: `array[position]` for a shared [S] array, `array[b, position]`
    for a per-batch [B, S] one."""
    if array.ndim == 1:
        return lambda b, position: array[position]
    return lambda b, position: array[b, position]


def _document_starts(document_ids):
    """The position where each position's document begins, same shape as `document_ids`.

    A document is a run of equal consecutive ids, so a start is a position whose id differs
    from its left neighbour; a running maximum carries the latest start rightwards.
    """
    length = document_ids.shape[-1]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), document_ids.shape)
    is_start = jnp.concatenate(
        [
            jnp.ones(document_ids.shape[:-1] + (1,), dtype=jnp.bool_),
            document_ids[..., 1:] != document_ids[..., :-1],
        ],
        axis=-1,
    )
    return jax.lax.cummax(jnp.where(is_start, positions, 0), axis=document_ids.ndim - 1)


def document_mask(document_ids, kv_document_ids=None):
    """A mask_mod that is True where the query and the key belong to the same document.

    Args:
      document_ids: int array of shape [S] (one packing shared by every batch row) or
        [B, S] (read as `document_ids[b, idx]`): the document id of each position. Ids only
        need to be equal within a document and different across neighbouring documents.
      kv_document_ids: optional int array of shape [Skv] or [B, Skv], the keys' ids when
        they differ from the queries' (Sq != Skv). Defaults to `document_ids`.

    >>> import jax.numpy as jnp
    >>> mask_mod = document_mask(jnp.array([0, 0, 1, 1, 1]))
    >>> [bool(mask_mod(0, 0, 3, kv)) for kv in range(5)]
    [False, False, True, True, True]
    """
    q_ids = _check_document_ids(document_ids, "document_ids")
    kv_ids = q_ids
    if kv_document_ids is not None:
        kv_ids = _check_document_ids(kv_document_ids, "kv_document_ids")
    read_q_id = _per_position_reader(q_ids)
    read_kv_id = _per_position_reader(kv_ids)

    def same_document_mask(b, h, q_idx, kv_idx):
        return read_q_id(b, q_idx) == read_kv_id(b, kv_idx)

    same_document_mask.__name__ = "document_mask"
    return same_document_mask


def document_mask_from_offsets(offsets, total_length):
    """`document_mask` for documents given by their start positions.

    Args:
      offsets: 1-D int array `[0, s1, s2, ..., total_length]` of shape [num_documents + 1]
        (attention-gym's `generate_doc_mask_mod` convention): document `d` covers
        positions `offsets[d] <= idx < offsets[d + 1]`. May be a traced array.
      total_length: Python int, the packed sequence length S.

    >>> import jax.numpy as jnp
    >>> mask_mod = document_mask_from_offsets(jnp.array([0, 2, 5]), 5)
    >>> [bool(mask_mod(0, 0, 3, kv)) for kv in range(5)]
    [False, False, True, True, True]
    """
    if not isinstance(total_length, numbers.Integral):
        raise ValueError(f"total_length must be a Python int, got {total_length!r}")
    offsets = jnp.asarray(offsets)
    if offsets.ndim != 1:
        raise ValueError(
            f"offsets must have shape [num_documents + 1], got shape {offsets.shape}"
        )
    positions = jnp.arange(total_length, dtype=offsets.dtype)
    # Unrolled: the default while loop syncs with the host on every iteration on a GPU.
    document_ids = jnp.searchsorted(offsets, positions, side="right",
                                    method="scan_unrolled") - 1
    mask_mod = document_mask(document_ids)
    mask_mod.__name__ = "document_mask_from_offsets"
    return mask_mod


def document(inner_mask_mod, document_ids, kv_document_ids=None):
    """Apply `inner_mask_mod` inside each document, with positions counted from the
    document's start.

    True where the query and the key are in the same document and
    `inner_mask_mod(b, h, q_idx - q_start, kv_idx - kv_start)`, where `q_start`
    (`kv_start`) is the position where the query's (key's) document begins. So
    `document(causal_mask, ids)` is causal attention within each document, and
    `document(prefix_lm(4), ids)` gives every document its own 4-token prefix.

    Args:
      inner_mask_mod: a mask_mod(b, h, q_idx, kv_idx) written for one document.
      document_ids: int array of shape [S] (shared by the batch) or [B, S]. Each document
        must be one contiguous run of equal ids: a run's first position is its start.
      kv_document_ids: optional int array of shape [Skv] or [B, Skv] for the keys, when
        they differ from the queries'. Defaults to `document_ids`.

    >>> import jax.numpy as jnp
    >>> from pallas_flex.masks.prefix_lm import prefix_lm
    >>> mask_mod = document(prefix_lm(2), jnp.array([7, 7, 7, 3, 3, 3, 3]))
    >>> [bool(mask_mod(0, 0, 3, kv)) for kv in range(7)]
    [False, False, False, True, True, False, False]
    """
    if not callable(inner_mask_mod):
        raise ValueError(f"document: inner_mask_mod must be callable, got {inner_mask_mod!r}")
    q_ids = _check_document_ids(document_ids, "document_ids")
    q_starts = _document_starts(q_ids)
    # Shared ids give one starts array too: each captured array is one more kernel input.
    kv_ids, kv_starts = q_ids, q_starts
    if kv_document_ids is not None:
        kv_ids = _check_document_ids(kv_document_ids, "kv_document_ids")
        kv_starts = _document_starts(kv_ids)
    read_q_id = _per_position_reader(q_ids)
    read_kv_id = _per_position_reader(kv_ids)
    read_q_start = _per_position_reader(q_starts)
    read_kv_start = _per_position_reader(kv_starts)

    def document_inner_mask(b, h, q_idx, kv_idx):
        same_document = read_q_id(b, q_idx) == read_kv_id(b, kv_idx)
        inner = inner_mask_mod(
            b, h, q_idx - read_q_start(b, q_idx), kv_idx - read_kv_start(b, kv_idx)
        )
        return same_document & inner

    document_inner_mask.__name__ = (
        f"document({getattr(inner_mask_mod, '__name__', repr(inner_mask_mod))})"
    )
    return document_inner_mask
