"""An independent float64 NumPy reference for `paged_attention`.

Written from the OpenVINO PagedAttention spec (its `insert_into_cache`, with the new
tokens placed after each sequence's `past_lens` history) with plain
loops: insert each sequence's new tokens into a copy of the caches, read the
sequence's whole key/value history back position by position, and run a dense softmax
per token and head.
"""

from __future__ import annotations

import numpy as np


def to_float64(x):
    """float64 NumPy copy of a JAX or NumPy array (bfloat16 included)."""
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def reference_paged_attention(query, key, value, key_cache, value_cache, past_lens,
                              subsequence_begins, block_indices, block_indices_begins, *,
                              scale=None, sliding_window=0, alibi_slopes=None,
                              score_aggregation_window=None, rotated_block_indices=None,
                              rotation_deltas=None, rotation_trig_lut=None, sinks=None):
    """Returns float64 (output [T, Hq*Dv], scores [sum(past_lens) + T], key_cache,
    value_cache), the caches with the listed blocks' keys re-rotated, then the new tokens
    inserted."""
    key_cache, value_cache = to_float64(key_cache), to_float64(value_cache)
    num_blocks, kv_heads, block_size, head_dim = key_cache.shape
    if rotated_block_indices is not None:
        lut = to_float64(rotation_trig_lut)
        deltas = np.asarray(rotation_deltas, np.int64)
        for i, block in enumerate(np.asarray(rotated_block_indices, np.int64)):
            for offset in range(block_size):
                row = lut[deltas[i, offset] if deltas.shape[1] == block_size else deltas[i, 0]]
                for h in range(kv_heads):
                    x = key_cache[block, h, offset].copy()
                    for j in range(head_dim // 2):
                        cos, sin = row[j], row[head_dim // 2 + j]
                        key_cache[block, h, offset, 2 * j] = x[2 * j] * cos - x[2 * j + 1] * sin
                        key_cache[block, h, offset, 2 * j + 1] = x[2 * j] * sin + x[2 * j + 1] * cos
    value_dim = value_cache.shape[3]
    num_tokens = np.shape(query)[0]
    q_heads = np.shape(query)[1] // head_dim
    group = q_heads // kv_heads
    query = to_float64(query).reshape(num_tokens, q_heads, head_dim)
    key = to_float64(key).reshape(num_tokens, kv_heads, head_dim)
    value = to_float64(value).reshape(num_tokens, kv_heads, value_dim)
    past_lens, begins, blocks_all, block_begins = (
        np.asarray(x, np.int64) for x in (past_lens, subsequence_begins, block_indices,
                                          block_indices_begins))
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)
    slopes = None
    if alibi_slopes is not None:
        slopes = np.broadcast_to(to_float64(alibi_slopes), (q_heads,))
    num_seqs = len(past_lens)
    windows = np.broadcast_to(
        np.asarray(0 if score_aggregation_window is None else score_aggregation_window),
        (num_seqs,))

    output = np.zeros((num_tokens, q_heads, value_dim))
    all_scores = []
    for s in range(num_seqs):
        first_token, new_len, past = begins[s], begins[s + 1] - begins[s], past_lens[s]
        blocks = blocks_all[block_begins[s]:block_begins[s + 1]]
        for i in range(new_len):
            position = past + i
            block, offset = blocks[position // block_size], position % block_size
            key_cache[block, :, offset, :] = key[first_token + i]
            value_cache[block, :, offset, :] = value[first_token + i]
        context = past + new_len
        slots = [(blocks[p // block_size], p % block_size) for p in range(context)]
        keys = np.array([key_cache[block, :, offset] for block, offset in slots]).reshape(
            context, kv_heads, head_dim)
        values = np.array([value_cache[block, :, offset] for block, offset in slots]).reshape(
            context, kv_heads, value_dim)
        seq_scores = np.zeros(context)
        key_positions = np.arange(context)
        for i in range(new_len):
            position = past + i
            visible = key_positions <= position
            if sliding_window > 0:
                visible &= key_positions >= position + 1 - sliding_window
            counted = windows[s] <= 0 or i >= new_len - windows[s]
            for h in range(q_heads):
                logits = keys[:, h // group] @ query[first_token + i, h] * scale
                if slopes is not None:
                    logits = logits + slopes[h] * (key_positions - position)
                logits = np.where(visible, logits, -np.inf)
                top = logits.max() if sinks is None else max(logits.max(), float(sinks[h]))
                weights = np.exp(logits - top)
                # A sink: one more softmax column with no value.
                weights /= weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
                output[first_token + i, h] = weights @ values[:, h // group]
                if counted:
                    seq_scores += weights
        all_scores.append(seq_scores)
    scores = np.concatenate(all_scores) if all_scores else np.zeros(0)
    return (output.reshape(num_tokens, q_heads * value_dim), scores, key_cache, value_cache)
