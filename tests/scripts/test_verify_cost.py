"""scripts/research/verify_cost.py on a tiny random-weight int4 model: the native step's attention orders (chunk by
chunk, the default, and row by row) and the untrimmed step (every mask column scanned) measured side by side, with a
prefill chunk; the JSON says which is which."""
import json

from factories import require_native, run_script, tiny_model_dir


def test_verify_cost_times_both_attention_orders_and_a_prefill_chunk(tmp_path):
    require_native()
    out = tmp_path / "verify_cost.json"
    r = run_script("scripts/research/verify_cost.py", "--model", tiny_model_dir("llama"), "--weights", "int4",
                   "--threads", "1", "--contexts", "64,300", "--rounds", "1", "--steps", "2",
                   "--compile", "auto,auto/row,auto/untrimmed", "--prefill-chunk", "32", "--out", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/verify_cost.py ")
    assert set(doc["by_compile"]) == {"auto", "auto/row", "auto/untrimmed"}
    for mode in ("auto", "auto/row", "auto/untrimmed"):
        assert doc["by_compile"][mode]["step"]["row_step"].startswith("native")
        for c in ("64", "300"):
            cell = doc["by_compile"][mode]["by_context"][c]
            assert cell["decode_ms_median"] > 0 and cell["verify_ms_median"] > 0 and cell["prefill_chunk_ms_median"] > 0
    row = doc["by_compile"]["auto/row"]["by_context"]["300"]
    assert row["prefill_chunk_speedup_vs_auto"] > 0 and row["verify_speedup_vs_auto"] > 0


def test_merged_runs_keep_every_compile_arm_of_each_run(tmp_path):
    """--merge: each run keeps its arms side by side (the comparison is inside a run), with its rounds and commit."""
    require_native()
    parts = []
    for i, modes in enumerate(("auto/planes2,auto", "auto")):
        parts.append(tmp_path / f"run{i}.json")
        r = run_script("scripts/research/verify_cost.py", "--model", tiny_model_dir("llama"), "--weights", "int4",
                       "--threads", "1", "--contexts", "64", "--rounds", "1", "--steps", "2", "--compile", modes,
                       "--out", parts[-1])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "merged.json"
    r = run_script("scripts/research/verify_cost.py", "--merge", *parts, "--out", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [set(run["by_compile"]) for run in doc["runs"]] == [{"auto/planes2", "auto"}, {"auto"}]
    for run, part in zip(doc["runs"], parts):
        src = json.loads(part.read_text())
        assert run["rounds"] == 1 and run["commit"] == src["commit"]
        assert run["auto"]["64"]["verify_ms_median"] == src["by_compile"]["auto"]["by_context"]["64"]["verify_ms_median"]
