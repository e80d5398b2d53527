"""`benchmarks/inspect_kernels.py lower` writes our kernels' Triton IR on any machine.

It reaches into JAX's Pallas-Triton lowering (private modules): this catches a JAX
upgrade that moves them before a GPU session needs the tool.
"""

from __future__ import annotations

import re

import pytest

from benchmarks import inspect_kernels


@pytest.mark.parametrize("kv_heads,expected", [
    (0, {"flex_attention_forward", "flex_attention_backward"}),
    (2, {"flex_attention_forward", "flex_attention_backward_dkdv",
         "flex_attention_backward_dq"}),
])
def test_lower_writes_triton_ir_for_every_kernel(tmp_path, kv_heads, expected):
    inspect_kernels.main(["lower", "--variant", "alibi", "--seq-len", "256", "--q-heads", "4",
                          "--kv-heads", str(kv_heads), "--out-dir", str(tmp_path)])
    files = sorted(tmp_path.glob("*.ttir"))
    names = set()
    for path in files:
        text = path.read_text()
        names.add(re.search(r"tt.func public @(\w+)", text).group(1))
        assert "tt.dot" in text, path.name
        assert re.search(r"_alibi_w\d+s\d+\.ttir$", path.name), path.name
    assert names == expected
