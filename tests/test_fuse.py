"""pf.fuse: attention written as plain JAX code runs as pallas_flex calls, with the
outputs and gradients of the written code (each pattern of issue 21 against the unfused
function), and explain_fuse says what was fused and why not."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flex as pf
from pallas_flex import api
from pallas_flex.masks.mod_program import MASK, make_mod_program

B, S, H, D = 2, 48, 4, 16  # S not a multiple of the 128-blocks: padding included


def _inputs(seed=0, heads=H, kv_heads=H, length=S):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (B, length, heads, D), jnp.float32),
            jax.random.normal(keys[1], (B, length, kv_heads, D), jnp.float32),
            jax.random.normal(keys[2], (B, length, kv_heads, D), jnp.float32),
            jax.random.normal(keys[3], (B, length, heads, D), jnp.float32))


def _attend(q, k, v, logits_fn):
    """Plain attention: q.k scaled, logits_fn, softmax, .v (layout [B, S, H, D])."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    p = jax.nn.softmax(logits_fn(s), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.fixture
def calls(monkeypatch):
    """The pf.attention calls pf.fuse made: their keyword arguments, and the shapes of
    q, k, v under "shapes"."""
    made = []
    original = api.attention

    def counting(*args, **kwargs):
        made.append({**kwargs, "shapes": [tuple(x.shape) for x in args[:3]]})
        return original(*args, **kwargs)
    monkeypatch.setattr(api, "attention", counting)
    return made


def _check(fn, args, calls, argnums=(0, 1, 2), expected_calls=1, backend="xla",
           atol=2e-5):
    """fuse(fn) equals fn (outputs, gradients of sum(out * cotangent) wrt argnums)
    under jit, and made `expected_calls` pallas_flex calls. Each side's output and
    gradients come from one jax.vjp (one trace and forward), not a forward compiled
    again beside the gradient's."""
    fused = jax.jit(pf.fuse(fn, backend=backend))

    def out_and_pullback(f):
        def of_differentiated(*differentiated):
            full = list(args)
            for index, x in zip(argnums, differentiated):
                full[index] = x
            return f(*full)
        return jax.vjp(of_differentiated, *(args[index] for index in argnums))
    got, got_pullback = out_and_pullback(fused)
    assert len(calls) == expected_calls, pf.explain_fuse(fn, *args)
    want, want_pullback = out_and_pullback(fn)
    np.testing.assert_allclose(got, want, atol=atol, rtol=atol)
    cotangent = jax.random.normal(jax.random.key(9), want.shape, want.dtype)
    for a, b in zip(got_pullback(cotangent), want_pullback(cotangent)):
        np.testing.assert_allclose(a, b, atol=10 * atol, rtol=10 * atol)


def test_vanilla_with_a_scale(calls):
    q, k, v, _ = _inputs()
    _check(lambda q, k, v: _attend(q, k, v, lambda s: s), (q, k, v), calls)
    # The division by sqrt(D) is pf.attention's scale, not a score_mod.
    assert calls[0]["mask_mod"] is None and calls[0]["score_mod"] is None
    assert calls[0]["scale"] == pytest.approx(1 / np.sqrt(D))


def test_a_scale_beside_other_uses_of_the_unscaled_scores(calls):
    """`s * c` becomes the call's scale; the score_mod still sees the unscaled s where the
    code uses it (the kernel's scaled score divided back)."""
    q, k, v, _ = _inputs()

    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(s * 0.2 + 0.5 * jnp.tanh(s), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    _check(attend, (q, k, v), calls)
    assert calls[0]["score_mod"] is not None
    assert calls[0]["scale"] == pytest.approx(0.2)


def test_causal_written_with_tril_through_the_interpreted_kernels(calls):
    q, k, v, _ = _inputs(1)
    causal = jnp.tril(jnp.ones((S, S), bool))
    _check(lambda q, k, v: _attend(q, k, v, lambda s: jnp.where(causal, s, -jnp.inf)),
           (q, k, v), calls, backend="interpret")
    assert calls[0]["mask_mod"] is not None


def test_sliding_window_on_iotas_gives_a_sparse_block_mask(calls, monkeypatch):
    q, k, v, _ = _inputs(2, length=512)

    def window(s):
        rows, cols = jnp.arange(512)[:, None], jnp.arange(512)[None, :]
        return jnp.where((rows >= cols) & (rows - cols < 100), s, -jnp.inf)
    built = []
    original = api.build_block_mask

    def recording(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(api, "build_block_mask", recording)
    pf.fuse(lambda q, k, v: _attend(q, k, v, window), backend="xla")(q, k, v)  # eagerly
    counts = built[0].kv_num_blocks + built[0].full_kv_num_blocks
    assert int(jnp.sum(counts)) < 4 * 4 / 2 + 4  # 4x4 blocks of 128: a band, not all
    _check(lambda q, k, v: _attend(q, k, v, window), (q, k, v), calls, expected_calls=2)


def test_alibi_as_broadcast_arithmetic_with_learnable_slopes(calls):
    q, k, v, _ = _inputs(3)
    slopes = jnp.linspace(0.1, 0.8, H)

    def alibi(q, k, v, slopes):
        distance = jnp.arange(S)[None, :] - jnp.arange(S)[:, None]
        return _attend(q, k, v, lambda s: s + slopes[None, :, None, None] * distance)
    _check(alibi, (q, k, v, slopes), calls, argnums=(0, 1, 2, 3))


def test_soft_cap(calls):
    q, k, v, _ = _inputs(4)
    _check(lambda q, k, v: _attend(q, k, v, lambda s: 5.0 * jnp.tanh(s / 5.0)), (q, k, v),
           calls)


def test_an_additive_bias_tensor_gets_its_gradient(calls):
    q, k, v, _ = _inputs(5)
    bias = jax.random.normal(jax.random.key(6), (1, H, S, S))
    _check(lambda q, k, v, bias: _attend(q, k, v, lambda s: s + bias), (q, k, v, bias),
           calls, argnums=(0, 1, 2, 3))


def test_a_padding_mask_from_lengths(calls):
    q, k, v, _ = _inputs(7)
    lengths = jnp.array([30, 48])

    def padded(q, k, v, lengths):
        keep = jnp.arange(S)[None, :] < lengths[:, None]  # [B, Skv]
        return _attend(q, k, v, lambda s: jnp.where(keep[:, None, None, :], s, -1e30))
    _check(padded, (q, k, v, lengths), calls)


@pytest.mark.parametrize("written", ["repeat", "reshape"])
def test_gqa_written_with_repeat_or_a_reshape(calls, written):
    q, k, v, _ = _inputs(8, heads=H, kv_heads=2)

    def gqa(q, k, v):
        if written == "repeat":
            k, v = (jnp.repeat(x, H // 2, axis=2) for x in (k, v))
            return _attend(q, k, v, lambda s: s)
        grouped = q.reshape(B, S, 2, H // 2, D)  # [B, S, Hkv, G, D]
        s = jnp.einsum("bqgrd,bkgd->bgrqk", grouped, k) / np.sqrt(D)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bgrqk,bkgd->bqgrd", p, v).reshape(B, S, H, D)
    _check(gqa, (q, k, v), calls)


@pytest.mark.parametrize("extra", ["causal", "mask", "bias", "causal_window", "window",
                                   "lengths"])
def test_jax_nn_dot_product_attention(calls, extra):
    """Each of jax.nn.dot_product_attention's ways to mask or bias. Its window and length
    masks compare positions it builds as NumPy constants (np.arange): those become index
    arithmetic in the mask_mod, not arrays for the kernels to read; its logits,
    transposed before the mask, are the scores themselves: no score_mod."""
    q, k, v, _ = _inputs(9)
    mask = jnp.tril(jnp.ones((1, 1, S, S), bool)) | (jnp.arange(S) % 5 == 0)
    bias = jax.random.normal(jax.random.key(10), (1, H, S, S))
    lengths = jnp.array([S - 13, S], jnp.int32)
    options = {"causal": {"is_causal": True}, "mask": {"mask": mask},
               "bias": {"bias": bias},
               "causal_window": {"is_causal": True, "local_window_size": (7, 0)},
               "window": {"local_window_size": (5, 3)},
               "lengths": {"key_value_seq_lengths": lengths}}[extra]
    _check(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **options), (q, k, v),
           calls)
    (call,) = calls
    assert (call["score_mod"] is None) == (extra != "bias")
    if extra in ("causal", "causal_window", "window"):
        assert not make_mod_program(call["mask_mod"], MASK).consts


def test_softmax_with_where(calls):
    """jax.nn.softmax(s, where=mask): the mask becomes the mask_mod; the rows it masks
    whole (the first three queries here) are zeros in the written code too."""
    q, k, v, _ = _inputs(14)
    rows = jnp.arange(S)[:, None]
    mask = (rows >= jnp.arange(S)[None, :]) & (rows >= 3)

    def written(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        p = jax.nn.softmax(s, axis=-1, where=mask)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    _check(written, (q, k, v), calls)
    (call,) = calls
    assert call["mask_mod"] is not None and call["score_mod"] is None
    assert "mask_mod from 1 predicate" in pf.explain_fuse(written, q, k, v)


def test_dot_product_attention_window_through_the_interpreted_kernels(calls):
    """The window mask of jax.nn.dot_product_attention (index arithmetic in the mask_mod)
    on the kernels themselves, interpreted: outputs and gradients."""
    q, k, v, _ = _inputs(15, kv_heads=2)
    _check(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(9, 0)), (q, k, v), calls,
        backend="interpret")


def test_numpy_constants_in_the_written_code(calls):
    """NumPy arrays the code closes over (document ids, a position table with an offset)
    are read by the mods: a progression as index arithmetic, anything else captured."""
    q, k, v, _ = _inputs(13)
    documents = np.repeat(np.arange(4, dtype=np.int32), S // 4)  # not a progression
    positions = np.arange(S, dtype=np.int32) * 2 + 5  # a progression of step 2

    def written(q, k, v):
        def logits(s):  # (jnp: a comparison of NumPy arrays would be a constant [S, S])
            document, position = jnp.asarray(documents), jnp.asarray(positions)
            same = document[:, None] == document[None, :]
            later = position[:, None] >= position[None, :]
            return jnp.where(same & later, s, -jnp.inf)
        return _attend(q, k, v, logits)
    _check(written, (q, k, v), calls)
    consts = make_mod_program(calls[0]["mask_mod"], MASK).consts
    assert [np.asarray(c).tolist() for c in consts] == [documents.tolist()]


def test_under_vmap_around_jit(calls):
    q, k, v, _ = _inputs(11)

    def one_example(q, k, v):  # [S, H, D]: the product's only batch dim is the head
        s = jnp.einsum("qhd,khd->hqk", q, k)
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)
    got = jax.vmap(jax.jit(pf.fuse(one_example, backend="xla")))(q, k, v)
    np.testing.assert_allclose(got, jax.vmap(one_example)(q, k, v), atol=2e-5)
    assert len(calls) == 1


def test_unfusable_code_runs_as_written_and_is_explained(calls):
    q, k, v, _ = _inputs(12)

    def with_weights(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p  # the weights are an output too
    text = pf.explain_fuse(with_weights, q, k, v)
    assert "not fused" in text and "output" in text, text
    got = pf.fuse(with_weights, backend="xla")(q, k, v)
    for a, b in zip(got, with_weights(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert not calls
    assert pf.explain_fuse(lambda x: x * 2, q) == "no softmax found"


def test_flax_nnx_multi_head_attention_unmodified(calls):
    from flax import nnx
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=32, qkv_features=H * D,
                                   decode=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(13), (B, S, 32))
    mask = nnx.make_causal_mask(jnp.ones((B, S)))
    got = pf.fuse(lambda x: layer(x, mask=mask), backend="xla")(x)
    np.testing.assert_allclose(got, layer(x, mask=mask), atol=2e-5)
    assert len(calls) == 1


def test_a_linen_model(calls):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)(
                x, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            return nn.Dense(8)(y)
    x = jax.random.normal(jax.random.key(14), (B, S, 32))
    model = Block()
    params = model.init(jax.random.key(15), x)

    def loss(params, x):
        return jnp.sum(model.apply(params, x) ** 2)
    got = jax.value_and_grad(pf.fuse(loss, backend="xla"))(params, x)
    want = jax.value_and_grad(loss)(params, x)
    assert len(calls) >= 1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)


def test_bfloat16_with_the_softmax_in_float32(calls):
    """Logits cast to float32 for the softmax and the probabilities back to bfloat16, as
    mixed-precision code does: the mask under the cast is still the mask_mod."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(16)[:3])
    causal = jnp.tril(jnp.ones((S, S), bool))

    def mixed(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
        s = jnp.where(causal, 30.0 * jnp.tanh(s / 30.0), -jnp.inf)
        p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    assert "mask_mod from 1 predicate" in pf.explain_fuse(mixed, q, k, v)
    got = jax.jit(pf.fuse(mixed, backend="xla"))(q, k, v).astype(jnp.float32)
    want = mixed(q, k, v).astype(jnp.float32)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    assert calls[0]["mask_mod"] is not None


def test_explain_prints_at_trace_time_and_keywords_are_static(calls, capsys):
    q, k, v, _ = _inputs(17)

    def scaled(q, k, v, *, temperature):
        return _attend(q, k, v, lambda s: s / temperature)
    out = pf.fuse(scaled, explain=True, backend="xla")(q, k, v, temperature=2.0)
    assert "fused into pf.attention (no mask; score_mod; scale 0.25)" in capsys.readouterr().out
    np.testing.assert_allclose(out, scaled(q, k, v, temperature=2.0), atol=2e-5)


def test_softmax_written_with_logsumexp_and_look_alikes_that_are_not(calls):
    q, k, v, _ = _inputs(18)
    causal = jnp.tril(jnp.ones((S, S), bool))

    def log_space(q, k, v):
        s = jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3, -jnp.inf)
        p = jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    _check(log_space, (q, k, v), calls)

    def mean_shifted(q, k, v):  # exp(s - mean s) is no softmax: left alone
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jnp.exp(s - jnp.mean(s, axis=-1, keepdims=True))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    assert pf.explain_fuse(mean_shifted, q, k, v) == "no softmax found"


def test_programs_without_attention_run_as_written():
    """Custom derivatives (relu, gelu), scan, cond, checkpoint and fori_loop go through
    pf.fuse's evaluator unchanged, values and gradients."""
    x = jax.random.normal(jax.random.key(19), (4, 8))

    def program(x):
        y = jax.nn.relu(x) + jax.nn.gelu(x)
        carry, ys = jax.lax.scan(lambda c, xi: (c + jnp.sin(xi), c * 2), jnp.zeros(8), y)
        z = jax.lax.cond(carry.sum() > 0, lambda a: a * 2, lambda a: a - 1, ys)
        w = jax.checkpoint(lambda a: jnp.tanh(a) ** 2)(z)
        return w.sum() + jax.lax.fori_loop(0, 3, lambda i, a: a + i, 0.0)
    fused = pf.fuse(program)
    np.testing.assert_allclose(jax.jit(fused)(x), program(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(fused)(x), jax.grad(program)(x), rtol=1e-6)


def test_attention_inside_jax_checkpoint_is_fused_and_stays_rematerialized(calls):
    """A remat'd block (jax.checkpoint, as flax's nn.remat makes): its attention is fused,
    the region is still a checkpoint, and gradients equal the written code's."""
    q, k, v, _ = _inputs(20)
    causal = jnp.tril(jnp.ones((S, S), bool))

    def block(q, k, v):
        return jax.checkpoint(lambda q, k, v: jnp.tanh(_attend(
            q, k, v, lambda s: jnp.where(causal, s, -jnp.inf))) * 2,
            policy=jax.checkpoint_policies.nothing_saveable)(q, k, v)
    assert pf.explain_fuse(block, q, k, v).startswith("inside jax.checkpoint: ")
    calls.clear()  # (explain_fuse traces the call too)
    _check(block, (q, k, v), calls)
    fused_jaxpr = jax.make_jaxpr(pf.fuse(block, backend="xla"))(q, k, v)
    assert any(eqn.primitive.name in ("remat2", "checkpoint") for eqn in fused_jaxpr.eqns)


def _benchmark_attention(score, group, length):
    """pallas_flex.bench.jax_suites.plain_attention's code: q.k cast to float32 and
    scaled, a score mod, `where` on a `tril`, the probabilities cast back to v's dtype,
    GQA by `jnp.repeat` of k and v."""
    slopes = jnp.linspace(0.1, 0.8, H)

    def attend(q, k, v):
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * (1 / np.sqrt(D))
        if score == "alibi":
            distance = jnp.arange(length)[None, :] - jnp.arange(length)[:, None]
            s = s + slopes[None, :, None, None] * distance
        if score == "softcap":
            s = 5.0 * jnp.tanh(s / 5.0)
        s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return attend


def _one_row(seed, kv_heads=H, dtype=jnp.float32):
    """q, k, v of a batch of one (as the benchmarks run): its size-1 dims lose their
    roles on the way to the softmax."""
    return tuple(x[:1].astype(dtype) for x in _inputs(seed, kv_heads=kv_heads)[:3])


@pytest.mark.parametrize("score, kv_heads, backend", [
    ("none", H, "interpret"), ("alibi", H, "xla"), ("softcap", H, "xla"),
    ("none", 2, "xla")])
def test_the_benchmark_code_with_a_batch_of_one(calls, score, kv_heads, backend):
    args = _one_row(21, kv_heads)
    attend = _benchmark_attention(score, H // kv_heads, S)
    assert "fused into pf.attention (mask_mod" in pf.explain_fuse(attend, *args)
    calls.clear()  # (explain_fuse traces the call too)
    _check(attend, args, calls, backend=backend)


def test_the_benchmark_code_in_bfloat16(calls):
    """The benchmarks' own inputs: bf16 q, k, v of a batch of one, the softmax in
    float32; and the softmax left in bf16 (jax.nn.softmax then sums in float32)."""
    args = _one_row(22, 2, jnp.bfloat16)
    attend = _benchmark_attention("softcap", H // 2, S)
    _check(attend, args, calls, atol=2e-2)

    def bf16_softmax(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    q, k, v = _one_row(23, dtype=jnp.bfloat16)
    assert "fused" in pf.explain_fuse(bf16_softmax, q, k, v)
    calls.clear()
    _check(bf16_softmax, (q, k, v), calls, atol=2e-2)


@pytest.mark.parametrize("scores, pv", [
    ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"), ("bkhd,bqhd->bhqk", "bkhd,bhqk->bqhd"),
    ("bqhd,bkhd->bhkq", "bhkq,bkhd->bqhd"), ("bkhd,bqhd->bqhk", "bkhd,bqhk->bhdq")])
@pytest.mark.parametrize("batch", [1])  # B = 1 is the harder case (size-1 dims lose roles)
def test_einsum_operand_orders(calls, scores, pv, batch):
    """k before q, v before p, the key axis before the query axis, the output in another
    order: each einsum spelling of the two products is fused."""
    q, k, v, _ = (x[:batch] for x in _inputs(24))
    layout = scores.split("->")[1]

    def along(axis):  # an index along one axis of the scores' layout
        return jnp.arange(S).reshape([S if c == axis else 1 for c in layout])

    def attend(q, k, v):
        s = jnp.einsum(scores, *((q, k) if scores.startswith("bq") else (k, q))) * 0.25
        s = jnp.where(along("q") >= along("k"), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=layout.index("k"))
        out = jnp.einsum(pv, *((p, v) if pv.startswith(layout) else (v, p)))
        return jnp.einsum(pv.split("->")[1] + "->bqhd", out)
    assert "fused into pf.attention (mask_mod" in pf.explain_fuse(attend, q, k, v)
    calls.clear()
    _check(attend, (q, k, v), calls)


def _repeat_inputs(seed, batch, q_heads, kv_heads, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (batch, S, q_heads, D), jnp.float32),
            jax.random.normal(keys[1], (batch, S, kv_heads, D)).astype(dtype),
            jax.random.normal(keys[2], (batch, S, kv_heads, D)).astype(dtype))


# Each case changes the plain one (causal, batch B, group 4, [B, S, H, D]) in one or two
# ways: the score, the group (1 or 8), batch 1, the layout, a cast. The plain case itself
# and (causal, batch 1, group 4) only repeated the others' patterns (the bhsd and cast
# cases are causal with group 4 at batch B; alibi with group 8 runs at batch 1).
@pytest.mark.parametrize("score, batch, kv_heads, layout", [
    ("alibi", B, 2, "bshd"), ("causal", B, 8, "bshd"), ("alibi", 1, 1, "bshd"),
    ("causal", B, 2, "bhsd"), ("causal", B, 2, "cast")])
def test_gqa_by_jnp_repeat_reads_k_v_before_the_repeat(calls, score, batch, kv_heads,
                                                        layout):
    """`k, v = (jnp.repeat(x, group, axis=2) ...)`, as model code writes GQA: the call
    takes the un-repeated k and v (native GQA, query head h on KV head h // group: the
    repeat's order); mods reading the head still see the query head; gradients reach
    the un-repeated k and v. Group 1 (a repeat by one) fuses as plain attention; a
    repeat after a transpose to [B, H, S, D], or under a cast, is seen through."""
    q_heads, group = 8, 8 // kv_heads
    dtype = jnp.bfloat16 if layout == "cast" else jnp.float32
    q, k, v = _repeat_inputs(25, batch, q_heads, kv_heads, dtype)
    slopes = jnp.linspace(0.1, 0.8, q_heads)
    causal = jnp.tril(jnp.ones((S, S), bool))

    def attend(q, k, v, slopes):
        if layout == "bhsd":  # transposed first, repeated along axis 1
            k, v = (jnp.repeat(x.transpose(0, 2, 1, 3), group, axis=1) for x in (k, v))
            s = jnp.einsum("bqhd,bhkd->bhqk", q, k) / np.sqrt(D)
        else:
            k, v = (jnp.repeat(x, group, axis=2).astype(jnp.float32) for x in (k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        if score == "alibi":
            distance = jnp.arange(S)[None, :] - jnp.arange(S)[:, None]
            s = s + slopes[None, :, None, None] * distance
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bhkd->bqhd" if layout == "bhsd" else "bhqk,bkhd->bqhd",
                          p, v)
    atol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    _check(attend, (q, k, v, slopes), calls, argnums=(0, 1, 2, 3), atol=atol)
    assert calls[0]["shapes"] == [(batch, S, q_heads, D), (batch, S, kv_heads, D),
                                  (batch, S, kv_heads, D)]
    text = pf.explain_fuse(attend, q, k, v, slopes)
    assert (f"{group}-fold jnp.repeat" in text) == (group > 1), text


@pytest.mark.parametrize("written", ["k tiled, v repeated", "both tiled",
                                     "k repeated, v not"])
def test_heads_repeated_other_ways_keep_the_repeated_k_v(calls, written):
    """Heads tiled (broadcast before the head axis: head i reads source head i % heads,
    not jnp.repeat's i // group), or only one of k, v repeated: the call takes k and v
    with the repeated heads, as today, and equals the written code."""
    q, k, v = _repeat_inputs(26, B, 8, 2)
    if written == "k repeated, v not":
        v = jax.random.normal(jax.random.key(27), (B, S, 8, D))

    def tile(x):
        return jnp.broadcast_to(x[:, :, None], (B, S, 4, 2, D)).reshape(B, S, 8, D)

    def attend(q, k, v):
        k = jnp.repeat(k, 4, axis=2) if written.startswith("k repeated") else tile(k)
        v = {"k tiled, v repeated": lambda: jnp.repeat(v, 4, axis=2),
             "both tiled": lambda: tile(v), "k repeated, v not": lambda: v}[written]()
        return _attend(q, k, v, lambda s: jnp.where(jnp.tril(jnp.ones((S, S), bool)), s,
                                                    -jnp.inf))
    _check(attend, (q, k, v), calls)
    assert calls[0]["shapes"] == [(B, S, 8, D)] * 3


def test_a_repeated_k_also_used_outside_the_attention(calls):
    """Only the call's inputs change: the repeated k still feeds the rest of the code."""
    q, k, v = _repeat_inputs(28, B, 8, 2)

    def attend(q, k, v):
        k, v = (jnp.repeat(x, 4, axis=2) for x in (k, v))
        return _attend(q, k, v, lambda s: s) + jnp.tanh(k)
    _check(attend, (q, k, v), calls)
    assert calls[0]["shapes"][1] == (B, S, 2, D)


def _layer_stack(layers=2, seed=29):
    """x [B, S, H*D] and stacked per-layer q, k, v projections [L, 3, H*D, H*D]."""
    keys = jax.random.split(jax.random.key(seed), 2)
    return (jax.random.normal(keys[0], (B, S, H * D)),
            jax.random.normal(keys[1], (layers, 3, H * D, H * D)) / np.sqrt(H * D))


def _causal_layer(h, weights):
    """One layer as a scan body: causal attention on projections of h, plus h."""
    q, k, v = (jnp.einsum("bse,ef->bsf", h, weights[i]).reshape(B, S, H, D)
               for i in range(3))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return h + out.reshape(h.shape), jnp.sum(out)


@pytest.mark.parametrize("written", ["scan", "checkpointed layer, reverse scan",
                                     "fori_loop"])
def test_attention_inside_a_scan_over_stacked_layers(calls, written):
    """Layers run by lax.scan over stacked [L, ...] weights (as model code and flax's
    nn.scan write them): the body's attention is fused (one call, traced once), the scan
    keeps its length and direction, and gradients reach the per-layer weights (scan xs)
    through scan's own AD; a jax.checkpoint'd body stays a checkpoint inside the scan."""
    x, weights = _layer_stack()

    def stack(x, weights):
        if written == "fori_loop":  # static bounds: a scan too
            return jax.lax.fori_loop(0, 2, lambda i, h: _causal_layer(h, weights[i])[0], x)
        checkpointed = written.startswith("checkpointed")
        layer = jax.checkpoint(_causal_layer) if checkpointed else _causal_layer
        h, sums = jax.lax.scan(layer, x, weights, reverse=checkpointed)
        return h * sums[0]
    text = pf.explain_fuse(stack, x, weights)
    prefix = "inside lax.scan: " + ("inside jax.checkpoint: " if "checkpoint" in written
                                    else "")
    assert text.startswith(prefix + "softmax") and "fused into pf.attention (mask_mod" \
        in text, text
    calls.clear()  # (explain_fuse traces the call too)
    _check(stack, (x, weights), calls, argnums=(0, 1), atol=1e-4)
    fused_jaxpr = str(jax.make_jaxpr(pf.fuse(stack, backend="xla"))(x, weights))
    assert "scan[" in fused_jaxpr and fused_jaxpr.count(" exp ") == 0, fused_jaxpr
    if "checkpoint" in written:
        assert "checkpoint[" in fused_jaxpr or "remat" in fused_jaxpr


def test_attention_inside_a_while_loop_body(calls):
    """fori_loop with a traced trip count (a while_loop): its body is fused too
    (forward only: JAX differentiates no while_loop in reverse)."""
    x, weights = _layer_stack(seed=30)

    def stack(x, weights, n):
        return jax.lax.fori_loop(0, n, lambda i, h: _causal_layer(h, weights[i])[0], x)
    n = jnp.array(2)
    assert pf.explain_fuse(stack, x, weights, n).startswith("inside lax.while_loop: ")
    calls.clear()
    got = jax.jit(pf.fuse(stack, backend="xla"))(x, weights, n)
    np.testing.assert_allclose(got, stack(x, weights, n), atol=1e-4, rtol=1e-4)
    assert len(calls) == 1


def test_a_linen_model_scanning_remat_layers(calls):
    """flax.linen nn.scan over nn.remat'd layers with nn.MultiHeadDotProductAttention:
    a checkpoint inside a scan body, parameters stacked along the scan."""
    import flax.linen as nn

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)(
                x, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            return x + y, None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(nn.remat(Layer), variable_axes={"params": 0},
                             split_rngs={"params": True}, length=2)
            return layers()(x, None)[0]
    x = jax.random.normal(jax.random.key(31), (B, S, 32))
    model = Stack()
    params = model.init(jax.random.key(32), x)

    def loss(params, x):
        return jnp.sum(model.apply(params, x) ** 2)
    text = pf.explain_fuse(loss, params, x)
    assert text.startswith("inside lax.scan: inside jax.checkpoint: ") and \
        "fused into pf.attention" in text, text
    calls.clear()
    got = jax.value_and_grad(pf.fuse(loss, backend="xla"))(params, x)
    want = jax.value_and_grad(loss)(params, x)
    assert len(calls) == 1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)


def test_an_output_gate_joins_the_call(calls):
    """AlphaFold's gated self-attention as written (MSA rows, a pair bias broadcast over
    them, `weighted_avg * jax.nn.sigmoid(gate)` after the einsum's transpose): the
    multiply becomes the call's output_gate, applied in the forward kernel's epilogue;
    outputs and gradients (the gate's and the bias's included) as the written code's."""
    rows, residues, heads, channels = 3, 40, 2, 16
    keys = jax.random.split(jax.random.key(11), 5)
    q, k, v, gate = (jax.random.normal(key, (1, rows, residues, heads, channels))
                     for key in keys[:4])
    pair_bias = jax.random.normal(keys[4], (1, heads, residues, residues))

    def gated(q, k, v, gate, pair_bias):
        logits = jnp.einsum("brqhc,brkhc->brhqk", q, k) / np.sqrt(channels)
        weights = jax.nn.softmax(logits + pair_bias[:, None], axis=-1)
        weighted_avg = jnp.einsum("brhqk,brkhc->brqhc", weights, v)
        return weighted_avg * jax.nn.sigmoid(gate)
    args = (q, k, v, gate, pair_bias)
    _check(gated, args, calls, argnums=(0, 1, 2, 3, 4), backend="interpret")
    assert calls[-1]["output_gate"] is not None
    assert "output gate" in pf.explain_fuse(gated, *args)
    # Not differentiated, the sigmoid runs inside the kernel and nowhere else.
    sites = []

    def walk(jaxpr, inside=False):
        for equation in jaxpr.eqns:
            if equation.primitive.name == "logistic":
                sites.append(inside)
            for sub in jax.extend.core.jaxprs_in_params(equation.params):
                walk(sub, inside or equation.primitive.name == "pallas_call")
    walk(jax.make_jaxpr(pf.fuse(gated, backend="interpret"))(*args).jaxpr)
    assert sites == [True]


def test_a_gate_the_call_cannot_take_stays_as_written(calls):
    """A sigmoid broadcast over the heads (not the output's shape), and an output used
    beside its gated product: the attention is fused, the multiply runs as written."""
    q, k, v, gate = _inputs(12)

    def broadcast_gate(q, k, v, gate):
        return _attend(q, k, v, lambda s: s) * jax.nn.sigmoid(gate[:, :, :1])

    def used_twice(q, k, v, gate):
        out = _attend(q, k, v, lambda s: s)
        return out * jax.nn.sigmoid(gate) + out
    for fn in (broadcast_gate, used_twice):
        _check(fn, (q, k, v, gate), calls, argnums=(0, 1, 2, 3),
               expected_calls=len(calls) + 1)
        assert calls[-1]["output_gate"] is None
        assert "output gate" not in pf.explain_fuse(fn, q, k, v, gate)
