"""FlexMultiHeadAttention against Flax's own layer, the dense reference, and itself
decoding through its cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_flex as pf
from pallas_flex.nn import FlexMultiHeadAttention, LearnableAlibi, T5RelativeBias
from tests.conftest import SMALL_TILES

FEATURES, HEADS = 32, 4
GRAD_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def _inputs(seed, batch=2, length=21, features=FEATURES):
    # numpy, not jax.random: each new shape of a jax.random draw is one more XLA compile.
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, length, features)), jnp.float32)


def _dense(mask_mod, q_len, kv_len):
    """The [1, 1, Sq, Skv] boolean mask of a mod that reads only positions."""
    return mask_mod(0, 0, jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :])[None, None]


def _build(make_layer):
    """Constructs a layer under jit: one compiled initializer rather than one per weight."""
    return nnx.jit(make_layer)()


def _flax_twin(ours, **options):
    """nnx.MultiHeadAttention holding `ours`'s weights. Built abstractly (no initializers
    run): any parameter the two modules do not share would stay abstract and fail."""
    theirs = nnx.eval_shape(lambda: nnx.MultiHeadAttention(
        ours.num_heads, ours.in_features, decode=False, rngs=nnx.Rngs(0), **options))
    nnx.update(theirs, nnx.state(ours, nnx.Param))
    return theirs


@pytest.fixture(scope="module")
def layer_pair():
    """Flax's layer and ours (grouped-query: 4 query heads, 2 key/value heads), same
    weights."""
    ours = _build(lambda: FlexMultiHeadAttention(HEADS, FEATURES, num_kv_heads=2,
                                                 backend="xla", kernel_options=SMALL_TILES,
                                                 rngs=nnx.Rngs(1)))
    head_dim = FEATURES // HEADS
    assert ours.query.kernel.shape == (FEATURES, HEADS, head_dim)
    assert ours.key.kernel.shape == ours.value.kernel.shape == (FEATURES, 2, head_dim)
    assert ours.out.kernel.shape == (HEADS, head_dim, FEATURES)
    return _flax_twin(ours, num_kv_heads=2), ours


def _assert_trees_close(ours, theirs, **tolerance):
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, **tolerance)


def _outputs_and_gradients(layer, x, **call_options):
    def loss(layer):
        out = layer(x, **call_options)
        return jnp.sum(jnp.sin(out)), out

    (_, out), gradients = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer)
    return out, gradients


@pytest.mark.parametrize("mask_mod", [pf.masks.causal_mask,
                                      pf.masks.sliding_window(5, causal=False)])
def test_matches_nnx_multi_head_attention_outputs_and_parameter_gradients(layer_pair,
                                                                          mask_mod):
    theirs, ours = layer_pair
    x = _inputs(0)
    dense_mask = _dense(mask_mod, x.shape[1], x.shape[1])
    our_out, our_gradients = _outputs_and_gradients(ours, x, mask_mod=mask_mod)
    their_out, their_gradients = _outputs_and_gradients(theirs, x, mask=dense_mask)
    assert our_out.shape == x.shape
    np.testing.assert_allclose(our_out, their_out, atol=2e-5)
    _assert_trees_close(our_gradients, their_gradients, **GRAD_TOLERANCE)


def test_cross_attention_with_other_features_and_lengths_matches_nnx():
    q_inputs, kv_inputs = _inputs(1, length=9), _inputs(2, length=26, features=12)
    shapes = dict(qkv_features=16, out_features=8, in_kv_features=12)
    ours = _build(lambda: FlexMultiHeadAttention(HEADS, FEATURES, backend="xla",
                                                 rngs=nnx.Rngs(1), **shapes))
    theirs = _flax_twin(ours, **shapes)
    both = nnx.jit(lambda ours, theirs: (ours(q_inputs, kv_inputs),
                                         theirs(q_inputs, kv_inputs)))
    our_out, their_out = both(ours, theirs)
    assert our_out.shape == (2, 9, 8)
    np.testing.assert_allclose(our_out, their_out, atol=2e-5)


def test_prebuilt_block_mask_equals_mask_mod(layer_pair):
    x = _inputs(4)
    _, ours = layer_pair
    mask_mod = pf.masks.sliding_window(6)
    block_mask = pf.create_block_mask(mask_mod, None, None, x.shape[1], x.shape[1],
                                      block_size=16)
    both = nnx.jit(lambda layer, block_mask: (layer(x, block_mask=block_mask),
                                              layer(x, mask_mod=mask_mod)))
    np.testing.assert_allclose(*both(ours, block_mask), atol=1e-6)


DECODE_LENGTH, MAX_LENGTH = 16, 20
# A sliding-window mask and a position-dependent learnable bias: both must see absolute
# positions through the cache.
DECODE_MASK = pf.masks.sliding_window(7)


@pytest.fixture(scope="module")
def decoding():
    """A GQA layer, inputs [2, DECODE_LENGTH, FEATURES], its full forward, and the jitted
    decode call (shared so that both decode tests compile it once)."""
    layer = _build(lambda: FlexMultiHeadAttention(
        HEADS, FEATURES, num_kv_heads=2, backend="xla", score_bias=LearnableAlibi(HEADS),
        kernel_options=SMALL_TILES, rngs=nnx.Rngs(5)))
    x = _inputs(6, length=DECODE_LENGTH)
    traces = []

    @nnx.jit
    def decode(layer, inputs, input_lengths):
        traces.append(inputs.shape)
        return layer(inputs, mask_mod=DECODE_MASK, decode=True, input_lengths=input_lengths)

    full = nnx.jit(lambda layer: layer(x, mask_mod=DECODE_MASK))(layer)
    return layer, x, full, decode, traces


def test_token_by_token_decoding_equals_full_forward_without_recompiling(decoding):
    layer, x, full, decode, traces = decoding
    layer.init_cache(batch_size=2, max_length=MAX_LENGTH)
    one_each = jnp.ones((2,), jnp.int32)
    decoded = jnp.concatenate(
        [decode(layer, x[:, i:i + 1], one_each) for i in range(DECODE_LENGTH)], axis=1)
    np.testing.assert_allclose(decoded, full, atol=2e-5)
    assert traces.count((2, 1, FEATURES)) == 1
    np.testing.assert_array_equal(layer.cache_index[...], [DECODE_LENGTH, DECODE_LENGTH])


def test_ragged_prefill_then_decode_equals_full_forward(decoding):
    layer, x, full, decode, _ = decoding
    prompt_lengths = jnp.array([5, 9])
    layer.init_cache(batch_size=2, max_length=MAX_LENGTH)
    # Right-padded prompts: row 0's pad holds garbage, which must never be attended to.
    padded_prompts = jnp.where(jnp.arange(9)[None, :, None] < prompt_lengths[:, None, None],
                               x[:, :9], 100.0)
    prefill = decode(layer, padded_prompts, prompt_lengths)
    np.testing.assert_allclose(prefill[1], full[1, :9], atol=2e-5)
    np.testing.assert_allclose(prefill[0, :5], full[0, :5], atol=2e-5)
    np.testing.assert_array_equal(layer.cache_index[...], prompt_lengths)
    # Then one token per row, each row at its own position.
    rows = jnp.arange(2)
    for step in range(4):
        positions = prompt_lengths + step
        out = decode(layer, x[rows, positions][:, None], jnp.ones((2,), jnp.int32))
        np.testing.assert_allclose(out[:, 0], full[rows, positions], atol=2e-5)


def test_learnable_bias_gradients_match_dense_autodiff():
    """A T5 bias owned by the layer and an ALiBi module passed at call time: both
    parameters get the gradients dense autodiff gives."""
    x = _inputs(9)
    fused_layer = _build(lambda: FlexMultiHeadAttention(
        HEADS, FEATURES, score_bias=T5RelativeBias(HEADS, num_buckets=8, max_distance=16,
                                                   bidirectional=False, rngs=nnx.Rngs(3)),
        backend="xla", kernel_options=SMALL_TILES, rngs=nnx.Rngs(4)))
    reference_layer = nnx.clone(fused_layer)
    reference_layer.backend = "reference"

    def loss(layer, alibi):
        return jnp.sum(jnp.sin(layer(x, mask_mod=pf.masks.causal_mask, score_mod=alibi())))

    gradients = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    fused = gradients(fused_layer, LearnableAlibi(HEADS))
    reference = gradients(reference_layer, LearnableAlibi(HEADS))
    for bias_gradient in (fused[0].score_bias.table, fused[1].slopes):
        assert float(jnp.abs(bias_gradient[...]).min()) > 0
    _assert_trees_close(fused, reference, **GRAD_TOLERANCE)


def test_bias_modules_hand_out_score_mods_over_their_parameters():
    bias = T5RelativeBias(2, num_buckets=8, max_distance=16, rngs=nnx.Rngs(0))
    assert bias.table.shape == (2, 8)
    bucket = int(pf.masks.t5_relative_bucket(3, num_buckets=8, max_distance=16))
    assert float(bias()(1.0, 0, 1, 2, 5)) == pytest.approx(1.0 + float(bias.table[1, bucket]))
    alibi = LearnableAlibi(4)
    np.testing.assert_array_equal(alibi.slopes[...], pf.masks.alibi_slopes(4))
    assert float(alibi()(0.0, 0, 0, 5, 3)) == pytest.approx(-2 * 0.25)


@pytest.mark.parametrize("construct,message", [
    (lambda: FlexMultiHeadAttention(4, 32, num_kv_heads=3, rngs=nnx.Rngs(0)), "num_kv_heads"),
    (lambda: FlexMultiHeadAttention(4, 32, qkv_features=30, rngs=nnx.Rngs(0)), "qkv_features"),
    (lambda: FlexMultiHeadAttention(0, 32, rngs=nnx.Rngs(0)), "num_heads"),
    (lambda: FlexMultiHeadAttention(4, 32, kernel_options=[("block_q", 16)], rngs=nnx.Rngs(0)),
     "kernel_options"),
    (lambda: FlexMultiHeadAttention(4, 32, score_bias=LearnableAlibi(2), rngs=nnx.Rngs(0)),
     "score_bias"),
    (lambda: T5RelativeBias(2, num_buckets=2, rngs=nnx.Rngs(0)), "num_buckets"),
], ids=["kv_heads", "qkv_features", "num_heads", "kernel_options", "bias_heads", "buckets"])
def test_constructor_errors(construct, message):
    with pytest.raises(ValueError, match=message):
        construct()


def test_call_errors():
    layer = _build(lambda: FlexMultiHeadAttention(2, 8, backend="xla", rngs=nnx.Rngs(0)))
    x = jnp.ones((1, 4, 8))
    block_mask = pf.create_block_mask(pf.masks.causal_mask, None, None, 4, 4)
    with pytest.raises(ValueError, match="inputs_q"):
        layer(jnp.ones((1, 4, 6)))
    with pytest.raises(ValueError, match="either mask_mod or block_mask"):
        layer(x, mask_mod=pf.masks.causal_mask, block_mask=block_mask)
    with pytest.raises(ValueError, match="init_cache"):
        layer(x, decode=True)
    layer.init_cache(batch_size=1, max_length=8)
    with pytest.raises(ValueError, match="block_mask"):
        layer(x, block_mask=block_mask, decode=True)
    with pytest.raises(ValueError, match="batch_size=1"):
        layer(jnp.ones((2, 1, 8)), decode=True)
    with pytest.raises(ValueError, match="input_lengths"):
        layer(x, decode=True, input_lengths=jnp.array([1.0]))
    with pytest.raises(ValueError, match="input_lengths"):
        layer(x, input_lengths=jnp.array([1]))


def test_decoding_past_max_length_is_a_clear_error():
    """The contiguous cache used to drop the tokens past max_length silently (and the
    outputs diverged); now it refuses, naming max_length and the position, eagerly and
    as a checkify check under jit. A call that fits (padding past the end included) is
    fine."""
    from jax.experimental import checkify

    layer = _build(lambda: FlexMultiHeadAttention(HEADS, FEATURES, backend="interpret",
                                                  rngs=nnx.Rngs(0)))
    layer.init_cache(batch_size=2, max_length=6)
    x = _inputs(3, length=4)
    layer(x, mask_mod=pf.masks.causal_mask, decode=True)
    message = (r"decoding past the cache's max_length: row 0 is at position 4 and 3 new "
               r"tokens would make 7, but init_cache\(max_length=6\) holds 6 per row")
    with pytest.raises(ValueError, match=message):
        layer(x[:, :3], mask_mod=pf.masks.causal_mask, decode=True)
    np.testing.assert_array_equal(layer.cache_index[...], [4, 4])  # nothing written
    with pytest.raises(ValueError, match=r"input_lengths must be in \[0, 3\] \(the call's "
                                         r"Sq\); input_lengths\[1\] = 4"):
        layer(x[:, :3], decode=True, input_lengths=jnp.array([1, 4]))
    # Row 0 writes 2 real tokens, row 1 one (its padding falls past max_length): fits.
    layer(x[:, :3], mask_mod=pf.masks.causal_mask, decode=True,
          input_lengths=jnp.array([2, 1]))
    np.testing.assert_array_equal(layer.cache_index[...], [6, 5])

    graphdef, state = nnx.split(layer)

    def step(state, inputs):
        module = nnx.merge(graphdef, state)
        return module(inputs, mask_mod=pf.masks.causal_mask, decode=True)

    error, _ = checkify.checkify(jax.jit(step))(state, x[:, :1])
    assert error.get() is not None and re.search(
        r"row 0 is at position 6 and 1 new tokens would make 7, but "
        r"init_cache\(max_length=6\)", error.get()), error.get()


def test_nan_padding_never_reaches_real_rows():
    """Right-padded prompts whose padding holds NaN: the padding is written as zeros, so
    the real tokens' outputs equal those of finite padding."""
    layer = _build(lambda: FlexMultiHeadAttention(HEADS, FEATURES, backend="xla",
                                                  kernel_options=SMALL_TILES,
                                                  rngs=nnx.Rngs(4)))
    x = _inputs(5, length=9)
    lengths = jnp.array([5, 9])
    real = jnp.arange(9)[None, :, None] < lengths[:, None, None]
    outputs = []
    for pad in (0.0, jnp.nan):
        layer.init_cache(batch_size=2, max_length=12)
        out = layer(jnp.where(real, x, pad), mask_mod=pf.masks.causal_mask, decode=True,
                    input_lengths=lengths)
        step = layer(x[:, :1], mask_mod=pf.masks.causal_mask, decode=True)
        outputs.append((np.asarray(out[0, :5]), np.asarray(out[1]), np.asarray(step)))
    for clean, poisoned in zip(*outputs):
        assert np.isfinite(poisoned).all()
        np.testing.assert_array_equal(poisoned, clean)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_paged_decoding_equals_full_forward(backend):
    """Ragged prompts, then one token per row, through a PagedKVCache (pages of 4, so
    rows span several non-adjacent pages); the kernels read the pages in place."""
    layer = _build(lambda: FlexMultiHeadAttention(
        HEADS, FEATURES, num_kv_heads=2, backend=backend, score_bias=LearnableAlibi(HEADS),
        kernel_options=SMALL_TILES, rngs=nnx.Rngs(7)))
    x = _inputs(8, length=12)
    full = layer(x, mask_mod=DECODE_MASK)
    layer.init_paged_cache(num_pages=10, page_size=4, batch_size=2, max_pages_per_seq=4)
    decode = nnx.jit(lambda layer, inputs, lengths: layer(
        inputs, mask_mod=DECODE_MASK, decode=True, input_lengths=lengths))
    prompt_lengths = jnp.array([3, 7])
    prefill = decode(layer, x[:, :7], prompt_lengths)
    np.testing.assert_allclose(prefill[1], full[1, :7], atol=2e-5)
    np.testing.assert_allclose(prefill[0, :3], full[0, :3], atol=2e-5)
    rows = jnp.arange(2)
    for step in range(4):
        positions = prompt_lengths + step
        out = decode(layer, x[rows, positions][:, None], jnp.ones((2,), jnp.int32))
        np.testing.assert_allclose(out[:, 0], full[rows, positions], atol=2e-5)
    cache = layer.paged_cache.get_value()
    np.testing.assert_array_equal(cache.lengths, [7, 11])
    assert int(cache.num_free_pages) == 10 - 2 - 3
    layer.erase_rows([0])
    assert int(layer.paged_cache.get_value().num_free_pages) == 10 - 3


def test_paged_decoding_out_of_pages_is_a_clear_error():
    layer = _build(lambda: FlexMultiHeadAttention(HEADS, FEATURES, backend="xla",
                                                  rngs=nnx.Rngs(0)))
    layer.init_paged_cache(num_pages=2, page_size=4, batch_size=2, max_pages_per_seq=4)
    with pytest.raises(ValueError, match="page"):
        layer(_inputs(1, length=6), decode=True)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_output_gate_matches_the_layer_written_by_hand(backend):
    """output_gate=True: a `gate` projection of inputs_q, each head's output times its
    sigmoid before `out` (Qwen3-Next's gated attention): outputs and every parameter's
    gradient (the gate's included) against the same layer written in plain JAX."""
    layer = _build(lambda: FlexMultiHeadAttention(
        HEADS, FEATURES, num_kv_heads=2, output_gate=True, backend=backend,
        kernel_options=SMALL_TILES, rngs=nnx.Rngs(3)))
    head_dim = FEATURES // HEADS
    assert layer.gate.kernel.shape == (FEATURES, HEADS, head_dim)
    x = _inputs(9)

    def by_hand(layer, x):
        out = pf.attention(layer.query(x), layer.key(x), layer.value(x),
                           mask_mod=pf.masks.causal_mask, backend="reference")
        return layer.out(out * jax.nn.sigmoid(layer.gate(x)))

    def loss(layer, fn):
        out = fn(layer, x)
        return jnp.sum(jnp.sin(out)), out

    ours = nnx.jit(nnx.value_and_grad(lambda layer: loss(
        layer, lambda layer, x: layer(x, mask_mod=pf.masks.causal_mask)), has_aux=True))
    theirs = nnx.jit(nnx.value_and_grad(lambda layer: loss(layer, by_hand), has_aux=True))
    (_, our_out), our_gradients = ours(layer)
    (_, their_out), their_gradients = theirs(layer)
    np.testing.assert_allclose(our_out, their_out, atol=2e-5)
    _assert_trees_close(our_gradients, their_gradients, **GRAD_TOLERANCE)
    assert float(jnp.max(jnp.abs(our_gradients["gate"]["kernel"][...]))) > 0
    # Not differentiated, the same output (the gate then in the forward kernel).
    np.testing.assert_allclose(
        nnx.jit(lambda layer: layer(x, mask_mod=pf.masks.causal_mask))(layer), their_out,
        atol=2e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_gated_decoding_equals_full_forward(paged):
    layer = _build(lambda: FlexMultiHeadAttention(
        HEADS, FEATURES, num_kv_heads=2, output_gate=True, backend="xla",
        kernel_options=SMALL_TILES, rngs=nnx.Rngs(4)))
    x = _inputs(10, length=8)
    full = nnx.jit(lambda layer: layer(x, mask_mod=DECODE_MASK))(layer)
    if paged:
        layer.init_paged_cache(num_pages=8, page_size=4, batch_size=2, max_pages_per_seq=4)
    else:
        layer.init_cache(batch_size=2, max_length=8)
    decode = nnx.jit(lambda layer, inputs: layer(inputs, mask_mod=DECODE_MASK, decode=True))
    decoded = jnp.concatenate([decode(layer, x[:, :5])] + [
        decode(layer, x[:, i:i + 1]) for i in range(5, 8)], axis=1)
    np.testing.assert_allclose(decoded, full, atol=2e-5)
