"""Continuous batching over the ragged paged-attention op, as a vLLM-style server does it.

Requests arrive over time with prompts of different lengths. Every step packs the
tokens of all running sequences into one flat batch — one new token for each sequence
that is decoding, a chunk of the prompt for each that is still prefilling (chunked
prefill, within a token budget) — and runs the model once: every layer calls
`pf.paged.paged_attention` (the OpenVINO-spec op), which writes the step's keys and
values into that layer's paged caches and attends to each sequence's history through its
block list. Cache blocks are taken from a free list as sequences grow and returned when
they finish, so a finished request's memory serves the next one at once.

The step has fixed shapes (a token budget, a number of sequence slots, a block list per
slot): requests come and go without recompiling. Unused token slots belong to a padding
sequence with blocks of its own; unused sequence slots have no tokens and no blocks.

Every request's greedy continuation is checked against a model run without any cache
(the full causal forward of its whole sequence at each step, `examples.generate`).

    python -m examples.serve_continuous                 # toy size, CPU
    python -m examples.serve_continuous --size large    # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_flex as pf
from examples import generate, train_gpt_packed


@dataclasses.dataclass(eq=False)  # requests are compared by identity
class Request:
    prompt: np.ndarray
    max_new_tokens: int
    arrival_step: int
    prefilled: int = 0                     # prompt tokens already in the cache
    blocks: list = dataclasses.field(default_factory=list)
    output: list = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    arrival_time: float | None = None

    @property
    def cached(self):
        """Positions in the cache: the prefilled prompt, then every output token but
        the newest (it is fed in the next step)."""
        return self.prefilled + max(0, len(self.output) - 1)

    @property
    def done(self):
        return len(self.output) >= self.max_new_tokens


def packed_step(structure, weights, caches, tokens, positions, metadata, backend=None):
    """One forward pass over the packed tokens [T] of all running sequences: every
    layer's attention is the ragged op on that layer's paged caches (donated: updated in
    place). Returns each token's greedy next token [T] (the host keeps those at the ends
    of the sequences' chunks: one fixed-shape transfer a step) and the updated caches.

    The model comes split (`nnx.split`, once, by the server): its `structure` (the
    state's treedef and the graphdef) bound into the jitted step (`Server.__init__`),
    its weights a flat list of arrays. `nnx.jit` would walk the module graph on the host
    at every call, a static graphdef would be hashed at every call, and an `nnx.State`
    argument is flattened in Python at every call: 6.4, 0.9 and ~0.2 ms a step for the
    toy model on a CPU, more than its step, which a server calling the model every few
    milliseconds cannot afford."""
    state_tree, graphdef = structure
    model = nnx.merge(graphdef, jax.tree.unflatten(state_tree, weights))
    x = model.token_embedding(tokens) + model.position_embedding(positions)  # [T, F]
    updated = []
    for block, (key_cache, value_cache) in zip(model.blocks, caches):
        attention = block.attention
        h = block.attention_norm(x)
        query, key, value = attention.query(h), attention.key(h), attention.value(h)
        out, key_cache, value_cache = pf.paged.paged_attention(
            query.reshape(tokens.shape[0], -1), key.reshape(tokens.shape[0], -1),
            value.reshape(tokens.shape[0], -1), key_cache, value_cache, *metadata,
            backend=backend)
        x = x + attention.out(out.reshape(query.shape))
        x = x + block.mlp_out(nnx.gelu(block.mlp_in(block.mlp_norm(x))))
        updated.append((key_cache, value_cache))
    logits = model.token_embedding.attend(model.final_norm(x)).astype(jnp.float32)
    return jnp.argmax(logits, axis=-1), updated


class Server:
    """A scheduler and block allocator around `packed_step`."""

    def __init__(self, model, config, *, num_blocks, block_size, token_budget, max_seqs,
                 max_blocks_per_seq, backend=None):
        self.block_size, self.backend = block_size, backend
        graphdef, state = nnx.split(model)  # once: `packed_step` takes the model split
        self.weights, state_tree = jax.tree.flatten(state)
        self.step_fn = jax.jit(functools.partial(packed_step, (state_tree, graphdef)),
                               static_argnames=("backend",), donate_argnames=("caches",))
        self.token_budget, self.max_seqs = token_budget, max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        attention = model.blocks[0].attention
        shape = (num_blocks, attention.num_kv_heads, block_size, attention.head_dim)
        dtype = jnp.dtype(config.dtype)
        self.caches = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                       for _ in model.blocks]
        # The padding sequence's blocks (it owns the unused token slots) are never freed.
        padding_blocks = -(-token_budget // block_size)
        self.padding_blocks = list(range(padding_blocks))
        self.free = list(range(padding_blocks, num_blocks))
        self.waiting, self.running, self.finished = [], [], []
        self.steps = 0

    def _blocks_needed(self, request, new_tokens):
        return -(-(request.cached + new_tokens) // self.block_size) - len(request.blocks)

    def _schedule(self):
        """[(request, tokens this step)]: every decoding sequence one token, then prompt
        chunks while the budget, the sequence slots and the free blocks last."""
        batch, budget = [], self.token_budget
        reserved = 0  # blocks the decodes below take
        for request in self.running:
            if request.prefilled == len(request.prompt) and budget:
                needed = self._blocks_needed(request, 1)
                if reserved + needed > len(self.free):
                    continue  # no block for its next token: it waits for one to free
                batch.append((request, 1))
                budget -= 1
                reserved += needed
        for request in self.running + self.waiting:
            if len(batch) == self.max_seqs or not budget:
                break
            remaining = len(request.prompt) - request.prefilled
            if remaining == 0:
                continue
            chunk = min(remaining, budget)
            needed = self._blocks_needed(request, chunk)
            if reserved + needed > len(self.free):
                continue
            batch.append((request, chunk))
            budget -= chunk
            reserved += needed
            if request in self.waiting:
                self.waiting.remove(request)
                self.running.append(request)
        for request, new_tokens in batch:  # grow the block lists
            for _ in range(self._blocks_needed(request, new_tokens)):
                request.blocks.append(self.free.pop())
        return batch

    def _metadata(self, batch):
        """Fixed-shape token and metadata arrays of a scheduled batch."""
        tokens = np.zeros(self.token_budget, np.int32)
        positions = np.zeros(self.token_budget, np.int32)
        past_lens = np.zeros(self.max_seqs + 1, np.int32)
        begins = np.zeros(self.max_seqs + 2, np.int32)
        block_indices = np.zeros(self.max_seqs * self.max_blocks_per_seq
                                 + len(self.padding_blocks), np.int32)
        block_begins = np.zeros(self.max_seqs + 2, np.int32)
        token, listed = 0, 0
        for slot, (request, new_tokens) in enumerate(batch):
            past = request.cached
            if request.prefilled < len(request.prompt):
                chunk = request.prompt[request.prefilled:request.prefilled + new_tokens]
            else:
                chunk = np.asarray(request.output[-1:])
            tokens[token:token + new_tokens] = chunk
            positions[token:token + new_tokens] = past + np.arange(new_tokens)
            past_lens[slot] = past
            block_indices[listed:listed + len(request.blocks)] = request.blocks
            token, listed = token + new_tokens, listed + len(request.blocks)
            begins[slot + 1], block_begins[slot + 1] = token, listed
        for slot in range(len(batch), self.max_seqs):  # empty slots
            begins[slot + 1], block_begins[slot + 1] = token, listed
        # The last slot: the padding sequence, owner of the unused tokens.
        positions[token:] = np.arange(self.token_budget - token)
        block_indices[listed:listed + len(self.padding_blocks)] = self.padding_blocks
        begins[-1], block_begins[-1] = self.token_budget, listed + len(self.padding_blocks)
        # NumPy arrays: the jitted step moves them to the device in its own dispatch.
        return tokens, positions, (past_lens, begins, block_indices, block_begins)

    def step(self, now):
        batch = self._schedule()
        if not batch:
            return 0
        tokens, positions, metadata = self._metadata(batch)
        greedy, self.caches = self.step_fn(self.weights, self.caches, tokens, positions,
                                           metadata, backend=self.backend)
        last = np.cumsum([new_tokens for _, new_tokens in batch]) - 1
        next_tokens = np.asarray(greedy)[last]
        now = time.perf_counter()
        generated = 0
        for (request, new_tokens), token in zip(batch, next_tokens):
            was_prefilling = request.prefilled < len(request.prompt)
            if was_prefilling:
                request.prefilled += new_tokens
                if request.prefilled < len(request.prompt):
                    continue  # a chunk in the middle of the prompt: nothing sampled yet
                request.first_token_time = now
            request.output.append(int(token))
            generated += 1
            if request.done:
                request.finish_time = now
                self.running.remove(request)
                self.free.extend(request.blocks)
                request.blocks = []
                self.finished.append(request)
        self.steps += 1
        return generated

    def run(self, requests):
        """Serves `requests` (arriving at their `arrival_step`) to completion; returns
        the wall time."""
        pending = sorted(requests, key=lambda r: r.arrival_step)
        start = time.perf_counter()
        step = 0
        while pending or self.waiting or self.running:
            while pending and pending[0].arrival_step <= step:
                request = pending.pop(0)
                request.arrival_time = time.perf_counter()
                self.waiting.append(request)
            self.step(time.perf_counter())
            step += 1
        jax.block_until_ready(self.caches)
        return time.perf_counter() - start


def make_requests(rng, config, count, max_prompt, max_new):
    """Arithmetic-progression prompts (the model's training data) of random lengths,
    arriving a few steps apart; returns (requests, their true continuations)."""
    requests, truths = [], []
    for index in range(count):
        prompt_len = int(rng.integers(2, max_prompt + 1))
        new_tokens = int(rng.integers(2, max_new + 1))
        document = train_gpt_packed.arithmetic_document(rng, prompt_len + new_tokens,
                                                        config.vocab_size)
        requests.append(Request(document[:prompt_len], new_tokens, arrival_step=2 * index))
        truths.append(document[prompt_len:])
    return requests, truths


def main(argv=None):
    """Trains, serves, checks; returns the finished requests (their `output`s equal the
    uncached reference's tokens) and a dict of figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    train_gpt_packed.add_arguments(parser)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-prompt", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=48)
    parser.add_argument("--token-budget", type=int, default=16,
                        help="tokens packed into one step (decodes first, then prompt chunks)")
    parser.add_argument("--max-seqs", type=int, default=4, help="sequences in one step")
    parser.set_defaults(steps=150, log_every=50)
    args = parser.parse_args(argv)
    config = train_gpt_packed.config_from_args(args)
    if args.max_prompt + args.max_new_tokens > config.seq_len:
        parser.error(f"--max-prompt + --max-new-tokens must fit the model's {config.seq_len} "
                     "positions")
    model, _ = train_gpt_packed.train(config, args.steps, seed=args.seed,
                                      log_every=args.log_every)
    rng = np.random.default_rng(args.seed + 2)
    requests, truths = make_requests(rng, config, args.requests, args.max_prompt,
                                     args.max_new_tokens)
    server = Server(model, config, num_blocks=args.num_blocks, block_size=args.block_size,
                    token_budget=args.token_budget, max_seqs=args.max_seqs,
                    max_blocks_per_seq=-(-(args.max_prompt + args.max_new_tokens)
                                         // args.block_size),
                    backend=config.backend)
    # A first run compiles the step; the timed run serves the same requests again.
    # The scheduler builds the metadata itself: the op's traced checks (host callbacks
    # that take the step off JAX's fast dispatch) are left out, as a server would.
    with pf.paged.traced_checks(False):
        server.run([dataclasses.replace(r, output=[], blocks=[]) for r in requests[:2]])
        server.finished, server.steps = [], 0
        seconds = server.run(requests)

    generated = sum(len(r.output) for r in requests)
    per_output_token = [(r.finish_time - r.first_token_time) / (len(r.output) - 1)
                        for r in requests if len(r.output) > 1]
    figures = dict(requests=len(requests), steps=server.steps, generated_tokens=generated,
                   seconds=seconds, tokens_per_second=generated / seconds,
                   time_per_output_token_ms=1e3 * float(np.mean(per_output_token)),
                   time_to_first_token_ms=1e3 * float(np.mean(
                       [r.first_token_time - r.arrival_time for r in requests])),
                   # Programs the step compiled for both runs (fixed shapes: one).
                   step_compilations=server.step_fn._cache_size())
    mismatches = []
    # One uncached reference for all prompts (right-padded together), cut per request:
    # a greedy continuation's first tokens do not depend on how many follow.
    references = generate.generate_without_cache(model, [r.prompt for r in requests],
                                                 args.max_new_tokens)
    for request, truth, reference in zip(requests, truths, references):
        reference = reference[:request.max_new_tokens]
        correct = int(np.sum(np.asarray(request.output) == truth))
        print(f"prompt {request.prompt.tolist()} -> {request.output}  "
              f"({correct}/{len(truth)} continue the progression)")
        if request.output != reference.tolist():
            mismatches.append((request.prompt.tolist(), request.output, reference.tolist()))
    print(f"{figures['requests']} requests, {figures['generated_tokens']} tokens in "
          f"{figures['steps']} steps: {figures['tokens_per_second']:.1f} tokens/s, "
          f"{figures['time_per_output_token_ms']:.2f} ms per output token, "
          f"{figures['time_to_first_token_ms']:.2f} ms to the first token")
    if mismatches:
        raise SystemExit(f"continuous batching differs from the uncached reference: "
                         f"{mismatches}")
    print("every request matches the uncached reference token for token; all "
          f"{args.num_blocks - len(server.padding_blocks)} blocks free again: "
          f"{len(server.free) == args.num_blocks - len(server.padding_blocks)}")
    return requests, figures


if __name__ == "__main__":
    main()
