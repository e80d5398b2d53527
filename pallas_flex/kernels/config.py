"""Kernel tuning: one frozen config, with defaults from a per-GPU-generation table.

Users override any field through `kernel_options={"block_q": 64, ...}`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_flex.kernels.device import shared_memory_budget


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Tile sizes and Triton launch parameters of the attention kernels.

    block_q, block_kv: query/key rows per tile; powers of two. They must divide the
      BlockMask's block size (a 128x128 BlockMask runs with 128x64 tiles: each mask
      block is walked as two kernel tiles).
    num_warps, num_stages: Triton warps per program and software-pipelining depth.
    backward_block_q, backward_block_kv: tiles of the dQ programs (each owns a query
      tile, walks KV tiles); backward_dkdv_block_q, backward_dkdv_block_kv: tiles of the
      dK/dV programs (each owns a KV tile, walks query tiles). Without GQA both kinds
      run in one launch with backward_num_warps/num_stages; with GQA in two, the dK/dV
      one with backward_dkdv_num_warps/num_stages (0 = the same). 8 warps need
      128-row owned tiles (on fewer rows a launch takes 4 warps and at most 2 stages).
    decode_max_q_len: queries this short (and within one BlockMask query block) run
      the split-KV decode kernel instead of the forward kernel.
    decode_block_kv: KV rows per decode tile (0 = by head dim: 128 up to D 128 (64 on
      contiguous 16-bit K/V), 64 up to 256, 32 above); decode_num_splits: programs
      sharing one row's KV tiles (0 = enough to fill the GPU: one wave of programs (at
      most one per SM) on contiguous 16-bit K/V up to D 128, two waves on 8-bit pages,
      about four per SM otherwise; `kernels/decode.py` has the figures);
      decode_num_warps/num_stages: decode launch parameters
      (num_stages 0 = 3 on contiguous K/V when three tiles fit in shared memory, else 2:
      deeper pipelining stalls on the page-table reads of a paged cache).
    decode_max_rows: query rows (heads x positions) per decode program (0 = as many as
      keep the [rows, Dv] float32 accumulator within 64 KiB).
    paged_num_stages: pipelining depth of the Triton forward kernel on a paged cache (0 = by
      page size, measured on the H100).
    backward_masked_first: the backward's programs walk a row's (or column's) masked
      blocks before its full ones (PyTorch's order) instead of after them.
    forward_selects_small_tables: the Triton forward reads a captured array read per
      element at indices reaching at most `tile_mods.SELECTED_GATHER_MAX_ENTRIES`
      entries (a T5 table) as one select per entry a tile reaches instead of a gather
      (the backward always does). H100, B4 H16 S4096 causal T5 forward: D 64 2.17 ->
      1.51 ms (on), D 128 8.3 -> 8.95 ms (off there, by the tuning table); backward at
      both (forward+backward without the table's gradient 7.7 -> 6.2 and 18.2 -> 16.6).
    backward_deterministic: every gradient must be bitwise equal from run to run. The
      Mosaic GPU backward at head dim 64 otherwise sums dQ over key blocks by TMA
      reduce-adds in its dK/dV kernel (`mosaic_eligibility.fuses_dq`; this option runs a
      dQ kernel of its own instead: B8 H16 S2048 D64 fwd+bwd 1.317 against 1.235 ms on
      the H100; also where arrays a score_mod captured read at indices of b and h only
      are differentiated), and a T5 table's gradient there sums its tiles near the
      diagonal by TMA reduce-adds (`backward_mosaic.REDUCED_DUMPS`; this option writes
      them one a key tile and sums them after the kernel: B4 H16 S4096 D128 causal
      fwd+bwd 3.25 against 3.14 ms, B8 S2048 D64 1.21 against 1.11). Elsewhere those gradients (ALiBi slopes) and small tables
      read per element (at most `DETERMINISTIC_MAX_ENTRIES` entries along the axes
      that vary over a tile: a T5 table) always are (each program writes its own
      partial sums, reduced in a fixed order); larger tables read per element (a
      relative table [H, 2S-1], a pair bias) are scatter-added with atomics, which this
      option refuses with a ValueError.
    backward_batch_sum: how the gradient of a large captured table read per element is
      summed over batch rows that share its entries (a pair bias [B, H, S, S] read at
      b // rows by the folded rows of an MSA, a bias [H, S, S] shared by the batch).
      "atomic": every row's dQ programs scatter-add their cotangent tiles into it (all
      rows add into the same addresses). "loop": a launch of its own
      (`backward_batch_loop.batch_loop_gradients`) in which a program owns one table
      tile and walks `backward_batch_rows` rows (0 = enough programs to fill the GPU),
      recomputing their dS tiles and summing them in registers: one scatter-add per
      program instead of one per row. "auto": "loop" where at least
      BATCH_LOOP_MIN_SHARING rows share each entry (by the table's extent along the
      axes indexed by b). Reads whose per-element indices depend on b stay "atomic".
      On the Mosaic GPU backward a bias tensor read as [q, kv] blocks takes its
      gradient from the dK/dV kernel's TMA reduce-adds unless this is "loop" (then the
      batch loop runs after its kernels).
    backward_batch_block_q, backward_batch_block_kv, backward_batch_num_warps,
      backward_batch_num_stages: the tiles and launch parameters of that launch.
    forward_kernel: which forward kernel runs on the GPU. "auto": the warp-specialized
      Mosaic GPU kernel (`kernels/forward_mosaic.py`) on Hopper for the calls it covers,
      else the Triton one; "mosaic": the Mosaic GPU kernel, a ValueError saying why if
      it does not cover the call (with backend="interpret", its interpret mode);
      "triton": the Triton kernel. Giving any of block_q, block_kv, num_warps or
      num_stages (the Triton kernel's settings) without forward_kernel selects "triton".
    forward_items_per_program: how many (head, 128-row query block, batch) items one
      program of the Mosaic GPU forward walks, with one K/V pipeline across them (the
      next item's first tiles load while the current one finishes; its output is stored
      from a buffer of its own); 0 = automatic (`forward_mosaic.choose_items_per_program`: 2,
      or 8 at D 64 where every query block of a head has the same blocks; there, at D 64
      and 128 on a contiguous cache, as many as make one wave of programs where that is
      at most the query heads, else up to 8 (the heads at most) where keys are at most
      SHORT_KEYS). H100, bf16,
      1 -> 2 items (B4 H16 S4096 D128, B1 S16384, B8 S2048 D64, GQA 32:8;
      docs/gpu-notes.md has the times): noop 1.1-1.9 % faster, causal -0.6 to +4.5 %,
      12 documents -2.7 to +11.5 %, soft-cap 1.3-4.4 %, ALiBi 0-5.8 %. 4 or 8 items, or
      one program per SM, lose up to 26 % on causal masks: the hardware's scheduling of
      programs no longer balances rows of unequal length.
    decode_kernel: which decode kernel runs latent-attention decode (one query position,
      one KV head, D and Dv as wide as DeepSeek's 576 / 512) on the GPU: "auto": the
      Mosaic GPU kernel (`kernels/decode_latent_mosaic.py`) on Hopper where it covers the
      call, else the Triton decode; "mosaic": a ValueError saying why where it does not
      (with backend="interpret", its interpret mode); "triton": the Triton decode.
      Giving decode_block_kv, decode_num_warps, decode_num_stages or decode_max_rows
      (the Triton decode's settings) without decode_kernel selects "triton";
      decode_num_splits sets either kernel's splits.
    backward_kernel: which backward kernel runs on the GPU, the same way: "auto" (the
      Mosaic GPU backward, `kernels/backward_mosaic.py`, where it covers the call: the
      forward's set, without gradients of captured arrays), "mosaic" (a ValueError
      saying why where it does not) or "triton". Giving any of the Triton backward's
      tiles, warps or stages without backward_kernel selects "triton".
    quantized_prefill: how a call of more queries than the decode takes (prefill) reads
      an int8 / float8 paged cache. "dequantize": the rows' pages are dequantized to the
      queries' dtype first (`paged.quantize.dequantized_pages`, one XLA fusion) and the
      16-bit forward runs on them (the Mosaic GPU kernel on Hopper): 1.3-2.5x faster on
      the H200 from 32 to 2048 new tokens (docs/gpu-notes.md), for transient memory of
      the rows' reserved pages in 16 bits (B x max_seq_len x Hkv x (D + Dv) x 2 bytes).
      "in_kernel": the Triton forward reads the 8-bit pages in place and converts each
      tile it reads (no extra memory). "auto": "dequantize" where those pages take at
      most QUANTIZED_PREFILL_MAX_BYTES (1 GiB: a 128k-token row of 8 KV heads at D 128
      takes 0.5 GiB), else "in_kernel", so that a prefill on a cache sized to the
      GPU's memory does not run out of it. Decode reads 8-bit pages in place either way.
    """

    block_q: int = 128
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    backward_block_q: int = 128
    backward_block_kv: int = 64
    backward_dkdv_block_q: int = 64
    backward_dkdv_block_kv: int = 128
    backward_num_warps: int = 8
    backward_num_stages: int = 3
    backward_dkdv_num_warps: int = 0
    backward_dkdv_num_stages: int = 0
    decode_max_q_len: int = 16
    decode_block_kv: int = 0
    decode_num_splits: int = 0
    decode_num_warps: int = 4
    decode_num_stages: int = 0
    decode_max_rows: int = 0
    paged_num_stages: int = 0
    backward_masked_first: bool = True
    forward_kernel: str = "auto"
    backward_kernel: str = "auto"
    decode_kernel: str = "auto"
    forward_items_per_program: int = 0
    backward_deterministic: bool = False
    forward_selects_small_tables: bool = True
    backward_batch_sum: str = "auto"
    backward_batch_rows: int = 0
    backward_batch_block_q: int = 64
    backward_batch_block_kv: int = 64
    backward_batch_num_warps: int = 4
    backward_batch_num_stages: int = 2
    quantized_prefill: str = "auto"
    # The fields the user set: the kernels shrink the others to fit the GPU's shared
    # memory (`kernels/shared_memory.py`), never these (a ValueError instead).
    given: frozenset = frozenset()
    # The shared-memory budget the call was planned for (kernels/device.py): part of the
    # options, so a new PALLAS_FLEX_SHARED_MEMORY_KIB is a new jit cache key.
    shared_memory_budget: int = 0
    # The values are k's first Dv columns (`flex_attention(q, k, None, value_dim=Dv)`, a
    # latent cache): the latent decode reads them from k in place; the other kernels take
    # the [..., :Dv] slice.
    values_in_keys: bool = False

    def replace(self, **changes) -> "KernelOptions":
        return dataclasses.replace(self, **changes)


# Hopper (sm_90) defaults by padded head dim, measured on the H100 (see
# f908cd9:benchmarks/results/*tuning*.json). Larger head dims need smaller tiles to fit registers.
_HOPPER_FORWARD = {
    # D 32 (issue 21's Evoformer row attention, B256 (R256 folded) H8 S256): D 64's forward
    # (128x64 tiles 0.198 ms, 64x128 0.226, 64x64 at 2 stages 0.188 against 0.186), its
    # backward on 64x64 tiles with 4 warps for dQ and dK/dV: forward+backward 0.971 ->
    # 0.821 ms with the pair bias and its gradient, 0.526 -> 0.414 plain (8 warps 0.819,
    # dK/dV on 64x128 0.872, 2 stages 0.818; H100, paired rounds).
    32: KernelOptions(block_q=64, block_kv=64, num_warps=4, num_stages=3,
                      backward_block_q=64, backward_block_kv=64, backward_dkdv_block_q=64,
                      backward_dkdv_block_kv=64, backward_num_warps=4,
                      backward_masked_first=False),
    # D 64 (B8 H16 S2048): 64x64 forward tiles 0.420/0.254 ms noop/causal against
    # 0.446/0.268 for 128x64 (f908cd9:benchmarks/results/2026-11-22-h100-d64-tuning.json).
    # Backward: dQ programs on 128x128 tiles, dK/dV programs on 128 keys x 64 queries
    # (no register spills; 128x128 there spills ~700 B per thread): backward alone
    # noop/causal/ALiBi/prefix-LM 1.235/0.750/0.829/0.871 ms against 1.245/0.752/0.883/
    # 0.872 for 128x128 in both kinds (2026-11-23-h100-d64-backward-tiles.json).
    # Backward walk order (f908cd9:benchmarks/results/2026-11-23-h100-backward-walk-order.json):
    # masked blocks first at D 128 (causal backward 2.043 -> 1.976 ms), full blocks first
    # at D 64 with its 128x128 tiles (causal 0.75 ms against 0.82 masked first; with the
    # 128x64 dK/dV tiles the two orders are within 1 %); D 256 keeps the order it was
    # tuned with.
    64: KernelOptions(block_q=64, block_kv=64, num_warps=4, num_stages=3,
                      backward_block_q=128, backward_block_kv=128, backward_dkdv_block_q=64,
                      backward_dkdv_block_kv=128, backward_masked_first=False),
    128: KernelOptions(block_q=128, block_kv=64, num_warps=4, num_stages=2,
                       forward_selects_small_tables=False),
    256: KernelOptions(block_q=64, block_kv=32, num_warps=4, num_stages=2,
                       backward_block_q=32, backward_block_kv=32, backward_dkdv_block_q=32,
                       backward_dkdv_block_kv=32, backward_num_warps=4, backward_num_stages=2,
                       backward_masked_first=False),
}


FORWARD_KERNELS = ("auto", "mosaic", "triton")
BACKWARD_KERNELS = FORWARD_KERNELS
# The most table entries along the axes a per-element read varies over that the backward
# sums in per-program register rows (a one-hot reduction, deterministic) rather than with
# atomics (see kernels/backward.py).
DETERMINISTIC_MAX_ENTRIES = 64
# backward_batch_sum "auto": the rows sharing a captured table's entries from which their
# gradients are summed by the batch loop rather than by atomics (issue 21's Evoformer
# pair bias: 256 rows a table; a per-row bias [B, H, S, S]: 1).
BATCH_LOOP_MIN_SHARING = 4
# backward_batch_rows 0: rows per batch-loop program such that the launch has about this
# many programs (an H100 holds ~8 four-warp programs on each of its 132 SMs).
BATCH_LOOP_TARGET_PROGRAMS = 1024
BATCH_SUMS = ("auto", "atomic", "loop")
QUANTIZED_PREFILLS = ("auto", "dequantize", "in_kernel")
QUANTIZED_PREFILL_MAX_BYTES = 1 << 30  # quantized_prefill "auto": dequantized pages at most
TRITON_FORWARD_FIELDS = frozenset({"block_q", "block_kv", "num_warps", "num_stages",
                                   "paged_num_stages", "forward_selects_small_tables"})
TRITON_DECODE_FIELDS = frozenset({"decode_block_kv", "decode_num_warps", "decode_num_stages",
                                  "decode_max_rows"})
TRITON_BACKWARD_FIELDS = frozenset({
    "backward_block_q", "backward_block_kv", "backward_dkdv_block_q",
    "backward_dkdv_block_kv", "backward_num_warps", "backward_num_stages",
    "backward_dkdv_num_warps", "backward_dkdv_num_stages"})


# Float32 changes to the Hopper table, by padded head dim (H100, B2 H16 S4096 causal
# forward; decode B8 Hq32 Hkv8 Skv 8192; first-call compile seconds / ms per call).
# Forward at D 128: 8 warps compile in 1.7 s and run in 4.1 ms, against 4.2 s / 6.8 ms
# with 4 (two warpgroups share the 128 query rows, and the three-TF32-pass dots of
# `online_softmax.dot_precision` stop spilling). Decode: 32-row KV tiles compile in
# 1.1 / 1.5 s (D 64 / 128) and run in 0.216 / 0.414 ms, against 2.4 / 2.1 s and
# 0.237 / 0.477 ms with 128 rows. Head dims 129-256 (D256, B2 H16 S4096 causal): the
# 16-bit table's 32x32 backward tiles spill in float32 (pip triton 3.6 for sm_90: 32
# registers and 75 KB of spill stores): 962 ms forward+backward; 16x16 tiles with one
# stage: 74.8 ms. The forward keeps the 16-bit table: 14.8 ms and 5.3 s to compile,
# against 22.4 ms / 4.2 s with 8 warps and 25.3 ms / 3.7 s with 8 warps on 16-row KV
# tiles (f908cd9:benchmarks/results/2026-11-24-h100-compile-times.json). Shared-memory
# fitting (kernels/shared_memory.py) still applies on top.
_HOPPER_FLOAT32_CHANGES = {
    32: dict(decode_block_kv=32),
    64: dict(decode_block_kv=32),
    128: dict(num_warps=8, decode_block_kv=32),
    256: dict(backward_block_q=16, backward_block_kv=16, backward_dkdv_block_q=16,
              backward_dkdv_block_kv=16, backward_num_stages=1),
}


# Triton tiles for short key ranges, by padded head dim: with at most SHORT_KEYS keys a
# program walks only a few of the table's tiles, so its pipeline never fills; smaller
# tiles (and more, shorter programs) keep the copies ahead. On Hopper the Triton kernels
# run what the Mosaic ones cannot: a bias tensor read at [q_idx, kv_idx] (AlphaFold's
# pair bias, `scores.bias_lookup`). H200, paired rounds, ms:
# * forward, a [H, S, S] bias, the D 128 table's 128x64 (4 warps, 2 stages) / 64x32
#   (4 warps, 3 stages): B64 H16 S256 0.175 / 0.161, B256 H8 S256 0.333 / 0.307
#   (Evoformer's gated row attention 0.417 / 0.365), B32 H16 S512 0.277 / 0.269, B16 H16
#   S1024 0.475 / 0.485. At D 32 and 64 no setting won by more than the spread (~5 %).
# * backward, Evoformer's gated row attention (R256 S256 H8, the pair bias's gradient
#   included) fwd+bwd, the table's tiles / the D 32 table's (64x64 dQ and dK/dV tiles,
#   4 warps, 3 stages): D 64 1.178 / 1.080, D 128 1.879 / 1.798 (64x32 dQ tiles, 8 warps
#   or 128-key dK/dV tiles: 1.08-2.86).
SHORT_KEYS = 512
_SHORT_KEYS_BACKWARD = {field: getattr(_HOPPER_FORWARD[32], field)  # D 32's tiles
                        for field in TRITON_BACKWARD_FIELDS}
_HOPPER_SHORT_KEYS = {
    64: _SHORT_KEYS_BACKWARD,
    128: dict(block_q=64, block_kv=32, num_warps=4, num_stages=3, **_SHORT_KEYS_BACKWARD),
}


def default_forward_options(head_dim: int, dtype=None, key_length=None) -> KernelOptions:
    """The tuning table's options for inputs of `dtype` (None: 16-bit) and `head_dim`;
    key_length (None: long) picks the short-key tiles at most SHORT_KEYS keys."""
    limit = next((limit for limit in sorted(_HOPPER_FORWARD) if head_dim <= limit),
                 max(_HOPPER_FORWARD))
    options = _HOPPER_FORWARD[limit]
    if dtype is not None and jnp.dtype(dtype) == jnp.float32:
        return options.replace(**_HOPPER_FLOAT32_CHANGES.get(limit, {}))
    if key_length is not None and key_length <= SHORT_KEYS:
        options = options.replace(**_HOPPER_SHORT_KEYS.get(limit, {}))
    return options


# Fields the call sets, not the user.
_INTERNAL_FIELDS = frozenset({"given", "shared_memory_budget", "values_in_keys"})


def resolve_options(kernel_options, head_dim: int, dtype=None, key_length=None
                    ) -> KernelOptions:
    """Merges user `kernel_options` (dict or KernelOptions) over the defaults for `dtype`
    (None: 16-bit), `head_dim` and `key_length` (None: long; `default_forward_options`),
    recording the shared-memory budget the call is planned for."""
    return _merge_options(kernel_options, head_dim, dtype, key_length).replace(
        shared_memory_budget=shared_memory_budget())


def _merge_options(kernel_options, head_dim: int, dtype=None, key_length=None
                   ) -> KernelOptions:
    options = default_forward_options(head_dim, dtype, key_length)
    if kernel_options is None:
        return options
    if isinstance(kernel_options, KernelOptions):
        return kernel_options
    if not isinstance(kernel_options, dict):
        raise ValueError(f"kernel_options must be a dict or KernelOptions, got "
                         f"{type(kernel_options).__name__}")
    known = {field.name for field in dataclasses.fields(KernelOptions)} - _INTERNAL_FIELDS
    unknown = set(kernel_options) - known
    if unknown:
        raise ValueError(f"kernel_options has unknown keys {sorted(unknown)}; "
                         f"expected some of {sorted(known)}")
    for name in ("block_q", "block_kv", "backward_block_q", "backward_block_kv",
                 "backward_dkdv_block_q", "backward_dkdv_block_kv", "backward_batch_block_q",
                 "backward_batch_block_kv"):
        size = kernel_options.get(name, 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or size & (size - 1):
            raise ValueError(f"kernel_options[{name!r}] must be a power of two, got {size!r}")
    size = kernel_options.get("decode_block_kv", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size & (size - 1):
        raise ValueError(f"kernel_options['decode_block_kv'] must be 0 (automatic) or a power "
                         f"of two, got {size!r}")
    for name in ("decode_max_q_len", "decode_num_splits", "decode_num_stages", "decode_max_rows",
                 "paged_num_stages", "backward_dkdv_num_warps", "backward_dkdv_num_stages",
                 "backward_batch_rows", "forward_items_per_program"):
        count = kernel_options.get(name, 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"kernel_options[{name!r}] must be a non-negative int, got {count!r}")
    for name in ("forward_kernel", "backward_kernel", "decode_kernel"):
        if kernel_options.get(name, "auto") not in FORWARD_KERNELS:
            raise ValueError(f"kernel_options[{name!r}] must be one of {FORWARD_KERNELS}, "
                             f"got {kernel_options[name]!r}")
    if kernel_options.get("quantized_prefill", "auto") not in QUANTIZED_PREFILLS:
        raise ValueError(f"kernel_options['quantized_prefill'] must be one of "
                         f"{QUANTIZED_PREFILLS}, got {kernel_options['quantized_prefill']!r}")
    if kernel_options.get("backward_batch_sum", "auto") not in BATCH_SUMS:
        raise ValueError(f"kernel_options['backward_batch_sum'] must be one of {BATCH_SUMS}, "
                         f"got {kernel_options['backward_batch_sum']!r}")
    for name in ("backward_masked_first", "backward_deterministic",
                 "forward_selects_small_tables"):
        if not isinstance(kernel_options.get(name, True), bool):
            raise ValueError(f"kernel_options[{name!r}] must be a bool, got "
                             f"{kernel_options[name]!r}")
    for name in ("num_warps", "num_stages", "backward_num_warps", "backward_num_stages",
                 "decode_num_warps", "backward_batch_num_warps", "backward_batch_num_stages"):
        count = kernel_options.get(name, 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"kernel_options[{name!r}] must be a positive int, got {count!r}")
    options = options.replace(**kernel_options, given=frozenset(kernel_options))
    # Tile settings are the Triton kernel's: a user who tunes them wants that kernel.
    if "forward_kernel" not in kernel_options and TRITON_FORWARD_FIELDS & set(kernel_options):
        options = options.replace(forward_kernel="triton")
    if "decode_kernel" not in kernel_options and TRITON_DECODE_FIELDS & set(kernel_options):
        options = options.replace(decode_kernel="triton")
    if "backward_kernel" not in kernel_options and (
            TRITON_BACKWARD_FIELDS | TRITON_FORWARD_FIELDS) & set(kernel_options):
        options = options.replace(backward_kernel="triton")
    # Tiles given for the forward only also bound the backward's (tests pass small
    # tiles to exercise many blocks on short sequences).
    for name in ("block_q", "block_kv"):
        for backward_name in (f"backward_{name}", f"backward_dkdv_{name}",
                              f"backward_batch_{name}"):
            if name in kernel_options and backward_name not in kernel_options:
                options = options.replace(**{backward_name: min(
                    kernel_options[name], getattr(options, backward_name))})
    return options


# Forward on a paged cache, B4 H16 2048 new tokens after 6144 cached, D 128 bf16 (see
# f908cd9:benchmarks/results/*paged*.json): pipelining depth by page size. Tiles inside one page
# (64) want 3 stages, and so do tiles gathered across 16-row pages since their pointers
# are built per row (+3.9 to +6.6 % over contiguous at 3 stages, +8.3 / +9.5 % at 2);
# 128-row pages want 2.
_HOPPER_PAGED_STAGES = {16: 3, 64: 3}


def paged_forward_stages(options: KernelOptions, page_size: int) -> int:
    if options.paged_num_stages:
        return options.paged_num_stages
    return _HOPPER_PAGED_STAGES.get(page_size, options.num_stages)


def planned_shared_memory(options: KernelOptions) -> int:
    """The shared-memory budget `options` were resolved for (the current one for options
    built directly, as benchmarks do)."""
    return options.shared_memory_budget or shared_memory_budget()
