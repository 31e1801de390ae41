"""`kakeya sessions list|rm|gc`: the persisted sessions of a state directory, from the shell.

Plain Python (no torch): it reads manifests, never tensors. Exit codes: 0 ok, 1 a named session
does not exist, 2 usage.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import re
import sys

from .state_dir import StateDir, is_session_id

_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _age(text: str) -> float:
    m = _AGE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected an age like 90s, 30m, 12h or 7d, got {text!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sessions", help="list, remove and clean up persisted sessions")
    p.add_argument("--state-dir", default=None, help="the daemon's --state-dir (default: $KAKEYA_HOME/state)")
    sub = p.add_subparsers(dest="sessions_command", metavar="{list,rm,gc}")
    ls = sub.add_parser("list", help="persisted sessions: id, history length, bytes on disk, last save, model, strategy")
    rm = sub.add_parser("rm", help="delete persisted sessions (a running daemon still holding one in memory saves it "
                                   "again on its next turn: close it with CloseSession instead)")
    rm.add_argument("ids", nargs="+", metavar="ID")
    gc = sub.add_parser("gc", help="remove leftovers of interrupted saves; optionally old sessions and set-aside files")
    for command in (ls, rm, gc):  # `sessions list --state-dir DIR` as well as `sessions --state-dir DIR list`
        command.add_argument("--state-dir", default=argparse.SUPPRESS, help="the daemon's --state-dir")
    gc.add_argument("--older-than", type=_age, default=None, metavar="AGE",
                    help="also remove sessions not saved for AGE (e.g. 7d, 12h)")
    gc.add_argument("--quarantine", action="store_true", help="also empty quarantine/ (sessions that could not be resumed)")
    p.set_defaults(func=run_sessions_command, _sessions_parser=p)
    return p


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _list(d: StateDir) -> int:
    entries = d.entries()
    if not entries:
        print(f"no persisted sessions under {d.sessions}")
    for e in entries:
        if e.problem:
            print(f"{e.session_id}  {_human(e.disk_bytes):>9}  UNREADABLE ({e.problem})")
            continue
        saved = _dt.datetime.fromtimestamp(e.saved_at, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
        print(f"{e.session_id}  {e.history_length:>8} tokens  {_human(e.disk_bytes):>9}  saved {saved}  "
              f"{e.model_id}  {e.kv_strategy}")
    aside = sorted(p.name for p in d.quarantine.iterdir()) if d.quarantine.is_dir() else []
    if aside:
        print(f"{len(aside)} set aside under {d.quarantine} (kakeya sessions gc --quarantine removes them)")
    return 0


def _rm(d: StateDir, ids: list[str]) -> int:
    missing = [i for i in ids if not is_session_id(i) or not d.delete(i)]
    for i in ids:
        if i not in missing:
            print(f"removed {i}")
    for i in missing:
        print(f"kakeya sessions: no persisted session {i[:64]!r} under {d.sessions}", file=sys.stderr)
    return 1 if missing else 0


def _gc(d: StateDir, args) -> int:
    r = d.gc(older_than_s=args.older_than, quarantine=args.quarantine)
    print(f"removed {r['leftover_files']} leftover file(s), {len(r['sessions_removed'])} session(s), "
          f"{len(r['quarantine_removed'])} set-aside entr{'y' if len(r['quarantine_removed']) == 1 else 'ies'}")
    return 0


def run_sessions_command(args) -> int:
    d = StateDir(args.state_dir)
    if args.sessions_command == "list":
        return _list(d)
    if args.sessions_command == "rm":
        return _rm(d, args.ids)
    if args.sessions_command == "gc":
        return _gc(d, args)
    args._sessions_parser.print_help(sys.stderr)
    return 2
