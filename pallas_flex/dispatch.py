"""Which kernel runs a call: the one place that decides.

Every entry point (`pallas_flex.attention` / `flex_attention`, `cascade_attention`
through them, `paged.paged_flex_attention`) asks `choose_forward` for the forward kernel
and runs it with `run_forward`; the kernels never choose each other. The table, in the
order the rules are tried:

| rule                                                           | kernel          |
|----------------------------------------------------------------|-----------------|
| backend "xla"                                                  | xla_blockwise   |
| Sq <= decode_max_q_len and one BlockMask query block: latent attention (one query, one KV head, D 128-640, Dv 128-512, contiguous or paged) that the Mosaic GPU latent decode takes (`decode_latent_mosaic.unsupported_reason`), decode_kernel "auto" (not under backend "interpret") or "mosaic" | mosaic_latent_decode |
| Sq <= decode_max_q_len and one BlockMask query block            | decode          |
| a quantized (int8 / float8) paged cache, quantized_prefill "dequantize", or "auto" (the default) where the rows' pages take at most QUANTIZED_PREFILL_MAX_BYTES dequantized: those pages dequantized to the queries' dtype, then these rules again for the 16-bit pages | dequantized_pages |
| forward_kernel "triton", or a quantized cache read in place (quantized_prefill "in_kernel", or "auto" past that size) | triton_forward  |
| backend "interpret", forward_kernel "auto"                      | triton_forward  |
| the Mosaic GPU forward takes the call (`mosaic_unsupported_reason`) | mosaic_forward |
| otherwise (forward_kernel "mosaic" then raises a ValueError)    | triton_forward  |

("reference" never reaches a kernel: the dense oracle in `pallas_flex.api`.) The
backward of `pallas_flex.attention` (`choose_backward`), in the same way:

| rule                                                           | kernel           |
|----------------------------------------------------------------|------------------|
| backward_kernel "triton"                                       | triton_backward  |
| backend "xla", or "interpret" with backward_kernel "auto"      | triton_backward (interpreted) |
| backward_kernel "auto", and head dim 32 or a score_mod reading a bias tensor at (q_idx, kv_idx) (`mosaic_eligibility.awaiting_measurement`) | triton_backward |
| the Mosaic GPU forward would take the call, and the captured arrays whose gradients are wanted are read once at indices of b and h only, of kv_idx - q_idx or as [q, kv] blocks of a bias tensor (`captured_gradient_unsupported_reason`), or summed by the batch loop (backward_batch_sum "loop": `backward.batch_loop_positions`) | mosaic_backward  |
| otherwise (backward_kernel "mosaic" then raises a ValueError)  | triton_backward  |

The ragged op (`paged.paged_attention`) has one kernel of its own.

Before any of this, the BlockMask the entry points build from a mask_mod gets the mask
the kernels run (`mask_for_kernels`): a mask reading a captured array at an index
computed from one position (`ids[q_idx // 2]`, or context parallelism's shard
positions) reads vectors precomputed over the rows and columns instead, where that lets
the Mosaic GPU kernels take it.

The Mosaic GPU forward (`kernels/forward_mosaic.py`) is written for Hopper: compute
capability 9.0 with its full shared memory, bfloat16/float16, D = Dv in {32, 64, 80,
96, 128, 192, 256} (the backward: 32 to 128; pages: 64 and 128), 128x128 BlockMask blocks, mods its tile interpreter lowers, and for paged K/V pages of a
multiple of 8 rows dividing 128 or a multiple of 128. `explain` says which kernel a call
gets and why.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_flex import sharding
from pallas_flex.kernels import (
    backward_mosaic, decode_latent_mosaic, device, forward_mosaic, mosaic_eligibility)
from pallas_flex.kernels.backward import batch_loop_positions, flex_attention_backward
from pallas_flex.kernels.config import (
    QUANTIZED_PREFILL_MAX_BYTES, KernelOptions, planned_shared_memory)
from pallas_flex.kernels.decode import flex_decode
from pallas_flex.kernels.forward import flex_attention_forward
from pallas_flex.kernels.tile_mods import captured_read_positions
from pallas_flex.kernels.xla_blockwise import blockwise_attention
from pallas_flex.masks.row_reads import precompute_row_reads
from pallas_flex.output_gate import gated
from pallas_flex.sinks import merge_sinks

FORWARD_KERNELS = ("xla_blockwise", "decode", "mosaic_latent_decode", "triton_forward",
                   "mosaic_forward", "dequantized_pages")
BACKWARD_KERNELS = ("triton_backward", "mosaic_backward")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel a call runs (one of `FORWARD_KERNELS`) and why, in a sentence; for
    "dequantized_pages", `then` is the choice for the 16-bit pages it makes."""
    kernel: str
    reason: str
    then: "Choice | None" = None


def mask_for_kernels(program, batch: int, heads: int, q_len: int, kv_len: int):
    """The mask program a BlockMask is built from, for kernels to run: `program`, or,
    where it reads a captured array at an index computed from one position
    (`ids[q_idx // 2]`, context parallelism's `ids[q_position(q_idx)]`: a per-element
    gather, which sends the call to the Triton kernels), the same mask reading vectors
    precomputed over the call's rows and columns (`masks.row_reads`), if the Mosaic GPU
    kernels take that."""
    if (program is None or not program.consts  # no captured array: nothing to read
            or mosaic_eligibility.mod_unsupported_reason(program) is None):
        return program
    rewritten = precompute_row_reads(program, batch, heads, q_len, kv_len)
    if rewritten is program or mosaic_eligibility.mod_unsupported_reason(rewritten):
        return program
    return rewritten


def uses_decode_kernel(q_len, block_mask, options: KernelOptions) -> bool:
    """Short queries within one BlockMask query block run the split-KV decode kernel."""
    return q_len <= options.decode_max_q_len and block_mask.num_blocks[0] == 1


def check_mods_run_on_tiles(block_mask, score_program) -> None:
    """Mods the kernels' tile interpreter cannot run fail here, with a ValueError that
    says why, not inside a kernel (every Pallas backend, before tracing one)."""
    captured_read_positions(block_mask.mask_mod)
    captured_read_positions(score_program)


def mosaic_unsupported_reason(q, k, v, block_mask, score_program, *, options, interpret,
                              paged=False, out_dtype=None):
    """None if the Mosaic GPU forward takes the call, else why not (a short phrase)."""
    reason = mosaic_eligibility.unsupported_reason(q, k, v, block_mask, score_program,
                                                   interpret=interpret, paged=paged)
    if reason is None and jnp.dtype(out_dtype or q.dtype) != q.dtype:
        reason = f"a {jnp.dtype(out_dtype)} output (it writes the inputs' dtype)"
    return reason or _mosaic_setting_reason(q, k, v, options=options, interpret=interpret)


def _mosaic_setting_reason(q, k, v, *, options, interpret):
    """Why no Mosaic GPU kernel runs a call they could take, where the call's setting
    says so (a checked shard_map, a smaller shared-memory budget), else None."""
    axes = sharding.varying_axes(q, k, v)
    if axes:
        return (f"inputs varying over the manual mesh axes {list(axes)} of a jax.shard_map "
                "that checks them (check_vma=True): the Triton kernels run there")
    budget = planned_shared_memory(options)
    if not interpret and not device.mosaic_allowed(budget):
        return (f"a shared-memory budget of {budget // 1024} KiB "
                f"({device.SHARED_MEMORY_ENVIRONMENT_VARIABLE}), below the device's own")
    return None


def choose_forward(q, k, v, block_mask, score_program, *, backend: str,
                   options: KernelOptions, paged: bool = False, out_dtype=None,
                   quantized: bool = False, with_max: bool = False) -> Choice:
    """The forward kernel of a call (see the module docstring's table). k / v are pages
    [num_pages, Hkv, page_size, D] when `paged`. A ValueError when kernel_options name
    a Mosaic kernel and it does not take the call."""
    if backend not in ("pallas", "interpret"):
        return Choice("xla_blockwise", f'backend "{backend}": the blockwise XLA loop')
    interpret = backend == "interpret"
    q_len = q.shape[1]
    if uses_decode_kernel(q_len, block_mask, options):
        return _choose_decode(q, k, v, block_mask, score_program, options=options,
                              interpret=interpret, paged=paged, with_max=with_max)
    way = quantized and _quantized_prefill(q, k, v, block_mask, options)
    if way == "dequantize":
        pages = jax.ShapeDtypeStruct(k.shape, q.dtype)
        then = choose_forward(q, pages, jax.ShapeDtypeStruct(v.shape, q.dtype), block_mask,
                              score_program, backend=backend, options=options, paged=True,
                              out_dtype=out_dtype, with_max=with_max)
        return Choice("dequantized_pages", f"a quantized cache, quantized_prefill "
                                           f"'{options.quantized_prefill}': the rows' pages "
                                           f"dequantized to {q.dtype} first, then "
                                           f"{then.kernel} ({then.reason})", then)
    if options.forward_kernel == "triton":
        return Choice("triton_forward", "kernel_options['forward_kernel'] is 'triton'")
    named = options.forward_kernel == "mosaic"
    if quantized:
        if named:
            raise ValueError("kernel_options['forward_kernel'] is 'mosaic', but the Mosaic "
                             "GPU forward does not read quantized (int8 / float8) caches in "
                             "place (quantized_prefill 'in_kernel')")
        return Choice("triton_forward", f"a quantized cache, quantized_prefill "
                                        f"'{options.quantized_prefill}' (in_kernel): the "
                                        "Triton forward applies its scales")
    if interpret and not named:
        # What the CPU suite tests; the Mosaic kernel's interpret mode is asked by name.
        return Choice("triton_forward", 'backend "interpret" runs the Triton kernel unless '
                                        "kernel_options['forward_kernel'] is 'mosaic'")
    reason = mosaic_unsupported_reason(q, k, v, block_mask, score_program, options=options,
                                       interpret=interpret, paged=paged, out_dtype=out_dtype)
    if reason is None:
        items = _mosaic_items_per_program(q, block_mask, options, paged)
        return Choice("mosaic_forward", "the Mosaic GPU forward takes it (Hopper, "
                                        f"warp-specialized, wgmma; {items} query blocks per "
                                        "program)")
    if named:
        raise ValueError(f"kernel_options['forward_kernel'] is 'mosaic', but the Mosaic GPU "
                         f"forward kernel does not take this call: {reason}")
    return Choice("triton_forward", f"the Mosaic GPU forward does not take {reason}")


def _quantized_prefill(q, k, v, block_mask, options: KernelOptions) -> str:
    """How a prefill reads a quantized paged cache (`KernelOptions.quantized_prefill`):
    "dequantize" or "in_kernel"; "auto" dequantizes where the rows' reserved pages take
    at most QUANTIZED_PREFILL_MAX_BYTES in the queries' dtype (pages k, v [num_pages,
    Hkv, page_size, D / Dv]; the BlockMask's key length is the rows' max_seq_len)."""
    if options.quantized_prefill != "auto":
        return options.quantized_prefill
    dequantized = (q.shape[0] * block_mask.shape[3] * k.shape[1] * (k.shape[3] + v.shape[3])
                   * jnp.dtype(q.dtype).itemsize)
    return "dequantize" if dequantized <= QUANTIZED_PREFILL_MAX_BYTES else "in_kernel"


def _choose_decode(q, k, v, block_mask, score_program, *, options: KernelOptions,
                   interpret: bool, paged: bool, with_max: bool) -> Choice:
    """Latent-attention decode on the Mosaic GPU kernel where it takes the call (see
    KernelOptions.decode_kernel), else the Triton split-KV decode."""
    split_kv = Choice("decode", f"Sq = {q.shape[1]} <= decode_max_q_len = "
                                f"{options.decode_max_q_len} in one BlockMask query block: "
                                "the split-KV decode kernel")
    named = options.decode_kernel == "mosaic"
    if options.decode_kernel == "triton" or (interpret and not named):
        return split_kv
    reason = decode_latent_mosaic.unsupported_reason(
        q, k, v, block_mask, score_program, paged=paged, with_max=with_max,
        interpret=interpret) or _mosaic_setting_reason(q, k, v, options=options,
                                                        interpret=interpret)
    if reason is None:
        return Choice("mosaic_latent_decode", "latent-attention decode: the Mosaic GPU "
                                              "kernel (Hopper, wgmma, 64 heads a program)")
    if named:
        raise ValueError(f"kernel_options['decode_kernel'] is 'mosaic', but the Mosaic GPU "
                         f"latent decode does not take this call: {reason}")
    return split_kv


def _mosaic_items_per_program(q, block_mask, options: KernelOptions, paged: bool) -> int:
    """The (head, query block, batch) items a Mosaic GPU forward program walks."""
    batch, _, q_heads, head_dim = q.shape
    num_items = batch * q_heads * block_mask.num_blocks[0]
    return forward_mosaic.choose_items_per_program(
        options.forward_items_per_program, head_dim, block_mask.mask_mod, num_items,
        q_heads, paged=paged, kv_len=block_mask.seq_lengths[1])


def run_forward(choice: Choice, q, k, v, block_mask, score_program, *, scale: float,
                options: KernelOptions, interpret: bool, page_table=None, lengths=None,
                out_dtype=None, with_max=False, k_scales=None, v_scales=None, sinks=None,
                row_sums_of=(), output_gate=None):
    """(out, lse), and with_max the row max, of the kernel `choice` names (arguments as
    `choose_forward`'s, plus the paged ones: page_table, lengths, and a quantized
    cache's k_scales, v_scales; sinks [Hq] or None, which the forward kernels fold into
    their normalization and the decode kernel's output takes in a pass of its own).
    row_sums_of (the Mosaic forward only): then per position one row sum more
    (`forward_mosaic.flex_attention_forward_mosaic`). output_gate (None or [B, Sq, Hq,
    Dv]): the output times its sigmoid, in the Triton and Mosaic forwards' epilogues on
    contiguous K/V, after the kernel elsewhere (`pallas_flex/output_gate.py`)."""
    if output_gate is not None and (choice.kernel not in ("triton_forward", "mosaic_forward")
                                    or page_table is not None):
        out, *rest = run_forward(
            choice, q, k, v, block_mask, score_program, scale=scale, options=options,
            interpret=interpret, page_table=page_table, lengths=lengths,
            out_dtype=out_dtype, with_max=with_max, k_scales=k_scales, v_scales=v_scales,
            sinks=sinks, row_sums_of=row_sums_of)
        return (gated(out, output_gate), *rest)
    if row_sums_of and choice.kernel != "mosaic_forward":
        raise ValueError(f"row sums of captured reads come from the Mosaic GPU forward, not "
                         f"{choice.kernel}")
    paging = dict(page_table=page_table, lengths=lengths)
    if k_scales is not None:
        paging.update(k_scales=k_scales, v_scales=v_scales)
    if choice.kernel == "dequantized_pages":
        # (imported here: the paged package's entry points import this module)
        from pallas_flex.paged.quantize import dequantized_pages
        k, table = dequantized_pages(k, k_scales, page_table, q.dtype)
        v, _ = dequantized_pages(v, v_scales, page_table, q.dtype)
        return run_forward(choice.then, q, k, v, block_mask, score_program, scale=scale,
                           options=options, interpret=interpret, page_table=table,
                           lengths=lengths, out_dtype=out_dtype, with_max=with_max,
                           sinks=sinks)
    if choice.kernel == "xla_blockwise":
        return blockwise_attention(q, k, v, block_mask, score_program, scale=scale,
                                   out_dtype=out_dtype, with_max=with_max, sinks=sinks)
    if choice.kernel in ("decode", "mosaic_latent_decode"):
        if choice.kernel == "decode":
            out, lse, *row_max = flex_decode(
                q, k, v, block_mask, score_program, scale=scale, options=options,
                interpret=interpret, out_dtype=out_dtype, with_max=with_max, **paging)
        else:  # (never with_max: `_choose_decode`)
            # Values that are k's first Dv columns are read from k in place: v, their
            # slice, is then left unused (and XLA drops it).
            (out, lse), row_max = decode_latent_mosaic.latent_decode(
                q, k, k if options.values_in_keys else v, block_mask, scale=scale,
                interpret=interpret, num_splits=options.decode_num_splits,
                out_dtype=out_dtype, page_table=page_table, lengths=lengths,
                value_dim=v.shape[3]), []
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        return (out, lse, *row_max)
    if choice.kernel == "mosaic_forward":
        return forward_mosaic.flex_attention_forward_mosaic(
            q, k, v, block_mask, score_program, scale=scale, interpret=interpret,
            with_max=with_max, sinks=sinks, row_sums_of=row_sums_of, output_gate=output_gate,
            items_per_program=_mosaic_items_per_program(q, block_mask, options,
                                                        page_table is not None), **paging)
    return flex_attention_forward(q, k, v, block_mask, score_program, scale=scale,
                                  options=options, interpret=interpret, out_dtype=out_dtype,
                                  with_max=with_max, sinks=sinks, output_gate=output_gate,
                                  **paging)


def choose_backward(q, k, v, block_mask, score_program, *, backend: str,
                    options: KernelOptions, wanted_const_grads=None) -> Choice:
    """The backward kernel of a call (see the module docstring's second table).
    wanted_const_grads: per captured array of the score_mod, whether its gradient is
    wanted (None: none are). A ValueError when kernel_options name the Mosaic backward
    and it does not take the call."""
    named = options.backward_kernel == "mosaic"
    if options.backward_kernel == "triton":
        return Choice("triton_backward", "kernel_options['backward_kernel'] is 'triton'")
    interpret = backend != "pallas"
    if backend == "xla" or (interpret and not named):
        return Choice("triton_backward", f'backend "{backend}" runs the Triton backward in '
                                         "Pallas's interpreter")
    reason = mosaic_unsupported_reason(q, k, v, block_mask, score_program, options=options,
                                       interpret=interpret)
    _, kernel_positions = split_gradient_positions(q, score_program, options,
                                                    wanted_const_grads)
    trained_blocks = ()
    if reason is None:
        trained_blocks = mosaic_eligibility.block_positions(score_program, kernel_positions)
        reason = mosaic_eligibility.backward_unsupported_reason(
            score_program, q.shape[3], q.dtype, gradient_tiles=len(trained_blocks))
    if reason is None:
        reason = mosaic_eligibility.captured_gradient_unsupported_reason(
            score_program, kernel_positions)
        if reason is None and options.backward_deterministic and trained_blocks:
            reason = ("backward_deterministic with the gradient of a bias tensor read at "
                      "(q_idx, kv_idx) (summed by reduce-adds in varying order)")
    if reason is None and not named:
        waiting = mosaic_eligibility.awaiting_measurement(score_program, q.shape[3])
        if waiting is not None:
            return Choice("triton_backward", f"{waiting}: the Mosaic GPU backward takes it "
                                             "when kernel_options name it (not yet timed on "
                                             "the GPU)")
    if reason is None:
        return Choice("mosaic_backward", "the Mosaic GPU backward takes it (Hopper, "
                                         "warp-specialized, wgmma)")
    if named:
        raise ValueError(f"kernel_options['backward_kernel'] is 'mosaic', but the Mosaic GPU "
                         f"backward kernel does not take this call: {reason}")
    return Choice("triton_backward", f"the Mosaic GPU backward does not take {reason}")


def split_gradient_positions(q, score_program, options: KernelOptions, wanted_const_grads):
    """(the positions of the captured arrays whose gradients the batch loop sums, those
    the Mosaic backward's kernels sum) among the differentiated ones. The kernels take a
    bias tensor read as blocks (`mosaic_eligibility.block_positions`: TMA reduce-adds of
    each tile's dS' g, in an order that varies run to run); with backward_batch_sum
    "loop" the batch loop sums one shared by many batch rows instead
    (`backward.batch_loop_positions`), and with backward_deterministic it says whether
    it can (a ValueError for a large table)."""
    positions = mosaic_eligibility.differentiated_positions(score_program, wanted_const_grads)
    looped = ()
    if positions and (options.backward_batch_sum == "loop" or options.backward_deterministic):
        looped = batch_loop_positions(score_program, wanted_const_grads, q.shape[0],
                                      options.backward_deterministic)
    return looped, tuple(p for p in positions if p not in looped)


def run_backward(choice: Choice, q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                 *, scale: float, options: KernelOptions, interpret: bool,
                 wanted_const_grads=None, row_sums=()):
    """(dq, dk, dv, d_score_consts) of the kernel `choice` names (d_score_consts as
    `backward.flex_attention_backward` returns them). row_sums: the Mosaic forward's
    (`api._forward_row_sums`), or () where it gave none."""
    if choice.kernel == "mosaic_backward":
        looped, positions = split_gradient_positions(q, score_program, options,
                                                      wanted_const_grads)
        return backward_mosaic.flex_attention_backward_mosaic(
            q, k, v, out, lse, d_out, d_lse, block_mask, score_program, scale=scale,
            interpret=interpret, masked_first=options.backward_masked_first,
            gradient_positions=positions, deterministic=options.backward_deterministic,
            row_sums=row_sums, batch_loop_positions=looped, options=options)
    return flex_attention_backward(q, k, v, out, lse, d_out, d_lse, block_mask, score_program,
                                   scale=scale, options=options, interpret=interpret,
                                   wanted_const_grads=wanted_const_grads)


def explain_choice(q, k, v, block_mask, score_program, *, backend: str,
                   options: KernelOptions, paged: bool = False) -> str:
    """A short report: the forward kernel and why, and the backward kernel."""
    if backend == "reference":
        return "forward: reference (dense oracle)\nbackward: jax autodiff of the oracle"
    choice = choose_forward(q, k, v, block_mask, score_program, backend=backend,
                            options=options, paged=paged)
    if paged:
        backward = "none (paged attention is inference only)"
    else:
        backward_choice = choose_backward(q, k, v, block_mask, score_program,
                                          backend=backend, options=options)
        backward = f"{backward_choice.kernel} ({backward_choice.reason})"
    return f"forward: {choice.kernel} ({choice.reason})\nbackward: {backward}"
