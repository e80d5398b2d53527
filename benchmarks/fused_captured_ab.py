"""A/B on one H100/H200 to decide `mosaic_eligibility.CAPTURED_ROW_SUMS` and
`FUSE_CAPTURED_GRADIENTS` (then delete this script and record the figures where those
constants are defined).

    PYTHONPATH=$PWD python3 -m benchmarks.fused_captured_ab          # on the GPU
    python -m benchmarks.fused_captured_ab --lower                   # CUDA lowering, CPU

Causal forward+backward with learnable ALiBi slopes (D 64: B8 H16 S2048, B2 H16 S8192,
GQA 32:8 B4 S4096; D 128: B4 H16 S4096, GQA 32:8 B4 S4096): the slopes' gradient from
the exact deltas the dQ kernel sums (today's default), from the forward's row sums in
the dQ kernel, and (D 64) in the fused dK/dV/dQ kernel, against the same call without
the slopes' gradient; each AOT-compiled after `jax.clear_caches()` (the flags are read
when a call is traced), timed in paired rounds; ms, the cost of the slopes' gradient
(bar: 1.10x), and the largest difference of each variant's gradients (dq, dk, dv,
d_slopes) to the default's, relative to the largest entry."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench.timing import time_paired
from pallas_flex.kernels import device, mosaic_eligibility

SHAPES = [(8, 16, 16, 2048, 64), (2, 16, 16, 8192, 64), (4, 32, 8, 4096, 64),
          (4, 16, 16, 4096, 128), (4, 32, 8, 4096, 128)]  # B, Hq, Hkv, S, D
# name: (CAPTURED_ROW_SUMS, FUSE_CAPTURED_GRADIENTS, the slopes' gradient wanted)
VARIANTS = {"exact_deltas": (False, True, True), "row_sums": (True, False, True),
            "row_sums_fused": (True, True, True), "no_gradient": (False, True, False)}


def _step(with_slopes_gradient):
    def step(q, k, v, slopes, d_out):
        def loss(q, k, v, slopes):
            out = pf.attention(q, k, v, mask_mod=pf.masks.causal_mask,
                               score_mod=pf.scores.alibi(slopes), backend="pallas")
            return jnp.sum(out.astype(jnp.float32) * d_out)
        return jax.grad(loss, argnums=(0, 1, 2, 3) if with_slopes_gradient else (0, 1, 2))(
            q, k, v, slopes)
    return step


def _variants(head_dim):
    # At D 128 nothing fuses: row_sums_fused would be row_sums again.
    return {name: flags for name, flags in VARIANTS.items()
            if head_dim == 64 or name != "row_sums_fused"}


def _build(flags, args, lower_only):
    row_sums, fuse, with_gradient = flags
    saved = mosaic_eligibility.CAPTURED_ROW_SUMS, mosaic_eligibility.FUSE_CAPTURED_GRADIENTS
    try:
        mosaic_eligibility.CAPTURED_ROW_SUMS = row_sums
        mosaic_eligibility.FUSE_CAPTURED_GRADIENTS = fuse
        jax.clear_caches()
        traced = jax.jit(_step(with_gradient)).trace(*args)
        if lower_only:
            with pf.api.lowering_for_gpu():
                return traced.lower(lowering_platforms=("cuda",))
        return traced.lower().compile()
    finally:
        mosaic_eligibility.CAPTURED_ROW_SUMS, mosaic_eligibility.FUSE_CAPTURED_GRADIENTS = saved


def main(lower_only=False):
    if lower_only:
        device.compute_capability = lambda: (9, 0)
    for batch, q_heads, kv_heads, length, dim in SHAPES:
        label = f"B{batch} H{q_heads}:{kv_heads} S{length} D{dim}"
        shapes = [(batch, length, heads, dim) for heads in (q_heads, kv_heads, kv_heads)]
        if lower_only:
            args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
            args += [jax.ShapeDtypeStruct((q_heads,), jnp.float32),
                     jax.ShapeDtypeStruct(shapes[0], jnp.float32)]
            for name, flags in _variants(dim).items():
                with pf.api.lowering_for_gpu():
                    _build(flags, args, True)
            print(f"{label}: every variant lowered", flush=True)
            continue
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        args = [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]
        args += [jnp.asarray(pf.scores.alibi_slopes(q_heads)),
                 jax.random.normal(keys[3], shapes[0], jnp.float32)]
        executables, grads = {}, {}
        try:
            for name, flags in _variants(dim).items():
                executables[name] = _build(flags, args, False)
                grads[name] = [np.asarray(g, np.float32) for g in executables[name](*args)]
        except Exception as error:  # a shape that fails says why; the others run
            print(f"{label}: {type(error).__name__}: {str(error)[:600]}", flush=True)
            continue
        ms = {name: entry["ms"] for name, entry in time_paired(
            {name: (run, args) for name, run in executables.items()}, rounds=7,
            iters=10).items()}
        report = []
        for name in executables:
            line = f"{name} {ms[name]:.3f} ({ms[name] / ms['no_gradient']:.3f}x)"
            if name not in ("exact_deltas", "no_gradient"):
                line += " diff " + "/".join(
                    f"{float(np.max(np.abs(a - b)) / np.max(np.abs(b))):.1e}"
                    for a, b in zip(grads[name], grads["exact_deltas"]))
            report.append(line)
        print(f"{label} causal ALiBi fwd+bwd ms: " + ", ".join(report), flush=True)


if __name__ == "__main__":
    main(lower_only="--lower" in sys.argv[1:])
