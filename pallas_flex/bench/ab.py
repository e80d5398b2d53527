"""A/B of kernel options on the harness's attention cases, in paired rounds.

    python -m pallas_flex.bench.ab --shapes b4_s4096_d128 --variants causal --mode fwd_bwd \
        --arm default={} --arm triton='{"backward_kernel": "triton"}' [--out ab.json]

Each arm is `pf.attention` on the same inputs with its own `kernel_options`; all arms of
a case are compiled first, then timed in `time_paired`'s rounds (every arm once a round,
every other round in reverse order: the GPU clock drifts under load), so their ratios
compare like with like. Each row also gives each arm's largest difference from the first
arm's output (and gradients), relative to its largest value (bf16: ~1e-2 or less between
kernels that agree), and the kernels `pf.explain` says it runs. A maintainer tool for
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
from pallas_flex.bench.jax_suites import _bf16, _difference, _step, mods
from pallas_flex.bench.timing import time_paired


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


def run(args) -> list[dict]:
    backend = "interpret" if args.quick else args.backend
    arms = dict(args.arm)
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
            outputs = {name: jax.block_until_ready(fn(*call_args))
                       for name, (fn, call_args) in calls.items()}
            first = next(iter(outputs.values()))
            differences = {name: _difference(out, first) for name, out in outputs.items()}
            timed = time_paired(calls, rounds=args.rounds, iters=args.iters)
            base = timed[next(iter(arms))]["ms"]
            row = {"case": f"{shape.name} {variant.name}", "mode": args.mode,
                   "arms": {name: {**timed[name], "ratio": timed[name]["ms"] / base,
                                   "max_difference": differences[name],
                                   "kernels": explained[name], "options": arms[name]}
                            for name in arms}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_flex.bench.ab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", type=parse_arm, action="append", required=True,
                        help="name=kernel_options JSON (the first arm is the baseline)")
    parser.add_argument("--shapes", help="comma-separated shape names or indices (default: all)")
    parser.add_argument("--variants", help="comma-separated variant names or indices (default: all)")
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
