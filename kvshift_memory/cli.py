"""The ``kvshift`` command: look after a memory store from the shell.

    kvshift inspect ./.kvshift            # counts and sizes, as JSON
    kvshift check ./.kvshift              # verify records and blobs; exit 1 if something is unrepaired
    kvshift gc ./.kvshift [--keep-model FINGERPRINT]

A store is a folder (the embedded default) or ``--kv-url redis://…`` (with ``--index-url``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from .exceptions import KVShiftError

__all__ = ["main"]


def _open_store(args: argparse.Namespace):
    from .store import MemoryStore

    return MemoryStore(args.path, kv_url=args.kv_url, index_url=args.index_url)


def _inspect(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        print(json.dumps(store.stats(model_fingerprint=args.model_fingerprint), indent=1, sort_keys=True))
    return 0


def _check(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        report = store.check()
    print(json.dumps(asdict(report), indent=1))
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        report = store.gc(keep_model_fingerprint=args.keep_model)
    print(json.dumps(asdict(report), indent=1))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshift", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def store_command(name: str, help_text: str, run) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("path", nargs="?", default=None, help="the store's folder")
        command.add_argument("--kv-url", default=None, help="memory://, redis://… (instead of or with a folder)")
        command.add_argument("--index-url", default=None, help="http(s)://… or :memory: (default: PATH/index)")
        command.set_defaults(run=run)
        return command

    store_command("inspect", "counts and sizes of a store", _inspect).add_argument(
        "--model-fingerprint", default=None, help="also count fragments of other models (stale)"
    )
    store_command("check", "verify every record and fragment; repair what text can rebuild", _check)
    store_command("gc", "erase deleted and expired memories, free unused fragments", _gc).add_argument(
        "--keep-model", default=None, metavar="FINGERPRINT", help="also free fragments of every other model"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a refused request, with a one-line reason)."""
    args = _parser().parse_args(argv)
    if args.path is None and args.kv_url is None:
        print("kvshift: give a store folder or --kv-url", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except KVShiftError as exc:
        print(f"kvshift: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
