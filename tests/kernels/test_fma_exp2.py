"""exp2 on the FMA units (`kernels/fma_exp2.py`): the polynomial's accuracy and edge values,
and which calls of the Mosaic forward take it (`mosaic_eligibility.exp2_fma_share`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex import masks
from pallas_flex.kernels import fma_exp2, mosaic_eligibility
from pallas_flex.masks.mod_program import SCORE, make_mod_program


@pytest.mark.parametrize("jit", [False, True])
def test_polynomial_exp2_is_within_its_relative_error_bound(jit):
    """Relative error at most 1.02e-4 (the minimax fit's 1.013e-4) over the normal range
    the softmax reaches, exact at integers (p(0) = 1), and exactly 0 at and below -127:
    exp2(-inf) of a masked score must add nothing to a row's sum."""
    exp2 = jax.jit(fma_exp2.exp2_reference) if jit else fma_exp2.exp2_reference
    x = np.concatenate([np.linspace(-126.0, 60.0, 400_001), np.arange(-126, 61),
                        np.random.default_rng(0).uniform(-30, 1, 10_000)]).astype(np.float32)
    got = np.asarray(exp2(jnp.asarray(x)), np.float64)
    expected = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / expected - 1)) <= 1.02e-4
    integers = np.arange(-126, 61).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(exp2(jnp.asarray(integers))),
                                  np.exp2(integers))
    low = jnp.asarray([-jnp.inf, -1e30, -200.0, -127.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(exp2(low)), np.zeros(4, np.float32))
    # Between -127 and -126 the result is a denormal, never negative or NaN.
    tail = np.asarray(exp2(jnp.linspace(-127.0, -126.0, 1001, dtype=jnp.float32)))
    assert np.all(tail >= 0) and np.all(tail < 2.0 ** -125)


def test_no_share_is_the_transcendental_exp2():
    x = jnp.linspace(-20.0, 0.0, 257, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(fma_exp2.exp2(x, None)), np.asarray(jnp.exp2(x)))
    np.testing.assert_array_equal(np.asarray(fma_exp2.exp2(x, (0, 8))),
                                  np.asarray(jnp.exp2(x)))


def test_the_share_goes_to_head_dim_64_with_a_transcendental_score_mod_only():
    def program(score_mod):
        return make_mod_program(score_mod, SCORE)
    share = mosaic_eligibility.exp2_fma_share
    assert share(64, program(masks.tanh_softcap(30.0))) == (5, 8)
    assert share(64, program(lambda s, b, h, q, kv: s * jax.nn.sigmoid(s))) == (5, 8)
    assert share(64, None) is None
    assert share(64, program(masks.alibi(4))) is None
    assert share(128, program(masks.tanh_softcap(30.0))) is None
    assert share(96, program(masks.tanh_softcap(30.0))) is None
