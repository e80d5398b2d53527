"""Runs a benchmark suite on both frameworks and prints one side-by-side table.

    PYTHONPATH=$PWD python3 -m benchmarks.run [--suite forward] [--shapes 0,gqa_b4_s4096_d128]
        [--variants causal,document] [--quick] [--iters 20] [--xla] [--out results.json]

Each framework runs in its own subprocess, one after the other, and writes JSON to a
temporary file: JAX (pallas_flex, cuDNN, optionally the XLA path) with
`XLA_PYTHON_CLIENT_PREALLOCATE=false`, then PyTorch FlexAttention when `torch` is
importable. The merged rows, the device, the versions, the date and the git commit go to
`benchmarks/results/<date>-<device>-<suite>.json` (`--mode fwd`) or
`<date>-<device>-<suite>_backward.json` (`--mode fwd_bwd`, e.g. forward_backward.json), or
`--out`. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import suites

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Above this, ours and a reference disagree by more than bf16 rounding can explain
# (outputs are averages of N(0, 1) values, |out| < 8, where one bf16 ulp is <= 1/32).
DISAGREEMENT = 0.05
# fwd_bwd: above this, a gradient differs by more than bf16 rounding explains, relative to
# the reference's largest |element| (the backward's bf16 P and dS tiles give ~0.5% at most).
GRAD_DISAGREEMENT = 0.02


# -- running the frameworks ------------------------------------------------------------------

def _child_env(extra=None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def _run_child(module: str, argv: list[str], env: dict, json_path: Path):
    """Runs `python -m module argv --json-out json_path`; returns (exit code, result)."""
    command = [sys.executable, "-m", module, *argv, "--json-out", str(json_path)]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    code = subprocess.run(command, cwd=REPO_ROOT, env=env).returncode
    if code != 0 or not json_path.exists():
        return code, None
    return code, json.loads(json_path.read_text())


def run_jax(args, workdir: Path) -> dict:
    argv = suites.selection_argv(args) + ["--iters", str(args.iters),
                                          "--repeats", str(args.repeats)]
    if args.xla:
        argv.append("--xla")
    if args.jax_mha:
        argv.append("--jax-mha")
    argv += ["--time-budget-s", str(args.time_budget_s)]
    if args.backend:
        argv += ["--backend", args.backend]
    # JAX would otherwise take 75% of GPU memory, and torch runs on the same GPU next.
    env = _child_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    code, result = _run_child("benchmarks.jax_bench", argv, env, workdir / "jax.json")
    if result is None:
        raise SystemExit(f"the JAX benchmark failed (exit code {code}); see its output above")
    return result


def run_torch(args, workdir: Path) -> dict:
    if args.skip_torch:
        return {"status": "skipped", "reason": "--skip-torch", "rows": []}
    if importlib.util.find_spec("torch") is None:
        return {"status": "n/a", "reason": "torch is not importable", "rows": []}
    argv = suites.selection_argv(args) + ["--rep-ms", str(args.torch_rep_ms),
                                          "--warmup-ms", str(args.torch_warmup_ms)]
    code, result = _run_child("benchmarks.torch_bench", argv, _child_env(),
                              workdir / "torch.json")
    if result is None:
        return {"status": "error", "reason": f"the torch benchmark failed (exit code {code})",
                "rows": []}
    if result.get("error"):
        return {**result, "status": "n/a", "reason": result["error"]}
    return result


# -- merging -----------------------------------------------------------------------------------

def _key(row):
    return row["shape"]["name"], row["variant"]["name"]


# Shared by the harnesses (jax-free): a timing entry is {"ms": ...} or a status/error.

def entry_ms(entry):
    return entry.get("ms") if isinstance(entry, dict) else None


def ms_ratio(numerator_ms, denominator_ms):
    if numerator_ms is None or denominator_ms is None or not denominator_ms > 0:
        return None
    return numerator_ms / denominator_ms


def error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) < 600 else text[:600] + " ..."


def _grad_sample_differences(ours: dict | None, theirs: dict | None) -> dict:
    """Per gradient (dq, dk, dv): the largest |ours - theirs| over the sampled elements,
    and that relative to the largest |theirs| there."""
    absolute, relative = {}, {}
    for name in sorted(set(ours or {}) & set(theirs or {})):
        differences = [abs(a - b) for a, b in zip(ours[name], theirs[name])]
        if not differences:
            continue
        scale = max(abs(b) for b in theirs[name])
        absolute[name] = max(differences)
        relative[name] = (absolute[name] / scale if scale > 0 else
                          0.0 if absolute[name] == 0 else float("inf"))
    if not absolute:
        return {}
    return {"grad_max_abs_diff_vs_ours_samples": absolute,
            "grad_rel_diff_vs_ours_samples": relative,
            "grad_max_rel_diff_vs_ours_samples": max(relative.values())}


def merge(jax_result: dict, torch_result: dict) -> list[dict]:
    torch_rows = {_key(row): row for row in torch_result.get("rows", [])}
    merged = []
    for jax_row in jax_result["rows"]:
        row = {key: value for key, value in jax_row.items()
               if key not in ("ours_samples", "ours_grad_samples")}
        torch_row = torch_rows.get(_key(jax_row))
        if torch_row is None:
            row["torch"] = {"status": torch_result.get("status", "n/a"),
                            "reason": torch_result.get("reason", "no torch row")}
        else:
            row["torch"] = torch_row["torch"]
            row["torch_block_mask_build_s"] = torch_row.get("block_mask_build_s")
            row["torch_block_density"] = torch_row.get("block_density")
            ours_samples, torch_samples = (jax_row.get("ours_samples"),
                                           torch_row.get("torch_samples"))
            if ours_samples and torch_samples:
                row["torch"]["max_abs_diff_vs_ours_samples"] = max(
                    abs(a - b) for a, b in zip(ours_samples, torch_samples))
            row["torch"].update(_grad_sample_differences(
                jax_row.get("ours_grad_samples"), torch_row.get("torch_grad_samples")))
        ours_ms = entry_ms(row.get("ours"))
        row["torch_ms_over_ours_ms"] = ms_ratio(entry_ms(row["torch"]), ours_ms)
        row["cudnn_ms_over_ours_ms"] = ms_ratio(entry_ms(row.get("cudnn")), ours_ms)
        if "jax_mha" in row:
            row["jax_mha_ms_over_ours_ms"] = ms_ratio(entry_ms(row["jax_mha"]), ours_ms)
        merged.append(row)
    return merged


# -- the table ---------------------------------------------------------------------------------

def time_cell(entry) -> str:
    if not isinstance(entry, dict):
        return "n/a"
    if "ms" in entry:
        return f"{entry['ms']:.3f}"
    return {"inexpressible": "-"}.get(entry.get("status"), entry.get("status", "error"))


def ratio_cell(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _largest_difference(row):
    """The largest |ours - reference| of the output (cuDNN, mha: whole; torch: samples)."""
    differences = [entry[key] for entry, key in (
        (row.get("cudnn") or {}, "max_abs_diff_vs_ours"),
        (row.get("jax_mha") or {}, "max_abs_diff_vs_ours"),
        (row.get("torch") or {}, "max_abs_diff_vs_ours_samples")) if key in entry]
    return max(differences) if differences else None


def _largest_grad_difference(row):
    """fwd_bwd: the largest relative gradient difference to any reference."""
    differences = [entry[key] for entry, key in (
        (row.get("cudnn") or {}, "grad_max_rel_diff_vs_ours"),
        (row.get("jax_mha") or {}, "grad_max_rel_diff_vs_ours"),
        (row.get("torch") or {}, "grad_max_rel_diff_vs_ours_samples")) if key in entry]
    return max(differences) if differences else None


def format_table(rows: list[dict], header: list[str]) -> str:
    with_xla = any("xla" in row for row in rows)
    with_mha = any("jax_mha" in row for row in rows)
    with_grads = any(row.get("mode") == "fwd_bwd" for row in rows)
    columns = ["shape", "variant", "density", "ours ms", "ours TFLOP/s", "cuDNN ms",
               "torch ms", "torch/ours", "cuDNN/ours"]
    if with_mha:
        columns.append("jax_mha ms")
    if with_xla:
        columns.append("xla ms")
    columns.append("max|diff|")
    if with_grads:
        columns.append("grad rel|diff|")
    table = [columns]
    for row in rows:
        ours = row.get("ours") or {}
        tflops = ours.get("tflops")
        difference = _largest_difference(row)
        cells = [
            suites.Shape(**row["shape"]).label,
            row["variant"]["name"],
            f"{row['density']:.3f}",
            time_cell(ours),
            "-" if tflops is None else f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.2g}",
            time_cell(row.get("cudnn")),
            time_cell(row.get("torch")),
            ratio_cell(row.get("torch_ms_over_ours_ms")),
            ratio_cell(row.get("cudnn_ms_over_ours_ms")),
        ]
        if with_mha:
            cells.append(time_cell(row.get("jax_mha")))
        if with_xla:
            cells.append(time_cell(row.get("xla")))
        cells.append("-" if difference is None else
                      f"{difference:.4f}" + (" !" if difference > DISAGREEMENT else ""))
        if with_grads:
            grad_difference = _largest_grad_difference(row)
            cells.append("-" if grad_difference is None else f"{grad_difference:.4f}" + (
                " !" if grad_difference > GRAD_DISAGREEMENT else ""))
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]

    def render(line):
        return "  ".join(cell.ljust(width) if i < 2 else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(line, widths)))

    lines = list(header) + [render(columns), "  ".join("-" * w for w in widths)]
    lines += [render(line) for line in table[1:]]
    notes = []
    for row in rows:
        for name in ("ours", "cudnn", "torch", "jax_mha", "xla"):
            entry = row.get(name)
            if isinstance(entry, dict) and "error" in entry:
                notes.append(f"  {row['shape']['name']} {row['variant']['name']} {name}: "
                             f"{entry['error'][:300]}")
        difference = _largest_difference(row)
        if difference is not None and difference > DISAGREEMENT:
            notes.append(f"  {row['shape']['name']} {row['variant']['name']}: outputs differ "
                         f"by {difference:.4f} (> {DISAGREEMENT}): check the variant's mods")
        grad_difference = _largest_grad_difference(row)
        if grad_difference is not None and grad_difference > GRAD_DISAGREEMENT:
            notes.append(f"  {row['shape']['name']} {row['variant']['name']}: gradients "
                         f"differ by {grad_difference:.4f} of their largest element "
                         f"(> {GRAD_DISAGREEMENT}): see grad_rel_diff_* in the JSON")
    if notes:
        lines += ["", "notes:"] + notes
    return "\n".join(lines)


# -- provenance ----------------------------------------------------------------------------------

def _git(*argv) -> str | None:
    try:
        return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(jax_result: dict, torch_result: dict, now: datetime.datetime) -> dict:
    jax_env = jax_result["environment"]
    torch_env = torch_result.get("environment", {})
    plugins = {name: _version(name) for name in
               ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt",
                "jax-cuda13-pjrt") if _version(name)}
    return {
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
        "device": torch_env.get("device_name") or jax_env["device_kind"],
        "jax_device_kind": jax_env["device_kind"],
        "platform": jax_env["platform"],
        "versions": {
            "python": sys.version.split()[0],
            "jax": jax_env.get("jax"), "jaxlib": jax_env.get("jaxlib"), **plugins,
            "pallas_flex": jax_env.get("pallas_flex"),
            "torch": torch_env.get("torch") or _version("torch"),
            "torch_cuda": torch_env.get("torch_cuda"),
            "triton": torch_env.get("triton") or _version("triton"),
        },
        "git_commit": _git("rev-parse", "HEAD"),
        # Untracked files count too (new modules change what ran); results do not.
        "git_dirty": bool(_git("status", "--porcelain", "--", ".",
                               ":(exclude)benchmarks/results")),
    }


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# -- main -----------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="pallas-flex bench",
        description="pallas_flex vs cuDNN vs PyTorch FlexAttention: one table, one JSON file.")
    suites.add_selection_args(parser)
    parser.add_argument("--iters", type=int, default=20,
                        help="JAX: calls per timed loop (default 20)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="JAX: timed loops, median kept (default 5)")
    parser.add_argument("--backend", default=None,
                        help="backend of 'ours' (default: the best for the device)")
    parser.add_argument("--xla", action="store_true",
                        help="also time backend='xla' (fwd only: its backward is the "
                             "Pallas interpreter)")
    parser.add_argument("--jax-mha", action="store_true",
                        help="also time JAX's Pallas Triton mha (jax.experimental.pallas.ops"
                             ".gpu.attention; GPU; noop, causal, document; no GQA)")
    parser.add_argument("--time-budget-s", type=float, default=20.0,
                        help="JAX: cut iters, then repeats, of a timing that the warm-up "
                             "says would take longer than this (default 20 s; only slow "
                             "CPU paths reach it)")
    parser.add_argument("--skip-torch", action="store_true", help="do not run PyTorch")
    parser.add_argument("--torch-rep-ms", type=int, default=100,
                        help="torch: do_bench measuring time in ms (default 100)")
    parser.add_argument("--torch-warmup-ms", type=int, default=25,
                        help="torch: do_bench warmup in ms (default 25)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<date>-<device>-"
                             "<suite>.json for fwd, -<suite>_backward.json for fwd_bwd)")
    parser.add_argument("--append", action="store_true",
                        help="merge into an existing JSON file at the output path (rows of "
                             "this run replace rows of the same shape and variant), to "
                             "build one file from several shorter runs")
    args = parser.parse_args(argv)
    try:
        suites.select(args)
    except ValueError as error:
        parser.error(str(error))
    if args.iters < 1 or args.repeats < 1:
        parser.error("--iters and --repeats must be at least 1")
    if not args.time_budget_s > 0:
        parser.error("--time-budget-s must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    suites.check_mode(args.mode)  # an unimplemented mode fails before any subprocess
    suite = suites.SUITES[args.suite]
    flop_note = suites.flop_convention(args.mode)
    with tempfile.TemporaryDirectory(prefix="pallas-flex-bench-") as workdir:
        jax_result = run_jax(args, Path(workdir))
        torch_result = run_torch(args, Path(workdir))
    now = datetime.datetime.now().astimezone()
    info = provenance(jax_result, torch_result, now)
    rows = merge(jax_result, torch_result)

    versions = info["versions"]
    backend = args.backend or jax_result["environment"].get("default_backend")
    if args.mode == "fwd_bwd":
        step_note = ("one timed call = one step computing out and dq, dk, dv for a fixed "
                     "random bf16 cotangent d_out (the gradients of sum(out * d_out)): JAX "
                     "jax.vjp under one jax.jit, torch autograd.grad(out, (q, k, v), d_out)")
    else:
        step_note = "one timed call = the forward output"
    header = [
        f"pallas_flex {suite.name} benchmark ({args.mode}) on {info['device']}, {info['date']}, "
        f"commit {(info['git_commit'] or 'unknown')[:10]}{' (dirty)' if info['git_dirty'] else ''}",
        f"jax {versions['jax']}, jaxlib {versions['jaxlib']}, torch {versions['torch'] or 'n/a'}, "
        f"triton {versions['triton'] or 'n/a'}",
        f"ours = pallas_flex.flex_attention(backend={backend!r}), BlockMask built once; "
        "cuDNN = jax.nn.dot_product_attention(implementation='cudnn'); "
        "torch = torch.compile(flex_attention)"
        + ("; jax_mha = jax.experimental.pallas.ops.gpu.attention.mha (GPU; '-': no such "
           "variant or GQA)" if args.jax_mha else ""),
        step_note,
        "times in ms (JAX: median of loops of back-to-back calls; torch: do_bench median); "
        "bf16; " + flop_note,
        "cuDNN '-': the variant has no cuDNN equivalent; 'unsupported': cuDNN refused it; "
        "torch/ours, cuDNN/ours = their ms / our ms (> 1: ours faster); "
        "max|diff| = largest |ours - other| over cuDNN's (and jax_mha's) whole output and "
        f"{suites.NUM_SAMPLES} sampled outputs of torch"
        + ("; grad rel|diff| = largest |ours - other| / max|other| over dq, dk, dv (cuDNN, "
           "jax_mha: whole; torch: the same samples)" if args.mode == "fwd_bwd" else ""),
    ]
    cut = [f"{row['shape']['name']} {row['variant']['name']} {name}"
           for row in jax_result["rows"] for name in ("ours", "cudnn", "jax_mha", "xla")
           if isinstance(row.get(name), dict) and "iters" in row[name]
           and (row[name]["iters"], row[name]["repeats"]) != (args.iters, args.repeats)]
    if cut:
        header.append(f"timed with fewer iters/repeats (--time-budget-s "
                      f"{args.time_budget_s:g}): {', '.join(cut)}")
    if torch_result.get("status") in ("n/a", "skipped", "error"):
        header.append(f"torch: {torch_result['status']} ({torch_result['reason']})")

    out = Path(args.out) if args.out else RESULTS_DIR / (
        f"{info['date']}-{device_slug(info['device'])}-{suite.name}"
        f"{suites.MODE_FILE_SUFFIX[args.mode]}.json")
    run_info = {
        **info, "ours_backend": backend,
        "jax_timing": jax_result.get("timing"), "jax_iters": jax_result.get("iters"),
        "jax_repeats": jax_result.get("repeats"),
        "jax_time_budget_s": jax_result.get("time_budget_s"),
        "torch_timing": torch_result.get("timing"),
        "torch_status": torch_result.get("status", "ran"),
        "torch_reason": torch_result.get("reason"),
        "jax_environment": jax_result["environment"],
        "torch_environment": torch_result.get("environment"),
    }
    for row in rows:  # Rows keep their own provenance: --append mixes runs in one file.
        row.update(timestamp=info["timestamp"], git_commit=info["git_commit"],
                   git_dirty=info["git_dirty"])
    runs = [run_info]
    if args.append and out.exists():
        previous = json.loads(out.read_text())
        mismatch = [key for key, value in
                    (("suite", suite.name), ("mode", args.mode), ("device", info["device"]))
                    if previous.get(key) != value]
        if mismatch:
            raise SystemExit(f"--append: {out} holds a different {', '.join(mismatch)}; "
                             "choose another --out")
        fresh = {_key(row) for row in rows}
        rows = [row for row in previous["rows"] if _key(row) not in fresh] + rows
        rows.sort(key=_suite_order)
        runs = previous.get("runs", []) + runs
        header.append(f"(--append: {len(rows)} rows in {out.name}, from {len(runs)} runs)")

    print()
    print(format_table(rows, header))
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {**info, "suite": suite.name, "mode": args.mode, "flop_convention": flop_note,
              "runs": runs, "rows": rows}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


def _suite_order(row):
    shapes = [shape.name for suite in suites.SUITES.values() for shape in suite.shapes]
    shapes += [shape.name for shape in suites.EXTRA_SHAPES]
    variants = [v.name for suite in suites.SUITES.values() for v in suite.variants]
    shape, variant = _key(row)
    return (shapes.index(shape) if shape in shapes else len(shapes), shape,
            variants.index(variant) if variant in variants else len(variants), variant)


if __name__ == "__main__":
    sys.exit(main())
