"""The API reference: pdoc builds it from the docstrings without a warning, and it lists
every public name of pallas_flex, pallas_flex.masks, pallas_flex.scores,
pallas_flex.paged, pallas_flex.context_parallel, pallas_flex.variants and pallas_flex.nn
(`make api-docs` writes it to build/api)."""

from __future__ import annotations

import warnings

import pdoc

import pallas_flex as pf
from pallas_flex import context_parallel, masks, nn, paged, scores, variants

SPECS = ("pallas_flex", "pallas_flex.nn")


def test_api_reference_builds_without_warnings_and_lists_every_public_name(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*SPECS, output_directory=tmp_path)
    pdoc_warnings = [str(w.message) for w in caught if "pdoc" in w.filename]
    assert not pdoc_warnings, pdoc_warnings
    pages = {"pallas_flex": tmp_path / "pallas_flex.html",
             "masks": tmp_path / "pallas_flex" / "masks.html",
             "paged": tmp_path / "pallas_flex" / "paged.html",
             "scores": tmp_path / "pallas_flex" / "scores.html",
             "nn": tmp_path / "pallas_flex" / "nn.html",
             "context_parallel": tmp_path / "pallas_flex" / "context_parallel.html",
             "variants": tmp_path / "pallas_flex" / "variants.html"}
    modules = {"pallas_flex": pf, "masks": masks, "paged": paged, "scores": scores, "nn": nn,
               "context_parallel": context_parallel, "variants": variants}
    for key, module in modules.items():
        html = pages[key].read_text()
        names = [name for name in module.__all__
                 if name not in ("masks", "paged", "scores", "context_parallel", "variants")]
        missing = [name for name in names if f'id="{name}"' not in html]
        assert not missing, f"{key}: {missing}"
        assert 'class="signature' in html
