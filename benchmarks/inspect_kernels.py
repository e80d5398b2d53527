"""Read what Triton makes of our kernels without a GPU: registers, spills, shared memory,
pipelining (a maintainer tool; docs/design.md §8 gives the commands).

`lower` (the project's environment, any machine) writes the forward and backward kernels'
Triton IR as planned for an H100 (`--page-size N`: the paged kernels); `compile` (a side
environment with pip `triton==3.6.0`) runs Triton's CUDA pipeline on those files and
prints shared memory, async copies, wgmma, `ptxas -v` registers and spills and each PTX
loop's global loads; `audit` checks the shared-memory estimate against Triton for every
cell of the GPU test matrix. Warps and stages come from the file name (`..._w8s3.ttir`).
`capture_mosaic` (a function) lowers calls' Mosaic GPU kernels for an H100 and digests them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys


def lower(args) -> None:
    """The forward and backward kernels of a B4 call, or with --page-size those of
    `paged_flex_attention` on pages of that many rows (the last q_len of seq_len tokens)."""
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf
    from pallas_flex import masks
    from pallas_flex.kernels import backward, forward
    from pallas_flex.kernels.config import resolve_options
    from pallas_flex.masks.mod_program import SCORE, make_mod_program
    from pallas_flex.paged.cache import PagedKVCache

    options = resolve_options(json.loads(args.options), args.head_dim, args.dtype)
    batch, length, dim, size = 4, args.seq_len, args.head_dim, args.page_size
    kv_heads, dtype = args.kv_heads or args.q_heads, jnp.dtype(args.dtype)
    shape = lambda *dims, dtype=dtype: jax.ShapeDtypeStruct(dims, dtype)  # noqa: E731
    score_mod = {"alibi": masks.alibi(args.q_heads), "softcap": masks.tanh_softcap(30.0)
                 }.get(args.variant)
    if size:
        q_len = args.q_len or min(2048, length)
        pages = batch * (-(-length // size))
        cache_dtype = jnp.dtype(args.cache_dtype or dtype)
        scales = (() if args.cache_dtype is None else
                  (shape(pages, kv_heads, size, dtype=jnp.float32),) * 2)
        cache = PagedKVCache(shape(pages, kv_heads, size, dim, dtype=cache_dtype),
                             shape(pages, kv_heads, size, dim, dtype=cache_dtype),
                             shape(batch, pages // batch, dtype=jnp.int32),
                             shape(batch, dtype=jnp.int32), shape(pages, dtype=jnp.int32),
                             *scales)
        block_mask = pf.create_block_mask(masks.offset(masks.causal_mask, length - q_len),
                                          None, None, q_len, length)
        run = lambda q, cache: pf.paged.paged_flex_attention(  # noqa: E731
            q, cache, block_mask=block_mask, score_mod=score_mod, backend="pallas",
            kernel_options=options)
        _write_ttir(args, [(run, (shape(batch, q_len, args.q_heads, dim), cache))],
                    suffix=f"{args.variant}_page{size}" + (
                        f"_{args.cache_dtype}" if args.cache_dtype else ""))
        return
    q_shape, kv_shape = shape(batch, length, args.q_heads, dim), shape(batch, length,
                                                                        kv_heads, dim)
    score_program = make_mod_program(score_mod, SCORE) if score_mod is not None else None
    block_mask = pf.create_block_mask(None if args.variant == "noop" else masks.causal_mask,
                                      None, None, length, length)

    def run_forward(q, k, v):
        return forward.flex_attention_forward(q, k, v, block_mask, score_program,
                                              scale=dim ** -0.5, options=options,
                                              interpret=False)

    def run_backward(q, k, v, out, lse, d_out):
        return backward.flex_attention_backward(
            q, k, v, out, lse, d_out, None, block_mask, score_program, scale=dim ** -0.5,
            options=options, interpret=False, wanted_const_grads=[False] * len(
                score_program.consts) if score_program is not None else None)

    _write_ttir(args, [(run_forward, (q_shape, kv_shape, kv_shape)),
                       (run_backward, (q_shape, kv_shape, kv_shape, q_shape,
                                       shape(batch, args.q_heads, length, dtype=jnp.float32),
                                       q_shape))], suffix=args.variant)


def _write_ttir(args, functions, *, suffix: str) -> None:
    """Lowers each (function, argument shapes) for an H100 and writes the Triton module
    of every kernel it launches as <kernel>_<suffix>_w<warps>s<stages>.ttir."""
    os.makedirs(args.out_dir, exist_ok=True)
    for name, warps, stages, text in capture_triton(functions):
        path = os.path.join(args.out_dir, f"{name}_{suffix}_w{warps}s{stages}.ttir")
        with open(path, "w") as f:
            f.write(text)
        print(path)


def capture_triton(functions) -> list[tuple[str, int, int, str]]:
    """(kernel name, warps, stages, TTIR) of every Triton kernel that lowering each
    (function, argument shapes) for an H100 launches (Mosaic GPU kernels are left out)."""
    import jax
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration

    from pallas_flex import api

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
        with api.lowering_for_gpu():  # backend="pallas" traces here without a GPU
            lowered = [jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
                       .as_text() for fn, shapes in functions]
    finally:
        pallas_call_registration.gpu_info_lib.get_gpu_info = real_gpu_info
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = real_lower
    # Each launch's warps and stages, as the kernels chose them, from the custom calls.
    launch_parameters = {
        name: (int(warps), int(stages)) for name, stages, warps in re.findall(
            r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32',
            "".join(lowered))}
    captured = []
    for text in modules:
        name = re.search(r"tt.func public @(\w+)", text).group(1)
        captured.append((name, *launch_parameters[name], text))
    return captured


def capture_mosaic(functions) -> list[str]:
    """A digest of every Mosaic GPU kernel that lowering each (function, argument shapes)
    for an H100 launches, in launch order, on any machine: of the kernel's MLIR module as
    text without locations (so lines moved in the source leave it alone). Lowering runs
    Mosaic GPU's Python side whole (layouts, shared-memory refs, barriers, the module),
    where interpret mode skips parts; the GPU compiles the module to a cubin later. Equal
    digests before and after a change: the kernels the GPU gets are unchanged."""
    import jax
    from jax.experimental.mosaic.gpu import core as mosaic_core

    from pallas_flex import api
    from pallas_flex.kernels import device

    modules = []
    real_capability, real_serde = device.compute_capability, mosaic_core._run_serde_pass

    def keep(module, **kwargs):  # each kernel's module, as Mosaic GPU serializes it
        text = module.operation.get_asm(enable_debug_info=False)
        # (its dump file's name counts the kernels this process lowered)
        modules.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "", text))
        return real_serde(module, **kwargs)

    device.compute_capability = lambda: device.HOPPER  # what the dispatcher asks
    mosaic_core._run_serde_pass = keep
    jax.clear_caches()  # a call lowered before would come from JAX's cache, unseen
    try:
        with api.lowering_for_gpu():
            for fn, shapes in functions:
                jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    finally:
        device.compute_capability = real_capability
        mosaic_core._run_serde_pass = real_serde
    return [hashlib.sha256(text.encode()).hexdigest()[:16] for text in modules]


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


def compile_ttir(path: str, arch: int = 90) -> dict:
    """Runs Triton's CUDA pipeline for sm_<arch> on a TTIR file, as XLA does, writing
    <name>.ttgir and <name>.ptx beside it (<name>.sm<arch>.* for other archs); its
    metadata (`shared`: bytes of shared memory). Warps and stages from the file name."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", arch, 32))
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
    metadata, text = {"warps": warps, "stages": stages}, module
    base = path[:-len(".ttir")] + ("" if arch == 90 else f".sm{arch}")
    for stage in ("ttir", "ttgir", "llir", "ptx"):
        text = stages_of[stage](text, metadata)
        if stage in ("ttgir", "ptx"):
            with open(f"{base}.{stage}", "w") as f:
                f.write(str(text))
    metadata["base"] = base
    return metadata


def compile_files(args) -> None:
    if args.json:  # shared memory only, in 2 processes: {file: bytes}
        import multiprocessing
        with multiprocessing.Pool(2) as pool:
            shared = pool.starmap(_shared_bytes, [(path, args.arch) for path in args.files])
        with open(args.json, "w") as f:
            json.dump(dict(zip(args.files, shared)), f)
        return
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for path in args.files:
        metadata = compile_ttir(path, args.arch)
        base, warps, stages = metadata["base"], metadata["warps"], metadata["stages"]
        ttgir = open(base + ".ttgir").read()
        arch = "sm_90a" if args.arch == 90 else f"sm_{args.arch}"
        report = subprocess.run([ptxas, f"-arch={arch}", "-v", base + ".ptx",
                                 "-o", os.devnull], capture_output=True, text=True).stderr
        registers = " ".join(line.split(":", 1)[-1].strip() for line in report.splitlines()
                             if "registers" in line or "spill" in line)
        print(f"{os.path.basename(path)}: warps {warps} stages {stages}, shared memory "
              f"{metadata.get('shared')} B, async copies "
              f"{ttgir.count('async_copy_global_to_local')}, wgmma "
              f"{ttgir.count('warp_group_dot ')}; ptxas: {registers}")
        ptx = open(base + ".ptx").read()
        for label, loads, copies, wgmma in loop_instruction_counts(ptx):
            print(f"  loop {label}: ld.global {loads}, cp.async {copies}, wgmma {wgmma}")


def _shared_bytes(path: str, arch: int):
    try:
        return compile_ttir(path, arch)["shared"]
    except Exception as error:  # noqa: BLE001 (recorded in the audit)
        return f"{type(error).__name__}: {str(error)[:300]}"


# The shared-memory audit (`audit`): the GPU test matrix's cells (tests/gpu/
# test_dtype_matrix.py), each budget compiled for the GPU it stands for.
AUDIT_ARCHS = {227: 90, 164: 80, 100: 89, 64: 75}


def _audit_cell(cell, out_dir: str) -> list[dict]:
    """Lowers one cell as a user call would plan it under its budget: a record per
    Triton kernel with the options and estimate `fit` / `fit_streaming` settled on."""
    import jax

    from pallas_flex.kernels import device, shared_memory
    from tests.gpu.test_dtype_matrix import DTYPES, cell_program

    dtype, head_dim, layout, op, budget = cell
    # Planned as on the GPU the budget stands for (its dtypes, whether it has tensor cores).
    os.environ["PALLAS_FLEX_SHARED_MEMORY_KIB"] = str(budget)
    device.compute_capability = lambda: divmod(AUDIT_ARCHS[budget], 10)
    jax.clear_caches()
    fits = {}  # "forward", "backward", "decode": (options, estimate)
    real_fit, real_fit_streaming = shared_memory.fit, shared_memory.fit_streaming

    def fit(options, estimate, budget, *, kernel, **context):
        fitted = real_fit(options, estimate, budget, kernel=kernel, **context)
        fields = (shared_memory.FORWARD_FIELDS if kernel == "forward"
                  else shared_memory.BACKWARD_FIELDS)
        fits[kernel] = ({field: getattr(fitted, field) for field in fields}, estimate(fitted))
        return fitted

    def fit_streaming(block_kv, num_stages, estimate, budget, *, kernel, **given):
        fitted = real_fit_streaming(block_kv, num_stages, estimate, budget, kernel=kernel,
                                    **given)
        fits[kernel] = (dict(block_kv=fitted[0], num_stages=fitted[1]), estimate(*fitted))
        return fitted

    record = dict(dtype=dtype, head_dim=head_dim, layout=layout, op=op, budget_kib=budget)
    shared_memory.fit, shared_memory.fit_streaming = fit, fit_streaming
    try:
        captured = capture_triton([cell_program(op, DTYPES[dtype], head_dim, layout)])
    except ValueError as error:  # no configuration fits, or a dtype the GPU lacks
        return [dict(record, refused=str(error))]
    finally:
        shared_memory.fit, shared_memory.fit_streaming = real_fit, real_fit_streaming
    records = []
    for name, warps, stages, text in captured:
        kind = next(kind for kind in ("backward", "decode", "forward") if kind in name)
        options, estimate = fits[kind]
        path = os.path.join(out_dir, f"{hashlib.sha1(text.encode()).hexdigest()[:16]}"
                                     f"_w{warps}s{stages}.ttir")
        with open(path, "w") as f:
            f.write(text)
        records.append(dict(record, kernel=name, warps=warps, stages=stages, options=options,
                            estimate=estimate, ttir=os.path.basename(path)))
    return records


def audit(args) -> None:
    """Every cell of the GPU test matrix at every budget: the options the library chose,
    its estimate and what pip triton compiled for that budget's GPU (a JSON and a table)."""
    import itertools
    import multiprocessing

    import jax

    from tests.gpu.test_dtype_matrix import DTYPES, HEAD_DIMS, LAYOUTS, OPS

    os.makedirs(args.out_dir, exist_ok=True)
    cells = list(itertools.product(DTYPES, HEAD_DIMS, LAYOUTS, OPS, AUDIT_ARCHS))
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        records = sum(pool.starmap(_audit_cell, [(cell, args.out_dir) for cell in cells]), [])
    # Identical (TTIR, arch) pairs compile once, across runs too (compiled.json).
    cache_path = os.path.join(args.out_dir, "compiled.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    for arch in sorted(set(AUDIT_ARCHS.values())):
        missing = sorted({r["ttir"] for r in records if "ttir" in r
                          and AUDIT_ARCHS[r["budget_kib"]] == arch} - {
            key.rsplit("@", 1)[0] for key in cache if key.endswith(f"@sm{arch}")})
        if missing:
            out = os.path.join(args.out_dir, f"shared_sm{arch}.json")
            subprocess.run([args.triton_python, os.path.abspath(__file__), "compile", "--arch", str(arch),
                            "--json", out, *missing], check=True, cwd=args.out_dir)
            cache.update({f"{name}@sm{arch}": shared
                          for name, shared in json.load(open(out)).items()})
            json.dump(cache, open(cache_path, "w"), indent=0)
    for r in records:
        if "ttir" in r:
            r["arch"] = f"sm_{AUDIT_ARCHS[r['budget_kib']]}"
            r["compiled"] = cache[f"{r['ttir']}@sm{AUDIT_ARCHS[r['budget_kib']]}"]
            r["passed"] = isinstance(r["compiled"], int) and r["compiled"] <= r["budget_kib"] * 1024
            r["estimate_covers"] = isinstance(r["compiled"], int) and r["estimate"] >= r["compiled"]
    result = dict(
        description="Shared memory of every Triton kernel of the GPU test matrix "
                    "(tests/gpu/test_dtype_matrix.py) as planned at each budget "
                    "(PALLAS_FLEX_SHARED_MEMORY_KIB), against pip triton's compile for the "
                    "budget's GPU: python -m benchmarks.inspect_kernels audit",
        device="CPU, pip triton 3.6.0 compile for " + ", ".join(
            f"sm_{arch} ({budget} KiB)" for budget, arch in AUDIT_ARCHS.items()),
        date=args.date, jax_version=jax.__version__, records=records)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print_audit(records)


def print_audit(records) -> None:
    print(f"{'cell':42} {'kernel':30} {'estimate':>8} {'compiled':>8} {'budget':>7}  result")
    for r in records:
        cell = f"{r['dtype']}-d{r['head_dim']}-{r['layout']}-{r['op']}-{r['budget_kib']}"
        if "ttir" not in r:
            print(f"{cell:42} refused: {r['refused']}"[:160])
            continue
        result = ("pass" if r["passed"] else "FAIL") + (
            "" if r["estimate_covers"] else " (estimate low)")
        print(f"{cell:42} {r['kernel']:30} {r['estimate']:8} {str(r['compiled'])[:8]:>8} "
              f"{r['budget_kib'] * 1024:7}  {result}  {r['options']}")
    kernels = [r for r in records if "ttir" in r]
    print(f"{len(kernels)} kernels: {sum(not r['passed'] for r in kernels)} over budget, "
          f"{sum(not r['estimate_covers'] for r in kernels)} estimates low, "
          f"{sum('refused' in r for r in records)} cells refused")


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
    lower_parser.add_argument("--dtype", default="bfloat16")
    lower_parser.add_argument("--out-dir", default="/tmp/ttir")
    lower_parser.add_argument("--page-size", type=int, default=0,
                              help="lower paged_flex_attention on pages of this many rows")
    lower_parser.add_argument("--q-len", type=int, default=0, help="with --page-size: new "
                              "tokens (1: the decode kernel; 0: min(2048, seq-len))")
    lower_parser.add_argument("--cache-dtype", choices=["int8", "float8_e4m3fn"],
                              help="with --page-size: a quantized cache (per-token scales)")
    compile_parser = commands.add_parser("compile", help="compile TTIR files (pip triton)")
    compile_parser.add_argument("files", nargs="+")
    compile_parser.add_argument("--arch", type=int, default=90, help="compute capability")
    compile_parser.add_argument("--json", help="write {file: shared memory bytes} here")
    audit_parser = commands.add_parser("audit", help="estimates against compiled shared "
                                       "memory over the GPU test matrix (project env)")
    audit_parser.add_argument("--out-dir", default="/tmp/smem_audit")
    audit_parser.add_argument("--json", default="/tmp/smem_audit/audit.json")
    audit_parser.add_argument("--triton-python", default="/tmp/tvenv/bin/python")
    audit_parser.add_argument("--date", default="")
    args = parser.parse_args(argv)
    {"lower": lower, "compile": compile_files, "audit": audit}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
