"""Context parallelism: one sequence split over the devices of a mesh axis (ring, pass-KV).

Built on JAX's own SPMD machinery: called inside `jax.shard_map`, each device keeps its
query shard while the K/V shards travel around the ring with `jax.lax.ppermute`; every
step runs the block-sparse kernels on the visiting shard with the user's mods seeing
global positions, and the partial results merge exactly (`merge_attention_states`,
float32 between steps). The backward is JAX's transpose of that program: the kernels'
custom VJPs, and ppermutes the other way round for the K/V gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flex.api import attention, merge_attention_states


def _shifted(mod, q_offset, kv_offset, is_score):
    """`mod` evaluated at global positions: shard-local indices plus the shards' offsets
    (traced scalars: the kernels read them as captured arrays, so one program serves
    every device and step)."""
    if mod is None:
        return None
    if is_score:
        return lambda score, b, h, q_idx, kv_idx: mod(score, b, h, q_idx + q_offset,
                                                       kv_idx + kv_offset)
    return lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + q_offset, kv_idx + kv_offset)


def ring_attention(q, k, v, *, axis_name, mask_mod=None, score_mod=None, scale=None,
                   return_lse=False, backend=None, kernel_options=None):
    """`pf.attention` over a sequence sharded along `axis_name`, inside `jax.shard_map`.

    Args:
      q: this device's query shard [B, Sq / N, Hq, D]: device i of the N along
        `axis_name` holds global positions [i * Sq / N, (i + 1) * Sq / N).
      k, v: this device's key/value shards [B, Skv / N, Hkv, D or Dv], laid out alike.
      axis_name: the mesh axis the sequence is split over.
      mask_mod, score_mod: as in `pf.attention`, at global positions (`q_idx`, `kv_idx`
        are positions in the whole sequence); arrays they capture are read whole on
        every device (pass them replicated), and get gradients as in `pf.attention`.
      scale, return_lse, backend, kernel_options: as in `pf.attention`.
    Returns:
      this device's output shard [B, Sq / N, Hq, Dv] (and lse [B, Hq, Sq / N]).

    The kernels' internal loops do not yet declare which values vary over manual mesh
    axes, so the enclosing `jax.shard_map` needs `check_vma=False`. Every step visits
    every shard (a pair with no block in the BlockMask costs a kernel launch that reads
    nothing, and its transfer); zig-zag load balancing for causal masks is not built yet.

    Example:
      >>> mesh = jax.make_mesh((4,), ("cp",))
      >>> shard = jax.sharding.PartitionSpec(None, "cp")
      >>> step = jax.shard_map(
      ...     lambda q, k, v: pf.ring_attention(q, k, v, axis_name="cp",
      ...                                       mask_mod=pf.masks.causal_mask),
      ...     mesh=mesh, in_specs=shard, out_specs=shard, check_vma=False)
      >>> out = jax.jit(step)(q, k, v)   # equals pf.attention(q, k, v, mask_mod=...)
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must be 4-D shards [B, S, H, D], got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    devices = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    q_offset = (index * q.shape[1]).astype(jnp.int32)
    # Each step sends this device's K/V shard to the next device and receives the
    # previous one's: at step s, device i holds the shard of device (i - s) mod N.
    to_next = [(source, (source + 1) % devices) for source in range(devices)]
    out = lse = None
    for step in range(devices):
        kv_offset = (((index - step) % devices) * k.shape[1]).astype(jnp.int32)
        part, part_lse = attention(
            q, k, v, mask_mod=_shifted(mask_mod, q_offset, kv_offset, False),
            score_mod=_shifted(score_mod, q_offset, kv_offset, True), scale=scale,
            return_lse=True, backend=backend, kernel_options=kernel_options)
        if out is None:
            out, lse = part.astype(jnp.float32), part_lse
        else:
            out, lse = merge_attention_states(out, lse, part, part_lse)
        if step + 1 < devices:
            k, v = jax.lax.ppermute((k, v), axis_name, to_next)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
