"""A/B of kernel options on the harness's attention cases, in paired rounds.

    python -m pallas_flex.bench.ab --shapes b4_s4096_d128 --variants causal --mode fwd_bwd \
        --arm default={} --arm triton='{"backward_kernel": "triton"}' [--out ab.json]
    python -m pallas_flex.bench.ab --gated gated_r256_s256_d32 --mode fwd_bwd \
        --arm default={} --arm mosaic='{"backward_kernel": "mosaic"}'

Each arm is `pf.attention` on the same inputs with its own `kernel_options`; all arms of
a case are compiled first, then timed in `time_paired`'s rounds (every arm once a round,
every other round in reverse order: the GPU clock drifts under load), so their ratios
compare like with like. Each row also gives each arm's largest difference from the first
arm's output (and gradients), relative to its largest value (bf16: ~1e-2 or less between
kernels that agree), and the kernels `pf.explain` says it runs. `--gated` times
Evoformer's gated row attention instead (`pf.variants.gated_self_attention` at the
variants suite's gated cases; fwd_bwd differentiates the pair bias and the gate too).
A maintainer tool for
the device machine: the question a throwaway probe script would answer, in one command.
`--quick` runs the tiny CPU shape on the interpret backend (its test).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

import pallas_flex as pf
from pallas_flex.bench import cases
from pallas_flex.bench.cli import _pick, suite_shapes
from pallas_flex.bench.jax_suites import _bf16, _difference, _grad_step, _step, mods
from pallas_flex.bench.timing import time_paired
from pallas_flex.variants.gated import folded_call


def parse_arm(text: str) -> tuple[str, dict]:
    """'name=JSON' -> (name, kernel_options)."""
    name, separator, options = text.partition("=")
    if not separator or not name:
        raise argparse.ArgumentTypeError(f"an arm is name=JSON, got {text!r}")
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"arm {name!r}: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"arm {name!r}: kernel_options must be an object")
    return name, parsed


def _gated_calls(case, arms, backend, mode):
    """({arm: (jitted step, its arguments)}, {arm: pf.explain of the folded call}) of a
    gated variant case (the `pf.attention` call `gated.folded_call` gives)."""
    shape = case.shape
    msa = (shape.batch, case.rows, shape.seq_len, shape.q_heads, shape.head_dim)
    q, k, v, gate, d_out = _bf16(*(cases.normal(msa, i) for i in range(5)))
    pair_bias = jax.numpy.asarray(cases.normal(
        (shape.batch, shape.q_heads, shape.seq_len, shape.seq_len), 5), jax.numpy.bfloat16)
    folded = folded_call(q, k, v, gate, pair_bias=pair_bias)
    del folded["output_gate"]  # (explain takes no gate)
    calls, explained = {}, {}
    for name, options in arms.items():
        def gated(q, k, v, gate, pair_bias, options=options):
            return pf.variants.gated_self_attention(
                q, k, v, gate, pair_bias=pair_bias, scale=shape.scale, backend=backend,
                kernel_options=options)
        calls[name] = (_grad_step(gated, mode, tuple(range(5))),
                       (q, k, v, gate, pair_bias, d_out))
        explained[name] = pf.explain(**folded, scale=shape.scale, backend=backend,
                                     kernel_options=options)
    return calls, explained


def _row(case, arms, calls, explained, args) -> dict:
    """Each arm's timing (paired rounds), ratio to the first arm, largest difference from
    its output (and gradients), kernels and options."""
    outputs = {name: jax.block_until_ready(fn(*call_args))
               for name, (fn, call_args) in calls.items()}
    first = next(iter(outputs.values()))
    differences = {name: _difference(out, first) for name, out in outputs.items()}
    timed = time_paired(calls, rounds=args.rounds, iters=args.iters)
    base = timed[next(iter(arms))]["ms"]
    row = {"case": case, "mode": args.mode,
           "arms": {name: {**timed[name], "ratio": timed[name]["ms"] / base,
                           "max_difference": differences[name],
                           "kernels": explained[name], "options": arms[name]}
                    for name in arms}}
    print(json.dumps(row), flush=True)
    return row


def run(args) -> list[dict]:
    backend = "interpret" if args.quick else args.backend
    arms = dict(args.arm)
    if args.gated:
        gated_cases = [case for case in suite_shapes("variants", args.gated, args.quick)
                       if case.kind == "gated"]
        if len(gated_cases) != len(args.gated.split(",")):
            raise SystemExit(f"--gated takes the variants suite's gated cases, got "
                             f"{args.gated!r}")
        return [_row(f"gated {case.name}", arms,
                     *_gated_calls(case, arms, backend, args.mode), args)
                for case in gated_cases]
    rows = []
    for shape in suite_shapes("forward", args.shapes, args.quick):
        q, k, v, d_out = _bf16(*cases.inputs(shape))
        for variant in _pick(args.variants, cases.VARIANTS, "variant"):
            mask_mod, score_mod = mods(variant, shape)
            calls, explained = {}, {}
            for name, options in arms.items():
                def attend(q, k, v, options=options):
                    return pf.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod,
                                        scale=shape.scale, backend=backend,
                                        kernel_options=options)
                calls[name] = (_step(attend, args.mode), (q, k, v, d_out))
                explained[name] = pf.explain(q, k, v, mask_mod=mask_mod,
                                             score_mod=score_mod, scale=shape.scale,
                                             backend=backend, kernel_options=options)
            rows.append(_row(f"{shape.name} {variant.name}", arms, calls, explained, args))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_flex.bench.ab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", type=parse_arm, action="append", required=True,
                        help="name=kernel_options JSON (the first arm is the baseline)")
    parser.add_argument("--shapes", help="comma-separated shape names or indices (default: all)")
    parser.add_argument("--variants", help="comma-separated variant names or indices (default: all)")
    parser.add_argument("--gated", help="comma-separated gated cases of the variants suite "
                        "(instead of --shapes and --variants)")
    parser.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd")
    parser.add_argument("--backend", default=None, help="default: the device's best")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="the tiny CPU shape, interpreted")
    parser.add_argument("--out", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    names = [name for name, _ in args.arm]
    if len(set(names)) != len(names):
        parser.error(f"arm names must differ, got {names}")
    rows = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
