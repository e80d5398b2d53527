"""Read what Triton makes of our kernels without a GPU: registers, spills, shared memory,
pipelining. Two steps, in two environments:

1. In the project's environment (any machine, no GPU needed), lower the forward and
   backward kernels for an H100 and write their Triton IR (TTIR):

       python -m benchmarks.inspect_kernels lower --variant causal --out-dir /tmp/ttir \
           [--options '{"backward_num_stages": 2}'] [--q-heads 32 --kv-heads 8]

2. With pip `triton` (3.6.0 matches jaxlib 0.11.2's build closely: the same shared memory
   and registers as Nsight Compute reported on the device), run Triton's CUDA pipeline on
   each file, as XLA does, and print what it made:

       python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.6.0
       /tmp/tvenv/bin/python benchmarks/inspect_kernels.py compile /tmp/ttir/*.ttir

   It writes <name>.ttgir and <name>.ptx next to each input and prints shared memory,
   async copies (pipelined loads), wgmma count and `ptxas -v`'s registers and spills,
   then, per loop of the PTX (a block that branches back to itself), its global loads,
   async copies and wgmma instructions: per-tile work the pipeliner did not turn into
   async copies shows up there (a paged kernel's page-table reads did, 64 per tile).
   Warps and stages come from the file name (`..._w8s3.ttir`, as `lower` writes it).

`lower --page-size N` lowers `paged_flex_attention` on a cache of N-row pages instead (no
backward): the forward kernel for a prefill (`--q-len`, default 2048 new tokens on the
sequence), the decode kernel with `--q-len 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys


def lower(args) -> None:
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf
    from pallas_flex import masks
    from pallas_flex.kernels import backward, forward
    from pallas_flex.kernels.config import resolve_options
    from pallas_flex.masks.mod_program import SCORE, make_mod_program

    options = resolve_options(json.loads(args.options), args.head_dim)
    if args.page_size:
        lower_paged(args, options)
        return
    batch, length, dim = 4, args.seq_len, args.head_dim
    kv_heads = args.kv_heads or args.q_heads
    q_shape = jax.ShapeDtypeStruct((batch, length, args.q_heads, dim), jnp.bfloat16)
    kv_shape = jax.ShapeDtypeStruct((batch, length, kv_heads, dim), jnp.bfloat16)
    lse_shape = jax.ShapeDtypeStruct((batch, args.q_heads, length), jnp.float32)
    mask_mod = None if args.variant == "noop" else masks.causal_mask
    score_mod = {"alibi": masks.alibi(args.q_heads), "softcap": masks.tanh_softcap(30.0)
                 }.get(args.variant)
    score_program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
    block_mask = pf.create_block_mask(mask_mod, None, None, length, length)
    scale = dim ** -0.5

    def run_forward(q, k, v):
        return forward.flex_attention_forward(q, k, v, block_mask, score_program, scale=scale,
                                              options=options, interpret=False)

    def run_backward(q, k, v, out, lse, d_out):
        return backward.flex_attention_backward(
            q, k, v, out, lse, d_out, None, block_mask, score_program, scale=scale,
            options=options, interpret=False, wanted_const_grads=[False] * len(
                score_program.consts) if score_program is not None else None)

    _write_ttir(args, [(run_forward, (q_shape, kv_shape, kv_shape)),
                       (run_backward, (q_shape, kv_shape, kv_shape, q_shape, lse_shape,
                                       q_shape))], suffix=args.variant)


def lower_paged(args, options) -> None:
    """The kernels of `paged_flex_attention` on a cache of args.page_size-row pages:
    queries are the last q_len positions of seq_len-token rows (causal, or the variant's
    mods), pages [B * seq_len / page_size, Hkv, page_size, D]."""
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf
    from pallas_flex import masks
    from pallas_flex.paged.cache import PagedKVCache
    from pallas_flex.paged.flex_attention import paged_flex_attention

    batch, length, dim, page_size = 4, args.seq_len, args.head_dim, args.page_size
    q_len = args.q_len or min(2048, length)
    kv_heads = args.kv_heads or args.q_heads
    num_pages = batch * (-(-length // page_size))
    pages = jax.ShapeDtypeStruct((num_pages, kv_heads, page_size, dim), jnp.bfloat16)
    cache = PagedKVCache(
        k_pages=pages, v_pages=pages,
        page_table=jax.ShapeDtypeStruct((batch, num_pages // batch), jnp.int32),
        lengths=jax.ShapeDtypeStruct((batch,), jnp.int32),
        page_owner=jax.ShapeDtypeStruct((num_pages,), jnp.int32))
    q_shape = jax.ShapeDtypeStruct((batch, q_len, args.q_heads, dim), jnp.bfloat16)
    mask_mod = masks.offset(masks.causal_mask, length - q_len)
    score_mod = {"alibi": masks.alibi(args.q_heads), "softcap": masks.tanh_softcap(30.0)
                 }.get(args.variant)
    block_mask = pf.create_block_mask(mask_mod, None, None, q_len, length)

    def run(q, cache):
        return paged_flex_attention(q, cache, block_mask=block_mask, score_mod=score_mod,
                                    backend="pallas", kernel_options=options)

    _write_ttir(args, [(run, (q_shape, cache))], suffix=f"{args.variant}_page{page_size}")


def _write_ttir(args, functions, *, suffix: str) -> None:
    """Lowers each (function, argument shapes) for an H100 and writes the Triton module
    of every kernel it launches as <kernel>_<suffix>_w<warps>s<stages>.ttir."""
    import jax
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration

    # Lower for an H100 whatever this machine has, and keep each Triton module (the
    # patches are undone afterwards: GPU work in the same process sees the real device).
    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    modules = []
    real_gpu_info = pallas_call_registration.gpu_info_lib.get_gpu_info
    real_lower = lowering.lower_jaxpr_to_triton_module

    def keep(*a, **kw):
        result = real_lower(*a, **kw)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h100
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        lowered = [jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
                   for fn, shapes in functions]
    finally:
        pallas_call_registration.gpu_info_lib.get_gpu_info = real_gpu_info
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = real_lower
    # Each launch's warps and stages, as the kernels chose them, from the custom calls.
    launch_parameters = {
        name: (int(warps), int(stages)) for name, stages, warps in re.findall(
            r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32',
            "".join(lowered))}
    os.makedirs(args.out_dir, exist_ok=True)
    for text in modules:
        name = re.search(r"tt.func public @(\w+)", text).group(1)
        warps, stages = launch_parameters[name]
        path = os.path.join(args.out_dir, f"{name}_{suffix}_w{warps}s{stages}.ttir")
        with open(path, "w") as f:
            f.write(text)
        print(path)


def loop_instruction_counts(ptx: str) -> list[tuple[str, int, int, int]]:
    """(label, global loads, async copies, wgmma) of each PTX loop: a block whose
    instructions run up to a branch back to its own label."""
    loops, label, counts = [], None, [0, 0, 0]
    for line in ptx.splitlines():
        start = re.match(r"^(\$L__BB\d+_\d+):", line)
        if start:
            label, counts = start.group(1), [0, 0, 0]
            continue
        if label is None:
            continue
        counts[0] += "ld.global" in line
        counts[1] += "cp.async.cg" in line or "cp.async.ca" in line
        counts[2] += "wgmma.mma_async" in line
        branch = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if branch and branch.group(1) == label:
            loops.append((label, *counts))
    return loops


def compile_files(args) -> None:
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for path in args.files:
        match = re.search(r"_w(\d+)s(\d+)\.ttir$", path)
        warps, stages = (int(match.group(1)), int(match.group(2))) if match else (4, 2)
        options = backend.parse_options(dict(num_warps=warps, num_stages=stages))
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = ir.parse_mlir_module(path, context)
        module.context = context
        stages_of = {}
        language = getattr(triton.compiler.compiler, "Language", None)
        backend.add_stages(stages_of, options, language.TRITON if language else None)
        metadata, text = {}, module
        for stage in ("ttir", "ttgir", "llir", "ptx"):
            text = stages_of[stage](text, metadata)
            if stage in ("ttgir", "ptx"):
                with open(path[:-len(".ttir")] + f".{stage}", "w") as f:
                    f.write(str(text))
        ttgir = open(path[:-len(".ttir")] + ".ttgir").read()
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path[:-len(".ttir")] + ".ptx",
                                 "-o", os.devnull], capture_output=True, text=True).stderr
        registers = " ".join(line.split(":", 1)[-1].strip() for line in report.splitlines()
                             if "registers" in line or "spill" in line)
        print(f"{os.path.basename(path)}: warps {warps} stages {stages}, shared memory "
              f"{metadata.get('shared')} B, async copies "
              f"{ttgir.count('async_copy_global_to_local')}, wgmma "
              f"{ttgir.count('warp_group_dot ')}; ptxas: {registers}")
        ptx = open(path[:-len(".ttir")] + ".ptx").read()
        for label, loads, copies, wgmma in loop_instruction_counts(ptx):
            print(f"  loop {label}: ld.global {loads}, cp.async {copies}, wgmma {wgmma}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inspect_kernels",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    lower_parser = commands.add_parser("lower", help="write the kernels' TTIR (project env)")
    lower_parser.add_argument("--variant", default="noop",
                              choices=["noop", "causal", "alibi", "softcap"])
    lower_parser.add_argument("--options", default="{}", help="kernel_options as JSON")
    lower_parser.add_argument("--q-heads", type=int, default=16)
    lower_parser.add_argument("--kv-heads", type=int, default=0, help="0: as many as q")
    lower_parser.add_argument("--seq-len", type=int, default=4096)
    lower_parser.add_argument("--head-dim", type=int, default=128)
    lower_parser.add_argument("--out-dir", default="/tmp/ttir")
    lower_parser.add_argument("--page-size", type=int, default=0,
                              help="lower paged_flex_attention on pages of this many rows")
    lower_parser.add_argument("--q-len", type=int, default=0,
                              help="with --page-size: new tokens (1 = the decode kernel; "
                                   "0 = min(2048, seq-len))")
    compile_parser = commands.add_parser("compile", help="compile TTIR files (pip triton)")
    compile_parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    (lower if args.command == "lower" else compile_files)(args)


if __name__ == "__main__":
    sys.exit(main())
