"""The examples run at toy size: training lowers the loss, cached generation matches the
full-forward reference token for token."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallas_flex as pf
from examples import generate, train_gpt_packed


def _import_pallas_interpreter():
    """The first Pallas interpret-mode call in a process imports JAX's interpreter, which
    registers a config option that is part of every jit cache key, so the first training
    step would compile twice. A tiny call first keeps that one-off out of the example's
    time (see tests/test_recompilation.py)."""
    q = jnp.ones((1, 16, 1, 8))
    pf.attention(q, q, q, backend="interpret").block_until_ready()


def test_training_lowers_the_loss_and_cached_generation_matches_reference(capsys):
    _import_pallas_interpreter()
    # One layer: the same code as the toy's two, at half the compile time.
    steps = ["--steps", "30", "--log-every", "10", "--num-layers", "1"]
    losses = train_gpt_packed.main(steps)
    assert len(losses) == 30 and np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])

    # Same toy config, so the jitted training step compiled above is reused.
    generated, reference, expected, paged = generate.main(steps + ["--new-tokens", "6"])
    np.testing.assert_array_equal(generated, reference)
    np.testing.assert_array_equal(paged, reference)
    assert generated.shape == expected.shape == (4, 6)
    assert "matches the full-forward reference" in capsys.readouterr().out


def test_continuous_batching_serves_every_request_like_the_uncached_model(capsys):
    """Requests arriving over time, prompts prefilled in chunks next to decode steps,
    blocks taken and freed: every request's greedy tokens equal the uncached model's."""
    from examples import serve_continuous

    _import_pallas_interpreter()
    steps = ["--steps", "30", "--log-every", "10", "--num-layers", "1"]  # as above
    requests, figures = serve_continuous.main(steps + ["--requests", "6"])
    assert [len(r.output) for r in requests] == [r.max_new_tokens for r in requests]
    assert all(not r.blocks for r in requests)
    # More tokens than one step's budget in flight at once: chunked prefill happened.
    assert sum(len(r.prompt) for r in requests) > 16
    assert figures["generated_tokens"] == sum(r.max_new_tokens for r in requests)
    assert figures["tokens_per_second"] > 0 and figures["time_per_output_token_ms"] > 0
    # Requests came and went, prefill chunks and decodes mixed: one compiled step served all.
    assert figures["step_compilations"] == 1
    assert "every request matches the uncached reference" in capsys.readouterr().out
