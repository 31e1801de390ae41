"""Failover behind a proxy: 3 daemons sharing a state directory behind HAProxy (`kakeya cluster`), SDK sessions
running turns through it while one daemon is SIGKILLed and later restarted.

Two parts, one after the other on the same cluster:
  side by side  --pair-sessions sessions, one at a time, run --pair-turns pairs of identical-sized turns: one
                through the proxy, one straight to the daemon that holds the session (its owner in the state
                directory), in alternating order; the paired ratio is what the proxy costs a session that never
                moved (issue 32 target: <= 1.1x direct)
  failover      --sessions SDK sessions (one thread each) run --turns turns: append a tool result of
                --append-min..--append-max random token ids, then stream --generate tokens (greedy). Once a
                third of all turns are done, the daemon holding the most sessions is SIGKILLed (no save, no
                release); once two thirds are done (and every affected session answered again) it is restarted
                on its port. A turn that fails is recovered by the client: it reads the session's history
                through the proxy (the SDK retries while the dead daemon's lease holds), checks that it starts
                with exactly what the client had confirmed, and redoes what the daemon does not have.
Reported: sessions lost; turns whose history differs from what the client confirmed (after every turn the
client compares GetHistory with its own record; both must be 0); the time from the kill until every affected
session answered again (target: lease + 5 s); how many sessions moved when the killed daemon came back
(consistent hashing: about a third, exactly the ones it held); p50/p95 turn latency before / during / after
(during = turns that overlap the time from the kill until the restarted daemon is up). The
daemon killed is the one holding the most sessions at that moment; turns past two thirds of a session wait
until it is back (so that "after" has turns). Writes results/bench_cluster.json and .png.

    python scripts/bench_agentic/bench_cluster.py                      # SmolLM2-135M int4, the defaults
    python scripts/bench_agentic/bench_cluster.py --model DIR --turns 6 --out /tmp/c.json   # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, percentile, run_metadata, write_json  # noqa: E402


def stats(xs) -> dict:
    return {"turns": len(xs), "p50_s": _r(percentile(xs, 0.5)), "p95_s": _r(percentile(xs, 0.95)),
            "max_s": _r(max(xs) if xs else None)}


def _r(x, n=3):
    return None if x is None else round(x, n)


class Owners:
    """Which daemon holds each session: the lease's owner.json in the shared state directory, mapped to a daemon
    index through each daemon's GetServerInfo (a restarted daemon is a new name)."""

    def __init__(self, cluster):
        self.cluster, self.index = cluster, {}

    def learn(self, i: int) -> None:
        import kakeya

        with kakeya.Client(self.cluster.daemons[i].address) as c:
            self.index[c.server_info().persistence.daemon_id] = i

    def of(self, sid: str) -> int | None:
        from inference_engine.persistence.state_dir import StateDir

        try:
            owner = json.loads((StateDir(self.cluster.state_dir).data_dir(sid) / "owner.json").read_text())["daemon_id"]
        except (OSError, ValueError, KeyError):
            return None
        return self.index.get(owner)


VOCAB = [40000]  # set from GetServerInfo: ids drawn from [vocab // 8, min(vocab, 40000))


def turn_ids(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(VOCAB[0] // 8, min(VOCAB[0], 40000)) for _ in range(rng.randrange(lo, hi + 1))]


def saved_files(state_dir, sid) -> dict:
    """{file: bytes} of the session's saved segments and manifest (the files its manifest names)."""
    from inference_engine.persistence.state_dir import MANIFEST_NAME, StateDir

    d = StateDir(state_dir).data_dir(sid)
    body = json.loads((d / MANIFEST_NAME).read_text())["body"]
    return {g["file"]: g["bytes"] for g in body["segments"]} | {MANIFEST_NAME: (d / MANIFEST_NAME).stat().st_size}


def side_by_side(cluster, owners: Owners, args) -> dict:
    """Paired turns through the proxy and straight to the session's holder, one session at a time; each turn's
    save is measured too (segments are written once, so a save wrote the files its manifest newly names)."""
    import kakeya

    via_proxy, direct, ratios, written, positions = [], [], [], [], []
    with kakeya.Client(cluster.address) as proxy:
        for k in range(args.pair_sessions):
            rng = random.Random(1000 + k)
            s = proxy.create_session(turn_ids(rng, 64, 64), session_id=f"bench-pair-{k:03d}-{int(time.time())}",
                                     ignore_eos=True)
            s.generate_all(1)  # the first prefill, outside the pairs
            holder = owners.of(s.id)
            with kakeya.Client(cluster.daemons[holder].address) as straight:
                d = straight.session(s.id)
                for t in range(args.pair_turns):
                    ids_a = turn_ids(rng, args.append_min, args.append_max)
                    ids_b = ids_a[::-1]  # same size, other ids: the two arms do the same work
                    took = {}
                    order = (("proxy", s, ids_a), ("direct", d, ids_b)) if t % 2 == 0 else (("direct", d, ids_b), ("proxy", s, ids_a))
                    for arm, handle, ids in order:
                        before = saved_files(cluster.state_dir, s.id)
                        t0 = time.perf_counter()
                        handle.append(ids)
                        handle.generate_all(args.generate)
                        took[arm] = time.perf_counter() - t0
                        after = saved_files(cluster.state_dir, s.id)
                        written.append(sum(n for f, n in after.items() if f not in before or f == "session.json"))
                        positions.append(len(ids) + args.generate)
                    via_proxy.append(took["proxy"])
                    direct.append(took["direct"])
                    ratios.append(took["proxy"] / took["direct"])
            assert owners.of(s.id) == holder, "a pair session moved"
            s.close()
    per_position = [w / p for w, p in zip(written, positions)]
    return {"pairs": len(ratios), "proxy": stats(via_proxy), "direct": stats(direct),
            "save_bytes_per_turn": {"median": int(statistics.median(written)), "max": max(written),
                                    "turn_positions_median": int(statistics.median(positions)),
                                    "bytes_per_new_position_median": int(statistics.median(per_position))},
            "paired_ratio_median": _r(statistics.median(ratios)), "paired_ratio_mean": _r(statistics.fmean(ratios)),
            "ratio_of_medians": _r(statistics.median(via_proxy) / statistics.median(direct)),
            "target": "<= 1.1", "met": statistics.median(ratios) <= 1.1}


class Run:
    """The failover part's shared state: turns done, events, and per-turn records."""

    def __init__(self, total_turns: int):
        self.lock = threading.Lock()
        self.done = 0
        self.total = total_turns
        self.changed = threading.Condition(self.lock)
        self.t0 = time.monotonic()
        self.kill_at = self.restart_at = self.up_at = None
        self.turns: list[dict] = []
        self.errors: list[dict] = []
        self.first_answer_after_kill: dict[str, float] = {}
        self.mismatches: list[dict] = []
        self.lost: list[str] = []
        self.restarted = threading.Event()
        self.per_session: dict[str, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def turn_done(self, record: dict) -> None:
        with self.changed:
            self.turns.append(record)
            self.done += 1
            if record.get("latency_s") is not None:
                self.per_session[record["session"]] = self.per_session.get(record["session"], 0) + 1
            self.changed.notify_all()

    def answered(self, sid: str) -> None:
        with self.lock:
            if self.kill_at is not None and sid not in self.first_answer_after_kill:
                self.first_answer_after_kill[sid] = self.now()

    def wait_turns(self, n: int) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.done >= n)


def retrying(sid, run: Run, args, what: str, attempt):
    """attempt() retried past errors (a daemon dying right then) for up to --recover-timeout-s, each error recorded;
    None when the session is gone or the time is up."""
    import kakeya

    deadline = time.monotonic() + args.recover_timeout_s
    while time.monotonic() < deadline:
        try:
            return attempt()
        except kakeya.SessionNotFoundError:
            return None
        except kakeya.KakeyaError as e:
            with run.lock:
                run.errors.append({"session": sid, "at_s": _r(run.now()), "error": f"{what}: {type(e).__name__}: {e.details[:160]}"})
            time.sleep(0.2)
    return None


def read_history(s, sid, run: Run, args):
    """GetHistory, retried past errors for up to --recover-timeout-s; None: lost."""
    def attempt():
        h = s.history()
        run.answered(sid)
        return h

    return retrying(sid, run, args, "history", attempt)


def agent(k: int, client, run: Run, args, handles: list) -> None:
    """One session's turns; a failed turn is recovered from what the daemon has (GetHistory)."""
    import kakeya

    rng = random.Random(k)
    sid = f"bench-agent-{k:03d}-{int(time.time())}"
    s = client.create_session(turn_ids(rng, 32, 32), session_id=sid, ignore_eos=True)
    handles.append(s)
    confirmed = s.history()
    gate = int(args.turns * args.restart_at)
    for turn in range(args.turns):
        if turn == gate:  # the last turns start once the killed daemon is back, so that "after" has turns
            run.restarted.wait(args.recover_timeout_s + 600)
        ids = turn_ids(rng, args.append_min, args.append_max)
        started, t0, recovered, error = run.now(), time.perf_counter(), False, None
        try:
            s.append(ids)
            run.answered(sid)
            r = s.generate_all(args.generate)
            got = confirmed + ids + list(r.tokens)
        except kakeya.KakeyaError as e:
            error = f"{type(e).__name__}: {e.details[:160]}"
            with run.lock:
                run.errors.append({"session": sid, "turn": turn, "at_s": _r(run.now()), "error": error})
            got = recover(s, sid, confirmed, ids, run, args)
            recovered = True
            if got is None:
                with run.lock:
                    run.lost.append(sid)
                run.turn_done({"session": sid, "turn": turn, "start_s": _r(started), "latency_s": None, "lost": True})
                return
        latency = time.perf_counter() - t0
        run.answered(sid)
        history = read_history(s, sid, run, args)  # what the daemon holds now: must be exactly the client's record
        if history is None:
            with run.lock:
                run.lost.append(sid)
            run.turn_done({"session": sid, "turn": turn, "start_s": _r(started), "latency_s": None, "lost": True})
            return
        if history != got:
            with run.lock:
                run.mismatches.append({"session": sid, "turn": turn, "expected_length": len(got), "got_length": len(history)})
        confirmed = history
        run.turn_done({"session": sid, "turn": turn, "start_s": _r(started), "latency_s": _r(latency), "recovered": recovered,
                       "error": error})
        if args.think_s:
            time.sleep(args.think_s)


def recover(s, sid, confirmed, ids, run: Run, args):
    """After a failed turn: the history the daemon now has must start with what the client confirmed; redo the
    part it lacks. Returns the history once the turn is complete, None if the session cannot be reached."""
    def attempt():
        h = s.history()
        run.answered(sid)
        if h[:len(confirmed)] != confirmed:
            with run.lock:
                run.mismatches.append({"session": sid, "at": "recovery", "confirmed_length": len(confirmed),
                                       "got_length": len(h)})
            return h
        rest = h[len(confirmed):]
        if not rest:
            s.append(ids)
        elif rest != ids and not (rest[:len(ids)] == ids and len(rest) > len(ids)):
            with run.lock:
                run.mismatches.append({"session": sid, "at": "recovery-rest", "confirmed_length": len(confirmed),
                                       "got_length": len(h)})
            return h
        if len(rest) > len(ids):  # the turn was saved before its Done was lost: it happened
            return h
        r = s.generate_all(args.generate)
        return confirmed + ids + list(r.tokens)

    return retrying(sid, run, args, "recovery", attempt)


def controller(cluster, owners: Owners, run: Run, args, out: dict) -> None:
    """SIGKILL the busiest daemon a third of the way in; restart it at two thirds (once every affected session
    answered again); record where the sessions are around each event."""
    run.wait_turns(int(run.total * args.kill_at))
    sessions = sorted({t["session"] for t in run.turns})
    homes = {sid: owners.of(sid) for sid in sessions}
    counts = [sum(1 for v in homes.values() if v == i) for i in range(len(cluster.daemons))]
    victim = max(range(len(counts)), key=counts.__getitem__)
    affected = [sid for sid, i in homes.items() if i == victim]
    with run.lock:
        run.kill_at = run.now()
        run.first_answer_after_kill.clear()
    cluster.kill(victim)
    out.update(victim=cluster.daemons[victim].name, homes_at_kill=homes, affected=affected, kill_at_s=_r(run.kill_at),
               kill_after_turns=run.done)
    down = cluster.wait_state(victim, "DOWN", 60)
    out["haproxy_marked_down_after_s"] = _r(down)
    gate = int(args.turns * args.restart_at)
    with run.changed:  # every agent at its gate (or lost)
        run.changed.wait_for(lambda: sum(1 for n in run.per_session.values() if n >= gate) + len(set(run.lost)) >= args.sessions)
    with run.changed:  # every affected session answered again (or was lost) before the restart
        run.changed.wait_for(lambda: all(sid in run.first_answer_after_kill or sid in run.lost for sid in affected),
                             timeout=args.recover_timeout_s)
    before = {sid: owners.of(sid) for sid in sessions}
    with run.lock:
        run.restart_at = run.now()
    cluster.restart(victim)
    owners.learn(victim)
    with run.lock:
        run.up_at = run.now()
    run.restarted.set()
    out.update(restart_at_s=_r(run.restart_at), up_at_s=_r(run.up_at), owners_before_restart=before)


def capacity(cluster, handles, holder: dict) -> dict:
    """Per daemon: resident memory now and at start, the sessions it holds, their KV bytes; per session: bytes
    on disk (the files its manifest names) and history length."""
    import psutil

    from inference_engine.persistence.state_dir import StateDir

    per_daemon = []
    for i, d in enumerate(cluster.daemons):
        held = [s for s in handles if holder.get(s.id) == i]
        infos = [s.info() for s in held]
        per_daemon.append({"daemon": d.name, "rss_bytes": psutil.Process(d.proc.pid).memory_info().rss,
                           "rss_bytes_at_start": getattr(d, "rss_at_start", None), "sessions": len(held),
                           "kv_live_bytes": sum(x.kv_live_bytes for x in infos)})
    disk = [sum(saved_files(cluster.state_dir, s.id).values()) for s in handles]
    lengths = [s.info().history_length for s in handles]
    state_bytes = sum(p.stat().st_size for p in StateDir(cluster.state_dir).sessions.rglob("*") if p.is_file())
    return {"per_daemon": per_daemon, "session_disk_bytes": {"median": int(statistics.median(disk)), "max": max(disk)},
            "session_history_tokens": {"median": int(statistics.median(lengths)), "max": max(lengths)},
            "state_dir_sessions_bytes": state_bytes}


def failover(cluster, owners: Owners, args) -> dict:
    import kakeya

    run = Run(args.sessions * args.turns)
    out: dict = {}
    ctl = threading.Thread(target=controller, args=(cluster, owners, run, args, out), daemon=True)
    ctl.start()
    handles: list = []
    with kakeya.Client(cluster.address, owner_wait_s=args.recover_timeout_s) as client:
        threads = [threading.Thread(target=agent, args=(k, client, run, args, handles)) for k in range(args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ctl.join(timeout=args.recover_timeout_s + 300)
        sessions = sorted({t["session"] for t in run.turns})
        after = {sid: owners.of(sid) for sid in sessions}  # before the sessions are closed (their leases go with them)
        out["capacity"] = capacity(cluster, handles, after)
        for s in handles:
            try:
                s.close()
            except kakeya.KakeyaError:
                pass
    affected = out.get("affected", [])
    before = out.get("owners_before_restart", {})
    victim = next((i for i, d in enumerate(cluster.daemons) if d.name == out.get("victim")), None)
    out["owners_at_end"] = after
    out["moved_on_return"] = sum(1 for sid in sessions if sid in before and after.get(sid) != before[sid])
    out["returned_home"] = sum(1 for sid in affected if after.get(sid) == victim)
    out["moved_on_return_of"] = len(sessions)
    recover_s = {sid: _r(run.first_answer_after_kill[sid] - run.kill_at) for sid in affected if sid in run.first_answer_after_kill}
    phases = {"before": [], "during": [], "after": []}
    for t in run.turns:
        if t["latency_s"] is None:
            continue
        end = t["start_s"] + t["latency_s"]  # a turn belongs to "during" if it overlaps [kill, restarted daemon up)
        phase = ("before" if run.kill_at is None or end < run.kill_at else
                 "after" if run.up_at is not None and t["start_s"] >= run.up_at else "during")
        phases[phase].append(t["latency_s"])
    out.update(
        sessions=len(sessions), turns=run.done, sessions_lost=len(set(run.lost)), lost=sorted(set(run.lost)),
        history_mismatches=len(run.mismatches), mismatches=run.mismatches, errors=run.errors,
        turns_recovered=sum(1 for t in run.turns if t.get("recovered")),
        recovery_s_per_affected_session=recover_s,
        time_to_recover_s=_r(max(recover_s.values())) if len(recover_s) == len(affected) and affected else None,
        latency=stats([t["latency_s"] for t in run.turns if t["latency_s"] is not None]),
        latency_by_phase={k: stats(v) for k, v in phases.items()}, turn_records=run.turns,
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="each daemon's --threads")
    ap.add_argument("--lease-ttl", type=float, default=10.0, help="the daemons' --lease-ttl (the product default)")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--append-min", type=int, default=24)
    ap.add_argument("--append-max", type=int, default=64)
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=0.0, help="pause between a session's turns")
    ap.add_argument("--kill-at", type=float, default=1 / 3, help="fraction of all turns done at the SIGKILL")
    ap.add_argument("--restart-at", type=float, default=2 / 3, help="fraction of all turns done at the restart")
    ap.add_argument("--recover-timeout-s", type=float, default=120.0, help="a session not answering for this long is lost")
    ap.add_argument("--pair-sessions", type=int, default=4)
    ap.add_argument("--pair-turns", type=int, default=8)
    ap.add_argument("--serve-args", default="", help="more `kakeya serve` flags for every daemon")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_cluster.json"))
    args = ap.parse_args()
    import shlex

    from inference_engine.server.cluster import Cluster

    meta = run_metadata(vars(args))
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="kakeya-bench-cluster-"))
    serve = ["--threads", str(args.threads), "--idle-ttl", "0", *shlex.split(args.serve_args)]
    cluster = Cluster(args.daemons, args.model, run_dir / "state", run_dir, proxy_port=0, first_port=0,
                      lease_ttl=args.lease_ttl, serve_args=serve)
    t0 = time.monotonic()
    with cluster:
        started_s = time.monotonic() - t0
        import psutil

        owners = Owners(cluster)
        for i, d in enumerate(cluster.daemons):
            owners.learn(i)
            d.rss_at_start = psutil.Process(d.proc.pid).memory_info().rss  # the model and the runtime, no session yet
        import kakeya

        with kakeya.Client(cluster.address) as c:
            VOCAB[0] = c.server_info().vocab_size
        print(f"cluster up in {started_s:.1f} s: proxy {cluster.address}", flush=True)
        pairs = side_by_side(cluster, owners, args)
        print("side by side:", {k: pairs[k] for k in ("paired_ratio_median", "ratio_of_medians")}, pairs["proxy"], pairs["direct"],
              flush=True)
        fo = failover(cluster, owners, args)
    doc = meta | {
        "cluster": {"daemons": args.daemons, "proxy": "HAProxy (deploy/haproxy/haproxy.cfg as kakeya cluster writes it)",
                    "started_in_s": _r(started_s), "run_dir": str(run_dir)},
        "load_average_at_end": os.getloadavg(),
        "side_by_side": pairs,
        "failover": fo,
    }
    doc["targets"] = {
        "sessions_lost": {"value": fo["sessions_lost"], "target": 0, "met": fo["sessions_lost"] == 0},
        "history_mismatches": {"value": fo["history_mismatches"], "target": 0, "met": fo["history_mismatches"] == 0},
        "time_to_recover_s": {"value": fo["time_to_recover_s"], "target": f"<= lease {args.lease_ttl:g} + 5 s",
                              "met": fo["time_to_recover_s"] is not None and fo["time_to_recover_s"] <= args.lease_ttl + 5},
        "sessions_moved_on_return": {"value": fo.get("moved_on_return"), "of": fo.get("moved_on_return_of"),
                                     "expected": "the killed daemon's sessions (~1/3), back to it",
                                     "returned_home": fo.get("returned_home"), "affected": len(fo.get("affected", []))},
        "proxy_vs_direct": {"value": pairs["paired_ratio_median"], "target": "<= 1.1", "met": pairs["met"]},
    }
    path = pathlib.Path(args.out)
    write_json(path, doc)
    plot(doc, path.with_suffix(".png"))
    print(json.dumps(doc["targets"], indent=1))
    return 0


def plot(doc, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fo, pairs = doc["failover"], doc["side_by_side"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    a = axes[0]
    turns = [t for t in fo["turn_records"] if t["latency_s"] is not None]
    a.scatter([t["start_s"] for t in turns if not t.get("recovered")], [t["latency_s"] for t in turns if not t.get("recovered")],
              s=8, label="turn")
    a.scatter([t["start_s"] for t in turns if t.get("recovered")], [t["latency_s"] for t in turns if t.get("recovered")],
              s=18, marker="x", color="red", label="turn recovered after an error")
    for key, label, color in (("kill_at_s", "SIGKILL", "red"), ("restart_at_s", "restart", "gray"), ("up_at_s", "up again", "green")):
        if fo.get(key) is not None:
            a.axvline(fo[key], color=color, linestyle="--", label=f"{label} ({fo[key]:.0f} s)")
    a.set(title=f"turn latency: {fo['sessions']} sessions, lost {fo['sessions_lost']}, mismatches {fo['history_mismatches']}, "
                f"recovered in {fo['time_to_recover_s']} s", xlabel="turn start (s)", ylabel="append + generate (s)")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    b = axes[1]
    names = ["before", "during", "after"]
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [fo["latency_by_phase"][n]["p50_s"] or 0 for n in names], width=0.4, label="p50")
    b.bar([i + 0.2 for i in x], [fo["latency_by_phase"][n]["p95_s"] or 0 for n in names], width=0.4, label="p95")
    b.set(xticks=list(x), xticklabels=names, title="turn latency by phase (s)")
    b.legend(fontsize=8)
    b.grid(alpha=0.3, axis="y")
    c = axes[2]
    c.bar([0, 1], [pairs["direct"]["p50_s"], pairs["proxy"]["p50_s"]], width=0.5, label="p50")
    c.scatter([0, 1], [pairs["direct"]["p95_s"], pairs["proxy"]["p95_s"]], color="k", marker="_", s=400, label="p95")
    c.set(xticks=[0, 1], xticklabels=["direct", "through HAProxy"],
          title=f"side by side: paired ratio {pairs['paired_ratio_median']}x (median)")
    c.legend(fontsize=8)
    c.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
