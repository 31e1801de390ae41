"""Long-session bench (ADR 0008 §7, G1/G2/G4/G5): agent-like sessions for minutes or hours, a SIGKILL
of the daemon in the middle, and time to first token at 8k of history resumed vs re-prefilled.

Part 1, the long run. A real `kakeya serve` (subprocess, --persist turn) and N concurrent agent
sessions driven only through the Python SDK: each turn appends a tool-call-sized chunk (30-120
tokens; now and then a 1,000-1,500-token "file read") and generates 16-32 tokens. Time is cut
into buckets (10 minutes in a 4-hour run, proportionally smaller in a short one); per bucket:
resident KV peak (`session_kv_resident_bytes` from /metrics: the hot set; the page-selection and
page-store tiers of a `paged` daemon are recorded beside it) and stored bytes (the state directory),
turn latency p50/p95, and the invariant counters from /metrics. Halfway through the daemon is
killed with SIGKILL and started again on the same state directory; every session must go on
under its id (`sessions_lost` counts those that could not).

Part 2, time to first token at 8k tokens of history: (a) a session resumed from disk after a
kill -9 (the daemon's start-up excluded), (b) re-prefilling the same history in a new session,
(c) llama.cpp (llama-cpp-python, same GGUF) restoring its state file (llama_state_load_file, as
its server's slot restore does; model load excluded) and evaluating the same new tokens.

Targets: G1 resident KV peak drift < 10 % across buckets; G2 turn p50 drift < 50 % first -> last
bucket; G4 invariant violations 0; G5 every call through the SDK; no session lost across the
SIGKILL; resumed TTFT at 8k >= 20x faster than re-prefill and <= 1.5x llama.cpp's restore.

    python scripts/bench_agentic/bench_session_long_run.py --minutes 3
    python scripts/bench_agentic/bench_session_long_run.py --hours 4
    python scripts/bench_agentic/bench_session_long_run.py --ttft-only   # part 2 alone
Writes results/bench_session_long_run.json and .png (--ttft-only: results/parts/session_ttft/ttft_8k.json).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, command_line, run_metadata, write_json  # noqa: E402

from inference_engine.server.cluster import free_port  # noqa: E402

CHECKPOINT = "checkpoint.json"
RESUMED_LINE = "every agent resumed after the SIGKILL; checkpoint written"  # printed once per run


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


class Daemon:
    """`kakeya serve` as a subprocess on a fixed port (so clients reconnect to the same address)."""

    def __init__(self, args, state_dir: str, *serve_args: str):
        self.port, self.metrics_port = free_port(), free_port()
        self.cmd = [sys.executable, "-m", "inference_engine.server.cli", "serve", "--model", args.model,
                    "--bind", f"127.0.0.1:{self.port}", "--metrics-port", str(self.metrics_port), "--state-dir", state_dir,
                    "--threads", str(args.threads), "--capacity", str(args.capacity), *serve_args]
        self.log = open(os.path.join(state_dir, "..", f"daemon-{self.port}.log"), "ab")
        self.proc = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> float:
        t0 = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"daemon did not start ({line!r}); see {self.log.name}")
        return time.perf_counter() - t0

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill9()

    def metrics(self) -> dict | None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).read().decode()
        except OSError:
            return None
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
                out[key] = s.value
        return out


def corpus(tokenizer_dir: str) -> list[int]:
    """Token ids of Python stdlib sources on this machine: real text, no download."""
    import inspect
    import json as json_mod
    import logging

    from transformers import AutoTokenizer

    text = "\n".join(inspect.getsource(m) for m in (json_mod.decoder, json_mod.encoder, argparse, logging, subprocess, threading))
    return AutoTokenizer.from_pretrained(tokenizer_dir)(text, add_special_tokens=False)["input_ids"]


COUNTERS = ("cache_invariant_violations_total", "session_total", "session_save_duration_seconds",
            "session_load_duration_seconds")  # the counters a daemon process's last sample is kept for


class RunClock:
    """Seconds of driving since the run began, summed over its legs: a run whose processes die with the
    machine (a session's end) goes on with `--resume DIR`, and neither the time the machine was stopped nor a
    leg's daemon start-up is counted. Within a leg it is wall time."""

    def __init__(self, offset: float):
        self.offset, self.wall0 = offset, time.time()

    def now(self) -> float:
        return self.offset + time.time() - self.wall0


class Agent(threading.Thread):
    """One agent session: turns until run time `end`, riding out the daemon's death (UNAVAILABLE) by
    retrying. `saved` (a checkpoint's `state()`) continues an agent whose process died."""

    def __init__(self, idx: int, target: str, ids: list[int], end: float, args, clock: RunClock, saved: dict | None = None):
        super().__init__(daemon=True, name=f"agent-{idx}")
        self.idx, self.target, self.ids, self.end, self.args, self.clock = idx, target, ids, end, args, clock
        self.rng = random.Random(1000 + idx)
        self.turns: list[dict] = []
        self.errors: list[dict] = []
        self.session_id = None
        self.lost = False
        self.resumed_after_kill = None  # seconds from the first failed call to the next success
        self.history_seen = 0
        self.warmup_s = None
        self.resume_checks: list[dict] = []  # per outage: the daemon's history length against the client's
        if saved:
            v, internal, gauss = saved["rng"]
            self.rng.setstate((v, tuple(internal), gauss))
            for k in ("turns", "errors", "session_id", "lost", "resumed_after_kill", "history_seen", "warmup_s",
                      "resume_checks"):
                setattr(self, k, saved[k])

    def state(self) -> dict:
        v, internal, gauss = self.rng.getstate()
        return {"rng": [v, list(internal), gauss], "turns": list(self.turns), "errors": list(self.errors),
                "session_id": self.session_id, "lost": self.lost, "resumed_after_kill": self.resumed_after_kill,
                "history_seen": self.history_seen, "warmup_s": self.warmup_s, "resume_checks": list(self.resume_checks)}

    def gone(self, e: Exception) -> bool:
        """The session no longer exists (NOT_FOUND / FAILED_PRECONDITION): the agent is lost. False."""
        self.lost = True
        self.errors.append({"t": self.clock.now(), "kind": "not_found", "detail": str(e)[:300]})
        return False

    def check_resumed(self, s, cause: str, wait_s: float = 300.0) -> bool:
        """After an outage: does the session answer, with at least the history its client confirmed?
        Recorded in resume_checks; False when it is gone (then the agent is lost)."""
        from kakeya.errors import FailedPreconditionError, SessionNotFoundError, UnavailableError

        deadline = time.time() + wait_s
        while True:
            try:
                n = len(s.history())
                break
            except UnavailableError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
            except (SessionNotFoundError, FailedPreconditionError) as e:
                return self.gone(e)
        self.resume_checks.append({"t": self.clock.now(), "after": cause, "history": n, "client_saw": self.history_seen})
        self.history_seen = n
        return True

    def chunk(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.ids) - n)
        return self.ids[start:start + n]

    def run(self) -> None:
        import kakeya
        from kakeya.errors import FailedPreconditionError, KakeyaError, SessionNotFoundError, UnavailableError

        if self.lost:
            return
        client = kakeya.Client(self.target)
        down_since = None
        if self.session_id is None:
            s = client.create_session(self.chunk(self.args.initial_tokens), ignore_eos=True)
            self.session_id = s.id
        else:  # a new leg: the machine stopped, the daemon was started again on the same state directory
            s = client.session(self.session_id)
            if not self.check_resumed(s, "machine_stop"):  # first, whatever run time is left
                return
        while self.clock.now() < self.end:
            if self.warmup_s is None:  # warm-up, not a turn: the initial prefill (the "system prompt")
                t0 = time.perf_counter()
                try:
                    s.generate_all(1)
                except UnavailableError:
                    down_since = down_since or t0
                    time.sleep(0.5)
                    continue
                except (SessionNotFoundError, FailedPreconditionError) as e:
                    return self.gone(e)
                self.warmup_s = time.perf_counter() - t0
                continue  # an outage during the warm-up is checked like any other, by the first turn
            large = self.rng.random() < self.args.large_append_p
            n_app = self.rng.randint(1000, 1500) if large else self.rng.randint(30, 120)
            n_gen = self.rng.randint(16, 32)
            t0 = time.perf_counter()
            try:
                if down_since is not None:  # first call after an outage: does the session still exist, and all of it?
                    if not self.check_resumed(s, "sigkill"):
                        return
                    self.resumed_after_kill = time.perf_counter() - down_since
                    down_since = None
                length = s.append(self.chunk(n_app))
                res = s.generate_all(n_gen)
            except UnavailableError as e:
                down_since = down_since or t0
                self.errors.append({"t": self.clock.now(), "kind": "unavailable", "detail": str(e)[:200]})
                time.sleep(0.5)
                continue
            except (SessionNotFoundError, FailedPreconditionError) as e:
                return self.gone(e)
            except KakeyaError as e:
                self.errors.append({"t": self.clock.now(), "kind": type(e).__name__, "detail": str(e)[:300]})
                time.sleep(0.5)
                continue
            dt = time.perf_counter() - t0
            self.history_seen = length + res.generated_tokens
            self.turns.append({"t_end": self.clock.now(), "latency_s": dt, "ttft_s": res.time_to_first_token_seconds,
                               "appended": n_app, "generated": res.generated_tokens, "large": large,
                               "prefill_s": res.prefill_seconds, "history": self.history_seen})
        if down_since is not None and self.check_resumed(s, "sigkill"):  # the run ended during an outage: check anyway
            self.resumed_after_kill = time.perf_counter() - down_since
        client.close()


def final_check(target: str, agent: Agent, wait_s: float = 300.0) -> dict:
    """After the run, through the SDK: does the session still answer (the daemon may still be loading)?"""
    import kakeya
    from kakeya.errors import KakeyaError, UnavailableError

    deadline = time.time() + wait_s
    with kakeya.Client(target) as c:
        while True:
            try:
                n = len(c.session(agent.session_id).history())
                return {"ok": True, "history_tokens": n, "client_saw": agent.history_seen}
            except UnavailableError:
                if time.time() > deadline:
                    return {"ok": False, "error": "daemon unavailable"}
                time.sleep(0.5)
            except KakeyaError as e:
                return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def write_checkpoint(work: str, ckpt: dict) -> None:
    """Atomically (temporary name, fsync, rename): a machine stop mid-write leaves the previous one."""
    path = os.path.join(work, CHECKPOINT)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def long_run(args, ids, work: str, ckpt: dict) -> dict:
    """Part 1. `ckpt` is the run's checkpoint (empty for a new run): the agents' state, the samples and
    the legs so far are saved to it every --checkpoint-seconds, and a `--resume` leg starts from it."""
    state = os.path.join(work, "long-run-state")
    os.makedirs(state, exist_ok=True)
    duration = args.hours * 3600 if args.hours else args.minutes * 60
    bucket_s = args.bucket_seconds or (600.0 if duration >= 3600 else duration / args.short_buckets)
    leg = {"command": command_line(), "wall_start": time.time(), "load_average_at_start": os.getloadavg()}
    daemon = Daemon(args, state, "--kv-strategy", args.kv_strategy)
    leg["daemon_startup_s"] = daemon.start()
    clock = RunClock(ckpt.get("run_s", 0.0))  # from here: a leg's daemon start-up is not run time (a loaded box's
    leg["run_start"] = clock.now()            # slow start would otherwise eat the run before the agents began)
    legs = ckpt.get("legs", []) + [leg]
    samples = ckpt.get("samples", [])
    counters = ckpt.get("counters", []) + [{}]  # per daemon process, its last sample of COUNTERS
    kill = ckpt.get("kill")
    saved = ckpt.get("agents") or [None] * args.sessions
    agents = [Agent(i, daemon.target, ids, duration, args, clock, saved[i]) for i in range(args.sessions)]
    for a in agents:
        a.start()

    def keep(m: dict | None) -> dict:
        return {k: v for k, v in (m or {}).items() if k.startswith(COUNTERS)}

    def checkpoint() -> None:
        leg.update(wall_end=time.time(), run_end=clock.now())
        ckpt.update(config=ckpt.get("config"), run_s=clock.now(), legs=legs, samples=samples, counters=counters,
                    kill=kill, agents=[a.state() for a in agents])
        write_checkpoint(work, ckpt)

    last_ckpt = time.time()
    while clock.now() < duration or any(a.is_alive() for a in agents):
        # the kill comes once every agent holds its session (creating one is not retried: a kill then would lose the agent)
        if kill is None and clock.now() >= duration * args.kill_at and all(a.session_id or not a.is_alive() for a in agents):
            counters[-1] = keep(daemon.metrics()) or counters[-1]
            daemon.kill9()
            kill = {"killed_at_s": clock.now()}
            kill["restart_s"] = daemon.start()
            counters.append({})
        m = daemon.metrics()
        if m is not None:
            counters[-1] = keep(m)
            samples.append({"t": clock.now(), "kv_live_bytes": m.get("session_kv_live_bytes", 0.0),
                            # the hot set (daemons from before the tier gauges: kv_live_bytes, the same for non-paged)
                            "kv_resident_bytes": m.get("session_kv_resident_bytes", m.get("session_kv_live_bytes", 0.0)),
                            "kv_selection_bytes": m.get("session_kv_selection_bytes", 0.0),
                            "kv_page_store_bytes": m.get("session_kv_stored_bytes", 0.0),
                            "stored_bytes": dir_bytes(state), "active": m.get("session_active", 0.0),
                            "load_1m": os.getloadavg()[0]})
        if kill is not None and "all_resumed_at_s" not in kill and all(
                a.lost or any(r["after"] == "sigkill" for r in a.resume_checks) for a in agents):
            # every agent has checked its session after the SIGKILL (or lost it): checkpointed, then said on
            # stdout, so a driver (tests/persistence/test_bench_long_run.py) can stop the machine from here on
            kill["all_resumed_at_s"] = clock.now()
            checkpoint()
            last_ckpt = time.time()
            print(f"{RESUMED_LINE} at {kill['all_resumed_at_s']:.1f} s of run time", flush=True)
        if time.time() - last_ckpt >= args.checkpoint_seconds:
            checkpoint()
            last_ckpt = time.time()
        time.sleep(args.sample_seconds)
        if clock.now() > duration + 600:
            break
    final_checks = [final_check(daemon.target, a) for a in agents]
    counters[-1] = keep(daemon.metrics()) or counters[-1]
    daemon.stop()
    checkpoint()

    def counter(name):
        return sum(v for m in counters for k, v in m.items() if k.startswith(name) and not k.endswith("_created"))

    violations = {kind: counter(f"cache_invariant_violations_total{{kind={kind}}}") for kind in ("inv1", "inv2")}
    failed = counter("session_total{outcome=failed}")
    n_buckets = max(1, int(round(duration / bucket_s)))
    stops = [lg["run_start"] for lg in legs[1:]]
    buckets = []
    for b in range(n_buckets):
        lo, hi = b * bucket_s, (b + 1) * bucket_s
        turns = [t for a in agents for t in a.turns if lo <= t["t_end"] < hi]
        ss = [s for s in samples if lo <= s["t"] < hi]
        lat = [t["latency_s"] for t in turns]
        small = [t["latency_s"] for t in turns if not t["large"]]
        loads = [s["load_1m"] for s in ss if "load_1m" in s]
        buckets.append({
            "bucket": b, "start_s": lo, "end_s": hi, "turns": len(turns),
            "turn_latency_p50_s": pct(lat, 0.5), "turn_latency_p95_s": pct(lat, 0.95),
            "small_turn_latency_p50_s": pct(small, 0.5),
            "kv_resident_peak_bytes": max((s["kv_resident_bytes"] for s in ss), default=None),
            "kv_selection_peak_bytes": max((s["kv_selection_bytes"] for s in ss), default=None),
            "kv_page_store_peak_bytes": max((s["kv_page_store_bytes"] for s in ss), default=None),
            "kv_stored_peak_bytes": max((s["stored_bytes"] for s in ss), default=None),  # on disk
            "load_average_1m_mean": statistics.mean(loads) if loads else None,
            "contains_kill": kill is not None and lo <= kill["killed_at_s"] < hi,
            "contains_machine_stop": any(lo <= t < hi for t in stops),
        })
    full = [b for b in buckets if b["turns"] and b["kv_resident_peak_bytes"]]
    peaks = [b["kv_resident_peak_bytes"] for b in full]
    g1 = (max(peaks) - min(peaks)) / min(peaks) if peaks else None
    p50s = [b["turn_latency_p50_s"] for b in full]
    g2 = (p50s[-1] - p50s[0]) / p50s[0] if len(p50s) > 1 else None
    save_sum, save_n = counter("session_save_duration_seconds_sum"), counter("session_save_duration_seconds_count")
    load_sum, load_n = counter("session_load_duration_seconds_sum"), counter("session_load_duration_seconds_count")
    lost = sum(a.lost or not c["ok"] for a, c in zip(agents, final_checks))
    # a session that answers with less history than its client had confirmed lost turns (a turn in flight at
    # a kill is not confirmed, so it does not count)
    regressed = sum(r["history"] < r["client_saw"] for a in agents for r in a.resume_checks)
    return {
        "duration_s": duration, "bucket_s": bucket_s, "sessions": args.sessions,
        "daemon_startup_s": legs[0]["daemon_startup_s"], "kill": kill, "buckets": buckets,
        "legs": [{k: v for k, v in lg.items()} for lg in legs], "machine_stops": len(legs) - 1,
        "sessions_lost": lost, "resumes_with_history_lost": regressed,
        "per_session": [{"turns": len(a.turns), "history_tokens": a.history_seen, "lost": a.lost, "warmup_s": a.warmup_s,
                         "after_run": c, "resume_checks": a.resume_checks,
                         "resumed_after_kill_s": a.resumed_after_kill, "errors": len(a.errors),
                         "error_kinds": sorted({e["kind"] for e in a.errors})} for a, c in zip(agents, final_checks)],
        "invariant_violations": violations, "sessions_failed": failed,
        "saves": {"count": save_n, "mean_s": save_sum / save_n if save_n else None},
        "loads": {"count": load_n, "mean_s": load_sum / load_n if load_n else None},
        "gates": {
            "G1_resident_kv_peak_drift": g1, "G1_pass": g1 is not None and g1 < 0.10,
            "G2_turn_p50_drift_first_to_last": g2, "G2_pass": g2 is not None and g2 < 0.50,
            "G4_invariant_violations": violations["inv1"] + violations["inv2"],
            "G4_pass": violations["inv1"] + violations["inv2"] == 0,
            "G5_every_call_through_sdk": True,
            "no_session_lost": lost == 0 and regressed == 0,
        },
    }


def first_token_s(session, new: list[int]) -> tuple[float, int]:
    """Client-side time from the append to the first streamed token (the stream is then drained)."""
    t0 = time.perf_counter()
    if new:
        session.append(new)
    stream = session.generate(1)
    tok = next(iter(stream))
    dt = time.perf_counter() - t0
    for _ in stream:
        pass
    return dt, tok


def ttft_daemon(args, ids, work: str, strategy: str, n_hist: int, n_new: int) -> dict:
    """(b) re-prefill: a new session with the whole history (daemon at --threads); (a) the same session
    resumed from disk after kill -9 + restart, appending n_new new tokens; then (a') `reloads` more loads
    from disk in the same daemon (capacity 1: creating a small session spills the big one, the next call
    loads it). (a) and (a') are taken once per --ttft-threads count (a kill -9 and a restart with that
    --threads each), as llama.cpp's restore is: the count with the faster median is the comparison."""
    import kakeya

    state = tempfile.mkdtemp(prefix=f"ttft-{strategy}-", dir=work)  # a fresh one per leg of a resumed run
    d = Daemon(args, state, "--kv-strategy", strategy, "--capacity", "1")
    d.start()
    hist = ids[:n_hist]
    counts = [int(t) for t in (args.ttft_threads or f"1,{args.threads}").split(",")]
    counts = sorted(set(counts), key=counts.index)
    rounds = len(counts) * (1 + args.reloads)
    new = [ids[n_hist + i * n_new:n_hist + (i + 1) * n_new] for i in range(1 + rounds)]
    try:
        with kakeya.Client(d.target) as c:
            t0 = time.perf_counter()
            whole = hist + new[0]
            piece = 16384  # the daemon's default --max-append-tokens: a longer history goes in several calls
            s = c.create_session(whole[:piece], ignore_eos=True)
            for i in range(piece, len(whole), piece):
                s.append(whole[i:i + piece])
            reprefill, first = first_token_s(s, [])
            reprefill += time.perf_counter() - t0 - reprefill  # CreateSession and appends included (no model work)
        d.kill9()
    finally:
        d.stop()
    by_threads, k = {}, 1
    for t in counts:
        d = Daemon(args, state, "--kv-strategy", strategy, "--capacity", "1", "--threads", str(t))
        try:
            restart = d.start()
            load_avg = os.getloadavg()[0]
            with kakeya.Client(d.target) as c:
                s2 = c.session(s.id)
                resumed, first_resumed = first_token_s(s2, new[k])
                k += 1
                reloads = []
                for _ in range(args.reloads):
                    c.create_session([1, 2, 3])  # capacity 1: the big session is spilled
                    reloads.append(first_token_s(s2, new[k])[0])
                    k += 1
            m = d.metrics() or {}
            d.kill9()  # the next count resumes after a kill -9 too
        finally:
            d.stop()
        n_loads = m.get("session_load_duration_seconds_count") or 0
        by_threads[t] = {"resumed_ttft_s": resumed, "reloaded_after_spill_ttft_s": reloads,
                         "median": statistics.median([resumed, *reloads]), "restart_s": restart, "loads": n_loads,
                         "load_s_mean": (m.get("session_load_duration_seconds_sum") or 0) / max(1.0, n_loads),
                         "first_token": first_resumed, "load_average_1m": load_avg}
    best = min(by_threads, key=lambda t: by_threads[t]["median"])
    b = by_threads[best]
    return {"strategy": strategy, "history_tokens": n_hist + n_new, "new_tokens": n_new,
            "reprefill_ttft_s": reprefill, "reprefill_threads": args.threads, "resume_by_threads": by_threads,
            "best_threads": best, "resumed_ttft_s": b["resumed_ttft_s"], "reloaded_after_spill_ttft_s": b["reloaded_after_spill_ttft_s"],
            "restart_s": b["restart_s"], "loads": b["loads"], "load_s_mean": b["load_s_mean"],
            "state_bytes": dir_bytes(state), "first_tokens": [first, b["first_token"]]}


def ttft_llama_cpp(args, ids, work: str, n_hist: int, n_new: int) -> dict:
    import llama_cpp
    import numpy as np

    from inference_engine.model_store import resolve_model

    gguf = str(resolve_model(args.model) / "source.gguf")
    n_ctx = n_hist + 4 * n_new + 64
    hist, new = ids[:n_hist + n_new], ids[n_hist + n_new:n_hist + 2 * n_new]
    threads = args.llama_threads or args.threads
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    t0 = time.perf_counter()
    llm.eval(hist)
    prefill = time.perf_counter() - t0
    path = os.path.join(work, "llama.state")
    arr = (llama_cpp.llama_token * len(hist))(*hist)
    t0 = time.perf_counter()
    assert llama_cpp.llama_state_save_file(llm._ctx.ctx, path.encode(), arr, len(hist))
    save_s = time.perf_counter() - t0
    del llm
    by_threads = {}
    for t in sorted({1, threads, args.threads}):
        llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=t, n_threads_batch=t, n_batch=512,
                              verbose=False)  # "restart"; batch threads too (llama-cpp-python defaults them to every core)
        restores = []
        for _ in range(1 + args.reloads):
            t0 = time.perf_counter()
            out = (llama_cpp.llama_token * n_ctx)()
            n_out = ctypes_size_t()
            assert llama_cpp.llama_state_load_file(llm._ctx.ctx, path.encode(), out, n_ctx, n_out)
            n = n_out.value
            llm.n_tokens = n
            llm.input_ids[:n] = np.array(out[:n], dtype=np.intc)
            llm.eval(new)
            first = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))  # last row's logits
            restores.append(time.perf_counter() - t0)
        by_threads[t] = {"restore_ttft_s_all": restores, "median": statistics.median(restores), "min": min(restores)}
        del llm
    best = min(by_threads, key=lambda t: by_threads[t]["median"])
    return {"llama_cpp_version": llama_cpp.__version__, "gguf": os.path.relpath(gguf, os.path.expanduser("~")),
            "prefill_s": prefill, "prefill_threads": threads, "state_file_bytes": os.path.getsize(path), "save_s": save_s,
            "restore_by_threads": by_threads, "restore_ttft_s_median": by_threads[best]["median"], "best_threads": best,
            "restored_tokens": n, "first_token": first}


def ctypes_size_t():
    import ctypes

    return ctypes.c_size_t(0)


def plot(doc: dict, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lr = doc["long_run"]
    b = lr["buckets"]
    x = [(r["start_s"] + r["end_s"]) / 2 / 60 for r in b]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    nan = float("nan")

    def col(key, scale=1.0):
        return [nan if r[key] is None else r[key] / scale for r in b]

    ax[0].plot(x, col("turn_latency_p50_s"), "o-", label="p50")
    ax[0].plot(x, col("turn_latency_p95_s"), "s--", label="p95")
    if lr["kill"]:
        for a in ax[:2]:
            a.axvline(lr["kill"]["killed_at_s"] / 60, color="red", ls=":", label="SIGKILL + restart")
    for lg in lr.get("legs", [])[1:]:
        for a in ax[:2]:
            a.axvline(lg["run_start"] / 60, color="purple", ls="--", label="machine stop (--resume)")
    ax[0].set(xlabel="minutes", ylabel="turn latency (s)", title=f"{lr['sessions']} concurrent sessions")
    ax[0].legend()
    ax[1].plot(x, col("kv_resident_peak_bytes", 2**20), "o-", label="resident KV peak")
    ax[1].plot(x, col("kv_stored_peak_bytes", 2**20), "s--", label="stored on disk peak")
    ax[1].set(xlabel="minutes", ylabel="MiB", title="KV per bucket")
    ax[1].legend()
    t = doc["ttft_8k"]
    labels, vals = [], []
    for r in t["kakeya"]:
        labels += [f"resumed\n{r['strategy']}", f"re-prefill\n{r['strategy']}"]
        vals += [r["reload_ttft_s_median"], r["reprefill_ttft_s"]]
    if t.get("llama_cpp") and "restore_ttft_s_median" in t["llama_cpp"]:
        labels.append("llama.cpp\nstate restore")
        vals.append(t["llama_cpp"]["restore_ttft_s_median"])
    ax[2].bar(range(len(vals)), vals, color=["tab:green", "tab:gray"] * len(t["kakeya"]) + ["tab:orange"])
    ax[2].set_xticks(range(len(vals)), labels, fontsize=8)
    ax[2].set_yscale("log")
    ax[2].set(ylabel="seconds (log)", title=f"time to first token at {t['kakeya'][0]['history_tokens']} tokens")
    for i, v in enumerate(vals):
        ax[2].text(i, v, f"{v:.2f}s", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, default=3.0, help="short run")
    g.add_argument("--hours", type=float, default=None, help="the full gate: --hours 4")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-strategy", default="sink_window")
    ap.add_argument("--initial-tokens", type=int, default=1100, help="first append per session (past the window)")
    ap.add_argument("--large-append-p", type=float, default=0.08)
    ap.add_argument("--bucket-seconds", type=float, default=None, help="default: 600 for runs >= 1 h, else duration / 6")
    ap.add_argument("--short-buckets", type=int, default=6)
    ap.add_argument("--sample-seconds", type=float, default=1.0)
    ap.add_argument("--ttft-history", type=int, default=8000)
    ap.add_argument("--ttft-new", type=int, default=16)
    ap.add_argument("--ttft-strategies", default="sink_window,full")
    ap.add_argument("--reloads", type=int, default=3, help="extra spill + reload samples per strategy")
    ap.add_argument("--ttft-threads", default=None,
                    help="daemon --threads counts the resumed TTFT is taken at (a restart each; the faster median is "
                         "the comparison, as for llama.cpp's restore); default 1,--threads")
    ap.add_argument("--skip-long-run", action="store_true")
    ap.add_argument("--ttft-only", action="store_true",
                    help="the TTFT comparison alone (no long run), written to results/parts/session_ttft/ttft_8k.json "
                         "unless --out is given")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--llama-threads", type=int, default=1,
                    help="llama.cpp threads for its 8k prefill (its restore is timed at 1 and --threads threads; the "
                         "faster median is the comparison)")
    ap.add_argument("--note", default="shared 2-core box: other engineers' jobs ran beside this one, timings are noisy")
    ap.add_argument("--out", default=None, help="default: results/bench_session_long_run.json "
                                                  "(--ttft-only: results/parts/session_ttft/ttft_8k.json)")
    ap.add_argument("--work-dir", default=None,
                    help="keep the run's state (daemon state directories, checkpoint) here, not in a temporary "
                         "directory removed at the end: needed to --resume it")
    ap.add_argument("--resume", metavar="WORK_DIR", default=None,
                    help="go on with the run whose processes died (a machine stop) from WORK_DIR's checkpoint, "
                         "with that run's settings; the stopped time is not counted as run time")
    ap.add_argument("--checkpoint-seconds", type=float, default=30.0)
    ap.add_argument("--kill-at", type=float, default=0.5, help="the daemon's SIGKILL, as a fraction of the run time")
    args = ap.parse_args()
    ckpt: dict = {}
    if args.resume:
        with open(os.path.join(args.resume, CHECKPOINT)) as f:
            ckpt = json.load(f)
        # the run's settings; options added since the checkpoint was written take their defaults
        args = argparse.Namespace(**{**vars(ap.parse_args([])), **ckpt["config"], "work_dir": args.resume, "resume": args.resume})
    if args.ttft_only:
        args.skip_long_run = True
    if args.out is None:
        args.out = str(ROOT / "results" / ("parts/session_ttft/ttft_8k.json" if args.ttft_only else "bench_session_long_run.json"))

    from inference_engine.model_store import resolve_model

    ids = corpus(str(resolve_model(args.model)))
    # the history, then one chunk of new tokens per turn: re-prefill, and per thread count the resume + reloads
    counts = len(set((args.ttft_threads or f"1,{args.threads}").split(",")))
    need = args.ttft_history + (2 + counts * (1 + args.reloads)) * args.ttft_new
    while len(ids) < need:
        ids = ids + ids
    config = {k: v for k, v in vars(args).items() if k not in ("resume",)}
    ckpt.setdefault("config", config)
    doc = run_metadata(config)
    doc["note"] = args.note
    work = args.work_dir or tempfile.mkdtemp(prefix="kakeya-long-run-")
    os.makedirs(work, exist_ok=True)
    try:
        if not args.skip_long_run:
            if "long_run" not in ckpt:
                ckpt["long_run"] = long_run(args, ids, work, ckpt)
                write_checkpoint(work, ckpt)
            doc["long_run"] = ckpt["long_run"]
            print({k: v for k, v in doc["long_run"].items() if k in ("gates", "sessions_lost", "kill", "saves", "machine_stops")})
        rows = [ttft_daemon(args, ids, work, st, args.ttft_history, args.ttft_new) for st in args.ttft_strategies.split(",")]
        ttft = {"kakeya": rows}
        if not args.skip_llama_cpp:
            try:
                ttft["llama_cpp"] = ttft_llama_cpp(args, ids, work, args.ttft_history, args.ttft_new)
            except Exception as e:  # noqa: BLE001 - record why the arm is missing
                ttft["llama_cpp"] = {"error": f"{type(e).__name__}: {e}"}
        lc = ttft.get("llama_cpp", {}).get("restore_ttft_s_median")
        for r in rows:
            r["speedup_vs_reprefill"] = r["reprefill_ttft_s"] / r["resumed_ttft_s"]
            r["reload_ttft_s_median"] = statistics.median([r["resumed_ttft_s"], *r["reloaded_after_spill_ttft_s"]])
            r["vs_llama_cpp_restore"] = r["reload_ttft_s_median"] / lc if lc else None  # medians of both
            r["gate_20x_pass"] = r["speedup_vs_reprefill"] >= 20
            r["gate_1p5x_llama_cpp_pass"] = r["vs_llama_cpp_restore"] is not None and r["vs_llama_cpp_restore"] <= 1.5
        doc["ttft_8k"] = ttft
        doc["load_average_at_end"] = os.getloadavg()
        print(ttft)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    out = ROOT / args.out if not os.path.isabs(args.out) else pathlib.Path(args.out)
    write_json(out, doc)
    if "long_run" in doc:
        plot(doc, os.path.splitext(str(out))[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
