"""The benchmark suites: shapes and attention variants, shared by every framework.

Everything here is plain data plus numpy, so the JAX and the PyTorch benchmark (which
run in separate processes and must not import each other's framework) build their
inputs, document ids and ALiBi slopes from the same seeds and get the same numbers.
Each variant is described once, as data; `jax_bench.py` turns it into jnp mods and
`torch_bench.py` into torch mods.

FLOP convention: a forward pass costs `4 * B * Hq * S * S * D * density` FLOPs (two
matmuls of `2 * S * S * D` each per head), where `density` is the exact fraction of
(q, kv) pairs the mask allows, computed analytically per query row below. That counts
FLOPs on the unmasked share only, as PyTorch FlexAttention's reported TFLOP/s do:
block-sparse skipping does not inflate the throughput, and masked-out work that a
kernel still performs inside partial blocks earns no credit. A forward-and-backward
step counts 3.5 times that (the FlashAttention convention: the backward pass is 2.5
forwards, five matmuls against the forward's two).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

INPUT_SEED = 0        # q, k, v and the cotangent d_out (different streams of it)
DOCUMENT_SEED = 1234  # document lengths of the "document" variant
SAMPLE_SEED = 7       # output positions compared across frameworks
NUM_SAMPLES = 256


# -- shapes ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """Self-attention of `q [B, S, Hq, D]` against `k, v [B, S, Hkv, D]`."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    seq_len: int
    head_dim: int

    @property
    def is_gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    @property
    def label(self) -> str:
        """Compact table label: B x Hq[/Hkv] x S x D."""
        heads = f"{self.q_heads}/{self.kv_heads}" if self.is_gqa else f"{self.q_heads}"
        return f"{self.batch}x{heads}x{self.seq_len}x{self.head_dim}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


FORWARD_SHAPES = (
    Shape("b4_s4096_d128", 4, 16, 16, 4096, 128),
    Shape("b1_s16384_d128", 1, 16, 16, 16384, 128),
    Shape("b8_s2048_d64", 8, 16, 16, 2048, 64),
    Shape("gqa_b4_s4096_d128", 4, 32, 8, 4096, 128),
)

# Never part of a suite run by default; selected by name for CPU smoke tests.
EXTRA_SHAPES = (
    Shape("tiny", 1, 2, 2, 256, 64),
    Shape("tiny_gqa", 1, 4, 2, 256, 64),
)


# -- variants ---------------------------------------------------------------------------

NO_MASK, CAUSAL, SLIDING_WINDOW, PREFIX_LM, DOCUMENT = (
    "none", "causal", "sliding_window", "prefix_lm", "document")
NO_SCORE, ALIBI, SOFTCAP = "none", "alibi", "softcap"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One attention variant, described once for every framework.

    mask: NO_MASK; CAUSAL (kv <= q); SLIDING_WINDOW (causal, kv in (q - window, q]);
      PREFIX_LM (kv < prefix or kv <= q); DOCUMENT (`num_documents` packed documents,
      causal within a document; ids from `document_ids`).
    score: NO_SCORE; ALIBI (score + slope[h] * (kv - q), standard slopes for Hq heads);
      SOFTCAP (cap * tanh(score / cap)).
    """

    name: str
    mask: str = NO_MASK
    score: str = NO_SCORE
    window: int | None = None
    prefix: int | None = None
    num_documents: int | None = None
    softcap: float | None = None

    @property
    def is_causal(self) -> bool:
        """Causal-like: no query sees a later key."""
        return self.mask in (CAUSAL, SLIDING_WINDOW, DOCUMENT)

    @property
    def cudnn_expressible(self) -> bool:
        """Whether `jax.nn.dot_product_attention(implementation="cudnn")` can run it:
        no mask, causal, or a causal sliding window, and no score_mod."""
        return self.score == NO_SCORE and self.mask in (NO_MASK, CAUSAL, SLIDING_WINDOW)

    @property
    def mha_expressible(self) -> bool:
        """Whether JAX's Pallas Triton `mha` (jax.experimental.pallas.ops.gpu.attention)
        can run it: no mask, causal, or documents (`segment_ids` with `causal=True`), and
        no score_mod. It has no GQA either; that is the shape's business."""
        return self.score == NO_SCORE and self.mask in (NO_MASK, CAUSAL, DOCUMENT)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


FORWARD_VARIANTS = (
    Variant("noop"),
    Variant("causal", mask=CAUSAL),
    Variant("sliding_window_1024", mask=SLIDING_WINDOW, window=1024),
    Variant("document", mask=DOCUMENT, num_documents=12),
    Variant("prefix_lm_1024", mask=PREFIX_LM, prefix=1024),
    Variant("alibi", mask=CAUSAL, score=ALIBI),
    Variant("softcap_30", mask=CAUSAL, score=SOFTCAP, softcap=30.0),
)


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    shapes: tuple[Shape, ...]
    variants: tuple[Variant, ...]


SUITES = {"forward": Suite("forward", FORWARD_SHAPES, FORWARD_VARIANTS)}


# -- modes ------------------------------------------------------------------------------

# What one timed call does:
#   fwd     — the attention output;
#   fwd_bwd — the output and the gradients dq, dk, dv of `sum(out * d_out)` (the vector-
#             Jacobian product with a fixed random bf16 cotangent d_out, `make_cotangent`)
#             in one step: JAX `jax.vjp`, torch `torch.autograd.grad(out, (q, k, v), d_out)`.
# A new mode needs a step builder in jax_bench.STEP_BUILDERS and torch_bench.STEP_BUILDERS,
# its FLOP factor in _MODE_FLOP_FACTOR and its file suffix in MODE_FILE_SUFFIX.
MODES = ("fwd", "fwd_bwd")
IMPLEMENTED_MODES = ("fwd", "fwd_bwd")
# Multiples of the forward FLOPs (the FlashAttention convention: backward = 2.5 x forward).
_MODE_FLOP_FACTOR = {"fwd": 1.0, "fwd_bwd": 3.5}
# Result files are <date>-<device>-<suite><suffix>.json: forward.json, forward_backward.json.
MODE_FILE_SUFFIX = {"fwd": "", "fwd_bwd": "_backward"}


def needs_cotangent(mode: str) -> bool:
    """Whether a mode's step takes the cotangent d_out."""
    return mode == "fwd_bwd"


def flop_convention(mode: str) -> str:
    """One line stating how a mode's FLOPs are counted (table header and JSON)."""
    forward = "4*B*Hq*S^2*D*density"
    factor = _MODE_FLOP_FACTOR[mode]
    counted = forward if factor == 1.0 else (
        f"{factor:g} * {forward} (forward + backward, backward = 2.5 x forward: the "
        "FlashAttention convention)")
    return (f"TFLOP/s = {counted} / time; density = exact fraction of (q, kv) pairs the "
            "mask allows (FLOPs counted on the unmasked share, as PyTorch FlexAttention "
            "reports)")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {MODES}, got {mode!r}")
    if mode not in IMPLEMENTED_MODES:
        raise NotImplementedError(
            f"--mode {mode} is not implemented yet (implemented: {IMPLEMENTED_MODES}). To "
            "add it, give jax_bench.STEP_BUILDERS and torch_bench.STEP_BUILDERS a builder "
            "for it and list it in suites.IMPLEMENTED_MODES.")


# -- data shared by both frameworks -------------------------------------------------------

def document_ids(seq_len: int, num_documents: int, seed: int = DOCUMENT_SEED) -> np.ndarray:
    """int32 [seq_len]: `num_documents` packed documents of roughly equal length
    (each within +-25% of seq_len / num_documents), ids 0, 1, ... in order."""
    if seq_len < 2 * num_documents:
        raise ValueError(f"seq_len {seq_len} is too short for {num_documents} documents")
    weights = np.random.default_rng(seed).uniform(0.75, 1.25, num_documents)
    ends = np.round(np.cumsum(weights) / weights.sum() * seq_len).astype(np.int64)
    ends[-1] = seq_len
    return np.searchsorted(ends, np.arange(seq_len), side="right").astype(np.int32)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """float32 [num_heads]: the standard ALiBi slopes (Press et al.; the reference
    `get_slopes`): `2 ** (-8 (h + 1) / n)` for a power of two n, else interleaved."""
    def power_of_two(n):
        first = 2.0 ** (-8.0 / n)
        return [first ** (h + 1) for h in range(n)]

    def slopes(n):
        if n & (n - 1) == 0:
            return power_of_two(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_two(closest) + slopes(2 * closest)[0::2][:n - closest]

    return np.asarray(slopes(num_heads), dtype=np.float32)


def variant_tables(variant: Variant, shape: Shape) -> dict[str, np.ndarray]:
    """The arrays a variant's mods close over (numpy; each framework converts them)."""
    tables = {}
    if variant.mask == DOCUMENT:
        tables["document_ids"] = document_ids(shape.seq_len, variant.num_documents)
    if variant.score == ALIBI:
        tables["slopes"] = alibi_slopes(shape.q_heads)
    return tables


def make_inputs(shape: Shape, seed: int = INPUT_SEED):
    """float32 q [B, S, Hq, D], k, v [B, S, Hkv, D], standard normal (never zeros), in
    pallas_flex's layout. Both frameworks cast the same numbers to bf16."""
    def normal(which, heads):
        rng = np.random.default_rng([seed, which])
        return rng.standard_normal(
            (shape.batch, shape.seq_len, heads, shape.head_dim), dtype=np.float32)

    return normal(0, shape.q_heads), normal(1, shape.kv_heads), normal(2, shape.kv_heads)


def make_cotangent(shape: Shape, seed: int = INPUT_SEED) -> np.ndarray:
    """float32 d_out [B, S, Hq, D] (the output's shape), standard normal, for fwd_bwd:
    the step computes the gradients of `sum(out * d_out)`. A stream of its own, so q, k,
    v are the same numbers in both modes; both frameworks cast it to bf16."""
    rng = np.random.default_rng([seed, 3])
    return rng.standard_normal(
        (shape.batch, shape.seq_len, shape.q_heads, shape.head_dim), dtype=np.float32)


def sample_positions(shape: Shape, count: int = NUM_SAMPLES, seed: int = SAMPLE_SEED):
    """Four int64 arrays (b, s, h, d) indexing `count` output elements in the
    [B, S, Hq, D] layout; both frameworks report the output there, so a run can check
    that they computed the same function on the same inputs."""
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, size, count) for size in
                 (shape.batch, shape.seq_len, shape.q_heads, shape.head_dim))


def kv_sample_positions(shape: Shape, count: int = NUM_SAMPLES, seed: int = SAMPLE_SEED):
    """`sample_positions` for dk and dv ([B, S, Hkv, D]): the same elements with query
    head h mapped to its KV head h // (Hq / Hkv), as GQA groups them in both frameworks."""
    b, s, h, d = sample_positions(shape, count, seed)
    return b, s, h // (shape.q_heads // shape.kv_heads), d


# -- density and FLOPs ----------------------------------------------------------------------

def allowed_keys_per_query(variant: Variant, shape: Shape) -> np.ndarray:
    """int64 [S]: how many keys each query row may attend to (exact, analytic)."""
    seq_len = shape.seq_len
    q_idx = np.arange(seq_len, dtype=np.int64)
    if variant.mask == NO_MASK:
        return np.full(seq_len, seq_len, np.int64)
    if variant.mask == CAUSAL:
        return q_idx + 1
    if variant.mask == SLIDING_WINDOW:
        return np.minimum(q_idx + 1, variant.window)
    if variant.mask == PREFIX_LM:
        return np.maximum(q_idx + 1, min(variant.prefix, seq_len))
    if variant.mask == DOCUMENT:
        ids = document_ids(seq_len, variant.num_documents)
        starts = np.searchsorted(ids, ids, side="left")  # first position of q's document
        return q_idx - starts + 1
    raise ValueError(f"unknown mask kind {variant.mask!r}")


def mask_density(variant: Variant, shape: Shape) -> float:
    """Exact fraction of the S x S (q, kv) pairs the mask allows."""
    return float(allowed_keys_per_query(variant, shape).sum()) / float(shape.seq_len) ** 2


def dense_mask_numpy(variant: Variant, shape: Shape) -> np.ndarray:
    """bool [S, S], element by element; only for checking the analytic density on
    small shapes (see `self_check`)."""
    q_idx = np.arange(shape.seq_len)[:, None]
    kv_idx = np.arange(shape.seq_len)[None, :]
    if variant.mask == NO_MASK:
        return np.ones((shape.seq_len, shape.seq_len), bool)
    if variant.mask == CAUSAL:
        return q_idx >= kv_idx
    if variant.mask == SLIDING_WINDOW:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < variant.window)
    if variant.mask == PREFIX_LM:
        return (kv_idx < variant.prefix) | (q_idx >= kv_idx)
    if variant.mask == DOCUMENT:
        ids = document_ids(shape.seq_len, variant.num_documents)
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    raise ValueError(f"unknown mask kind {variant.mask!r}")


def flop_count(shape: Shape, density: float, mode: str = "fwd") -> float:
    """FLOPs of one call, counted on the unmasked share (see the module docstring)."""
    check_mode(mode)
    forward = 4.0 * shape.batch * shape.q_heads * shape.seq_len ** 2 * shape.head_dim
    return forward * density * _MODE_FLOP_FACTOR[mode]


def tflops(flops: float, milliseconds: float | None) -> float | None:
    if milliseconds is None or not milliseconds > 0:
        return None
    return flops / (milliseconds * 1e-3) / 1e12


# -- command-line selection (shared by run.py, jax_bench.py, torch_bench.py) ----------------

def add_selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="forward", choices=sorted(SUITES),
                        help="which suite of shapes and variants (default: forward)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape indices (into the suite) or names; "
                             f"extra names for CPU smoke tests: "
                             f"{', '.join(s.name for s in EXTRA_SHAPES)} (default: the suite)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant names or indices (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="only the first selected shape")
    parser.add_argument("--mode", default="fwd", choices=MODES,
                        help="what one timed call does: fwd (the output) or fwd_bwd "
                             "(the output and dq, dk, dv for a fixed cotangent d_out); "
                             "default fwd")


def _pick(spec: str | None, items, extra=(), what="item"):
    if spec is None:
        return list(items)
    by_name = {item.name: item for item in (*items, *extra)}
    chosen = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        if token.isdigit():
            index = int(token)
            if index >= len(items):
                raise ValueError(f"{what} index {index} out of range: the suite has "
                                 f"{len(items)} ({', '.join(i.name for i in items)})")
            chosen.append(items[index])
        elif token in by_name:
            chosen.append(by_name[token])
        else:
            raise ValueError(f"unknown {what} {token!r}; expected an index or one of "
                             f"{', '.join(by_name)}")
    if not chosen:
        raise ValueError(f"--{what}s selected nothing")
    return list(dict.fromkeys(chosen))  # unique, in the order given


def select(args) -> tuple[Suite, list[Shape], list[Variant]]:
    """The suite, shapes and variants chosen by `add_selection_args` options."""
    suite = SUITES[args.suite]
    shapes = _pick(args.shapes, suite.shapes, EXTRA_SHAPES, "shape")
    if args.quick:
        shapes = shapes[:1]
    variants = _pick(args.variants, suite.variants, (), "variant")
    return suite, shapes, variants


def selection_argv(args) -> list[str]:
    """The selection options again, as argv for a subprocess."""
    argv = ["--suite", args.suite, "--mode", args.mode]
    if args.shapes is not None:
        argv += ["--shapes", args.shapes]
    if args.variants is not None:
        argv += ["--variants", args.variants]
    if args.quick:
        argv.append("--quick")
    return argv


# -- self check -------------------------------------------------------------------------------

def self_check() -> None:
    """Analytic densities equal element-by-element counts on small shapes."""
    for seq_len in (256, 300, 2048):
        shape = Shape("check", 1, 1, 1, seq_len, 64)
        for variant in FORWARD_VARIANTS:
            exact = dense_mask_numpy(variant, shape).sum(axis=1)
            analytic = allowed_keys_per_query(variant, shape)
            if not np.array_equal(exact, analytic):
                raise AssertionError(f"density of {variant.name} at S={seq_len} is wrong")
    slopes = alibi_slopes(8)
    assert np.allclose(slopes, [2.0 ** -(h + 1) for h in range(8)]), slopes


if __name__ == "__main__":
    self_check()
    print("analytic densities match dense counts")
    for shape in FORWARD_SHAPES + EXTRA_SHAPES:
        densities = ", ".join(f"{v.name}={mask_density(v, shape):.4f}"
                              for v in FORWARD_VARIANTS)
        print(f"{shape.name:>20}: {densities}")
