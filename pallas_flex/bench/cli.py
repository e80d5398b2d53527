"""`pallas-flex bench`: run suites side by side with their peers, print the tables and keep
the latest run per (GPU, suite) in `<out>/<gpu>/<suite>.json`; `pallas-flex bench report`
regenerates the Markdown from those files (see pallas_flex/bench/report.py)."""

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
import types
from pathlib import Path

from pallas_flex.bench import cases, machine_state, report

SUITES = {  # each suite and what it is compared with
    "forward": "cuDNN, tokamax (Mosaic GPU), PyTorch FlexAttention",
    "fwd_bwd": "cuDNN, tokamax, PyTorch FlexAttention",
    "score_mods": "the same causal call without the mod",
    "decode": "cuDNN, PyTorch FlexAttention, JAX's Pallas paged_attention",
    "paged": "the same call on a contiguous cache",
    "quantized": "the same paged decode on a bfloat16 cache", "ragged": "the op's XLA loop",
    "cascade": "pf.attention over concatenated caches", "memory": "-",
    "block_mask": "torch's create_block_mask", "compile": "- (seconds, per dtype)",
    "fuse": "the hand-written pf.attention call, XLA on the plain code",
    "variants": "sinks: the call without them; differential: two pf.attention calls, XLA; "
                "gated: XLA",
    "captured_gradients": "the same forward+backward without the captured array's "
                          "gradient",
    "latent": "the Triton decode on the same latent-attention call"}
TORCH_SUITES = ("forward", "fwd_bwd", "decode", "block_mask")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="pallas-flex bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark pallas_flex against its peers on this machine's first device.",
        epilog="suites and what each is compared with:\n" + "\n".join(
            f"  {name:11s} {peers}" for name, peers in SUITES.items()) +
        "\n\n`pallas-flex bench report [--check]` regenerates benchmarks/results/README.md "
        "and README.md's performance table from the results files.\nKernel inspection "
        "(registers, shared memory, spills) is a maintainer tool in a checkout: "
        "python -m benchmarks.inspect_kernels --help.")
    parser.add_argument("suites", nargs="*", default=["forward"], metavar="SUITE",
                        help=f"any of {', '.join(SUITES)} or all (default: forward)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes that a CPU runs in seconds (XLA backend there)")
    parser.add_argument("--shapes", help="forward/fwd_bwd/decode/variants: comma-separated "
                        "names or indices of the suite's shapes (default: all; variants: "
                        "all but its extra cases)")
    parser.add_argument("--variants", help="forward/fwd_bwd/decode: comma-separated names")
    parser.add_argument("--backend", help="ours on this backend (default: the device's best)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch FlexAttention")
    parser.add_argument("--iters", type=int, default=None,
                        help="calls a timed loop (default 20; 1 with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed loops an entry (default 5; 1 with --quick)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per suite and framework (default: none)")
    parser.add_argument("--out", help="results directory (default: benchmarks/results in a "
                        "checkout, nothing with --quick)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.suites = list(SUITES) if args.suites == ["all"] else args.suites
    for suite in args.suites:
        if suite not in SUITES:
            parser.error(f"unknown suite {suite!r}; choose from {', '.join(SUITES)} or all")
    return args


def _pick(spec, items, what, default=None):
    """The items named (or indexed) in a comma-separated `spec`; for None, `default` (all
    of them when not given)."""
    by_name = {item.name: item for item in items} | {str(i): x for i, x in enumerate(items)}
    for token in (spec or "").split(","):
        if token and token not in by_name:
            raise SystemExit(f"unknown {what} {token!r}; choose from "
                             f"{', '.join(item.name for item in items)}")
    if spec:
        return [by_name[token] for token in spec.split(",") if token]
    return list(items if default is None else default)


def suite_shapes(suite: str, spec, quick: bool) -> list:
    """The shapes (the variants suite: its cases) `suite` runs: those named in `spec`, else
    its default set, which leaves out what runs only when named (`extra` variant cases,
    `cases.EXTRA_ATTENTION_SHAPES`)."""
    if quick:
        return _pick(spec, {"decode": cases.QUICK_DECODE_SHAPES,
                            "variants": cases.QUICK_VARIANT_CASES}.get(
                                suite, cases.QUICK_ATTENTION_SHAPES), "shape")
    items, default = {
        "decode": (cases.DECODE_SHAPES, None),
        "variants": (cases.VARIANT_CASES,
                     [case for case in cases.VARIANT_CASES if not case.extra]),
    }.get(suite, (cases.ATTENTION_SHAPES + cases.EXTRA_ATTENTION_SHAPES,
                  cases.ATTENTION_SHAPES))
    return _pick(spec, items, "shape", default)


def run_child(args, suite: str) -> dict:
    """In the child process: one suite on the JAX side."""
    import jax

    import pallas_flex as pf
    from pallas_flex.bench import jax_suites

    decode = suite == "decode"
    shapes = suite_shapes(suite, args.shapes, args.quick)
    options = types.SimpleNamespace(
        quick=args.quick, backend=args.backend or pf.default_backend(), shapes=shapes,
        variants=_pick(args.variants, cases.DECODE_VARIANTS if decode else cases.VARIANTS,
                       "variant"),
        # --quick checks that every entry is timed, not how fast: one loop of one call.
        timing={"iters": args.iters or (1 if args.quick else 20),
                "repeats": args.repeats or (1 if args.quick else 5)})
    columns, metric, rows = jax_suites.SUITES[suite](options)
    versions = {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
                "pallas_flex": pf.__version__}
    return {"suite": suite, "device": jax.devices()[0].device_kind, "backend": options.backend,
            "versions": versions, "columns": columns, "metric": metric, "rows": rows}


def _subprocess(command, env, timeout):
    print("$ " + " ".join(command), flush=True)
    try:
        return subprocess.run(command, env={**os.environ, **env}, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout} s", flush=True)
        return None


def _with_torch(args, result, workdir: Path) -> None:
    """Adds a torch_flex entry to every row (timed, or why not) and compares outputs."""
    suite = result["suite"]
    if suite not in TORCH_SUITES:
        return
    result["columns"].append("torch_flex")
    reason = ("--no-torch" if args.no_torch else "torch is not installed"
              if importlib.util.find_spec("torch") is None else
              "no GPU" if result["backend"] != "pallas" else None)
    entries, status = {}, "n/a"
    if reason is None:
        case_file, out_file = workdir / f"{suite}-cases.json", workdir / f"{suite}-torch.json"
        case_file.write_text(json.dumps([[row["case"], row["params"]] for row in result["rows"]]))
        # torch owns the GPU in its process; JAX is imported there for the mods only.
        code = _subprocess([sys.executable, "-m", "pallas_flex.bench.torch_peer", suite,
                            str(case_file), str(out_file)], {"JAX_PLATFORMS": "cpu"},
                           args.timeout)
        if out_file.exists():
            torch_result = json.loads(out_file.read_text())
            result["versions"]["torch"] = torch_result["torch"]
            entries = torch_result["entries"]
        status = "timeout" if code is None else "error"
        reason = (f"not reached within --timeout {args.timeout:g} s" if code is None else
                  f"the torch process exited with {code} before this case")
    for row in result["rows"]:
        entry = entries.get(row["case"], {"status": status, "reason": reason})
        ours, theirs = row.pop("samples", None), entry.pop("samples", None)
        if ours and theirs:
            entry["max_rel_diff_vs_ours"] = max(
                max(abs(a - b) for a, b in zip(x, y)) / max(max(map(abs, y)), 1e-6)
                for x, y in zip(ours, theirs))
        row["torch_flex"] = entry


def _git(directory, *args, env=None):
    """git's output, stripped, or None where it failed."""
    result = subprocess.run(["git", "-C", str(directory), *args], capture_output=True,
                            text=True, env={**os.environ, **(env or {})})
    return result.stdout.strip() if result.returncode == 0 else None


def git_provenance(directory=None) -> dict:
    """{git_commit, git_tree} of the checkout holding `directory` (default: this
    package's, so the library that ran, not the caller's working directory; None for
    both outside a checkout, as a pip install is): its HEAD and the tree of the files
    the run used (tracked and untracked, less the ignored), hashed through a scratch
    index. A copy of a working tree can carry a stale HEAD (the device tool's did): its
    git_tree still equals `git rev-parse --short COMMIT^{tree}` of the commit whose files
    ran (`git log --format='%h %t'` finds it)."""
    directory = directory or Path(__file__).resolve().parent
    commit = _git(directory, "rev-parse", "--short", "HEAD") or None
    tree = None
    with tempfile.TemporaryDirectory() as scratch:
        env = {"GIT_INDEX_FILE": os.path.join(scratch, "index")}
        if (commit is not None and _git(directory, "read-tree", "HEAD", env=env) is not None
                and _git(directory, "add", "-A", env=env) is not None):
            tree = (_git(directory, "write-tree", env=env) or "")[:7] or None
    return {"git_commit": commit, "git_tree": tree}


def gpu_name(device_kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu' -> 'cpu'."""
    model = re.search(r"\b[a-z]+\d+[a-z]*\b", device_kind.lower())
    return model.group(0) if model else re.sub(r"[^a-z0-9]+", "-", device_kind.lower())


MACHINES_KEPT = 8  # machine snapshots a results file keeps, the newest last


def write(out: Path, result: dict) -> Path:
    """Into out/<gpu>/<suite>.json, replacing the rows of the cases run (in parts, maybe)."""
    path = out / gpu_name(result["device"]) / f"{result['suite']}.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("device") == result["device"]:
            fresh = {row["case"] for row in result["rows"]}
            result["rows"] = [r for r in old["rows"] if r["case"] not in fresh] + result["rows"]
            result["commands"] = list(dict.fromkeys(old.get("commands", []) +
                                                    result["commands"]))
            # The machine of every run whose rows the file holds (the last few).
            result["machines"] = (old.get("machines", [])
                                  + result.get("machines", []))[-MACHINES_KEPT:]
            result["columns"] = list(dict.fromkeys(old["columns"] + result["columns"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        return report.main(argv[1:])
    args = parse_args(argv)
    if args.child:
        result = run_child(args, args.suites[0])
        Path(args.child).write_text(json.dumps(result))
        return 0
    out = Path(args.out) if args.out else (
        None if args.quick or not Path("benchmarks/results").is_dir()
        else Path("benchmarks/results"))
    command = "pallas-flex bench " + " ".join(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as workdir:
        for suite in args.suites:
            child_out = Path(workdir) / f"{suite}.json"
            options = [a for a in argv if a not in SUITES and a != "all"]
            before = machine_state.snapshot()
            _subprocess([sys.executable, "-m", "pallas_flex.bench.cli", suite, *options,
                         "--child", str(child_out)],
                {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, args.timeout)
            if not child_out.exists():
                print(f"{suite}: the JAX process wrote no result", flush=True)
                failed += 1
                continue
            result = json.loads(child_out.read_text())
            # The machine just after the JAX process, before torch's: what it timed on.
            after = machine_state.snapshot()
            _with_torch(args, result, Path(workdir))
            date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            result.update(date=date, **git_provenance(), commands=[command],
                          machines=[{"date": date, "command": command, "before": before,
                                     "after": after}])
            print("\n".join(report.table(result)) + "\n", flush=True)
            if out is not None:
                print(f"wrote {write(out, result)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
