"""The ``infinijup`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infinijup", description="Branchable, resumable Jupyter sessions.")
    parser.add_argument("--version", action="version", version=f"infinijup {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from .store import cli as store_cli

    store_cli.add_subparser(sub)
    helper = sub.add_parser("helper", help="check the privileged helper")
    helper.set_defaults(func=_helper_status)
    return parser


def _helper_status(args: argparse.Namespace) -> int:
    from .errors import InfinijupError
    from .helper_client import HelperClient

    try:
        info = HelperClient().hello()
    except InfinijupError as exc:
        print(f"infinijup: {exc}", file=sys.stderr)
        return 2
    import dataclasses

    for k, v in dataclasses.asdict(info).items():
        print(f"{k}: {v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 success, 1 ``store check`` found a problem, 2 an error or bad usage."""
    parser = build_parser()
    args = parser.parse_args(argv)  # bad usage (no command too) exits 2 with the usage
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # ``infinijup store log | head``
        return 0


if __name__ == "__main__":
    sys.exit(main())
