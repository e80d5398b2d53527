"""Peak GPU memory of one fused forward + backward step of pallas_flex, per sequence length.

    PYTHONPATH=$PWD python3 -m benchmarks.memory_bench [--lengths 16384,32768,65536]
        [--batch 1] [--heads 16] [--head-dim 128] [--steps 5] [--out results.json]

Causal self-attention, bf16, q, k, v [B, S, H, D] and a cotangent d_out of out's shape (the
numbers of `suites.make_inputs` / `suites.make_cotangent`). For each length, in a fresh
subprocess with `XLA_PYTHON_CLIENT_PREALLOCATE=false` (so the allocator's statistics are
the step's own, not one preallocated pool):

  1. q, k, v, d_out go to the device (converted to bf16 on the host: no device temporaries),
     the causal BlockMask is built once, and the step — the same jitted fwd_bwd step as
     `benchmarks.run --mode fwd_bwd` (`jax.vjp` of `flex_attention` with d_out, returning
     out, dq, dk, dv) — is compiled ahead of time;
  2. `jax.devices()[0].memory_stats()` is read, one step runs, and it is read again: when
     `peak_bytes_in_use` grew, the step set the process's peak and that peak is the step's
     exactly (inputs, BlockMask, the step's outputs and workspace all included); if it did
     not grow, the earlier peak is an upper bound and the row says so;
  3. `--steps` more steps are timed one at a time (median reported).

The table gives the peak, the peak minus the inputs (q, k, v, d_out), and both divided by S:
per-token bytes that stay flat as S doubles show memory linear in S (an S x S score matrix in
f32 would be 4 * B * H * S^2 bytes: 256 GiB at S = 65536, H = 16). XLA's compiled temp size
(`memory_analysis()`) is listed too; Pallas kernels allocate no memory of their own beyond
their outputs. On a CPU `memory_stats()` is None: the peak columns read n/a (exit code 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import run as bench_run  # jax-free: subprocesses, provenance helpers
from benchmarks import suites

DEFAULT_LENGTHS = (16384, 32768, 65536)
MIB = float(1 << 20)


# -- one length, in the child process --------------------------------------------------------

def measure(seq_len: int, batch: int, heads: int, head_dim: int, steps: int,
            backend: str | None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_flex as pf
    from benchmarks import jax_bench

    device = jax.devices()[0]

    def memory_stats():
        stats = device.memory_stats()
        return dict(stats) if stats else None

    shape = suites.Shape(f"memory_s{seq_len}", batch, heads, heads, seq_len, head_dim)
    variant = suites.Variant("causal", mask=suites.CAUSAL)
    host = [*suites.make_inputs(shape), suites.make_cotangent(shape)]
    q, k, v, d_out = (jax.device_put(np.asarray(x, dtype=jnp.bfloat16), device)
                      for x in host)
    del host
    input_bytes = sum(int(x.nbytes) for x in (q, k, v, d_out))

    mask_mod, score_mod = jax_bench.jax_mods(variant, shape)
    start = time.perf_counter()
    block_mask = pf.create_block_mask(mask_mod, None, None, seq_len, seq_len)
    jax.block_until_ready(block_mask.kv_num_blocks)
    block_mask_s = time.perf_counter() - start
    block_mask_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(block_mask)
                           if hasattr(x, "nbytes"))

    backend = backend or pf.default_backend()
    step = jax_bench.STEP_BUILDERS["fwd_bwd"][0](score_mod, backend)
    arguments = (q, k, v, d_out, block_mask)
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()
    compile_s = time.perf_counter() - start
    try:
        analysis = compiled.memory_analysis()
        xla_memory = {name: int(getattr(analysis, name)) for name in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
            if hasattr(analysis, name)} if analysis is not None else None
    except Exception as error:  # Not every backend implements it.
        xla_memory = {"error": f"{type(error).__name__}: {error}"}

    before = memory_stats()
    start = time.perf_counter()
    result = jax.block_until_ready(compiled(*arguments))
    first_step_s = time.perf_counter() - start
    after = memory_stats()
    output_bytes = sum(int(x.nbytes) for x in result)
    del result

    step_ms = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arguments))
        step_ms.append((time.perf_counter() - start) * 1e3)

    row = {
        "seq_len": seq_len, "batch": batch, "heads": heads, "head_dim": head_dim,
        "dtype": "bfloat16", "variant": "causal", "backend": backend,
        "input_bytes": input_bytes, "block_mask_bytes": block_mask_bytes,
        "output_bytes": output_bytes,
        "block_mask_build_s": block_mask_s, "compile_s": compile_s,
        "first_step_ms": first_step_s * 1e3,
        "step_ms": statistics.median(step_ms) if step_ms else first_step_s * 1e3,
        "step_ms_all": step_ms, "xla_memory_analysis": xla_memory,
        "memory_stats_before": before, "memory_stats_after": after,
    }
    if before is None or after is None or "peak_bytes_in_use" not in after:
        row["peak_bytes"] = None
        row["peak_note"] = "memory_stats() unavailable on this device"
    else:
        peak_before = before.get("peak_bytes_in_use", 0)
        peak_after = after["peak_bytes_in_use"]
        row["peak_bytes"] = peak_after
        row["peak_exact"] = peak_after > peak_before
        row["bytes_in_use_before_step"] = before.get("bytes_in_use")
        if not row["peak_exact"]:
            row["peak_note"] = ("the step did not raise the process's peak: the peak is an "
                                "upper bound set before the step")
    return {"environment": {
        "platform": device.platform, "device_kind": device.device_kind,
        "jax": jax.__version__, "jaxlib": bench_run._version("jaxlib"),
        "pallas_flex": pf.__version__}, "row": row}


# -- the parent: one subprocess per length, the table, the JSON ---------------------------------

def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _per_token_kib(value, seq_len, batch) -> str:
    return "n/a" if value is None else f"{value / (seq_len * batch) / 1024:.2f}"


def format_table(rows: list[dict], header: list[str]) -> str:
    columns = ["S", "inputs MiB", "outputs MiB", "peak MiB", "peak-inputs MiB",
               "(peak-inputs)/token KiB", "peak/token KiB", "XLA temp MiB", "step ms"]
    table = [columns]
    notes = []
    for row in rows:
        if "error" in row:
            table.append([str(row["seq_len"])] + ["error"] * (len(columns) - 1))
            notes.append(f"  S={row['seq_len']}: {row['error'][:400]}")
            continue
        peak = row.get("peak_bytes")
        above_inputs = None if peak is None else peak - row["input_bytes"]
        xla = row.get("xla_memory_analysis") or {}
        peak_cell = _mib(peak)
        if peak is not None and not row.get("peak_exact", True):
            peak_cell = "<= " + peak_cell
        table.append([
            str(row["seq_len"]), _mib(row["input_bytes"]), _mib(row["output_bytes"]),
            peak_cell, _mib(above_inputs),
            _per_token_kib(above_inputs, row["seq_len"], row["batch"]),
            _per_token_kib(peak, row["seq_len"], row["batch"]),
            _mib(xla.get("temp_size_in_bytes")), f"{row['step_ms']:.2f}"])
        if row.get("peak_note"):
            notes.append(f"  S={row['seq_len']}: {row['peak_note']}")
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = list(header)
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths))
              for line in table[:1]]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths))
              for line in table[1:]]
    if notes:
        lines += ["", "notes:"] + notes
    return "\n".join(lines)


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(token) for token in text.split(",") if token.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths: comma-separated integers, got {text!r}")
    if not lengths or any(length < 1 for length in lengths):
        raise argparse.ArgumentTypeError(f"--lengths: positive integers, got {text!r}")
    return lengths


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Peak GPU memory of one pallas_flex fwd+bwd step (causal), per length.")
    parser.add_argument("--lengths", type=_lengths, default=list(DEFAULT_LENGTHS),
                        help="comma-separated sequence lengths (default 16384,32768,65536)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps after the measured one (median kept; default 5)")
    parser.add_argument("--backend", default=None,
                        help="pallas_flex backend (default: the best for the device)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<date>-<device>-"
                             "memory.json)")
    # The child process: one length, JSON to --json-out.
    parser.add_argument("--child-seq-len", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.batch, args.heads, args.head_dim) < 1 or args.steps < 0:
        parser.error("--batch, --heads, --head-dim must be positive, --steps >= 0")
    return args


def child_main(args) -> int:
    result = measure(args.child_seq_len, args.batch, args.heads, args.head_dim, args.steps,
                     args.backend)
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text)
    else:
        print(text)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_seq_len is not None:
        return child_main(args)

    rows, environment = [], None
    env = bench_run._child_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    with tempfile.TemporaryDirectory(prefix="pallas-flex-memory-") as workdir:
        for seq_len in args.lengths:
            argv = ["--child-seq-len", str(seq_len), "--batch", str(args.batch),
                    "--heads", str(args.heads), "--head-dim", str(args.head_dim),
                    "--steps", str(args.steps)]
            if args.backend:
                argv += ["--backend", args.backend]
            code, result = bench_run._run_child("benchmarks.memory_bench", argv, env,
                                                Path(workdir) / f"s{seq_len}.json")
            if result is None:
                rows.append({"seq_len": seq_len, "batch": args.batch,
                             "error": f"the child failed (exit code {code}); see its "
                                      "output above (out of memory?)"})
                continue
            environment = environment or result["environment"]
            rows.append(result["row"])
            row = result["row"]
            print(f"[memory] S={seq_len}: peak {_mib(row.get('peak_bytes'))} MiB, "
                  f"step {row['step_ms']:.2f} ms", file=sys.stderr, flush=True)

    now = datetime.datetime.now().astimezone()
    environment = environment or {}
    device = environment.get("device_kind", "unknown")
    commit = bench_run._git("rev-parse", "HEAD")
    dirty = bool(bench_run._git("status", "--porcelain", "--", ".",
                                ":(exclude)benchmarks/results"))
    backend = next((row["backend"] for row in rows if "backend" in row), args.backend)
    header = [
        f"pallas_flex fwd+bwd peak memory on {device}, {now:%Y-%m-%d}, commit "
        f"{(commit or 'unknown')[:10]}{' (dirty)' if dirty else ''}; jax "
        f"{environment.get('jax', '?')}",
        f"causal, bf16, B={args.batch} H={args.heads} D={args.head_dim}, backend={backend!r}; "
        "one jitted step: jax.vjp of flex_attention with a fixed d_out -> out, dq, dk, dv; "
        "BlockMask built once; each S in a fresh process (XLA_PYTHON_CLIENT_PREALLOCATE="
        "false)",
        "peak = memory_stats()['peak_bytes_in_use'] after one step (everything live: "
        "inputs, BlockMask, outputs, workspace); inputs = q, k, v, d_out; per token = / "
        "(B*S); step ms = median of --steps steps, each timed alone",
    ]
    print()
    print(format_table(rows, header))

    out = Path(args.out) if args.out else bench_run.RESULTS_DIR / (
        f"{now:%Y-%m-%d}-{bench_run.device_slug(device)}-memory.json")
    record = {
        "date": now.strftime("%Y-%m-%d"), "timestamp": now.isoformat(timespec="seconds"),
        "device": device, "environment": environment, "git_commit": commit,
        "git_dirty": dirty, "python": sys.version.split()[0],
        "settings": {"lengths": args.lengths, "batch": args.batch, "heads": args.heads,
                     "head_dim": args.head_dim, "steps": args.steps, "backend": backend,
                     "variant": "causal", "dtype": "bfloat16"},
        "method": __doc__.strip(),
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
