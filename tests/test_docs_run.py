"""Docs that run: every ```python block of README.md and docs/*.md executes on the CPU.

The blocks of one file run in order in one namespace, so a block may build on the one
before it. A block that is not meant to run here (shell commands, GPU-only code, output)
is fenced as something else: ```bash, ```text, ... On the CPU `backend=None` picks the
XLA blockwise path, so the README's code runs as written without a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON_INFO = {"python", "py", "python3"}
# An opening or closing fence: up to 3 spaces of indent (more inside list items), then
# ``` or ~~~ and an optional info string.
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")


def doc_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the block's first code line, code) of every ```python block."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        info = opening["info"].split()[0].lower() if opening["info"] else ""
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if (closing and not closing["info"] and closing["fence"][0] == fence[0]
                    and len(closing["fence"]) >= len(fence)):
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        else:
            raise ValueError(f"unclosed code fence opened at line {i + 1}")
        if info in PYTHON_INFO:
            blocks.append((i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def test_extractor_finds_blocks_and_skips_other_fences():
    text = ("intro\n```python\nx = 1\n```\n\n```bash\nmake test\n```\n"
            "* item\n\n  ```python\n  y = x + 1\n  ```\n```\nplain\n```\n")
    assert python_blocks(text) == [(3, "x = 1\n"), (12, "y = x + 1\n")]
    # The README's opening example is found (the test below would pass vacuously if not).
    readme = python_blocks((REPO_ROOT / "README.md").read_text())
    assert readme and "pf.attention(" in readme[0][1]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_python_blocks_run(path: Path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # a block that plots must not open a window
    monkeypatch.chdir(REPO_ROOT)
    blocks = python_blocks(path.read_text())
    namespace: dict = {"__name__": "__docs__"}
    for line, code in blocks:
        # The filename and line padding make a traceback point at the Markdown line.
        source = "\n" * (line - 1) + code
        exec(compile(source, f"{path.relative_to(REPO_ROOT)}", "exec"), namespace)
