"""The benchmark harness (pallas_flex/bench): its cases, its tables, the README's
performance table against the committed results, and `pallas-flex bench --quick` from a
plain install of the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex.bench import cases, cli, jax_suites, report

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("shape", [cases.Shape("s", 1, 4, 2, 300, 32),
                                   cases.Shape("decode", 1, 4, 2, 300, 32, q_len=1),
                                   cases.Shape("few", 1, 4, 2, 300, 32, q_len=37)],
                         ids=lambda shape: shape.name)
@pytest.mark.parametrize("variant", cases.VARIANTS, ids=lambda variant: variant.name)
def test_analytic_densities_match_the_mods(shape, variant):
    """The FLOP count's exact per-row key counts equal the mask_mod evaluated element by
    element (queries at the end of the keys), for the mods the suites time."""
    variant = cases.Variant(variant.name, variant.mask, variant.score, window=50,
                            prefix=70, documents=5)
    mask_mod, _ = jax_suites.mods(variant, shape)
    q = jnp.arange(shape.queries)[:, None]
    kv = jnp.arange(shape.seq_len)[None, :]
    dense = (np.ones((shape.queries, shape.seq_len), bool) if mask_mod is None
             else np.asarray(jax.vmap(jax.vmap(mask_mod, (None, None, None, 0)),
                                      (None, None, 0, None))(0, 0, q[:, 0], kv[0])))
    np.testing.assert_array_equal(dense.sum(axis=1), cases.allowed_keys(variant, shape))
    expected = 4.0 * shape.q_heads * shape.head_dim * dense.sum()
    assert cases.flops(variant, shape, "fwd") == pytest.approx(expected)
    assert cases.flops(variant, shape, "fwd_bwd") == pytest.approx(3.5 * expected)


def test_alibi_slopes_are_the_standard_ones():
    """The suites' ALiBi slopes are pf.scores.alibi_slopes (one definition for both)."""
    np.testing.assert_allclose(pf.scores.alibi_slopes(8), [2.0 ** -(h + 1) for h in range(8)])
    assert len(pf.scores.alibi_slopes(12)) == 12


def test_gpu_names():
    assert cli.gpu_name("NVIDIA H100 80GB HBM3") == "h100"
    assert cli.gpu_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert cli.gpu_name("Tesla T4") == "t4"
    assert cli.gpu_name("cpu") == "cpu"


def _result(rows, **extra):
    return {"suite": "forward", "device": "NVIDIA H100 80GB HBM3", "metric": "ms",
            "columns": ["pallas_flex", "cudnn", "torch_flex"], "date": "2026-11-24",
            "git_commit": "abc", "versions": {"jax": "0.11.2"}, "commands": ["x"],
            "rows": rows, **extra}


def _row(variant, ours, cudnn, torch, shape="b4_s4096_d128"):
    return {"case": f"{shape} {variant}", "params": {"shape": shape, "variant": variant,
                                                     "flops": 2e9},
            "pallas_flex": {"ms": ours}, "cudnn": cudnn if isinstance(cudnn, dict) else
            {"ms": cudnn}, "torch_flex": {"ms": torch}}


def test_a_table_gives_values_ratios_statuses_and_failures():
    result = _result([_row("causal", 2.0, 3.0, 5.0),
                      _row("alibi", 4.0, {"status": "inexpressible", "reason": "r"}, 2.0),
                      _row("softcap", 1.0, {"status": "unsupported", "reason": "boom"}, 1.0)])
    lines = report.table(result)
    assert "| b4_s4096_d128 causal | 2 | 3 | 5 | 1.5× | 2.5× | 1 |" in lines
    assert "| b4_s4096_d128 alibi | 4 | – | 2 | – | 0.5× | 0.5 |" in lines
    assert "| b4_s4096_d128 softcap | 1 | unsupported | 1 | – | 1× | 2 |" in lines
    assert "- b4_s4096_d128 softcap, cudnn: boom" in lines
    stale = _row("noop", 1.0, 1.0, 1.0)
    stale["stale"] = "measured before the kernel changed"
    assert ("- b4_s4096_d128 noop: stale: measured before the kernel changed"
            in report.table(_result([stale])))


def test_a_quantized_table_gives_each_columns_tb_per_s_and_accuracy():
    """Entries that count their own bytes (8-bit caches read fewer) get a TB/s each, and
    accuracy keys a second table, with the reference the row names."""
    entry = {"ms": 0.1, "bytes": 2.5e8, "max_abs_error_vs_float64": 1e-3,
             "max_abs_diff_vs_bf16": 2e-2}
    result = _result([{"case": "b8 page_16", "params": {"bytes": 5e8, "reference": "row 0"},
                       "bf16": {"ms": 0.2, "bytes": 5e8, "max_abs_error_vs_float64": 5e-4},
                       "int8": entry, "float8_e4m3fn": {"status": "error", "reason": "boom"}}],
                     suite="quantized", columns=["bf16", "int8", "float8_e4m3fn"])
    lines = report.table(result)
    assert "| b8 page_16 | 0.2 | 0.1 | error | 0.5× | – | 2.5 | 2.5 | – |" in lines
    assert ("| case | max abs error vs float64: bf16 | max abs error vs float64: int8 | "
            "max abs diff vs bf16's output: int8 |") in lines
    assert "| b8 page_16 | 5.00e-04 | 1.00e-03 | 2.00e-02 |" in lines
    assert "- reference: row 0" in lines and "- b8 page_16, float8_e4m3fn: boom" in lines


def test_write_keeps_the_other_cases_of_a_suite_run_in_parts(tmp_path):
    first = _result([_row("causal", 2.0, 3.0, 5.0), _row("alibi", 4.0, 3.0, 2.0)],
                    commands=["first"])
    cli.write(tmp_path, first)
    path = cli.write(tmp_path, _result([_row("alibi", 1.0, 1.0, 1.0)], commands=["second"]))
    assert path == tmp_path / "h100" / "forward.json"
    written = json.loads(path.read_text())
    assert [(row["case"], row["pallas_flex"]["ms"]) for row in written["rows"]] == [
        ("b4_s4096_d128 causal", 2.0), ("b4_s4096_d128 alibi", 1.0)]
    assert written["commands"] == ["first", "second"]
    # Files written before machines were recorded have none; later runs' are kept, the
    # newest last, MACHINES_KEPT of them.
    assert written["machines"] == []
    for run in range(cli.MACHINES_KEPT + 1):
        cli.write(tmp_path, _result([_row("alibi", 1.0, 1.0, 1.0)], commands=["again"],
                                    machines=[{"date": str(run)}]))
    written = json.loads(path.read_text())
    assert [m["date"] for m in written["machines"]] == [
        str(run) for run in range(1, cli.MACHINES_KEPT + 1)]


def test_the_readme_table_is_generated_into_its_markers(tmp_path):
    (tmp_path / "h100").mkdir()
    result = _result([_row("causal", 2.0, 3.0, 5.0), _row("causal", 9.0, 9.0, 9.0, "other")])
    (tmp_path / "h100" / "forward.json").write_text(json.dumps(result))
    readme = f"intro\n{report.START}\nstale\n{report.END}\nrest\n"
    text = report.with_readme_table(readme, report.load(tmp_path))
    assert text.startswith("intro\n") and text.endswith(f"{report.END}\nrest\n")
    assert "stale" not in text
    assert "| causal | 2 | 2.5 | 1.5 |" in text  # the main shape only
    summary = report.results_readme(report.load(tmp_path))
    assert "| h100 | forward | 2 | cudnn 1.22×, torch_flex 1.58× |" in summary
    with pytest.raises(ValueError, match="performance-table"):
        report.with_readme_table("no markers", [])


def test_the_committed_tables_match_the_committed_results(monkeypatch, capsys):
    """README.md's performance table and benchmarks/results/README.md are what
    `pallas-flex bench report` makes of the results files: no figure typed by hand."""
    monkeypatch.chdir(REPO_ROOT)
    assert report.main(["--check"]) == 0, capsys.readouterr().out
    results = report.load(REPO_ROOT / "benchmarks" / "results")
    # The multi-GPU suite is its own module (`pallas_flex.bench.multi_device`), not a
    # `pallas-flex bench` suite of one GPU; it has H100 rows when the tool gave H100s.
    on_h100 = {r["suite"] for r in results if r["gpu"] == "h100"} - {"multi_device"}
    assert on_h100 <= set(cli.SUITES)
    # Every suite measured on the H100, but a suite added in a session with no device time
    # left, named here until its first run (which must then remove it).
    not_yet = set()
    assert not (not_yet & on_h100), "measured now: take it out of not_yet"
    assert on_h100 == set(cli.SUITES) - not_yet
    for result in results:
        keys = (("device", "device_count", "date", "versions", "command", "rows")
                if result["suite"] == "multi_device" else
                ("device", "date", "versions", "commands", "columns", "metric", "rows"))
        for key in keys:
            assert result[key], (result["path"], key)


def test_the_multi_device_suite_runs_on_host_devices(tmp_path):
    """pallas_flex/bench/multi_device.py on the four host devices (XLA backend, tiny
    shapes): its correctness check passes (under a shard_map that checks varying axes),
    the sharded calls hold no collective (on 1 and 2 devices: 4 would compile the same
    properties twice more), every row is measured, and the report renders its tables."""
    from pallas_flex.bench import multi_device
    assert multi_device.main(["--quick", "--parts", "correctness,sharding,scaling",
                              "--strategies", "ring", "--masks", "causal", "--check-vma",
                              "--scaling-devices", "2", "--sharding-devices", "1,2",
                              "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu" / "multi_device.json").read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert {case.split("/")[0] for case in rows} == {"correctness", "sharding", "scaling"}
    assert {row["devices"] for case, row in rows.items() if case.startswith("sharding/")} == {1, 2}
    for case, row in rows.items():
        if case.startswith("sharding/"):
            assert sum(row["collectives"].values()) == 0, row
        if case.startswith("scaling/ring"):
            assert row["efficiency_vs_one_device"] > 0 and row["memory_per_device_bytes"]
    text = "\n".join(report.multi_device_table({**result, "gpu": "cpu"}))
    assert "scaling/ring/causal/S256/N2" in text and "correctness/ring" in text
    assert rows["scaling/ring/causal/S256/N2"]["head_chunks"] == 1


def test_quick_runs_a_suite_end_to_end(tmp_path):
    """The CLI as a user runs it: a JAX process per suite, the torch peer reported as not
    run (no GPU), a results file under <out>/cpu/. One timed loop of one call per column
    (`--iters 1 --repeats 1`): the entries are still timed, in a third of the time."""
    assert cli.main(["cascade", "--quick", "--iters", "1", "--repeats", "1", "--out",
                     str(tmp_path)]) == 0
    written = json.loads((tmp_path / "cpu" / "cascade.json").read_text())
    assert [row["case"] for row in written["rows"]] == ["b4_p512_l64 full",
                                                        "b4_p512_l64 ragged"]
    for row in written["rows"]:
        assert row["cascade"]["ms"] > 0
        assert row["concatenated"]["max_rel_diff_vs_ours"] < 2e-2
    # The machine it ran on, before and after the JAX process (no GPU here).
    (machine,) = written["machines"]
    assert machine["command"] == written["commands"][0] and machine["date"] == written["date"]
    for state in (machine["before"], machine["after"]):
        assert state["gpus"] == [] and state["cpus"] == os.cpu_count()
        assert len(state["load_average"]) == 3


FAKE_NVIDIA_SMI = """#!/bin/sh
# Refuses the newer name of the throttle reasons, as a driver before 535 does.
case "$1" in *clocks_event_reasons*) echo 'Field "clocks_event_reasons.active" is not a valid field to query.'; exit 2;; esac
echo "0, NVIDIA H100 80GB HBM3, 570.86, P0, 1755, 1980, 2619, 2619, 312.45, 700.00, 51, 100, 0x0000000000000004"
echo "1, NVIDIA H100 80GB HBM3, 570.86, P8, 345, 1980, 2619, 2619, 70.10, 700.00, 33, 0, 0x0000000000000001"
"""


def test_the_machine_state_reads_nvidia_smi_and_the_report_shows_it(tmp_path):
    """`machine_state.gpus` parses nvidia-smi's CSV per GPU (numbers as numbers), falls
    back to the older name of the clock-event reasons, and gives [] where nvidia-smi is
    missing or fails; the report's line shows the newest run's first GPU and host load."""
    from pallas_flex.bench import machine_state
    fake = tmp_path / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    first, second = machine_state.gpus(str(fake))
    assert first == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "driver_version": "570.86",
                     "pstate": "P0", "clocks.sm": 1755, "clocks.max.sm": 1980,
                     "clocks.mem": 2619, "clocks.max.mem": 2619, "power.draw": 312.45,
                     "power.limit": 700.0, "temperature.gpu": 51, "utilization.gpu": 100,
                     "clock_event_reasons": "0x0000000000000004"}
    assert second["pstate"] == "P8" and second["clocks.sm"] == 345
    broken = tmp_path / "broken-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    broken.chmod(0o755)
    assert machine_state.gpus(str(broken)) == []
    assert machine_state.gpus(str(tmp_path / "absent")) == []
    state = machine_state.snapshot(str(fake))
    result = {"machines": [{"after": {"gpus": [], "load_average": None, "cpus": 2}},
                           {"after": state}]}
    line = report.machine_line(result)
    assert line.startswith("Machine after the run: GPU 0: SM 1755/1980 MHz, memory "
                           "2619/2619 MHz, 312.45/700.0 W, 51 C, P0, clock event reasons "
                           "0x0000000000000004; host load "), line
    assert report.machine_line({}) is None


def test_quick_runs_the_quantized_suite(tmp_path):
    """`pallas-flex bench quantized --quick`: int8 and float8 pages against bf16 ones,
    each entry with its stored bytes (values plus two float32 scales per token and head),
    its error against the float64 reference on the dequantized values (as small as
    bf16's: the kernels add no error of their own) and its distance from bf16's output."""
    assert cli.main(["quantized", "--quick", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "cpu" / "quantized.json").read_text())
    assert written["columns"] == ["bf16", "int8", "float8_e4m3fn", "int8_in_kernel",
                                  "float8_e4m3fn_in_kernel"]
    assert [row["case"] for row in written["rows"]] == [
        "tiny_b2_s512 page_16", "tiny_b2_s512 contiguous", "tiny_b1_s2048 page_16",
        "tiny_b1_s2048 contiguous", "prefill_b1_new64_of256 page_16"]
    *decode_rows, prefill = written["rows"]
    contiguous = [row for row in decode_rows if row["case"].endswith("contiguous")]
    decode_rows = [row for row in decode_rows if row not in contiguous]
    # Contiguous 8-bit K/V with their scales (pf.flex_attention's k_scales, v_scales).
    for row in contiguous:
        tokens_heads = row["params"]["batch"] * row["params"]["seq_len"] * row["params"][
            "kv_heads"]
        assert row["bf16"]["bytes"] == tokens_heads * 2 * 64 * 2
        for column, loss in (("int8", 0.05), ("float8_e4m3fn", 0.15)):
            assert row[column]["bytes"] == tokens_heads * (2 * 64 + 8)
            assert 0 < row[column]["max_abs_diff_vs_bf16"] < loss
    # The prefill row: the 8-bit pages read dequantized first and in the kernel's tiles.
    for column, loss in (("int8", 0.05), ("float8_e4m3fn", 0.15)):
        for way in (column, f"{column}_in_kernel"):
            entry = prefill[way]
            assert entry["speedup_vs_bf16"] == pytest.approx(prefill["bf16"]["ms"] / entry["ms"])
            assert 0 < entry["max_abs_diff_vs_bf16"] < loss
    for row in decode_rows:
        params = row["params"]
        tokens_heads = params["batch"] * params["seq_len"] * params["kv_heads"]
        assert row["bf16"]["bytes"] == params["bytes"] == tokens_heads * 2 * 64 * 2
        assert row["bf16"]["max_abs_error_vs_float64"] < 2e-3
        for column, loss in (("int8", 0.05), ("float8_e4m3fn", 0.15)):
            entry = row[column]
            assert entry["bytes"] == tokens_heads * (2 * 64 + 8)
            assert entry["tb_per_s"] == pytest.approx(entry["bytes"] / entry["ms"] / 1e9)
            assert entry["speedup_vs_bf16"] == pytest.approx(row["bf16"]["ms"] / entry["ms"])
            assert entry["max_abs_error_vs_float64"] < 2e-3
            assert 0 < entry["max_abs_diff_vs_bf16"] < loss
    assert "reference" in written["rows"][0]["params"]
    text = "\n".join(report.table(written))
    assert "TB/s float8_e4m3fn" in text and "max abs diff vs bf16's output: int8" in text


def test_quick_runs_the_latent_suite(tmp_path):
    """`pallas-flex bench latent --quick`: the Mosaic GPU latent decode (in interpret mode
    on a CPU, narrow heads) against the Triton decode on the same chained steps, on a
    contiguous cache, on the same tokens in shuffled pages and on one latent array whose
    first Dv columns are the values (`value_dim`), each entry with its bytes' TB/s and
    TFLOP/s, and every other column's distance from the contiguous Triton column's
    output."""
    assert cli.main(["latent", "--quick", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "cpu" / "latent.json").read_text())
    columns = ["mosaic", "mosaic_paged", "mosaic_latent", "mosaic_latent_paged", "triton",
               "triton_paged"]
    assert written["columns"] == columns
    assert [row["case"] for row in written["rows"]] == ["tiny_b1_s176"]
    for row in written["rows"]:
        params = row["params"]
        assert params["bytes"] == params["batch"] * params["seq_len"] * (128 + 128) * 2
        assert params["page_size"] == 16
        for column in columns:
            entry = row[column]
            # The latent array holds D columns a token (the values among them).
            read = params["bytes"] // 2 if "latent" in column else params["bytes"]
            assert entry["tb_per_s"] == pytest.approx(read / entry["ms"] / 1e9)
            assert entry["tflop_per_s"] == pytest.approx(params["flops"] / entry["ms"] / 1e9)
        for column in ("mosaic", "mosaic_paged", "mosaic_latent", "mosaic_latent_paged",
                       "triton_paged"):
            assert 0 <= row[column]["max_abs_diff_vs_triton"] < 2e-2
        for column, peer in (("mosaic", "triton"), ("mosaic_paged", "triton_paged")):
            assert row[column]["speedup_vs_triton"] == pytest.approx(
                row[peer]["ms"] / row[column]["ms"])


def test_quick_runs_the_variants_suite(tmp_path):
    """`pallas-flex bench variants --quick`: sinks (forward, forward+backward, decode steps)
    against the same calls without them, differential attention against two pf.attention
    calls and XLA on the paper's code, gated attention against XLA on AlphaFold's; every
    entry timed in paired rounds, the outputs agreeing, each row's acceptance criterion
    recorded and rendered."""
    assert cli.main(["variants", "--quick", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "cpu" / "variants.json").read_text())
    assert written["columns"] == ["pallas_flex", "no_sinks", "two_calls", "xla_plain"]
    peers = {"sinks tiny_s256 fwd": ["no_sinks"], "sinks tiny_s256 fwd_bwd": ["no_sinks"],
             "sinks tiny_decode step": ["no_sinks"],
             "differential tiny_s256 fwd_bwd": ["two_calls", "xla_plain"],
             "gated r8_s64_h2_d32 fwd": ["xla_plain"],
             "gated r8_s64_h2_d32 fwd_bwd": ["xla_plain"]}
    assert [row["case"] for row in written["rows"]] == list(peers)
    for row in written["rows"]:
        present = [c for c in written["columns"] if c in row]
        assert present == ["pallas_flex"] + peers[row["case"]], row
        for column in present:
            assert row[column]["ms"] > 0 and len(row[column]["rounds_ms"]) == 2, row
            assert row[column]["compile_s"] > 0
            if column in ("two_calls", "xla_plain"):
                assert row[column]["max_rel_diff_vs_ours"] < 2e-2, row
        criterion = row["acceptance"]
        ours, peer = row["pallas_flex"]["ms"], row[peers[row["case"]][-1]]["ms"]
        assert criterion["value"] == pytest.approx(
            ours / peer if row["case"].startswith("sinks") else peer / ours)
    decode = written["rows"][2]
    assert decode["params"]["steps_per_call"] == 2
    # Per step, like the rounds: the median (mean) of the two rounds.
    entry = decode["pallas_flex"]
    assert entry["ms"] == pytest.approx(sum(entry["rounds_ms"]) / 2)
    lines = report.table(written)
    assert report.LEGENDS["variants"] in lines
    assert any(line.startswith("| sinks tiny_decode step |") and line.endswith("| – |")
               for line in lines)  # no FLOP rate for decode
    assert any(line.startswith("- sinks tiny_s256 fwd: pallas_flex / no_sinks <= 1.03: ")
               for line in lines)
    assert any(line.startswith("- gated r8_s64_h2_d32 fwd_bwd: xla_plain / pallas_flex >= 5: ")
               for line in lines)


def test_bench_quick_works_from_a_plain_install(tmp_path):
    """`pallas-flex bench --quick` from a wheel installed into a fresh virtualenv, run
    outside the checkout (its dependencies borrowed from this environment)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "pallas_flex", source / "pallas_flex",
                    ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True,
                           text=True, timeout=300)
    if build.returncode and "No matching distribution found for setuptools" in build.stderr:
        pytest.skip("pip cannot reach setuptools to build with (no index here)")
    assert build.returncode == 0, build.stderr
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps",
                    str(wheel)], check=True, timeout=300)
    site_packages = subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    # jax, numpy, ... from this environment; the path itself, not its .pth files, so the
    # checkout's editable install stays out.
    (Path(site_packages) / "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    # (without a PYTHONPATH of the caller's, which would put a checkout first)
    clean_env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    where = subprocess.run([venv / "bin" / "python", "-c",
                            "import pallas_flex; print(pallas_flex.__file__)"], cwd=work,
                           capture_output=True, text=True, check=True, env=clean_env).stdout
    assert where.startswith(site_packages), where
    # One timed loop of one call per entry: the install, not the timing, is under test.
    run = subprocess.run([venv / "bin" / "pallas-flex", "bench", "--quick", "--iters", "1",
                          "--repeats", "1"], cwd=work,
                         capture_output=True, text=True, timeout=600,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| tiny_gqa causal |" in run.stdout
    assert not list(work.iterdir())  # --quick writes no results file


def test_the_captured_gradients_suite_pairs_each_table_with_the_call_without_it():
    """`captured_gradients`: ALiBi slopes and a T5 table, each forward+backward with and
    without the array's gradient, timed in paired rounds with the 1.1x bar recorded."""
    import types

    import pallas_flex as pf
    from pallas_flex.bench import jax_suites
    options = types.SimpleNamespace(quick=True, backend=pf.default_backend(),
                                    shapes=list(cases.QUICK_ATTENTION_SHAPES),
                                    timing={"iters": 1, "repeats": 1})
    columns, metric, rows = jax_suites.captured_gradients(options)
    assert columns == ["pallas_flex", "no_table_gradient"] and metric == "ms"
    assert [row["case"] for row in rows] == ["tiny_gqa alibi_slopes", "tiny_gqa t5_table"]
    for row in rows:
        assert row["pallas_flex"]["ms"] > 0 and row["no_table_gradient"]["ms"] > 0
        assert row["acceptance"]["criterion"] == "pallas_flex / no_table_gradient <= 1.1"
        assert row["acceptance"]["value"] == pytest.approx(
            row["pallas_flex"]["ms"] / row["no_table_gradient"]["ms"])


def test_columns_are_timed_in_paired_rounds(monkeypatch):
    """`_pair`: every column `_measure` compiled runs once per round, and the rounds'
    median (per step of a chained call) is its ms."""
    import types

    from pallas_flex.bench import jax_suites, timing
    calls = []
    clock = iter(range(1000))

    def fake_time_calls(fn, args, *, iters, repeats):
        calls.append(fn.__name__)
        return {"ms": float(next(clock)), "repeats_ms": [0.0]}, None
    monkeypatch.setattr(timing, "time_calls", fake_time_calls)

    def ours(x):
        return x

    def peer(x):
        return x
    options = types.SimpleNamespace(quick=False, timing={"iters": 4, "repeats": 3})
    row = {"ours": {"ms": 50.0, "compile_s": 1.0}, "peer": {"ms": 60.0}}
    jax_suites._pair(row, {"ours": (ours, (1,), 1), "peer": (peer, (1,), 2)}, options)
    # Interleaved, one round after another, every other round in the reverse order.
    assert calls == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert row["ours"]["rounds_ms"] == [0.0, 3.0, 4.0] and row["ours"]["ms"] == 3.0
    assert row["peer"]["rounds_ms"] == [0.5, 1.0, 2.5] and row["peer"]["ms"] == 1.0
    assert row["ours"]["compile_s"] == 1.0 and row["ours"]["timing"] == "paired rounds"
    one = {"ours": {"compile_s": 1.0}}  # one column: timed alone, in rounds as well
    jax_suites._pair(one, {"ours": (ours, (1,), 1)}, options)
    assert one["ours"]["rounds_ms"] == [6.0, 7.0, 8.0] and one["ours"]["ms"] == 7.0
    quick = types.SimpleNamespace(quick=True, timing=options.timing)
    timed_already = {"ours": {"ms": 50.0}}  # a quick run: `_measure` timed it
    jax_suites._pair(timed_already, {"ours": (ours, (1,), 1)}, quick)
    assert timed_already == {"ours": {"ms": 50.0}} and len(calls) == 9


def test_paired_rounds_alternate_their_order(monkeypatch):
    """Each round times every call once, every other round in the reverse order (no call
    always first); the median is over each call's own rounds."""
    from pallas_flex.bench import timing
    order, times = [], {"a": [1.0, 5.0, 2.0], "b": [3.0, 4.0, 9.0]}
    def fake_time_calls(fn, args, iters, repeats):
        order.append(fn)
        return {"ms": times[fn].pop(0)}, None
    monkeypatch.setattr(timing, "time_calls", fake_time_calls)
    result = timing.time_paired({"a": ("a", ()), "b": ("b", ())}, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert result["a"] == {"ms": 2.0, "rounds_ms": [1.0, 5.0, 2.0]}
    assert result["b"] == {"ms": 4.0, "rounds_ms": [3.0, 4.0, 9.0]}


def test_git_provenance_names_the_tree_that_ran_under_a_stale_head(tmp_path, monkeypatch):
    """A copy of a working tree whose HEAD is an older commit: git_commit is that HEAD,
    git_tree the tree of the files present (the newer commit's), not HEAD's."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "old")
    old = git("rev-parse", "--short", "HEAD")
    (tmp_path / "a.py").write_text("x = 2\n")
    git("commit", "-qam", "new")
    new_tree = git("rev-parse", "--short=7", "HEAD^{tree}")
    git("update-ref", "HEAD", old)  # HEAD stale, files the new commit's
    (tmp_path / "package").mkdir()  # from a directory inside the checkout
    assert cli.git_provenance(tmp_path / "package") == {"git_commit": old,
                                                        "git_tree": new_tree}
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()  # not a repository: nothing to name
    assert cli.git_provenance(outside) == {"git_commit": None, "git_tree": None}
    # By default the checkout of the package itself, whatever the working directory.
    monkeypatch.chdir(outside)
    assert cli.git_provenance()["git_commit"] == (subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
        text=True).stdout.strip() or None)


def test_every_context_parallel_strategy_on_eight_host_devices(tmp_path):
    """Issue 19's correctness check at 8 devices, on 8 host devices (a process of its own:
    this one has 4): ring with the zig-zag layout, ring without it, all-gather K/V and
    all-to-all heads, causal and document + causal, out, lse, dq, dk, dv against one
    device (XLA backend, tiny shapes)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run(
        [sys.executable, "-m", "pallas_flex.bench.multi_device", "--quick", "--parts",
         "correctness", "--strategies", "ring,ring_contiguous,all_gather,all_to_all",
         "--out", str(tmp_path)], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "cpu" / "multi_device.json").read_text())["rows"]
    assert {(row["strategy"], row["mask"].split("64")[0], row["devices"]) for row in rows} == {
        (strategy, mask, 8) for strategy in ("ring", "ring_contiguous", "all_gather",
                                             "all_to_all") for mask in ("causal", "document")}
    for row in rows:
        assert row["status"] == "ok" and max(row["max_diff_over_max"].values()) < 2e-2, row


def test_the_ragged_suite_pairs_each_column_with_its_own_call(monkeypatch):
    """`ragged` times its kernel columns together after compiling them one by one: each
    column's timed call runs that column's step (the plain kernel's output is the plain
    op's, the rotated columns' are not), not the last one defined."""
    import types

    # Histories long enough that the listed blocks (10 %, seeded) hold cached keys.
    mixes = {"tiny_history": [(256, 1), (128, 16)]}
    monkeypatch.setattr(jax_suites, "RAGGED_MIXES", mixes)
    outputs = {}

    def fake_time_paired(calls, rounds, iters):  # each call once, its output kept
        for name, (fn, args) in calls.items():
            outputs[name] = np.asarray(jax.block_until_ready(fn(*args)), np.float32)
        return {name: {"ms": 1.0, "rounds_ms": [1.0]} for name in calls}
    monkeypatch.setattr(jax_suites, "time_paired", fake_time_paired)
    options = types.SimpleNamespace(quick=False, backend="interpret",
                                    timing={"iters": 1, "repeats": 1})
    heads, dim = (4, 2), 64
    columns, _, rows = jax_suites.ragged(options, heads=heads, dim=dim)
    assert sorted(outputs) == ["kernel", "kernel_rotated", "kernel_rotated_in_reads"]
    others, (key_cache, value_cache), _ = jax_suites.ragged_inputs(
        mixes["tiny_history"], heads, dim, 16)
    with pf.paged.traced_checks(False):
        plain, _, _ = pf.paged.paged_attention(**others, key_cache=key_cache,
                                               value_cache=value_cache, backend="interpret")
    np.testing.assert_allclose(outputs["kernel"], np.asarray(plain, np.float32), atol=1e-6)
    for rotated in ("kernel_rotated", "kernel_rotated_in_reads"):
        assert np.max(np.abs(outputs[rotated] - outputs["kernel"])) > 1e-2, rotated
    assert rows[0]["kernel"]["timing"] == "paired rounds"
    # The first calls rotate the same keys, in the cache and in the reads.
    assert rows[0]["kernel_rotated_in_reads"]["max_rel_diff_vs_in_cache"] < 1e-2


def _ab_row(tmp_path, *argv):
    """`bench.ab` on the tiny CPU shape (2 rounds of 1 call) and its one row."""
    from pallas_flex.bench import ab

    out = tmp_path / "ab.json"
    assert ab.main(["--quick", "--rounds", "2", "--iters", "1", *argv,
                    "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    return row


def test_ab_times_kernel_options_side_by_side(tmp_path):
    """`python -m pallas_flex.bench.ab`: each arm's kernel_options on the same inputs,
    timed in paired rounds; ratios against the first arm, each arm's difference from it
    and the kernels it runs. Tiles of 32 and 64 agree; a mis-set arm is a clear error."""
    from pallas_flex.bench import ab

    row = _ab_row(tmp_path, "--variants", "causal", "--mode", "fwd_bwd", "--arm", "base={}",
                  "--arm", 'small={"block_q": 32, "block_kv": 32}')
    assert row["case"] == "tiny_gqa causal" and list(row["arms"]) == ["base", "small"]
    base, small = row["arms"]["base"], row["arms"]["small"]
    assert base["ratio"] == 1.0 and len(small["rounds_ms"]) == 2
    assert small["ratio"] == pytest.approx(small["ms"] / base["ms"])
    assert base["max_difference"] == 0.0 and 0.0 < small["max_difference"] < 2e-2
    assert small["options"] == {"block_q": 32, "block_kv": 32}
    assert "forward: triton_forward" in small["kernels"]
    for bad in ("no_equals", "x=[1]", "x={"):
        with pytest.raises(SystemExit):
            ab.main(["--quick", "--arm", bad])
    with pytest.raises(SystemExit):
        ab.main(["--quick", "--arm", "a={}", "--arm", "a={}"])


def test_ab_times_the_gated_variant(tmp_path):
    """`bench.ab --gated`: Evoformer's gated row attention under each arm's options
    (here the pair bias's gradient by the Triton backward's atomics or its batch loop),
    forward+backward with the pair bias and gate differentiated; a case that is not a
    gated one is a clear error."""
    from pallas_flex.bench import ab

    row = _ab_row(tmp_path, "--gated", "gated_tiny", "--mode", "fwd_bwd",
                  "--arm", 'loop={"backward_batch_sum": "loop"}',
                  "--arm", 'atomic={"backward_batch_sum": "atomic"}')
    assert row["case"] == "gated gated_tiny" and list(row["arms"]) == ["loop", "atomic"]
    assert row["arms"]["atomic"]["max_difference"] < 2e-2  # (0: the same sums, in order)
    assert len(row["arms"]["atomic"]["rounds_ms"]) == 2 and row["arms"]["loop"]["ratio"] == 1
    assert "backward: triton_backward" in row["arms"]["atomic"]["kernels"]
    with pytest.raises(SystemExit):
        ab.main(["--quick", "--gated", "sinks_tiny", "--arm", "a={}"])


def test_shapes_and_cases_that_run_only_when_named():
    """A suite run without --shapes leaves out `cases.EXTRA_ATTENTION_SHAPES` and the
    `extra` variant cases; naming one runs it (and only what was named)."""
    for suite in ("forward", "fwd_bwd"):
        assert cli.suite_shapes(suite, None, False) == list(cases.ATTENTION_SHAPES)
    assert [s.name for s in cli.suite_shapes("forward", "b8_s2048_d32,b4_s4096_d128",
                                             False)] == ["b8_s2048_d32", "b4_s4096_d128"]
    assert {s.head_dim for s in cases.EXTRA_ATTENTION_SHAPES} == {32}
    default_cases = cli.suite_shapes("variants", None, False)
    assert default_cases and not any(case.extra for case in default_cases)
    named = [case.name for case in cases.VARIANT_CASES if case.extra][:1]
    assert [case.name for case in cli.suite_shapes("variants", named[0], False)] == named
    assert cli.suite_shapes("decode", None, False) == list(cases.DECODE_SHAPES)
    with pytest.raises(SystemExit, match="unknown shape"):
        cli.suite_shapes("forward", "b8_s2048_d48", False)
