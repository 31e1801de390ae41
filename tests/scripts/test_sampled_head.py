"""scripts/research/sampled_head.py on a tiny random-weight int4 model: both head arms scored against the fp32 head, timed
in the same rounds, sampled decoding against greedy, and top-p both ways, written with the provenance. Nothing here
reads a timing's value."""
import json

from factories import require_native, run_script, tiny_model_dir

SCRIPT = "scripts/research/sampled_head.py"


def test_sampled_head_scores_times_and_decodes_both_arms(tmp_path):
    mod = require_native()
    out = tmp_path / "sampled_head.json"
    r = run_script(SCRIPT, "--model", tiny_model_dir("llama"), "--threads", "1", "--prompts", "2", "--positions", "12",
                   "--rounds", "2", "--decode", "4", "--decode-rounds", "1", "--random-prompts", "--out", out)
    if mod.q4_isa() == 0:
        assert r.returncode != 0 and "not available here" in r.stderr
        return
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/sampled_head.py ") and doc["commit"]
    assert set(doc["quality"]) == {"int8", "q4-residual"}
    for q in doc["quality"].values():
        assert q["positions"] == 2 * 12 and 0 <= q["mean_abs_error"] <= q["max_abs_error"] and 0 <= q["top1_agreement"] <= 1
    assert set(doc["head_ms"]["int8"]) == {"1", "8"}
    assert set(doc["decode"]) == {"int8", "q4-residual", "greedy", "sampling"} and doc["decode"]["greedy"]["vs_greedy"] == 1.0
    assert set(doc["top_p_ms"]) == {"sort", "top_p_filter", "multinomial", "draw"} and doc["top_p_same_kept_set"] is True
