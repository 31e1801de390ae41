"""Where the needles of passkey / multi-turn ladders sat, in absolute token positions, and which were found.

Rebuilds every sample of the given merged ladders from the ladder's own generator and seed (the tokenizer only, no
model), finds the key's first token position in the document (turn 1 for multi-turn), and tallies hits per arm, rung
and band of positions (--bands: edges in tokens). Answers whether misses depend on where the needle sits in absolute
terms (the model's reading of K/V written there) rather than on its depth or its distance to the question.

    scripts/research/miss_positions.py --ladders results/research/niah_ladder.json \\
        results/research/niah_ladder_past_context_far.json results/research/niah_ladder_multiturn_past_context.json \\
        --out results/research/miss_positions.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

import niah_ladder as nl  # noqa: E402
from needle_positions import key_positions  # noqa: E402


def generator_args(ladder: dict, task: str) -> types.SimpleNamespace:
    """The sample generator's arguments that shape a sample's ids (multi-turn: turns, turn_tokens; the parts must
    agree on them; the answer length does not change the ids)."""
    seen, sets = set(), set()
    for p in ladder.get("parts") or [{"part": None}]:
        cfg = json.loads((ROOT / p["part"]).read_text())["config"] if p["part"] else ladder["config"]
        seen.add((cfg.get("turns", 10), cfg.get("turn_tokens", 8)) if task == "multiturn" else ())
        sets.add(cfg.get("sample_set", "eval"))
    if len(seen) != 1:
        raise SystemExit(f"the parts disagree on (turns, turn_tokens): {sorted(seen)}")
    if sets != {"eval"}:
        raise SystemExit("only eval-set ladders are supported")
    turns, turn_tokens = seen.pop() or (0, 0)
    return types.SimpleNamespace(turns=turns, turn_tokens=turn_tokens, answer_tokens=1, keys=4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ladders", nargs="+", required=True, help="merged ladder JSONs (passkey or multiturn)")
    ap.add_argument("--bands", default="4096,8192", help="band edges in tokens (comma list)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="results/research/miss_positions.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from inference_engine.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    edges = [int(x) for x in args.bands.split(",")]
    names = [f"<{edges[0]}"] + [f"{a}-{b}" for a, b in zip(edges, edges[1:])] + [f">={edges[-1]}"]

    def band(pos: int) -> str:
        return names[sum(pos >= e for e in edges)]

    out: dict = {"bands": names, "ladders": {}}
    for path in args.ladders:
        ladder = json.loads((ROOT / path).read_text())
        task = "multiturn" if "--task multiturn" in ladder["command"] else "passkey"
        if "--task multikey" in ladder["command"]:
            raise SystemExit(f"{path}: a multikey ladder (scripts/research/needle_positions.py reads those)")
        gen = generator_args(ladder, task)
        cells = {}
        for arm, res in ladder["arms"].items():
            for rung, cell in res.get("rungs", {}).items():
                rows = cell.get("rows") or []
                if not rows:
                    continue
                n = int(rung)
                tally = {b: {"samples": 0, "hits": 0} for b in names}
                found = []
                for i, row in enumerate(rows):
                    row = dict(row, sample=row.get("sample", i))  # rows before --first-sample carry no index (0, 1, ..)
                    s = nl.make_task_sample(task, tok, n, nl.sample_rng(task, n, row["sample"]), gen)
                    if s.key != row["key"]:
                        raise SystemExit(f"{path} {arm} rung {n} sample {row['sample']}: rebuilt key {s.key} != {row['key']}")
                    pos = key_positions(tok, s.turns[0][0], s.key)[0]
                    tally[band(pos)]["samples"] += 1
                    tally[band(pos)]["hits"] += int(row["hit"])
                    found.append({"sample": row["sample"], "key_position": pos, "hit": row["hit"]})
                cells[f"{arm}@{rung}"] = {"by_band": tally, "samples": sorted(found, key=lambda r: r["key_position"])}
                print(f"{path} {arm} @ {rung}: " + ", ".join(f"{b} {t['hits']}/{t['samples']}" for b, t in tally.items()),
                      flush=True)
        out["ladders"][path] = {"task": task, "cells": cells}
    write_json(ROOT / args.out, run_metadata(vars(args)) | out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
