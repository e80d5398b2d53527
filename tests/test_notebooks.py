"""Every notebook runs top to bottom on the CPU at its quick sizes, in a kernel that is
this interpreter (the venv's python), and is committed with its outputs stripped."""

from __future__ import annotations

import pathlib
import sys

import nbformat
import pytest
from ipykernel.kernelspec import install as install_kernelspec
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def python3_kernel(tmp_path_factory, monkeypatch_module):
    """Kernel "python3" resolved to this interpreter: a kernelspec written for
    sys.executable, first on JUPYTER_PATH, so no other "python3" on the machine wins."""
    prefix = tmp_path_factory.mktemp("jupyter")
    install_kernelspec(kernel_name="python3", prefix=str(prefix))
    monkeypatch_module.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch_module.setenv("PALLAS_FLEX_QUICK", "1")
    monkeypatch_module.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch_module.setenv("MPLBACKEND", "Agg")
    return "python3"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _notebook_paths():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_notebooks_are_there():
    assert {path.name for path in _notebook_paths()} >= {
        "quickstart.ipynb", "training.ipynb", "benchmarks.ipynb"}


@pytest.mark.parametrize("path", _notebook_paths(), ids=lambda path: path.stem)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: strip outputs before committing")


@pytest.mark.parametrize("path", _notebook_paths(), ids=lambda path: path.stem)
def test_notebook_runs_top_to_bottom(path, python3_kernel):
    notebook = nbformat.read(path, as_version=4)
    # First, the kernel's own interpreter: it must be the one running these tests.
    notebook.cells.insert(0, nbformat.v4.new_code_cell(
        "import sys; print(sys.executable)"))
    client = NotebookClient(notebook, kernel_name=python3_kernel, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    kernel_python = notebook.cells[0].outputs[0]["text"].strip()
    assert pathlib.Path(kernel_python) == pathlib.Path(sys.executable)
