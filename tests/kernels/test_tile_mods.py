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
