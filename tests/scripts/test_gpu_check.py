"""scripts/gpu_check.py's CPU smoke run (`--device cpu --quick`) on a tiny random-weight model: every
section runs, the JSON has the shape a GPU run's will have, the engine's greedy tokens equal
transformers' (fp32, `full`), and the run is labelled so it is never taken for GPU figures.
Nothing here reads a timing."""
import json
import pathlib
import subprocess
import sys

from factories import tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
STRATEGIES = ("full", "sink_window", "paged", "dlm_restore")


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_cpu_quick_run_checks_exactness_and_records_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = run("--model-dir", str(tiny_model_dir("llama")), "--device", "cpu", "--quick", "--threads", "1", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())

    assert doc["label"].startswith("cpu-smoke") and doc["device"]["kind"] == "cpu-smoke"
    assert doc["command"].startswith("scripts/gpu_check.py ") and doc["commit"] and doc["complete"]
    assert doc["cpu"]["model"] and doc["versions"]["torch"] and doc["versions"]["transformers"]
    sections = doc["sections"]
    assert set(sections) == {"correctness", "runs", "decode_batch1", "profile", "aggregate", "ngram", "transformers_eager",
                             "transformers_static_compiled", "paged_long"}
    assert all("wall_s" in s for s in sections.values())
    assert {k for k, s in sections.items() if s["status"] != "ok"} == {"transformers_static_compiled"}
    assert "cpu" in sections["transformers_static_compiled"]["reason"]  # skipped on the CPU by default, with its reason

    # engine (full, fp32) == transformers generate, token for token, with the step's compile off and auto
    corr = sections["correctness"]
    modes = ("off", "auto") if doc["compile_supported"] else ("off",)
    assert set(corr["by_compile"]) == set(modes) and corr["all_identical"] is True
    for mode in modes:
        rows = corr["by_compile"][mode]["per_prompt"]
        assert len(rows) == 2 and all(row["identical"] and row["tokens"] == corr["tokens"] for row in rows)

    runs = sections["runs"]
    assert all(runs["strategies"][s]["status"] == "ok" for s in STRATEGIES), runs["strategies"]
    paged = runs["strategies"]["paged"]
    assert paged["stored_bytes"] > 0 and paged["page_recalls"] > 0 and paged["dropped_tokens"] == 0
    assert runs["strategies"]["sink_window"]["dropped_tokens"] > 0  # the history really outgrew sink + window
    shortlisted = runs["paged_shortlist"]  # the shortlist's path ran (its tokens may differ from exact choice's)
    assert shortlisted["status"] == "ok" and shortlisted["page_recalls"] > 0 and "identical_to_exact_choice" in shortlisted
    ngram = runs["drafters"]["ngram"]
    assert ngram["status"] == "ok" and ngram["identical_to_plain_full"] is True
    for name in ("smollm2-135m-dflash", "smollm2-135m-dlm"):  # made for SmolLM2's vocabulary, not the tiny model's
        assert runs["drafters"][name]["status"] == "skipped" and runs["drafters"][name]["reason"]

    arms = sections["decode_batch1"]["arms"]
    piecewise = {f"{s}/compile={modes[-1]}/row_graphs=off" for s in ("full", "sink_window")}
    compiled = {f"{s}/compile=on" for s in ("full", "sink_window")}
    eager = {f"{s}/compile={modes[-1]}/inductor=off" for s in ("full", "sink_window")}
    assert set(arms) == {f"{s}/compile={m}" for s in STRATEGIES for m in modes} | piecewise | compiled | eager
    assert all(a["status"] == "ok" and a["decode_tok_s"] > 0 for k, a in arms.items() if k not in piecewise | compiled | eager)
    assert all(arms[k]["status"] == "skipped" and "inductor" in arms[k]["reason"] for k in eager)
    assert all(arms[k]["status"] == "skipped" and "row graphs" in arms[k]["reason"] for k in piecewise)  # CUDA only
    assert all(arms[k]["status"] == "skipped" and "CUDA only" in arms[k]["reason"] for k in compiled)
    # the profile records the loop thread's ops per decode token (started on that thread), and a chrome trace
    prof = sections["profile"]
    for arm in ("full", "paged"):
        a = prof["arms"][f"{arm}/compile={modes[-1]}"]
        assert a["status"] == "ok" and a["host_ops"] > 0 and a["host_self_cpu_ms"] > 0, a
        assert a["top_host_ops_by_self_cpu"] and a["wall_ms_per_token"] > 0
    trace = out.with_name(prof["trace"]["trace"])
    assert prof["trace"]["status"] == "ok" and trace.exists() and trace.stat().st_size == prof["trace"]["bytes"]
    levels = sections["aggregate"]["levels"]
    assert set(levels) == {"1", "4", "16"} and sections["aggregate"]["arm"]["batching"] is True
    for n, level in levels.items():
        assert level["status"] == "ok" and level["tokens"] == int(n) * sections["aggregate"]["tokens_per_session"]
    assert sections["ngram"]["identical_to_plain"] is True and sections["ngram"]["k"] == 4
    assert sections["transformers_eager"]["generated"] == sections["transformers_eager"]["tokens"]

    assert doc["targets"]["applies"] is False
    assert doc["targets"]["correctness_full_identical_to_transformers"]["met"] is True
    assert doc["targets"]["paged_runs_and_recalls"]["met"] is True
    assert doc["targets"]["every_strategy_and_drafter_runs"]["met"] is True
    long = sections["paged_long"]  # paged at a short history and just past the tiny model's trained context
    assert long["max_context"] == 2048 and set(long["lengths"]) == {"120", "2150"}
    assert all(v["status"] == "ok" and v["generated"] == 8 for v in long["lengths"].values()), long
    assert doc["targets"]["paged_past_the_context_runs"]["met"] is True
    assert doc["targets"]["batch1_ge_3x_transformers_static_compiled"]["met"] is None  # no compiled control on the CPU

    # --summarize: a run its time limit killed inside paged_long gets its ratios and targets from what it finished
    cut = json.loads(out.read_text())
    del cut["ratios"], cut["targets"]
    cut["sections"]["paged_long"]["status"] = "running"
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    r = run("--summarize", str(tmp_path / "cut.json"), "--out", str(tmp_path / "summary.json"), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"]["paged_long"]["status"] == "cut" and summary["summarized"]["cut_sections"] == ["paged_long"]
    assert summary["ratios"] == doc["ratios"] and summary["targets"] == doc["targets"]
    assert run("--summarize", str(out), "--out", str(tmp_path / "again.json"), timeout=60).returncode == 2  # finished already


def test_a_cpu_run_never_writes_the_gpu_results_file():
    before = (REPO / "results" / "gpu_check.json").stat().st_mtime if (REPO / "results" / "gpu_check.json").exists() else None
    r = run("--model-dir", str(tiny_model_dir("llama")), "--device", "cpu", "--quick", timeout=60)
    assert r.returncode == 2 and "writes no GPU figures" in r.stderr
    after = (REPO / "results" / "gpu_check.json").stat().st_mtime if (REPO / "results" / "gpu_check.json").exists() else None
    assert after == before
