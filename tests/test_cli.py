"""`pallas-flex --version`."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import pallas_flex
from pallas_flex import cli


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pallas-flex {metadata.version('pallas-flex')}"


def test_version_falls_back_to_the_package_version(monkeypatch, capsys):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pallas-flex {pallas_flex.__version__}"


def test_version_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "pallas_flex.cli", "--version"],
                            capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == f"pallas-flex {metadata.version('pallas-flex')}"
