"""The GPU suite's smoke selection (`PALLAS_FLEX_GPU_SMOKE=1`, `make test-gpu-smoke`,
tests/selection.py's `_smoke`) and shards, checked on the CPU by collecting: every gpu test
function keeps a test, the dtype matrix keeps its slice (every dtype and op at head dims
64, 96, 128, 256, the device's own budget, GQA), the captured-gradient matrix one cell
per array kind and dtype, and the whole stays small enough for one device call; the
shards of a run that collects no path under tests/gpu split its tests too."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(smoke, shard=None, paths=("tests",)):
    env = dict(os.environ)
    env.pop("PALLAS_FLEX_TEST_SHARD", None)
    if shard is not None:
        env["PALLAS_FLEX_TEST_SHARD"] = shard
    env["PALLAS_FLEX_GPU_SMOKE"] = "1" if smoke else ""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
         "-p", "no:cacheprovider", "--ignore=tests/test_notebooks.py",
         "--ignore=tests/test_api_reference.py", *paths],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_the_smoke_run_keeps_every_function_and_the_matrix_slices():
    everything, smoke = _collect(False), _collect(True)
    functions = {test.split("[")[0] for test in everything}
    assert {test.split("[")[0] for test in smoke} == functions
    assert set(smoke) <= set(everything) and len(smoke) < 200 < len(everything)
    cells = [re.search(r"\[(.*)\]", test).group(1).split("-") for test in smoke
             if "test_cell_matches_float64_reference" in test]
    assert len(cells) == 3 * 4 * 3
    assert {(cell[0], cell[3]) for cell in cells} == {
        (dtype, op) for dtype in ("float32", "bfloat16", "float16")
        for op in ("forward", "forward_backward", "decode")}
    assert {int(cell[1].lstrip("d")) for cell in cells} == {64, 96, 128, 256}
    captured = [re.search(r"\[(.*)\]", test).group(1).split("-")[0::5] for test in smoke
                if "test_captured_array_gradient_matches_float64_reference" in test]
    assert len(captured) == len({tuple(cell) for cell in captured}) >= 6


def test_shards_split_a_run_outside_tests_gpu():
    """PALLAS_FLEX_TEST_SHARD splits the gpu tests of one kernel file (no tests/gpu path
    collected) into disjoint shards that together hold all of them."""
    paths = ("tests/kernels/test_backward_mosaic.py",)
    everything = _collect(False, paths=paths)
    shards = [_collect(False, shard=f"{index}/3", paths=paths) for index in range(3)]
    assert len(everything) > 10 and all(shards)
    assert sorted(sum(shards, [])) == sorted(everything)
