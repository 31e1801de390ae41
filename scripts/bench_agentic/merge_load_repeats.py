"""Merge repeated bench_load.py runs (the parts of one A/B experiment) into one JSON: per commit and arm, every run's
targets figures, and their medians.

Each part is a bench_load.py JSON (its own command, commit and machine kept as written). Runs group by the commit they
ran at; within a group the figures of the arms' `targets` are listed in the parts' order and their median taken.

    python scripts/bench_agentic/merge_load_repeats.py results/parts/bench_load_native_ab results/bench_load.json \
        --out results/bench_load_native_ab.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import run_metadata, write_json  # noqa: E402

FIGURES = ("decode_aggregate_8_vs_1", "itl_p95_8_with_append_vs_1", "agent_mix_aggregate_8_vs_1")


def merge(parts: list[pathlib.Path]) -> dict:
    groups: dict = {}
    for path in parts:
        run = json.loads(path.read_text())
        for arm, targets in run.get("targets", {}).items():
            g = groups.setdefault(run["commit"][:7], {}).setdefault(arm, {"parts": [], "figures": {}})
            g["parts"].append({"file": path.name, "command": run["command"], "date_utc": run["date_utc"],
                               "cpu": run["machine"]["cpu"], "dirty_worktree": run["dirty_worktree"]})
            for name in FIGURES:
                if targets.get(name) is not None:
                    g["figures"].setdefault(name, []).append(targets[name])
    for arms in groups.values():
        for g in arms.values():
            g["median"] = {name: round(statistics.median(v), 3) for name, v in g["figures"].items()}
    return groups


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", help="bench_load.py JSONs, or folders of them")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    parts = [f for p in map(pathlib.Path, args.parts) for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    if not parts:
        ap.error(f"no JSON files in {args.parts}")
    out = run_metadata({"parts": args.parts}) | {"by_commit": merge(parts)}
    write_json(pathlib.Path(args.out), out)
    for commit, arms in out["by_commit"].items():
        for arm, g in arms.items():
            print(commit, arm, g["median"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
