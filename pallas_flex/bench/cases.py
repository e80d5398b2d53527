"""What the suites measure, as numpy data: shapes, variants, inputs (the same numbers for
every framework) and FLOPs: a forward is `4 * B * Hq * Sq * Skv * D * density`, density the
exact fraction of (q, kv) pairs the mask allows (FLOPs counted on the unmasked share only,
as PyTorch FlexAttention reports them: block-sparse skipping earns no credit of its own);
forward+backward counts 3.5 times that (the FlashAttention convention).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

INPUT_SEED, DOCUMENT_SEED, SAMPLE_SEED, NUM_SAMPLES = 0, 1234, 7, 256


@dataclasses.dataclass(frozen=True)
class Shape:
    """q [B, Sq, Hq, D] against k, v [B, Skv, Hkv, D or Dv]; Sq = q_len or Skv."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    value_dim: int | None = None
    q_len: int | None = None
    scale: float | None = None

    @property
    def queries(self) -> int:
        return self.seq_len if self.q_len is None else self.q_len

    @property
    def dv(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def kv_bytes(self) -> int:
        """Bytes of bf16 K and V: what a decode step must read at least once."""
        return self.batch * self.seq_len * self.kv_heads * (self.head_dim + self.dv) * 2


@dataclasses.dataclass(frozen=True)
class Variant:
    """mask: none | causal | sliding (window) | prefix (prefix) | document (documents);
    score: none | alibi | softcap (cap). Decode shapes place the one query at Skv - 1."""

    name: str
    mask: str = "none"
    score: str = "none"
    window: int = 1024
    prefix: int = 1024
    documents: int = 12
    cap: float = 30.0

    @property
    def cudnn_expressible(self) -> bool:
        return self.score == "none" and self.mask in ("none", "causal", "sliding")


VARIANTS = (
    Variant("noop"), Variant("causal", "causal"),
    Variant("sliding_window_1024", "sliding"), Variant("document", "document"),
    Variant("prefix_lm_1024", "prefix"), Variant("alibi", "causal", "alibi"),
    Variant("softcap_30", "causal", "softcap"),
)
ATTENTION_SHAPES = (
    Shape("b4_s4096_d128", 4, 16, 16, 4096, 128),
    Shape("b1_s16384_d128", 1, 16, 16, 16384, 128),
    Shape("b8_s2048_d64", 8, 16, 16, 2048, 64),
    Shape("gqa_b4_s4096_d128", 4, 32, 8, 4096, 128),
)
# Absorbed MLA (DeepSeek-V2/V3): scores over the 512-d latent plus the 64-d rope key, with
# the softmax scale of the un-absorbed 192-d query-key head.
DECODE_SHAPES = (  # the longest last: torch.compile takes minutes there
    Shape("decode_b8_s16384", 8, 32, 8, 16384, 128, q_len=1),
    Shape("mla_b8_s8192", 8, 128, 1, 8192, 576, 512, 1, 1 / math.sqrt(192)),
    Shape("mla_b1_s32768", 1, 128, 1, 32768, 576, 512, 1, 1 / math.sqrt(192)),
    Shape("decode_b1_s131072", 1, 32, 8, 131072, 128, q_len=1),
)
# Decode: noop is the plainest call (no BlockMask at all); causal_in_call builds the
# offset-causal BlockMask inside the timed call, causal passes one built outside.
DECODE_VARIANTS = tuple(v for v in VARIANTS if v.name in ("noop", "causal")) + (
    Variant("causal_in_call", "causal"),) + tuple(
    v for v in VARIANTS if v.name in ("alibi", "softcap_30"))
# --quick: shapes a CPU runs in seconds with the XLA backend.
# Shapes the attention suites and `bench.ab` run only when named (--shapes): head dim 32
# (Evoformer's, small models'), for its kernels' own A/B and peer rows.
EXTRA_ATTENTION_SHAPES = (Shape("b8_s2048_d32", 8, 16, 16, 2048, 32),
                          Shape("b4_s4096_d32", 4, 16, 16, 4096, 32))
QUICK_ATTENTION_SHAPES = (Shape("tiny_gqa", 1, 4, 2, 256, 64),)
QUICK_DECODE_SHAPES = (Shape("tiny_decode", 2, 8, 2, 1024, 64, q_len=1),
                       Shape("tiny_mla", 2, 16, 1, 512, 96, 64, 1, 1 / math.sqrt(48)))



@dataclasses.dataclass(frozen=True)
class VariantCase:
    """A case of the `variants` suite. kind: sinks (forward and forward+backward against
    the call without sinks), sinks_decode (one query, chained steps), differential
    (forward+backward of pf.variants.differential_attention) or gated (Evoformer gated
    self-attention, forward and forward+backward; `rows` MSA rows of `shape.seq_len`
    residues, shape.batch batch elements). `extra` cases run only when named (--shapes):
    the default run fits about 2.5 minutes of H100 time, compiles included."""

    name: str
    kind: str
    shape: Shape
    rows: int = 1
    extra: bool = False


VARIANT_CASES = (
    VariantCase("sinks_b4_s4096_d128", "sinks", Shape("b4_s4096_d128", 4, 16, 16, 4096, 128)),
    VariantCase("sinks_decode_b8_s16384", "sinks_decode",
                Shape("decode_b8_s16384", 8, 32, 8, 16384, 128, q_len=1)),
    VariantCase("differential_b4_s4096_d128", "differential",
                Shape("b4_s4096_d128", 4, 16, 16, 4096, 128)),
    VariantCase("differential_b4_s4096_d64", "differential",
                Shape("b4_s4096_d64", 4, 16, 16, 4096, 64), extra=True),
    # Flashlight's Evoformer shapes: 256 MSA rows of 256 residues, 8 heads.
    VariantCase("gated_r256_s256_d32", "gated", Shape("r256_s256_h8_d32", 1, 8, 8, 256, 32),
                rows=256),
    VariantCase("gated_r256_s256_d64", "gated", Shape("r256_s256_h8_d64", 1, 8, 8, 256, 64),
                rows=256, extra=True),
    VariantCase("gated_r256_s256_d128", "gated", Shape("r256_s256_h8_d128", 1, 8, 8, 256, 128),
                rows=256, extra=True),
)
QUICK_VARIANT_CASES = (
    VariantCase("sinks_tiny", "sinks", Shape("tiny_s256", 1, 4, 4, 256, 64)),
    VariantCase("sinks_decode_tiny", "sinks_decode",
                Shape("tiny_decode", 2, 8, 2, 1024, 64, q_len=1)),
    VariantCase("differential_tiny", "differential", Shape("tiny_s256", 1, 4, 4, 256, 64)),
    VariantCase("gated_tiny", "gated", Shape("r8_s64_h2_d32", 1, 2, 2, 64, 32), rows=8),
)

def document_ids(seq_len: int, documents: int) -> np.ndarray:
    """int32 [S]: `documents` packed documents, each within +-25% of S / documents."""
    weights = np.random.default_rng(DOCUMENT_SEED).uniform(0.75, 1.25, documents)
    ends = np.round(np.cumsum(weights) / weights.sum() * seq_len).astype(np.int64)
    ends[-1] = seq_len
    return np.searchsorted(ends, np.arange(seq_len), side="right").astype(np.int32)


def normal(shape: tuple, stream: int) -> np.ndarray:
    """float32 standard normal from (INPUT_SEED, stream): the same numbers everywhere."""
    return np.random.default_rng([INPUT_SEED, stream]).standard_normal(shape, np.float32)


def inputs(shape: Shape):
    """float32 q, k, v and the cotangent d_out, in pallas_flex's [B, S, H, D] layout."""
    b, s = shape.batch, shape.seq_len
    return (normal((b, shape.queries, shape.q_heads, shape.head_dim), 0),
            normal((b, s, shape.kv_heads, shape.head_dim), 1),
            normal((b, s, shape.kv_heads, shape.dv), 2),
            normal((b, shape.queries, shape.q_heads, shape.dv), 3))


def sample_positions(shape: Shape, kv: bool = False):
    """(b, s, h, d) indices of NUM_SAMPLES elements of out/dq, or (`kv`) of dk/dv with the
    query head mapped to its KV head: both frameworks report these, so a run checks that
    they computed the same function."""
    rng = np.random.default_rng(SAMPLE_SEED)
    b, s, h, d = (rng.integers(0, n, NUM_SAMPLES) for n in
                  (shape.batch, shape.queries, shape.q_heads, shape.dv))
    return (b, s, h // (shape.q_heads // shape.kv_heads), d) if kv else (b, s, h, d)


def allowed_keys(variant: Variant, shape: Shape) -> np.ndarray:
    """int64 [Sq]: how many keys each query may attend to (exact; queries at the end)."""
    skv = shape.seq_len
    q = np.arange(skv - shape.queries, skv, dtype=np.int64)
    if variant.mask == "none":
        return np.full(q.shape, skv)
    if variant.mask == "causal":
        return q + 1
    if variant.mask == "sliding":
        return np.minimum(q + 1, variant.window)
    if variant.mask == "prefix":
        return np.maximum(q + 1, min(variant.prefix, skv))
    ids = document_ids(skv, variant.documents)
    return q - np.searchsorted(ids, ids[q], side="left") + 1


def flops(variant: Variant, shape: Shape, mode: str) -> float:
    pairs = float(allowed_keys(variant, shape).sum())
    forward = 2.0 * shape.batch * shape.q_heads * pairs * (shape.head_dim + shape.dv)
    return forward * (3.5 if mode == "fwd_bwd" else 1.0)
