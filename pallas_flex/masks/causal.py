"""Causal attention: a query sees itself and every earlier key."""


def causal_mask(b, h, q_idx, kv_idx):
    """True where `q_idx >= kv_idx`.

    Queries and keys share one position axis, so with `Sq != Skv` the first query sits at
    key position 0; wrap with `pallas_flex.masks.offset.offset` for decoding, where the
    queries are the last positions.

    >>> bool(causal_mask(0, 0, 3, 2)), bool(causal_mask(0, 0, 2, 3))
    (True, False)
    """
    return q_idx >= kv_idx
