"""scripts/research/native_prefill.py on a tiny random-weight int4 model: both arms prefill, the shared step runs with
and without its chunk, and the JSON carries the provenance and the ratios. Nothing here reads a timing's value."""
import json
import pathlib
import subprocess
import sys


from factories import require_native, tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "research" / "native_prefill.py"


def test_native_prefill_script_runs_both_arms(tmp_path):
    require_native()
    out = tmp_path / "native_prefill.json"
    model = tiny_model_dir("llama")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--lengths", "40,90", "--chunk", "32",
                        "--threads", "1", "--rounds", "1", "--sessions", "2", "--shared-chunk", "8",
                        "--shared-context", "24", "--shared-steps", "2", "--skip-quality", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/native_prefill.py ") and doc["commit"]
    for n in ("40", "90"):
        row = doc["prefill"]["1"][n]
        assert set(row["seconds_median"]) == {"python", "native"} and row["native_speedup"] > 0
    shared = doc["shared_step"]["1"]
    assert set(shared["step_ms_median"]) == {"rows_only", "python", "native"}
    assert "quality" not in doc
