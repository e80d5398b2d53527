"""The harness's clock: median of repeated loops of back-to-back calls, and paired rounds."""

from __future__ import annotations

import statistics
import time

import jax


def time_calls(fn, args, *, iters: int = 20, repeats: int = 5, budget_s: float = 20.0):
    """(entry, last output): compile (first call), two warm-up calls (none where a single
    call is timed), then `repeats` loops
    of `iters` calls synchronised once; entry = {ms (median per call), repeats_ms,
    compile_s, iters, repeats}. When the fastest warm-up call says the loops would take
    more than `budget_s` (slow paths: interpret mode on a CPU), fewer are run."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    compile_s = per_call_s = time.perf_counter() - start
    # One call timed (--quick: that every entry is timed, not how fast) leaves nothing
    # to shrink, so no estimate: half the calls of an interpret-mode suite.
    for _ in range(2 if iters * repeats > 1 else 0):  # one at a time: the fastest
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        per_call_s = min(per_call_s, time.perf_counter() - start)
    if per_call_s * iters * repeats > budget_s:
        iters = max(1, min(iters, int(budget_s / (per_call_s * repeats))))
        repeats = max(1, min(repeats, int(budget_s / (per_call_s * iters))))
    loops_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        loops_ms.append((time.perf_counter() - start) / iters * 1e3)
    return {"ms": statistics.median(loops_ms), "repeats_ms": loops_ms,
            "compile_s": compile_s, "iters": iters, "repeats": repeats}, out


def time_paired(calls: dict, *, rounds: int = 9, iters: int = 20) -> dict:
    """{name: {ms (median over rounds), rounds_ms}} for `calls` {name: (fn, args)}, each round
    timing every call once, so that the GPU's clock drift under load hits all alike; every
    other round in the reverse order, so that no call always runs first (an H200 sweep
    that put the same call first in every round timed it ~3 % slower than its twin)."""
    rounds_ms = {name: [] for name in calls}
    for round_index in range(rounds):
        order = list(calls.items())
        for name, (fn, args) in order[::-1] if round_index % 2 else order:
            entry, _ = time_calls(fn, args, iters=iters, repeats=1)
            rounds_ms[name].append(entry["ms"])
    return {name: {"ms": statistics.median(ms), "rounds_ms": ms}
            for name, ms in rounds_ms.items()}


def error_entry(error: BaseException, status: str = "error") -> dict:
    return {"status": status, "reason": f"{type(error).__name__}: {error}"[:600]}
