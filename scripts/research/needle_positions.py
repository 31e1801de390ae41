"""Where the needles of a multikey ladder sat, and what the misses answered.

Reads a merged multikey ladder (results/research/niah_ladder_multikey.json), rebuilds every
sample from the ladder's own generator and seed (the tokenizer only, no model), finds the token
position of each needle's key, and, for every arm with a window (`sink_window`, `paged`), asks:
was the asked needle still in the resident window when the question came, and when the arm
missed a sample `full` answered, which needle did it answer (the one nearest the question?).

    scripts/research/needle_positions.py --ladder results/research/niah_ladder_multikey.json \
        --out results/research/needle_positions_multikey.json

It answers whether a miss is a selection failure (the asked needle evicted and not recalled) or
something the model does with a partial context (the asked needle resident, yet another answered).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

import niah_ladder as nl  # noqa: E402


def key_positions(tok, ids: list, key: str) -> list:
    """Token positions where the key's token ids start (the needle states each key twice)."""
    kid = tok(" " + key, add_special_tokens=False)["input_ids"]
    return [j for j in range(len(ids) - len(kid) + 1) if ids[j:j + len(kid)] == kid]


def first_number(answer: str) -> str | None:
    """The first run of 5 or more digits in an answer (the key it gave), or None."""
    m = re.search(r"\d{5,}", answer)
    return m.group(0) if m else None


def part_args(ladder: dict) -> dict:
    """--keys / --answer-tokens of the parts (they must agree: the samples are rebuilt from them)."""
    seen = set()
    for p in ladder["parts"]:
        cfg = json.loads((ROOT / p["part"]).read_text())["config"]
        seen.add((cfg.get("keys", 4), cfg.get("answer_tokens", 12), cfg.get("sample_set", "eval")))
    if len(seen) != 1:
        raise SystemExit(f"the parts disagree on (keys, answer_tokens, sample_set): {sorted(seen)}")
    keys, answer_tokens, sample_set = seen.pop()
    if sample_set != "eval":
        raise SystemExit("only eval-set ladders are supported")
    return {"keys": keys, "answer_tokens": answer_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", default=str(nl.RESULTS / "niah_ladder_multikey.json"))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=str(nl.RESULTS / "needle_positions_multikey.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from inference_engine.model_store import resolve_model

    ladder = json.loads(pathlib.Path(args.ladder).read_text())
    if "--task multikey" not in ladder["command"]:
        raise SystemExit(f"{args.ladder} is not a multikey ladder")
    gen = types.SimpleNamespace(turns=0, turn_tokens=0, **part_args(ladder))
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    full = ladder["arms"]["full"]["rungs"]
    out = {"ladder": os.path.relpath(args.ladder, ROOT), "generator": vars(gen), "rungs": {}}
    for rung, cell in sorted(full.items(), key=lambda kv: int(kv[0])):
        n = int(rung)
        samples = {}
        for row in cell["rows"]:
            i = row["sample"]
            s = nl.make_task_sample("multikey", tok, n, nl.sample_rng("multikey", n, i), gen)
            if s.key != row["key"]:
                raise SystemExit(f"rung {n} sample {i}: rebuilt key {s.key} != ladder key {row['key']}")
            ids = s.single_turn_ids
            needles = {k: key_positions(tok, ids, k)[0] for k in (s.key,) + s.distractors}
            samples[i] = {"length": len(ids), "asked": s.key, "needles": needles}
        full_hit = {r["sample"]: r["hit"] for r in cell["rows"]}
        full_number = {r["sample"]: first_number(r["answer"]) for r in cell["rows"]}
        arms = {}
        for arm, res in ladder["arms"].items():
            cfg = res.get("config", {})
            if arm == "full" or rung not in res.get("rungs", {}) or "window" not in cfg:
                continue
            rows = {r["sample"]: r for r in res["rungs"][rung]["rows"]}
            tally = {"asked_resident": {"samples": 0, "hits": 0}, "asked_evicted": {"samples": 0, "hits": 0},
                     "same_number_as_full": 0, "misses_where_full_hit": []}
            for i, row in rows.items():
                smp = samples[i]
                window_start = smp["length"] - cfg["window"]  # the window of the last prompt token (the first answer token's query)
                resident = smp["needles"][smp["asked"]] >= window_start
                t = tally["asked_resident" if resident else "asked_evicted"]
                t["samples"] += 1
                t["hits"] += int(row["hit"])
                tally["same_number_as_full"] += int(first_number(row["answer"]) == full_number.get(i) is not None)
                if full_hit.get(i) and not row["hit"]:
                    answered = first_number(row["answer"])  # a needle's key, or a number no needle holds
                    latest = max(smp["needles"], key=smp["needles"].get)
                    tally["misses_where_full_hit"].append({
                        "sample": i, "asked_position": smp["needles"][smp["asked"]], "window_start": window_start,
                        "asked_resident": resident, "answered_key": answered,
                        "answered_position": smp["needles"].get(answered),
                        "answered_the_needle_nearest_the_question": answered == latest})
            arms[arm] = tally
        out["rungs"][rung] = {"samples": samples, "arms": arms}
    write_json(pathlib.Path(args.out), run_metadata(vars(args)) | out)
    for rung, r in out["rungs"].items():
        for arm, t in r["arms"].items():
            print(rung, arm, "same number as full", t["same_number_as_full"], "resident", t["asked_resident"],
                  "evicted", t["asked_evicted"],
                  "misses where full hit:", [(m["sample"], m["asked_resident"], m["answered_the_needle_nearest_the_question"])
                                             for m in t["misses_where_full_hit"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
