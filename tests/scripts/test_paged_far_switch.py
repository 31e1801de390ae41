"""scripts/research/paged_far_switch.py on a tiny random-weight int4 model (trained context 2048, far_from 1024): the
crossing turn of each arm, the `context` arm re-encoded once (its positions under far_from copied; `context-whole`
every position encoded again) and then running far_from as the `start` arm does."""
import json
import pathlib
import subprocess
import sys

from factories import require_native, tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "research" / "paged_far_switch.py"


def test_paged_far_switch_times_the_crossing_turn_of_each_arm(tmp_path):
    require_native()
    out = tmp_path / "switch.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir("llama", max_position_embeddings=2048)),
                        "--history", "1536", "--append", "768", "--decode", "4", "--far-from", "1024", "--rounds", "1",
                        "--threads", "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/paged_far_switch.py ")
    runs = doc["runs"]
    arms = ("default", "context", "context-whole", "start")
    assert [runs[a][0]["re_encoded"] for a in arms] == [0, 1, 1, 0]
    assert [runs[a][0]["reencoded_tokens"] for a in arms] == [0, 1536 - 1024, 1536, 0]
    assert [runs[a][0]["far_from_after"] for a in arms] == [2048, 1024, 1024, 1024]
    assert set(doc["ratios"]) == {"context / default, crossing turn's time to first token",
                                  "context / default, decode tok/s after the crossing",
                                  "context-whole / default, crossing turn's time to first token",
                                  "context-whole / default, decode tok/s after the crossing",
                                  "start / default, crossing turn's time to first token",
                                  "start / default, decode tok/s after the crossing"}
