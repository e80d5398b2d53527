"""A/B probe (delete after recording): prefill over an 8-bit paged cache, the Triton
forward dequantizing each tile it reads, against the pages dequantized to bf16 first
(`quantize.dequantized_pages`) and the 16-bit forward (Mosaic) on them. B4 H16 (and GQA
32:8), new tokens on 8192, D 128, pages of 64, causal at the offset, paired rounds.
PYTHONPATH=$PWD python3 -m benchmarks.dequantized_prefill_ab"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench.jax_suites import _shuffled_pages
from pallas_flex.bench.timing import time_paired
from pallas_flex.paged.quantize import dequantize, dequantized_pages, quantize

QUICK = "--quick" in sys.argv
BACKEND = "interpret" if QUICK else "pallas"
TOTAL, D, PAGE = (256, 64, 16) if QUICK else (8192, 128, 64)
rng = np.random.default_rng(0)
for (B, HQ, HKV) in ((4, 16, 16), (4, 32, 8)):
    k, v = (jnp.asarray(rng.standard_normal((B, TOTAL, HKV, D)), jnp.bfloat16) for _ in range(2))
    (k_pages, table, owner), (v_pages, _, _) = (_shuffled_pages(x, PAGE) for x in (k, v))
    lengths = jnp.full((B,), TOTAL, jnp.int32)
    for new in ((64,) if QUICK else (2048, 512, 128, 32)):
        offset = TOTAL - new
        q = jnp.asarray(rng.standard_normal((B, new, HQ, D)), jnp.bfloat16)

        def causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx
        block_mask = pf.create_block_mask(causal, None, None, new, TOTAL)
        for dtype in ("int8", "float8_e4m3fn"):
            (kv_, ks), (vv, vs) = (quantize(x, jnp.dtype(dtype)) for x in (k_pages, v_pages))
            cache = pf.paged.PagedKVCache(kv_, vv, table, lengths, owner, ks, vs)

            @jax.jit
            def in_kernel(q, cache):
                return pf.paged.paged_flex_attention(q, cache, block_mask=block_mask,
                                                     backend=BACKEND)

            def dequantized(page_size):
                @jax.jit
                def run(q, cache):
                    kp, t = dequantized_pages(cache.k_pages, cache.k_scales, cache.page_table,
                                              q.dtype, page_size)
                    vp, _ = dequantized_pages(cache.v_pages, cache.v_scales, cache.page_table,
                                              q.dtype, page_size)
                    c16 = pf.paged.PagedKVCache(kp, vp, t, cache.lengths,
                                                jnp.zeros((kp.shape[0],), jnp.int32))
                    return pf.paged.paged_flex_attention(q, c16, block_mask=block_mask,
                                                         backend=BACKEND)
                return run
            calls = {"in_kernel": in_kernel, "dequantized_p64": dequantized(PAGE),
                     "dequantized_p128": dequantized(2 * PAGE)}
            outs = {name: jax.block_until_ready(fn(q, cache)) for name, fn in calls.items()}
            for name, out in outs.items():
                diff = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                             - outs["in_kernel"].astype(jnp.float32))))
                print(f"B{B} Hq{HQ}:{HKV} new {new} {dtype} {name} max diff vs in_kernel "
                      f"{diff:.3g}", flush=True)
            timed = time_paired({n: (fn, (q, cache)) for n, fn in calls.items()},
                                rounds=1 if QUICK else 7)
            print(f"B{B} Hq{HQ}:{HKV} new {new} {dtype}: " + ", ".join(
                f"{n} {e['ms']:.4f}" for n, e in timed.items()), flush=True)
