"""scripts/research/paged_memory.py on a tiny random-weight model: both variants run in their own processes, the
spilling one past its (tiny) budget with cold bytes and its RAM tier within the budget, the control all in RAM, and
the JSON carries the ratios and the target's verdicts. Nothing here reads a timing."""
import json
import pathlib
import subprocess
import sys

from factories import tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "research" / "paged_memory.py"


def test_paged_memory_runs_both_variants_and_spills_past_the_budget(tmp_path):
    out = tmp_path / "paged_memory.json"
    model = tiny_model_dir("llama", max_position_embeddings=2048)
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--weights", "fp32", "--lengths", "700,2300",
                        "--decode-steps", "1", "--chunk", "128", "--threads", "1", "--page-ram-mb", "0.1", "--resume-step",
                        "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/paged_memory.py ") and doc["commit"]
    spill, ram = doc["variants"]["spill"], doc["variants"]["ram"]
    assert spill["page_ram_mb"] == 0.1 and ram["page_ram_mb"] == 0
    budget = 0.1 * 2 ** 20
    for n in ("700", "2300"):
        s, a = spill["lengths"][n]["tiers"], ram["lengths"][n]["tiers"]
        assert s["hot"] == a["hot"] and a["cold_disk"] == 0  # the same hot set; the control never spills
        assert s["warm_ram"] <= budget and s["warm_ram"] + s["cold_disk"] >= a["warm_ram"] * 0.75  # all kept, by tier
    assert spill["lengths"]["2300"]["tiers"]["cold_disk"] > 0 and spill["lengths"]["2300"]["past_context"]
    assert "decode_step_s_spill_files_dropped" in spill["lengths"]["2300"]
    for v in (spill, ram):  # a saved and loaded session's first step, with far_keys in its state and without
        assert all(v["lengths"][n][k] > 0 for n in ("700", "2300")
                   for k in ("resumed_first_step_s", "resumed_first_step_s_without_far_keys"))
    assert set(doc["ratios"]["spill_over_ram_decode_time"]) == {"700", "2300"}
    assert doc["issue_29_memory_target"]["2300"]["tiers_ram_le_hot_plus_budget"] is True
    for v in (spill, ram):  # the anonymous peaks on the way to each length: the fill's, and the steps'
        assert all(v["lengths"][n]["peak_anon_of_cache"] > 0 and v["lengths"][n]["peak_anon_steps"] > 0 for n in ("700", "2300"))
    assert "peak_anon_of_cache_le_hot_plus_budget" in doc["issue_29_memory_target"]["2300"]
