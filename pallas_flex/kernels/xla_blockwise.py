"""FlexAttention as a blockwise XLA computation over the same BlockMask.

The `"xla"` backend: runs anywhere (the CPU default), visits only the blocks the
BlockMask lists, and holds one `[block_q, block_kv]` score tile per (batch, head) at a
time, so memory stays linear in sequence length. Mods run through `jax.vmap`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flex import sharding
from pallas_flex.kernels import online_softmax
from pallas_flex.kernels.padding import pad_axis
from pallas_flex.masks.mod_program import vmap_mask, vmap_score


def blockwise_attention(q, k, v, block_mask, score_program, *, scale: float,
                        out_dtype=None, with_max=False, sinks=None):
    """out [B, Sq, Hq, Dv] (out_dtype, default q's) and lse [B, Hq, Sq] (float32), and
    with_max the row max of the logits [B, Hq, Sq]. sinks: None, or a logit per query
    head [Hq] in every row's softmax with no value (the lse includes it; the row max
    does not)."""
    batch, q_len, q_heads, _ = q.shape
    kv_len, kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    block_q, block_kv = block_mask.block_size
    num_q_blocks, num_kv_blocks = block_mask.num_blocks
    group = q_heads // kv_heads
    precision = online_softmax.dot_precision(q.dtype)
    q = pad_axis(q, 1, num_q_blocks * block_q)
    k = pad_axis(k, 1, num_kv_blocks * block_kv)
    v = pad_axis(v, 1, num_kv_blocks * block_kv)
    mask_fn = vmap_mask(block_mask.mask_mod)
    score_fn = vmap_score(score_program) if score_program is not None else None
    table_batch = block_mask.kv_num_blocks.shape[0] > 1
    table_heads = block_mask.kv_num_blocks.shape[1] > 1
    axes = sharding.varying_axes(q, k, v, block_mask, score_program, sinks)

    def one_query_block(b, h, row):
        tb, th = (b if table_batch else 0), (h if table_heads else 0)
        q_tile = lax.dynamic_slice_in_dim(q[b, :, h], row * block_q, block_q)  # [block_q, D]
        q_idx = jnp.minimum(row * block_q + jnp.arange(block_q, dtype=jnp.int32), q_len - 1)

        def visit(kv_block, state, masked):
            start = kv_block * block_kv
            k_tile = lax.dynamic_slice_in_dim(k[b, :, h // group], start, block_kv)
            v_tile = lax.dynamic_slice_in_dim(v[b, :, h // group], start, block_kv)
            scores = jnp.dot(q_tile, k_tile.T, preferred_element_type=jnp.float32,
                             precision=precision) * scale
            kv_idx = start + jnp.arange(block_kv, dtype=jnp.int32)
            kv_idx_in_range = jnp.minimum(kv_idx, kv_len - 1)
            if score_fn is not None:
                scores = score_fn(scores, b, h, q_idx, kv_idx_in_range).astype(jnp.float32)
            scores = scores * online_softmax.LOG2_E
            if masked:
                keep = mask_fn(b, h, q_idx, kv_idx_in_range) & (kv_idx < kv_len)[None, :]
                scores = jnp.where(keep, scores, -jnp.inf)
            return online_softmax.update(state, scores, v_tile, precision)

        def walk(num_blocks, indices, state, masked):
            return lax.fori_loop(
                0, num_blocks[tb, th, row],
                lambda j, s: visit(indices[tb, th, row, j], s, masked), state)

        # Inside a shard_map that checks varying axes the loop's state varies as its
        # inputs do.
        state = sharding.vary(online_softmax.initial_state(block_q, value_dim), axes)
        state = walk(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, state, False)
        state = walk(block_mask.kv_num_blocks, block_mask.kv_indices, state, True)
        sink_log2 = (None if sinks is None
                     else sinks[h].astype(jnp.float32) * online_softmax.LOG2_E)
        return online_softmax.finalize(state, sink_log2) + (
            (online_softmax.row_max(state),) if with_max else ())

    def one_head(b, h):
        out, *rows = lax.map(lambda row: one_query_block(b, h, row),
                             jnp.arange(num_q_blocks, dtype=jnp.int32))
        return (out.reshape(-1, value_dim),) + tuple(row.reshape(-1) for row in rows)

    heads = jnp.arange(q_heads, dtype=jnp.int32)
    batches = jnp.arange(batch, dtype=jnp.int32)
    out, *rows = jax.vmap(jax.vmap(one_head, in_axes=(None, 0)),
                          in_axes=(0, None))(batches, heads)
    # out [B, Hq, Sq_pad, Dv] -> [B, Sq, Hq, Dv]; rows: lse (and the row max) [B, Hq, Sq_pad]
    out = jnp.swapaxes(out, 1, 2)[:, :q_len].astype(out_dtype or q.dtype)
    return (out,) + tuple(row[:, :, :q_len] for row in rows)
