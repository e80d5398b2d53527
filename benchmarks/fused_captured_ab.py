"""A/B on one H100/H200 to decide `mosaic_eligibility.FUSE_CAPTURED_GRADIENTS` (then
delete this script and record the figures where that constant is defined).

    PYTHONPATH=$PWD python3 -m benchmarks.fused_captured_ab          # on the GPU
    python -m benchmarks.fused_captured_ab --lower                   # CUDA lowering, CPU

Causal forward+backward with learnable ALiBi slopes at head dim 64 (B8 H16 S2048, B2
H16 S8192, GQA 32:8 B4 S4096): the two-kernel backward (flag off) against the fused
dK/dV/dQ kernel taking the slopes' gradient from the forward's row sums (flag on), and
the same call without the slopes' gradient (fused either way), each AOT-compiled after
`jax.clear_caches()` (the flag is read when a call is traced), timed in paired rounds;
ms, the cost of the slopes' gradient (bar: 1.10x), and the largest difference between
the two settings' gradients relative to the largest entry."""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.kernels import device, mosaic_eligibility

SHAPES = [(8, 16, 16, 2048), (2, 16, 16, 8192), (4, 32, 8, 4096)]  # B, Hq, Hkv, S


def _step(with_slopes_gradient):
    def step(q, k, v, slopes, d_out):
        def loss(q, k, v, slopes):
            out = pf.attention(q, k, v, mask_mod=pf.masks.causal_mask,
                               score_mod=pf.scores.alibi(slopes), backend="pallas")
            return jnp.sum(out.astype(jnp.float32) * d_out)
        return jax.grad(loss, argnums=(0, 1, 2, 3) if with_slopes_gradient else (0, 1, 2))(
            q, k, v, slopes)
    return step


def _ms(executable, args, iters=10):
    jax.block_until_ready(executable(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = executable(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e3


def lower_only():
    """The CUDA lowering (Mosaic GPU modules built, no ptxas) of every variant on the CPU."""
    device.compute_capability = lambda: (9, 0)
    for batch, q_heads, kv_heads, length in SHAPES:
        q = jax.ShapeDtypeStruct((batch, length, q_heads, 64), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((batch, length, kv_heads, 64), jnp.bfloat16)
        args = (q, kv, kv, jax.ShapeDtypeStruct((q_heads,), jnp.float32),
                jax.ShapeDtypeStruct(q.shape, jnp.float32))
        for fuse, with_gradient in ((False, True), (True, True), (False, False)):
            mosaic_eligibility.FUSE_CAPTURED_GRADIENTS = fuse
            jax.clear_caches()
            with pf.api.lowering_for_gpu():
                jax.jit(_step(with_gradient)).trace(*args).lower(lowering_platforms=("cuda",))
            print(f"B{batch} H{q_heads}:{kv_heads} S{length} fused={fuse} "
                  f"gradient={with_gradient}: lowered", flush=True)
    mosaic_eligibility.FUSE_CAPTURED_GRADIENTS = False


def main():
    for batch, q_heads, kv_heads, length in SHAPES:
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q = jax.random.normal(keys[0], (batch, length, q_heads, 64), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, length, kv_heads, 64), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, length, kv_heads, 64), jnp.bfloat16)
        d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
        slopes = jnp.asarray(pf.scores.alibi_slopes(q_heads))
        args = (q, k, v, slopes, d_out)
        variants = {"two_kernels": (False, True), "fused": (True, True),
                    "no_gradient": (False, False)}
        executables, grads = {}, {}
        try:
            for name, (fuse, with_gradient) in variants.items():
                mosaic_eligibility.FUSE_CAPTURED_GRADIENTS = fuse
                jax.clear_caches()
                executables[name] = jax.jit(_step(with_gradient)).lower(*args).compile()
                grads[name] = [np.asarray(g, np.float32) for g in executables[name](*args)]
        except Exception as error:  # a shape that fails says why; the others run
            print(f"B{batch} H{q_heads}:{kv_heads} S{length}: {type(error).__name__}: "
                  f"{str(error)[:600]}", flush=True)
            continue
        finally:
            mosaic_eligibility.FUSE_CAPTURED_GRADIENTS = False
        rounds = {name: [] for name in variants}
        for _ in range(7):
            for name in variants:
                rounds[name].append(_ms(executables[name], args))
        ms = {name: statistics.median(r) for name, r in rounds.items()}
        differences = [float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                       for a, b in zip(grads["fused"], grads["two_kernels"])]
        print(f"B{batch} H{q_heads}:{kv_heads} S{length} D64 causal ALiBi fwd+bwd ms: "
              f"two kernels {ms['two_kernels']:.3f}, fused {ms['fused']:.3f}, without the "
              f"slopes' gradient {ms['no_gradient']:.3f}; cost "
              f"{ms['two_kernels'] / ms['no_gradient']:.3f}x / "
              f"{ms['fused'] / ms['no_gradient']:.3f}x; fused against two kernels "
              f"(dq, dk, dv, d_slopes, relative): "
              + ", ".join(f"{d:.2e}" for d in differences), flush=True)


if __name__ == "__main__":
    import sys
    lower_only() if "--lower" in sys.argv[1:] else main()
