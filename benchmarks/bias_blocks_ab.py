"""A/B probe (delete after recording): a score_mod adding a bias tensor on the Mosaic
forward (block reads, `forward_kernel="mosaic"`) against the Triton forward (the
default), forward only, paired rounds. Measured (H200, 2026-11-29), Evoformer R256 S256
H8 D64: Mosaic 0.275 ms with the blocks loaded when the mod runs, 0.345 with their loads
issued during the q.k (reverted), Triton 0.244, XLA 1.09. Not yet: the long-sequence
rows (below; with the bias captured by the score_mod as a constant they printed nothing
in 380 s: now a jit argument, and each step says when it is done) and D128, which decide
whether "auto" should take bias tensors to the Mosaic forward
(`mosaic_eligibility.unsupported_reason`).
PYTHONPATH=$PWD python3 -m benchmarks.bias_blocks_ab"""
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench import cases, jax_suites
from pallas_flex.bench.timing import time_paired

rng = np.random.default_rng(0)
MOSAIC = {"forward_kernel": "mosaic"}
# A bias [1, H, S, S] on B4 H16 S4096 D128, causal and not.
q, k, v = (jnp.asarray(rng.standard_normal((4, 4096, 16, 128)), jnp.bfloat16) for _ in range(3))
bias = jnp.asarray(rng.standard_normal((1, 16, 4096, 4096)), jnp.bfloat16)
for mask_name, mask_mod in (("noop", None), ("causal", pf.masks.causal_mask)):
    block_mask = None if mask_mod is None else pf.create_block_mask(mask_mod, None, None,
                                                                     4096, 4096)
    calls, outs = {}, {}
    for name, options in (("mosaic", MOSAIC), ("triton", None), ("no_bias", None)):
        fn = jax.jit(lambda q, k, v, b, options=options, name=name: pf.flex_attention(
            q, k, v, score_mod=None if name == "no_bias" else pf.scores.bias_lookup(b),
            block_mask=block_mask, backend="pallas", kernel_options=options))
        started = time.perf_counter()
        outs[name] = jax.block_until_ready(fn(q, k, v, bias))
        print(f"  {mask_name} {name}: first call {time.perf_counter() - started:.1f} s",
              flush=True)
        calls[name] = (fn, (q, k, v, bias))
    diff = float(jnp.max(jnp.abs(outs["mosaic"].astype(jnp.float32)
                                 - outs["triton"].astype(jnp.float32))))
    result = time_paired(calls, rounds=5)
    print(f"bias B4 H16 S4096 D128 {mask_name}: max |mosaic - triton| {diff:.3g}; "
          + ", ".join(f"{n} {e['ms']:.4f} ms" for n, e in result.items()), flush=True)

# Evoformer gated self-attention, R256 S256 H8 (forward; 5x XLA is issue 21's bar).
for dim in (64, 128):
    shape = (1, 256, 256, 8, dim)
    q, k, v, gate = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    bias = jnp.asarray(rng.standard_normal((1, 8, 256, 256)), jnp.bfloat16)
    calls = {"xla": (jax.jit(jax_suites.plain_gated(cases.Shape("x", 1, 8, 8, 256, dim))),
                     (q, k, v, gate, bias))}
    outs = {}
    for name, options in (("mosaic", MOSAIC), ("triton", None)):
        fn = jax.jit(lambda q, k, v, g, b, options=options: pf.variants.gated_self_attention(
            q, k, v, g, pair_bias=b, backend="pallas", kernel_options=options))
        outs[name] = jax.block_until_ready(fn(q, k, v, gate, bias))
        calls[name] = (fn, (q, k, v, gate, bias))
    diff = float(jnp.max(jnp.abs(outs["mosaic"].astype(jnp.float32)
                                 - outs["triton"].astype(jnp.float32))))
    result = time_paired(calls, rounds=5)
    print(f"gated D{dim}: max |mosaic - triton| {diff:.3g}; " + ", ".join(
        f"{n} {e['ms']:.4f} ms ({result['xla']['ms'] / e['ms']:.2f}x XLA)"
        for n, e in result.items()), flush=True)
