"""The `pallas-flex` command: `pallas-flex demo`, `pallas-flex bench [options]`,
`pallas-flex --version`.

`pallas-flex bench --help` lists the benchmark options (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# benchmarks/ is not part of the installed package: it lives beside it in a checkout.
REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_DIR = REPO_ROOT / "benchmarks"


def package_version() -> str:
    """The installed distribution's version; in a checkout that is not installed (only on
    PYTHONPATH), the package's own `__version__`."""
    from importlib import metadata

    try:
        return metadata.version("pallas-flex")
    except metadata.PackageNotFoundError:
        import pallas_flex

        return getattr(pallas_flex, "__version__", "unknown")


def _bench(argv: list[str]) -> int:
    if not (BENCHMARKS_DIR / "run.py").is_file():
        print(f"pallas-flex bench: no benchmarks/ found at {BENCHMARKS_DIR}. The benchmark "
              "harness is not part of the installed package; run it from a source checkout "
              "(pip install -e . in the repository, or PYTHONPATH=<repo> python3 -m "
              "benchmarks.run).", file=sys.stderr)
        return 2
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from benchmarks import run  # Only importable from a checkout, hence here.

    return run.main(argv)


def _demo(argv: list[str]) -> int:
    from pallas_flex import demo  # Imported lazily: plotting and examples are heavy.

    result = demo.main(argv)
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pallas-flex", description="FlexAttention for JAX: demo and benchmarks.")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{demo,bench}")
    commands.required = True
    # Each subcommand parses its own options (add_help=False lets `--help` through).
    commands.add_parser("demo", add_help=False,
                        help="run the demo (pallas-flex demo --help for its options)")
    commands.add_parser("bench", add_help=False,
                        help="benchmark against cuDNN and PyTorch FlexAttention "
                             "(pallas-flex bench --help for its options)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "bench":
        return _bench(rest)
    return _demo(rest)


if __name__ == "__main__":
    sys.exit(main())
