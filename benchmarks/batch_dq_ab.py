"""A/B probe (delete after recording): Evoformer gated self-attention forward+backward
with the batch loop writing dQ (KernelOptions.backward_batch_dq: 16 x 256 tiles, no dQ
programs) against the default (batch loop for the pair bias's gradient beside the dQ
and dK/dV programs); XLA's plain code for scale. Paired rounds; gradients compared with
the default's; each variant's backward launches printed. Decides backward_batch_dq's
default. ~4 minutes of device time (D32, D64, and D32 with an MSA key mask).
PYTHONPATH=$PWD python3 -m benchmarks.batch_dq_ab"""
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench import cases, jax_suites
from pallas_flex.bench.timing import time_paired

rng = np.random.default_rng(0)
VARIANTS = {"default": None, "dq_16x256": {"backward_batch_dq": True}}


def step(fn):
    def run(q, k, v, gate, bias, d_out):
        out, pullback = jax.vjp(fn, q, k, v, gate, bias)
        return (out, *pullback(d_out))
    return jax.jit(run)


# (head dim, with AlphaFold's MSA key mask: a per-row mask_mod; XLA's plain code has none)
for dim, masked in ((32, False), (64, False), (32, True)):
    label = f"D{dim}" + (" key mask" if masked else "")
    shape = (1, 256, 256, 8, dim)
    q, k, v, gate, d_out = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                            for _ in range(5))
    bias = jnp.asarray(rng.standard_normal((1, 8, 256, 256)), jnp.bfloat16)
    key_mask = jnp.asarray(rng.random((1, 256, 256)) > 0.1) if masked else None
    args = (q, k, v, gate, bias, d_out)
    calls = {} if masked else {"xla": (step(jax_suites.plain_gated(
        cases.Shape("x", 1, 8, 8, 256, dim))), args)}
    outs = {}
    for name, options in VARIANTS.items():
        fn = step(lambda q, k, v, g, b, options=options: pf.variants.gated_self_attention(
            q, k, v, g, pair_bias=b, key_mask=key_mask, backend="pallas",
            kernel_options=options))
        started = time.perf_counter()
        try:
            outs[name] = jax.block_until_ready(fn(*args))
        except Exception as error:  # noqa: BLE001 - a probe reports and goes on
            print(f"  {label} {name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        launches = sorted(set(re.findall(r"name=(flex_attention_backward\w*)",
                                         str(jax.make_jaxpr(fn)(*args)))))
        print(f"  {label} {name}: first call {time.perf_counter() - started:.1f} s, "
              f"launches {launches}", flush=True)
        calls[name] = (fn, args)
    for name in outs:
        diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                 for a, b in zip(outs[name], outs["default"])]
        print(f"  {label} {name}: max |x - default| out, dq, dk, dv, dgate, dbias "
              + " ".join(f"{d:.3g}" for d in diffs), flush=True)
    result = time_paired(calls, rounds=7)
    base = result["xla" if "xla" in result else "default"]["ms"]
    print(f"gated {label} fwd+bwd: " + ", ".join(
        f"{n} {e['ms']:.4f} ms ({base / e['ms']:.2f}x {'XLA' if 'xla' in result else 'default'})"
        for n, e in result.items()), flush=True)
