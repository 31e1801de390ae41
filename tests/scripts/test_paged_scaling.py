"""scripts/research/paged_scaling.py on a tiny random-weight int4 model: every length keeps its own cache, the decode
steps of each (length, variant, arm, K/V dtype, query) and of the `full` reference are timed in the same rounds, and the JSON
carries the provenance, the per-length figures and the side-by-side ratios. Nothing here reads a timing's value."""
import json
import pathlib
import subprocess
import sys

from factories import require_native, tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "research" / "paged_scaling.py"


def test_paged_scaling_interleaves_lengths_arms_and_the_full_reference(tmp_path):
    require_native()
    out = tmp_path / "paged_scaling.json"
    steps = 2
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir("llama")), "--weights", "int4",
                        "--lengths", "700,1400", "--shortlists", "2", "--repeats", "1", "--decode-steps", str(steps),
                        "--step-arms", "native,native-python-recall", "--full-reference", "600", "--threads", "1",
                        "--kv-dtypes", "fp32,fp16", "--queries", "int8,fp32", "--far-from", "1024",
                        "--chunk", "256", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/paged_scaling.py ") and doc["commit"]
    assert doc["config"]["decode_steps_interleaved"].startswith("each round")
    assert doc["config"]["far_from"] == 1024 and doc["config"]["strategy"].endswith("far_from 1024")
    lengths = doc["lengths"]
    arms = {f"{a}+kv_{dt}+q_{q}" for a in ("native", "native-python-recall") for dt in ("fp32", "fp16")
            for q in ("int8", "fp32")}
    keys = {f"{v}/{a}" for v in ("exact", "2") for a in arms}
    for n in ("700", "1400"):
        assert set(lengths[n]["decode_step_s"]) == keys and lengths[n]["archived_positions"] > 0
        assert set(lengths[n]["choice_s_per_decode_step"]) >= {"exact", "2"}
        held = lengths[n]["bytes_by_kv_dtype"]  # fp16: the slab and the page store in half the bytes
        assert held["fp16"]["resident"] * 2 == held["fp32"]["resident"] and held["fp16"]["page_store"] > 0
        assert held["fp16"]["page_store"] * 2 == held["fp32"]["page_store"]
    assert set(lengths["full_reference"]["decode_step_s"]) == arms
    ratios = lengths["ratios"]
    assert len(ratios) == 2 * len(keys) and all(v > 0 for v in ratios.values())
    # every length, dtype, query and arm took its steps: the whole-step calls counted for both lengths and the reference
    assert lengths["native_steps"]["whole"] >= steps * 2 * (2 * 2 * 2 + 2)
    merged = tmp_path / "merged.json"  # --merge: runs side by side in one file, each with its provenance and ratios
    r = subprocess.run([sys.executable, str(SCRIPT), "--merge", str(out), str(out), "--out", str(merged)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(merged.read_text())["runs"]
    assert len(runs) == 2 and runs[0]["far_from"] == 1024 and runs[0]["ratios"] == ratios
    assert set(runs[0]["decode_step_s"]) == {"700", "1400"} and runs[0]["cpu"] == doc["machine"]["cpu"]
