"""pyproject.toml uses the SPDX license string (a TOML table is deprecated by setuptools
and warned about on every `pip install`)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_license_is_an_spdx_string_and_setuptools_understands_it():
    config = tomllib.loads(PYPROJECT.read_text())
    assert config["project"]["license"] == "Apache-2.0"
    # The string form needs setuptools >= 77.
    (setuptools,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert minimum and int(minimum[1]) >= 77
