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


@pytest.mark.parametrize("q_len,expected", [(0, "flex_attention_forward_paged"),
                                            (1, "flex_attention_decode")])
def test_lower_writes_the_paged_kernels(tmp_path, q_len, expected):
    inspect_kernels.main(["lower", "--page-size", "16", "--q-len", str(q_len),
                          "--seq-len", "256", "--q-heads", "4", "--kv-heads", "2",
                          "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("*.ttir")
    assert re.search(r"tt.func public @(\w+)", path.read_text()).group(1) == expected
    assert path.name.startswith(f"{expected}_noop_page16_w"), path.name


def test_loop_instruction_counts_reads_blocks_that_branch_to_themselves():
    ptx = """
$L__BB0_1:
\tld.global.b32 {%r1}, [%rd1];
\t@%p1 bra $L__BB0_3;
$L__BB0_2:
\tld.global.b32 {%r2}, [%rd2];
\tld.global.b32 {%r3}, [%rd3];
\tcp.async.cg.shared.global [%r4], [%rd4], 16;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd5, %rd6, 1, 1, 1, 0, 1;
\t@%p2 bra $L__BB0_2;
$L__BB0_3:
\tret;
"""
    assert inspect_kernels.loop_instruction_counts(ptx) == [("$L__BB0_2", 2, 1, 1)]
