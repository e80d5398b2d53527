"""The tile interpreter that replays a scalar mod on whole tiles inside the kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex import masks
from pallas_flex.kernels import tile_mods
from pallas_flex.masks.mod_program import SCORE, make_mod_program

BLOCK_Q, BLOCK_KV = 4, 8


def _tile_score(program, score, q_idx, kv_idx, indices_below):
    """apply_score_on_tile outside a kernel: captured arrays come from plain arrays."""
    refs = [jnp.reshape(c, (1,)) if jnp.ndim(c) == 0 else c for c in program.consts]
    return tile_mods.apply_score_on_tile(program, refs, score, jnp.int32(0), jnp.int32(1),
                                         q_idx, kv_idx, indices_below=indices_below)


def _float_conversions_of_tiles(program, q_idx, kv_idx, indices_below):
    """Shapes of the int->float conversions the tile evaluation performs."""
    score = jnp.zeros((q_idx.shape[0], kv_idx.shape[1]), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda s, q, k: _tile_score(program, s, q, k, indices_below))(
        score, q_idx, kv_idx)
    return [eqn.invars[0].aval.shape for eqn in jaxpr.eqns
            if eqn.primitive.name == "convert_element_type"
            and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer)
            and eqn.params["new_dtype"] == jnp.float32]


def _indices(q_start, kv_start):
    q_idx = q_start + jnp.arange(BLOCK_Q, dtype=jnp.int32)[:, None]
    kv_idx = kv_start + jnp.arange(BLOCK_KV, dtype=jnp.int32)[None, :]
    return q_idx, kv_idx


@pytest.mark.parametrize("q_start,kv_start", [(0, 0), (3, 100), (2 ** 24 - BLOCK_Q, 0),
                                               (0, 2 ** 24 - BLOCK_KV)])
def test_index_difference_converts_vectors_and_stays_exact(q_start, kv_start):
    """ALiBi's float32(kv_idx - q_idx) becomes float32(kv_idx) - float32(q_idx): the
    conversions run on the index vectors, and the scores are bit-identical, up to the
    largest indices the rewrite is allowed for."""
    program = make_mod_program(masks.alibi(jnp.array([0.5, 0.25], jnp.float32)), SCORE)
    q_idx, kv_idx = _indices(q_start, kv_start)
    score = jax.random.normal(jax.random.key(0), (BLOCK_Q, BLOCK_KV), jnp.float32)

    rewritten = _tile_score(program, score, q_idx, kv_idx, indices_below=2 ** 24)
    plain = _tile_score(program, score, q_idx, kv_idx, indices_below=None)
    expected = score + 0.25 * (np.asarray(kv_idx, np.float64) - np.asarray(q_idx, np.float64))
    np.testing.assert_array_equal(np.asarray(rewritten), np.asarray(plain))
    np.testing.assert_allclose(np.asarray(rewritten), expected.astype(np.float32), rtol=0)

    assert sorted(_float_conversions_of_tiles(program, q_idx, kv_idx, 2 ** 24)) == [
        (1, BLOCK_KV), (BLOCK_Q, 1)]
    assert _float_conversions_of_tiles(program, q_idx, kv_idx, None) == [(BLOCK_Q, BLOCK_KV)]


def test_no_rewrite_past_exact_float32_integers():
    """Past 2**24 the two conversions could round differently from the difference's:
    the kernels then convert the difference itself."""
    program = make_mod_program(masks.alibi(jnp.array([0.5, 0.25], jnp.float32)), SCORE)
    q_idx, kv_idx = _indices(0, 0)
    assert _float_conversions_of_tiles(program, q_idx, kv_idx, 2 ** 24 + 1) == [
        (BLOCK_Q, BLOCK_KV)]


def test_rewrite_only_for_raw_indices():
    """A difference of derived values (here kv_idx * 3 - q_idx) is converted as a whole:
    only q_idx and kv_idx themselves are known to be small."""
    def tripled_distance(score, b, h, q_idx, kv_idx):
        return score + jnp.astype(kv_idx * 3 - q_idx, jnp.float32)

    program = make_mod_program(tripled_distance, SCORE)
    q_idx, kv_idx = _indices(5, 7)
    assert _float_conversions_of_tiles(program, q_idx, kv_idx, 2 ** 24) == [
        (BLOCK_Q, BLOCK_KV)]
    score = jnp.zeros((BLOCK_Q, BLOCK_KV), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(_tile_score(program, score, q_idx, kv_idx, 2 ** 24)),
        (3 * np.asarray(kv_idx) - np.asarray(q_idx)).astype(np.float32))


@pytest.mark.parametrize("offset", [0, 3])
def test_rewrite_sees_through_a_zero_offset(offset):
    """`kv_idx - q_idx - offset` with a query offset of 0 (queries at the end of the
    keys, written generally) is the index difference itself; a nonzero offset is not."""
    slopes = jnp.array([0.5, 0.25], jnp.float32)

    def shifted_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx - offset)

    program = make_mod_program(shifted_alibi, SCORE)
    q_idx, kv_idx = _indices(5, 7)
    conversions = sorted(_float_conversions_of_tiles(program, q_idx, kv_idx, 2 ** 24))
    assert conversions == ([(1, BLOCK_KV), (BLOCK_Q, 1)] if offset == 0
                           else [(BLOCK_Q, BLOCK_KV)])
    score = jnp.zeros((BLOCK_Q, BLOCK_KV), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(_tile_score(program, score, q_idx, kv_idx, 2 ** 24)),
        (0.25 * (np.asarray(kv_idx) - np.asarray(q_idx) - offset)).astype(np.float32))


def test_rewrite_reaches_into_nested_calls():
    """Mods that call jitted helpers keep the rewrite: the index arguments are mapped
    into the call's jaxpr."""
    @jax.jit
    def distance(q_idx, kv_idx):
        return jnp.astype(kv_idx - q_idx, jnp.float32)

    def relative(score, b, h, q_idx, kv_idx):
        return score - distance(q_idx, kv_idx)

    program = make_mod_program(relative, SCORE)
    q_idx, kv_idx = _indices(1, 2)
    assert sorted(_float_conversions_of_tiles(program, q_idx, kv_idx, 2 ** 24)) == [
        (1, BLOCK_KV), (BLOCK_Q, 1)]
    score = jnp.zeros((BLOCK_Q, BLOCK_KV), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(_tile_score(program, score, q_idx, kv_idx, 2 ** 24)),
        -(np.asarray(kv_idx) - np.asarray(q_idx)).astype(np.float32))


# The Mosaic GPU kernels' tile evaluation keeps sums and scalings unevaluated
# (`mosaic_tiles.Affine`); on plain arrays it must give the scalar mod's values, and
# fold only what it may (a constant factor of a bare tile).
_AFFINE_MODS = {
    "softcap": (masks.tanh_softcap(30.0), 30.0),
    "softcap_array_cap": (masks.tanh_softcap(jnp.float32(20.0)), 20.0),  # concrete here
    "alibi": (masks.alibi(4), 1.0),
    "relative": (masks.relative_position(0.01), 1.0),
    "divisions_and_negation": (lambda s, b, h, q, kv: -(s - 3.0) / 7.0
                               + (q - kv).astype(jnp.float32) / 3.0, 1.0),
    "select_of_scalings": (lambda s, b, h, q, kv: jnp.where(
        q >= kv, s * 2.0 - 1.0, s / 2.0 + kv.astype(jnp.float32)), 1.0),
    "product_of_tiles": (lambda s, b, h, q, kv: s * s / 100.0 + 1.0 - s, 1.0),
    "vectors_only": (lambda s, b, h, q, kv: (kv - q).astype(jnp.float32) * 0.5 + 2.0, 1.0),
    "query_vector": (lambda s, b, h, q, kv: s + q.astype(jnp.float32) * 0.1, 1.0),
    "negative_factor": (lambda s, b, h, q, kv: s * -2.0, -2.0 * 0.125),
}


def _evaluate_on_mosaic_tile(program, raw, scale, b, h, q_start, kv_start,
                             keep_affine=False):
    """The Mosaic GPU tile interpreter's outputs of a score program on the tile of raw
    scores [BLOCK_Q, BLOCK_KV] at (q_start, kv_start), queries along axis 0."""
    from pallas_flex.kernels import mosaic_tiles

    refs = [jnp.reshape(c, (1,)) if jnp.ndim(c) == 0 else c for c in program.consts]
    args = (mosaic_tiles.Affine(raw, scale), jnp.int32(b), jnp.int32(h),
            mosaic_tiles.Vector(jnp.arange(q_start, q_start + BLOCK_Q, dtype=jnp.int32), 0),
            mosaic_tiles.Vector(jnp.arange(kv_start, kv_start + BLOCK_KV, dtype=jnp.int32), 1))
    return mosaic_tiles.evaluate(program, {}, refs, args, tile=(BLOCK_Q, BLOCK_KV), q_axis=0,
                                 q_start=q_start, kv_start=kv_start, interpret=True,
                                 keep_affine=keep_affine)


@pytest.mark.parametrize("name", sorted(_AFFINE_MODS))
@pytest.mark.parametrize("with_derivative", [False, True])
def test_mosaic_affine_evaluation_matches_the_scalar_mod(name, with_derivative):
    from pallas_flex.kernels import mosaic_tiles
    from pallas_flex.masks.mod_program import with_score_derivative

    mod, folded_factor = _AFFINE_MODS[name]
    scale, b, h, q_start, kv_start = 0.125, 0, 2, 5, 40
    raw = jnp.asarray(np.random.default_rng(0).normal(size=(BLOCK_Q, BLOCK_KV)) * 10,
                      jnp.float32)
    q_positions = q_start + np.arange(BLOCK_Q)
    kv_positions = kv_start + np.arange(BLOCK_KV)

    def per_element(function):
        return jax.vmap(jax.vmap(function, (0, None, 0)), (0, 0, None))(
            raw * scale, jnp.asarray(q_positions), jnp.asarray(kv_positions))

    program = make_mod_program(mod, SCORE)
    if with_derivative:
        program = with_score_derivative(program)
    outputs = _evaluate_on_mosaic_tile(program, raw, scale, b, h, q_start, kv_start,
                                       keep_affine=True)
    tile, factor = mosaic_tiles.scaled_tile(outputs[0], (BLOCK_Q, BLOCK_KV))
    assert factor == pytest.approx(folded_factor if name != "negative_factor" else -0.25)
    expected = per_element(lambda s, q, kv: mod(s, b, h, q, kv))
    np.testing.assert_allclose(tile * factor, expected, rtol=2e-6, atol=2e-6)
    if with_derivative:
        derivative = mosaic_tiles.to_tile(
            mosaic_tiles.materialize(outputs[1], (BLOCK_Q, BLOCK_KV)), (BLOCK_Q, BLOCK_KV))
        expected = per_element(lambda s, q, kv: jax.grad(lambda s: mod(s, b, h, q, kv))(s))
        np.testing.assert_allclose(derivative, expected, rtol=2e-6, atol=2e-6)


def test_mosaic_affine_division_by_a_constant_is_a_multiplication():
    """A soft-cap's score / cap costs one multiplication per element (folded with the
    softmax scale) and no division: Mosaic GPU lowers a float32 division per element as
    the IEEE sequence."""
    from pallas_flex.kernels import mosaic_tiles

    program = make_mod_program(masks.tanh_softcap(30.0), SCORE)
    shape = (BLOCK_Q, BLOCK_KV)

    def run(raw):
        args = (mosaic_tiles.Affine(raw, 0.125), jnp.int32(0), jnp.int32(0),
                mosaic_tiles.Vector(jnp.arange(BLOCK_Q, dtype=jnp.int32), 0),
                mosaic_tiles.Vector(jnp.arange(BLOCK_KV, dtype=jnp.int32), 1))
        (out,) = mosaic_tiles.evaluate(program, {}, [], args, tile=shape, q_axis=0,
                                       q_start=0, kv_start=0, interpret=True,
                                       keep_affine=True)
        return mosaic_tiles.scaled_tile(out, shape)[0]

    jaxpr = jax.make_jaxpr(run)(jnp.zeros(shape, jnp.float32))
    tile_ops = [eqn.primitive.name for eqn in jaxpr.eqns
                if eqn.outvars[0].aval.shape == shape]
    assert "div" not in tile_ops
    assert tile_ops.count("mul") == 1 and tile_ops.count("tanh") == 1


def test_read_derivatives_on_a_tile_match_autodiff_of_the_mod():
    """`with_read_derivatives`: besides the mod and d mod / d score, the derivative with
    respect to the value read from each differentiated captured array (a 0-d temperature,
    ALiBi slopes at h, a bias shared by head pairs at h // 2), evaluated on a tile by the
    Mosaic GPU interpreter, equals autodiff of the scalar mod with respect to the arrays
    (each is read once, so the array's gradient is that derivative at the entry read)."""
    from pallas_flex.kernels import mosaic_tiles
    from pallas_flex.masks.mod_program import with_read_derivatives

    temperature = jnp.float32(1.5)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    pair_bias = jnp.asarray([0.3, -0.7], jnp.float32)

    def mod(s, b, h, q, kv, temperature=temperature, slopes=slopes, pair_bias=pair_bias):
        return 20.0 * jnp.tanh(s * temperature / 20.0) + slopes[h] * (kv - q) + pair_bias[h // 2]

    scale, b, h, q_start, kv_start = 0.125, 0, 3, 5, 40
    raw = jnp.asarray(np.random.default_rng(1).normal(size=(BLOCK_Q, BLOCK_KV)) * 10,
                      jnp.float32)
    q_positions, kv_positions = q_start + np.arange(BLOCK_Q), kv_start + np.arange(BLOCK_KV)
    program = make_mod_program(mod, SCORE)
    positions = tuple(range(len(program.consts)))
    derived = with_read_derivatives(program, positions)
    outputs = _evaluate_on_mosaic_tile(derived, raw, scale, b, h, q_start, kv_start)
    assert len(outputs) == 2 + len(positions)
    tiles = [np.asarray(mosaic_tiles.to_tile(x, (BLOCK_Q, BLOCK_KV))) for x in outputs]

    def per_element(function):
        return jax.vmap(jax.vmap(function, (0, None, 0)), (0, 0, None))(
            raw * scale, jnp.asarray(q_positions), jnp.asarray(kv_positions))

    np.testing.assert_allclose(tiles[0], per_element(lambda s, q, kv: mod(s, b, h, q, kv)),
                               rtol=2e-6, atol=2e-5)
    np.testing.assert_allclose(tiles[1], per_element(
        lambda s, q, kv: jax.grad(mod)(s, b, h, q, kv)), rtol=2e-6, atol=2e-6)
    by_array = per_element(lambda s, q, kv: jax.grad(
        lambda t, sl, pb: mod(s, b, h, q, kv, t, sl, pb), argnums=(0, 1, 2))(
            temperature, slopes, pair_bias))
    expected = [by_array[0], by_array[1][..., h], by_array[2][..., h // 2]]
    # The program's consts keep the mod's capture order: match them by identity.
    order = {id(c): i for i, c in enumerate((temperature, slopes, pair_bias))}
    for position, tile in zip(positions, tiles[2:]):
        want = expected[order[id(program.consts[position])]]
        np.testing.assert_allclose(tile, want, rtol=2e-6, atol=2e-6)


def test_small_tables_read_per_element_are_selected_not_gathered(monkeypatch):
    """A T5 table (32 buckets a head) read per element runs as one select per entry a
    tile reaches (`CapturedRef._select`) with the reference's values where
    `forward_selects_small_tables` says so (the D 64 default); a relative table of
    2S - 1 entries a head stays a gather, and so does everything with the option off."""
    import pallas_flex as pf
    from pallas_flex.kernels import tile_mods

    selected = []
    original = tile_mods.CapturedRef._select

    def spy(self, *args):
        selected.append(self.shape)
        return original(self, *args)

    monkeypatch.setattr(tile_mods.CapturedRef, "_select", spy)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 200, 2, 64)), jnp.float32) for _ in range(3))
    t5 = pf.scores.t5_relative_bias(jnp.asarray(rng.normal(size=(2, 32)), jnp.float32))
    relative = jnp.asarray(rng.normal(size=(2, 399)), jnp.float32)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + relative[h, q_idx - kv_idx + 199]

    for score_mod, options, expect_select in (
            (t5, None, True), (relative_bias, None, False),
            (t5, {"forward_selects_small_tables": False}, False)):
        selected.clear()
        out = pf.attention(q, k, v, score_mod=score_mod, backend="interpret",
                           kernel_options=options)
        want = pf.attention(q, k, v, score_mod=score_mod, backend="reference")
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
        assert bool(selected) == expect_select and all(s == (2, 32) for s in selected)


def test_clipped_exact_indices_are_exact_up_to_the_axis_end():
    """`jnp.clip(q_idx, 0, upper)` reads exactly q_idx where the array's axis ends at or
    before upper (the read clamps there anyway): a block read, as in the traced reads of
    `with_read_derivatives`; clipped earlier it stops short of the axis's end, a gather."""
    from pallas_flex.masks.mod_program import with_read_derivatives
    bias = jnp.zeros((2, 200, 256))

    def kinds(score_mod):
        program = make_mod_program(score_mod, SCORE)
        return [kinds for _, _, kinds, _ in tile_mods.exact_index_reads(program)]

    assert kinds(lambda s, b, h, q, kv: s + bias[h, jnp.clip(q, 0, 199), kv]) == [
        [None, "q", "kv"]]
    assert kinds(lambda s, b, h, q, kv: s + bias[h, q, jnp.clip(kv, 0, 300)]) == [
        [None, "q", "kv"]]
    assert kinds(lambda s, b, h, q, kv: s + bias[h, jnp.clip(q, 0, 99), kv]) == [
        [None, None, "kv"]]
    assert kinds(lambda s, b, h, q, kv: s + bias[h, jnp.clip(q, 5, 199), kv]) == [
        [None, None, "kv"]]
    derivatives = with_read_derivatives(make_mod_program(masks.bias_lookup(bias[None]),
                                                         SCORE), (0,))
    assert [kinds for _, _, kinds, _ in tile_mods.exact_index_reads(derivatives)] == [
        [None, None, "q", "kv"]]
