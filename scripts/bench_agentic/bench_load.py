"""Many agents at once: N concurrent sessions with an agent-like mix, side by side in one run.

Per level (--levels concurrent sessions), every session runs --turns turns on its own thread:
append a tool result of 40-400 tokens (sizes drawn per turn), then stream --generate tokens.
Arms, one after another on the same machine and thread count:
  kakeya-batching-on   `kakeya serve --weights <fmt> --batching on` (other flags default: capacity 16,
                       sessions persisted per turn to a temporary --state-dir), driven through the Python SDK
  kakeya-batching-off  the same daemon with --batching off (one session's step per forward)
  llama.cpp            llama-cpp-python on the same GGUF: its `Llama` object has no cross-sequence
                       batching (one sequence per context), so each session gets its own `Llama`
                       (own KV, prefix reuse) and they run one call at a time
Per level and arm: aggregate tok/s (generated tokens / wall time of the level), per-session
decode tok/s, p50/p95 inter-token latency and time to first token, errors, sessions lost, the
server's peak RSS. Writes results/bench_load.json and .png.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def workload(session: int, turns: int, seed: int):
    rng = random.Random(seed * 1000 + session)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(40, 401))] for _ in range(turns)]


class Daemon:
    def __init__(self, model, weights, batching, threads, state_dir):
        # Product defaults otherwise (capacity 16, --persist turn): at 16+ sessions eviction spills to disk.
        cmd = [str(ROOT / ".venv" / "bin" / "kakeya"), "serve", "--bind", "127.0.0.1:0", "--model", model, "--weights", weights,
               "--batching", batching, "--threads", str(threads), "--state-dir", state_dir]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"kakeya serve did not start: {line!r}")
        self.target = f"127.0.0.1:{line.split()[1]}"

    def rss(self):
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def run_level_kakeya(target, n, args, rss_probe):
    import kakeya

    results = [None] * n
    peak = [rss_probe()]
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(0.1):
            peak[0] = max(peak[0], rss_probe())

    def session_thread(i):
        rec = {"itl": [], "ttft": [], "tokens": 0, "decode_s": 0.0, "errors": [], "lost": False}
        try:
            with kakeya.Client(target) as client, client.create_session(ignore_eos=True) as s:
                for turn in workload(i, args.turns, args.seed):
                    s.append(turn)
                    timed_turn(rec, s.generate(max_tokens=args.generate))
        except Exception as e:  # noqa: BLE001 - recorded per session
            rec["errors"].append(f"{type(e).__name__}: {e}")
            rec["lost"] = "NotFound" in type(e).__name__
        results[i] = rec

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    wall = run_sessions(session_thread, n)
    stop.set()
    return summarize(results, wall, peak[0])


def run_sessions(session_thread, n) -> float:
    """Run n session threads at once; the wall time until the last one ends."""
    threads = [threading.Thread(target=session_thread, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def timed_turn(rec, stream) -> list:
    """Consume one turn's token stream, recording time to first token, inter-token gaps and decode time."""
    t0, first, last, toks = time.perf_counter(), None, None, []
    for tok in stream:
        now = time.perf_counter()
        if last is None:
            rec["ttft"].append(now - t0)
            first = now
        else:
            rec["itl"].append(now - last)
        last = now
        toks.append(tok)
    rec["tokens"] += len(toks)
    rec["decode_s"] += (last - first) if toks else 0.0
    return toks


def llama_stream(llm, history, n, lock):
    """n greedy tokens after `history`; each model call holds `lock` (one call at a time)."""
    gen = None
    for _ in range(n):
        with lock:
            if gen is None:
                gen = llm.generate(history, temp=0.0)  # reset=True keeps the longest common prefix
            tok = next(gen)
        yield tok


def run_level_llama(gguf, n, args):
    from llama_cpp import Llama

    lock = threading.Lock()  # one call at a time: the Llama objects share the machine's threads
    llms = [Llama(model_path=str(gguf), n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
            for _ in range(n)]
    results = [None] * n

    def session_thread(i):
        rec = {"itl": [], "ttft": [], "tokens": 0, "decode_s": 0.0, "errors": [], "lost": False}
        history = []
        try:
            for turn in workload(i, args.turns, args.seed):
                history += turn
                history += timed_turn(rec, llama_stream(llms[i], list(history), args.generate, lock))
        except Exception as e:  # noqa: BLE001
            rec["errors"].append(f"{type(e).__name__}: {e}")
        results[i] = rec

    import psutil

    out = summarize(results, run_sessions(session_thread, n), psutil.Process().memory_info().rss)
    del llms
    return out


def summarize(results, wall, peak_rss):
    itl = [x for r in results for x in r["itl"]]
    ttft = [x for r in results for x in r["ttft"]]
    toks = sum(r["tokens"] for r in results)
    per = [(r["tokens"] - len(r["ttft"])) / r["decode_s"] for r in results if r["decode_s"] > 0]
    return {"sessions": len(results), "wall_s": round(wall, 2), "generated_tokens": toks,
            "aggregate_tok_s": round(toks / wall, 2), "per_session_decode_tok_s_mean": round(sum(per) / len(per), 2) if per else None,
            "itl_p50_s": percentile(itl, 0.5), "itl_p95_s": percentile(itl, 0.95),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
            "errors": sum(len(r["errors"]) for r in results), "error_samples": [e for r in results for e in r["errors"]][:3],
            "sessions_lost": sum(r["lost"] for r in results), "peak_rss_bytes": peak_rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--generate", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="batching-on,batching-off,llama.cpp")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_load.json"))
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    arms = args.arms.split(",")
    out = {"levels": levels, "arms": {}}
    for arm in arms:
        res = {}
        if arm.startswith("batching-"):
            import tempfile

            d = Daemon(args.model, args.weights, arm.removeprefix("batching-"), args.threads, tempfile.mkdtemp(prefix="kakeya-load-"))
            try:
                for n in levels:
                    res[n] = run_level_kakeya(d.target, n, args, d.rss)
                    print(arm, n, res[n]["aggregate_tok_s"], "tok/s", flush=True)
            finally:
                d.close()
        elif arm == "llama.cpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print("llama.cpp arm skipped: install the bench extra (make bench-deps)")
                continue
            from inference_engine.model_store import resolve_model

            gguf = pathlib.Path(resolve_model(args.model)) / "source.gguf"
            for n in levels:
                res[n] = run_level_llama(gguf, n, args)
                print(arm, n, res[n]["aggregate_tok_s"], "tok/s", flush=True)
        out["arms"][arm] = res
    if "batching-on" in out["arms"] and "batching-off" in out["arms"]:
        on, off = out["arms"]["batching-on"], out["arms"]["batching-off"]
        out["batching_gain"] = {n: round(on[n]["aggregate_tok_s"] / off[n]["aggregate_tok_s"], 3) for n in levels}
    if "batching-on" in out["arms"] and "llama.cpp" in out["arms"]:
        on, ll = out["arms"]["batching-on"], out["arms"]["llama.cpp"]
        out["vs_llama_cpp"] = {n: round(on[n]["aggregate_tok_s"] / ll[n]["aggregate_tok_s"], 3) for n in levels}
    doc = run_metadata(vars(args)) | out
    path = pathlib.Path(args.out)
    write_json(path, doc)
    plot(out, path.with_suffix(".png"))
    print({k: out.get(k) for k in ("batching_gain", "vs_llama_cpp")})
    return 0


def plot(out, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    levels = out["levels"]
    for arm, res in out["arms"].items():
        axes[0].plot(levels, [res[n]["aggregate_tok_s"] for n in levels], marker="o", label=arm)
        axes[1].plot(levels, [res[n]["itl_p95_s"] or 0 for n in levels], marker="o", label=arm)
        axes[2].plot(levels, [res[n]["ttft_p95_s"] or 0 for n in levels], marker="o", label=arm)
    for a, t in zip(axes, ("aggregate tok/s", "p95 inter-token latency (s)", "p95 time to first token (s)")):
        a.set(title=t, xlabel="concurrent sessions", xscale="log", xticks=levels, xticklabels=levels)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
