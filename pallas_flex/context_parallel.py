"""Context parallelism: one sequence split over the devices of a mesh axis (ring, pass-KV).

Built on JAX's own SPMD machinery: called inside `jax.shard_map`, each device keeps its
query shard while the K/V shards travel around the ring with `jax.lax.ppermute`; every
step runs the block-sparse kernels on the visiting shard with the user's mods seeing
global positions, and the partial results merge exactly (`merge_attention_states`,
float32 between steps). The ring has its own VJP: the backward passes K/V round the ring
again (nothing but this device's shards and the merged statistics is kept), runs the fused
backward kernels of each visiting shard with the merged output and lse, and sends the
K/V gradient buffers, which travel with their shard, home at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from pallas_flex.api import (
    AuxRequest, _attention_block_mask, _zero_cotangent, attention, attention_backward,
    call_results, check_aux, flex_attention, merge_attention_states, resolve_backend)
from pallas_flex.masks.mod_program import MASK, SCORE, const_positions, make_mod_program
from pallas_flex import sharding
from pallas_flex.sinks import check_sinks, merge_sinks

__all__ = ["ContextParallel", "choose_strategy", "context_parallel_attention", "layout_order",
           "ring_head_chunks", "striped_order", "zigzag_order"]
LAYOUTS = ("contiguous", "zig-zag", "striped")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """`pf.attention(..., context_parallel=pf.ContextParallel("cp"))`: the sequence is
    split over mesh axis `axis_name` (inside `jax.shard_map`); `layout` and `strategy` as
    in `context_parallel_attention`."""

    axis_name: str
    layout: str = "contiguous"
    strategy: str = "auto"
    head_chunks: int | None = None


def _positions(index, length, devices, layout):
    """Global position of each local index of device `index`'s shard of `length` rows:
    contiguous (device i holds [i * length, (i + 1) * length)), zig-zag (two chunks of
    length / 2: chunk i and chunk 2N - 1 - i, so every device gets as much of a causal
    mask's work as every other) or striped (every N-th position from i: local row r is
    position r * N + i, which also spreads every document over all devices)."""
    if layout == "contiguous":
        offset = (index * length).astype(jnp.int32)
        return lambda local: local + offset
    if layout == "striped":
        offset = jnp.asarray(index).astype(jnp.int32)
        return lambda local: local * devices + offset
    half = length // 2
    first = (index * half).astype(jnp.int32)
    second = ((2 * devices - 1 - index) * half).astype(jnp.int32)
    return lambda local: jnp.where(local < half, local + first, local - half + second)


def _gathered_positions(length, devices, layout):
    """Global position of each row of shards gathered in device order (row g is device
    g // length's local row g % length)."""
    return lambda g: _positions(g // length, length, devices, layout)(g % length)


def _same(index):
    return index


def _at_global_positions(mod, q_position, kv_position, is_score, head=lambda h: h):
    """`mod` evaluated at global positions (and heads: `head`), from traced shard offsets
    the kernels read as captured arrays, so one program serves every device and step."""
    if mod is None:
        return None
    if is_score:
        return lambda score, b, h, q_idx, kv_idx: mod(score, b, head(h), q_position(q_idx),
                                                       kv_position(kv_idx))
    return lambda b, h, q_idx, kv_idx: mod(b, head(h), q_position(q_idx), kv_position(kv_idx))


def striped_order(seq_len, devices):
    """int32 [seq_len]: the global positions in striped layout order, so that
    `x[:, striped_order(S, N)]` sharded N ways gives device i positions i, i + N,
    i + 2N, ...; `x[:, jnp.argsort(order)]` undoes it."""
    if seq_len % devices:
        raise ValueError(f"a striped layout deals the sequence to {devices} devices: "
                         f"seq_len {seq_len} is not a multiple of {devices}")
    return jnp.arange(seq_len, dtype=jnp.int32).reshape(-1, devices).T.reshape(-1)


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got "
                         f"{layout!r}")


def layout_order(seq_len, devices, layout):
    """The positions in `layout`'s order (`x[:, layout_order(S, N, layout)]` lays inputs
    out for it): identity, `zigzag_order` or `striped_order`."""
    _check_layout(layout)
    if layout == "zig-zag":
        return zigzag_order(seq_len, devices)
    if layout == "striped":
        return striped_order(seq_len, devices)
    return jnp.arange(seq_len, dtype=jnp.int32)


def zigzag_order(seq_len, devices):
    """int32 [seq_len]: the global positions in zig-zag layout order, so that
    `x[:, zigzag_order(S, N)]` sharded N ways gives device i chunks i and 2N - 1 - i (of
    S / 2N positions each); `x[:, jnp.argsort(order)]` undoes it."""
    if seq_len % (2 * devices):
        raise ValueError(f"a zig-zag layout splits the sequence into 2 x {devices} equal "
                         f"chunks: seq_len {seq_len} is not a multiple of {2 * devices}")
    chunks = jnp.arange(seq_len, dtype=jnp.int32).reshape(2 * devices, -1)
    order = [chunk for i in range(devices) for chunk in (i, 2 * devices - 1 - i)]
    return chunks[jnp.asarray(order)].reshape(-1)


def context_parallel_attention(q, k, v, *, axis_name, mask_mod=None, score_mod=None,
                               scale=None, return_lse=False, layout="contiguous",
                               strategy="auto", backend=None, kernel_options=None,
                               sinks=None, return_aux=None, head_chunks=None):
    """`pf.attention` over a sequence sharded along `axis_name`, inside `jax.shard_map`.

    Args:
      q: this device's query shard [B, Sq / N, Hq, D]: device i of the N along
        `axis_name` holds global positions [i * Sq / N, (i + 1) * Sq / N).
      k, v: this device's key/value shards [B, Skv / N, Hkv, D or Dv], laid out alike.
      axis_name: the mesh axis the sequence is split over.
      mask_mod, score_mod: as in `pf.attention`, at global positions (`q_idx`, `kv_idx`
        are positions in the whole sequence); arrays they capture are read whole on
        every device (pass them replicated), and get gradients as in `pf.attention`.
      layout: "contiguous" (above), "zig-zag" (device i holds chunks i and 2N - 1 - i of
        the sequence cut in 2N) or "striped" (device i holds positions i, i + N, ...):
        lay the inputs out with `x[:, layout_order(S, N, layout)]`, and the outputs come
        back in that order. The mods still see original positions. Both balance a causal
        mask's work across the devices; striped also deals every document of a packed
        sequence out to all of them (zig-zag leaves a device whichever documents its two
        chunks hold).
      strategy: "ring" (K/V shards passed round the ring, one step per device, each
        transfer overlapped with the previous step's kernels), "all_gather" (every device
        gathers the whole K/V once, `jax.lax.all_gather`, and runs one call: what Llama 3
        training uses; K/V memory per device is the whole sequence's), "all_to_all"
        (Ulysses: `jax.lax.all_to_all` trades the sequence split for a head split, each
        device attends its Hq / N heads over the whole sequence, and the outputs trade
        back; Hq and Hkv must be multiples of N) or "auto" (the default:
        `choose_strategy`). Measured on 4 H200s over NVLink, forward+backward, B1 H16
        D128: all-gather was fastest everywhere (causal 1M tokens 100 % parallel
        efficiency, ring 97 %, all-to-all 92 %; document masks 109 % / 85 % / 36 %),
        so "auto" gathers where the whole K/V is small next to the device's memory and
        passes it round the ring where it is not.
      head_chunks: the ring runs the KV heads in this many groups, one group after the
        other (each group's K/V goes round the ring alone), so that what the ring holds
        beside the inputs and outputs -- the visiting K/V shard and, in the backward, the
        float32 dK/dV buffers travelling with it and dQ's -- is 1 / head_chunks of the
        whole; must divide Hkv. None (the default): the fewest groups whose K/V shard
        takes at most 64 MiB (`ring_head_chunks`), so a long sequence's ring needs
        little more memory than its shards (B1 H16 D128 at 128k tokens a device: 16
        groups). Applies to the ring only.
      scale, return_lse, backend, kernel_options, sinks, return_aux: as in
        `pf.attention` (a sink takes part in every row once, merged after the devices'
        parts; the row max is the largest over every device's keys).
    Returns:
      this device's output shard [B, Sq / N, Hq, Dv] (and lse [B, Hq, Sq / N], or a
      `pf.AuxOutput` of this device's rows with return_aux).

    The enclosing `jax.shard_map` may check varying manual axes (check_vma=True, its
    default; backend "interpret" then refuses, its interpreter cannot index the
    per-step BlockMasks that vary with the shard) or not. A step whose
    BlockMask lists no block is not computed on that device, and K/V stop travelling
    once no device needs a later step (a sliding window's first steps only).

    Example:
      >>> mesh = jax.make_mesh((4,), ("cp",))
      >>> shard = jax.sharding.PartitionSpec(None, "cp")
      >>> step = jax.shard_map(
      ...     lambda q, k, v: pf.context_parallel_attention(q, k, v, axis_name="cp",
      ...                                                   mask_mod=pf.masks.causal_mask),
      ...     mesh=mesh, in_specs=shard, out_specs=shard)
      >>> out = jax.jit(step)(q, k, v)   # equals pf.attention(q, k, v, mask_mod=...)
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must be 4-D shards [B, S, H, D], got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    _check_layout(layout)
    if layout == "zig-zag" and (q.shape[1] % 2 or k.shape[1] % 2):
        raise ValueError(f"a zig-zag shard holds two equal chunks: shard lengths "
                         f"{q.shape[1]} and {k.shape[1]} must be even")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, "
                         f"got {strategy!r}")
    if head_chunks is not None and strategy not in ("auto", "ring"):
        raise ValueError(f"head_chunks groups the ring's heads; strategy {strategy!r} "
                         "does not pass K/V round a ring")
    ring_head_chunks(k.shape, v.shape, k.dtype, head_chunks)  # validates head_chunks
    check_sinks(sinks, q.shape[2])
    with_max = check_aux(return_aux, return_lse)
    out, lse, *row_max = _context_parallel(
        q, k, v, axis_name, mask_mod, score_mod, layout, strategy,
        dict(scale=scale, backend=backend, kernel_options=kernel_options), with_max,
        head_chunks)
    if sinks is not None:  # one more part of every row, merged after the others
        out, lse = merge_sinks(out, lse, sinks)
    return call_results(out, lse, row_max, return_lse, return_aux)


STRATEGIES = ("auto", "ring", "all_gather", "all_to_all")
# "auto" gathers K/V when the whole sequence's K and V take at most this share of a
# device's memory (the gathered K/V, its float32 gradient buffers and the kernels'
# working set then fit beside a model's activations).
_GATHER_SHARE = 1 / 8
_UNKNOWN_DEVICE_MEMORY = 16 * 2 ** 30


def choose_strategy(k_shard_shape, v_shard_shape, dtype, devices, device=None):
    """The strategy "auto" runs: "all_gather" where the whole sequence's K and V
    (`devices` shards of these shapes) take at most 1/8 of the device's memory
    (`memory_stats()["bytes_limit"]`, 16 GiB where the platform does not say), else
    "ring". At 1M tokens, Hkv 16, D 128 in bf16 the whole K/V is 8 GiB: gathered on an
    80 GB H100 or a 141 GB H200, ring past ~1.2M tokens on an H100."""
    gathered = devices * jnp.dtype(dtype).itemsize * (
        math.prod(k_shard_shape) + math.prod(v_shard_shape))
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit", _UNKNOWN_DEVICE_MEMORY)
    return "all_gather" if gathered <= _GATHER_SHARE * limit else "ring"


# The ring's head groups ("auto"): the fewest whose K/V shard (k and v of this device)
# is at most this many bytes. A group's kernels still fill the GPU (64 MiB of bf16 K/V
# at D 128 is 128k key rows over the group's heads and batch: 1024 blocks of 128 keys
# for the dK/dV kernel), and its transfers stay long enough to run at the link's rate.
_RING_CHUNK_BYTES = 64 * 2 ** 20


def ring_head_chunks(k_shard_shape, v_shard_shape, dtype, head_chunks=None):
    """How many groups of KV heads the ring runs one after the other: `head_chunks` if
    given (a positive divisor of Hkv, else ValueError), else the fewest groups whose K/V
    shard takes at most 64 MiB."""
    kv_heads = k_shard_shape[2]
    if head_chunks is not None:
        if (isinstance(head_chunks, bool) or not isinstance(head_chunks, int)
                or head_chunks < 1 or kv_heads % head_chunks):
            raise ValueError(f"head_chunks must be a positive divisor of the {kv_heads} KV "
                             f"heads, got {head_chunks!r}")
        return head_chunks
    shard = jnp.dtype(dtype).itemsize * (math.prod(k_shard_shape) + math.prod(v_shard_shape))
    return next(chunks for chunks in range(1, kv_heads + 1)
                if kv_heads % chunks == 0
                and (shard // chunks <= _RING_CHUNK_BYTES or chunks == kv_heads))


def _context_parallel(q, k, v, axis_name, mask_mod, score_mod, layout, strategy, options,
                      with_max=False, head_chunks=None):
    """(out in q's dtype, lse), and with_max the row max, of one strategy."""
    devices = jax.lax.axis_size(axis_name)
    if strategy == "auto":
        strategy = choose_strategy(k.shape, v.shape, k.dtype, devices)
    index = jax.lax.axis_index(axis_name)
    q_position = _positions(index, q.shape[1], devices, layout)
    backend = options["backend"]
    if strategy == "all_gather":
        k, v = (jax.lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k, v))
        return _one_call(q, k, v, mask_mod, score_mod, q_position,
                         _gathered_positions(k.shape[1] // devices, devices, layout),
                         lambda h: h, options, with_max)
    if strategy == "all_to_all":
        return _all_to_all(q, k, v, axis_name, devices, index, layout, mask_mod,
                           score_mod, options, with_max)
    if resolve_backend(backend) == "reference":  # the dense oracle: plain autodiff
        out, lse, *row_max = _ring_forward(q, k, v, axis_name, layout, mask_mod, score_mod,
                                           options, with_max=with_max)
    else:
        score_program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
        mask_program = make_mod_program(mask_mod, MASK) if mask_mod is not None else None
        out, lse, *row_max = _ring(
            q, k, v, mask_program, score_program,
            _RingConfig(axis_name, layout, tuple(sorted(options.items(), key=lambda x: x[0])),
                        with_max, ring_head_chunks(k.shape, v.shape, k.dtype, head_chunks)))
    return (out.astype(q.dtype), lse, *row_max)


@dataclasses.dataclass(frozen=True)
class _RingConfig:
    axis_name: str
    layout: str
    options: tuple  # (name, value) pairs of scale, backend, kernel_options
    with_max: bool = False  # a third output: the row max (a statistic: no gradient)
    head_chunks: int = 1  # groups of KV heads run one after the other

    def __hash__(self):
        return hash((self.axis_name, self.layout, repr(self.options), self.with_max,
                     self.head_chunks))

    def __eq__(self, other):
        return isinstance(other, _RingConfig) and hash(self) == hash(other)


def _ring_schedule(q, k, v, axis_name, layout, mask_mod, kernel_options):
    """(BlockMask of each ring step, whether it lists a block on this device, how many
    devices need each step): at step s device i holds the K/V shard of device
    (i - s) mod N. The BlockMasks are built first: a step whose BlockMask lists no block
    is not computed on that device, and a step no device computes is not transferred
    either (psum'd, so every device takes the same branch). Built once by the forward,
    kept for the backward."""
    devices = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    q_position = _positions(index, q.shape[1], devices, layout)
    block_masks, computed = [], []
    for step in range(devices):
        kv_position = _positions((index - step) % devices, k.shape[1], devices, layout)
        block_mask = _attention_block_mask(
            q, k, v, _at_global_positions(mask_mod, q_position, kv_position, False), None,
            kernel_options)
        block_masks.append(block_mask)
        computed.append(jnp.bool_(True) if block_mask is None else (
            jnp.sum(block_mask.kv_num_blocks) + jnp.sum(block_mask.full_kv_num_blocks) > 0))
    needed = jax.lax.psum(jnp.stack(computed).astype(jnp.int32), axis_name)
    return block_masks, computed, needed


def _step_score_mods(q, k, axis_name, layout, score_mod):
    """The score_mod at global positions, per ring step (closures: nothing computed)."""
    devices = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    q_position = _positions(index, q.shape[1], devices, layout)
    return [_at_global_positions(score_mod, q_position,
                                 _positions((index - step) % devices, k.shape[1], devices,
                                            layout), True)
            for step in range(devices)]


def _shift(x, axis_name, devices, distance):
    """`x` sent `distance` devices on round the ring (back, if negative)."""
    if distance % devices == 0:
        return x
    return jax.lax.ppermute(x, axis_name, [(source, (source + distance) % devices)
                                           for source in range(devices)])


def _move_to_step(x, held, step, needed, axis_name, devices):
    """`x` (the shards of step `held`, on every device) moved on to step `step`'s if any
    device computes that step, in one hop over the steps no device computes (a window or
    a document mask can leave middle steps empty); and the step now held. `held` and
    `needed` agree on every device, so every device takes the same branch."""
    def move(x):
        return jax.lax.switch(step - held - 1, [
            functools.partial(_shift, axis_name=axis_name, devices=devices, distance=d)
            for d in range(1, step + 1)], x)
    wanted = needed[step] > 0
    return (jax.lax.cond(wanted, move, lambda x: x, x),
            jnp.where(wanted, jnp.int32(step), held))


def _ring_forward(q, k, v, axis_name, layout, mask_mod, score_mod, options,
                  schedule=None, with_max=False):
    """(out float32, lse), and with_max the row max: the K/V shards passed round the
    ring, partial results merged. schedule: `_ring_schedule`'s, if already built."""
    devices = jax.lax.axis_size(axis_name)
    block_masks, computed, needed = schedule or _ring_schedule(
        q, k, v, axis_name, layout, mask_mod, options["kernel_options"])
    score_mods = _step_score_mods(q, k, axis_name, layout, score_mod)
    out = jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32)
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    merged = (out, lse) + ((lse,) if with_max else ())  # the row max starts at -inf too
    # Inside a shard_map that checks varying axes the merged state varies as the steps'
    # results do (both branches of each step's cond must agree).
    merged = sharding.vary(merged, sharding.varying_axes(q, k, v, mask_mod, score_mod))
    held = jnp.int32(0)
    for step, (block_mask, busy, shifted_score_mod) in enumerate(
            zip(block_masks, computed, score_mods)):
        if step:
            (k, v), held = _move_to_step((k, v), held, step, needed, axis_name, devices)

        def merge_step(merged, k, v, block_mask=block_mask, score_mod=shifted_score_mod):
            part, aux = flex_attention(
                q, k, v, score_mod, block_mask, **options,
                return_aux=AuxRequest(lse=True, max_scores=with_max))
            out, lse = merge_attention_states(merged[0], merged[1], part, aux.lse)
            if with_max:
                return out, lse, jnp.maximum(merged[2], aux.max_scores)
            return out, lse
        merged = jax.lax.cond(busy, merge_step, lambda merged, k, v: merged, merged, k, v)
    return merged


def _head_group(x, group, size, axis=2):
    return jax.lax.dynamic_slice_in_dim(x, group * size, size, axis=axis)


def _in_head_group(mod, head_offset, is_score):
    """`mod` of a head group: its heads offset to the whole call's (only for a mod that
    reads h: the others keep their program, so their BlockMask is shared by all groups)."""
    if mod is None or not make_mod_program(mod, SCORE if is_score else MASK).uses_head:
        return mod
    return _at_global_positions(mod, _same, _same, is_score, lambda h: h + head_offset)


def _over_head_groups(q, k, config, programs, run_group, carry):
    """Runs `run_group(group, carry, q_heads, kv_heads, mask, score, programs)` for each
    of config.head_chunks groups of KV heads (and their query heads), one after the
    other in a `fori_loop`, so the ring's buffers of one group are freed before the next
    group's are made: mask and score are the group's mods, programs the whole call's
    (mask, score) programs as the loop sees them. They travel in the loop's carry, so
    that the group's mods capture the loop's own values of their arrays (which
    `const_positions` matches by identity)."""
    chunks = config.head_chunks
    q_heads, kv_heads = q.shape[2] // chunks, k.shape[2] // chunks

    def body(group, state):
        carry, (mask, score) = state
        offset = (group * q_heads).astype(jnp.int32)
        carry = run_group(group, carry, q_heads, kv_heads, _in_head_group(mask, offset, False),
                          _in_head_group(score, offset, True), (mask, score))
        return carry, (mask, score)
    return jax.lax.fori_loop(0, chunks, body, (carry, programs))[0]


def _ring_forward_by_head_groups(q, k, v, mask_program, score_program, config,
                                 schedule=None):
    """`_ring_forward` over config.head_chunks groups of heads, one after the other:
    (out in q's dtype, lse), and with config.with_max the row max. schedule: the
    BlockMasks of a mask that does not read h, shared by every group (None: each group
    builds its own)."""
    options, with_max = dict(config.options), config.with_max
    if config.head_chunks == 1:
        out, *stats = _ring_forward(q, k, v, config.axis_name, config.layout, mask_program,
                                    score_program, options, schedule, with_max)
        return (out.astype(q.dtype), *stats)

    def run_group(group, merged, q_heads, kv_heads, mask, score, programs):
        out, *stats = _ring_forward(
            _head_group(q, group, q_heads), _head_group(k, group, kv_heads),
            _head_group(v, group, kv_heads), config.axis_name, config.layout, mask, score,
            options, schedule, with_max)
        return (jax.lax.dynamic_update_slice_in_dim(
                    merged[0], out.astype(q.dtype), group * q_heads, axis=2),
                *(jax.lax.dynamic_update_slice_in_dim(whole, part, group * q_heads, axis=1)
                  for whole, part in zip(merged[1:], stats)))
    rows = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    merged = (jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype), rows) + (
        (rows,) if with_max else ())
    merged = sharding.vary(merged, sharding.varying_axes(q, k, v, mask_program,
                                                         score_program))
    return _over_head_groups(q, k, config, (mask_program, score_program),
                             run_group, merged)


def _shared_schedule(q, k, v, mask_program, config):
    """The ring's BlockMasks, built once for every head group where that is possible:
    with one group, or a mask that does not read h. None otherwise."""
    if config.head_chunks > 1 and mask_program is not None and mask_program.uses_head:
        return None
    return _ring_schedule(q, k, v, config.axis_name, config.layout, mask_program,
                          dict(config.options)["kernel_options"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, mask_program, score_program, config):
    """The ring with its own backward (below): (out in q's dtype, lse), and the row max
    with config.with_max."""
    return _ring_forward_by_head_groups(q, k, v, mask_program, score_program, config)


def _ring_fwd(q, k, v, mask_program, score_program, config):
    wanted = tuple(primal.perturbed for primal in (
        score_program.consts if score_program is not None else ()))
    q, k, v, mask_program, score_program = jax.tree.map(
        lambda primal: primal.value, (q, k, v, mask_program, score_program),
        is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    schedule = _shared_schedule(q, k, v, mask_program, config)
    out, lse, *row_max = _ring_forward_by_head_groups(q, k, v, mask_program, score_program,
                                                      config, schedule)
    # Only this device's shards, the merged statistics and the (small) step BlockMasks
    # are kept: the backward passes K/V round the ring again instead of holding every
    # shard that visited. The output is kept in q's dtype, as one device's call keeps it.
    return ((out, lse, *row_max),
            (q, k, v, score_program, out, lse, wanted, mask_program, schedule))


def _add_const_grads(d_consts, positions, grads):
    """d_consts (float32, per captured array of the whole program) plus the gradients
    `grads` of a derived program's captured arrays, at their `positions` among the
    whole program's (`const_positions`; None: one of the derived program's own)."""
    d_consts = list(d_consts)
    for position, grad in zip(positions, grads):
        if position is not None and grad is not None:
            d_consts[position] = d_consts[position] + grad.astype(jnp.float32)
    return d_consts


def _ring_backward(q, k, v, out, lse, d_out, d_lse, mask_program, score_program, wanted,
                   config, schedule):
    """The ring backward of one head group: (dq, dk, dv in their inputs' dtypes, the
    float32 gradients of score_program's captured arrays, None where not wanted)."""
    axis_name, options = config.axis_name, dict(config.options)
    devices = jax.lax.axis_size(axis_name)
    block_masks, computed, needed = schedule or _ring_schedule(
        q, k, v, axis_name, config.layout, mask_program, options["kernel_options"])
    score_mods = _step_score_mods(q, k, axis_name, config.layout, score_program)
    d_q = jnp.zeros(q.shape, jnp.float32)
    d_k, d_v = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    consts = score_program.consts if score_program is not None else ()
    d_consts = [jnp.zeros(jnp.shape(c), jnp.float32) if w else None
                for c, w in zip(consts, wanted)]
    axes = sharding.varying_axes(q, k, v, out, lse, d_out, d_lse, score_program,
                                 mask_program)
    d_q, d_k, d_v, d_consts = sharding.vary((d_q, d_k, d_v, d_consts), axes)
    held = jnp.int32(0)
    for step, (block_mask, busy, shifted_score_mod) in enumerate(
            zip(block_masks, computed, score_mods)):
        if step:  # the dK/dV buffers travel with their shard
            (k, v, d_k, d_v), held = _move_to_step((k, v, d_k, d_v), held, step, needed,
                                                   axis_name, devices)

        def step_grads(d_q, d_k, d_v, d_consts, k, v, block_mask=block_mask,
                       score_mod=shifted_score_mod):
            shifted = (make_mod_program(score_mod, SCORE) if score_mod is not None
                       else None)
            shifted_positions = const_positions(score_program, shifted)
            g_q, g_k, g_v, g_consts = attention_backward(
                q, k, v, out, lse, d_out, d_lse, block_mask=block_mask, score_mod=shifted,
                wanted_const_grads=[p is not None and wanted[p] for p in shifted_positions],
                **options)
            return (d_q + g_q.astype(jnp.float32), d_k + g_k.astype(jnp.float32),
                    d_v + g_v.astype(jnp.float32),
                    _add_const_grads(d_consts, shifted_positions, g_consts))
        d_q, d_k, d_v, d_consts = jax.lax.cond(
            busy, step_grads, lambda d_q, d_k, d_v, d_consts, k, v: (d_q, d_k, d_v, d_consts),
            d_q, d_k, d_v, d_consts, k, v)
    # The buffers here belong to the device `held` places back: send them home.
    d_k, d_v = jax.lax.switch(held, [
        functools.partial(_shift, axis_name=axis_name, devices=devices, distance=-back)
        for back in range(devices)], (d_k, d_v))
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_consts


def _ring_bwd(config, residuals, cotangents):
    """The ring backward: K/V shards go round again, each step runs the fused backward
    kernels of the visiting shard with the merged out and lse (so its P is the global
    softmax), dq accumulates here and dK/dV accumulate in float32 buffers that travel
    with their shard; after the last step the buffers go home. With head groups, one
    group after the other. Captured arrays' gradients are this device's partial sums
    (shard_map sums a replicated input's cotangent)."""
    q, k, v, score_program, out, lse, wanted, mask_program, schedule = residuals
    d_out, d_lse = cotangents[:2]  # the row max (a statistic) has no gradient
    d_out = jnp.zeros(out.shape, q.dtype) if isinstance(d_out, SymbolicZero) else d_out
    d_lse = None if isinstance(d_lse, SymbolicZero) else d_lse
    consts = score_program.consts if score_program is not None else ()
    if config.head_chunks == 1:
        d_q, d_k, d_v, d_consts = _ring_backward(
            q, k, v, out, lse, d_out, d_lse, mask_program, score_program, wanted, config,
            schedule)
    else:
        def run_group(group, grads, q_heads, kv_heads, mask, score, programs):
            d_q, d_k, d_v, d_consts = grads
            score = make_mod_program(score, SCORE) if score is not None else None
            # The group's program's captured arrays among the whole program's.
            positions = const_positions(programs[1], score)
            g_q, g_k, g_v, g_consts = _ring_backward(
                _head_group(q, group, q_heads), _head_group(k, group, kv_heads),
                _head_group(v, group, kv_heads),
                _head_group(out, group, q_heads), _head_group(lse, group, q_heads, axis=1),
                _head_group(d_out, group, q_heads),
                None if d_lse is None else _head_group(d_lse, group, q_heads, axis=1),
                mask, score, [p is not None and wanted[p] for p in positions],
                config, schedule)
            d_consts = _add_const_grads(d_consts, positions, g_consts)
            return (jax.lax.dynamic_update_slice_in_dim(d_q, g_q, group * q_heads, axis=2),
                    jax.lax.dynamic_update_slice_in_dim(d_k, g_k, group * kv_heads, axis=2),
                    jax.lax.dynamic_update_slice_in_dim(d_v, g_v, group * kv_heads, axis=2),
                    d_consts)

        grads = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
                 jnp.zeros(v.shape, v.dtype),
                 [jnp.zeros(jnp.shape(c), jnp.float32) if w else None
                  for c, w in zip(consts, wanted)])
        grads = sharding.vary(grads, sharding.varying_axes(
            q, k, v, out, lse, d_out, d_lse, score_program, mask_program))
        d_q, d_k, d_v, d_consts = _over_head_groups(
            q, k, config, (mask_program, score_program), run_group, grads)
    d_mask = jax.tree.map(_zero_cotangent, mask_program)
    d_score = None
    if score_program is not None:
        d_score = jax.tree.map(_zero_cotangent, score_program)
        d_score.consts = tuple(
            grad.astype(jnp.result_type(c)) if grad is not None else _zero_cotangent(c)
            for grad, c in zip(d_consts, consts))
    return sharding.typed_as_primals((d_q, d_k, d_v, d_mask, d_score),
                                     (q, k, v, mask_program, score_program))


_ring.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)


def _one_call(q, k, v, mask_mod, score_mod, q_position, kv_position, head, options,
              with_max=False):
    """(out, lse), and with_max the row max, of one `attention` call with the mods at
    global positions and heads."""
    out, aux = attention(
        q, k, v, return_aux=AuxRequest(lse=True, max_scores=with_max), **options,
        mask_mod=_at_global_positions(mask_mod, q_position, kv_position, False, head),
        score_mod=_at_global_positions(score_mod, q_position, kv_position, True, head))
    return (out, aux.lse) + ((aux.max_scores,) if with_max else ())


def _all_to_all(q, k, v, axis_name, devices, index, layout, mask_mod, score_mod, options,
                with_max=False):
    """Ulysses: [B, S / N, H, D] shards become [B, S, H / N, D] (put back in sequence
    order under the zig-zag and striped layouts), one call, and the outputs trade back.

    The call sees the whole sequence in order, so the mods run at their own positions,
    with no position arithmetic: the call is the one-device call on H / N heads (the
    head offset is added only for mods that read `h`). Measured on 4 H200s before this
    reordering, mods evaluated at zig-zag-gathered positions ran the call ~1.8x slower
    (benchmarks/results/h200/multi_device.json)."""
    if q.shape[2] % devices or k.shape[2] % devices:
        raise ValueError(f"strategy 'all_to_all' splits the heads over {devices} devices: "
                         f"Hq {q.shape[2]} and Hkv {k.shape[2]} must be multiples of it")
    head_offset = (index * (q.shape[2] // devices)).astype(jnp.int32)
    q, k, v = (jax.lax.all_to_all(x, axis_name, 2, 1, tiled=True) for x in (q, k, v))
    order = None
    if layout != "contiguous":  # rows in device order -> sequence order, and back after
        order = layout_order(q.shape[1], devices, layout)
        restore = jnp.argsort(order)
        q, k, v = (jnp.take(x, restore, axis=1) for x in (q, k, v))

    def at_global_heads(mod, is_score):
        if mod is None or not make_mod_program(mod, SCORE if is_score else MASK).uses_head:
            return mod
        return _at_global_positions(mod, _same, _same, is_score, lambda h: h + head_offset)
    out, aux = attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=with_max),
                         **options, mask_mod=at_global_heads(mask_mod, False),
                         score_mod=at_global_heads(score_mod, True))
    rows = [aux.lse] + ([aux.max_scores] if with_max else [])  # [B, H / N, S] each
    if order is not None:
        out = jnp.take(out, order, axis=1)
        rows = [jnp.take(row, order, axis=2) for row in rows]
    return (jax.lax.all_to_all(out, axis_name, 1, 2, tiled=True),
            *(jax.lax.all_to_all(row, axis_name, 2, 1, tiled=True) for row in rows))
