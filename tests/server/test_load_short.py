"""The short version of the long-load run (scripts/bench_agentic/bench_load.py --duration-s): 8 sessions
through the Python SDK keep taking agent-like turns (tool-result appends of 40-400 tokens, streamed
generations) against a real `kakeya serve`, and none errs or is lost. The default suite runs 15 seconds
(~40 turns per session on the tiny model); the one-minute version is marked slow (`pytest -m slow`). The
30-minute run is results/bench_load_long.json."""
import json
import pathlib
import subprocess
import sys

import pytest

from factories import tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seconds", [15, pytest.param(60, marks=pytest.mark.slow)])
def test_eight_sessions_keep_taking_turns_and_lose_nothing(tmp_path, seconds):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_agentic" / "bench_load.py"), "--model", str(tiny_model_dir("llama")),
           "--weights", "int4", "--arms", "batching-on-shared16", "--levels", "8", "--duration-s", str(seconds), "--threads", "1",
           "--generate", "8", "--interference-levels", "", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    arm = json.loads(out.read_text())["arms"]["batching-on-shared16"]
    assert arm["prefill_chunk_shared"] == 16  # the arm's daemon ran with --prefill-chunk-shared 16
    level = arm["8"]
    assert level["errors"] == 0, level["error_samples"]
    assert level["sessions_lost"] == 0
    assert level["turns_min_per_session"] >= 2  # every session kept working (each took several turns)
    assert level["generated_tokens"] == 8 * level["turns"]  # ignore_eos: every turn streamed all its tokens
    engine = level["engine"]  # the daemon's /metrics over the level: its forwards' make-up
    assert engine["forwards"] > 0 and engine["rows_per_forward"] > 0 and engine["prefill_tokens_per_forward"] > 0
    assert 0 < engine["busy_share"] and engine["forward_ms_mean"] > 0
