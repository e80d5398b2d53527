"""The notebooks' install cell (the Colab path) and `make wheel`.

The cell runs before pallas_flex can be imported, so its logic lives in the cell: these
tests take its source from the notebooks and exec it with fakes for `find_spec`
(installed or not), `shutil.which` (GPU or not) and `subprocess.run` (pip).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ("quickstart.ipynb", "training.ipynb", "serving.ipynb", "benchmarks.ipynb")
SOURCE_LINE = re.compile(r'^PALLAS_FLEX_SOURCE = "(?P<source>[^"]*)"', re.MULTILINE)
VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def install_cell(name: str) -> str:
    """The source of the notebook's install cell: its first code cell."""
    cells = json.loads((REPO_ROOT / "notebooks" / name).read_text())["cells"]
    first_code = next(cell for cell in cells if cell["cell_type"] == "code")
    return "".join(first_code["source"])


class FakeEnvironment:
    """pallas_flex importable or not, nvidia-smi present or not, and a pip that records
    its calls (and makes pallas_flex importable, as the real one would)."""

    def __init__(self, monkeypatch, *, installed: bool, gpu: bool, pip_returncode: int = 0):
        self.installed = installed
        self.pip_calls: list[list[str]] = []
        real_find_spec, real_which = importlib.util.find_spec, shutil.which

        def find_spec(name, *args, **kwargs):
            if name == "pallas_flex":
                return real_find_spec(name) if self.installed else None
            return real_find_spec(name, *args, **kwargs)

        def which(command, *args, **kwargs):
            if command == "nvidia-smi":
                return "/usr/bin/nvidia-smi" if gpu else None
            return real_which(command, *args, **kwargs)

        def run(command, *args, **kwargs):
            assert command[:4] == [sys.executable, "-m", "pip", "install"], command
            self.pip_calls.append(command)
            self.installed = pip_returncode == 0
            return subprocess.CompletedProcess(command, pip_returncode, "pip says", "pip errs")

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(shutil, "which", which)
        monkeypatch.setattr(subprocess, "run", run)

    def run_cell(self, source: str | None = None) -> dict:
        code = install_cell("quickstart.ipynb")
        if source is not None:
            code = SOURCE_LINE.sub(lambda _: f"PALLAS_FLEX_SOURCE = {source!r}", code, count=1)
        namespace: dict = {"__name__": "__notebook__"}
        exec(compile(code, "install cell", "exec"), namespace)
        return namespace

    @property
    def requirements(self) -> list[str]:
        return [call[-1] for call in self.pip_calls]


@pytest.fixture
def wheel(tmp_path):
    path = tmp_path / f"pallas_flex-{VERSION}-py3-none-any.whl"
    path.write_bytes(b"")
    return path


def test_every_notebook_carries_the_same_install_cell():
    cells = {name: install_cell(name) for name in NOTEBOOKS}
    assert all("PALLAS_FLEX_SOURCE" in cell for cell in cells.values()), (
        "the first code cell of every notebook is the install cell")
    assert len(set(cells.values())) == 1, (
        f"the install cells differ: {sorted(cells)}; copy quickstart's into the others")
    # The default names the wheel `make wheel` builds for this version.
    (source,) = SOURCE_LINE.findall(cells["quickstart.ipynb"])
    assert source == f"/content/pallas_flex-{VERSION}-py3-none-any.whl"


@pytest.mark.parametrize("gpu", [False, True])
def test_where_pallas_flex_imports_the_cell_runs_no_pip(monkeypatch, wheel, gpu):
    environment = FakeEnvironment(monkeypatch, installed=True, gpu=gpu)
    environment.run_cell()  # the default source: a path that does not exist here
    environment.run_cell(str(wheel))
    assert environment.pip_calls == []


@pytest.mark.parametrize("source", [f"/content/pallas_flex-{VERSION}-py3-none-any.whl",
                                    "git+https://github.com/OWNER/REPO",
                                    "git+https://github.com/OWNER/REPO@main"])
def test_an_unreplaced_placeholder_is_a_clear_error_and_no_pip(monkeypatch, source):
    environment = FakeEnvironment(monkeypatch, installed=False, gpu=False)
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        environment.run_cell(source)
    message = str(error.value)
    assert "pallas_flex is not installed" in message
    assert f"PALLAS_FLEX_SOURCE = {source!r}" in message
    for form in ("make wheel", "git+https://github.com/OWNER/REPO", "pyproject.toml",
                 "Files pane"):
        assert form in message
    assert environment.pip_calls == []


@pytest.mark.parametrize("source, problem", [
    ("https://github.com/someone/pallas-flex", "must be a git URL starting with git+"),
    ("/content/pallas_flex-0.1.0-py3-none-any (1).whl", "rename the file"),
    ("/no/such/checkout", "neither a wheel nor a checkout"),
])
def test_a_bad_source_is_a_clear_error(monkeypatch, tmp_path, source, problem):
    if source.endswith(".whl"):  # a second upload: Colab appends " (1)"
        source = str(tmp_path / pathlib.Path(source).name)
        pathlib.Path(source).write_bytes(b"")
    environment = FakeEnvironment(monkeypatch, installed=False, gpu=False)
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(problem)):
        environment.run_cell(source)
    assert environment.pip_calls == []


@pytest.mark.parametrize("gpu, name", [(False, "pallas-flex"), (True, "pallas-flex[cuda12]")])
def test_a_wheel_is_installed_with_the_cuda_extra_on_a_gpu(monkeypatch, wheel, gpu, name):
    environment = FakeEnvironment(monkeypatch, installed=False, gpu=gpu)
    environment.run_cell(str(wheel))
    assert environment.requirements == [f"{name} @ {wheel.as_uri()}"]
    assert environment.pip_calls[0][:5] == [sys.executable, "-m", "pip", "install", "-q"]
    assert_valid_requirement(environment.requirements[0], extras={"cuda12"} if gpu else set())


@pytest.mark.parametrize("gpu, name", [(False, "pallas-flex"), (True, "pallas-flex[cuda12]")])
def test_a_git_url_or_a_checkout_is_installed_likewise(monkeypatch, tmp_path, gpu, name):
    url = "git+https://github.com/someone/pallas-flex@v0.1.0"
    (tmp_path / "pyproject.toml").write_text("")
    environment = FakeEnvironment(monkeypatch, installed=False, gpu=gpu)
    environment.run_cell(url)
    environment.installed = False
    environment.run_cell(str(tmp_path))
    assert environment.requirements == [f"{name} @ {url}", f"{name} @ {tmp_path.as_uri()}"]
    for requirement in environment.requirements:
        assert_valid_requirement(requirement, extras={"cuda12"} if gpu else set())


def test_a_failed_pip_shows_its_output_and_raises(monkeypatch, wheel, capsys):
    environment = FakeEnvironment(monkeypatch, installed=False, gpu=False, pip_returncode=1)
    with pytest.raises(RuntimeError, match="pip could not install"):
        environment.run_cell(str(wheel))
    assert "pip errs" in capsys.readouterr().out


def assert_valid_requirement(requirement: str, extras: set[str]):
    """pip parses it: a PEP 508 direct reference naming pallas-flex and the extras."""
    from pip._vendor.packaging.requirements import Requirement

    parsed = Requirement(requirement)
    assert parsed.name == "pallas-flex" and parsed.extras == extras and parsed.url


def test_make_wheel_ships_every_module(tmp_path):
    """`make wheel` on a copy of the package: every module of pallas_flex/ (subpackages
    such as pallas_flex/bench/ included) and nothing stale from an earlier build."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    for name in ("Makefile", "pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    shutil.copytree(REPO_ROOT / "pallas_flex", tmp_path / "pallas_flex",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    stale = tmp_path / "build" / "lib" / "pallas_flex" / "deleted_module.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    build = subprocess.run(["make", "wheel", f"PYTHON={sys.executable}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    if build.returncode and "No matching distribution found for setuptools" in build.stderr:
        pytest.skip("pip cannot reach setuptools to build with (no index here)")
    assert build.returncode == 0, build.stdout + build.stderr

    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == f"pallas_flex-{VERSION}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {path.relative_to(tmp_path).as_posix()
               for path in (tmp_path / "pallas_flex").rglob("*.py")}
    assert "pallas_flex/__init__.py" in names
    assert modules <= names, sorted(modules - names)
    if (REPO_ROOT / "pallas_flex" / "bench").is_dir():
        assert any(name.startswith("pallas_flex/bench/") for name in names)
    assert "pallas_flex/deleted_module.py" not in names
    metadata = zipfile.ZipFile(wheel).read(
        f"pallas_flex-{VERSION}.dist-info/METADATA").decode()
    assert "Provides-Extra: cuda12" in metadata


def test_the_readme_names_this_version_s_wheel_and_the_cell():
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"dist/pallas_flex-{VERSION}-py3-none-any.whl" in readme
    assert "PALLAS_FLEX_SOURCE" in readme and "make wheel" in readme
