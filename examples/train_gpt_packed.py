"""Train a small GPT on packed documents with FlexMultiHeadAttention.

Several documents share each training row ("packing"); attention must stay inside each
document and be causal within it. That is one mask_mod,
`pf.masks.document(pf.masks.causal_mask, document_ids)`: its BlockMask is built once per
batch and reused by every layer, and the blocks between different documents are never
computed.

The data are synthetic: each document is `BOS, a, a+d, a+2d, ...` (mod the vocabulary)
for a random start `a` and step `d`, so after two tokens the rest is predictable and the
loss visibly falls.

    python -m examples.train_gpt_packed                  # toy size: seconds on a CPU
    python -m examples.train_gpt_packed --size large     # a GPU-sized model, bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pallas_flex as pf
from pallas_flex.nn import FlexMultiHeadAttention

BOS = 0


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int  # training row length; also the number of learned positions
    features: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    batch_size: int
    min_document: int  # document lengths (BOS included) are drawn from [min, max]
    max_document: int
    learning_rate: float
    dtype: str = "float32"
    backend: str | None = None  # None: pallas_flex's default for the device


SIZES = {
    "toy": GPTConfig(vocab_size=32, seq_len=64, features=64, num_heads=4, num_kv_heads=2,
                     num_layers=2, batch_size=8, min_document=6, max_document=24,
                     learning_rate=3e-3),
    "large": GPTConfig(vocab_size=512, seq_len=4096, features=1024, num_heads=16,
                       num_kv_heads=4, num_layers=8, batch_size=8, min_document=64,
                       max_document=1024, learning_rate=3e-4, dtype="bfloat16"),
}


class Block(nnx.Module):
    """Pre-norm transformer block: attention, then an MLP."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.attention_norm = nnx.RMSNorm(config.features, dtype=dtype, rngs=rngs)
        self.attention = FlexMultiHeadAttention(
            config.num_heads, config.features, num_kv_heads=config.num_kv_heads,
            use_bias=False, dtype=dtype, backend=config.backend, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(config.features, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(config.features, 4 * config.features, use_bias=False,
                                 dtype=dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * config.features, config.features, use_bias=False,
                                  dtype=dtype, rngs=rngs)

    def __call__(self, x, **attention_options):
        x = x + self.attention(self.attention_norm(x), **attention_options)
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class GPT(nnx.Module):
    """Decoder-only transformer; the output projection is the token embedding's transpose.

    `attention_options` are passed to every layer's `FlexMultiHeadAttention`: a shared
    `block_mask` for training, or `mask_mod`, `decode=True` and `input_lengths` for
    cached generation.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.token_embedding = nnx.Embed(config.vocab_size, config.features, dtype=dtype,
                                         rngs=rngs)
        self.position_embedding = nnx.Embed(config.seq_len, config.features, dtype=dtype,
                                            rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.features, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, positions, **attention_options):
        """tokens, positions: int [B, S] -> logits float32 [B, S, vocab_size]."""
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x, **attention_options)
        return self.token_embedding.attend(self.final_norm(x)).astype(jnp.float32)

    def init_cache(self, batch_size: int, max_length: int):
        for block in self.blocks:
            block.attention.init_cache(batch_size, max_length)

    def init_paged_cache(self, batch_size: int, max_length: int, page_size: int):
        """A paged cache per layer, with pages for every row's max_length tokens (a
        server would share one pool among more requests than fit at once)."""
        pages_per_row = -(-max_length // page_size)
        for block in self.blocks:
            block.attention.init_paged_cache(batch_size * pages_per_row, page_size,
                                             batch_size, pages_per_row)


def arithmetic_document(rng: np.random.Generator, length: int, vocab_size: int) -> np.ndarray:
    """[BOS, a, a+d, a+2d, ...] over the tokens 1..vocab_size-1; `length` tokens."""
    start, step = rng.integers(0, vocab_size - 1), rng.integers(1, 5)
    body = (start + step * np.arange(length - 1)) % (vocab_size - 1) + 1
    return np.concatenate([[BOS], body])


def packed_batch(rng: np.random.Generator, config: GPTConfig):
    """Rows of `seq_len + 1` tokens filled with whole documents (the last one cut).

    Returns tokens, document_ids int32 [B, seq_len + 1] (ids count documents from 0 in
    each row) and positions int32 [B, seq_len + 1] (counted from each document's start).
    """
    row_length = config.seq_len + 1
    tokens = np.zeros((config.batch_size, row_length), np.int32)
    document_ids = np.zeros_like(tokens)
    positions = np.zeros_like(tokens)
    for row in range(config.batch_size):
        filled, document = 0, 0
        while filled < row_length:
            length = rng.integers(config.min_document, config.max_document + 1)
            piece = arithmetic_document(rng, length, config.vocab_size)[:row_length - filled]
            span = slice(filled, filled + len(piece))
            tokens[row, span] = piece
            document_ids[row, span] = document
            positions[row, span] = np.arange(len(piece))
            filled, document = filled + len(piece), document + 1
    return tokens, document_ids, positions


def packed_loss(model: GPT, tokens, document_ids, positions):
    """Next-token cross-entropy over one packed batch of `seq_len + 1`-token rows.

    A target that starts a new document (its BOS) is not predictable from the previous
    document and is left out of the mean.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    input_documents = document_ids[:, :-1]
    batch, length = inputs.shape
    # Built once here, used by every layer: the document wrapper restarts the causal mask
    # at each document start.
    mask_mod = pf.masks.document(pf.masks.causal_mask, input_documents)
    block_mask = pf.create_block_mask(mask_mod, batch, None, length, length)
    logits = model(inputs, positions[:, :-1], block_mask=block_mask)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weights = (document_ids[:, 1:] == input_documents).astype(jnp.float32)
    return jnp.sum(losses * weights) / jnp.sum(weights)


@nnx.jit
def train_step(model: GPT, optimizer: nnx.Optimizer, tokens, document_ids, positions):
    loss, gradients = nnx.value_and_grad(packed_loss)(model, tokens, document_ids, positions)
    optimizer.update(model, gradients)
    return loss


@functools.cache
def optimizer_transform(learning_rate: float) -> optax.GradientTransformation:
    """One transform object per learning rate: nnx.jit keys its cache on the optimizer's
    (static) transform, so a fresh optax object would recompile `train_step`."""
    return optax.adamw(learning_rate)


def train(config: GPTConfig, steps: int, *, seed: int = 0, log_every: int = 10,
          print_fn=print):
    """Trains a fresh GPT for `steps` steps; returns (model, losses)."""
    model = GPT(config, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optimizer_transform(config.learning_rate), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        batch = (jnp.asarray(array) for array in packed_batch(rng, config))
        losses.append(float(train_step(model, optimizer, *batch)))
        if step % log_every == 0 or step == steps - 1:
            print_fn(f"step {step:5d}  loss {losses[-1]:.4f}  "
                     f"({time.perf_counter() - start:.1f} s)")
    return model, losses


def config_from_args(args) -> GPTConfig:
    config = SIZES[args.size]
    overrides = {name: getattr(args, name)
                 for name in ("batch_size", "seq_len", "num_layers", "backend")
                 if getattr(args, name) is not None}
    return dataclasses.replace(config, **overrides)


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--size", choices=sorted(SIZES), default="toy",
                        help="model/data preset (toy: CPU seconds; large: a GPU)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--backend", choices=pf.BACKENDS,
                        help="pallas_flex backend (default: best for the device)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)


def main(argv=None):
    """Trains and returns the list of per-step losses."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    print(f"{args.size}: {config}  on {jax.devices()[0].device_kind}")
    _, losses = train(config, args.steps, seed=args.seed, log_every=args.log_every)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
