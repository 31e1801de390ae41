"""scripts/research/verify_cost.py on a tiny random-weight int4 model: the native step's attention orders (chunk by
chunk, the default, and row by row) and the untrimmed step (every mask column scanned) measured side by side, with a
prefill chunk; the JSON says which is which. --merge keeps each run's arms apart."""
import json

import pytest

from factories import main_in_process, require_native, run_script, tiny_model_dir

THREE = ("auto", "auto/row", "auto/untrimmed")


@pytest.fixture(scope="module")
def three_arms(tmp_path_factory):
    """One run of the three arms at two contexts with a prefill chunk (the first test's subject, the merge's second part)."""
    require_native()
    out = tmp_path_factory.mktemp("verify_cost") / "verify_cost.json"
    r = run_script("scripts/research/verify_cost.py", "--model", tiny_model_dir("llama"), "--weights", "int4",
                   "--threads", "1", "--contexts", "64,300", "--rounds", "1", "--steps", "2",
                   "--compile", ",".join(THREE), "--prefill-chunk", "32", "--out", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_verify_cost_times_both_attention_orders_and_a_prefill_chunk(three_arms):
    doc = json.loads(three_arms.read_text())
    assert doc["command"].startswith("scripts/research/verify_cost.py ")
    assert set(doc["by_compile"]) == set(THREE)
    for mode in THREE:
        assert doc["by_compile"][mode]["step"]["row_step"].startswith("native")
        for c in ("64", "300"):
            cell = doc["by_compile"][mode]["by_context"][c]
            assert cell["decode_ms_median"] > 0 and cell["verify_ms_median"] > 0 and cell["prefill_chunk_ms_median"] > 0
    row = doc["by_compile"]["auto/row"]["by_context"]["300"]
    assert row["prefill_chunk_speedup_vs_auto"] > 0 and row["verify_speedup_vs_auto"] > 0


def test_merged_runs_keep_every_compile_arm_of_each_run(tmp_path, three_arms, monkeypatch):
    """--merge: each run keeps its arms side by side (the comparison is inside a run), with its rounds and commit (the
    merge reads JSON only: run in this process)."""
    parts = [tmp_path / "run0.json", three_arms]
    r = run_script("scripts/research/verify_cost.py", "--model", tiny_model_dir("llama"), "--weights", "int4",
                   "--threads", "1", "--contexts", "64", "--rounds", "1", "--steps", "2", "--compile", "auto/planes2,auto",
                   "--out", parts[0])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "merged.json"
    assert main_in_process("scripts/research/verify_cost.py", ["--merge", *parts, "--out", out], monkeypatch) in (0, None)
    doc = json.loads(out.read_text())
    assert [set(run["by_compile"]) for run in doc["runs"]] == [{"auto/planes2", "auto"}, set(THREE)]
    for run, part in zip(doc["runs"], parts):
        src = json.loads(part.read_text())
        assert run["rounds"] == 1 and run["commit"] == src["commit"]
        assert run["auto"]["64"]["verify_ms_median"] == src["by_compile"]["auto"]["by_context"]["64"]["verify_ms_median"]
