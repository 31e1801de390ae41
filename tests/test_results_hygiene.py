"""results/ holds only script-written figures: each JSON names the script that wrote it, parts sit in a
`parts/` folder beside their merged result, and the merged recall ladder carries provenance per cell."""
from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
LADDER = RESULTS / "research" / "niah_ladder.json"
JSONS = sorted(RESULTS.rglob("*.json"))
PROVENANCE = ("part", "commit", "dirty_worktree", "device", "machine", "date_utc")


def rel(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT))


def test_there_are_results():
    assert LADDER in JSONS and len(JSONS) > 10


@pytest.mark.parametrize("path", JSONS, ids=rel)
def test_every_json_names_the_script_that_wrote_it(path):
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict) and doc.get("command"), f"{rel(path)} records no `command`: write it with a script"
    # the first word: commands written before run_metadata quoted its arguments (shlex.join) are not
    # all shell-parseable (an apostrophe in a --note), but every one starts with the script's path
    script = doc["command"].split()[0]
    assert script.startswith("scripts/") and (ROOT / script).is_file(), f"{rel(path)}: {script} is not a script in scripts/"


def test_parts_live_in_a_parts_folder():
    stray = [rel(p) for p in RESULTS.rglob("*_part*") if "parts" not in p.relative_to(RESULTS).parts]
    assert not stray, f"part files outside a parts/ folder: {stray}"


def test_every_png_has_its_json():
    assert not [rel(p) for p in RESULTS.rglob("*.png") if not p.with_suffix(".json").exists()]


def test_merged_ladder_cells_carry_their_provenance():
    doc = json.loads(LADDER.read_text())
    assert "--merge" in doc["command"] and doc["commit"] and "dirty_worktree" in doc and doc["date_utc"]
    assert (ROOT / doc["notes"]).is_file()  # notes are a doc, linked
    merged_parts = {p["part"] for p in doc["parts"]}
    cells = [(arm, n, c) for arm, r in doc["arms"].items() if r.get("status") == "ok" for n, c in r["rungs"].items()]
    assert cells
    for arm, n, c in cells:
        prov = c.get("provenance")
        assert prov, f"{arm} @ {n} has no provenance"
        for p in prov:
            assert all(k in p for k in PROVENANCE), f"{arm} @ {n}: provenance {p} lacks {set(PROVENANCE) - set(p)}"
            assert p["part"] in merged_parts and (ROOT / p["part"]).is_file()
        if len(prov) > 1:  # a continuation: the parts' sample ranges follow each other
            assert [p["samples"][0] for p in prov] == [0] + [p["samples"][1] + 1 for p in prov[:-1]]
            assert prov[-1]["samples"][1] + 1 == c["samples"]


def test_every_ladder_part_is_merged():
    """Every ladder part is merged into one merged ladder file (niah_ladder.json, or an experiment
    of its own such as niah_kv_int8.json), and every part a merged file names exists."""
    parts = {rel(p) for p in (LADDER.parent / "parts").rglob("*.json")
             if "niah_ladder.py" in json.loads(p.read_text()).get("command", "")}  # other experiments' parts sit beside them
    merged = [json.loads(p.read_text()) for p in LADDER.parent.glob("*.json")]
    named = {p["part"] for doc in merged if "--merge" in doc.get("command", "") and "niah_ladder.py" in doc["command"]
             for p in doc.get("parts", [])}
    assert parts == named
