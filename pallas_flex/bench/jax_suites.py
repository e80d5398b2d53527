"""The JAX side of every suite: pallas_flex and the JAX peers (cuDNN, tokamax, JAX's
Pallas `paged_attention`, the XLA paths). A suite is `run(options) -> (columns, metric,
rows)`: the implementations timed (ours first: ratios are taken against it), the entries'
value key ("ms", "s", "peak_mib"), rows {"case", "params", column: entry}, an entry being
{metric: value, ...} or {"status", "reason"}. `options`: shapes, variants, backend,
timing, `quick` (tiny CPU sizes)."""

from __future__ import annotations

import dataclasses
import functools
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from pallas_flex.bench import cases
from pallas_flex.bench.timing import error_entry, time_calls, time_paired
from pallas_flex.paged.quantize import quantize

OURS = "pallas_flex"


def mods(variant: cases.Variant, shape: cases.Shape, arrays=jnp.asarray, tanh=jnp.tanh):
    """(mask_mod, score_mod) of a variant, as a user writes them; queries sit at the end of
    the keys (decode: the one query at Skv - 1). `arrays`/`tanh` make torch's twin."""
    offset = shape.seq_len - shape.queries
    if variant.mask == "document":
        ids = arrays(cases.document_ids(shape.seq_len, variant.documents))
    if variant.score == "alibi":
        slopes = arrays(np.asarray(pf.scores.alibi_slopes(shape.q_heads)))
    masks = {
        "none": None,
        "causal": lambda b, h, q, kv: q + offset >= kv,
        "sliding": lambda b, h, q, kv: (q + offset >= kv) & (q + offset - kv < variant.window),
        "prefix": lambda b, h, q, kv: (kv < variant.prefix) | (q + offset >= kv),
        "document": lambda b, h, q, kv: (ids[q + offset] == ids[kv]) & (q + offset >= kv),
    }
    scores = {
        "none": None,
        "alibi": lambda s, b, h, q, kv: s + slopes[h] * (kv - q - offset),
        "softcap": lambda s, b, h, q, kv: variant.cap * tanh(s / variant.cap),
    }
    return masks[variant.mask], scores[variant.score]


def _bf16(*arrays):
    return [jnp.asarray(x, jnp.bfloat16) for x in arrays]


def _step(attend, mode):
    """One timed call: the output (fwd), or the output and dq, dk, dv for the cotangent
    d_out (fwd_bwd, the vector-Jacobian product of one jitted step)."""
    def step(q, k, v, d_out, *extra):
        if mode == "fwd":
            return attend(q, k, v, *extra)
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, *extra), q, k, v)
        return (out, *pullback(d_out))
    return jax.jit(step)


def _difference(ours, other) -> float:
    """Largest |ours - other| relative to max |other|, over every returned array."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(other)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)),
                                                                        1e-6)))
    return worst


def _chained(attend, steps):
    """attend(q, *rest) applied `steps` times, each output the next query (Dv = D)."""
    if steps == 1:
        return attend

    def chained(q, *rest):
        out = q
        for _ in range(steps):
            out = attend(out.reshape(q.shape).astype(q.dtype), *rest)
        return out
    return chained


def _measure(row, name, fn, args, options, ours_out=None, steps=1, timed=None):
    """Times `fn(*args)` into row[name] (ms per step of a call chaining `steps`); returns
    its output (a failure is the entry). timed: a dict that collects {name: (fn, args,
    steps)} of the calls that ran, which `_pair` then times together: here they only
    compile and run once (a quick run times them here)."""
    print(f"  {row['case']}: {name}", flush=True)
    try:
        if timed is not None and not options.quick:
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            row[name] = {"compile_s": time.perf_counter() - start}
            timed[name] = (fn, args, steps)
            if ours_out is not None:
                row[name]["max_rel_diff_vs_ours"] = _difference(ours_out, out)
            return out
        row[name], out = time_calls(fn, args, **options.timing)
        if steps > 1:
            row[name]["ms"] /= steps
            row[name]["repeats_ms"] = [t / steps for t in row[name]["repeats_ms"]]
        if ours_out is not None:
            row[name]["max_rel_diff_vs_ours"] = _difference(ours_out, out)
        return out
    except Exception as error:
        traceback.print_exc()
        row[name] = error_entry(error, "error" if ours_out is None else "unsupported")
        return None


def _pair(row, timed, options):
    """Times the calls in `timed` ({column: (fn, args, steps)}, each compiled and run once
    by `_measure`) in paired rounds, each round running every column once (every other
    round in the reverse order), and makes
    those rounds' median the entries' ms: the H100's clock drifts under sustained load
    (docs/gpu-notes.md, Measuring), which columns timed one after another would pay
    unequally. A quick run has timed them in `_measure` already."""
    if not timed or options.quick:
        return
    try:
        paired = time_paired({name: (fn, args) for name, (fn, args, _) in timed.items()},
                             rounds=options.timing["repeats"], iters=options.timing["iters"])
    except Exception:  # each on its own then, so that one failure stays its own
        traceback.print_exc()
        paired = {}
        for name, (fn, args, _) in timed.items():
            try:
                paired[name] = time_paired({name: (fn, args)}, rounds=options.timing["repeats"],
                                           iters=options.timing["iters"])[name]
            except Exception as error:
                row[name] = error_entry(error, "error" if name == OURS else "unsupported")
    for name, entry in paired.items():
        steps = timed[name][2]
        row[name].update(ms=entry["ms"] / steps,
                         rounds_ms=[t / steps for t in entry["rounds_ms"]],
                         timing="paired rounds")


def _samples(out, shape):
    """The sampled elements the torch peer also reports (out, dq; dk, dv at KV heads)."""
    arrays = out if isinstance(out, tuple) else (out,)
    return [np.asarray(x[cases.sample_positions(shape, kv=i in (2, 3))].astype(jnp.float32))
            .tolist() for i, x in enumerate(arrays)]


def _cudnn(variant, shape, kv_lengths=None):
    kwargs = {"is_causal": variant.mask in ("causal", "sliding") and shape.q_len is None}
    if variant.mask == "sliding":
        kwargs["local_window_size"] = (variant.window - 1, 0)
    if kv_lengths is not None:  # decode, bottom-right causal: each query sees its keys
        kwargs["query_seq_lengths"] = jnp.ones(shape.batch, jnp.int32)
        kwargs["key_value_seq_lengths"] = kv_lengths
    return functools.partial(jax.nn.dot_product_attention, scale=shape.scale,
                             implementation="cudnn", **kwargs)


# -- forward, fwd_bwd, decode -------------------------------------------------------------

def attention(options, mode: str, decode: bool = False):
    """Ours against cuDNN and tokamax's Mosaic GPU kernel (where they can express the
    variant) or, for decode, cuDNN and JAX's Pallas paged_attention on a paged cache.
    Decode times each column per step of a call chaining dependent steps (Dv = D), our
    noop call with no BlockMask and causal_in_call with the mask built in the call."""
    on_gpu = jax.default_backend() == "gpu"
    columns = [OURS, "cudnn"] + (["jax_paged"] if decode else ["tokamax"])
    rows = []
    for shape in options.shapes:
        q, k, v, d_out = _bf16(*cases.inputs(shape))
        for variant in options.variants:
            if decode and shape.dv != shape.head_dim and variant.name != "noop":
                continue  # latent attention (MLA) is measured plain: the masks cost the same
            row = {"case": f"{shape.name} {variant.name}", "params": {
                **dataclasses.asdict(shape), "shape": shape.name, "variant": variant.name,
                "mode": mode, "flops": cases.flops(variant, shape, mode),
                **({"bytes": shape.kv_bytes} if decode else {})}}
            mask_mod, score_mod = mods(variant, shape)
            block_mask = pf.create_block_mask(mask_mod, None, None, shape.queries,
                                              shape.seq_len)
            # Decode: `steps` dependent steps per timed call (each output the next query),
            # ms per step: a ~0.2 ms call timed back to back from Python would measure the
            # host. Latent attention (Dv != D) cannot feed its output back: one step.
            steps = ((2 if options.quick else 8) if decode and shape.dv == shape.head_dim
                     else 1)
            row["params"]["steps_per_call"] = steps

            def ours(q, k, v, block_mask):
                if decode and variant.name == "noop":  # no BlockMask at all
                    return pf.flex_attention(q, k, v, score_mod, scale=shape.scale,
                                             backend=options.backend)
                if variant.name.endswith("_in_call"):  # built inside the timed call
                    return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                        scale=shape.scale, backend=options.backend)
                return pf.flex_attention(q, k, v, score_mod, block_mask, scale=shape.scale,
                                         backend=options.backend)
            if steps > 1:  # the samples the torch peer compares: one step's
                row["samples"] = _samples(jax.jit(ours)(q, k, v, block_mask), shape)
            timed = {}
            out = _measure(row, OURS, _step(_chained(ours, steps), mode),
                           (q, k, v, d_out, block_mask), options, steps=steps, timed=timed)
            if out is not None and steps == 1:
                row["samples"] = _samples(out, shape)
            if not on_gpu:
                row["cudnn"] = {"status": "n/a", "reason": "no GPU"}
            elif not variant.cudnn_expressible or shape.dv != shape.head_dim:
                row["cudnn"] = {"status": "inexpressible", "reason": "a mask or score_mod "
                                "cuDNN has no form for, or Dv != D"}
            else:
                lengths = jnp.full(shape.batch, shape.seq_len, jnp.int32) if decode else None
                _measure(row, "cudnn", _step(_chained(_cudnn(variant, shape, lengths), steps),
                                             mode),
                         (q, k, v, d_out), options, out, steps=steps, timed=timed)
            if decode:
                _jax_paged(row, variant, shape, (q, k, v), options, out, steps=steps,
                           timed=timed)
            else:
                _tokamax(row, variant, shape, (q, k, v, d_out), mode, options, out, timed)
            _pair(row, timed, options)
            rows.append(row)
    return columns, "ms", rows


def _tokamax(row, variant, shape, args, mode, options, ours_out, timed=None):
    """tokamax's Mosaic GPU attention (causal, windows, soft-cap; optional: pip install)."""
    if variant.mask not in ("none", "causal", "sliding") or variant.score == "alibi":
        row["tokamax"] = {"status": "inexpressible", "reason": "no such mask or score"}
    elif jax.default_backend() != "gpu":
        row["tokamax"] = {"status": "n/a", "reason": "no GPU"}
    if "tokamax" in row:
        return
    try:
        import tokamax
    except ImportError as error:
        row["tokamax"] = error_entry(error, "n/a")
        return
    attend = functools.partial(
        tokamax.dot_product_attention, scale=shape.scale, is_causal=variant.mask != "none",
        local_window_size=(variant.window - 1, 0) if variant.mask == "sliding" else None,
        logits_soft_cap=variant.cap if variant.score == "softcap" else None,
        implementation="mosaic")
    _measure(row, "tokamax", _step(attend, mode), args, options, ours_out, timed=timed)


def _jax_paged(row, variant, shape, qkv, options, ours_out, page_size=16, k_splits=16,
               steps=1, timed=None):
    """JAX's Pallas Triton paged_attention (no ALiBi, Dv = D, S a multiple of k_splits
    pages; it applies no softmax scale, so q is scaled first)."""
    if variant.mask not in ("none", "causal") or variant.score == "alibi" \
            or shape.dv != shape.head_dim \
            or shape.seq_len % (page_size * k_splits):
        row["jax_paged"] = {"status": "inexpressible", "reason": "ALiBi, Dv != D or a length "
                            "that is no multiple of 16 pages"}
        return
    try:
        with warnings.catch_warnings():  # the module says it is deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import paged_attention
    except ImportError as error:
        row["jax_paged"] = error_entry(error, "n/a")
        return
    q, k, v = qkv
    (k_pages, table, _), (v_pages, _, _) = (_shuffled_pages(x, page_size) for x in (k, v))
    k_pages, v_pages = k_pages.transpose(1, 0, 2, 3), v_pages.transpose(1, 0, 2, 3)
    scale = shape.scale or shape.head_dim ** -0.5
    cap = variant.cap if variant.score == "softcap" else None

    def call(q, k_pages, v_pages, table):
        query = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)
        return paged_attention.paged_attention(
            query, k_pages, v_pages, table, jnp.full(shape.batch, shape.seq_len, jnp.int32),
            attn_logits_soft_cap=cap, k_splits=k_splits,
            interpret=jax.default_backend() != "gpu")[:, None]
    _measure(row, "jax_paged", jax.jit(_chained(call, steps)), (q, k_pages, v_pages, table),
             options, ours_out, steps=steps, timed=timed)


def _shuffled_pages(x, page_size):
    """x [B, S, H, D] -> pages [B * S / page_size, H, page_size, D] in a seeded random
    physical order, the page table int32 [B, S / page_size] and each page's row."""
    b, s, h, d = x.shape
    table = np.random.default_rng([cases.INPUT_SEED, 5]).permutation(b * s // page_size)
    logical = np.argsort(table)  # the logical page at each physical page
    pages = x.reshape(-1, page_size, h, d).transpose(0, 2, 1, 3)[jnp.asarray(logical)]
    return (pages, jnp.asarray(table.reshape(b, -1), jnp.int32),
            jnp.asarray(logical // (s // page_size), jnp.int32))


def score_mods(options):
    """Each common score_mod on the causal forward against the same call without it (the
    `causal` column): its ratio to causal is what the mod costs."""
    rows = []
    for shape in options.shapes:
        q, k, v, _ = _bf16(*cases.inputs(shape))
        block_mask = pf.create_block_mask(pf.masks.causal_mask, None, None, shape.seq_len,
                                          shape.seq_len)
        table = jnp.asarray(cases.normal((shape.q_heads, 32), 4))
        bias = None if shape.seq_len > 8192 else pf.scores.bias_lookup(jnp.asarray(  # dense
            cases.normal((1, shape.q_heads, shape.seq_len, shape.seq_len), 5), jnp.bfloat16))
        row = {"case": shape.name, "params": {
            **dataclasses.asdict(shape), "flops": cases.flops(cases.VARIANTS[1], shape, "fwd")}}
        for column, score_mod in {
                "causal": None, "alibi": pf.scores.alibi(pf.scores.alibi_slopes(shape.q_heads)),
                "relative_position": pf.scores.relative_position(0.01),
                "t5_bias": pf.scores.t5_relative_bias(table, bidirectional=False),
                "bias_lookup": bias,
                "softcap": pf.scores.tanh_softcap(30.0)}.items():
            if column == "bias_lookup" and score_mod is None:
                row[column] = {"status": "skipped", "reason": "a dense [H, S, S] bias"}
                continue
            attend = jax.jit(lambda q, k, v, m, mod=score_mod: pf.flex_attention(
                q, k, v, mod, m, backend=options.backend))
            _measure(row, column, attend, (q, k, v, block_mask), options)
        rows.append(row)
    return ["causal", "alibi", "relative_position", "t5_bias", "bias_lookup", "softcap"], \
        "ms", rows


def captured_gradients(options):
    """Training a score_mod's captured array (issue 16): forward+backward of the causal
    call with learnable ALiBi slopes [Hq] and a T5 table [Hq, 32], the gradients of q, k,
    v and the array against those of q, k, v alone (the same call, which skips the
    captured-gradient work), in paired rounds. At most 1.1x is the bar."""
    causal = pf.masks.causal_mask
    rows = []
    for shape in options.shapes:
        q, k, v, d_out = _bf16(*cases.inputs(shape))
        block_mask = pf.create_block_mask(causal, None, None, shape.seq_len, shape.seq_len)
        for name, table, make_mod in (
                ("alibi_slopes", jnp.asarray(pf.scores.alibi_slopes(shape.q_heads)),
                 pf.scores.alibi),
                ("t5_table", jnp.asarray(cases.normal((shape.q_heads, 32), 4)),
                 lambda table: pf.scores.t5_relative_bias(table, bidirectional=False))):

            def attend(q, k, v, table, block_mask, make_mod=make_mod):
                return pf.flex_attention(q, k, v, make_mod(table), block_mask,
                                         backend=options.backend)
            row = {"case": f"{shape.name} {name}", "params": {
                **dataclasses.asdict(shape), "mode": "fwd_bwd", "captured": name,
                "flops": cases.flops(cases.VARIANTS[1], shape, "fwd_bwd")}}
            args = (q, k, v, table, block_mask, d_out)
            _run_paired(row, {OURS: (_grad_step(attend, "fwd_bwd", (0, 1, 2, 3)), args),
                              "no_table_gradient": (_grad_step(attend, "fwd_bwd", (0, 1, 2)),
                                                    args)}, options)
            _acceptance(row, "no_table_gradient", 1.1, at_most=True)
            rows.append(row)
    return [OURS, "no_table_gradient"], "ms", rows


def plain_attention(variant: cases.Variant, shape: cases.Shape):
    """The variant as plain JAX code (what pf.fuse takes): einsums, `where` on a `tril`,
    ALiBi as broadcast arithmetic, a tanh cap, GQA by `jnp.repeat`, the softmax in
    float32 as mixed-precision code writes it."""
    length, group = shape.seq_len, shape.q_heads // shape.kv_heads
    scale = shape.scale or 1 / np.sqrt(shape.head_dim)
    slopes = jnp.asarray(pf.scores.alibi_slopes(shape.q_heads))

    def attend(q, k, v):
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
        if variant.score == "alibi":
            distance = jnp.arange(length)[None, :] - jnp.arange(length)[:, None]
            s = s + slopes[None, :, None, None] * distance
        if variant.score == "softcap":
            s = variant.cap * jnp.tanh(s / variant.cap)
        s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return attend


def fuse(options):
    """pf.fuse on plain JAX attention (forward+backward) against the hand-written
    pf.attention call of the same variant and XLA on the plain code (skipped past 8192
    tokens: its [B, H, S, S] scores do not fit)."""
    rows = []
    variants = [v for v in cases.VARIANTS if v.name in ("causal", "alibi", "softcap_30")]
    for shape in options.shapes:
        q, k, v, d_out = _bf16(*cases.inputs(shape))
        for variant in variants:
            row = {"case": f"{shape.name} {variant.name}", "params": {
                **dataclasses.asdict(shape), "shape": shape.name, "variant": variant.name,
                "mode": "fwd_bwd", "flops": cases.flops(variant, shape, "fwd_bwd")}}
            plain = plain_attention(variant, shape)
            mask_mod, score_mod = mods(variant, shape)
            hand_written = functools.partial(pf.attention, mask_mod=mask_mod,
                                             score_mod=score_mod, scale=shape.scale,
                                             backend=options.backend)
            fused = pf.fuse(plain, backend=options.backend)
            ours = _measure(row, OURS, _step(fused, "fwd_bwd"), (q, k, v, d_out), options)
            _measure(row, "hand_written", _step(hand_written, "fwd_bwd"), (q, k, v, d_out),
                     options, ours)
            if shape.seq_len > 8192:
                row["xla_unfused"] = {"status": "skipped",
                                      "reason": "[B, H, S, S] float32 scores"}
            else:
                _measure(row, "xla_unfused", _step(plain, "fwd_bwd"), (q, k, v, d_out),
                         options, ours)
            rows.append(row)
    return [OURS, "hand_written", "xla_unfused"], "ms", rows


# -- variants: attention sinks, differential attention, Evoformer gated attention ------------

def plain_differential(shape: cases.Shape):
    """Differential attention as the paper writes it (Ye et al. 2024, eq. 1), causal:
    (softmax(q1 k1^T * scale) - lam * softmax(q2 k2^T * scale)) v, GQA by `jnp.repeat`, the
    softmaxes in float32 as mixed-precision code writes them; lam [Hq]."""
    group = shape.q_heads // shape.kv_heads
    scale = shape.scale or 1 / np.sqrt(shape.head_dim)

    def weights(q, k):
        causal = jnp.tril(jnp.ones((shape.seq_len, shape.seq_len), bool))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, axis=2))
        return jax.nn.softmax(jnp.where(causal, s.astype(jnp.float32) * scale, -jnp.inf),
                              axis=-1)

    def attend(q1, k1, q2, k2, v, lam):
        p = weights(q1, k1) - lam[:, None, None] * weights(q2, k2)
        return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), jnp.repeat(v, group, axis=2))
    return attend


def plain_gated(shape: cases.Shape):
    """Evoformer MSA row attention with pair bias as AlphaFold writes it: per row
    softmax(q k^T * scale + pair_bias) v (the bias [B, H, S, S] broadcast over the rows),
    times sigmoid(gate); q, k, v, gate [B, R, S, H, D]."""
    scale = shape.scale or 1 / np.sqrt(shape.head_dim)

    def attend(q, k, v, gate, pair_bias):
        s = jnp.einsum("brqhd,brkhd->brhqk", q, k).astype(jnp.float32) * scale
        p = jax.nn.softmax(s + pair_bias[:, None].astype(jnp.float32), axis=-1)
        out = jnp.einsum("brhqk,brkhd->brqhd", p.astype(v.dtype), v)
        return (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(
            q.dtype)
    return attend


def _grad_step(fn, mode, argnums):
    """One timed call of fn(*args, d_out): the output (fwd), or the output and the
    gradients of the arguments `argnums` for the cotangent d_out (fwd_bwd)."""
    def step(*args):
        *args, d_out = args
        if mode == "fwd":
            return fn(*args)
        def free(*differentiated):
            full = list(args)
            for i, x in zip(argnums, differentiated):
                full[i] = x
            return fn(*full)
        out, pullback = jax.vjp(free, *[args[i] for i in argnums])
        return (out, *pullback(d_out))
    return jax.jit(step)


def _run_paired(row, calls, options, compare=()):
    """`calls` {column: (fn, args)}: each run once (compile_s and its output; a failure
    is its entry), then timed in paired rounds (docs/gpu-notes.md); the columns in
    `compare` get max_rel_diff_vs_ours against the first column's output."""
    outs = _run_once(row, calls,
                     failure_status=lambda column: "error" if column == OURS else "unsupported")
    timed = time_paired({column: calls[column] for column in outs},
                        rounds=2 if options.quick else 5,
                        iters=3 if options.quick else options.timing["iters"])
    for column, entry in timed.items():
        row[column].update(entry)
        if column in compare and OURS in outs:
            row[column]["max_rel_diff_vs_ours"] = _difference(outs[OURS], outs[column])


def _acceptance(row, column, limit, at_most, ours_column=OURS):
    """row["acceptance"]: `column`'s time over ours (at least `limit`), or ours over
    `column`'s (`at_most`: at most `limit`), and whether it holds; ours: the
    `ours_column` entry."""
    ours, other = (value.get("ms") for value in (row.get(ours_column, {}),
                                                 row.get(column, {})))
    if ours and other:
        ratio, text = ((ours / other, f"{ours_column} / {column} <= {limit}") if at_most else
                       (other / ours, f"{column} / {ours_column} >= {limit}"))
        row["acceptance"] = {"criterion": text, "value": ratio,
                             "met": ratio <= limit if at_most else ratio >= limit}


def variants(options):
    """Issue 21's variants, each against what it replaces, in paired rounds:
    attention sinks (`sinks=` [Hq]) on the causal forward, forward+backward (gradients of
    q, k, v and the sinks) and decode (one query through a prebuilt BlockMask, `steps`
    dependent steps a timed call: ms per step), against the same call without sinks;
    differential attention (forward+backward, all six gradients) against two pf.attention
    calls combined by hand and XLA on the paper's plain formulation; Evoformer gated
    self-attention (forward, forward+backward of q, k, v, gate and the pair bias) against
    XLA on AlphaFold's plain formulation."""
    causal = cases.VARIANTS[1]
    steps = 2 if options.quick else 8
    rows = []
    for case in options.shapes:
        shape = case.shape
        params = {**dataclasses.asdict(shape), "shape": shape.name, "variant": case.kind}
        q, k, v, d_out = _bf16(*cases.inputs(shape))
        if case.kind in ("sinks", "sinks_decode"):
            sinks = jnp.asarray(cases.normal((shape.q_heads,), 10))
            block_mask = pf.create_block_mask(mods(causal, shape)[0], None, None,
                                              shape.queries, shape.seq_len)

            def attend(q, k, v, block_mask, sinks=None):
                return pf.flex_attention(q, k, v, block_mask=block_mask, sinks=sinks,
                                         backend=options.backend)
        if case.kind == "sinks":
            for mode in ("fwd", "fwd_bwd"):
                row = {"case": f"sinks {shape.name} {mode}", "params": {
                    **params, "mode": mode, "flops": cases.flops(causal, shape, mode)}}
                _run_paired(row, {
                    OURS: (_grad_step(attend, mode, (0, 1, 2, 4)),
                           (q, k, v, block_mask, sinks, d_out)),
                    "no_sinks": (_grad_step(attend, mode, (0, 1, 2)),
                                 (q, k, v, block_mask, d_out))}, options)
                _acceptance(row, "no_sinks", 1.03, at_most=True)
                rows.append(row)
        elif case.kind == "sinks_decode":
            row = {"case": f"sinks {shape.name} step", "params": {
                **params, "mode": "fwd", "steps_per_call": steps, "kv_bytes": shape.kv_bytes}}
            _run_paired(row, {  # Dv = D: a step's output is the next query
                OURS: (jax.jit(_chained(attend, steps)), (q, k, v, block_mask, sinks)),
                "no_sinks": (jax.jit(_chained(attend, steps)), (q, k, v, block_mask))},
                options)
            for column in (OURS, "no_sinks"):
                if "ms" in row[column]:
                    row[column].update(ms=row[column]["ms"] / steps, rounds_ms=[
                        t / steps for t in row[column]["rounds_ms"]])
            _acceptance(row, "no_sinks", 1.02, at_most=True)
            rows.append(row)
        elif case.kind == "differential":
            q2, k2 = _bf16(cases.normal(q.shape, 11), cases.normal(k.shape, 12))
            lam = jnp.linspace(0.2, 0.8, shape.q_heads, dtype=jnp.float32)
            mask_mod = mods(causal, shape)[0]

            def ours(q1, k1, q2, k2, v, lam):
                return pf.variants.differential_attention(
                    q1, k1, q2, k2, v, lam, mask_mod=mask_mod, scale=shape.scale,
                    backend=options.backend)

            def two_calls(q1, k1, q2, k2, v, lam):
                first, second = (pf.attention(q, k, v, mask_mod=mask_mod, scale=shape.scale,
                                              backend=options.backend).astype(jnp.float32)
                                 for q, k in ((q1, k1), (q2, k2)))
                return (first - lam[:, None] * second).astype(q1.dtype)
            row = {"case": f"differential {shape.name} fwd_bwd", "params": {
                **params, "mode": "fwd_bwd", "flops": 2 * cases.flops(causal, shape,
                                                                      "fwd_bwd")}}
            args = (q, k, q2, k2, v, lam, d_out)
            _run_paired(row, {column: (_grad_step(fn, "fwd_bwd", tuple(range(6))), args)
                              for column, fn in ((OURS, ours), ("two_calls", two_calls),
                                                 ("xla_plain", plain_differential(shape)))},
                        options, compare=("two_calls", "xla_plain"))
            _acceptance(row, "xla_plain", 3, at_most=False)
            rows.append(row)
        elif case.kind == "gated":
            msa = (shape.batch, case.rows, shape.seq_len, shape.q_heads, shape.head_dim)
            q, k, v, gate, d_out = _bf16(*(cases.normal(msa, i) for i in range(5)))
            pair_bias = jnp.asarray(cases.normal(
                (shape.batch, shape.q_heads, shape.seq_len, shape.seq_len), 5), jnp.bfloat16)
            folded = dataclasses.replace(shape, batch=shape.batch * case.rows)

            def ours(q, k, v, gate, pair_bias):
                return pf.variants.gated_self_attention(q, k, v, gate, pair_bias=pair_bias,
                                                        scale=shape.scale,
                                                        backend=options.backend)
            for mode in ("fwd", "fwd_bwd"):
                row = {"case": f"gated {shape.name} {mode}", "params": {
                    **params, "rows": case.rows, "mode": mode,
                    "flops": cases.flops(cases.VARIANTS[0], folded, mode)}}
                args = (q, k, v, gate, pair_bias, d_out)
                _run_paired(row, {column: (_grad_step(fn, mode, tuple(range(5))), args)
                                  for column, fn in ((OURS, ours),
                                                     ("xla_plain", plain_gated(shape)))},
                            options, compare=("xla_plain",))
                _acceptance(row, "xla_plain", 5, at_most=False)
                rows.append(row)
    return [OURS, "no_sinks", "two_calls", "xla_plain"], "ms", rows

# -- paged, ragged, cascade ------------------------------------------------------------------

def paged(options):
    """The same call reading K/V through a page table (pages shuffled) or contiguously, in
    paired rounds; decode (causal at the last position) and prefill (new tokens after a
    cached history)."""
    page_sizes = (16,) if options.quick else (16, 64, 128)
    columns = ["contiguous"] + [f"paged_{size}" for size in page_sizes]
    calls_ = ((("decode", 2, 1, 512, 4, 2, 64), ("prefill", 1, 128, 512, 4, 4, 64))
              if options.quick else (("decode", 8, 1, 16384, 32, 8, 128),
                                     ("prefill", 4, 2048, 8192, 16, 16, 128),
                                     ("prefill_d64", 4, 2048, 8192, 16, 16, 64)))
    rows = []
    for name, batch, q_len, length, q_heads, kv_heads, dim in calls_:
        shape = cases.Shape(name, batch, q_heads, kv_heads, length, dim, q_len=q_len)
        q, k, v, _ = _bf16(*cases.inputs(shape))
        block_mask = pf.create_block_mask(mods(cases.VARIANTS[1], shape)[0], None, None,
                                          q_len, length)
        calls = {"contiguous": (jax.jit(lambda q, k, v, m: pf.flex_attention(
            q, k, v, block_mask=m, backend=options.backend)), (q, k, v, block_mask))}
        for size in page_sizes:
            (k_pages, table, owner), (v_pages, _, _) = (_shuffled_pages(x, size) for x in (k, v))
            cache = pf.paged.PagedKVCache(k_pages, v_pages, table, jnp.full(
                (batch,), length, jnp.int32), owner)
            calls[f"paged_{size}"] = (jax.jit(lambda q, c, m: pf.paged.paged_flex_attention(
                q, c, block_mask=m, backend=options.backend)), (q, cache, block_mask))
        print(f"[paged] {name}", flush=True)
        row = {"case": name, "params": {**dataclasses.asdict(shape), "bytes": shape.kv_bytes}}
        row.update(time_paired(calls, rounds=3 if options.quick else 9,
                               iters=3 if options.quick else 20))
        ours = calls["contiguous"][0](*calls["contiguous"][1])
        for column in columns[1:]:
            row[column]["max_rel_diff_vs_ours"] = _difference(ours, calls[column][0](
                *calls[column][1]))
        rows.append(row)
    return columns, "ms", rows


QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")


def quantized(options):
    """Decode (one query at the end, causal through the BlockMask) on a paged cache of
    bfloat16 pages against the same pages quantized to int8 and float8_e4m3fn (and the
    same on contiguous K/V, `_quantized_contiguous`; then a prefill row,
    `_quantized_prefill`)
    (pallas_flex/paged/quantize.py: per (token, head) scales), in paired rounds. Each
    entry: ms per decode step, the stored bytes a step reads (every page's values, plus
    the scales), their TB/s, the speedup over bf16, the largest |error| against a float64
    reference on the values the cache holds (dequantized; bf16's own values for bf16) and,
    quantized, the largest |difference| from the bf16 column's output: the accuracy the
    8-bit cache costs. Each timed call chains `steps` dependent decode steps (a step's
    output is the next query) in one jitted function: a ~0.1 ms call timed back to back
    from Python would measure the host (docs/gpu-notes.md, Measuring)."""
    page_sizes = (16,) if options.quick else (16, 64)
    columns = ["bf16", *QUANTIZED_DTYPES]
    steps = 2 if options.quick else 8
    shapes = ((("tiny_b2_s512", 2, 512, 8, 2, 64), ("tiny_b1_s2048", 1, 2048, 8, 2, 64))
              if options.quick else (("b8_s16384", 8, 16384, 32, 8, 128),
                                     ("b1_s131072", 1, 131072, 32, 8, 128)))

    @jax.jit
    def decode_steps(q, cache, block_mask):
        """(the first step's output, the last's): one compile serves accuracy and time."""
        outs = [q]
        for _ in range(steps):  # Dv = D: the output is the next step's query
            outs.append(pf.paged.paged_flex_attention(outs[-1], cache, block_mask=block_mask,
                                                      backend=options.backend))
        return outs[1], outs[-1]
    rows = []
    for name, batch, length, q_heads, kv_heads, dim in shapes:
        shape = cases.Shape(name, batch, q_heads, kv_heads, length, dim, q_len=1)
        q, k, v, _ = _bf16(*cases.inputs(shape))
        block_mask = pf.create_block_mask(mods(cases.VARIANTS[1], shape)[0], None, None, 1,
                                          length)
        # The float64 reference on the host: every row of a small batch, else row 0 (all
        # heads); a few hundred MiB of float64 per KV head at most.
        reference_rows = list(range(batch)) if batch * length <= 65536 else [0]
        for size in page_sizes:
            print(f"[quantized] {name} page_{size}", flush=True)
            (k_pages, table, owner), (v_pages, _, _) = (_shuffled_pages(x, size)
                                                        for x in (k, v))
            caches = _quantized_caches(k_pages, v_pages, table,
                                       jnp.full((batch,), length, jnp.int32), owner)
            row = {"case": f"{name} page_{size}", "params": {
                **dataclasses.asdict(shape), "page_size": size, "steps_per_call": steps,
                "bytes": shape.kv_bytes, "reference": (
                    f"float64 on the dequantized values of batch rows {reference_rows} of "
                    f"{batch}, all {q_heads} query heads")}}
            calls = {column: (decode_steps, (q, cache, block_mask))
                     for column, cache in caches.items()}
            outs = _run_once(row, calls, first_output=True)
            calls = {column: calls[column] for column in outs}
            for column, entry in time_paired(calls, rounds=3 if options.quick else 9,
                                             iters=3 if options.quick else 20).items():
                cache = caches[column]
                stored = batch * length * kv_heads * (
                    (cache.head_dim + cache.value_dim) * cache.dtype.itemsize
                    + (2 * 4 if cache.quantized else 0))  # two float32 scales per token, head
                ms = entry["ms"] / steps
                row[column].update({
                    "ms": ms, "rounds_ms": [t / steps for t in entry["rounds_ms"]],
                    "bytes": stored, "tb_per_s": stored / ms / 1e9,
                    "max_abs_error_vs_float64": _error_vs_float64(outs[column], q, cache,
                                                                  reference_rows)})
            _versus_bf16(row, outs)
            rows.append(row)
            del caches, calls, outs
        rows.append(_quantized_contiguous(options, shape, q, k, v, block_mask, steps))
    rows += _quantized_prefill(options)
    return columns + [f"{dtype}_in_kernel" for dtype in QUANTIZED_DTYPES], "ms", rows


def _quantized_contiguous(options, shape, q, k, v, block_mask, steps):
    """`quantized`'s decode row on contiguous K/V: `pf.flex_attention` on bf16 k, v
    against int8 / float8 k, v with their scales (`k_scales=`, `v_scales=`), the same
    chained steps; ms a step, stored bytes, TB/s and each output's largest difference
    from the bf16 column's."""
    print(f"[quantized] {shape.name} contiguous", flush=True)

    def steps_of(q, k, v, k_scales, v_scales):
        outs = [q]
        for _ in range(steps):
            outs.append(pf.flex_attention(outs[-1], k, v, block_mask=block_mask,
                                          backend=options.backend, k_scales=k_scales,
                                          v_scales=v_scales))
        return outs[1], outs[-1]
    step = jax.jit(steps_of)
    inputs = {"bf16": (k, v, None, None)}
    for dtype in QUANTIZED_DTYPES:
        (k_values, k_scales), (v_values, v_scales) = (quantize(x, jnp.dtype(dtype))
                                                      for x in (k, v))
        inputs[dtype] = (k_values, v_values, k_scales, v_scales)
    row = {"case": f"{shape.name} contiguous", "params": {
        **dataclasses.asdict(shape), "steps_per_call": steps, "bytes": shape.kv_bytes}}
    calls = {column: (step, (q, *operands)) for column, operands in inputs.items()}
    outs = _run_once(row, calls, first_output=True)
    calls = {column: calls[column] for column in outs}
    for column, entry in time_paired(calls, rounds=3 if options.quick else 9,
                                     iters=3 if options.quick else 20).items():
        k_stored = inputs[column][0]
        stored = shape.batch * shape.seq_len * shape.kv_heads * (
            2 * shape.head_dim * jnp.dtype(k_stored.dtype).itemsize
            + (2 * 4 if column != "bf16" else 0))
        ms = entry["ms"] / steps
        row[column].update({"ms": ms, "rounds_ms": [t / steps for t in entry["rounds_ms"]],
                            "bytes": stored, "tb_per_s": stored / ms / 1e9})
    _versus_bf16(row, outs)
    return row


def _quantized_prefill(options):
    """`quantized`'s prefill rows: new tokens causal after a cached history, on bfloat16
    pages and on the same pages quantized, read the default way (dequantized first,
    `KernelOptions.quantized_prefill`) and in the Triton forward's tiles ("_in_kernel"
    columns); ms a call, paired rounds, and each output's largest difference from the
    bf16 column's."""
    batch, heads, new, total, dim, size = ((1, 4, 64, 256, 64, 16) if options.quick else
                                          (4, 16, 2048, 8192, 128, 64))
    shape = cases.Shape(f"prefill_b{batch}_new{new}_of{total}", batch, heads, heads, total,
                        dim, q_len=new)
    q, k, v, _ = _bf16(*cases.inputs(shape))
    block_mask = pf.create_block_mask(mods(cases.VARIANTS[1], shape)[0], None, None, new,
                                      total)
    (k_pages, table, owner), (v_pages, _, _) = (_shuffled_pages(x, size) for x in (k, v))
    caches = {column: (cache, None) for column, cache in _quantized_caches(
        k_pages, v_pages, table, jnp.full((batch,), total, jnp.int32), owner).items()}
    for dtype in QUANTIZED_DTYPES:
        caches[f"{dtype}_in_kernel"] = (caches[dtype][0], {"quantized_prefill": "in_kernel"})
    print(f"[quantized] {shape.name} page_{size}", flush=True)
    row = {"case": f"{shape.name} page_{size}", "params": {
        **dataclasses.asdict(shape), "page_size": size, "mask": "causal at the offset"}}
    calls = {column: (jax.jit(functools.partial(
        pf.paged.paged_flex_attention, block_mask=block_mask, backend=options.backend,
        kernel_options=kernel_options)), (q, cache))
        for column, (cache, kernel_options) in caches.items()}
    outs = _run_once(row, calls)
    for column, entry in time_paired({column: calls[column] for column in outs},
                                     rounds=3 if options.quick else 9,
                                     iters=3 if options.quick else 20).items():
        row[column].update(entry)
    _versus_bf16(row, outs)
    return [row]


def _quantized_caches(k_pages, v_pages, table, lengths, owner):
    """{"bf16": the cache of these pages, and per QUANTIZED_DTYPES the same pages
    quantized (per-token scales)}."""
    caches = {"bf16": pf.paged.PagedKVCache(k_pages, v_pages, table, lengths, owner)}
    for dtype in QUANTIZED_DTYPES:
        (k_values, k_scales), (v_values, v_scales) = (
            quantize(x, jnp.dtype(dtype)) for x in (k_pages, v_pages))
        caches[dtype] = pf.paged.PagedKVCache(k_values, v_values, table, lengths, owner,
                                              k_scales, v_scales)
    return caches


def _run_once(row, calls, first_output=False, failure_status=lambda column: "error"):
    """{column: output} of each {column: (fn, args)} run once (the first of the outputs
    where first_output), the call's seconds in row[column]["compile_s"]; a failure
    becomes the row's entry for its column instead (`error_entry` with
    failure_status(column))."""
    outs = {}
    for column, (fn, args) in calls.items():
        print(f"  {row['case']}: {column}", flush=True)
        try:
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            row[column] = {"compile_s": time.perf_counter() - start}
            outs[column] = out[0] if first_output else out
        except Exception as error:
            traceback.print_exc()
            row[column] = error_entry(error, failure_status(column))
    return outs


def _versus_bf16(row, outs):
    """Each timed column's speedup over the bf16 column and, for the others, its output's
    largest |difference| from bf16's (what the 8-bit cache costs in accuracy)."""
    if "bf16" not in outs or "ms" not in row.get("bf16", {}):
        return
    for column, out in outs.items():
        if "ms" in row.get(column, {}):
            row[column]["speedup_vs_bf16"] = row["bf16"]["ms"] / row[column]["ms"]
        if column != "bf16":
            row[column]["max_abs_diff_vs_bf16"] = float(jnp.max(jnp.abs(
                out.astype(jnp.float32) - outs["bf16"].astype(jnp.float32))))


def _error_vs_float64(out, q, cache, batch_rows) -> float:
    """Largest |out - attention in float64| over `batch_rows` and every head: the one query
    attends to all of its row's keys (causal at the last position), on the values the cache
    holds (quantized ones times their scales, in float64)."""
    q_heads, kv_heads = q.shape[2], cache.kv_heads
    group, scale = q_heads // kv_heads, cache.head_dim ** -0.5
    worst = 0.0
    for b in batch_rows:
        pages = cache.page_table[b][: -(-int(cache.lengths[b]) // cache.page_size)]
        query = np.asarray(q[b, 0], np.float64)
        got = np.asarray(out[b, 0].astype(jnp.float32), np.float64)
        for h in range(kv_heads):
            def logical(values, scales):  # [tokens, D] of KV head h, in float64
                x = np.asarray(values[pages, h]).astype(np.float64)
                if scales is not None:
                    x = x * np.asarray(scales[pages, h], np.float64)[..., None]
                return x.reshape(-1, x.shape[-1])
            k = logical(cache.k_pages, cache.k_scales)
            v = logical(cache.v_pages, cache.v_scales)
            s = query[h * group:(h + 1) * group] @ k.T * scale
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            expected = (p @ v) / p.sum(axis=-1, keepdims=True)
            worst = max(worst, float(np.max(np.abs(got[h * group:(h + 1) * group] - expected))))
    return worst


RAGGED_MIXES = {  # name: [(past_len, new_len)] per sequence
    "decode_64x4096": [(4096, 1)] * 64,
    "mixed_4prefill1024_60decode4096": [(1024, 1024)] * 4 + [(4096, 1)] * 60,
    "prefill_2x4096": [(0, 4096)] * 2,
}
QUICK_RAGGED_MIXES = {"tiny_mixed": [(64, 32), (200, 1), (0, 48)]}


def _rotation_inputs(total_blocks, block, dim, seed=0, fraction=0.1, lut_rows=4096):
    """The ragged op's RoPE re-rotation inputs for `fraction` of the cache's blocks: distinct
    physical blocks, a LUT row per slot, a LUT of cosines then sines."""
    rng = np.random.default_rng([cases.INPUT_SEED, seed])
    listed = max(1, int(total_blocks * fraction))
    angles = rng.uniform(0, 2 * np.pi, (lut_rows, dim // 2))
    return dict(
        rotated_block_indices=jnp.asarray(rng.choice(total_blocks, listed, replace=False),
                                          jnp.int32),
        rotation_deltas=jnp.asarray(rng.integers(0, lut_rows, (listed, block)), jnp.int32),
        rotation_trig_lut=jnp.asarray(np.concatenate([np.cos(angles), np.sin(angles)], 1),
                                      jnp.float32))


def ragged_inputs(seqs, heads, dim, block):
    """The ragged op's inputs for sequences `seqs` [(past_len, new_len)], bf16, heads
    (Hq, Hkv), blocks of `block` slots in a shuffled pool: (the arguments but the caches,
    the caches (key, value), the rotation inputs for 10 % of the blocks)."""
    blocks = [-(-(past + new) // block) for past, new in seqs]
    tokens = sum(new for _, new in seqs)
    normal = [jnp.asarray(cases.normal(shape, i), jnp.bfloat16) for i, shape in enumerate(
        [(tokens, heads[0] * dim), (tokens, heads[1] * dim), (tokens, heads[1] * dim),
         (sum(blocks), heads[1], block, dim), (sum(blocks), heads[1], block, dim)])]
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    others = dict(query=normal[0], key=normal[1], value=normal[2],
                  past_lens=i32([past for past, _ in seqs]),
                  subsequence_begins=i32(np.cumsum([0] + [new for _, new in seqs])),
                  block_indices=i32(np.random.default_rng(0).permutation(sum(blocks))),
                  block_indices_begins=i32(np.cumsum([0] + blocks)))
    return others, (normal[3], normal[4]), _rotation_inputs(sum(blocks), block, dim)


def ragged(options, heads=(32, 8), dim=128, block=16):
    """The ragged mixed prefill + decode op on the Pallas kernel against its XLA loop, as a
    server calls it: caches donated and fed back, traced checks off; kernel_rotated: the
    kernel's call that also re-rotates the RoPE of 10 % of the cache's blocks (the spec's
    rotation inputs, rotated in the cache); kernel_rotated_in_reads: the same rotation
    in the kernel's key reads (`rotation_in_cache=False`; issue 20 asks for at most 3 %
    over the kernel's call). The three kernel columns in paired rounds."""
    if options.quick:
        heads, dim = (4, 2), 64
    rows = []
    for name, seqs in (QUICK_RAGGED_MIXES if options.quick else RAGGED_MIXES).items():
        others, caches, rotation = ragged_inputs(seqs, heads, dim, block)
        tokens = sum(new for _, new in seqs)
        row = {"case": name, "params": {
            "sequences": len(seqs), "new_tokens": tokens, "kernel_backend": options.backend,
            "bytes": sum(p + n for p, n in seqs) * heads[1] * dim * 4}}
        outs, timed = {}, {}
        row["params"]["rotated_blocks"] = int(rotation["rotated_block_indices"].shape[0])
        for column, backend, extra in (
                ("kernel", options.backend, {}), ("xla_loop", "xla", {}),
                ("kernel_rotated", options.backend, rotation),
                ("kernel_rotated_in_reads", options.backend,
                 dict(rotation, rotation_in_cache=False))):
            step = jax.jit(lambda others, kc, vc, backend=backend, extra=extra:
                           pf.paged.paged_attention(**others, **extra, key_cache=kc,
                                                    value_cache=vc, backend=backend),
                           donate_argnums=(1, 2))
            caches_now = [jnp.copy(c) for c in caches]

            # step bound as a default: `_pair` times the calls after this loop, when the
            # name `step` holds the last column's (every column timed the in-reads call
            # until 2026-12-07, which made the kernel columns look alike).
            def call(others, caches=caches_now, step=step):
                out, caches[0], caches[1] = step(others, *caches)
                return out
            with pf.paged.traced_checks(False):
                outs[column] = _measure(row, column, call, (others,), options,
                                        timed=None if column == "xla_loop" else timed)
        with pf.paged.traced_checks(False):
            _pair(row, timed, options)
        if outs.get("kernel") is not None and outs.get("xla_loop") is not None:
            row["xla_loop"]["max_rel_diff_vs_ours"] = _difference(outs["kernel"],
                                                                  outs["xla_loop"])
        if outs.get("kernel_rotated") is not None and outs.get("kernel_rotated_in_reads") \
                is not None:  # the first call's rotation: the same keys either way
            row["kernel_rotated_in_reads"]["max_rel_diff_vs_in_cache"] = _difference(
                outs["kernel_rotated"], outs["kernel_rotated_in_reads"])
        _acceptance(row, "kernel", 1.03, at_most=True, ours_column="kernel_rotated_in_reads")
        rows.append(row)
    return ["kernel", "xla_loop", "kernel_rotated", "kernel_rotated_in_reads"], "ms", rows


def cascade(options):
    """`pf.cascade_attention` over a shared prefix against `pf.attention` over each
    request's concatenated prefix + suffix (built outside the timed call)."""
    batch, prefix, suffix, heads, dim = (4, 512, 64, (8, 2), 64) if options.quick else (
        16, 4096, 256, (32, 8), 128)
    q, prefix_k, prefix_v, suffix_k, suffix_v = _bf16(*(cases.normal(shape, i) for i, shape in
        enumerate([(batch, 1, heads[0], dim)] + [(1, prefix, heads[1], dim)] * 2
                  + [(batch, suffix, heads[1], dim)] * 2)))
    lengths = np.random.default_rng([cases.INPUT_SEED, 9]).integers(1, suffix + 1, batch)
    lengths = jnp.asarray(lengths, jnp.int32).at[0].set(suffix)
    k, v = (jnp.concatenate([jnp.broadcast_to(p, (batch, *p.shape[1:])), s], axis=1)
            for p, s in ((prefix_k, suffix_k), (prefix_v, suffix_v)))
    rows = []
    for variant in ("full", "ragged"):
        ragged_ = variant == "ragged"
        row = {"case": f"b{batch}_p{prefix}_l{suffix} {variant}", "params": {
            "batch": batch, "prefix": prefix, "suffix": suffix, "q_heads": heads[0],
            "kv_heads": heads[1], "head_dim": dim}}

        def shared(q, pk, pv, sk, sv, lengths, ragged_=ragged_):
            mask = (lambda b, h, q_idx, kv: kv < lengths[b]) if ragged_ else None
            return pf.cascade_attention(q, pk, pv, sk, sv, suffix_mask_mod=mask,
                                        backend=options.backend)

        def concatenated(q, k, v, lengths, ragged_=ragged_):
            mask = (lambda b, h, q_idx, kv: kv < prefix + lengths[b]) if ragged_ else None
            return pf.attention(q, k, v, mask_mod=mask, backend=options.backend)
        out = _measure(row, "cascade", jax.jit(shared),
                       (q, prefix_k, prefix_v, suffix_k, suffix_v, lengths), options)
        _measure(row, "concatenated", jax.jit(concatenated), (q, k, v, lengths), options, out)
        rows.append(row)
    return ["cascade", "concatenated"], "ms", rows


# -- memory, BlockMask creation, compile time ---------------------------------------------------

def memory(options):
    """Peak device memory of one causal fwd+bwd step (compiled ahead, run once between two
    reads of the allocator's statistics; lengths ascending, so each step sets the process's
    peak: `peak_exact`), then its time. Flat bytes per token: memory linear in S."""
    lengths, heads, dim = ((256, 512), 2, 64) if options.quick else (
        (16384, 32768, 65536), 16, 128)
    device = jax.devices()[0]
    rows = []
    for length in lengths:
        print(f"[memory] S={length}", flush=True)
        shape = cases.Shape(f"s{length}", 1, heads, heads, length, dim)
        args = [jax.device_put(np.asarray(x, jnp.bfloat16)) for x in cases.inputs(shape)]
        args.append(pf.create_block_mask(pf.masks.causal_mask, None, None, length, length))
        step = _step(lambda q, k, v, m: pf.flex_attention(
            q, k, v, block_mask=m, backend=options.backend), "fwd_bwd").lower(*args).compile()
        before = device.memory_stats() or {}
        jax.block_until_ready(step(*args))
        after = device.memory_stats() or {}
        entry = time_calls(step, args, iters=1, repeats=3)[0]  # outputs freed now
        if "peak_bytes_in_use" in after:
            entry["peak_mib"] = after["peak_bytes_in_use"] / 2 ** 20
            entry["peak_exact"] = after["peak_bytes_in_use"] > before.get("peak_bytes_in_use", 0)
            entry["peak_kib_per_token"] = after["peak_bytes_in_use"] / 1024 / length
        else:
            entry.update(status="n/a", reason="this device reports no memory statistics")
        rows.append({"case": f"S={length}", "params": {
            **dataclasses.asdict(shape), "input_mib": 4 * args[0].nbytes / 2 ** 20}, OURS: entry})
        del args
    return [OURS], "peak_mib", rows


def block_mask(options):
    """Building a causal document BlockMask (12 documents, 128-blocks): median of 5."""
    rows = []
    for length in (2048, 4096) if options.quick else (16384, 65536, 131072):
        ids = jnp.asarray(cases.document_ids(length, 12))
        mask_mod = pf.and_masks(pf.masks.causal_mask, pf.masks.document_mask(ids))
        build = functools.partial(pf.create_block_mask, mask_mod, None, None, length, length)
        entry = time_calls(lambda: build().kv_indices, (), iters=1, repeats=5)[0]
        rows.append({"case": f"S={length}", "params": {"seq_len": length, "documents": 12},
                     OURS: {**entry, "sparsity_percent": float(build().sparsity())}})
    return [OURS], "ms", rows  # the torch peer's column is added by the caller


def compile_time(options):
    """First-call seconds (trace, lower, compile, one run) of a new causal shape per head
    dim and dtype: forward, forward+backward, and decode (one query on the same keys)."""
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.zeros(8)))  # the process's first jit
    rows = []
    for dim in (64,) if options.quick else (64, 128, 256):
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            length = (128 if options.quick else 1024) + dim  # a new shape per row
            shape = cases.Shape("compile", 1, 8, 8, length, dim)
            q, k, v, d_out = (jnp.asarray(x, dtype) for x in cases.inputs(shape))

            def forward(q, k, v):
                return pf.attention(q, k, v, mask_mod=pf.masks.causal_mask,
                                    backend=options.backend)
            row = {"case": f"D{dim} {jnp.dtype(dtype).name}", "params": {
                "head_dim": dim, "dtype": jnp.dtype(dtype).name, "seq_len": length}}
            for column, fn, args in (
                    ("forward", forward, (q, k, v)),
                    ("fwd_bwd", lambda q, k, v: jax.vjp(forward, q, k, v)[1](d_out), (q, k, v)),
                    ("decode", lambda q, k, v: pf.attention(q, k, v, backend=options.backend),
                     (q[:, :1], k, v))):
                start = time.perf_counter()
                jax.block_until_ready(jax.jit(fn)(*args))
                row[column] = {"s": time.perf_counter() - start}
            rows.append(row)
    return ["forward", "fwd_bwd", "decode"], "s", rows


def latent(options):
    """Latent-attention (MLA) decode as DeepSeek serves it: Hq 128, one KV head, D 576,
    Dv 512, one query per batch row at the end of its cache (a decode offset, so the
    BlockMask lists every block), on a contiguous cache and on the same tokens in pages
    of `page_size` rows (FlashMLA's 64; pages shuffled, through `paged_flex_attention`):
    the Mosaic GPU kernel (`kernels/decode_latent_mosaic.py`, decode_kernel "mosaic")
    against the Triton split-KV decode (decode_kernel "triton") on the same inputs, and
    on one latent array whose first Dv columns are the values (mosaic_latent: DeepSeek's
    cache, `value_dim`, read in place; mosaic_latent_paged: the same in pages, a latent
    `PagedKVCache`; their TB/s count that array's bytes), in paired rounds. Each entry: ms per step of `steps` chained steps in one jitted call (a
    step's output, padded, is the next step's query), the K/V bytes a step reads and
    their TB/s, the TFLOP/s of its 2 x Hq x (D + Dv) flops per cached token, and the
    largest |difference| from the contiguous Triton column's output. --quick: narrow
    heads in interpret mode on a CPU, pages of 16."""
    steps = 1 if options.quick else 8
    page_size = 16 if options.quick else 64
    interpret = options.backend != "pallas"
    backend = "interpret" if interpret else options.backend
    if options.quick:
        q_heads, dim, value_dim = 64, 128, 128
        shapes = (("tiny_b1_s176", 1, 176),)  # 11 pages of 16, a partial block
    else:
        q_heads, dim, value_dim = 128, 576, 512
        shapes = tuple((f"b{batch}_s{length}", batch, length)
                       for length in (4096, 32768) for batch in (16, 64, 128))
    columns = ["mosaic", "mosaic_paged", "mosaic_latent", "mosaic_latent_paged", "triton",
               "triton_paged"]
    scale = 1 / np.sqrt(192.0)
    rows = []
    for name, batch, length in shapes:
        print(f"[latent] {name}", flush=True)
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (batch, 1, q_heads, dim), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, length, 1, dim), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, length, 1, value_dim), jnp.bfloat16)
        # As in DeepSeek's cache, the keys' first Dv columns are the values: one latent
        # array [B, S, 1, D] holds both (the mosaic_latent column passes it alone).
        k = latent = k.at[..., :value_dim].set(v)
        positions = jnp.full((batch,), length - 1, jnp.int32)
        block_mask = pf.create_block_mask(pf.masks.offset(pf.masks.causal_mask, positions),
                                          batch, None, 1, length)
        stored = batch * length * (dim + value_dim) * 2
        flops = 2 * batch * length * q_heads * (dim + value_dim)
        row = {"case": name, "params": {
            "batch": batch, "q_heads": q_heads, "kv_heads": 1, "seq_len": length,
            "head_dim": dim, "value_dim": value_dim, "page_size": page_size,
            "steps_per_call": steps, "bytes": stored, "flops": flops}}
        (k_pages, table, owner), (v_pages, _, _) = (
            _shuffled_pages(x, page_size) for x in (k, v))
        cache = pf.paged.PagedKVCache(k_pages, v_pages, table,
                                      jnp.full((batch,), length, jnp.int32), owner)
        # The same pages as one latent cache (key pages only, the values their first Dv
        # columns).
        latent_cache = pf.paged.PagedKVCache(k_pages, None, table, cache.lengths, owner,
                                             latent_value_dim=value_dim)

        def decode_steps(q, k, v, cache, block_mask, kernel, paged, latent=False):
            """(the first step's output, the last's). latent: the values are k's first
            Dv columns (one latent array, `value_dim`), read in place."""
            outs, query = [], q
            options_ = {"decode_kernel": kernel}
            for _ in range(steps):
                if latent:
                    out = pf.flex_attention(query, k, None, block_mask=block_mask,
                                            scale=scale, backend=backend,
                                            kernel_options=options_, value_dim=value_dim)
                elif paged:
                    out = pf.paged.paged_flex_attention(
                        query, cache, block_mask=block_mask, scale=scale, backend=backend,
                        kernel_options=options_)
                else:
                    out = pf.flex_attention(query, k, v, block_mask=block_mask, scale=scale,
                                            backend=backend, kernel_options=options_)
                outs.append(out)
                query = jnp.pad(out, ((0, 0), (0, 0), (0, 0), (0, dim - value_dim)))
            return outs[0], outs[-1]

        latent_bytes = batch * length * dim * 2
        calls, outs = {}, {}
        for column in columns:
            kernel, _, layout = column.partition("_")
            call = jax.jit(functools.partial(decode_steps, kernel=kernel,
                                             paged=layout.endswith("paged"),
                                             latent=layout == "latent"))
            arguments = ((q, None, None, cache, block_mask) if layout == "paged" else
                         (q, None, None, latent_cache, block_mask)
                         if layout == "latent_paged" else
                         (q, latent, None, None, block_mask) if layout == "latent" else
                         (q, k, v, None, block_mask))
            try:
                outs[column] = jax.block_until_ready(call(*arguments))[0]
                calls[column] = (call, arguments)
            except Exception as error:
                traceback.print_exc()
                row[column] = error_entry(error)
        # Interpret mode (--quick) takes seconds a call: one timed call a column.
        for column, entry in time_paired(calls, rounds=1 if options.quick else 7,
                                         iters=1 if options.quick else 10).items():
            ms = entry["ms"] / steps
            read = latent_bytes if "latent" in column else stored
            row[column] = {"ms": ms, "rounds_ms": [t / steps for t in entry["rounds_ms"]],
                           "tb_per_s": read / ms / 1e9, "tflop_per_s": flops / ms / 1e9}
        for column in outs.keys() - {"triton"} if "triton" in outs else ():
            row[column]["max_abs_diff_vs_triton"] = float(jnp.max(jnp.abs(
                outs[column].astype(jnp.float32) - outs["triton"].astype(jnp.float32))))
        for column in ("mosaic", "mosaic_paged"):  # each against Triton on the same cache
            peer = column.replace("mosaic", "triton")
            if column in calls and peer in calls:
                row[column]["speedup_vs_triton"] = row[peer]["ms"] / row[column]["ms"]
        rows.append(row)
        del q, k, v, latent, cache, latent_cache, k_pages, v_pages, calls, outs
    return columns, "ms", rows


SUITES = {
    "forward": lambda options: attention(options, "fwd"),
    "fwd_bwd": lambda options: attention(options, "fwd_bwd"), "score_mods": score_mods,
    "decode": lambda options: attention(options, "fwd", decode=True),
    "paged": paged, "quantized": quantized, "ragged": ragged, "cascade": cascade,
    "memory": memory, "block_mask": block_mask, "compile": compile_time, "fuse": fuse,
    "variants": variants, "captured_gradients": captured_gradients, "latent": latent,
}
