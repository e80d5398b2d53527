"""The multi-GPU suite (issues 18 and 19): context parallelism and batch/head sharding on
every device of one host, against one device of the same machine.

    python -m pallas_flex.bench.multi_device [--parts correctness,sharding,scaling]
        [--lengths 262144,1048576] [--out benchmarks/results] [--budget-s 540]

Parts:
  correctness  each strategy of --strategies (ring with the zig-zag layout, all-gather
               K/V, all-to-all heads; "ring_contiguous" without the zig-zag) on all
               devices against `pf.attention` on one, causal and document(--documents,
               64)+causal, B1 H16 D128 bf16 at `--check-length` (64k): out, lse, dq, dk,
               dv as the largest difference over the reference's largest value.
  sharding     forward+backward under `jit` with q, k, v sharded over the batch (B8 H16
               S4096 D128 causal) and over the heads (B1 H32 S16384), on 1, 2, ... devices;
               the compiled HLO's collectives are counted (batch/head sharding needs none
               but the gradient reductions of captured arrays: here, none at all).
  scaling      forward+backward of every strategy and mask at each length and device
               count (a power of two up to all devices; one device at the lengths that
               fit): ms, TFLOP/s per GPU (useful FLOPs: 4 B H D x unmasked pairs x 3.5 for
               forward+backward), efficiency against the one-device TFLOP/s, peak memory
               per device (XLA's memory analysis of the compiled step); `--mode forward`
               times the forward alone (FLOPs without the 3.5).

Rows go into `<out>/<gpu>/multi_device.json` as they finish (a run cut off by a time limit
keeps what it measured); `--budget-s` stops starting rows that would not finish in time.
With `--quick` it runs tiny shapes on host devices (`--xla_force_host_platform_device_count`)
with the XLA backend: the test of this module.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.bench.cli import git_provenance, gpu_name
from pallas_flex.bench.timing import error_entry, time_calls

# name: (strategy, layout, head_chunks); the ring's head groups: None = "auto" (the fewest
# with a K/V shard of at most 64 MiB), 1 = every head in one ring.
STRATEGIES = {"ring": ("ring", "zig-zag", None), "ring_contiguous": ("ring", "contiguous", None),
              "ring_striped": ("ring", "striped", None),
              "ring_all_heads": ("ring", "zig-zag", 1),
              "all_gather": ("all_gather", "zig-zag", None),
              "all_gather_striped": ("all_gather", "striped", None),
              "all_to_all": ("all_to_all", "zig-zag", None)}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute",
               "all-to-all")


def document_ids(length, documents, seed=0):
    """[length] int32 ids of `documents` documents of random lengths (at least 1/4 of the
    mean each), fixed by `seed`."""
    rng = np.random.default_rng(seed)
    sizes = rng.uniform(0.25, 1.75, documents)
    ends = np.round(np.cumsum(sizes) / sizes.sum() * length).astype(np.int64)
    return np.repeat(np.arange(documents, dtype=np.int32), np.diff(ends, prepend=0))


def masks_at(length, documents=64):
    """{name: (mask_mod, fraction of (q, kv) pairs attended)}."""
    ids_host = document_ids(length, documents)
    ids = jnp.asarray(ids_host)

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    sizes = np.bincount(ids_host).astype(np.float64)
    return {"causal": (masks.causal_mask, (length + 1) / (2 * length)),
            f"document{documents}_causal": (
                document_causal, float(np.sum(sizes * (sizes + 1) / 2)) / length ** 2)}


def _kind(mask_name):
    """"causal" or "document": what --masks selects by."""
    return "document" if mask_name.startswith("document") else mask_name


def _inputs(shape, sharding=None):
    """q, k, v, d_out in bf16, made where `sharding` places them."""
    b, s, hq, hkv, d = shape

    def make(key):
        keys = jax.random.split(key, 4)
        return tuple(jax.random.normal(kk, (b, s, h, d), jnp.bfloat16)
                     for kk, h in zip(keys, (hq, hkv, hkv, hq)))
    return jax.jit(make, out_shardings=sharding)(jax.random.key(0))


def _loss_gradients(attend):
    """(q, k, v, d_out) -> (out, lse, dq, dk, dv) of sum(out * d_out)."""
    def step(q, k, v, d_out):
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse) + vjp((d_out, jnp.zeros_like(lse)))
    return step


def _forward(attend):
    """(q, k, v, d_out) -> (out, lse): the forward alone (d_out unused)."""
    return lambda q, k, v, d_out: attend(q, k, v)


def _parallel_step(mesh, name, mask_mod, backend, mode="fwd_bwd", check_vma=False):
    shard = P(None, "cp")
    strategy, layout, head_chunks = STRATEGIES[name]

    def local(q, k, v):
        return pf.context_parallel_attention(q, k, v, axis_name="cp", mask_mod=mask_mod,
                                             strategy=strategy, layout=layout,
                                             return_lse=True, backend=backend,
                                             head_chunks=head_chunks)
    attend = jax.shard_map(local, mesh=mesh, in_specs=(shard,) * 3,
                           out_specs=(shard, P(None, None, "cp")), check_vma=check_vma)
    return jax.jit((_loss_gradients if mode == "fwd_bwd" else _forward)(attend))


def _single_step(mask_mod, backend, mode="fwd_bwd"):
    return jax.jit((_loss_gradients if mode == "fwd_bwd" else _forward)(
        lambda q, k, v: pf.attention(q, k, v, mask_mod=mask_mod, return_lse=True,
                                     backend=backend)))


def _compile(step, args):
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled, time.perf_counter() - start


def _memory(compiled):
    """Bytes per device XLA plans for the step: arguments, outputs and temporaries."""
    try:
        analysis = compiled.memory_analysis()
        return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes +
                   analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _collectives(compiled):
    text = compiled.as_text()
    return {name: text.count(f" {name}(") + text.count(f" {name}-start(")
            for name in COLLECTIVES}


class Suite:
    def __init__(self, args):
        self.args = args
        self.devices = jax.devices()
        self.backend = args.backend or pf.default_backend()
        self.start = time.perf_counter()
        self.rows = []
        self.path = None
        if args.out:
            self.path = (Path(args.out) / gpu_name(self.devices[0].device_kind) /
                         "multi_device.json")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.header = {
            "suite": "multi_device", "device": self.devices[0].device_kind,
            "device_count": len(self.devices), "backend": self.backend,
            "versions": {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
                         "pallas_flex": pf.__version__},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **git_provenance(),
            "command": "python -m pallas_flex.bench.multi_device " + " ".join(args.argv)}

    def left_s(self):
        return self.args.budget_s - (time.perf_counter() - self.start)

    def add(self, row):
        row["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.path is not None:
            old = json.loads(self.path.read_text()) if self.path.exists() else {}
            fresh = {r["case"] for r in self.rows}
            kept = [r for r in old.get("rows", []) if r["case"] not in fresh
                    and old.get("device") == self.header["device"]]
            rows = kept + self.rows  # rows of machines of several sizes: the largest named
            header = {**self.header, "device_count": max(
                [self.header["device_count"]] + [r.get("devices", 1) for r in rows])}
            self.path.write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")

    def previous_rows(self):
        """The rows of an earlier run on this device kind in the results file."""
        if self.path is None or not self.path.exists():
            return []
        old = json.loads(self.path.read_text())
        return old.get("rows", []) if old.get("device") == self.header["device"] else []

    def timing(self):
        return {"iters": self.args.iters, "repeats": self.args.repeats,
                "budget_s": self.args.time_budget_s}

    # --- correctness -------------------------------------------------------------------
    def correctness(self):
        n = len(self.devices)
        length = self.args.check_length
        shape = (1, length, self.args.heads, self.args.heads, self.args.dim)
        mesh = jax.make_mesh((n,), ("cp",), devices=self.devices)
        q, k, v, d_out = _inputs(shape, NamedSharding(jax.make_mesh(
            (1,), ("one",), devices=self.devices[:1]), P()))
        for mask_name, (mask_mod, _) in masks_at(length, self.args.documents).items():
            if self.args.masks and _kind(mask_name) not in self.args.masks:
                continue
            expected = [np.asarray(x, np.float32) for x in
                        _single_step(mask_mod, self.backend)(q, k, v, d_out)]
            for name in self.args.strategies:
                layout = STRATEGIES[name][1]
                vma = "/check_vma" if self.args.check_vma else ""
                case = f"correctness/{name}/{mask_name}/S{length}/N{n}{vma}"
                row = {"case": case, "strategy": name, "mask": mask_name, "devices": n,
                       "S": length, "check_vma": self.args.check_vma}
                try:
                    order = np.asarray(pf.context_parallel.layout_order(length, n, layout))
                    restore = np.argsort(order)
                    sharded = NamedSharding(mesh, P(None, "cp"))
                    args = [jax.device_put(x[:, order], sharded) for x in (q, k, v, d_out)]
                    got = _parallel_step(mesh, name, mask_mod, self.backend,
                                         check_vma=self.args.check_vma)(*args)
                    got = [np.asarray(x, np.float32) for x in got]
                    got = [got[0][:, restore], got[1][:, :, restore]] + [
                        x[:, restore] for x in got[2:]]
                    row["max_diff_over_max"] = {
                        key: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))
                        for key, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected)}
                    row["status"] = ("ok" if max(row["max_diff_over_max"].values()) <
                                     self.args.tolerance else "mismatch")
                except Exception as error:  # noqa: BLE001 - the row records it
                    row.update(error_entry(error))
                self.add(row)

    # --- batch and head sharding -------------------------------------------------------
    def sharding(self):
        for what, shape, spec in (("batch", self.args.batch_shape, P("x")),
                                  ("heads", self.args.head_shape, P(None, None, "x"))):
            mask_mod = masks.causal_mask
            step = jax.jit(_loss_gradients(lambda q, k, v: pf.attention(
                q, k, v, mask_mod=mask_mod, return_lse=True, backend=self.backend)))
            base = None
            for n in self._device_counts():
                case = f"sharding/{what}/B{shape[0]}H{shape[2]}S{shape[1]}D{shape[4]}/N{n}"
                row = {"case": case, "split": what, "devices": n, "shape": list(shape)}
                try:
                    mesh = jax.make_mesh((n,), ("x",), devices=self.devices[:n])
                    args = _inputs(shape, NamedSharding(mesh, spec))
                    compiled, row["lower_compile_s"] = _compile(step, args)
                    row["collectives"] = _collectives(compiled)
                    row["memory_per_device_bytes"] = _memory(compiled)
                    entry, _ = time_calls(compiled, args, **self.timing())
                    row.update(entry, status="ok")
                    base = base or (entry["ms"] if n == 1 else None)
                    if base:
                        row["speedup_vs_one_device"] = base / entry["ms"]
                    del args
                except Exception as error:  # noqa: BLE001
                    row.update(error_entry(error))
                self.add(row)

    def _device_counts(self):
        if self.args.sharding_devices:
            return [n for n in self.args.sharding_devices if n <= len(self.devices)]
        counts, n = [], 1
        while n <= len(self.devices):
            counts.append(n)
            n *= 2
        return counts

    # --- context-parallel scaling ------------------------------------------------------
    def scaling(self):
        heads, dim = self.args.heads, self.args.dim
        for length in self.args.lengths:  # in the order given, most wanted first
            for mask_name, (mask_mod, fraction) in masks_at(length, self.args.documents).items():
                if self.args.masks and _kind(mask_name) not in self.args.masks:
                    continue
                flops = 4 * heads * dim * fraction * length ** 2 * (
                    3.5 if self.args.mode == "fwd_bwd" else 1.0)
                counts = [n for n in self.args.scaling_devices if 1 < n <= len(self.devices)]
                if length <= self.args.max_single_length:
                    counts = [1] + counts
                for n in counts:
                    names = ["one_device"] if n == 1 else self.args.strategies
                    for name in names:
                        self._scaling_row(length, mask_name, mask_mod, flops, n, name,
                                          heads, dim)

    def _scaling_row(self, length, mask_name, mask_mod, flops, n, name, heads, dim):
        kv_heads = self.args.kv_heads or heads
        gqa = f"/H{heads}:{kv_heads}" if kv_heads != heads else ""
        mode = "" if self.args.mode == "fwd_bwd" else "/forward"
        case = f"scaling/{name}/{mask_name}/S{length}{gqa}{mode}/N{n}"
        row = {"case": case, "mode": self.args.mode, "strategy": name, "mask": mask_name,
               "devices": n,
               "S": length, "shape": [1, length, heads, kv_heads, dim]}
        estimate = self._estimate_s(flops, n)
        if self.left_s() < estimate:
            row.update(status="skipped", reason=f"{estimate:.0f} s estimated, "
                       f"{self.left_s():.0f} s left of --budget-s")
            self.add(row)
            return
        try:
            shape = (1, length, heads, kv_heads, dim)
            if n == 1:
                args = _inputs(shape, NamedSharding(jax.make_mesh(
                    (1,), ("one",), devices=self.devices[:1]), P()))
                step = _single_step(mask_mod, self.backend, self.args.mode)
            else:
                mesh = jax.make_mesh((n,), ("cp",), devices=self.devices[:n])
                # Timing does not need the zig-zag permutation of the data itself: random
                # inputs are as good in any order; the layout changes only the positions.
                args = _inputs(shape, NamedSharding(mesh, P(None, "cp")))
                strategy, _, head_chunks = STRATEGIES[name]
                if strategy == "ring":
                    shard = (1, length // n, kv_heads, dim)
                    row["head_chunks"] = pf.context_parallel.ring_head_chunks(
                        shard, shard, jnp.bfloat16, head_chunks)
                step = _parallel_step(mesh, name, mask_mod, self.backend, self.args.mode)
            compiled, row["lower_compile_s"] = _compile(step, args)
            row["memory_per_device_bytes"] = _memory(compiled)
            entry, out = time_calls(compiled, args, **self.timing())
            del out, args
            row.update(entry, status="ok")
            row["tflops_per_device"] = flops / (entry["ms"] * 1e-3) / n / 1e12
            base = next((r for r in self.rows + self.previous_rows()
                         if r.get("strategy") == "one_device" and r["mask"] == mask_name
                         and r.get("mode", "fwd_bwd") == self.args.mode
                         and r["shape"][2:] == row["shape"][2:] and r.get("status") == "ok"),
                        None)
            if base is not None and n > 1:
                row["efficiency_vs_one_device"] = (row["tflops_per_device"] /
                                                   base["tflops_per_device"])
        except Exception as error:  # noqa: BLE001
            row.update(error_entry(error))
        self.add(row)

    def _estimate_s(self, flops, n):
        """Seconds a row will take: compile plus ~(2 + iters * repeats) steps at the rate of
        the last row measured (a guess of 300 TFLOP/s per device before any)."""
        rate = next((r["tflops_per_device"] for r in reversed(self.rows)
                     if r.get("tflops_per_device")), 300.0)
        step_s = flops / (rate * 1e12 * n)
        runs = 3 + min(self.args.iters * self.args.repeats,
                       max(1, self.args.time_budget_s / max(step_s, 1e-9)))
        return 20 + step_s * runs


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m pallas_flex.bench.multi_device",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="correctness,sharding,scaling")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lengths", default="262144,524288,1048576")
    parser.add_argument("--masks", default="", help="causal,document (default: both)")
    parser.add_argument("--documents", type=int, default=64,
                        help="documents in the document+causal mask")
    parser.add_argument("--mode", choices=("fwd_bwd", "forward"), default="fwd_bwd",
                        help="scaling: forward+backward (default) or the forward alone")
    parser.add_argument("--strategies", default="ring,all_gather,all_to_all")
    parser.add_argument("--scaling-devices", default="", help="device counts past one, in "
                        "the order to run (default: 2, 4, 8, ...)")
    parser.add_argument("--sharding-devices", default="", help="batch/head sharding: device "
                        "counts (default: 1, 2, 4, ... up to the devices there are)")
    parser.add_argument("--max-single-length", type=int, default=262144)
    parser.add_argument("--check-length", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="scaling: GQA (default: "
                        "--heads)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tolerance", type=float, default=2e-2)
    parser.add_argument("--check-vma", action="store_true", help="correctness: under a "
                        "shard_map that checks varying manual axes")
    parser.add_argument("--backend")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--time-budget-s", type=float, default=20.0,
                        help="seconds of timed loops per row at most")
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.masks = [m for m in args.masks.split(",") if m]
    args.strategies = [s for s in args.strategies.split(",") if s]
    for name in args.strategies:
        if name not in STRATEGIES:
            parser.error(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    args.batch_shape, args.head_shape = (8, 4096, 16, 16, 128), (1, 16384, 32, 32, 128)
    if args.quick:
        args.lengths, args.check_length = [256], 256
        # 8 heads: all-to-all splits them over up to 8 host devices.
        args.max_single_length, args.heads, args.dim = 256, 8, 32
        args.batch_shape, args.head_shape = (4, 128, 4, 4, 32), (1, 128, 8, 8, 32)
        args.backend = args.backend or "xla"
        args.iters, args.repeats = 1, 1
    args.scaling_devices = ([int(x) for x in args.scaling_devices.split(",") if x]
                            or [2 ** i for i in range(1, 10)])
    args.sharding_devices = [int(x) for x in args.sharding_devices.split(",") if x]
    return args


def main(argv=None):
    import sys
    args = parse_args(sys.argv[1:] if argv is None else argv)
    suite = Suite(args)
    print(json.dumps(suite.header), flush=True)
    for part in args.parts:
        getattr(suite, part)()
    failed = [r["case"] for r in suite.rows if r.get("status") not in ("ok", "skipped")]
    print(f"{len(suite.rows)} rows, {len(failed)} not ok: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
