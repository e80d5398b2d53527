"""`masks.row_reads.precompute_row_reads`: reads of captured arrays at one computed
position become reads of precomputed vectors, the mask unchanged everywhere, and the
Mosaic GPU kernels take the result where they refused the gather."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flex import context_parallel
from pallas_flex.kernels import mosaic_eligibility
from pallas_flex.masks.mod_program import MASK, make_mod_program
from pallas_flex.masks.row_reads import precompute_row_reads

LENGTH, DEVICES = 256, 2
SHARD = LENGTH // DEVICES
IDS = jnp.asarray(np.repeat(np.arange(5), [30, 70, 6, 100, 50]), jnp.int32)
BATCH_IDS = jnp.stack([IDS, IDS[::-1]])  # [2, LENGTH]: documents per batch row


def documents(b, h, q_idx, kv_idx):
    return (IDS[q_idx] == IDS[kv_idx]) & (q_idx >= kv_idx)


def per_batch_documents(b, h, q_idx, kv_idx):
    return (BATCH_IDS[b, q_idx] == BATCH_IDS[b, kv_idx]) & (q_idx >= kv_idx)


def every_element(program, batch=1):
    """[B, Sq, Skv] bool of the program at shard positions."""
    q_idx, kv_idx = jnp.arange(SHARD), jnp.arange(SHARD)
    rows = jax.vmap(lambda b, q: jax.vmap(lambda kv: program(b, 0, q, kv))(kv_idx),
                    (None, 0))
    return jax.vmap(lambda b: rows(b, q_idx))(jnp.arange(batch))


@pytest.mark.parametrize("layout", ["contiguous", "zig-zag", "striped"])
@pytest.mark.parametrize("mask_mod,batch", [(documents, 1), (per_batch_documents, 2)])
def test_a_mask_at_shard_positions_reads_vectors_and_is_unchanged(layout, mask_mod, batch):
    """The document mask at a shard pair's global positions (traced offsets, as context
    parallelism calls it): a gather the Mosaic kernels refuse, then plain reads of
    precomputed vectors that they take, equal on every element, for every pair."""
    @jax.jit
    def both(device, visiting):
        q_position = context_parallel._positions(device, SHARD, DEVICES, layout)
        kv_position = context_parallel._positions(visiting, SHARD, DEVICES, layout)
        program = make_mod_program(context_parallel._at_global_positions(
            mask_mod, q_position, kv_position, False), MASK)
        rewritten = precompute_row_reads(program, batch, 1, SHARD, SHARD)
        assert "gather" in mosaic_eligibility.mod_unsupported_reason(program)
        assert mosaic_eligibility.mod_unsupported_reason(rewritten) is None
        return every_element(program, batch), every_element(rewritten, batch)
    attended = 0
    for device in range(DEVICES):
        for visiting in range(DEVICES):
            before, after = both(jnp.int32(device), jnp.int32(visiting))
            np.testing.assert_array_equal(after, before)
            attended += int(jnp.sum(before))
    assert attended > 0


def test_programs_without_such_reads_are_returned_as_they_are():
    causal = make_mod_program(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, MASK)
    assert precompute_row_reads(causal, 1, 1, 8, 8) is causal
    pairs = make_mod_program(lambda b, h, q_idx, kv_idx: IDS[q_idx + kv_idx] > 2, MASK)
    assert precompute_row_reads(pairs, 1, 1, 8, 8) is pairs  # reads at both positions
    assert precompute_row_reads(None, 1, 1, 8, 8) is None
    plain = make_mod_program(documents, MASK)  # already a read at q_idx / kv_idx
    rewritten = precompute_row_reads(plain, 1, 1, LENGTH, LENGTH)
    assert mosaic_eligibility.mod_unsupported_reason(rewritten) is None


def test_whole_array_arithmetic_that_meets_one_position_is_precomputed():
    """`jnp.max(limits) - q_idx` (a reduction of a captured array, then one position),
    which the tile interpreter cannot run, becomes a row vector read at q_idx: the mask
    then runs on the kernels (interpret backend) and equals the reference."""
    import pallas_flex as pf
    limits = jnp.arange(LENGTH, dtype=jnp.int32) // 2

    def max_limit_mask(b, h, q_idx, kv_idx):
        return kv_idx <= jnp.max(limits) - q_idx
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(key, (1, LENGTH, 2, 32), jnp.float32) for key in keys)
    options = {"block_q": 64, "block_kv": 64}
    np.testing.assert_allclose(
        pf.attention(q, k, v, mask_mod=max_limit_mask, backend="interpret",
                     kernel_options=options),
        pf.attention(q, k, v, mask_mod=max_limit_mask, backend="reference"),
        atol=2e-5, rtol=2e-5)


def test_reads_inside_calls_and_of_several_arrays_are_found():
    """The mod's jnp functions under `jit` are inlined first; two arrays, both positions,
    each read through its own arithmetic."""
    starts = jnp.asarray([0, 30, 100, 106, 206], jnp.int32)

    @jax.jit
    def document_of(position):
        return jnp.searchsorted(starts, position, side="right") - 1

    def mask_mod(b, h, q_idx, kv_idx):
        return (document_of(2 * q_idx) == IDS[kv_idx // 2]) | (q_idx == kv_idx)
    program = make_mod_program(mask_mod, MASK)
    rewritten = precompute_row_reads(program, 1, 1, SHARD, LENGTH)
    assert mosaic_eligibility.mod_unsupported_reason(program) is not None
    assert mosaic_eligibility.mod_unsupported_reason(rewritten) is None
    grid = jax.vmap(lambda q: jax.vmap(lambda kv: (program(0, 0, q, kv),
                                                   rewritten(0, 0, q, kv)))(
        jnp.arange(LENGTH)))(jnp.arange(SHARD))
    np.testing.assert_array_equal(grid[1], grid[0])
    assert 0 < int(jnp.sum(grid[0])) < SHARD * LENGTH


def test_the_entry_points_rewrite_only_masks_the_mosaic_kernels_refuse():
    """`dispatch.mask_for_kernels`: a mask already run by the Mosaic kernels is kept as it
    is; one reading at a computed position is rewritten; and `pf.attention` with it
    equals the dense reference."""
    from pallas_flex import dispatch
    import pallas_flex as pf
    plain = make_mod_program(documents, MASK)
    assert dispatch.mask_for_kernels(plain, 1, 1, LENGTH, LENGTH) is plain

    def halves(b, h, q_idx, kv_idx):  # two queries per document position
        return (IDS[q_idx // 2] == IDS[kv_idx]) & (q_idx // 2 >= kv_idx)
    program = make_mod_program(halves, MASK)
    rewritten = dispatch.mask_for_kernels(program, 1, 1, 2 * LENGTH, LENGTH)
    assert rewritten is not program
    assert mosaic_eligibility.mod_unsupported_reason(rewritten) is None
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 2 * LENGTH, 2, 32), jnp.float32)
    k, v = (jax.random.normal(key, (1, LENGTH, 2, 32), jnp.float32) for key in keys[1:])
    np.testing.assert_allclose(
        pf.attention(q, k, v, mask_mod=halves, backend="xla"),
        pf.attention(q, k, v, mask_mod=halves, backend="reference"), atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
def test_a_mask_read_at_computed_positions_runs_on_the_mosaic_kernels_on_the_gpu():
    """On Hopper: `pf.explain` names the Mosaic forward and backward for the `halves`
    mask, and bf16 outputs and gradients agree with the float32 reference."""
    import pallas_flex as pf

    def halves(b, h, q_idx, kv_idx):
        return (IDS[q_idx // 2] == IDS[kv_idx]) & (q_idx // 2 >= kv_idx)
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (2, 2 * LENGTH, 4, 128), jnp.float32)
    k, v = (jax.random.normal(key, (2, LENGTH, 2, 128), jnp.float32) for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    text = pf.explain(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask_mod=halves)
    assert "forward: mosaic_forward" in text and "backward: mosaic_backward" in text, text

    def loss(attend, dtype):
        def f(q, k, v):
            out = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype))
            return jnp.sum(out.astype(jnp.float32) * d_out), out
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(loss(lambda q, k, v: pf.attention(
        q, k, v, mask_mod=halves), jnp.bfloat16))(q, k, v)
    (_, want), want_grads = jax.jit(loss(lambda q, k, v: pf.attention(
        q, k, v, mask_mod=halves, backend="reference"), jnp.float32))(q, k, v)
    for got, expected in zip((out, *grads), (want, *want_grads)):
        scale = float(jnp.max(jnp.abs(expected)))
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - expected))) < 2e-2 * scale
