"""The `pallas-flex` command: `pallas-flex demo`, `pallas-flex bench [options]`,
`pallas-flex --version`.

`pallas-flex bench --help` lists the suites and options (pallas_flex/bench/).
"""

from __future__ import annotations

import argparse
import sys


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
    from pallas_flex.bench import cli  # Imported lazily: the harness is not needed otherwise.

    return cli.main(argv)


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
