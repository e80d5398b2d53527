"""Which of the collected tests a GPU run keeps: its shard and the smoke selection.

Environment:
  PALLAS_FLEX_TEST_SHARD=i/n: run only shard i (0-based) of n of the selected tests. The
    shards split the tests by groups that share reference values and programs,
    balanced by an estimate of their compile time; `make test-gpu` runs the n shards
    as concurrent pytest processes (compiling is single-threaded CPU work, and the
    suite's compile time is far over 10 minutes done one after the other).
  PALLAS_FLEX_GPU_SMOKE=1: a quick check of every kernel family in one device call
    (`make test-gpu-smoke`): the first test of every test function, and of the two
    matrices a slice (`_smoke`), before sharding.

tests/conftest.py calls `select` from its collection hook, so both apply to any pytest
run under tests/, whatever paths it collects.
"""

from __future__ import annotations

import os

import pytest

SHARD_ENV = "PALLAS_FLEX_TEST_SHARD"
SMOKE_ENV = "PALLAS_FLEX_GPU_SMOKE"

# Seconds a test took on the H100 in `make test-gpu` (14 shards at once, 2026-11-24),
# compiling, references and checks included. Matrix cells by (op, float32?, at the
# device's own budget?): a smaller budget's cell often reuses the program of a larger one.
_MATRIX_S = {("forward", True, True): 5.4, ("forward", False, True): 3.7,
             ("forward_backward", True, True): 12.7, ("forward_backward", False, True): 6.5,
             ("decode", True, True): 3.9, ("decode", False, True): 3.5,
             ("forward", True, False): 2.8, ("forward", False, False): 1.1,
             ("forward_backward", True, False): 6.0, ("forward_backward", False, False): 3.6,
             ("decode", True, False): 2.2, ("decode", False, False): 1.8}
# Captured-gradient cells by (S > 2048, float32?); the training tests by float32?; any
# other test (the pallas parameters of the shared suites: ~11 s on average).
_CAPTURED_S = {(True, False): 25.4, (False, True): 22.6, (False, False): 13.5}
_TRAIN_S = {True: 48.0, False: 21.0}
_OTHER_S = 11.0


def _group_and_cost(item):
    """(group, estimated seconds) of a test. Groups keep together the tests that share
    reference values, reference programs, compiled kernels and JAX caches."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    module = item.nodeid.split("::")[0]
    is_float32 = params.get("dtype_name") == "float32"
    if "budget" in params:  # test_dtype_matrix cells
        group = (module, params["dtype_name"], params["head_dim"], params["layout"])
        cost = _MATRIX_S[params["op"], is_float32, params["budget"] is None]
    elif "length" in params:  # test_captured_gradients cells
        group = (module, params["length"], params["mask"], params["head_dim"],
                 params["layout"])
        cost = _CAPTURED_S.get((params["length"] > 2048, is_float32), 25.4)
    else:
        group = (item.nodeid,)
        cost = (_TRAIN_S[is_float32] if "train" in item.nodeid and "dtype_name" in params
                else _OTHER_S)
    return group, cost


def _shard_spec(config):
    spec = os.environ.get(SHARD_ENV, "").strip()
    if not spec:
        return None
    index, _, count = spec.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise pytest.UsageError(f"{SHARD_ENV} must be i/n with 0 <= i < n, got {spec!r}")
    return index, count


# The smoke run's slice of the dtype matrix: the device's own shared-memory budget, one
# layout, the head dims of distinct kernel paths (Mosaic 64 / 128, Mosaic D96 past the
# powers of two, 256 on Triton's smaller tiles), every dtype and op.
_SMOKE_MATRIX = {"budget": (None,), "layout": ("gqa",), "head_dim": (64, 96, 128, 256)}


def _smoke_key(item):
    """The key a smoke run keeps one test of (the first collected), or None: drop it."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    function = item.nodeid.split("[")[0]
    if "budget" in params:  # test_dtype_matrix cells: each cell of the slice
        if any(params[name] not in kept for name, kept in _SMOKE_MATRIX.items()):
            return None
        return item.nodeid
    if "length" in params:  # test_captured_gradients cells: one per array kind and dtype
        return function, params.get("kind"), params.get("dtype_name")
    return function


def _smoke(items):
    """The tests of a smoke run (`SMOKE_ENV`), in collection order."""
    seen, kept = set(), []
    for item in items:
        key = _smoke_key(item)
        if key is not None and key not in seen:
            seen.add(key)
            kept.append(item)
    return kept


def _keep_only(config, items, kept):
    """Deselects every item not in `kept` (reported as deselected), in place."""
    chosen = set(map(id, kept))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in chosen])
    items[:] = kept


def select(config, items):
    """Keeps, in place, the smoke selection (`SMOKE_ENV`) and then this process's shard
    (`SHARD_ENV`) of the collected items; run after -m / -k deselection (tests/conftest.py
    hooks it in last), so that every shard sees the same items."""
    if os.environ.get(SMOKE_ENV, "") not in ("", "0"):
        _keep_only(config, items, _smoke(items))
    spec = _shard_spec(config)
    if spec is None:
        return
    index, count = spec
    groups = {}
    for item in items:
        group, cost = _group_and_cost(item)
        groups.setdefault(group, [0.0, []])
        groups[group][0] += cost
        groups[group][1].append(item)
    loads = [0.0] * count
    mine = set()
    # Longest-processing-time-first: the largest groups first, each to the least-loaded
    # shard (ties to the lowest index), in a deterministic order.
    for group, (cost, members) in sorted(groups.items(), key=lambda entry: (-entry[1][0],
                                                                             str(entry[0]))):
        shard = loads.index(min(loads))
        loads[shard] += cost
        if shard == index:
            mine.update(id(member) for member in members)
    _keep_only(config, items, [item for item in items if id(item) in mine])
