"""scripts/research/paged_save_peak.py on a tiny random-weight model: both arms save a spilled `paged` session past the
trained context twice in their own processes, write segments of the same size (but for their headers), and load it back equal; the JSON
carries the ratios. Nothing here reads a timing or compares the memory figures (they are the script's to report)."""
import json

from factories import main_in_process, tiny_model_dir


def test_both_arms_save_the_same_segments_and_load_them_back(tmp_path, monkeypatch):
    out = tmp_path / "save_peak.json"
    model = tiny_model_dir("llama", max_position_embeddings=2048)
    args = ["--model", model, "--weights", "fp32", "--lengths", "2300", "--turn", "300", "--chunk", "128", "--threads", "1",
            "--page-ram-mb", "0.05", "--state-dir", tmp_path, "--out", out]
    assert main_in_process("scripts/research/paged_save_peak.py", args, monkeypatch) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/paged_save_peak.py ") and doc["commit"]
    runs = {run["arm"]: run for run in doc["runs"]}
    assert set(runs) == {"streamed", "whole"}
    for run in runs.values():
        assert run["loaded_back_equal"] is True and run["tiers"]["cold_disk"] > 0 and run["archived_rows"] > 1200
        assert run["turn_save"]["segments_bytes"] > run["first_save"]["segments_bytes"]
    for save in ("first_save", "turn_save"):  # the same rows whichever way they were written (headers may differ)
        assert abs(runs["streamed"][save]["segments_bytes"] - runs["whole"][save]["segments_bytes"]) < 4096
    assert set(doc["ratios"]["2300"]) == {f"{k}_{m}" for k in ("first_save", "turn_save", "load")
                                          for m in ("peak_anon_whole_over_streamed", "seconds_streamed_over_whole")}
    assert all(run["load"]["seconds"] > 0 for run in runs.values())
