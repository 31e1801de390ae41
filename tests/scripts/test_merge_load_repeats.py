"""scripts/bench_agentic/merge_load_repeats.py: repeated bench_load runs group by commit and arm, medians per figure."""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench_agentic"))

import merge_load_repeats  # noqa: E402


def _run(path, commit, decode, p95):
    path.write_text(json.dumps({
        "command": "scripts/bench_agentic/bench_load.py --levels 1,8", "commit": commit + "0" * 33, "date_utc": "x",
        "dirty_worktree": False, "machine": {"cpu": {"model": "m"}},
        "targets": {"batching-on-auto": {"decode_aggregate_8_vs_1": decode, "itl_p95_8_with_append_vs_1": p95},
                    "llama.cpp-batched": {"decode_aggregate_8_vs_1": 1.5}}}))


def test_runs_group_by_commit_and_arm_with_medians(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    _run(parts / "a_r1.json", "aaaaaaa", 2.0, 9.0)
    _run(parts / "a_r2.json", "aaaaaaa", 3.0, 7.0)
    _run(tmp_path / "a_full.json", "aaaaaaa", 2.5, 11.0)
    _run(parts / "b_r1.json", "bbbbbbb", 1.0, 20.0)
    out = tmp_path / "merged.json"
    assert merge_load_repeats.main([str(parts), str(tmp_path / "a_full.json"), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    a = merged["by_commit"]["aaaaaaa"]["batching-on-auto"]
    assert a["figures"]["decode_aggregate_8_vs_1"] == [2.0, 3.0, 2.5]
    assert a["median"] == {"decode_aggregate_8_vs_1": 2.5, "itl_p95_8_with_append_vs_1": 9.0}
    assert [p["file"] for p in a["parts"]] == ["a_r1.json", "a_r2.json", "a_full.json"]
    assert merged["by_commit"]["bbbbbbb"]["batching-on-auto"]["median"]["decode_aggregate_8_vs_1"] == 1.0
    assert merged["by_commit"]["aaaaaaa"]["llama.cpp-batched"]["median"] == {"decode_aggregate_8_vs_1": 1.5}
