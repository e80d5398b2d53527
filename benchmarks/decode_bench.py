"""Decode benchmark: one query token per request against a long KV cache.

    PYTHONPATH=$PWD python3 -m benchmarks.decode_bench [--rows decode,mla,cascade]
        [--variants noop,causal,alibi,softcap] [--shapes b8_s16384] [--torch/--no-torch]
        [--timeout 300] [--out results.json] [--append] [--dry-run]

Rows (bf16; Sq = 1; see benchmarks/README.md, "Decode"):
  decode   Hq 32, Hkv 8, D 128 at (B 8, S 16384) and (B 1, S 131072); variants noop,
           causal (the query at position S - 1: `offset(causal_mask, positions)`), alibi
           and softcap (both causal). Columns: ours (`pf.attention`), cuDNN
           (`jax.nn.dot_product_attention(implementation="cudnn")`, noop and causal), JAX's
           Pallas `paged_attention` on a paged copy of the cache, torch FlexAttention.
  mla      absorbed MLA decode: Hq 128 over one KV head, D 576 for scores, Dv 512,
           B in {1, 8}, S in {8192, 32768}; same columns.
  cascade  16 requests sharing a 4096-token prefix with 256-token suffixes:
           `pf.cascade_attention` against `pf.attention` over each request's concatenated
           prefix + suffix.
  paged    a hook for paged-cache rows (`jax_paged_rows`), not filled in yet.

Every (row group, shape) runs its JAX columns in a fresh subprocess, and every torch row
in one of its own (`torch.compile` at S = 131072 takes minutes), each under `--timeout`
seconds; a subprocess writes its rows as JSON lines as it finishes them, so a timeout
loses only the rows not yet done. JAX subprocesses run with
`XLA_PYTHON_CLIENT_PREALLOCATE=false` (torch shares the GPU). Achieved bandwidth is the
bytes of K and V the call is given, `B * S * Hkv * (D + Dv) * 2`, over its time.

`--dry-run` runs tiny shapes on any device with backend "xla" (JAX's paged kernel in
interpret mode, no cuDNN, no torch): it checks the harness, not the speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

from benchmarks import run as bench_run  # jax-free: provenance helpers, result paths
from benchmarks import suites  # numpy only: ALiBi slopes

INPUT_SEED = 0
SAMPLE_SEED = 7       # output elements compared with torch (computed in another process)
NUM_SAMPLES = 256
SOFTCAP = 30.0
BYTES_PER_ELEMENT = 2  # bf16
# Above this, two implementations disagree by more than bf16 rounding explains (outputs
# are averages of N(0, 1) values, where one bf16 ulp is <= 1/64).
DISAGREEMENT = 0.05


# -- shapes and variants (plain data; both frameworks build their inputs from these) ---------

@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """`q [B, 1, Hq, D]` against `k [B, S, Hkv, D]`, `v [B, S, Hkv, Dv]`."""

    name: str
    batch: int
    seq_len: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    value_dim: int = 128
    scale: float | None = None  # None: 1/sqrt(D)

    @property
    def label(self) -> str:
        dims = (f"{self.head_dim}" if self.head_dim == self.value_dim
                else f"{self.head_dim}/{self.value_dim}")
        return f"B{self.batch} S{self.seq_len} H{self.q_heads}/{self.kv_heads} D{dims}"

    @property
    def kv_bytes(self) -> int:
        return (self.batch * self.seq_len * self.kv_heads * (self.head_dim + self.value_dim)
                * BYTES_PER_ELEMENT)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.label, "kv_bytes": self.kv_bytes}


@dataclasses.dataclass(frozen=True)
class CascadeShape:
    """`batch` requests, one decode query each, sharing `prefix_len` tokens, each with
    `suffix_len` tokens of its own."""

    name: str
    batch: int
    prefix_len: int
    suffix_len: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def label(self) -> str:
        return (f"B{self.batch} P{self.prefix_len}+L{self.suffix_len} "
                f"H{self.q_heads}/{self.kv_heads} D{self.head_dim}")

    def _bytes(self, tokens: int) -> int:
        return tokens * self.kv_heads * 2 * self.head_dim * BYTES_PER_ELEMENT

    @property
    def cascade_bytes(self) -> int:
        """K/V bytes the cascade call is given: the prefix once, every suffix."""
        return self._bytes(self.prefix_len + self.batch * self.suffix_len)

    @property
    def concatenated_bytes(self) -> int:
        """K/V bytes of the per-request concatenation: the prefix B times."""
        return self._bytes(self.batch * (self.prefix_len + self.suffix_len))

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.label,
                "cascade_bytes": self.cascade_bytes,
                "concatenated_bytes": self.concatenated_bytes}


# Absorbed MLA (DeepSeek-V2/V3): scores over the 512-d latent plus the 64-d rope key, with
# the softmax scale of the un-absorbed 192-d query-key head.
MLA = {"q_heads": 128, "kv_heads": 1, "head_dim": 576, "value_dim": 512,
       "scale": 1.0 / math.sqrt(192)}

DECODE_VARIANTS = ("noop", "causal", "alibi", "softcap")
CASCADE_VARIANTS = ("full", "ragged")
CUDNN_VARIANTS = ("noop", "causal")
PAGED_VARIANTS = ("noop", "causal", "softcap")  # JAX's paged kernel: lengths, soft-cap


@dataclasses.dataclass(frozen=True)
class Group:
    shapes: tuple
    dry_run_shapes: tuple
    variants: tuple
    torch: bool  # whether torch FlexAttention rows exist


GROUPS = {
    "decode": Group(
        shapes=(DecodeShape("b8_s16384", 8, 16384), DecodeShape("b1_s131072", 1, 131072)),
        dry_run_shapes=(DecodeShape("tiny_b2_s1024", 2, 1024, 8, 2, 64, 64),
                        DecodeShape("tiny_b1_s2048", 1, 2048, 8, 2, 64, 64)),
        variants=DECODE_VARIANTS, torch=True),
    "mla": Group(
        shapes=tuple(DecodeShape(f"mla_b{b}_s{s}", b, s, **MLA)
                     for b in (1, 8) for s in (8192, 32768)),
        dry_run_shapes=(DecodeShape("tiny_mla_b2_s512", 2, 512, 16, 1, 96, 64,
                                    1.0 / math.sqrt(48)),),
        variants=("noop",), torch=True),
    "cascade": Group(
        shapes=(CascadeShape("b16_p4096_l256", 16, 4096, 256),),
        dry_run_shapes=(CascadeShape("tiny_b4_p512_l64", 4, 512, 64, 8, 2, 64),),
        variants=CASCADE_VARIANTS, torch=False),
    # HOOK: paged-cache decode rows; see `jax_paged_rows`.
    "paged": Group(shapes=(), dry_run_shapes=(), variants=(), torch=False),
}
DEFAULT_ROWS = ("decode", "mla", "cascade")


def shapes_of(group: str, args) -> tuple:
    shapes = GROUPS[group].dry_run_shapes if args.dry_run else GROUPS[group].shapes
    if args.shapes:
        shapes = tuple(shape for shape in shapes if shape.name in args.shapes)
    return shapes


def variants_of(group: str, args) -> tuple:
    variants = GROUPS[group].variants
    if group == "decode" and args.variants:
        variants = tuple(variant for variant in variants if variant in args.variants)
    return variants


def find_shape(group: str, name: str):
    for shape in GROUPS[group].shapes + GROUPS[group].dry_run_shapes:
        if shape.name == name:
            return shape
    raise ValueError(f"no {group} shape named {name!r}")


# -- inputs (numpy, from fixed seeds: the same numbers in both frameworks) --------------------

def _normal(shape, stream):
    return np.random.default_rng([INPUT_SEED, stream]).standard_normal(shape, np.float32)


def make_decode_inputs(shape: DecodeShape):
    """float32 q [B, 1, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv]."""
    b, s = shape.batch, shape.seq_len
    return (_normal((b, 1, shape.q_heads, shape.head_dim), 0),
            _normal((b, s, shape.kv_heads, shape.head_dim), 1),
            _normal((b, s, shape.kv_heads, shape.value_dim), 2))


def decode_positions(shape: DecodeShape) -> np.ndarray:
    """int32 [B]: each query's position, the cache's last one."""
    return np.full(shape.batch, shape.seq_len - 1, np.int32)


def make_cascade_inputs(shape: CascadeShape):
    """float32 q [B, 1, Hq, D], prefix k, v [1, P, Hkv, D], suffix k, v [B, L, Hkv, D],
    and int32 suffix lengths [B] in [1, L] (the "ragged" variant; one full)."""
    b, hkv, d = shape.batch, shape.kv_heads, shape.head_dim
    lengths = np.random.default_rng([INPUT_SEED, 9]).integers(1, shape.suffix_len + 1, b)
    lengths[0] = shape.suffix_len
    return (_normal((b, 1, shape.q_heads, d), 0),
            _normal((1, shape.prefix_len, hkv, d), 1), _normal((1, shape.prefix_len, hkv, d), 2),
            _normal((b, shape.suffix_len, hkv, d), 3), _normal((b, shape.suffix_len, hkv, d), 4),
            lengths.astype(np.int32))


def sample_positions(shape: DecodeShape):
    """(b, s, h, d) int64 arrays indexing NUM_SAMPLES elements of out [B, 1, Hq, Dv]."""
    rng = np.random.default_rng(SAMPLE_SEED)
    return tuple(rng.integers(0, size, NUM_SAMPLES)
                 for size in (shape.batch, 1, shape.q_heads, shape.value_dim))


def tb_per_s(num_bytes: int, ms: float | None) -> float | None:
    if ms is None or not ms > 0:
        return None
    return num_bytes / (ms * 1e-3) / 1e12


# -- the JAX side (runs in a child process) ------------------------------------------------------

def jax_decode_mods(variant: str, positions, slopes):
    """(mask_mod, score_mod) of a decode variant; queries sit at `positions` [B]."""
    import pallas_flex as pf

    causal = pf.masks.offset(pf.masks.causal_mask, positions)
    if variant == "noop":
        return None, None
    if variant == "causal":
        return causal, None
    if variant == "alibi":
        return causal, pf.masks.offset_score(pf.masks.alibi(slopes), positions)
    if variant == "softcap":
        return causal, pf.masks.tanh_softcap(SOFTCAP)
    raise ValueError(f"unknown decode variant {variant!r}")


def _ours_block_mask(q, k, positions, slopes, *, variant):
    """The step's BlockMask, built once outside the timed call (a model builds it once
    per decode step and shares it across its layers, as torch's side does)."""
    import pallas_flex as pf

    mask_mod, _ = jax_decode_mods(variant, positions, slopes)
    if mask_mod is None:
        return pf.create_block_mask(None, None, None, q.shape[1], k.shape[1])
    return pf.create_block_mask(mask_mod, q.shape[0], None, q.shape[1], k.shape[1])


def _ours_decode(q, k, v, block_mask, positions, slopes, *, variant, scale, backend):
    import pallas_flex as pf

    _, score_mod = jax_decode_mods(variant, positions, slopes)
    return pf.flex_attention(q, k, v, score_mod, block_mask, scale=scale, backend=backend)


def _cudnn_decode(q, k, v, positions, *, variant, scale):
    """cuDNN through jax.nn. Causal decode is bottom-right aligned (the one query is the
    last position), which jax.nn's `is_causal` (top-left) is not: it is expressed as a
    padding mask, each query seeing `positions + 1` keys."""
    import jax
    import jax.numpy as jnp

    if variant == "noop":
        return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn")
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, query_seq_lengths=jnp.ones(q.shape[0], jnp.int32),
        key_value_seq_lengths=positions + 1, implementation="cudnn")


def _paged_module():
    """JAX's Pallas Triton paged attention module, or the reason it is unavailable."""
    try:
        with warnings.catch_warnings():  # The module warns that it is deprecated.
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import paged_attention
        return paged_attention, None
    except Exception as error:
        return None, bench_run.error_text(error)


def to_paged_layout(k, v, page_size: int, seed: int = INPUT_SEED):
    """k, v [B, S, Hkv, D] -> k_pages, v_pages [Hkv, B*S/page_size, page_size, D] with the
    pages in a seeded random physical order, and block_tables [B, S/page_size] int32."""
    import jax.numpy as jnp

    batch, seq_len, kv_heads, head_dim = k.shape
    pages_per_sequence = seq_len // page_size
    num_pages = batch * pages_per_sequence
    physical = np.random.default_rng([seed, 5]).permutation(num_pages)  # logical -> physical
    logical_at = jnp.asarray(np.argsort(physical))  # physical -> logical

    def pages(x):
        logical = x.reshape(num_pages, page_size, kv_heads, x.shape[-1])
        return jnp.transpose(logical[logical_at], (2, 0, 1, 3))

    block_tables = jnp.asarray(physical.reshape(batch, pages_per_sequence), jnp.int32)
    return pages(k), pages(v), block_tables


def _paged_decode(q, k_pages, v_pages, block_tables, lengths, *, module, scale, soft_cap,
                  interpret):
    """JAX's paged_attention on q [B, 1, Hq, D]. It applies no softmax scale: q is scaled
    first (so its soft-cap acts on scaled scores, as ours does)."""
    import jax.numpy as jnp

    query = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)  # [B, Hq, D]
    out = module.paged_attention(query, k_pages, v_pages, block_tables, lengths,
                                 attn_logits_soft_cap=soft_cap, interpret=interpret)
    return out[:, None]


class JaxRows:
    """Shared by the JAX row builders: timing, comparisons, what the child emits."""

    def __init__(self, args, emit):
        import jax

        from benchmarks import jax_bench

        self.args = args
        self.emit = emit
        self.on_gpu = jax.devices()[0].platform == "gpu"
        self.backend = "xla" if args.dry_run else (args.backend or _default_backend())
        self._time_calls = jax_bench.time_calls

    def timed(self, fn, fn_args, num_bytes):
        entry, out = self._time_calls(fn, fn_args, iters=self.args.iters,
                                      repeats=self.args.repeats,
                                      budget_s=self.args.time_budget_s)
        entry["tb_per_s"] = tb_per_s(num_bytes, entry["ms"])
        return entry, out

    def reference(self, row, name, build, fn_args, num_bytes, ours_out):
        """Times one other implementation and compares its output with ours."""
        import jax.numpy as jnp

        try:
            row[name], out = self.timed(build(), fn_args, num_bytes)
            if ours_out is not None:
                difference = jnp.abs(out.astype(jnp.float32) - ours_out.astype(jnp.float32))
                row[name]["max_abs_diff_vs_ours"] = float(jnp.max(difference))
        except Exception as error:
            row[name] = {"status": "unsupported", "error": bench_run.error_text(error)}
            traceback.print_exc()


def _default_backend():
    import pallas_flex as pf

    return pf.default_backend()


def jax_decode_rows(shape: DecodeShape, variants, rows: JaxRows):
    """Rows of the decode and mla groups: ours, cuDNN, JAX's paged attention."""
    import jax
    import jax.numpy as jnp

    args = rows.args
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in make_decode_inputs(shape))
    positions = jnp.asarray(decode_positions(shape))
    slopes = jnp.asarray(suites.alibi_slopes(shape.q_heads))
    samples = tuple(jnp.asarray(index) for index in sample_positions(shape))
    scale = shape.softmax_scale
    paged_module, paged_missing = _paged_module()
    paged_inputs = None
    paged_fits = (shape.head_dim == shape.value_dim
                  and shape.seq_len % (args.page_size * 16) == 0)  # its k_splits = 16
    for variant in variants:
        print(f"[jax] {shape.name} {variant} ...", file=sys.stderr, flush=True)
        row = {"shape": shape.as_dict(), "variant": variant, "ours_backend": rows.backend}
        ours_out = None
        try:
            ours = jax.jit(functools.partial(_ours_decode, variant=variant, scale=scale,
                                             backend=rows.backend))
            block_mask = _ours_block_mask(q, k, positions, slopes, variant=variant)
            row["ours"], ours_out = rows.timed(ours, (q, k, v, block_mask, positions, slopes),
                                               shape.kv_bytes)
            row["ours_samples"] = np.asarray(
                ours_out[samples].astype(jnp.float32)).tolist()
        except Exception as error:  # One broken variant must not end the run.
            row["ours"] = {"error": bench_run.error_text(error)}
            traceback.print_exc()

        if not rows.on_gpu:
            row["cudnn"] = {"status": "n/a", "reason": "no GPU"}
        elif variant not in CUDNN_VARIANTS:
            row["cudnn"] = {"status": "inexpressible", "reason": "no score_mod in cuDNN"}
        else:
            rows.reference(row, "cudnn", lambda: jax.jit(functools.partial(
                _cudnn_decode, variant=variant, scale=scale)), (q, k, v, positions),
                shape.kv_bytes, ours_out)

        if paged_module is None:
            row["paged"] = {"status": "n/a", "reason": paged_missing}
        elif not rows.on_gpu and not args.dry_run:
            row["paged"] = {"status": "n/a", "reason": "no GPU"}
        elif variant not in PAGED_VARIANTS or not paged_fits:
            row["paged"] = {"status": "inexpressible", "reason": (
                "no ALiBi in JAX's paged_attention" if variant not in PAGED_VARIANTS else
                "JAX's paged_attention needs Dv == D and S a multiple of 16 pages")}
        else:
            if paged_inputs is None:  # built once per shape, outside the timed calls
                paged_inputs = to_paged_layout(k, v, args.page_size)
            lengths = None if variant == "noop" else positions + 1
            soft_cap = SOFTCAP if variant == "softcap" else None
            rows.reference(row, "paged", lambda: jax.jit(functools.partial(
                _paged_decode, module=paged_module, scale=scale, soft_cap=soft_cap,
                interpret=not rows.on_gpu)), (q, *paged_inputs, lengths), shape.kv_bytes,
                ours_out)
        rows.emit(row)


def _cascade_step(q, prefix_k, prefix_v, suffix_k, suffix_v, lengths, *, ragged, backend):
    import pallas_flex as pf

    suffix_mask = (lambda b, h, q_idx, kv_idx: kv_idx < lengths[b]) if ragged else None
    return pf.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v,
                                suffix_mask_mod=suffix_mask, backend=backend)


def _concatenated_step(q, k, v, lengths, *, ragged, prefix_len, backend):
    import pallas_flex as pf

    mask = ((lambda b, h, q_idx, kv_idx: kv_idx < prefix_len + lengths[b]) if ragged
            else None)
    return pf.attention(q, k, v, mask_mod=mask, backend=backend)


def jax_cascade_rows(shape: CascadeShape, variants, rows: JaxRows):
    """`pf.cascade_attention` against `pf.attention` over the concatenated caches (built
    once, outside the timed calls, as a server without cascade would store them)."""
    import jax
    import jax.numpy as jnp

    host = make_cascade_inputs(shape)
    q, prefix_k, prefix_v, suffix_k, suffix_v = (jnp.asarray(x, jnp.bfloat16)
                                                 for x in host[:5])
    lengths = jnp.asarray(host[5])

    def concatenate(prefix, suffix):
        return jnp.concatenate(
            [jnp.broadcast_to(prefix, (shape.batch, *prefix.shape[1:])), suffix], axis=1)

    k, v = concatenate(prefix_k, suffix_k), concatenate(prefix_v, suffix_v)
    for variant in variants:
        print(f"[jax] {shape.name} {variant} ...", file=sys.stderr, flush=True)
        ragged = variant == "ragged"
        row = {"shape": shape.as_dict(), "variant": variant, "ours_backend": rows.backend}
        outs = {}
        for name, step, step_args, num_bytes in (
                ("cascade", functools.partial(_cascade_step, ragged=ragged,
                                              backend=rows.backend),
                 (q, prefix_k, prefix_v, suffix_k, suffix_v, lengths), shape.cascade_bytes),
                ("concatenated", functools.partial(
                    _concatenated_step, ragged=ragged, prefix_len=shape.prefix_len,
                    backend=rows.backend), (q, k, v, lengths), shape.concatenated_bytes)):
            try:
                row[name], outs[name] = rows.timed(jax.jit(step), step_args, num_bytes)
            except Exception as error:
                row[name] = {"error": bench_run.error_text(error)}
                traceback.print_exc()
        if len(outs) == 2:
            difference = jnp.abs(outs["cascade"].astype(jnp.float32)
                                 - outs["concatenated"].astype(jnp.float32))
            row["max_abs_diff"] = float(jnp.max(difference))
            row["speedup"] = row["concatenated"]["ms"] / row["cascade"]["ms"]
        rows.emit(row)


def jax_paged_rows(shape, variants, rows: JaxRows):
    """HOOK (for the paged kernels): paged-KV-cache decode rows.

    Expected: for each decode shape, build a `pallas_flex.paged.PagedKVCache` holding the
    same K/V as `make_decode_inputs` (pages in a random physical order, as
    `to_paged_layout`), time ours on it against the same call on the contiguous cache (the
    "decode" rows) and JAX's `paged_attention` (`_paged_decode`), and `rows.emit` one row
    per variant with entries "ours", "contiguous", "paged" (`rows.timed` gives ms and
    TB/s). Then give GROUPS["paged"] its shapes and variants (and a table column if
    needed)."""
    del shape, variants, rows


JAX_ROW_BUILDERS = {"decode": jax_decode_rows, "mla": jax_decode_rows,
                    "cascade": jax_cascade_rows, "paged": jax_paged_rows}


def jax_child(args) -> int:
    from benchmarks import jax_bench

    output = Path(args.jsonl_out)

    def emit(record):
        with output.open("a") as file:  # one line per finished row: a timeout keeps them
            file.write(json.dumps(record) + "\n")

    emit({"environment": jax_bench.environment()})
    rows = JaxRows(args, lambda row: emit({"row": {"group": args.group, **row}}))
    shape = find_shape(args.group, args.shape)
    JAX_ROW_BUILDERS[args.group](shape, tuple(args.child_variants.split(",")), rows)
    return 0


# -- the torch side (runs in a child process, one row each; never imports jax) ----------------

TORCH_DEVICE = "cuda"


def torch_environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": bench_run._version("triton"), "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    return env


def torch_decode_mods(variant: str, positions, slopes):
    """(mask_mod or None, score_mod or None): `jax_decode_mods` in torch."""
    import torch

    def causal(b, h, q_idx, kv_idx):
        return q_idx + positions[b] >= kv_idx

    if variant == "noop":
        return None, None
    if variant == "causal":
        return causal, None
    if variant == "alibi":
        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - (q_idx + positions[b]))
        return causal, alibi
    if variant == "softcap":
        def softcap(score, b, h, q_idx, kv_idx):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
        return causal, softcap
    raise ValueError(f"unknown decode variant {variant!r}")


def torch_row(shape: DecodeShape, variant: str, args) -> dict:
    """torch.compile(flex_attention) on the same numbers, [B, H, S, D] layout, a BlockMask
    over [B, 1, 1, S] from a compiled create_block_mask (flex decoding for Sq = 1);
    timed by triton's do_bench (median)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    from benchmarks import torch_bench

    torch_bench.configure_dynamo()

    def to_torch(array):  # [B, S, H, D] float32 -> [B, H, S, D] bf16 on the GPU
        tensor = torch.from_numpy(array).to(device=TORCH_DEVICE, dtype=torch.bfloat16)
        return tensor.permute(0, 2, 1, 3).contiguous()

    row = {"group": args.group, "shape": shape.as_dict(), "variant": variant}
    q, k, v = (to_torch(x) for x in make_decode_inputs(shape))
    positions = torch.from_numpy(decode_positions(shape)).to(TORCH_DEVICE)
    slopes = torch.from_numpy(suites.alibi_slopes(shape.q_heads)).to(TORCH_DEVICE)
    mask_mod, score_mod = torch_decode_mods(variant, positions, slopes)
    start = time.perf_counter()
    block_mask = None
    if mask_mod is not None:
        block_mask = torch.compile(create_block_mask, dynamic=False)(
            mask_mod, shape.batch, None, 1, shape.seq_len, device=TORCH_DEVICE)
        torch.cuda.synchronize()
    row["torch_block_mask_build_s"] = time.perf_counter() - start
    flex = torch.compile(flex_attention, dynamic=False)

    def step():
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                    scale=shape.softmax_scale, enable_gqa=shape.q_heads != shape.kv_heads)

    start = time.perf_counter()
    out = step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    ms = float(do_bench(step, warmup=args.torch_warmup_ms, rep=args.torch_rep_ms,
                        return_mode="median"))
    row["torch"] = {"ms": ms, "compile_s": compile_s, "tb_per_s": tb_per_s(shape.kv_bytes, ms)}
    b, s, h, d = (torch.from_numpy(index).to(TORCH_DEVICE)
                  for index in sample_positions(shape))
    row["torch_samples"] = out[b, h, s, d].float().cpu().tolist()  # out is [B, Hq, 1, Dv]
    return row


def torch_child(args) -> int:
    output = Path(args.jsonl_out)

    def emit(record):
        with output.open("a") as file:
            file.write(json.dumps(record) + "\n")

    import torch

    emit({"environment": torch_environment()})
    if not torch.cuda.is_available():
        emit({"error": "torch sees no CUDA device"})
        return 0
    shape = find_shape(args.group, args.shape)
    try:
        emit({"row": torch_row(shape, args.child_variants, args)})
    except Exception as error:
        traceback.print_exc()
        emit({"error": bench_run.error_text(error)})
    return 0


# -- the parent: subprocesses, merging, the table, the JSON -----------------------------------

def run_child(argv: list[str], env: dict, jsonl: Path, timeout_s: float):
    """Runs `python -m benchmarks.decode_bench argv --jsonl-out jsonl` in a session of its
    own (killed whole, compiler workers included, after `timeout_s`). Returns (failure or
    None, the JSON records it wrote)."""
    command = [sys.executable, "-m", "benchmarks.decode_bench", *argv,
               "--jsonl-out", str(jsonl)]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    process = subprocess.Popen(command, cwd=bench_run.REPO_ROOT, env=env,
                               start_new_session=True)
    try:
        code = process.wait(timeout=timeout_s)
        failure = None if code == 0 else f"exit code {code}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        failure = f"timed out after {timeout_s:g} s (--timeout)"
    records = []
    if jsonl.exists():
        records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return failure, records


def _timing_argv(args) -> list[str]:
    argv = ["--iters", str(args.iters), "--repeats", str(args.repeats),
            "--time-budget-s", str(args.time_budget_s), "--page-size", str(args.page_size),
            "--torch-rep-ms", str(args.torch_rep_ms),
            "--torch-warmup-ms", str(args.torch_warmup_ms)]
    if args.backend:
        argv += ["--backend", args.backend]
    if args.dry_run:
        argv.append("--dry-run")
    return argv


def _key(row) -> tuple:
    return row["group"], row["shape"]["name"], row["variant"]


def run_jax(args, workdir: Path) -> tuple[list[dict], dict]:
    env = bench_run._child_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    rows, environment = [], {}
    for group in args.rows:
        for shape in shapes_of(group, args):
            variants = variants_of(group, args)
            if not variants:
                continue
            jsonl = workdir / f"jax-{group}-{shape.name}.jsonl"
            failure, records = run_child(
                ["--child", "jax", "--group", group, "--shape", shape.name,
                 "--child-variants", ",".join(variants), *_timing_argv(args)],
                env, jsonl, args.timeout)
            environment = environment or next(
                (r["environment"] for r in records if "environment" in r), {})
            done = [r["row"] for r in records if "row" in r]
            rows += done
            finished = {row["variant"] for row in done}
            for variant in variants:
                if variant not in finished:
                    rows.append({"group": group, "shape": shape.as_dict(), "variant": variant,
                                 "jax_failure": failure or "the child wrote no row"})
    return rows, environment


def run_torch(args, workdir: Path, rows: list[dict]) -> dict:
    """Adds a "torch" entry to every decode and mla row; returns torch's environment."""
    if not args.torch:
        for row in rows:
            if GROUPS[row["group"]].torch:
                row["torch"] = {"status": "skipped", "reason": "--no-torch"}
        return {}
    if importlib.util.find_spec("torch") is None:
        for row in rows:
            if GROUPS[row["group"]].torch:
                row["torch"] = {"status": "n/a", "reason": "torch is not importable"}
        return {}
    environment = {}
    for row in rows:
        if not GROUPS[row["group"]].torch:
            continue
        group, shape_name, variant = _key(row)
        jsonl = workdir / f"torch-{group}-{shape_name}-{variant}.jsonl"
        failure, records = run_child(
            ["--child", "torch", "--group", group, "--shape", shape_name,
             "--child-variants", variant, *_timing_argv(args)],
            bench_run._child_env(), jsonl, args.timeout)
        environment = environment or next(
            (r["environment"] for r in records if "environment" in r), {})
        torch_rows = [r["row"] for r in records if "row" in r]
        errors = [r["error"] for r in records if "error" in r]
        if torch_rows:
            for key in ("torch", "torch_samples", "torch_block_mask_build_s"):
                row[key] = torch_rows[0][key]
        elif errors and errors[0] == "torch sees no CUDA device":
            row["torch"] = {"status": "n/a", "reason": errors[0]}
        else:
            row["torch"] = {"status": "timeout" if failure and "timed out" in failure
                            else "error", "error": "; ".join(errors) or failure or "no row"}
    return environment


def add_comparisons(row: dict) -> None:
    """Ratios to ours, and torch's sampled outputs against ours (after merging, so that a
    torch-only run appended to a JAX run's file compares with that run's outputs)."""
    if row["group"] == "cascade":
        return
    ours = bench_run.entry_ms(row.get("ours"))
    for name in ("cudnn", "paged", "torch"):
        row[f"{name}_ms_over_ours_ms"] = bench_run.ms_ratio(
            bench_run.entry_ms(row.get(name)), ours)
    ours_samples, torch_samples = row.get("ours_samples"), row.get("torch_samples")
    if ours_samples and torch_samples and "ms" in row["torch"]:
        row["torch"]["max_abs_diff_vs_ours_samples"] = max(
            abs(a - b) for a, b in zip(ours_samples, torch_samples))


def _bandwidth_cell(entry) -> str:
    value = entry.get("tb_per_s") if isinstance(entry, dict) else None
    return "-" if value is None else f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def _difference_cell(value) -> str:
    return "-" if value is None else f"{value:.4f}" + (" !" if value > DISAGREEMENT else "")


def _render(table: list[list[str]], left: int = 2) -> list[str]:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]

    def render(line):
        return "  ".join(cell.ljust(width) if i < left else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(line, widths)))

    return [render(table[0]), "  ".join("-" * w for w in widths)] + [
        render(line) for line in table[1:]]


def _largest_difference(row):
    differences = [entry[key] for entry, key in (
        (row.get("cudnn") or {}, "max_abs_diff_vs_ours"),
        (row.get("paged") or {}, "max_abs_diff_vs_ours"),
        (row.get("torch") or {}, "max_abs_diff_vs_ours_samples")) if key in entry]
    return max(differences) if differences else None


def format_tables(rows: list[dict]) -> list[str]:
    lines = []
    decode_rows = [row for row in rows if row["group"] != "cascade"]
    if decode_rows:
        table = [["shape", "variant", "ours ms", "ours TB/s", "cuDNN ms", "cuDNN TB/s",
                  "paged ms", "torch ms", "torch TB/s", "cuDNN/ours", "paged/ours",
                  "torch/ours", "max|diff|"]]
        for row in decode_rows:
            ours = row.get("ours") if "ours" in row else {"status": "failed"}
            table.append([
                row["shape"]["label"], row["variant"], bench_run.time_cell(ours),
                _bandwidth_cell(ours),
                bench_run.time_cell(row.get("cudnn")), _bandwidth_cell(row.get("cudnn")),
                bench_run.time_cell(row.get("paged")), bench_run.time_cell(row.get("torch")),
                _bandwidth_cell(row.get("torch")),
                bench_run.ratio_cell(row.get("cudnn_ms_over_ours_ms")),
                bench_run.ratio_cell(row.get("paged_ms_over_ours_ms")),
                bench_run.ratio_cell(row.get("torch_ms_over_ours_ms")),
                _difference_cell(_largest_difference(row))])
        lines += _render(table)
    cascade_rows = [row for row in rows if row["group"] == "cascade"]
    if cascade_rows:
        table = [["shape", "variant", "cascade ms", "cascade TB/s", "concat ms", "concat TB/s",
                  "concat/cascade", "max|diff|"]]
        for row in cascade_rows:
            table.append([
                row["shape"]["label"], row["variant"],
                bench_run.time_cell(row.get("cascade", {"status": "failed"})),
                _bandwidth_cell(row.get("cascade")),
                bench_run.time_cell(row.get("concatenated", {"status": "failed"})),
                _bandwidth_cell(row.get("concatenated")), bench_run.ratio_cell(row.get("speedup")),
                _difference_cell(row.get("max_abs_diff"))])
        lines += [""] + _render(table)
    notes = []
    for row in rows:
        label = f"  {row['shape']['name']} {row['variant']}"
        if "jax_failure" in row:
            notes.append(f"{label} jax: {row['jax_failure']}")
        for name in ("ours", "cudnn", "paged", "torch", "cascade", "concatenated"):
            entry = row.get(name)
            if isinstance(entry, dict) and "error" in entry:
                notes.append(f"{label} {name}: {entry['error'][:300]}")
        difference = _largest_difference(row) or row.get("max_abs_diff")
        if difference is not None and difference > DISAGREEMENT:
            notes.append(f"{label}: outputs differ by {difference:.4f} (> {DISAGREEMENT})")
    if notes:
        lines += ["", "notes:"] + notes
    return lines or ["(no rows)"]


def _header(info: dict, args, backend) -> list[str]:
    versions = info["versions"]
    return [
        f"pallas_flex decode benchmark on {info['device']}, {info['date']}, commit "
        f"{(info['git_commit'] or 'unknown')[:10]}{' (dirty)' if info['git_dirty'] else ''}"
        + (" -- DRY RUN (tiny shapes, not timings)" if args.dry_run else ""),
        f"jax {versions['jax']}, jaxlib {versions['jaxlib']}, torch {versions['torch'] or 'n/a'}, "
        f"triton {versions['triton'] or 'n/a'}",
        "bf16, Sq = 1 (the query at position S - 1); "
        f"ours = pf.flex_attention(backend={backend!r}) "
        "with the step's BlockMask built once outside the timed call (shared by a model's "
        "layers); cuDNN = jax.nn.dot_product_attention("
        "implementation='cudnn') (causal as kv_seq_lengths = S); paged = jax.experimental."
        f"pallas.ops.gpu.paged_attention (page size {args.page_size}, pages shuffled); torch ="
        " torch.compile(flex_attention) (flex decoding)",
        "TB/s = bytes of K and V given, B*S*Hkv*(D+Dv)*2, / time; '-': no such variant there; "
        "X/ours = X ms / ours ms (> 1: ours faster); max|diff| = largest |ours - other| "
        f"(torch: over {NUM_SAMPLES} sampled outputs)",
        "cascade: pf.cascade_attention vs pf.attention over the per-request concatenated "
        "prefix + suffix (built outside the timed call); TB/s over the K/V bytes each is given "
        "(cascade: prefix once); ragged = suffix lengths in [1, L] through a mask_mod",
    ]


def _jax_environment_for_provenance(environment: dict) -> dict:
    """bench_run.provenance wants a JAX environment; a torch-only run has none."""
    return {"environment": environment or {"device_kind": "unknown", "platform": "unknown"}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_bench",
        description="Decode (Sq = 1) benchmark: pallas_flex vs cuDNN vs JAX's paged "
                    "attention vs PyTorch FlexAttention; MLA decode; cascade attention.")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<date>-<device>-"
                             "decode.json)")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"comma-separated row groups out of {', '.join(GROUPS)} "
                             f"(default {','.join(DEFAULT_ROWS)}; 'paged' is a hook, empty)")
    parser.add_argument("--variants", default=None,
                        help=f"decode variants (default all: {','.join(DECODE_VARIANTS)})")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape names (default all of each group): "
                             + ", ".join(s.name for g in GROUPS.values() for s in g.shapes))
    parser.add_argument("--torch", action=argparse.BooleanOptionalAction, default=None,
                        help="PyTorch FlexAttention rows, one subprocess each (default: on, "
                             "off with --dry-run)")
    parser.add_argument("--jax", action=argparse.BooleanOptionalAction, default=True,
                        help="the JAX columns (--no-jax: torch only, for --append)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each subprocess may run: one per (group, shape) for "
                             "JAX, one per row for torch (default 300)")
    parser.add_argument("--iters", type=int, default=20, help="JAX: calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="JAX: timed loops (median)")
    parser.add_argument("--time-budget-s", type=float, default=20.0,
                        help="JAX: cut iters/repeats of timings longer than this")
    parser.add_argument("--backend", default=None,
                        help="backend of ours (default: the best for the device; "
                             "'xla' with --dry-run)")
    parser.add_argument("--page-size", type=int, default=16,
                        help="tokens per page of JAX's paged_attention layout (default 16)")
    parser.add_argument("--torch-rep-ms", type=int, default=100, help="torch do_bench rep")
    parser.add_argument("--torch-warmup-ms", type=int, default=25,
                        help="torch do_bench warmup")
    parser.add_argument("--append", action="store_true",
                        help="merge into the JSON at the output path (entries of this run "
                             "replace those of the same row)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, backend 'xla', paged kernel interpreted, no "
                             "torch: checks the harness on any machine")
    # The children.
    parser.add_argument("--child", choices=("jax", "torch"), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--group", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-variants", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--jsonl-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    args.rows = [token.strip() for token in args.rows.split(",") if token.strip()]
    unknown = [group for group in args.rows if group not in GROUPS]
    if unknown or not args.rows:
        parser.error(f"--rows: expected names out of {', '.join(GROUPS)}, got {unknown}")
    for option, known in (("variants", DECODE_VARIANTS),
                          ("shapes", [s.name for g in GROUPS.values()
                                      for s in g.shapes + g.dry_run_shapes])):
        value = getattr(args, option)
        if value is not None:
            value = [token.strip() for token in value.split(",") if token.strip()]
            unknown = [token for token in value if token not in known]
            if unknown or not value:
                parser.error(f"--{option}: expected names out of {', '.join(known)}, "
                             f"got {unknown or value}")
            setattr(args, option, value)
    if args.torch is None:
        args.torch = not args.dry_run
    if not (args.jax or args.torch):
        parser.error("--no-jax and --no-torch leave nothing to run")
    if args.dry_run:
        args.iters, args.repeats = min(args.iters, 3), min(args.repeats, 2)
        args.time_budget_s = min(args.time_budget_s, 5.0)
    if args.iters < 1 or args.repeats < 1 or not args.timeout > 0:
        parser.error("--iters, --repeats must be >= 1 and --timeout positive")
    if args.page_size < 1:
        parser.error("--page-size must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "jax":
        return jax_child(args)
    if args.child == "torch":
        return torch_child(args)

    with tempfile.TemporaryDirectory(prefix="pallas-flex-decode-") as workdir:
        workdir = Path(workdir)
        if args.jax:
            rows, jax_environment = run_jax(args, workdir)
        else:  # torch only: one placeholder row per (group, shape, variant) with torch
            jax_environment = {}
            rows = [{"group": group, "shape": shape.as_dict(), "variant": variant}
                    for group in args.rows if GROUPS[group].torch
                    for shape in shapes_of(group, args) for variant in variants_of(group, args)]
        torch_environment = run_torch(args, workdir, rows)

    now = datetime.datetime.now().astimezone()
    info = bench_run.provenance(_jax_environment_for_provenance(jax_environment),
                                {"environment": torch_environment}, now)
    backend = "xla" if args.dry_run else args.backend or jax_environment.get(
        "default_backend")
    out = Path(args.out) if args.out else bench_run.RESULTS_DIR / (
        f"{info['date']}-{bench_run.device_slug(info['device'])}-decode.json")
    run_info = {**info, "settings": {
        key: getattr(args, key) for key in (
            "rows", "variants", "shapes", "torch", "jax", "timeout", "iters", "repeats",
            "time_budget_s", "backend", "page_size", "torch_rep_ms", "torch_warmup_ms",
            "dry_run")}, "ours_backend": backend, "jax_environment": jax_environment,
        "torch_environment": torch_environment}
    prefix = "" if args.jax else "torch_"  # a torch-only run keeps the JAX run's fields
    for row in rows:
        row.update({f"{prefix}timestamp": info["timestamp"],
                    f"{prefix}git_commit": info["git_commit"],
                    f"{prefix}git_dirty": info["git_dirty"]})
    runs = [run_info]
    if args.append and out.exists():
        previous = json.loads(out.read_text())
        if previous.get("suite") != "decode":
            raise SystemExit(f"--append: {out} is not a decode benchmark file")
        if info["device"] == "unknown":  # a torch-only run on a machine without CUDA
            info.update({key: previous.get(key) for key in ("device", "jax_device_kind",
                                                             "platform")})
        merged = {_key(row): row for row in previous["rows"]}
        for row in rows:  # entries of this run replace the same row's entries
            old = merged.get(_key(row), {})
            merged[_key(row)] = {**old, **row}
        rows = list(merged.values())
        runs = previous.get("runs", []) + runs
    for row in rows:
        add_comparisons(row)

    header = _header(info, args, backend)
    print()
    print("\n".join(header + [""] + format_tables(rows)))
    record = {**info, "suite": "decode", "method": __doc__.strip(), "runs": runs,
              "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
