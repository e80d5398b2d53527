"""The public entry points: validate, canonicalize, dispatch to a backend."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from pallas_flex import dispatch, sharding
from pallas_flex.kernels import device, mosaic_eligibility
from pallas_flex.kernels.config import resolve_options
from pallas_flex.kernels.reference import reference_attention
from pallas_flex.masks.block_mask import BlockMask, create_block_mask, noop_block_mask
from pallas_flex.masks.mod_program import MASK, SCORE, make_mod_program
from pallas_flex.output_gate import check_output_gate, gate_gradients, gated, gated_result
from pallas_flex.sinks import check_sinks, sink_gradient

BACKENDS = ("pallas", "interpret", "xla", "reference")
_DEFAULT_MASK_BLOCK = 128


def default_backend() -> str:
    """"pallas" on a CUDA GPU, else "xla"."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


_lowering_for_gpu = False


@contextlib.contextmanager
def lowering_for_gpu():
    """Lets backend="pallas" trace on a machine without a GPU, to lower the kernels for
    one: `jax.jit(fn).trace(...).lower(lowering_platforms=("cuda",))`
    (benchmarks/inspect_kernels.py)."""
    global _lowering_for_gpu
    previous, _lowering_for_gpu = _lowering_for_gpu, True
    try:
        yield
    finally:
        _lowering_for_gpu = previous


def resolve_backend(backend) -> str:
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "pallas" and jax.default_backend() != "gpu" and not _lowering_for_gpu:
        raise ValueError(
            f'backend="pallas" needs a GPU (jax.default_backend() is '
            f'"{jax.default_backend()}"); use backend="interpret" to run the kernels in '
            'the Pallas interpreter, or "xla"')
    return backend


def build_block_mask(mask_mod, batch, q_heads, q_len, kv_len, kernel_options):
    """The BlockMask the one-line entry points build from a mask_mod (None: no mask):
    per batch row / head only where the mod reads b / h, blocks of 128 unless
    kernel_options asks for smaller tiles."""
    program = make_mod_program(mask_mod, MASK) if mask_mod is not None else None
    program = dispatch.mask_for_kernels(program, batch, q_heads, q_len, kv_len)
    block_size = _DEFAULT_MASK_BLOCK
    if kernel_options and isinstance(kernel_options, dict):
        block_size = (kernel_options.get("block_q", block_size),
                      kernel_options.get("block_kv", block_size))
    return create_block_mask(
        program, batch if program is not None and program.uses_batch else None,
        q_heads if program is not None and program.uses_head else None, q_len, kv_len,
        block_size=block_size)


def _validate_inputs(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-D array [B, S, H, D], got shape "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if jnp.dtype(x.dtype) not in device.SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, q_len, q_heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"k and v must have batch {batch} (q's), got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same length, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[2]} "
                         f"and {v.shape[2]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k's head dim must equal q's ({head_dim}), got {k.shape[3]}")
    # Before the GQA ratio below, which divides by k's head count.
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        raise ValueError(f"q, k, v must be non-empty, got {q.shape}, {k.shape}, {v.shape}")
    if q_heads % k.shape[2]:
        raise ValueError(f"q's heads ({q_heads}) must be a multiple of k's heads ({k.shape[2]}) "
                         "for grouped-query attention")


def values_in_keys(k, v, value_dim):
    """The values of a call that passes `v=None, value_dim=Dv`: k's first Dv columns (a
    latent cache, DeepSeek's MLA: one array for both), as the slice k[..., :Dv], which
    the latent decode leaves unused (it reads them from k in place) and the other kernels
    take. (v, in_keys): v as given and False when value_dim is None."""
    if value_dim is None:
        if v is None:
            raise ValueError("v is None: pass value_dim=Dv to take the values from k's "
                             "first Dv columns (a latent cache), or pass v")
        return v, False
    if v is not None:
        raise ValueError("value_dim takes the values from k's first value_dim columns: "
                         "pass v=None with it")
    if not hasattr(k, "shape") or len(k.shape) != 4:
        raise ValueError(f"k must be a 4-D array [B, S, H, D], got shape "
                         f"{getattr(k, 'shape', type(k).__name__)}")
    if (isinstance(value_dim, bool) or not isinstance(value_dim, (int, np.integer))
            or not 1 <= value_dim <= k.shape[3]):
        raise ValueError(f"value_dim must be an int from 1 to k's head dim ({k.shape[3]}), "
                         f"got {value_dim!r}")
    return k[..., :int(value_dim)], True


def validate_block_mask(block_mask, q, k):
    if not isinstance(block_mask, BlockMask):
        raise ValueError(f"block_mask must be a pallas_flex.BlockMask, got "
                         f"{type(block_mask).__name__}")
    batch, q_len, q_heads, _ = q.shape
    kv_len = k.shape[1]
    mask_batch, mask_heads, mask_q_len, mask_kv_len = block_mask.shape
    if (mask_q_len, mask_kv_len) != (q_len, kv_len):
        raise ValueError(f"block_mask was built for Q_LEN={mask_q_len}, KV_LEN={mask_kv_len}, "
                         f"but q and k have lengths {q_len} and {kv_len}")
    if mask_batch not in (1, batch):
        raise ValueError(f"block_mask has batch {mask_batch}; expected 1 or {batch}")
    if mask_heads not in (1, q_heads):
        raise ValueError(f"block_mask has {mask_heads} heads; expected 1 or {q_heads} "
                         "(query heads)")


def resolve_scale(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python float (a compile-time constant), got "
                         f"{type(scale).__name__}; fold a traced scale into a score_mod")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _forward_impl(q, k, v, block_mask, score_program, config, out_dtype=None,
                  with_max=False, sinks=None, row_sums_of=(), output_gate=None):
    """(out in out_dtype (default q's), lse), and with_max the row max of the logits, of
    the kernel `pallas_flex.dispatch` picks, run per shard where q, k, v are sharded over
    batch or heads (`pallas_flex.sharding`). sinks [Hq] (or None) take part in the
    kernel's softmax; the lse includes them. row_sums_of: positions of captured arrays
    (`_forward_row_sums`) whose reads' row sums follow (`dispatch.run_forward`).
    output_gate [B, Sq, Hq, Dv] (or None): the output times its sigmoid
    (`pallas_flex/output_gate.py`)."""
    backend, scale, options = config
    choice = dispatch.choose_forward(q, k, v, block_mask, score_program, backend=backend,
                                     options=options, out_dtype=out_dtype, with_max=with_max)

    def forward(operands, offsets):
        q, k, v, block_mask, score_program, sinks, output_gate = operands
        block_mask, score_program, positions = sharding.shift_mods(block_mask, score_program,
                                                                   offsets)
        return dispatch.run_forward(choice, q, k, v, block_mask, score_program, scale=scale,
                                    options=options, interpret=backend == "interpret",
                                    out_dtype=out_dtype, with_max=with_max, sinks=sinks,
                                    row_sums_of=tuple(positions.index(position)
                                                      for position in row_sums_of),
                                    output_gate=output_gate)

    return sharding.call(
        forward, (q, k, v, block_mask, score_program, sinks, output_gate),
        (sharding.QUERY, sharding.KEY, sharding.KEY, sharding.roles_of(block_mask, None),
         sharding.WHOLE, sharding.PER_HEAD, sharding.QUERY), sharding.query_and_rows,
        batch=q.shape[0], q_heads=q.shape[2], kv_heads=k.shape[2])


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _fused_attention(q, k, v, block_mask, score_program, sinks, gate, config,
                     with_max=False):
    """(out, lse), and with_max the row max of the logits (no gradient: a statistic),
    with gradients from the fused backward kernels; residuals are out, lse. sinks: None
    or [Hq], folded into the forward kernels' softmax (`pallas_flex/sinks.py`). gate:
    None or [B, Sq, Hq, Dv], out times its sigmoid: in the Triton or Mosaic GPU
    forward's epilogue here (no one differentiates), after the kernel in the forward
    rule, whose backward needs the ungated output (`pallas_flex/output_gate.py`)."""
    return _forward_impl(q, k, v, block_mask, score_program, config, with_max=with_max,
                         sinks=sinks, output_gate=gate)


def _unwrap_primals(tree):
    return jax.tree.map(lambda primal: primal.value, tree,
                        is_leaf=lambda x: isinstance(x, CustomVJPPrimal))


@jax.tree_util.register_pytree_node_class
class _StaticFlags:
    """Python booleans carried through custom_vjp residuals as static data."""

    def __init__(self, flags):
        self.flags = tuple(flags)

    def tree_flatten(self):
        return (), self.flags

    @classmethod
    def tree_unflatten(cls, flags, _):
        return cls(flags)


def _fused_attention_forward(q, k, v, block_mask, score_program, sinks, gate, config,
                             with_max=False):
    # symbolic_zeros=True: each primal says whether it is differentiated, so captured
    # arrays nobody differentiates (constant ALiBi slopes, say) cost no gradient work,
    # nor do sinks or an output gate nobody differentiates.
    wanted = _StaticFlags(primal.perturbed for primal in (
        score_program.consts if score_program is not None else ()))
    extras_wanted = _StaticFlags([sinks is not None and sinks.perturbed,  # (sinks, gate)
                                  gate is not None and gate.perturbed])
    q, k, v, block_mask, score_program, sinks, gate = _unwrap_primals(
        (q, k, v, block_mask, score_program, sinks, gate))
    if not any(wanted.flags) or _backward_takes_exact_deltas(
            q, k, v, block_mask, score_program, config, wanted.flags):
        row_sums_of = _forward_row_sums(q, k, v, block_mask, score_program, config,
                                        wanted.flags, with_max)
        out, lse, *rows = _forward_impl(q, k, v, block_mask, score_program, config,
                                        with_max=with_max, sinks=sinks,
                                        row_sums_of=row_sums_of)
        split = len(rows) - len(row_sums_of)
        row_max, row_sums = rows[:split], rows[split:]
        return (gated(out, gate), lse, *row_max), (
            q, k, v, block_mask, score_program, sinks, gate, out, lse, tuple(row_sums),
            wanted, extras_wanted)
    # A captured array's gradient sums dS over whole rows, where each row's dS sums to
    # rowsum(P * dP) - delta, zero only if delta = rowsum(dO * out) is taken from the
    # exact output. From the output rounded to 16 bits, every row keeps its rounding
    # error, and an ALiBi slope's gradient multiplies it by key distances in the
    # thousands (relative error 0.37 at 3000 bidirectional tokens in bfloat16, against
    # 0.005 for plain JAX attention). So for the Triton backward the forward keeps its
    # float32 output as the residual and rounds a copy for the caller. (The Mosaic GPU
    # backward sums each row's exact delta itself: `captured_gradients_mosaic.captured_gradients`.)
    out_unrounded, lse, *row_max = _forward_impl(q, k, v, block_mask, score_program, config,
                                                 out_dtype=jnp.float32, with_max=with_max,
                                                 sinks=sinks)
    return ((gated(out_unrounded, gate).astype(q.dtype), lse, *row_max),
            (q, k, v, block_mask, score_program, sinks, gate, out_unrounded, lse, (), wanted,
             extras_wanted))


def _backward_takes_exact_deltas(q, k, v, block_mask, score_program, config, wanted):
    """Whether the backward kernel of this call computes the captured arrays' gradients
    from each row's exact delta (the Mosaic GPU backward), so that the forward need not
    keep a float32 output."""
    backend, _, options = config
    return dispatch.choose_backward(
        q, k, v, block_mask, score_program, backend=backend, options=options,
        wanted_const_grads=wanted).kernel == "mosaic_backward"


def _forward_row_sums(q, k, v, block_mask, score_program, config, wanted, with_max):
    """The positions of the captured arrays whose row sums the forward returns for the
    Mosaic backward, which takes their gradients from them
    (`mosaic_eligibility.captured_row_sums`): those read at indices of b and h whose
    gradients are wanted, where the Mosaic forward runs (the caller has checked that the
    Mosaic backward does)."""
    backend, _, options = config
    # (not those the batch loop sums: a pair bias)
    _, positions = dispatch.split_gradient_positions(q, score_program, options, wanted)
    # (nor those read at kv_idx - q_idx or as [q, kv] blocks: the dK/dV kernel's)
    elsewhere = (mosaic_eligibility.relative_positions(score_program, positions)
                 + mosaic_eligibility.block_positions(score_program, positions))
    positions = tuple(position for position in positions if position not in elsewhere)
    if not positions or not mosaic_eligibility.captured_row_sums(q.shape[-1]):
        return ()
    if dispatch.choose_forward(q, k, v, block_mask, score_program, backend=backend,
                               options=options, with_max=with_max).kernel != "mosaic_forward":
        return ()
    return positions


def _fused_attention_backward(config, with_max, residuals, cotangents):
    del with_max  # the row max is a statistic: its cotangent is dropped
    (q, k, v, block_mask, score_program, sinks, gate, out, lse, row_sums, wanted,
     extras_wanted) = residuals
    d_out, d_lse = cotangents[:2]
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, q.dtype)
    if isinstance(d_lse, SymbolicZero):
        d_lse = None
    d_gate = None
    if gate is not None:  # d_out was the gated output's: the ungated one's from it
        d_out, d_gate = gate_gradients(out, gate, d_out, extras_wanted.flags[1])
    # With sinks, out and lse are those of the softmax the sinks take part in: the
    # kernels' backward is the same (a sink is a key with no value), and the sinks'
    # own gradient comes from the lse and the rows' delta (`sinks.sink_gradient`).
    d_q, d_k, d_v, const_grads = _backward_impl(q, k, v, out, lse, d_out, d_lse, block_mask,
                                                score_program, config, wanted.flags,
                                                row_sums)
    d_sinks = None
    if sinks is not None:
        d_sinks = (sink_gradient(sinks, out, lse, d_out, d_lse) if extras_wanted.flags[0]
                   else jnp.zeros_like(sinks))
    d_block_mask = jax.tree.map(_zero_cotangent, block_mask)
    d_score_program = None
    if score_program is not None:
        d_score_program = jax.tree.map(_zero_cotangent, score_program)
        d_score_program.consts = tuple(
            grad if grad is not None else _zero_cotangent(const)
            for grad, const in zip(const_grads, score_program.consts))
    return sharding.typed_as_primals(
        (d_q, d_k, d_v, d_block_mask, d_score_program, d_sinks, d_gate),
        (q, k, v, block_mask, score_program, sinks, gate))


def _backward_impl(q, k, v, out, lse, d_out, d_lse, block_mask, score_program, config,
                   wanted_flags, row_sums=()):
    """(dq, dk, dv, per captured array of the score_mod its gradient or None) of the
    backward kernel `pallas_flex.dispatch` picks, given the forward's out (float32 where
    captured-array gradients are wanted), lse and row sums (`_forward_row_sums`; () where
    the forward gave none); d_lse may be None. Run per shard where the inputs are
    sharded over batch or heads (`pallas_flex.sharding`)."""
    backend, scale, options = config
    # The "xla" backend has no GPU kernels: its backward runs the same kernels through
    # Pallas's interpreter (still O(S) memory, just not fast).
    choice = dispatch.choose_backward(q, k, v, block_mask, score_program, backend=backend,
                                      options=options, wanted_const_grads=wanted_flags)

    def backward(operands, offsets):
        q, k, v, out, lse, d_out, d_lse, block_mask, score_program, row_sums = operands
        block_mask, shifted_program, positions = sharding.shift_mods(
            block_mask, score_program, offsets)
        d_q, d_k, d_v, shifted_grads = dispatch.run_backward(
            choice, q, k, v, out, lse, d_out, d_lse, block_mask, shifted_program,
            scale=scale, options=options, interpret=backend != "pallas",
            wanted_const_grads=tuple(False if position is None else wanted_flags[position]
                                     for position in positions), row_sums=row_sums)
        const_grads = [None] * len(wanted_flags)
        for position, grad in zip(positions, shifted_grads):
            if position is not None:
                const_grads[position] = grad
        return d_q, d_k, d_v, const_grads

    return sharding.call(
        backward, (q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                   tuple(row_sums)),
        (sharding.QUERY, sharding.KEY, sharding.KEY, sharding.QUERY, sharding.ROW,
         sharding.QUERY, sharding.ROW, sharding.roles_of(block_mask, None), sharding.WHOLE,
         (sharding.ROW,) * len(row_sums)),
        lambda results: (sharding.QUERY, sharding.KEY, sharding.KEY,
                         jax.tree.map(lambda _: sharding.SUM, results[3])),
        batch=q.shape[0], q_heads=q.shape[2], kv_heads=k.shape[2])


def attention_backward(q, k, v, out, lse, d_out, d_lse, *, block_mask, score_mod=None,
                       scale=None, backend=None, kernel_options=None, wanted_const_grads=None):
    """The fused backward kernels of `flex_attention(q, k, v, score_mod, block_mask)`
    given its softmax statistics from elsewhere: `out` and `lse` may be those of attention
    over more keys than k, v hold (context parallelism's ring runs the backward of each
    K/V shard with the merged output and lse). d_lse may be None.

    Returns (dq, dk, dv, const_grads) in float32 where the kernels accumulate so, with
    const_grads per captured array of the score_mod (its `ModProgram`'s consts order),
    None where `wanted_const_grads` (one bool per captured array; None: all) says not."""
    block_mask, score_program, config = _prepare(q, k, v, score_mod, block_mask, scale,
                                                 backend, kernel_options)
    if config[0] == "reference":
        raise ValueError('attention_backward runs the backward kernels: backend '
                         '"reference" has none (it is differentiated by autodiff)')
    consts = score_program.consts if score_program is not None else ()
    wanted = tuple(wanted_const_grads) if wanted_const_grads is not None else tuple(
        bool(jnp.issubdtype(jnp.result_type(c), jnp.floating)) for c in consts)
    return _backward_impl(q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                          config, wanted)


_fused_attention.defvjp(_fused_attention_forward, _fused_attention_backward,
                        symbolic_zeros=True)


@functools.partial(jax.jit, static_argnames=("config", "with_max"))
def _attention(q, k, v, block_mask, score_program, sinks=None, gate=None, *, config,
               with_max=False):
    """(out, lse), and with_max the row max of the logits (sinks not included); the
    sinks take part in the softmax, and the lse includes them; out is multiplied by
    sigmoid(gate) where a gate is given."""
    backend, scale, _ = config
    if backend == "reference":  # dense, differentiated by plain autodiff: the oracle
        out, lse, *row_max = reference_attention(
            q, k, v, mask_mod=block_mask.mask_mod, score_mod=score_program, scale=scale,
            return_max=with_max, sinks=sinks)
        out = gated(out, gate).astype(q.dtype)
        row_max = [jax.lax.stop_gradient(x) for x in row_max]
    else:
        out, lse, *row_max = _fused_attention(q, k, v, block_mask, score_program, sinks,
                                              gate, config, with_max)
    return (out, lse, *row_max)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs `return_aux=` asks for (as PyTorch FlexAttention's):
    lse, and max_scores, the row max of the logits after score_mod and mask (for QK-clip
    or logit-growth monitoring; -inf for a fully masked row, attention sinks not
    included; no gradient)."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary outputs asked for (None for the others): lse [B, Hq, Sq] and
    max_scores [B, Hq, Sq], float32."""

    lse: object = None
    max_scores: object = None


def check_aux(return_aux, return_lse) -> bool:
    """Whether `return_aux` asks for the row max (a ValueError for a bad request)."""
    if return_aux is None:
        return False
    if not isinstance(return_aux, AuxRequest):
        raise ValueError(f"return_aux must be a pf.AuxRequest, got "
                         f"{type(return_aux).__name__}")
    if return_lse:
        raise ValueError("pass return_lse=True or return_aux=pf.AuxRequest(lse=True), "
                         "not both")
    return bool(return_aux.max_scores)


def call_results(out, lse, row_max, return_lse, return_aux):
    """What an attention entry point returns: out, (out, lse) with return_lse, or (out,
    AuxOutput) with return_aux. row_max: [] or [the row max] (`check_aux` said which)."""
    if return_aux is not None:
        return out, AuxOutput(lse if return_aux.lse else None,
                              row_max[0] if row_max else None)
    return (out, lse) if return_lse else out


def flex_attention(q, k, v, score_mod=None, block_mask=None, *, scale=None,
                   return_lse=False, backend=None, kernel_options=None, sinks=None,
                   return_aux=None, k_scales=None, v_scales=None, value_dim=None,
                   output_gate=None):
    """FlexAttention, PyTorch-shaped: `softmax(mask(score_mod(q k^T * scale))) v`.

    Args:
      q: [B, Sq, Hq, D]; k: [B, Skv, Hkv, D]; v: [B, Skv, Hkv, Dv]; Hq a multiple of
        Hkv (GQA/MQA); float32, bfloat16 or float16, all the same.
      score_mod: `score_mod(score, b, h, q_idx, kv_idx) -> score`, scalar semantics.
      block_mask: a `BlockMask` from `create_block_mask` (None: no mask).
      scale: Python float; defaults to 1/sqrt(D).
      return_lse: also return lse [B, Hq, Sq] (float32, natural log; -inf for fully
        masked rows, whose output is zero).
      backend: "pallas" (GPU), "interpret" (Pallas interpret mode), "xla" (blockwise,
        any device), "reference" (dense); None picks "pallas" on GPU, else "xla".
      kernel_options: dict overriding `KernelOptions` fields (forward_kernel: "auto",
        "mosaic" or "triton", the Hopper Mosaic GPU forward or the Triton one; block_q,
        block_kv, num_warps, num_stages: the Triton kernels' tiles; see
        `pallas_flex/kernels/config.py`).
      sinks: None, or float [Hq]: a logit per query head taking part in every row's
        softmax with no value (attention sinks, as gpt-oss): weights become
        exp(s) / (sum exp(s) + exp(sink)); differentiable (learnable); lse includes it.
      return_aux: a `pf.AuxRequest(lse=, max_scores=)`: also return a `pf.AuxOutput`
        with those (max_scores: the row max of the logits, from the kernel's running
        max, in the forward kernels and the decode kernel alike).
      k_scales, v_scales: for int8 / float8_e4m3fn k and v (a quantized KV cache), their
        float32 per-token scales [B, Skv, Hkv] (`pallas_flex.paged.quantize.quantize`);
        q stays float. Decode runs the split-KV kernel on the 8-bit values, other calls
        a dequantized copy; inference only (`pallas_flex/quantized_kv.py`).
      value_dim: with v=None, the values are k's first value_dim columns: a latent
        cache (DeepSeek's MLA: one [B, S, 1, 576] array, values its first 512 columns).
        The latent decode reads them from k in place; passing v=k[..., :512] instead
        makes XLA copy that slice of the cache at every call. Differentiable (the
        values' gradient joins k's).
      output_gate: None, or float [B, Sq, Hq, Dv]: the output is multiplied by
        sigmoid(output_gate) (gated attention: AlphaFold's, Qwen3-Next's), fused into
        the Triton or Mosaic GPU forward's epilogue where no one differentiates the call;
        differentiable. lse is the softmax's, ungated.
    Returns:
      out [B, Sq, Hq, Dv] in q's dtype, or (out, lse) with return_lse=True, or
      (out, AuxOutput) with return_aux.

    Example:
      >>> bm = pf.create_block_mask(pf.masks.causal_mask, None, None, 1024, 1024)
      >>> out = pf.flex_attention(q, k, v, block_mask=bm)
      >>> out = pf.flex_attention(q_latent, latent, None, value_dim=512)  # MLA decode
    """
    from pallas_flex import quantized_kv  # it builds on this module

    v, in_keys = values_in_keys(k, v, value_dim)
    if in_keys and (k_scales is not None or v_scales is not None):
        raise ValueError("value_dim (values in the keys) does not take a quantized cache "
                         "(k_scales, v_scales)")
    if quantized_kv.is_quantized_call(k, v, k_scales, v_scales):
        return gated_result(quantized_kv.flex_attention(
            q, k, v, k_scales, v_scales, score_mod, block_mask, scale=scale,
            return_lse=return_lse, backend=backend, kernel_options=kernel_options,
            sinks=sinks, return_aux=return_aux), check_output_gate(output_gate, q, v))
    with_max = check_aux(return_aux, return_lse)
    block_mask, score_program, config = _prepare(q, k, v, score_mod, block_mask, scale,
                                                 backend, kernel_options)
    if in_keys:
        backend, scale, options = config
        config = (backend, scale, options.replace(values_in_keys=True))
    out, lse, *row_max = _attention(q, k, v, block_mask, score_program,
                                    check_sinks(sinks, q.shape[2]),
                                    check_output_gate(output_gate, q, v), config=config,
                                    with_max=with_max)
    return call_results(out, lse, row_max, return_lse, return_aux)


def _prepare(q, k, v, score_mod, block_mask, scale, backend, kernel_options):
    """Validated (block_mask, score_program, config = (backend, scale, options))."""
    _validate_inputs(q, k, v)
    batch, q_len, q_heads, head_dim = q.shape
    if block_mask is None:  # no mask: nothing to build (constant, cached tables)
        block_mask = noop_block_mask(q_len, k.shape[1], _DEFAULT_MASK_BLOCK,
                                     device=_single_device(q))
    validate_block_mask(block_mask, q, k)
    score_program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
    backend = resolve_backend(backend)
    if backend == "pallas" and q.dtype == jnp.bfloat16 and not device.supports_bfloat16():
        raise ValueError(f"q, k, v are bfloat16, which this GPU (compute capability "
                         f"{device.compute_capability()}) has no tensor-core support for: "
                         "pass float16 or float32")
    options = resolve_options(kernel_options, max(head_dim, v.shape[3]), q.dtype,
                              key_length=k.shape[1])
    if backend in ("pallas", "interpret"):
        dispatch.check_mods_run_on_tiles(block_mask, score_program)
    if backend == "interpret":
        sharding.refuse_varying_on_the_interpreter(
            "the BlockMask tables or the mods' captured arrays", block_mask, score_program)
    return block_mask, score_program, (backend, resolve_scale(scale, head_dim), options)


def _single_device(x):
    """The device a concrete array lives on alone, else None (traced, sharded, NumPy)."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return None
    devices = x.devices()
    return next(iter(devices)) if len(devices) == 1 else None


def explain(q, k, v, *, mask_mod=None, score_mod=None, block_mask=None, scale=None,
            backend=None, kernel_options=None) -> str:
    """Which kernels `attention(q, k, v, ...)` with these arguments runs, and why (the
    rules: `pallas_flex.dispatch`). q, k, v may be arrays or `jax.ShapeDtypeStruct`s.

    Example:
      >>> print(pf.explain(q, k, v, mask_mod=pf.masks.causal_mask))
      forward: mosaic_forward (the Mosaic GPU forward takes it (Hopper, ...))
      backward: mosaic_backward (the Mosaic GPU backward takes it (Hopper, ...))
    """
    block_mask = _attention_block_mask(q, k, v, mask_mod, block_mask, kernel_options)
    block_mask, score_program, (backend, _, options) = _prepare(
        q, k, v, score_mod, block_mask, scale, backend, kernel_options)
    return dispatch.explain_choice(q, k, v, block_mask, score_program, backend=backend,
                                   options=options)


def _attention_block_mask(q, k, v, mask_mod, block_mask, kernel_options):
    """`attention`'s BlockMask: built from mask_mod, or the one given (or None)."""
    _validate_inputs(q, k, v)
    if mask_mod is not None and block_mask is not None:
        raise ValueError("pass either mask_mod or block_mask, not both (a BlockMask "
                         "already carries its mask_mod)")
    if mask_mod is None:
        return block_mask
    # Validate kernel_options before their block sizes become the BlockMask's, so a bad
    # block size is reported against kernel_options rather than block_size.
    resolve_options(kernel_options, max(q.shape[3], v.shape[3]))
    return build_block_mask(mask_mod, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                            kernel_options)


def attention(q, k, v, *, mask_mod=None, score_mod=None, block_mask=None, scale=None,
              return_lse=False, backend=None, kernel_options=None, context_parallel=None,
              sinks=None, return_aux=None, k_scales=None, v_scales=None, value_dim=None,
              output_gate=None):
    """FlexAttention in one line: builds the BlockMask of `mask_mod` inside the trace.

    Same arguments and results as `flex_attention`, plus `mask_mod(b, h, q_idx, kv_idx)
    -> bool` (True = the score takes part). Pass either `mask_mod` or a prebuilt
    `block_mask` (to reuse one across layers), not both.

    sinks, return_aux, k_scales, v_scales, value_dim, output_gate: as in `flex_attention`
    (value_dim with v=None: the values are k's first value_dim columns, a latent cache).

    context_parallel: a `pf.ContextParallel(axis_name, ...)` inside `jax.shard_map`, with
    q, k, v the shards of a sequence split over that mesh axis: runs
    `pf.context_parallel_attention` (mods at global positions; no prebuilt block_mask).

    Example:
      >>> out = pf.attention(q, k, v, mask_mod=pf.masks.causal_mask,
      ...                    score_mod=pf.masks.alibi(num_heads))
    """
    if value_dim is not None or v is None:
        if context_parallel is not None:
            raise ValueError("value_dim (values in the keys) does not take "
                             "context_parallel: pass v")
        values, _ = values_in_keys(k, v, value_dim)
        block_mask = _attention_block_mask(q, k, values, mask_mod, block_mask,
                                           kernel_options)
        return flex_attention(q, k, None, score_mod, block_mask, scale=scale,
                              return_lse=return_lse, backend=backend,
                              kernel_options=kernel_options, sinks=sinks,
                              return_aux=return_aux, k_scales=k_scales, v_scales=v_scales,
                              value_dim=value_dim, output_gate=output_gate)
    if context_parallel is not None:
        from pallas_flex import context_parallel as parallel  # it builds on this module

        if not isinstance(context_parallel, parallel.ContextParallel):
            raise ValueError("context_parallel must be a pf.ContextParallel, got "
                             f"{type(context_parallel).__name__}")
        if block_mask is not None:
            raise ValueError("context_parallel builds each shard pair's BlockMask from "
                             "mask_mod: pass mask_mod, not block_mask")
        _validate_inputs(q, k, v)
        gate = check_output_gate(output_gate, q, v)
        return gated_result(parallel.context_parallel_attention(
            q, k, v, mask_mod=mask_mod, score_mod=score_mod, scale=scale,
            return_lse=return_lse, backend=backend, kernel_options=kernel_options,
            sinks=sinks, return_aux=return_aux, **dataclasses.asdict(context_parallel)),
            gate)
    if k_scales is None and v_scales is None:
        block_mask = _attention_block_mask(q, k, v, mask_mod, block_mask, kernel_options)
    elif mask_mod is not None:  # 8-bit k, v: flex_attention's quantized path checks them
        if block_mask is not None:
            raise ValueError("pass either mask_mod or block_mask, not both")
        block_mask = build_block_mask(mask_mod, q.shape[0], q.shape[2], q.shape[1],
                                      k.shape[1], kernel_options)
    return flex_attention(q, k, v, score_mod, block_mask, scale=scale, return_lse=return_lse,
                          backend=backend, kernel_options=kernel_options, sinks=sinks,
                          return_aux=return_aux, k_scales=k_scales, v_scales=v_scales,
                          output_gate=output_gate)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Exactly merges two attention results over disjoint key sets.

    Args:
      out_a, out_b: [B, S, H, Dv] attention outputs over key sets A and B.
      lse_a, lse_b: [B, H, S] their log-sum-exps (natural log; -inf = no keys).
    Returns:
      (out [B, S, H, Dv] in out_a's dtype, lse [B, H, S] float32) of attention over A ∪ B.

    All four must be arrays (JAX or NumPy: anything with `.shape` and `.dtype`); Python
    lists and other values raise a ValueError naming the argument (they are not
    converted, as a nested list is almost always a mistake in the caller).
    """
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array (jax.Array or numpy.ndarray), got "
                             f"{type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got dtype {x.dtype}")
    for name, out in (("out_a", out_a), ("out_b", out_b)):
        if len(out.shape) != 4:
            raise ValueError(f"{name} must be a 4-D array [B, S, H, Dv], got shape {out.shape}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have the same shape, got {out_a.shape} "
                         f"and {out_b.shape}")
    expected = (out_a.shape[0], out_a.shape[2], out_a.shape[1])
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != expected:
            raise ValueError(f"{name} must have shape [B, H, S] = {expected}, got {lse.shape}")
    # Two parts, elementwise (`online_softmax.merge_partials` merges along an axis the
    # parts already share; stacking two outputs for it would copy both on this, the
    # cascade's, path).
    lse_a, lse_b = lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)
    # log(exp(a) + exp(b)) and the parts' weights from one shift, so that rows with no
    # keys in either part (-inf, -inf) give -inf with zero gradients: jnp.logaddexp's
    # derivative there is NaN, which a zero cotangent does not cancel (context
    # parallelism merges such rows every step).
    largest = jnp.maximum(lse_a, lse_b)
    shift = jnp.where(jnp.isfinite(largest), largest, 0.0)
    exp_a, exp_b = jnp.exp(lse_a - shift), jnp.exp(lse_b - shift)
    total = exp_a + exp_b
    some = total > 0
    total = jnp.where(some, total, 1.0)
    lse = jnp.where(some, shift + jnp.log(total), -jnp.inf)
    weight_a = jnp.swapaxes(exp_a / total, 1, 2)[..., None]
    weight_b = jnp.swapaxes(exp_b / total, 1, 2)[..., None]
    out = out_a.astype(jnp.float32) * weight_a + out_b.astype(jnp.float32) * weight_b
    return out.astype(out_a.dtype), lse
