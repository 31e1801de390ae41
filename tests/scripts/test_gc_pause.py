"""scripts/research/gc_pause.py on the tiny model: both arms run, and freezing empties what a collection walks.
Nothing here reads a timing's value."""
import json
import pathlib
import subprocess
import sys

from factories import tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_gc_pause_script_runs_both_arms(tmp_path):
    out = tmp_path / "gc.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "research" / "gc_pause.py"), "--model-dir",
                    str(tiny_model_dir("llama")), "--weights", "fp32", "--threads", "1", "--collections", "1",
                    "--steps", "4", "--out", str(out)], check=True, cwd=REPO, timeout=300)
    res = json.loads(out.read_text())
    assert res["command"].startswith("scripts/research/gc_pause.py")
    unfrozen, frozen = res["arms"]["unfrozen"], res["arms"]["frozen"]
    assert unfrozen["frozen_objects"] == 0 and frozen["frozen_objects"] > 1000
    assert frozen["tracked_objects"] < unfrozen["tracked_objects"] / 10
    assert unfrozen["decode_steps"] == frozen["decode_steps"] == 4
