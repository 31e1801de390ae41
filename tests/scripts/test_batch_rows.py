"""scripts/research/batch_rows.py on a tiny random-weight int4 model, run in this process (no second interpreter to
start): every arm and batch size timed in the same rounds, each cell's figures and the ratios written with the
provenance. Nothing here reads a timing's value."""
import json

from factories import main_in_process, require_native, tiny_model_dir
from inference_engine.backends.torch import native

SCRIPT = "scripts/research/batch_rows.py"


class _Run:
    def __init__(self, returncode, stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, "", stderr


def run_script(script, *args, monkeypatch):
    """The script's main() with these arguments in this process; its exit as a returncode and message."""
    try:
        return _Run(main_in_process(script, args, monkeypatch))
    except SystemExit as e:
        return _Run(1 if not isinstance(e.code, int) else e.code, str(e.code))


def test_batch_rows_times_every_arm_and_batch_in_the_same_rounds(tmp_path, monkeypatch):
    require_native()
    out = tmp_path / "batch_rows.json"
    r = run_script(SCRIPT, "--model", tiny_model_dir("llama"), "--threads", "1", "--context", "20", "--batches", "1,3",
                   "--rounds", "2", "--out", out, monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/batch_rows.py ") and doc["commit"]
    assert set(doc["by_arm"]) == {"before", "trim", "apart", "silu", "head"}
    # the daemon's default step: native.PLANES planes, outlier channels only where a matrix takes one plane
    default = {"planes": native.PLANES, "outliers": native.OUTLIERS if native.PLANES == 1 else 0, "kv_dtype": "fp32"}
    assert doc["arms"]["before"] == {"trim_columns": 0, "rows_apart": 0, "silu_vectors": 0, "refined_head": 0,
                                     "q4_row_registers": 0, "q4_vnni_tiles": 0} | default
    assert doc["arms"]["head"] == {"trim_columns": 1, "rows_apart": 1, "silu_vectors": 1, "refined_head": 1,
                                   "q4_row_registers": 1, "q4_vnni_tiles": 1} | default
    for arm in doc["by_arm"].values():
        assert set(arm) == {"1", "3"}
        assert arm["1"]["speedup_vs_1"] == 1.0 and arm["3"]["forward_ms_median"] > 0 and arm["3"]["speedup_vs_before"] > 0
    assert doc["by_arm"]["before"]["3"]["speedup_vs_before"] == 1.0


def test_batch_rows_times_the_activation_arms_with_their_own_steps(tmp_path, monkeypatch):
    """planes2 / outliers build their own native steps (two planes; one plane with native.OUTLIERS channels),
    rowmem turns the one-row tile in registers off, kvfp16 times sessions of fp16 K/V; each arm records what it ran."""
    require_native()
    out = tmp_path / "batch_rows.json"
    r = run_script(SCRIPT, "--model", tiny_model_dir("llama"), "--threads", "1", "--context", "20", "--batches", "1,2",
                   "--arms", "rowmem,head,planes2,outliers,kvfp16", "--rounds", "2", "--out", out,
                   monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["by_arm"]) == {"rowmem", "head", "planes2", "outliers", "kvfp16"}
    assert doc["arms"]["kvfp16"]["kv_dtype"] == "fp16" and doc["arms"]["head"]["kv_dtype"] == "fp32"
    assert doc["arms"]["rowmem"]["q4_row_registers"] == 0 and doc["arms"]["head"]["q4_row_registers"] == 1
    assert (doc["arms"]["planes2"]["planes"], doc["arms"]["planes2"]["outliers"]) == (2, 0)
    assert doc["arms"]["outliers"]["planes"] == 1 and doc["arms"]["outliers"]["outliers"] > 0


def test_batch_rows_refuses_an_unknown_arm(tmp_path, monkeypatch):
    require_native()
    r = run_script(SCRIPT, "--model", tiny_model_dir("llama"), "--arms", "trim,fast", "--batches", "1", "--rounds", "1",
                   "--out", tmp_path / "x.json", monkeypatch=monkeypatch)
    assert r.returncode != 0 and "unknown arms ['fast']" in r.stderr
