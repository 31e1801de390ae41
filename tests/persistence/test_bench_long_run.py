"""The long-session bench's short mode as a test (real model, real daemon, the Python SDK): sessions
survive the mid-run SIGKILL and a stop of the whole machine (the bench and its daemon killed, then
`--resume`), no invariant violation, and the TTFT part resumes a 300-token session from disk (a restart, then a
reload after a spill) and answers (its timings are the bench's to report, not this test's)."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from factories import load_script, require_smollm2

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_agentic" / "bench_session_long_run.py"
BENCH = [sys.executable, str(SCRIPT.relative_to(ROOT))]


def load_bench():
    return load_script(str(SCRIPT.relative_to(ROOT)))


@pytest.mark.timeout(1800)  # two legs of a 45-second run, a loaded box's slow daemon starts and the TTFT part
def test_short_long_run_survives_sigkill_and_machine_stop(tmp_path):
    require_smollm2()
    bench = load_bench()
    out, work = tmp_path / "long_run.json", tmp_path / "work"
    # 45 s of run time: the SIGKILL at 7 s, every agent back after the restart (~10 s of daemon start-up on an idle
    # 2-core box, 20-30 s on a loaded one, which counts as run time), then the machine stop; the resumed leg has the
    # rest for its turns (the daemon start-up of a leg is not run time)
    cmd = [*BENCH, "--minutes", "0.75", "--sessions", "2", "--threads", "1", "--initial-tokens", "300",
           "--ttft-history", "300", "--ttft-strategies", "sink_window", "--reloads", "1", "--ttft-threads", "1",
           "--skip-llama-cpp", "--checkpoint-seconds", "2", "--kill-at", "0.15", "--work-dir", str(work), "--out", str(out)]
    # leg 1: killed with its daemon (one process group, as a machine stop takes them) once it says on stdout that
    # every agent is back at work after the mid-run SIGKILL (its session checked) and the checkpoint holds that;
    # the test blocks on that line (or on leg 1's end, a failure), not on a clock
    log = tmp_path / "leg1.stderr"
    with open(log, "wb") as err:
        leg1 = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    said = None
    try:
        for line in leg1.stdout:  # EOF: leg 1 ended without the line
            if line.startswith(bench.RESUMED_LINE):
                said = line
                break
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already when leg 1 ended with its group
            os.killpg(leg1.pid, signal.SIGKILL)
        leg1.wait()
        leg1.stdout.close()
    assert said, f"leg 1 ended (exit {leg1.returncode}) before every agent resumed: {log.read_text()[-3000:]}"
    ckpt = work / "checkpoint.json"
    c = json.loads(ckpt.read_text())
    assert all(any(r["after"] == "sigkill" for r in a["resume_checks"]) for a in c["agents"]), c["agents"]
    assert not out.exists()

    r = subprocess.run([*BENCH, "--resume", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    lr = doc["long_run"]
    assert lr["machine_stops"] == 1 and lr["kill"] is not None
    assert lr["legs"][1]["command"].endswith(f"--resume {work}")
    assert lr["sessions_lost"] == 0 and lr["resumes_with_history_lost"] == 0 and lr["gates"]["no_session_lost"]
    assert lr["gates"]["G4_pass"]
    # each session was checked after the SIGKILL and after the machine stop, and answers after the run with
    # what its client saw
    for s in lr["per_session"]:
        assert {c["after"] for c in s["resume_checks"]} == {"sigkill", "machine_stop"}, s
        assert s["after_run"]["ok"] and s["after_run"]["history_tokens"] >= max(300, s["history_tokens"])
    # one run clock across the legs: the resumed leg's turns are recorded after the stop (the final checkpoint
    # keeps every turn), and the buckets count every recorded turn
    stop = lr["legs"][1]["run_start"]
    t_end = [t["t_end"] for a in json.loads(ckpt.read_text())["agents"] for t in a["turns"]]
    assert t_end and max(t_end) > stop, (stop, sorted(t_end))
    assert len(t_end) == sum(s["turns"] for s in lr["per_session"])
    assert sum(b["turns"] for b in lr["buckets"]) == sum(t < lr["duration_s"] for t in t_end)  # a last turn may end past it
    row = doc["ttft_8k"]["kakeya"][0]
    assert row["loads"] == 2 and row["history_tokens"] == 316  # resumed after the restart, reloaded after the spill
    assert row["resumed_ttft_s"] > 0 and len(row["reloaded_after_spill_ttft_s"]) == 1 and row["reprefill_ttft_s"] > 0
    assert pathlib.Path(str(out).replace(".json", ".png")).is_file()
