"""scripts/research/malloc_threshold.py on a tiny random-weight model: every arm runs each strategy's session in a
process of its own, the fixed threshold is set where the C library is glibc, and the sessions are the same in every
arm (what the cache holds). Nothing here reads a timing or compares the memory figures (they are the script's)."""
import ctypes
import json

from factories import main_in_process, tiny_model_dir


def test_every_arm_runs_the_same_sessions_in_processes_of_their_own(tmp_path, monkeypatch):
    out = tmp_path / "malloc.json"
    model = tiny_model_dir("llama", max_position_embeddings=2048)
    args = ["--model", model, "--weights", "fp32", "--arms", "glibc,mmap:512,trim", "--strategies", "paged",
            "--prefill", "96", "--chunk", "32", "--decode", "2", "--rounds", "1", "--threads", "1", "--out", out]
    assert main_in_process("scripts/research/malloc_threshold.py", args, monkeypatch) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/malloc_threshold.py ") and doc["commit"]
    assert set(doc["medians"]) == {"glibc", "mmap:512", "trim"} and set(doc["ratios"]) == {"mmap:512", "trim"}
    glibc = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    for arm, by in doc["runs"].items():
        assert set(by) == {"paged"}
        for s, [run] in by.items():
            assert run["threshold_set"] is (glibc and arm == "mmap:512")
            assert run["cache_holds_mib"] == doc["runs"]["glibc"][s][0]["cache_holds_mib"] > 0  # the same session
            assert run["prefill_tok_s"] > 0 and run["peak_anon_mib"] >= run["after_anon_mib"] - 1
            assert (run["trim_ms"] is not None) is (arm == "trim") and (arm != "trim" or run["trim_ms"] >= 0)
