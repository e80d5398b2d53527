"""Every notebook runs top to bottom on the CPU at its quick sizes, in a kernel that is
this interpreter (the venv's python), and is committed with its outputs stripped."""

from __future__ import annotations

import asyncio
import pathlib
import sys

import nbformat
import pytest
from ipykernel.kernelspec import install as install_kernelspec
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOK_NAMES = ("quickstart.ipynb", "training.ipynb", "serving.ipynb", "benchmarks.ipynb")
CELL_TIMEOUT_S = 120


def _notebook_paths():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_notebooks_are_there():
    assert {path.name for path in _notebook_paths()} >= set(NOTEBOOK_NAMES)


@pytest.mark.parametrize("path", _notebook_paths(), ids=lambda path: path.stem)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: strip outputs before committing")


async def _execute_all(clients):
    return await asyncio.gather(*(client.async_execute() for client in clients),
                                return_exceptions=True)


def test_every_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    """All notebooks at once, each in its own kernel: they are mostly XLA compilation,
    so running them side by side keeps both cores busy to the end."""
    # Kernel "python3" resolved to this interpreter: a kernelspec written for
    # sys.executable, first on JUPYTER_PATH, so no other "python3" on the machine wins.
    install_kernelspec(kernel_name="python3", prefix=str(tmp_path))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    monkeypatch.setenv("PALLAS_FLEX_QUICK", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebooks = {path.name: nbformat.read(path, as_version=4) for path in _notebook_paths()}
    for notebook in notebooks.values():
        # First, the kernel's own interpreter: it must be the one running these tests.
        notebook.cells.insert(0, nbformat.v4.new_code_cell(
            "import sys; print(sys.executable)"))
    # Each kernel talks over Unix sockets of its own (IPC transport, one path prefix a
    # kernel): TCP ports picked at random for kernels starting side by side collided
    # once in CI ("Address already in use", the kernel died before replying).
    clients = [NotebookClient(notebook, timeout=CELL_TIMEOUT_S,
                              km=AsyncKernelManager(kernel_name="python3", transport="ipc",
                                                    ip=str(tmp_path / f"kernel-{index}")),
                              resources={"metadata": {"path": str(NOTEBOOKS)}})
               for index, notebook in enumerate(notebooks.values())]
    results = asyncio.run(_execute_all(clients))

    failures = {name: result for name, result in zip(notebooks, results)
                if isinstance(result, BaseException)}
    for name, error in failures.items():
        if not isinstance(error, CellExecutionError):
            raise error
    assert not failures, "\n\n".join(f"{name}:\n{error}" for name, error in failures.items())
    for name, notebook in notebooks.items():
        kernel_python = notebook.cells[0].outputs[0]["text"].strip()
        assert pathlib.Path(kernel_python) == pathlib.Path(sys.executable), name
