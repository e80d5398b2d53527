"""paged_attention against the independent float64 NumPy reference, its cache writes,
jit/donation/checkify behaviour, and every bad-argument error."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_flex import paged
from pallas_flex.kernels import ragged_paged as ragged_kernel
from pallas_flex.masks import alibi_slopes
from pallas_flex.paged.quantize import quantize
from tests.conftest import FLOAT32_TOLERANCE, dense_low_precision, rmse
from tests.paged.ragged_reference import reference_paged_attention, to_float64

# (past_len, new_len) per sequence: prefill from scratch, decode steps, chunked prefill
# on top of history, sequences with no new tokens, and a prompt spanning several pages.
MIX_PAGE_4 = [(0, 5), (7, 1), (10, 6), (3, 0), (0, 1), (13, 3), (4, 1)]
MIX_PAGE_16 = [(0, 19), (21, 1), (33, 4), (0, 1), (16, 0), (40, 1)]

CONFIGS = {
    "mha_f32_page4": dict(seqs=MIX_PAGE_4, block_size=4, q_heads=2, kv_heads=2, head_dim=8,
                          value_dim=8, dtype=jnp.float32),
    "gqa_dv_f32_page16": dict(seqs=MIX_PAGE_16, block_size=16, q_heads=4, kv_heads=2,
                              head_dim=8, value_dim=12, dtype=jnp.float32),
    "mqa_bf16_page4": dict(seqs=MIX_PAGE_4, block_size=4, q_heads=4, kv_heads=1, head_dim=16,
                           value_dim=8, dtype=jnp.bfloat16),
    "gqa_bf16_page16": dict(seqs=MIX_PAGE_16, block_size=16, q_heads=4, kv_heads=2,
                            head_dim=16, value_dim=16, dtype=jnp.bfloat16),
}

# Options are traced values: they share each configuration's compiled program.
OPTIONS = {
    "plain": lambda q_heads: {},
    "sliding_window": lambda q_heads: dict(sliding_window=5),
    "alibi_per_head": lambda q_heads: dict(alibi_slopes=alibi_slopes(q_heads)),
    "alibi_shared": lambda q_heads: dict(alibi_slopes=jnp.array([0.3], jnp.float32)),
    "scale_window_alibi": lambda q_heads: dict(scale=0.7, sliding_window=3,
                                               alibi_slopes=alibi_slopes(q_heads) * 4),
}


def make_case(seed, seqs, *, block_size, q_heads, kv_heads, head_dim, value_dim, dtype,
              spare_blocks=3):
    """Arguments of a paged_attention call: random history in shuffled, non-contiguous
    blocks (every other sequence listed with one block more than it needs), random new
    tokens, and unused blocks holding random data too. The shapes depend only on `seqs`
    and the sizes, so cases of one configuration share a compiled program."""
    rng = np.random.default_rng(seed)
    past_lens = np.array([past for past, _ in seqs], np.int32)
    new_lens = np.array([new for _, new in seqs], np.int32)
    counts = [math.ceil((past + new) / block_size) + s % 2 for s, (past, new) in enumerate(seqs)]
    num_blocks = sum(counts) + spare_blocks
    block_indices = rng.permutation(num_blocks)[:sum(counts)].astype(np.int32)
    block_indices_begins = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    subsequence_begins = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    num_tokens = int(new_lens.sum())

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    return dict(
        query=normal(num_tokens, q_heads * head_dim),
        key=normal(num_tokens, kv_heads * head_dim),
        value=normal(num_tokens, kv_heads * value_dim),
        key_cache=normal(num_blocks, kv_heads, block_size, head_dim),
        value_cache=normal(num_blocks, kv_heads, block_size, value_dim),
        past_lens=jnp.asarray(past_lens), subsequence_begins=jnp.asarray(subsequence_begins),
        block_indices=jnp.asarray(block_indices),
        block_indices_begins=jnp.asarray(block_indices_begins))


def snapshot(case):
    return {name: np.array(to_float64(x)) for name, x in case.items()}


def dense_bf16_baseline(case, q_heads, kv_heads, head_dim, scale=None, sliding_window=0,
                        alibi_slopes=None):
    """The dense XLA computation in the inputs' dtype, one padded batch row per sequence:
    the accuracy bar for 16-bit outputs (tests/conftest.py). Returns [T, Hq * Dv]."""
    _, expected_cache_k, expected_cache_v = reference_paged_attention(**case)[1:]
    past = np.asarray(case["past_lens"])
    begins = np.asarray(case["subsequence_begins"])
    block_begins = np.asarray(case["block_indices_begins"])
    block_indices = np.asarray(case["block_indices"])
    new = np.diff(begins)
    block_size = expected_cache_k.shape[2]
    num_seqs, max_new, max_context = len(past), max(new.max(), 1), max((past + new).max(), 1)
    dtype = case["query"].dtype
    query = to_float64(case["query"]).reshape(-1, q_heads, head_dim)
    q = np.zeros((num_seqs, max_new, q_heads, head_dim))
    k = np.zeros((num_seqs, max_context, kv_heads, head_dim))
    v = np.zeros((num_seqs, max_context, kv_heads, expected_cache_v.shape[3]))
    for s in range(num_seqs):
        q[s, :new[s]] = query[begins[s]:begins[s + 1]]
        for p in range(past[s] + new[s]):
            block = block_indices[block_begins[s] + p // block_size]
            k[s, p] = expected_cache_k[block, :, p % block_size]
            v[s, p] = expected_cache_v[block, :, p % block_size]
    past_j = jnp.asarray(past)
    slopes = jnp.broadcast_to(jnp.zeros(1) if alibi_slopes is None else alibi_slopes, (q_heads,))

    def mask_mod(b, h, q_idx, kv_idx):
        position = past_j[b] + q_idx
        visible = kv_idx <= position
        if sliding_window > 0:
            visible &= kv_idx > position - sliding_window
        return visible

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - past_j[b] - q_idx)

    out = dense_low_precision(*(jnp.asarray(x, jnp.float32).astype(dtype) for x in (q, k, v)),
                              mask_mod=mask_mod, score_mod=score_mod, scale=scale)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    return np.concatenate([out[s, :new[s]].reshape(new[s], out.shape[2] * out.shape[3])
                           for s in range(num_seqs)])


def assert_output_close(out, expected, case, config, options):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert out.shape == expected.shape
    assert np.isfinite(out).all()
    if config["dtype"] == jnp.float32:
        np.testing.assert_allclose(out, expected, atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)
        return
    baseline = dense_bf16_baseline(case, config["q_heads"], config["kv_heads"],
                                   config["head_dim"], **options)
    ours, theirs = rmse(out, expected), rmse(baseline, expected)
    assert ours <= theirs, f"RMSE {ours:.3g} worse than dense {config['dtype']} XLA's {theirs:.3g}"


def assert_caches_exact(key_cache, value_cache, expected_k, expected_v):
    """The returned caches equal the reference's insertion bit for bit: new tokens at
    their slots, every other slot (history, spare blocks) unchanged."""
    dtype = key_cache.dtype
    for got, want in ((key_cache, expected_k), (value_cache, expected_v)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(jnp.asarray(want, jnp.float32).astype(dtype)
                                                 .astype(jnp.float32)))


def case_config(name):
    config = dict(CONFIGS[name])
    seqs = config.pop("seqs")
    return config, seqs


# The XLA loop and the Pallas kernel (interpreted on CPU; compiled on the GPU machine).
RAGGED_BACKENDS = ["xla", "interpret", pytest.param("pallas", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend", RAGGED_BACKENDS)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("config_name", CONFIGS)
def test_matches_reference(config_name, option, backend):
    config, seqs = case_config(config_name)
    case = make_case(0, seqs, **config)
    before = snapshot(case)
    options = OPTIONS[option](config["q_heads"])
    out, key_cache, value_cache = paged.paged_attention(**case, **options, backend=backend)
    expected, _, expected_k, expected_v = reference_paged_attention(**case, **options)
    assert out.dtype == config["dtype"]
    assert_output_close(out, expected, case, config, options)
    assert_caches_exact(key_cache, value_cache, expected_k, expected_v)
    for name, value in snapshot(case).items():  # inputs are not mutated
        np.testing.assert_array_equal(value, before[name], err_msg=name)


# Long histories, so that work items span several 64-position kernel tiles: decode
# steps, chunked prefill on history, a prompt from scratch, no new tokens.
MIX_LONG = [(300, 1), (190, 5), (0, 150), (77, 2), (64, 0)]


def random_long_mix(seed):
    """A shuffled batch with one sequence of each kind the split must handle (a decode
    step on a long history, chunked prefill on history, a prompt from scratch, no new
    tokens) and two more of random kinds, with random lengths."""
    rng = np.random.default_rng(seed)
    kinds = [lambda: (int(rng.integers(130, 400)), 1),
             lambda: (int(rng.integers(60, 260)), int(rng.integers(2, 40))),
             lambda: (0, int(rng.integers(20, 140))),
             lambda: (int(rng.integers(1, 200)), 0)]
    seqs = [kind() for kind in kinds] + [kinds[rng.integers(0, 3)]() for _ in range(2)]
    return [seqs[i] for i in rng.permutation(len(seqs))]


SPLIT_MIXES = {"fixed": MIX_LONG, "random_a": random_long_mix(10),
               "random_b": random_long_mix(11)}

# A window of 100 positions leaves items whose walk starts past tile 0 and still spans
# several tiles, so the window and the split shares interact; the small ALiBi slopes
# keep weight on far positions.
SPLIT_OPTIONS = {
    "plain": OPTIONS["plain"],
    "scale_window_alibi": OPTIONS["scale_window_alibi"],
    "long_window_alibi": lambda q_heads: dict(scale=0.7, sliding_window=100,
                                              alibi_slopes=alibi_slopes(q_heads)),
}


def assert_matches_reference_with_scores(case, config, options, backend, num_splits=None):
    out, scores, key_cache, value_cache = paged.paged_attention(
        **case, **options, return_scores=True, backend=backend, num_splits=num_splits)
    expected, expected_scores, expected_k, expected_v = reference_paged_attention(
        **case, **options)
    assert out.dtype == config["dtype"]
    assert_output_close(out, expected, case, config, options)
    assert_caches_exact(key_cache, value_cache, expected_k, expected_v)
    # The scores are weights recomputed with the merged lse (float32 even for bf16
    # inputs): they meet the float32 bar only if the merge is exact.
    used = expected_scores.shape[0]
    np.testing.assert_allclose(np.asarray(scores[:used]), expected_scores,
                               atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)


# Split-KV: programs sharing one work item's tiles. 3 leaves uneven shares; 8 and 64 are
# more splits than some or all items have tiles (empty splits must weigh nothing in the
# merge). `num_splits` is a static argument of the op's compiled program.
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("num_splits", [1, 3, 8, 64])
@pytest.mark.parametrize("option", SPLIT_OPTIONS)
@pytest.mark.parametrize("config_name", ["gqa_dv_f32_page16", "gqa_bf16_page16"])
def test_split_kv_matches_reference(config_name, option, num_splits, backend):
    config, _ = case_config(config_name)
    case = make_case(2, MIX_LONG, **config)
    assert_matches_reference_with_scores(case, config, SPLIT_OPTIONS[option](config["q_heads"]),
                                         backend, num_splits=num_splits)


def _random_mix_cases():
    """On the GPU every config x mix x num_splits. In interpret mode each config meets
    each mix once, split 3 ways (uneven shares) or 8 (more splits than some items have
    tiles), in rotation: num_splits=1 (no split) and every split count on the fixed mix
    run in test_split_kv_matches_reference."""
    for config_name in ("gqa_bf16_page16", "mqa_bf16_page4"):
        for mix in ("random_a", "random_b"):
            for num_splits in (1, 3, 8):
                case_id = f"{config_name}-{mix}-{num_splits}"
                if num_splits == (3 if (config_name[0] == "g") == (mix == "random_a") else 8):
                    yield pytest.param(config_name, mix, num_splits, "interpret",
                                       id=f"{case_id}-interpret")
                yield pytest.param(config_name, mix, num_splits, "pallas",
                                   marks=pytest.mark.gpu, id=f"{case_id}-pallas")


@pytest.mark.parametrize("config_name,mix,num_splits,backend", list(_random_mix_cases()))
def test_split_kv_random_mixes_match_reference(config_name, mix, num_splits, backend):
    config, _ = case_config(config_name)
    case = make_case(3, SPLIT_MIXES[mix], **config)
    options = SPLIT_OPTIONS["long_window_alibi"](config["q_heads"])
    assert_matches_reference_with_scores(case, config, options, backend, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 8])
def test_split_kv_decode_only_batch_matches_reference(num_splits):
    # The case split-KV exists for: one new token per sequence, long histories.
    config, _ = case_config("gqa_dv_f32_page16")
    seqs = [(past, 1) for past in (383, 256, 129, 64, 1, 300)]
    case = make_case(4, seqs, **config)
    assert_matches_reference_with_scores(case, config, {}, "interpret", num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 5, 40])
def test_split_kv_kernel_lse_equals_one_split(num_splits):
    # The kernel's merged (out, lse) against its own single-split result: the lse must
    # stay natural-log and exact, the output merged without loss.
    config, _ = case_config("gqa_dv_f32_page16")
    case = make_case(5, random_long_mix(12), **config)
    _, _, key_cache, value_cache = reference_paged_attention(**case)
    q_heads, head_dim = config["q_heads"], config["head_dim"]
    args = (case["query"].reshape(-1, q_heads, head_dim),
            jnp.asarray(key_cache, jnp.float32), jnp.asarray(value_cache, jnp.float32),
            case["past_lens"], case["subsequence_begins"], case["block_indices"],
            case["block_indices_begins"], 0.7, 100, alibi_slopes(q_heads))
    out_one, lse_one = ragged_kernel.ragged_paged_attention(*args, interpret=True,
                                                            num_splits=1)
    out, lse = ragged_kernel.ragged_paged_attention(*args, interpret=True,
                                                    num_splits=num_splits)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert out.shape == out_one.shape and lse.shape == lse_one.shape
    assert np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_one), atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_one), atol=1e-5, rtol=1e-5)


def test_num_splits_reaches_an_already_compiled_op(monkeypatch):
    # Each value passed must reach the kernel, not a program traced for an earlier one.
    kernel = ragged_kernel.ragged_paged_attention
    requested = []

    def recording(*args, num_splits, **kwargs):
        requested.append(num_splits)
        return kernel(*args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(ragged_kernel, "ragged_paged_attention", recording)
    config, _ = case_config("mha_f32_page4")
    case = make_case(6, [(29, 1), (0, 3), (11, 2)], **config)  # shapes no other test uses
    for num_splits in (2, 2, 3, 3):
        paged.paged_attention(**case, backend="interpret", num_splits=num_splits)
    # (The op's very first call in a process may trace twice, for reasons of its own.)
    assert set(requested) == {2, 3} and requested[-1] == 3
    assert requested.count(3) == 1  # the second call with 3 reuses its program


@pytest.mark.parametrize("num_splits", [0, -1, 1.5, True])
def test_bad_num_splits_is_a_value_error(num_splits):
    config, _ = case_config("mha_f32_page4")
    case = make_case(6, [(29, 1)], **config)
    with pytest.raises(ValueError, match="num_splits"):
        paged.paged_attention(**case, backend="interpret", num_splits=num_splits)


def test_automatic_splits_fill_the_gpu_only_when_items_do_not():
    choose = ragged_kernel.choose_num_splits
    assert choose(68, 8, 65, interpret=False) == 1          # 544 programs already
    assert choose(32, 8, 65, interpret=False) == 1          # 256 programs: the target
    assert choose(2, 8, 65, interpret=False) == 16          # 16 programs: 256 / 16
    assert choose(2, 8, 4, interpret=False) == 4            # no more splits than tiles
    assert choose(2, 8, 65, interpret=True) == 1            # interpreter: no splits
    assert choose(2, 8, 65, interpret=True, requested=5) == 5
    assert choose(2, 8, 4, interpret=False, requested=9) == 4


def test_planned_splits_for_the_benchmark_batches():
    # Hq 32, Hkv 8, D 128, pages of 16 (`pallas-flex bench ragged`).
    def plan(seqs):
        num_tokens = sum(new for _, new in seqs)
        num_blocks = sum(-(-(past + new) // 16) for past, new in seqs)
        return ragged_kernel.planned_num_splits((num_tokens, 32, 128), (num_blocks, 8, 16, 128),
                                                len(seqs), num_blocks)

    # 64 decode steps are 64 work items (one token each), 512 programs: no splits.
    assert plan([(4096, 1)] * 64) == 1
    assert plan([(4096, 1)] * 16) == 2                      # 128 programs: 256 / 128
    assert plan([(4096, 1)] * 8) == 4                       # 64 programs: 256 / 64
    # Prefill-heavy batches already fill the GPU: no partials, no merge.
    assert plan([(1024, 1024)] * 4 + [(4096, 1)] * 60) == 1
    assert plan([(0, 4096)] * 2) == 1


SCORE_WINDOWS = {
    "all_tokens": None,
    "last_two": 2,
    "zero_means_all": 0,
    "per_sequence": np.array([1, 0, 3, -1, 2, 100, 1], np.int32),  # MIX_PAGE_4's 7
}


@pytest.mark.parametrize("backend", RAGGED_BACKENDS)
@pytest.mark.parametrize("window", SCORE_WINDOWS)
def test_scores_match_reference(window, backend):
    config, seqs = case_config("mha_f32_page4")
    case = make_case(1, seqs, **config)
    options = dict(sliding_window=6, alibi_slopes=alibi_slopes(config["q_heads"]),
                   score_aggregation_window=SCORE_WINDOWS[window])
    out, scores, key_cache, value_cache = paged.paged_attention(
        **case, **options, return_scores=True, backend=backend)
    expected, expected_scores, expected_k, expected_v = reference_paged_attention(
        **case, **options)
    np.testing.assert_allclose(np.asarray(out), expected, atol=FLOAT32_TOLERANCE,
                               rtol=FLOAT32_TOLERANCE)
    assert_caches_exact(key_cache, value_cache, expected_k, expected_v)
    # Fixed size: every listed block's positions; the spec's layout first, then zeros.
    assert scores.shape == (case["block_indices"].shape[0] * config["block_size"],)
    assert scores.dtype == jnp.float32
    used = expected_scores.shape[0]
    np.testing.assert_allclose(np.asarray(scores[:used]), expected_scores,
                               atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)
    np.testing.assert_array_equal(np.asarray(scores[used:]), 0)
    offsets = paged.score_offsets(case["past_lens"], case["subsequence_begins"])
    np.testing.assert_array_equal(
        offsets, np.concatenate([[0], np.cumsum([past + new for past, new in seqs])]))


def test_scores_bf16_gqa_are_float32_accurate():
    # Scores are float32 sums of weights computed in float32 from the 16-bit inputs, so
    # they meet the float32 bar against float64 on the same inputs.
    config, seqs = case_config("gqa_bf16_page16")
    case = make_case(2, seqs, **config)
    _, scores, _, _ = paged.paged_attention(**case, score_aggregation_window=3,
                                            return_scores=True)
    _, expected, _, _ = reference_paged_attention(**case, score_aggregation_window=3)
    np.testing.assert_allclose(np.asarray(scores[:expected.shape[0]]), expected,
                               atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)


def test_scores_sum_to_heads_times_counted_tokens():
    # Each counted token spreads weight 1 per query head over its sequence's positions.
    config, seqs = case_config("gqa_dv_f32_page16")
    case = make_case(3, seqs, **config)
    _, scores, _, _ = paged.paged_attention(**case, return_scores=True)
    offsets = np.asarray(paged.score_offsets(case["past_lens"], case["subsequence_begins"]))
    for s, (_, new) in enumerate(seqs):
        total = float(np.sum(np.asarray(scores[offsets[s]:offsets[s + 1]])))
        assert total == pytest.approx(config["q_heads"] * new, rel=1e-5)


def test_cache_writes_only_the_new_tokens_slots():
    config, seqs = case_config("gqa_dv_f32_page16")
    case = make_case(4, seqs, **config)
    _, key_cache, value_cache = paged.paged_attention(**case)
    block_size, kv_heads = config["block_size"], config["kv_heads"]
    written = np.zeros(case["key_cache"].shape[:1] + (block_size,), bool)
    key = np.asarray(case["key"]).reshape(-1, kv_heads, config["head_dim"])
    blocks = np.asarray(case["block_indices"])
    token = 0
    for s, (past, new) in enumerate(seqs):
        first = int(case["block_indices_begins"][s])
        for position in range(past, past + new):
            block, offset = blocks[first + position // block_size], position % block_size
            np.testing.assert_array_equal(np.asarray(key_cache[block, :, offset]), key[token])
            written[block, offset] = True
            token += 1
    assert token == key.shape[0]
    untouched = ~written
    np.testing.assert_array_equal(np.asarray(key_cache).transpose(0, 2, 1, 3)[untouched],
                                  np.asarray(case["key_cache"]).transpose(0, 2, 1, 3)[untouched])
    np.testing.assert_array_equal(np.asarray(value_cache).transpose(0, 2, 1, 3)[untouched],
                                  np.asarray(case["value_cache"]).transpose(0, 2, 1, 3)[untouched])


def test_no_new_tokens_at_all():
    config, _ = case_config("mha_f32_page4")
    seqs = [(3, 0), (9, 0)]
    case = make_case(5, seqs, **config)
    out, scores, key_cache, value_cache = paged.paged_attention(**case, return_scores=True)
    assert out.shape == (0, config["q_heads"] * config["value_dim"])
    np.testing.assert_array_equal(np.asarray(scores), 0)
    np.testing.assert_array_equal(np.asarray(key_cache), np.asarray(case["key_cache"]))
    np.testing.assert_array_equal(np.asarray(value_cache), np.asarray(case["value_cache"]))


def test_jit_with_traced_metadata_and_options_matches_eager():
    config, seqs = case_config("gqa_dv_f32_page16")
    case = make_case(6, seqs, **config)
    options = dict(scale=jnp.float32(0.4), sliding_window=jnp.int32(7),
                   alibi_slopes=alibi_slopes(config["q_heads"]),
                   score_aggregation_window=jnp.int32(2))
    jitted = jax.jit(functools.partial(paged.paged_attention, return_scores=True))
    for got, want in zip(jitted(**case, **options),
                         paged.paged_attention(**case, **options, return_scores=True)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    expected, expected_scores, _, _ = reference_paged_attention(
        **case, scale=0.4, sliding_window=7, alibi_slopes=alibi_slopes(config["q_heads"]),
        score_aggregation_window=2)
    out, scores, _, _ = jitted(**case, **options)
    np.testing.assert_allclose(np.asarray(out), expected, atol=FLOAT32_TOLERANCE,
                               rtol=FLOAT32_TOLERANCE)
    np.testing.assert_allclose(np.asarray(scores[:expected_scores.shape[0]]), expected_scores,
                               atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)


def test_donated_caches_are_updated_in_place():
    config, seqs = case_config("mha_f32_page4")
    case = make_case(7, seqs, **config)
    _, expected_k, expected_v = reference_paged_attention(**case)[1:]
    names = list(case)
    step = jax.jit(lambda *args: paged.paged_attention(**dict(zip(names, args))),
                   donate_argnums=(names.index("key_cache"), names.index("value_cache")))
    key_cache, value_cache = case["key_cache"], case["value_cache"]
    _, new_k, new_v = step(*case.values())
    assert key_cache.is_deleted() and value_cache.is_deleted()
    assert_caches_exact(new_k, new_v, expected_k, expected_v)


# ---------------------------------------------------------------------------------------
# Bad metadata: ValueError when concrete, a checkify report when traced.

# Base: sequence 0 has 2 past + 3 new tokens, sequence 1 has 4 past + 1 new; block size
# 4, two blocks each. Both sequences' position 4 sits at offset 0 of their second block.
BASE_METADATA = dict(past_lens=[2, 4], subsequence_begins=[0, 3, 4],
                     block_indices=[4, 1, 5, 0], block_indices_begins=[0, 2, 4],
                     sliding_window=0)
BAD_METADATA = {
    "begins_start": (dict(subsequence_begins=[1, 3, 4]),
                     r"subsequence_begins\[0\] must be 0, got 1"),
    "begins_decreasing": (dict(subsequence_begins=[0, 5, 4]),
                          r"subsequence_begins must be non-decreasing, but "
                          r"subsequence_begins\[1\] = 5 > subsequence_begins\[2\] = 4"),
    "begins_end": (dict(subsequence_begins=[0, 3, 3]),
                   r"subsequence_begins\[-1\] must equal the number of tokens T = 4 "
                   r"\(query.shape\[0\]\), got 3"),
    "negative_past": (dict(past_lens=[2, -1]), r"past_lens must be >= 0, got past_lens\[1\] = -1"),
    "block_begins_negative": (dict(block_indices_begins=[-1, 2, 4]),
                              r"block_indices_begins\[0\] must be >= 0, got -1"),
    "block_begins_decreasing": (dict(block_indices_begins=[0, 3, 2]),
                                r"block_indices_begins must be non-decreasing, but "
                                r"block_indices_begins\[1\] = 3 > block_indices_begins\[2\] = 2"),
    "block_begins_end": (dict(block_indices_begins=[0, 2, 5]),
                         r"block_indices_begins\[-1\] must be <= len\(block_indices\) = 4, "
                         r"got 5"),
    "sequence_past_its_blocks": (dict(past_lens=[2, 8]),
                                 r"sequence 1 needs 9 cache positions \(past_lens 8 \+ 1 new "
                                 r"tokens\) but block_indices_begins gives it 2 blocks of 4"),
    "block_index_too_large": (dict(block_indices=[4, 1, 5, 6]),
                              r"block_indices\[3\] = 6 \(a block of sequence 1\) is out of "
                              r"range \[0, 6\) \(key_cache.shape\[0\]\)"),
    "block_index_negative": (dict(block_indices=[-1, 1, 5, 0]),
                             r"block_indices\[0\] = -1 \(a block of sequence 0\) is out of range"),
    "block_written_twice": (dict(block_indices=[4, 1, 5, 1]),
                            r"new tokens 2 and 3 would both be written to block 1, offset 0"),
    "negative_sliding_window": (dict(sliding_window=-2),
                                r"sliding_window must be >= 0 \(0 = unlimited\), got -2"),
}


@pytest.fixture(scope="module")
def small_case():
    rng = np.random.default_rng(8)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return dict(query=normal(4, 2 * 8), key=normal(4, 2 * 8), value=normal(4, 2 * 8),
                key_cache=normal(6, 2, 4, 8), value_cache=normal(6, 2, 4, 8))


def _metadata(case):
    metadata = dict(BASE_METADATA, **BAD_METADATA[case][0]) if case else dict(BASE_METADATA)
    return {name: jnp.asarray(value, jnp.int32) for name, value in metadata.items()}


def test_base_metadata_is_valid(small_case):
    out, _, _ = paged.paged_attention(**small_case, **_metadata(None))
    expected, _, _, _ = reference_paged_attention(**small_case, **_metadata(None))
    np.testing.assert_allclose(np.asarray(out), expected, atol=FLOAT32_TOLERANCE,
                               rtol=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("case", BAD_METADATA)
def test_bad_metadata_raises_when_concrete(case, small_case):
    with pytest.raises(ValueError, match=BAD_METADATA[case][1]):
        paged.paged_attention(**small_case, **_metadata(case))


@functools.cache
def _checked_paged_attention():
    return checkify.checkify(jax.jit(paged.paged_attention))


@pytest.mark.parametrize("case", [None, *BAD_METADATA])
def test_bad_metadata_is_reported_by_checkify_under_jit(case, small_case):
    error, (out, _, _) = _checked_paged_attention()(**small_case, **_metadata(case))
    if case is None:
        assert error.get() is None
        return
    message = error.get()
    assert message is not None, "checkify reported nothing"
    assert re.search(BAD_METADATA[case][1], message), message
    assert out.shape == (4, 16)  # the op itself still ran, without going out of bounds


def test_bad_metadata_under_plain_jit_runs_unchecked(small_case):
    out, key_cache, _ = jax.jit(paged.paged_attention)(**small_case,
                                                       **_metadata("block_index_too_large"))
    assert out.shape == (4, 16) and key_cache.shape == small_case["key_cache"].shape


# ---------------------------------------------------------------------------------------
# Bad shapes, dtypes and options: always ValueError.


def _with(small_case, **changes):
    arguments = dict(small_case, **_metadata(None))
    arguments.update(changes)
    return arguments


BAD_ARGUMENTS = {
    "query_rank": (lambda c: dict(query=c["query"].reshape(4, 2, 8)),
                   r"query must be a 2-D array \[T, Hq \* D\], got shape \(4, 2, 8\)"),
    "cache_rank": (lambda c: dict(key_cache=c["key_cache"][0]),
                   r"key_cache must be a 4-D array \[num_blocks, Hkv, block_size, D\]"),
    "integer_query": (lambda c: dict(query=c["query"].astype(jnp.int32)),
                      r"query must be float32, bfloat16 or float16, got int32"),
    "mixed_dtypes": (lambda c: dict(key=c["key"].astype(jnp.bfloat16)),
                     r"query, key, value, key_cache and value_cache must share a dtype, got "
                     r"float32, bfloat16, float32, float32, float32"),
    "value_cache_blocks": (lambda c: dict(value_cache=c["value_cache"][:5]),
                           r"value_cache must have key_cache's \[num_blocks, Hkv, block_size\] "
                           r"= \[6, 2, 4\], got \[5, 2, 4\]"),
    "key_tokens": (lambda c: dict(key=c["key"][:3]), r"key must have query's 4 tokens, got 3"),
    "key_width": (lambda c: dict(key=jnp.zeros((4, 24))),
                  r"key must have shape \[T, Hkv \* D\] = \[4, 16\] \(key_cache has 2 heads of "
                  r"dim 8\), got \(4, 24\)"),
    "value_width": (lambda c: dict(value=jnp.zeros((4, 8))),
                    r"value must have shape \[T, Hkv \* Dv\] = \[4, 16\]"),
    "gqa_ratio": (lambda c: dict(query=jnp.zeros((4, 24))),
                  r"query's width \(24\) must be Hq \* D with D = 8 \(key_cache's head dim\) "
                  r"and Hq a positive multiple of Hkv = 2"),
    "past_lens_rank": (lambda c: dict(past_lens=jnp.zeros((2, 1), jnp.int32)),
                       r"past_lens must be a 1-D integer array \[num_seqs\], got shape \(2, 1\)"),
    "begins_length": (lambda c: dict(subsequence_begins=jnp.array([0, 4], jnp.int32)),
                      r"subsequence_begins must have length 3, got 2"),
    "block_begins_length": (lambda c: dict(block_indices_begins=jnp.array([0, 4], jnp.int32)),
                            r"block_indices_begins must have length 3, got 2"),
    "float_block_indices": (lambda c: dict(block_indices=jnp.zeros(4)),
                            r"block_indices must be a 1-D integer array, got shape \(4,\) and "
                            r"dtype float32"),
    "alibi_shape": (lambda c: dict(alibi_slopes=jnp.ones(3)),
                    r"alibi_slopes must be a float array of shape \(2,\) \(one slope per query "
                    r"head\) or \(1,\) \(shared\), got shape \(3,\)"),
    "scale_shape": (lambda c: dict(scale=jnp.ones(2)),
                    r"scale must be None, a Python number or a float scalar array, got \(2,\)"),
    "sliding_window_float": (lambda c: dict(sliding_window=2.5),
                             r"sliding_window must be an integer or an integer scalar array"),
    "window_length": (lambda c: dict(score_aggregation_window=jnp.array([1, 2, 3])),
                      r"score_aggregation_window must have length 2, got 3"),
    "return_scores_type": (lambda c: dict(return_scores=1),
                           r"return_scores must be a Python bool \(under jit, a static "
                           r"argument: static_argnames=\('return_scores',\)\), got int"),
    "backend": (lambda c: dict(backend="cuda"),
                r"backend must be one of \(None, 'pallas', 'interpret', 'xla'\), got 'cuda'"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_arguments(case, small_case):
    changes, message = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=message):
        paged.paged_attention(**_with(small_case, **changes(small_case)))


def test_traced_checks_off_leaves_no_effects_and_no_report(small_case):
    """Inside traced_checks(False) the traced op has no checkify effects (so jit keeps
    its fast dispatch) and bad metadata goes unreported; the default keeps the checks,
    and eager calls raise either way."""
    bad = _metadata("block_index_too_large")
    assert jax.make_jaxpr(lambda m: paged.paged_attention(**small_case, **m))(bad).effects
    with paged.traced_checks(False):
        jaxpr = jax.make_jaxpr(lambda m: paged.paged_attention(**small_case, **m))(bad)
        error, (out, _, _) = checkify.checkify(jax.jit(
            lambda m: paged.paged_attention(**small_case, **m)))(bad)
        with pytest.raises(ValueError, match=BAD_METADATA["block_index_too_large"][1]):
            paged.paged_attention(**small_case, **bad)
    assert not jaxpr.effects
    assert error.get() is None and out.shape == (4, 16)
    with pytest.raises(ValueError, match="bool"):
        with paged.traced_checks(1):
            pass


# -- the spec's inputs 13-15: re-rotating cached keys ---------------------------------------


def _rotation(case, block_size, head_dim, per_slot, seed=7):
    """Every other listed block rotated (blocks holding history, and the last block of a
    sequence whose new tokens land there), by rows of a sin/cos table of 12 angles."""
    rng = np.random.default_rng(seed)
    listed = np.asarray(case["block_indices"])
    rotated = listed[::2].astype(np.int32)
    rows = 12
    angles = rng.uniform(-np.pi, np.pi, (rows, head_dim // 2))
    lut = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    deltas = rng.integers(0, rows, (len(rotated), block_size if per_slot else 1))
    return dict(rotated_block_indices=jnp.asarray(rotated),
                rotation_deltas=jnp.asarray(deltas, jnp.int32),
                rotation_trig_lut=jnp.asarray(lut))


@pytest.mark.parametrize("backend", RAGGED_BACKENDS)
@pytest.mark.parametrize("per_slot", [True, False], ids=["deltas_per_slot", "deltas_per_block"])
@pytest.mark.parametrize("config_name", ["gqa_dv_f32_page16", "mqa_bf16_page4"])
def test_rotated_blocks_match_reference(config_name, per_slot, backend):
    """The listed blocks' cached keys are rotated (in the returned key_cache too) before
    the new tokens are written; attention reads the rotated keys."""
    config, seqs = case_config(config_name)
    case = make_case(3, seqs, **config)
    rotation = _rotation(case, config["block_size"], config["head_dim"], per_slot)
    options = dict(sliding_window=0, alibi_slopes=alibi_slopes(config["q_heads"]))
    out, key_cache, value_cache = paged.paged_attention(**case, **options, **rotation,
                                                        backend=backend)
    expected, _, expected_k, expected_v = reference_paged_attention(**case, **options,
                                                                    **rotation)
    assert_output_close(out, expected, case, config, options)
    # Rotated keys are computed in float32 and rounded once to the cache's dtype.
    tolerance = 1e-6 if config["dtype"] == jnp.float32 else 1e-2
    np.testing.assert_allclose(to_float64(key_cache), expected_k, atol=tolerance,
                               rtol=tolerance)
    np.testing.assert_array_equal(to_float64(value_cache), expected_v)
    # The rotation did something: without it the keys differ.
    _, plain_k, _ = paged.paged_attention(**case, **options, backend=backend)
    assert np.abs(to_float64(plain_k) - expected_k).max() > 0.1


@pytest.mark.parametrize("backend", RAGGED_BACKENDS)
@pytest.mark.parametrize("per_slot", [True, False], ids=["deltas_per_slot", "deltas_per_block"])
@pytest.mark.parametrize("config_name", ["gqa_dv_f32_page16", "mqa_bf16_page4",
                                         "gqa_bf16_page16", "gqa_bf16_page128"])
def test_rotation_in_the_reads_leaves_the_cache_and_attends_to_rotated_keys(
        config_name, per_slot, backend):
    """rotation_in_cache=False: the output and scores are those of the keys rotated in
    the cache (the reference: the spec's in-cache rotation, then attention), the returned
    key_cache that of the call without rotation (nothing written but the new tokens),
    the new tokens written into listed blocks not rotated. Ragged prefill and decode
    sequences, GQA / MQA, pages of 4 and 16 (a tile of several pages, and pages of
    several tiles; pages of 128, a tile inside one page), deltas per slot or per block."""
    if config_name == "gqa_bf16_page128":  # not in CONFIGS: the other tests keep theirs
        config, seqs = case_config("gqa_bf16_page16")
        config["block_size"], seqs = 128, [(0, 70), (130, 1), (200, 5), (64, 0)]
    else:
        config, seqs = case_config(config_name)
    case = make_case(3, seqs, **config)
    rotation = _rotation(case, config["block_size"], config["head_dim"], per_slot)
    options = dict(sliding_window=0, alibi_slopes=alibi_slopes(config["q_heads"]))
    out, scores, key_cache, value_cache = paged.paged_attention(
        **case, **options, **rotation, rotation_in_cache=False, return_scores=True,
        backend=backend)
    expected, expected_scores, _, expected_v = reference_paged_attention(
        **case, **options, **rotation)
    assert_output_close(out, expected, case, config, options)
    used = expected_scores.shape[0]
    np.testing.assert_allclose(np.asarray(scores[:used], np.float64), expected_scores,
                               atol=2e-2 if config["dtype"] == jnp.bfloat16 else 1e-4)
    _, plain_k, plain_v = paged.paged_attention(**case, **options, backend=backend)
    np.testing.assert_array_equal(np.asarray(key_cache), np.asarray(plain_k))
    np.testing.assert_array_equal(np.asarray(value_cache), np.asarray(plain_v))
    np.testing.assert_array_equal(to_float64(value_cache), expected_v)
    # The rotation mattered: the unrotated call's output is far from the reference.
    plain_out = paged.paged_attention(**case, **options, backend=backend)[0]
    assert np.abs(to_float64(plain_out) - expected).max() > 0.05
    # Against the in-cache rotation on the same backend: the same keys, rounded alike.
    in_cache = paged.paged_attention(**case, **options, **rotation, backend=backend)[0]
    np.testing.assert_allclose(to_float64(out), to_float64(in_cache),
                               atol=2e-2 if config["dtype"] == jnp.bfloat16 else 1e-5)


def test_rotation_in_cache_must_be_a_bool():
    config, seqs = case_config("mha_f32_page4")
    case = make_case(5, seqs, **config)
    rotation = dict(rotated_block_indices=jnp.array([1], jnp.int32),
                    rotation_deltas=jnp.zeros((1, 4), jnp.int32),
                    rotation_trig_lut=jnp.ones((12, config["head_dim"]), jnp.float32))
    with pytest.raises(ValueError, match="rotation_in_cache must be a Python bool"):
        paged.paged_attention(**case, **rotation, rotation_in_cache=0, backend="xla")


def test_rotation_under_jit_with_donated_caches_matches_eager():
    config, seqs = case_config("mha_f32_page4")
    case = make_case(4, seqs, **config)
    rotation = _rotation(case, config["block_size"], config["head_dim"], True)
    eager = paged.paged_attention(**case, **rotation, backend="xla")
    step = jax.jit(lambda case, rotation: paged.paged_attention(**case, **rotation,
                                                                backend="xla"))
    for got, want in zip(step(case, rotation), eager):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


_HLO_DTYPES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32",
               jnp.dtype(jnp.int8): "s8"}


def _hlo_shape(x):
    return f"{_HLO_DTYPES[jnp.dtype(x.dtype)]}[{','.join(map(str, x.shape))}]"


def _cache_ops(hlo, shapes):
    """The optimized HLO's `copy` and `scatter` instructions (fused ones included) whose
    result has one of `shapes` ("bf16[64,2,16,64]"): ({shape: [copy lines]},
    {shape: [scatter lines]})."""
    copies, scatters = ({shape: [] for shape in shapes} for _ in range(2))
    for line in hlo.splitlines():
        found = re.search(r"= (\w+\[[\d,]*\])(?:\{[^}]*\})? (copy|scatter)\(", line)
        if found and found[1] in shapes:
            (copies if found[2] == "copy" else scatters)[found[1]].append(line.strip())
    return copies, scatters


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_rotation_step_writes_donated_caches_in_place(backend, quantized):
    """Issue 20: with 10 % of the blocks rotated, the jitted step with donated caches
    writes them in place: no copy of a cache (or its scales) in the optimized HLO, no
    cache-sized temporary, every output aliased to its donated input; and each scatter
    into them (the rotation, the new tokens' writes) has unique indices, which XLA's GPU
    scatter needs to store elements directly rather than by a 32-bit compare-and-swap
    loop per 16- or 8-bit element (likely most of the 0.29 ms the rotation cost on the
    H100)."""
    seqs = [(120, 1)] * 6 + [(0, 16)]
    case = make_case(6, seqs, block_size=16, q_heads=4, kv_heads=2, head_dim=64,
                     value_dim=64, dtype=jnp.bfloat16, spare_blocks=400)
    listed = np.asarray(case["block_indices"])
    rotated = listed[::10]  # 10 % of the blocks, some holding the new tokens' slots
    rows, dim = 8, 64
    angles = np.random.default_rng(0).uniform(-np.pi, np.pi, (rows, dim // 2))
    rotation = dict(rotated_block_indices=jnp.asarray(rotated, jnp.int32),
                    rotation_deltas=jnp.asarray(np.arange(rotated.size * 16).reshape(-1, 16)
                                                % rows, jnp.int32),
                    rotation_trig_lut=jnp.asarray(np.concatenate(
                        [np.cos(angles), np.sin(angles)], 1), jnp.float32))
    names = ("key_cache", "value_cache")
    caches = {name: case[name] for name in names}
    if quantized:
        (caches["key_cache"], caches["key_cache_scales"]), \
            (caches["value_cache"], caches["value_cache_scales"]) = (
                quantize(case[name].astype(jnp.float32), jnp.int8) for name in names)
    rest = {name: x for name, x in case.items() if name not in names}
    step = jax.jit(lambda caches, rest, rotation: paged.paged_attention(
        **caches, **rest, **rotation, backend=backend), donate_argnums=0)
    compiled = step.lower(caches, rest, rotation).compile()
    shapes = {_hlo_shape(x) for x in caches.values()}
    copies, scatters = _cache_ops(compiled.as_text(), shapes)
    assert copies == {shape: [] for shape in shapes}
    # A 16-bit cache on the Pallas backends is rotated by the `rotate_blocks` kernel (one
    # custom call on the GPU; here the interpreter's stores, which are scatters of its
    # own): the other scatters are the new tokens' writes.
    kernel_rotation = backend == "interpret" and not quantized
    if kernel_rotation:
        interpreted = [line for lines in scatters.values() for line in lines
                       if "rotate_cached_keys" in line]
        assert interpreted
        scatters = {shape: [line for line in lines if "rotate_cached_keys" not in line]
                    for shape, lines in scatters.items()}
    # Key cache (and scales): the rotation (XLA's) and the new tokens; value cache: the
    # tokens.
    assert sum(map(len, scatters.values())) == (2 if kernel_rotation else 3 * (1 + quantized))
    for lines in scatters.values():
        for line in lines:
            assert "unique_indices=true" in line, line
    memory = compiled.memory_analysis()
    cache_bytes = sum(x.nbytes for x in caches.values())
    assert memory.alias_size_in_bytes >= cache_bytes
    assert memory.temp_size_in_bytes < caches["key_cache"].nbytes // 2, (
        memory.temp_size_in_bytes, caches["key_cache"].nbytes)
    # The in-place step computes what the eager call does.
    eager = paged.paged_attention(**caches, **rest, **rotation, backend=backend)
    for got, want in zip(compiled({k: jnp.array(x, copy=True) for k, x in caches.items()},
                                  rest, rotation), eager):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("change,message", [
    (dict(rotation_trig_lut=None), "rotation_trig_lut missing"),
    (dict(rotated_block_indices=jnp.array([0, 99], jnp.int32),
          rotation_deltas=jnp.zeros((2, 1), jnp.int32)), r"rotated_block_indices\[1\] = 99"),
    (dict(rotated_block_indices=jnp.array([2, 2], jnp.int32),
          rotation_deltas=jnp.zeros((2, 1), jnp.int32)), "lists block 2 twice"),
    (dict(rotation_deltas=jnp.full((1, 4), 12, jnp.int32)), "not a row of rotation_trig_lut"),
    (dict(rotation_deltas=jnp.zeros((1, 3), jnp.int32)), r"rotation_deltas must be an int"),
    (dict(rotation_deltas=jnp.zeros((1, 4), jnp.float32)), r"rotation_deltas must be an int"),
    (dict(rotation_trig_lut=jnp.zeros((12, 6), jnp.float32)), "rotation_trig_lut must be"),
])
def test_bad_rotation_inputs_are_value_errors(change, message):
    config, seqs = case_config("mha_f32_page4")
    case = make_case(5, seqs, **config)
    rotation = dict(rotated_block_indices=jnp.array([1], jnp.int32),
                    rotation_deltas=jnp.zeros((1, 4), jnp.int32),
                    rotation_trig_lut=jnp.ones((12, config["head_dim"]), jnp.float32))
    rotation.update(change)
    with pytest.raises(ValueError, match=message):
        paged.paged_attention(**case, **rotation, backend="xla")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_heads_split_inside_a_shard_map_that_checks_varying_axes(backend):
    """Tensor-parallel serving written by hand: query, key, value and cache heads split
    over a mesh axis inside jax.shard_map with check_vma=True (its default), the
    metadata and ALiBi slopes whole on every device (each device's mods take its own
    half). The "xla" backend's outputs and updated caches equal the one-device call;
    "interpret", whose Pallas interpreter cannot index the varying refs at its program
    ids, is a ValueError naming the way out."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    config, seqs = case_config("gqa_dv_f32_page16")
    case = make_case(0, seqs, **config)
    slopes = alibi_slopes(config["q_heads"])
    expected = paged.paged_attention(**case, alibi_slopes=slopes, backend="xla")
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices("cpu")[:2],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    names = list(case)
    split = {"query", "key", "value", "key_cache", "value_cache"}
    in_specs = tuple(P(None, "model") if name in split else P() for name in names)

    def local(*args):
        own = jax.lax.dynamic_slice_in_dim(slopes, jax.lax.axis_index("model") * 2, 2)
        return paged.paged_attention(**dict(zip(names, args)), alibi_slopes=own,
                                     backend=backend)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                                 out_specs=(P(None, "model"),) * 3, check_vma=True))
    with jax.set_mesh(mesh):
        placed = [jax.device_put(case[name], NamedSharding(mesh, spec))
                  for name, spec in zip(names, in_specs)]
        if backend == "interpret":
            with pytest.raises(ValueError, match="check_vma=False"):
                step(*placed)
            return
        got = step(*placed)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
