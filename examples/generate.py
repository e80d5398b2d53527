"""Greedy generation with the decode cache of FlexMultiHeadAttention.

Trains the packed-document GPT of `train_gpt_packed` briefly, then continues several
prompts of different lengths together: one prefill call writes every prompt into the
cache (right-padded, with `input_lengths` saying how much of each row is real), then each
step decodes one token per row at that row's own position. Positions are traced arrays,
so no step recompiles.

The same generation then runs on a paged cache (`PagedKVCache`, pages read in place by
the kernels). Every generated token of both is checked against a reference without a
cache: the full causal forward of each row's whole sequence so far, at every step.

    python -m examples.generate                     # toy size, CPU
    python -m examples.generate --size large        # on a GPU
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_flex as pf
from examples import train_gpt_packed


@nnx.jit
def prefill(model, tokens, lengths):
    """Writes right-padded prompts [B, P] into the cache; logits [B, vocab] at each
    prompt's last real token."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = model(tokens, positions, mask_mod=pf.masks.causal_mask, decode=True,
                   input_lengths=lengths)
    return logits[jnp.arange(tokens.shape[0]), lengths - 1]


@nnx.jit
def decode_step(model, tokens, positions):
    """One new token per row, tokens and positions [B] -> logits [B, vocab]."""
    return model(tokens[:, None], positions[:, None], mask_mod=pf.masks.causal_mask,
                 decode=True)[:, 0]


def generate_cached(model, prompts, num_new_tokens, page_size=None):
    """Greedy continuation of each prompt through the decode cache -> int [B, new].
    page_size: None for the contiguous cache, else a PagedKVCache with pages this big."""
    lengths = np.array([len(prompt) for prompt in prompts], np.int32)
    padded = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, :len(prompt)] = prompt
    max_length = int(lengths.max()) + num_new_tokens
    if page_size is None:
        model.init_cache(len(prompts), max_length)
    else:
        model.init_paged_cache(len(prompts), max_length, page_size)
    next_tokens = jnp.argmax(prefill(model, jnp.asarray(padded), jnp.asarray(lengths)), -1)
    generated, positions = [next_tokens], jnp.asarray(lengths)
    # The module graph walked once for every step, not at each call (`nnx.cached_partial`).
    step = nnx.cached_partial(decode_step, model)
    for _ in range(num_new_tokens - 1):
        next_tokens = jnp.argmax(step(next_tokens, positions), -1)
        generated.append(next_tokens)
        positions = positions + 1
    return np.asarray(jnp.stack(generated, axis=1))


@nnx.jit
def last_logits_without_cache(model, tokens, lengths):
    """Full causal forward of right-padded sequences [B, L]; logits at each row's last
    real token (padding comes after it, so the causal mask hides it)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = model(tokens, positions, mask_mod=pf.masks.causal_mask)
    return logits[jnp.arange(tokens.shape[0]), lengths - 1]


def generate_without_cache(model, prompts, num_new_tokens):
    """The reference: greedy continuation recomputing the whole sequence every step."""
    lengths = np.array([len(prompt) for prompt in prompts], np.int32)
    sequences = np.zeros((len(prompts), lengths.max() + num_new_tokens), np.int32)
    for row, prompt in enumerate(prompts):
        sequences[row, :len(prompt)] = prompt
    rows = np.arange(len(prompts))
    for step in range(num_new_tokens):
        logits = last_logits_without_cache(model, jnp.asarray(sequences),
                                           jnp.asarray(lengths + step))
        sequences[rows, lengths + step] = np.asarray(jnp.argmax(logits, -1))
    return np.stack([sequences[row, lengths[row]:lengths[row] + num_new_tokens]
                     for row in rows])


def main(argv=None):
    """Trains, generates, checks; returns (generated, reference, expected, paged) int
    arrays [num_prompts, new_tokens]: cached, uncached, the true continuations, and the
    paged-cache generation."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    train_gpt_packed.add_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--page-size", type=int, default=4,
                        help="page size of the paged-cache generation")
    parser.set_defaults(steps=150, log_every=50)
    args = parser.parse_args(argv)
    config = train_gpt_packed.config_from_args(args)
    model, _ = train_gpt_packed.train(config, args.steps, seed=args.seed,
                                      log_every=args.log_every)

    rng = np.random.default_rng(args.seed + 1)
    prompt_lengths = (3, 7, 5, 10)
    if max(prompt_lengths) + args.new_tokens > config.seq_len:
        parser.error(f"--new-tokens {args.new_tokens}: prompts of up to {max(prompt_lengths)} "
                     f"tokens would run past the model's {config.seq_len} positions")
    documents = [train_gpt_packed.arithmetic_document(
        rng, length + args.new_tokens, config.vocab_size) for length in prompt_lengths]
    prompts = [document[:length] for document, length in zip(documents, prompt_lengths)]
    expected = np.stack([document[length:] for document, length
                         in zip(documents, prompt_lengths)])
    generated = generate_cached(model, prompts, args.new_tokens)
    paged = generate_cached(model, prompts, args.new_tokens, page_size=args.page_size)
    reference = generate_without_cache(model, prompts, args.new_tokens)
    for prompt, tokens, truth in zip(prompts, generated, expected):
        print(f"prompt {prompt.tolist()} -> {tokens.tolist()}"
              f"  ({int(np.sum(tokens == truth))}/{len(truth)} continue the progression)")
    if not np.array_equal(generated, reference):
        raise SystemExit("cached generation differs from the full-forward reference:\n"
                         f"{generated}\nvs\n{reference}")
    print("cached generation matches the full-forward reference token for token")
    if not np.array_equal(paged, reference):
        raise SystemExit("paged-cache generation differs from the full-forward reference:\n"
                         f"{paged}\nvs\n{reference}")
    print(f"paged-cache generation (pages of {args.page_size}) matches it too")
    return generated, reference, expected, paged


if __name__ == "__main__":
    main()
