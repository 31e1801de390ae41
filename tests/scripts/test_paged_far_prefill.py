"""scripts/research/paged_far_prefill.py on a tiny random-weight int4 model (trained context 2048): `full` to its
context, `paged` past it with the native step's attention chunk by chunk and row by row, and with the fp32 query;
per arm its chunks' times."""
import json
import pathlib
import subprocess
import sys

from factories import require_native, tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "research" / "paged_far_prefill.py"


def test_paged_far_prefill_runs_full_and_both_attention_orders_past_the_context(tmp_path):
    require_native()
    out = tmp_path / "prefill.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir("llama", max_position_embeddings=2048)),
                        "--tokens", "2560", "--chunk", "256", "--threads", "1", "--interleave",
                        "--arms", "full,native,native/row,native+fp32q,native+sf3,native+w64,native+far1024",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/paged_far_prefill.py ")
    arms = doc["arms"]
    assert arms["full"]["tokens"] == 2048  # full stops at the trained context
    assert doc["kv_dtype"]["paged"] in ("fp16", "fp32")  # what the daemon resolves (--kv-dtype auto)
    assert doc["shortlist_from"] == {"native": 256, "native/row": 256, "native+fp32q": 256, "native+sf3": 3,
                                     "native+w64": 256, "native+far1024": 256}  # the daemon's default
    assert doc["window"] == {"native": 508, "native/row": 508, "native+fp32q": 508, "native+sf3": 508,
                             "native+w64": 64, "native+far1024": 508}  # paged's default window, and an arm's own
    assert doc["far_from"] == {"native": 0, "native/row": 0, "native+fp32q": 0, "native+sf3": 0, "native+w64": 0,
                               "native+far1024": 1024}  # the trained context's layout, and InfLLM's from 1024
    for arm in ("native", "native/row", "native+fp32q", "native+sf3", "native+w64", "native+far1024"):
        assert arms[arm]["tokens"] == 2560 and len(arms[arm]["chunk_seconds"]) == 10
        assert arms[arm]["segments"]["past_context"]["tokens"] == 512
    assert doc["ratios"]["native / native+fp32q, tok/s past_context"] > 0  # the int8 query against the fp32 one
