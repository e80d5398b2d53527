"""`benchmarks/inspect_kernels.py lower` writes our kernels' Triton IR on any machine, and
`capture_mosaic` lowers the Mosaic GPU kernels for an H100 on it.

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


def _lowered_backward_kernels(attend, shapes):
    """{kernel name: TTIR} of the Triton kernels `jax.vjp` of `attend` launches, lowered
    for an H100 on this machine (no GPU needed)."""
    import jax

    def forward_and_backward(*args):
        *inputs, d_out = args
        _, vjp = jax.vjp(attend, *inputs)
        return vjp(d_out)

    return {name: text for name, _, _, text in inspect_kernels.capture_triton(
        [(forward_and_backward, shapes)])}


def test_batch_loop_launch_lowers_for_the_gpu():
    """The Evoformer pair bias's batch-loop launch (backward_batch_sum "loop"/"auto")
    lowers to Triton: its row loop once carried a constant, which Triton's scf.yield
    cannot take ('Operand 2 of operation "scf.yield" must be a Value'); the interpreter
    runs such loops, so only lowering catches it."""
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf

    batch, rows, residues, heads, dim = 1, 8, 256, 2, 32
    msa = jax.ShapeDtypeStruct((batch, rows, residues, heads, dim), jnp.bfloat16)
    pair = jax.ShapeDtypeStruct((batch, heads, residues, residues), jnp.bfloat16)

    def gated(q, k, v, gate, pair_bias):
        return pf.variants.gated_self_attention(
            q, k, v, gate, pair_bias=pair_bias, backend="pallas",
            kernel_options={"backward_batch_sum": "loop"})

    kernels = _lowered_backward_kernels(gated, (msa, msa, msa, msa, pair, msa))
    assert "flex_attention_backward_batch_loop" in kernels
    assert "scf.for" in kernels["flex_attention_backward_batch_loop"]


@pytest.mark.parametrize("case", ["shared_table", "scalar"])
def test_constant_table_indices_lower_for_the_gpu(case):
    """Loop carries that are constants at trace time lower too: the flat index of a
    table read at q_idx / kv_idx alone (no fixed axis: the batch loop's base is 0) and
    of a 0-d captured array (the dQ programs' summed site)."""
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf

    batch, length, heads, dim = 4, 256, 2, 32
    x = jax.ShapeDtypeStruct((batch, length, heads, dim), jnp.bfloat16)
    if case == "shared_table":
        table = jax.ShapeDtypeStruct((length, length), jnp.float32)
        score_mod = lambda table: lambda s, b, h, q, kv: s + table[q, kv]  # noqa: E731
        options, expected = {"backward_batch_sum": "loop"}, "flex_attention_backward_batch_loop"
    else:
        table = jax.ShapeDtypeStruct((), jnp.float32)
        score_mod = lambda t: lambda s, b, h, q, kv: s * t  # noqa: E731
        options, expected = None, "flex_attention_backward"

    def attend(q, k, v, table):
        return pf.attention(q, k, v, score_mod=score_mod(table), backend="pallas",
                            kernel_options=options)

    assert expected in _lowered_backward_kernels(attend, (x, x, x, table, x))


@pytest.mark.parametrize("read", ["pair_bias", "transposed", "vectors", "mask_table"])
def test_block_reads_lower_for_the_gpu(read):
    """Mod reads at exactly q_idx / kv_idx (loaded as blocks, their gradients added as
    blocks: tile_mods.block_reads) lower to Triton in every kernel, ragged lengths (the
    arrays edge-padded) and bfloat16 / bool arrays included (tests/test_block_reads.py
    checks that the kernels take that path)."""
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf

    batch, length, heads, dim = 4, 200, 2, 64
    x = jax.ShapeDtypeStruct((batch, length, heads, dim), jnp.bfloat16)
    shapes = {"pair_bias": [(batch // 2, heads, length, length)],
              "transposed": [(heads, length, length)],
              "vectors": [(heads, length), (batch, length)],
              "mask_table": [(length, length)]}[read]
    tables = [jax.ShapeDtypeStruct(shape, jnp.bool_ if read == "mask_table" else jnp.bfloat16)
              for shape in shapes]

    def attend(q, k, v, *tables):
        score_mod = mask_mod = None
        if read == "pair_bias":
            score_mod = lambda s, b, h, i, j: s + tables[0][b // 2, h, i, j]  # noqa: E731
        elif read == "transposed":
            score_mod = lambda s, b, h, i, j: s + tables[0][h, j, i]  # noqa: E731
        elif read == "vectors":
            score_mod = lambda s, b, h, i, j: s + tables[0][h, i] + tables[1][b, j]  # noqa: E731
        else:
            mask_mod = lambda b, h, i, j: tables[0][i, j] & (j <= i)  # noqa: E731
        return pf.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="pallas",
                            kernel_options={"backward_batch_sum": "atomic"})

    kernels = _lowered_backward_kernels(attend, (x, x, x, *tables, x))
    assert set(kernels) == {"flex_attention_forward", "flex_attention_backward"}


def _mosaic_case(case):
    """(function, argument shapes) of one call whose kernels the Mosaic GPU backends run
    on Hopper: forwards (GQA and a ragged length, head dims 64-256, float16, bias-tensor
    blocks, a document mask's id vectors, sinks with an output gate and the row max),
    forward+backward (D 64's fused dQ, D 128's two kernels, the deterministic backward,
    captured arrays' gradients: ALiBi slopes fused at D 64, a T5 table; bias-tensor
    blocks at D 32, 64 and 96, and a bias's gradient), paged prefills
    and the latent (MLA) decode, contiguous and on pages of 64."""
    import jax
    import jax.numpy as jnp

    import pallas_flex as pf
    from pallas_flex.paged.cache import PagedKVCache

    def shape(*dims, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(dims, dtype)
    mosaic = {"forward_kernel": "mosaic", "backward_kernel": "mosaic"}

    def attend(mask_mod=None, score_mod=None):
        return lambda q, k, v: pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                            backend="pallas", kernel_options=mosaic)

    def gradients(make_score_mod, table, **options):
        def loss(q, k, v, table):
            out = pf.attention(q, k, v, mask_mod=pf.masks.causal_mask,
                               score_mod=make_score_mod(table), backend="pallas",
                               kernel_options={**mosaic, **options})
            return out.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3)), table

    def paged(page_size, q_len, q_heads, kv_heads, dim, value_dim, options):
        pages = 32
        length = pages // 2 * page_size  # (a row's pages, all of them)
        cache = PagedKVCache(shape(pages, kv_heads, page_size, dim),
                             shape(pages, kv_heads, page_size, value_dim),
                             shape(2, pages // 2, dtype=jnp.int32), shape(2, dtype=jnp.int32),
                             shape(pages, dtype=jnp.int32))
        block_mask = pf.create_block_mask(pf.masks.offset(pf.masks.causal_mask,
                                                          length - q_len),
                                          None, None, q_len, length)
        return (lambda q, cache: pf.paged.paged_flex_attention(
            q, cache, block_mask=block_mask, backend="pallas", kernel_options=options),
            (shape(2, q_len, q_heads, dim), cache))

    def gqa(length, dim, dtype=jnp.bfloat16, q_heads=8, kv_heads=2):
        return (shape(2, length, q_heads, dim, dtype=dtype),
                *[shape(2, length, kv_heads, dim, dtype=dtype)] * 2)
    if case == "forward_gqa_ragged_alibi":
        return attend(pf.masks.causal_mask, pf.masks.alibi(8)), gqa(600, 128)
    if case == "forward_d256_softcap_float16":
        return attend(None, pf.masks.tanh_softcap(30.0)), gqa(384, 256, jnp.float16, 2, 2)
    if case == "forward_d80_documents":
        ids = jnp.arange(512) // 100
        return attend(lambda b, h, q, k: ids[q] == ids[k]), gqa(512, 80)
    if case in ("forward_d64_bias_blocks", "forward_d32_bias_blocks"):
        bias = jnp.zeros((1, 8, 384, 384), jnp.bfloat16)
        return attend(None, pf.scores.bias_lookup(bias)), gqa(384, 32 if "d32" in case else 64)
    if case in ("backward_d64_bias_blocks", "backward_d96_bias_blocks",
                "backward_d128_bias_blocks"):
        # (D 64: the fused dK/dV kernel; D 96: the dQ and dK/dV kernels; D 128: the dQ
        # kernel on 64-key tiles)
        dim = int(case.split("_")[1][1:])
        bias = jnp.zeros((1, 8, 384, 384), jnp.bfloat16)
        def fwd_bwd(q, k, v):
            return jax.grad(lambda q, k, v: attend(
                pf.masks.causal_mask, pf.scores.bias_lookup(bias))(q, k, v)
                .astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
        return fwd_bwd, gqa(384, dim)
    if case in ("backward_d64_trained_bias", "backward_d128_trained_bias"):
        # (its gradient by TMA reduce-adds; at D 128 from one staging buffer)
        grad, bias = gradients(pf.scores.bias_lookup, shape(1, 8, 384, 384))
        return grad, (*gqa(384, 128 if "d128" in case else 64), bias)
    if case == "backward_d32_pair_bias":
        # (a fixed pair bias: its gradient's batch loop is a Triton kernel, which does
        # not lower here)
        def gated_grad(q, k, v, gate, pair_bias):
            def loss(*args):
                return pf.variants.gated_self_attention(
                    *args[:4], pair_bias=pair_bias, backend="pallas",
                    kernel_options=mosaic).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, gate)
        msa = shape(1, 8, 256, 4, 32)
        return gated_grad, (msa, msa, msa, msa, shape(1, 4, 256, 256))
    if case in ("backward_d64_causal", "backward_d128_causal"):
        dim = 64 if case.endswith("d64_causal") else 128
        def fwd_bwd(q, k, v):
            return jax.grad(lambda q, k, v: attend(pf.masks.causal_mask)(q, k, v)
                            .astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
        return fwd_bwd, gqa(512, dim)
    if case == "backward_d64_t5_table":
        grad, table = gradients(lambda t: pf.scores.t5_relative_bias(t, max_distance=64),
                                shape(8, 32, dtype=jnp.float32))
        return grad, (*gqa(512, 64), table)
    if case == "paged_prefill_d128_page64":
        return paged(64, 256, 8, 2, 128, 128, mosaic)
    if case == "forward_d128_sinks_gate_row_max":
        def gated(q, k, v, sinks, gate):
            return pf.attention(q, k, v, mask_mod=pf.masks.causal_mask, sinks=sinks,
                                output_gate=gate, return_aux=pf.AuxRequest(max_scores=True),
                                backend="pallas", kernel_options=mosaic)
        q, k, v = gqa(512, 128)
        return gated, (q, k, v, shape(8, dtype=jnp.float32), q)
    if case == "forward_d192":
        return attend(pf.masks.causal_mask), gqa(384, 192, q_heads=2, kv_heads=2)
    if case in ("backward_d64_deterministic", "backward_d64_alibi_slopes",
                "backward_d128_alibi_slopes"):
        grad, slopes = gradients(pf.scores.alibi, shape(8, dtype=jnp.float32),
                                 backward_deterministic=case.endswith("deterministic"))
        return grad, (*gqa(512, 128 if "d128" in case else 64), slopes)
    if case == "paged_prefill_d64_page16":
        return paged(16, 200, 8, 2, 64, 64, mosaic)
    if case == "latent_decode_page64":
        return paged(64, 1, 128, 1, 576, 512, {"decode_kernel": "mosaic"})
    if case == "latent_decode":
        return (lambda q, k, v: pf.attention(q, k, v, backend="pallas",
                                             kernel_options={"decode_kernel": "mosaic"}),
                (shape(4, 1, 128, 576), shape(4, 1024, 1, 576), shape(4, 1024, 1, 512)))
    raise ValueError(case)


@pytest.mark.parametrize("case,kernels", [
    ("forward_gqa_ragged_alibi", 1), ("forward_d256_softcap_float16", 1),
    ("forward_d80_documents", 1), ("forward_d64_bias_blocks", 1),
    ("forward_d32_bias_blocks", 1), ("backward_d64_bias_blocks", 2),
    ("backward_d96_bias_blocks", 3), ("backward_d32_pair_bias", 3),
    ("backward_d64_trained_bias", 3), ("backward_d128_bias_blocks", 3),
    ("backward_d128_trained_bias", 3),
    ("backward_d64_causal", 2), ("backward_d128_causal", 3),
    ("backward_d128_alibi_slopes", 3), ("backward_d64_t5_table", 3),
    ("paged_prefill_d128_page64", 1), ("latent_decode", 1),
    ("forward_d128_sinks_gate_row_max", 1), ("forward_d192", 1),
    ("backward_d64_deterministic", 3), ("backward_d64_alibi_slopes", 2),
    ("paged_prefill_d64_page16", 1), ("latent_decode_page64", 1)])
def test_mosaic_kernels_lower_for_hopper(case, kernels):
    """The Mosaic GPU kernels lower for an H100 on this machine (`capture_mosaic`):
    interpret mode skips what only lowering runs (register counts, layout casts, the
    kernel's MLIR), so a change that breaks it shows here before a GPU session. Each
    case launches as many Mosaic kernels as it should (none fell back to Triton), and
    lowering the same call twice gives the same kernels."""
    function, shapes = _mosaic_case(case)
    digests = inspect_kernels.capture_mosaic([(function, shapes)])
    assert len(digests) == kernels, digests
    assert inspect_kernels.capture_mosaic([(function, shapes)]) == digests
