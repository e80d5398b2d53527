"""Probe (issue 21): attention sinks folded into the forward kernels' normalization.

checks: forward (out, lse) and gradients (q, k, v, sinks; through out and lse) of
  `pf.attention(..., sinks=)` on the GPU against a float64 model (the sink as one more
  column of the softmax), for bfloat16 / float16 / float32, D 64 / 128, GQA (8:2), a ragged
  length (1000), fully masked rows (the first 32 queries see no key: zeros, lse = sink),
  sinks far above (30) and below (-20) the logits, with and without ALiBi (the Mosaic
  kernel's row term), on the kernels the dispatcher picks (Mosaic GPU forward and backward
  for 16-bit on the H100, Triton for float32) and on the Triton kernels by name.
timing: B4 H16 S4096 D128 bfloat16 causal, forward and forward+backward (gradients of q,
  k, v and the sinks), paired rounds: with sinks, without, and the former scheme (the
  kernels without sinks, then `merge_sinks`' elementwise pass, differentiated by
  autodiff); the forward also on the Triton kernel. Acceptance: sinks / no_sinks <= 1.03.
  Also counts, in the compiled forward+backward, the reductions to [B, S, H] float32 (the
  rows' delta): the sinks' gradient should share the backward's, so the counts match.

Run: PYTHONPATH=$PWD python3 benchmarks/probes/sinks_gpu.py $OUT [checks|timing]
Writes $OUT/sinks_gpu.json. SINKS_PROBE_SMOKE=1 shrinks every shape (a CPU dry run of the
script itself, on the default backend there).
"""
import json
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex import masks
from pallas_flex.bench import cases
from pallas_flex.bench.timing import time_paired
from pallas_flex.sinks import merge_sinks

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["checks", "timing"]
report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}


def save():
    with open(f"{out_dir}/sinks_gpu.json", "w") as f:
        json.dump(report, f, indent=1)


# -- checks ------------------------------------------------------------------------------

SINKS = np.array([0.5, -1.0, 2.0, 30.0, 0.0, -20.0, 1.0, 3.0], np.float32)
SMOKE = bool(os.environ.get("SINKS_PROBE_SMOKE"))
BATCH, Q_HEADS, KV_HEADS, LENGTH, MASKED_ROWS = 2, 8, 2, 200 if SMOKE else 1000, 32
TRITON = {"forward_kernel": "triton", "backward_kernel": "triton"}
# (dtype, head dim, ALiBi, kernel_options)
CHECKS = [(dtype, dim, False, None) for dtype in ("bfloat16", "float16", "float32")
          for dim in (64, 128)] + [
    ("bfloat16", 128, True, None), ("float16", 64, True, None),
    ("bfloat16", 64, False, TRITON), ("float16", 128, False, TRITON),
    ("bfloat16", 128, True, TRITON)]


def late_causal(b, h, q_idx, kv_idx):
    return (q_idx >= MASKED_ROWS) & (kv_idx <= q_idx)


def model(q, k, v, sinks, bias):
    """float64 (out, lse): softmax over [scores, sink_h], the first rows fully masked."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[3]) + bias
    rows, columns = np.arange(LENGTH)[:, None], np.arange(LENGTH)[None, :]
    scores = jnp.where((columns <= rows) & (rows >= MASKED_ROWS), scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], scores.shape[:3] + (1,))
    both = jnp.concatenate([scores, sink], axis=-1)
    lse = jax.nn.logsumexp(both, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(both[..., :-1] - lse[..., None]), v), lse


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check(dtype_name, dim, alibi, options):
    dtype = jnp.dtype(dtype_name)
    keys = jax.random.split(jax.random.key(dim), 5)
    q = jax.random.normal(keys[0], (BATCH, LENGTH, Q_HEADS, dim)).astype(dtype)
    k = jax.random.normal(keys[1], (BATCH, LENGTH, KV_HEADS, dim)).astype(dtype)
    v = jax.random.normal(keys[2], (BATCH, LENGTH, KV_HEADS, dim)).astype(dtype)
    d_out = jax.random.normal(keys[3], (BATCH, LENGTH, Q_HEADS, dim)).astype(dtype)
    d_lse = jax.random.normal(keys[4], (BATCH, Q_HEADS, LENGTH))
    slopes = np.asarray(pf.scores.alibi_slopes(Q_HEADS)) if alibi else np.zeros(Q_HEADS)
    score_mod = masks.alibi(jnp.asarray(slopes, jnp.float32)) if alibi else None

    def ours(q, k, v, sinks):
        return pf.attention(q, k, v, mask_mod=late_causal, score_mod=score_mod, sinks=sinks,
                            return_lse=True, kernel_options=options)

    @jax.jit
    def step(q, k, v, sinks, d_out, d_lse):
        (out, lse), pullback = jax.vjp(ours, q, k, v, sinks)
        return out, lse, pullback((d_out, d_lse))

    explained = pf.explain(q, k, v, mask_mod=late_causal, score_mod=score_mod,
                           kernel_options=options)
    start = time.perf_counter()
    out, lse, grads = jax.block_until_ready(step(q, k, v, jnp.asarray(SINKS), d_out, d_lse))
    compile_s = time.perf_counter() - start

    with jax.enable_x64(True):
        bias = (slopes[:, None, None] * (np.arange(LENGTH)[None, None, :]
                                         - np.arange(LENGTH)[None, :, None]))
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, SINKS)]
        cotangents = [jnp.asarray(np.asarray(x, np.float64)) for x in (d_out, d_lse)]

        @jax.jit
        def golden(*args):
            (out, lse), pullback = jax.vjp(lambda *a: model(*a, bias), *args)
            return out, lse, pullback(tuple(cotangents))
        want_out, want_lse, want_grads = golden(*args)
        want_out, want_lse = np.asarray(want_out), np.asarray(want_lse)
        want_grads = [np.asarray(g) for g in want_grads]

    sixteen_bit = dtype != jnp.float32
    eps = float(jnp.finfo(dtype).eps)
    errors = {
        "out": relative_error(out, want_out),
        "lse_abs": float(np.abs(np.asarray(lse, np.float64) - want_lse).max()),
        **{f"d{name}": relative_error(g, w) for name, g, w in zip("qkv", grads, want_grads)},
        "dsinks": relative_error(grads[3], want_grads[3]),
    }
    limits = {"out": 2 * eps if sixteen_bit else 2e-4,
              "lse_abs": 2e-2 if sixteen_bit else 1e-4,
              "dq": 2e-2 if sixteen_bit else 1e-3, "dk": 2e-2 if sixteen_bit else 1e-3,
              "dv": 2e-2 if sixteen_bit else 1e-3, "dsinks": 2e-2 if sixteen_bit else 1e-3}
    masked_out = np.asarray(out[:, :MASKED_ROWS], np.float32)
    masked_lse = np.asarray(lse[:, :, :MASKED_ROWS])
    flags = {
        "masked_rows_zero": bool((masked_out == 0).all()),
        "masked_rows_lse_is_sink": bool(np.allclose(
            masked_lse, np.broadcast_to(SINKS[None, :, None], masked_lse.shape), rtol=1e-5,
            atol=1e-5)),
        "finite": bool(all(np.isfinite(np.asarray(x, np.float32)).all()
                           for x in (out, lse, *grads))),
        **{f"{name}_within": errors[name] <= limit for name, limit in limits.items()},
    }
    return {"case": f"{dtype_name} d{dim}{' alibi' if alibi else ''}"
                    f"{' triton' if options else ''}",
            "kernels": explained, "compile_s": compile_s, "errors": errors,
            "limits": limits, **flags, "ok": all(flags.values())}


if "checks" in parts:
    report["checks"] = []
    for case in CHECKS:
        try:
            row = check(*case)
        except Exception as error:
            traceback.print_exc()
            row = {"case": str(case), "error": f"{type(error).__name__}: {error}"[:2000],
                   "ok": False}
        print(json.dumps(row), flush=True)
        report["checks"].append(row)
        save()
    report["checks_ok"] = all(row["ok"] for row in report["checks"])
    save()


# -- timing ------------------------------------------------------------------------------

def delta_reductions(compiled_text, batch, length, heads):
    return len(re.findall(rf"f32\[{batch},{length},{heads}\]\{{[^}}]*\}} reduce\(",
                          compiled_text))


if "timing" in parts:
    shape = (cases.Shape("tiny", 1, 4, 4, 256, 64) if SMOKE
             else cases.Shape("b4_s4096_d128", 4, 16, 16, 4096, 128))
    q, k, v, d_out = (jnp.asarray(x, jnp.bfloat16) for x in cases.inputs(shape))
    sinks = jnp.asarray(cases.normal((shape.q_heads,), 10))
    block_mask = pf.create_block_mask(masks.causal_mask, None, None, shape.seq_len,
                                      shape.seq_len)

    def attend(q, k, v, s=None, options=None):
        return pf.flex_attention(q, k, v, block_mask=block_mask, sinks=s,
                                 kernel_options=options)

    def merged_after(q, k, v, s, options=None):  # the former scheme
        out, lse = pf.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                     kernel_options=options)
        return merge_sinks(out, lse, s)[0]

    def forward(fn, **kw):
        return jax.jit(lambda q, k, v, *s: fn(q, k, v, *s, **kw))

    def forward_backward(fn):
        def step(q, k, v, d_out, *s):
            out, pullback = jax.vjp(fn, q, k, v, *s)
            return out, pullback(d_out)
        return jax.jit(step)

    triton = {"forward_kernel": "triton"}
    modes = {
        "fwd": {"sinks": (forward(attend), (q, k, v, sinks)),
                "no_sinks": (forward(attend), (q, k, v)),
                "merge_after": (forward(merged_after), (q, k, v, sinks)),
                "triton_sinks": (forward(attend, options=triton), (q, k, v, sinks)),
                "triton_no_sinks": (forward(attend, options=triton), (q, k, v))},
        "fwd_bwd": {"sinks": (forward_backward(attend), (q, k, v, d_out, sinks)),
                    "no_sinks": (forward_backward(attend), (q, k, v, d_out)),
                    "merge_after": (forward_backward(merged_after), (q, k, v, d_out, sinks))},
    }
    report["timing"] = {"shape": f"{shape.name} bfloat16 causal",
                        "kernels": pf.explain(q, k, v, block_mask=block_mask)}
    for mode, calls in modes.items():
        row = {}
        for column, (fn, args) in list(calls.items()):
            try:
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                row[column] = {"compile_s": time.perf_counter() - start}
            except Exception as error:
                traceback.print_exc()
                row[column] = {"error": f"{type(error).__name__}: {error}"[:2000]}
                del calls[column]
        for column, entry in time_paired(calls, rounds=2 if SMOKE else 9,
                                         iters=2 if SMOKE else 20).items():
            row[column].update(entry)
        ms = {column: row[column].get("ms") for column in row}
        if ms.get("sinks") and ms.get("no_sinks"):
            row["sinks_over_no_sinks"] = ms["sinks"] / ms["no_sinks"]
            row["acceptance_met"] = row["sinks_over_no_sinks"] <= 1.03
        if ms.get("triton_sinks") and ms.get("triton_no_sinks"):
            row["triton_sinks_over_no_sinks"] = ms["triton_sinks"] / ms["triton_no_sinks"]
        if mode == "fwd_bwd":
            for column in ("sinks", "no_sinks"):
                if column in calls:
                    fn, args = calls[column]
                    text = fn.lower(*args).compile().as_text()
                    row[column]["delta_reductions"] = delta_reductions(
                        text, shape.batch, shape.seq_len, shape.q_heads)
        print(mode, json.dumps({c: (round(m, 4) if m else m) for c, m in ms.items()}),
              row.get("sinks_over_no_sinks"), flush=True)
        report["timing"][mode] = row
        save()
save()
