"""T5's bucketed relative-position bias (Raffel et al., 2020): one learned bias per head
and distance bucket, exact buckets for short distances, logarithmic ones beyond."""

import math
import numbers

import jax.numpy as jnp


def t5_relative_bucket(relative_position, *, num_buckets=32, max_distance=128, bidirectional=True):
    """The bucket of a relative position, as in T5's `_relative_position_bucket`.

    Scalar (elementwise) int32 -> int32, with `relative_position = kv_idx - q_idx`.
    Bidirectional: half the buckets for keys after the query, half for the rest. Within a
    half, distances below `num_buckets // 4` (`num_buckets // 2` one-directional) get one
    bucket each; larger ones share buckets spaced logarithmically up to `max_distance`,
    and everything farther lands in the last bucket. One-directional: keys after the query
    all fall in bucket 0.

    Args:
      relative_position: int32 scalar (or array: the function is elementwise).
      num_buckets, max_distance: Python ints, as in T5 (defaults 32 and 128).
      bidirectional: True for encoders, False for decoders' causal self-attention.

    >>> [int(t5_relative_bucket(distance)) for distance in (-1, 0, 1, 20, -200)]
    [1, 0, 17, 26, 15]
    """
    if bidirectional:
        num_buckets //= 2
        direction_offset = jnp.where(relative_position > 0, num_buckets, 0)
        distance = jnp.abs(relative_position)
    else:
        direction_offset = 0
        distance = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # The log is only used where distance >= max_exact; the guard keeps the unused
    # branch finite (log of 0 would be -inf, and its int cast undefined).
    log_ratio = jnp.log(jnp.maximum(distance, max_exact).astype(jnp.float32) / max_exact)
    distance_if_large = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    distance_if_large = jnp.minimum(distance_if_large, num_buckets - 1)
    return direction_offset + jnp.where(is_small, distance, distance_if_large)


def t5_relative_bias(bias_table, *, num_buckets=None, max_distance=128, bidirectional=True):
    """A score_mod adding `bias_table[h, t5_relative_bucket(kv_idx - q_idx)]`.

    Args:
      bias_table: float array of shape [H, num_buckets], one learned bias per query head
        and bucket (T5 stores its embedding as [num_buckets, H]: pass its transpose).
      num_buckets: defaults to `bias_table.shape[1]`.
      max_distance, bidirectional: as in `t5_relative_bucket`.

    >>> import jax.numpy as jnp
    >>> table = jnp.arange(64, dtype=jnp.float32).reshape(2, 32)
    >>> score_mod = t5_relative_bias(table)
    >>> float(score_mod(0.0, 0, 1, 0, 1))  # head 1, bucket 17
    49.0
    """
    bias_table = jnp.asarray(bias_table)
    if bias_table.ndim != 2:
        raise ValueError(
            f"bias_table must have shape [num_heads, num_buckets], got shape {bias_table.shape}"
        )
    if num_buckets is None:
        num_buckets = bias_table.shape[1]
    if not isinstance(num_buckets, numbers.Integral) or not (
        1 <= num_buckets <= bias_table.shape[1]
    ):
        raise ValueError(
            f"num_buckets must be an int in [1, bias_table.shape[1] = {bias_table.shape[1]}], "
            f"got {num_buckets!r}"
        )
    max_exact = num_buckets // 4 if bidirectional else num_buckets // 2
    if max_exact < 1:
        raise ValueError(
            f"num_buckets must be at least {4 if bidirectional else 2} "
            f"(bidirectional={bidirectional}), got {num_buckets}"
        )
    if not isinstance(max_distance, numbers.Integral) or max_distance <= max_exact:
        raise ValueError(
            f"max_distance must be an int larger than the exact range {max_exact}, "
            f"got {max_distance!r}"
        )

    def t5_bias_score(score, b, h, q_idx, kv_idx):
        bucket = t5_relative_bucket(
            kv_idx - q_idx,
            num_buckets=num_buckets,
            max_distance=max_distance,
            bidirectional=bidirectional,
        )
        return score + bias_table[h, bucket]

    t5_bias_score.__name__ = "t5_relative_bias"
    return t5_bias_score
