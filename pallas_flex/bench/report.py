"""Markdown (and a plot) from the results files, so no figure is typed by hand:
`pallas-flex bench report [--check]` writes `<results>/README.md` (every suite of every
GPU) and the README's table between its performance-table markers (`--check`: only say
whether both are up to date; tests/test_bench.py runs it)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

START, END = "<!-- performance-table:start -->", "<!-- performance-table:end -->"
MAIN_GPU, MAIN_SHAPE = "h100", "b4_s4096_d128"
UNITS = {"ms": "ms", "s": "s", "peak_mib": "MiB"}
LEGENDS = {  # what a suite's columns are, where their names do not say it
    "variants": "pallas_flex: the call with sinks, or pf.variants' function; no_sinks: the "
                "same call without sinks; two_calls: two pf.attention calls combined by hand; "
                "xla_plain: XLA on the plain-JAX formulation. Ratios: a column's time over "
                "pallas_flex's (> 1: pallas_flex is faster); a decode row is ms per step.",
    "captured_gradients": "pallas_flex: forward+backward with the gradients of q, k, v and "
                          "the captured array; no_table_gradient: the same call with those "
                          "of q, k, v alone. A ratio below 1 is what the array's gradient "
                          "costs."}
ACCURACY = {  # entry keys an accuracy table shows (the `quantized` suite's)
    "max_abs_error_vs_float64": "max abs error vs float64",
    "max_abs_diff_vs_bf16": "max abs diff vs bf16's output"}


def load(results_dir) -> list[dict]:
    """Every `<gpu>/<suite>.json` under results_dir, each with its `gpu` and `path`."""
    return [{**json.loads(path.read_text()), "gpu": path.parent.name, "path": str(path)}
            for path in sorted(Path(results_dir).glob("*/*.json"))]


def value(entry, metric):
    return entry.get(metric) if isinstance(entry, dict) else None


def _number(x) -> str:
    return "–" if x is None else f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def _cell(entry, metric) -> str:
    status = (entry or {}).get("status", "–")
    return _number(value(entry, metric)) if value(entry, metric) is not None else (
        "–" if status == "inexpressible" else status)


def ratio(row, column, ours, metric):
    a, b = value(row.get(column), metric), value(row.get(ours), metric)
    return a / b if a is not None and b else None


def _provenance(result) -> str:
    """'commit C' or 'commit C (tree T)': the tree of the files that ran
    (`cli.git_provenance`; a copied checkout's HEAD may be stale)."""
    tree = result.get("git_tree")
    return f"commit {result.get('git_commit')}" + (f" (tree {tree})" if tree else "")


def machine_line(result) -> str | None:
    """The machine of the file's newest run, as the JAX process left it
    (`machine_state.snapshot`): GPU clocks against their maxima, power, temperature,
    throttle reasons, and the host's load; None where the file has none."""
    machines = result.get("machines") or []
    if not machines:
        return None
    state = machines[-1].get("after") or machines[-1].get("before") or {}
    parts = []
    for gpu in state.get("gpus", [])[:1]:  # the benchmarks run on the first GPU
        parts.append(f"GPU {gpu.get('index')}: SM {gpu.get('clocks.sm')}/"
                     f"{gpu.get('clocks.max.sm')} MHz, memory {gpu.get('clocks.mem')}/"
                     f"{gpu.get('clocks.max.mem')} MHz, {gpu.get('power.draw')}/"
                     f"{gpu.get('power.limit')} W, {gpu.get('temperature.gpu')} C, "
                     f"{gpu.get('pstate')}, clock event reasons "
                     f"{gpu.get('clock_event_reasons', 'n/a')}")
    if state.get("load_average"):
        parts.append(f"host load {state['load_average'][0]} on {state.get('cpus')} CPUs")
    return f"Machine after the run: {'; '.join(parts)}." if parts else None


def table(result: dict) -> list[str]:
    """One results file as a Markdown table: each column's value, then, for timings, each
    peer's time over ours (> 1: ours is faster) and ours' TFLOP/s or TB/s (every column's
    TB/s where each entry counts its own bytes: quantized caches), the entries'
    accuracy (ACCURACY) in a second table, and each row's acceptance criterion, if it has
    one (the multi-GPU suite: its own tables)."""
    if result["suite"] == "multi_device":
        return multi_device_table(result)
    columns, metric = result["columns"], result["metric"]
    ours, peers = columns[0], columns[1:]
    ratios = metric == "ms" and peers
    rows = result["rows"]
    rate = next((key for key in ("bytes", "flops") if metric == "ms" and rows
                 and key in rows[0]["params"]), None)
    header = ["case"] + [f"{c} ({UNITS[metric]})" for c in columns]
    header += [f"{c} / {ours}" for c in peers] if ratios else []
    own_bytes = rate == "bytes" and any(isinstance(row.get(c), dict) and "bytes" in row[c]
                                        for row in rows for c in columns)
    header += ([f"TB/s {c}" for c in columns] if own_bytes else
               [{"flops": "TFLOP/s", "bytes": "TB/s"}[rate]] if rate else [])
    lines = [f"### {result['suite']} — {result['device']}",
             "", f"{result['date']}, {_provenance(result)}, "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
             + f"; `{'`, `'.join(result['commands'])}`", ""]
    machine = machine_line(result)
    lines += [machine, ""] if machine else []
    lines += [LEGENDS[result["suite"]], ""] if result["suite"] in LEGENDS else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for row in rows:
        cells = [row["case"]] + [_cell(row.get(c), metric) for c in columns]
        if ratios:
            cells += [_number(ratio(row, c, ours, metric)) + ("×" if ratio(row, c, ours, metric)
                                                              else "") for c in peers]
        if own_bytes:
            cells += [_number(value(row.get(c), "bytes") / value(row.get(c), metric) / 1e9
                              if value(row.get(c), "bytes") and value(row.get(c), metric)
                              else None) for c in columns]
        elif rate:
            ms, amount = value(row.get(ours), metric), row["params"].get(rate)
            cells.append(_number(amount / ms / 1e9 if ms and amount else None))
        lines.append("| " + " | ".join(cells) + " |")
        notes += [f"- {row['case']}, {c}: {row[c]['reason'][:200]}" for c in columns
                  if isinstance(row.get(c), dict) and row[c].get("status") in
                  ("error", "unsupported", "timeout")]
        # A row the code has since moved away from keeps its figures until re-measured,
        # with a "stale" note saying what changed.
        notes += [f"- {row['case']}: stale: {row['stale']}"] if row.get("stale") else []
    accepted = [f"- {row['case']}: {row['acceptance']['criterion']}: "
                f"{row['acceptance']['value']:.3g} "
                f"({'met' if row['acceptance']['met'] else 'NOT met'})"
                for row in rows if "acceptance" in row]
    return (lines + accuracy_table(result) + ([""] + accepted if accepted else [])
            + ([""] + notes if notes else []))


def accuracy_table(result: dict) -> list[str]:
    """Each ACCURACY key the entries carry, per column, and the rows' reference notes."""
    rows, columns = result["rows"], result["columns"]
    shown = [(key, c) for key in ACCURACY for c in columns
             if any(value(row.get(c), key) is not None for row in rows)]
    if not shown:
        return []
    header = ["case"] + [f"{ACCURACY[key]}: {c}" for key, c in shown]
    lines = ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join([row["case"]] + [
            "–" if value(row.get(c), key) is None else f"{value(row.get(c), key):.2e}"
            for key, c in shown]) + " |")
    references = dict.fromkeys(row["params"]["reference"] for row in rows
                               if "reference" in row["params"])
    return lines + ([""] + [f"- reference: {r}" for r in references] if references else [])


def multi_device_table(result: dict) -> list[str]:
    """The multi-GPU suite (pallas_flex/bench/multi_device.py): one table per part."""
    rows = result["rows"]
    lines = [f"### multi_device — {result['device']}, machines of up to "
             f"{result['device_count']} (each row: its device count N)", "",
             f"{result['date']}, {_provenance(result)}, "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
             + f"; `{result['command']}` (and runs of its parts)", ""]

    def gib(row):
        size = row.get("memory_per_device_bytes")
        return _number(size / 2 ** 30) if size else "–"
    parts = {
        "correctness": (["case", "status", "largest |difference| / largest |value|: out, "
                         "lse, dq, dk, dv"],
                        lambda r: [r.get("status", "–"), ", ".join(
                            f"{x:.1e}" for x in r.get("max_diff_over_max", {}).values())]),
        "sharding": (["case", "status", "ms", "speedup vs 1 device", "collectives in HLO",
                      "GiB / device"],
                     lambda r: [r.get("status", "–"), _number(r.get("ms")),
                                _number(r.get("speedup_vs_one_device")),
                                str(sum(r.get("collectives", {}).values())), gib(r)]),
        "scaling": (["case", "status", "ms", "TFLOP/s per device", "efficiency vs 1 device",
                     "GiB / device"],
                    lambda r: [r.get("status", "–"), _number(r.get("ms")),
                               _number(r.get("tflops_per_device")),
                               _number(r.get("efficiency_vs_one_device")), gib(r)])}
    for part, (header, cells) in parts.items():
        chosen = [r for r in rows if r["case"].startswith(part + "/")]
        if chosen:
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join([r["case"]] + cells(r)) + " |" for r in chosen] + [""]
    return lines


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def readme_table(results: list[dict]) -> list[str]:
    """README's table: forward and forward+backward at B4 H16 S4096 D128 on the main GPU."""
    results = [r for r in results if r["suite"] != "multi_device"]
    on_main = [r for r in results if r["gpu"] == MAIN_GPU] or results
    if not on_main:
        return ["No results yet: `pallas-flex bench all` on a GPU, then "
                "`pallas-flex bench report`."]
    by_suite = {r["suite"]: r for r in on_main}
    lines = [f"{on_main[0]['device']}, bf16; time of a peer / time of pallas_flex "
             "(> 1: pallas_flex is faster); – : the peer cannot express it.", ""]
    modes = [by_suite[s] for s in ("forward", "fwd_bwd") if s in by_suite]
    if modes:
        lines += ["| B4 H16 S4096 D128 | " + " | ".join(
            f"{m['suite']} ms | torch / ours | cuDNN / ours | tokamax / ours" for m in modes)
                  + " |", "|---|" + "---|---|---|---|" * len(modes)]
        rows = {m["suite"]: {r["params"]["variant"]: r for r in m["rows"]
                             if r["params"].get("shape") == MAIN_SHAPE} for m in modes}
        for variant in dict.fromkeys(v for m in rows.values() for v in m):
            cells = [variant]
            for m in modes:
                row = rows[m["suite"]].get(variant, {})
                cells += [_cell(row.get("pallas_flex"), "ms")] + [
                    _number(ratio(row, c, "pallas_flex", "ms"))
                    for c in ("torch_flex", "cudnn", "tokamax")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def results_readme(results: list[dict]) -> str:
    parts = ["# Benchmark results", "",
             "Generated by `pallas-flex bench report` from the JSON files beside it (one per "
             "GPU and suite: the latest run, with device, versions, date and command). Do not "
             "edit by hand. Entries: the median of timed loops (ms; where a row times several JAX "
             "implementations, the median of rounds that run each of them once in turn, as "
             "the clock drifts under load), first-call seconds (s) or the peak device memory "
             "(MiB); a peer's `– ` means it cannot express the case.", ""]
    parts += ["| GPU | suite | cases | peer / ours (geometric mean over the cases both ran) |",
              "|---|---|---|---|"]
    multi = [r for r in results if r["suite"] == "multi_device"]
    results = [r for r in results if r["suite"] != "multi_device"]
    for result in results:
        ours = result["columns"][0]
        means = [f"{c} {_number(geomean(ratio(r, c, ours, 'ms') for r in result['rows']))}×"
                 for c in result["columns"][1:] if result["metric"] == "ms"]
        parts.append(f"| {result['gpu']} | {result['suite']} | {len(result['rows'])} | "
                     f"{', '.join(means) or '(no peer: see its table)'} |")
    parts.append("")
    for result in multi:
        parts.append(f"| {result['gpu']} x{result['device_count']} | multi_device | "
                     f"{len(result['rows'])} | (against one device: see its table) |")
    parts.append("")
    for result in results:
        parts += table(result) + [""]
    for result in multi:
        parts += table(result)
    return "\n".join(parts)


def with_readme_table(readme: str, results: list[dict]) -> str:
    if START not in readme or END not in readme:
        raise ValueError(f"the README has no {START} ... {END} block")
    head, rest = readme.split(START, 1)
    return head + START + "\n" + "\n".join(readme_table(results)) + "\n" + END + \
        rest.split(END, 1)[1]


def plot(results: list[dict], path=None):
    """Bars of ours and each peer per case, one panel per timed suite of the main GPU."""
    import matplotlib.pyplot as plt

    gpu = MAIN_GPU if any(r["gpu"] == MAIN_GPU for r in results) else results[0]["gpu"]
    timed = [r for r in results if r["gpu"] == gpu and r.get("metric") == "ms"]
    figure, axes = plt.subplots(len(timed), 1, figsize=(12, 3.2 * len(timed)), squeeze=False)
    for ax, result in zip(axes[:, 0], timed):
        width, rows = 0.8 / len(result["columns"]), result["rows"]
        for i, column in enumerate(result["columns"]):
            ax.bar([j + i * width for j in range(len(rows))],
                   [value(row.get(column), "ms") or 0 for row in rows], width, label=column)
        ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=30, ha="right",
                      fontsize=7)
        ax.set(ylabel="ms", title=f"{result['suite']} ({result['device']})")
        ax.legend(fontsize=7)
    figure.tight_layout()
    if path:
        figure.savefig(path, dpi=110)
    return figure


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pallas-flex bench report", description=__doc__)
    parser.add_argument("--results", default="benchmarks/results")
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--plot", help="also save a plot of the main GPU's timings here")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the generated files differ from what is there")
    args = parser.parse_args(argv)
    results = load(args.results)
    readme = Path(args.readme)
    targets = {Path(args.results) / "README.md": results_readme(results),
               readme: with_readme_table(readme.read_text(), results)}
    stale = [str(p) for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if args.check:
        print("out of date: " + ", ".join(stale) if stale else "up to date")
        return 1 if stale else 0
    for path, text in targets.items():
        path.write_text(text)
    if args.plot:
        plot(results, args.plot)
    print(f"wrote {', '.join(map(str, targets))} from {len(results)} results files")
    return 0
