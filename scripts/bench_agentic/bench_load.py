"""Many agents at once: N concurrent sessions with an agent-like mix, side by side in one run.

Per level (--levels concurrent sessions), every session runs --turns turns on its own thread:
append a tool result of 40-400 tokens (sizes drawn per turn), then stream --generate tokens.
Arms, one after another on the same machine and thread count:
  kakeya-batching-on   `kakeya serve --weights <fmt> --batching on` (other flags default: capacity 16,
                       sessions persisted per turn to a temporary --state-dir), driven through the Python SDK
  kakeya-batching-off  the same daemon with --batching off (one session's step per forward)
  kakeya-batching-on-auto  batching on with --compile auto (the daemon's default; on the CPU the native row step:
                       backends/torch/native.py); the arms without the suffix run --compile off
  kakeya-batching-on-chunkN  batching on with --prefill-chunk N (smaller chunks bound the inter-token
                       latency others see while an append lands, at some prefill cost)
  kakeya-batching-on-sharedN  batching on with --prefill-chunk-shared N (a forward's token budget while other
                       sessions decode: their rows, then prefill; the default 8); combines with -chunkN before it
  kakeya-...-int8      (last suffix) the daemon with --activations int8 (the CPU int4 kernel's activations as one
                       int8 plane with outlier channels; the default int16 is two planes), e.g. batching-on-auto-int8
  llama.cpp-batched    llama.cpp on the same GGUF with n sequences in one context (n_seq_max = n), each
                       forward carrying one token per decoding sequence plus up to --llama-chunk prefill
                       tokens: llama-server's continuous batching, driven in-process through
                       llama-cpp-python's low-level API (no transport in the loop: favours llama.cpp)
  llama.cpp            llama-cpp-python's `Llama` class (what its high-level API supports: one sequence
                       per context): each session gets its own `Llama` (own KV, prefix reuse) and they
                       run one call at a time
Per level and arm: aggregate tok/s (generated tokens / wall time of the level: the agent mix,
prefill included), per-session decode tok/s, p50/p95 inter-token latency and time to first
token, errors, sessions lost, the server's peak RSS; then pure decode (every session generates
--decode-tokens at once after a 32-token history: aggregate decode tok/s). At
--interference-levels the level runs again while one more session appends --big-append tokens.
--duration-s turns it into the long-load run. For our daemon every level, decode run and interference run also
records "engine": its forwards over that stretch, read from its /metrics (mean forward ms, the model thread's busy
share, decode/verify rows and prefill tokens per forward). Writes results/bench_load.json and .png.
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
from bench_common import ROOT, git_state, percentile, run_metadata, write_json  # noqa: E402


def workload(session: int, turns: int, seed: int, vocab: int = 40000):
    """Tool-result appends of 40-400 token ids in [100, min(vocab, 40000))."""
    rng = random.Random(seed * 1000 + session)
    hi = min(vocab, 40000)
    return [[rng.randrange(100, hi) for _ in range(rng.randrange(40, 401))] for _ in range(turns)]


ENGINE_COUNTERS = ("engine_forwards_run", "engine_forward_seconds", "engine_row_tokens_run", "engine_prefill_tokens_run")


def engine_make_up(before: dict, after: dict, wall_s: float) -> dict:
    """What the daemon's forwards were over a stretch of wall time, from two scrapes of its engine counters:
    forwards, mean forward ms, the model thread's busy share (time in forwards / wall), decode/verify rows and
    prefill tokens per forward."""
    d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
    n = d["engine_forwards_run"]
    return {"forwards": int(n), "forward_ms_mean": round(1e3 * d["engine_forward_seconds"] / n, 2) if n else None,
            "busy_share": round(d["engine_forward_seconds"] / wall_s, 3) if wall_s > 0 else None,
            "rows_per_forward": round(d["engine_row_tokens_run"] / n, 2) if n else None,
            "prefill_tokens_per_forward": round(d["engine_prefill_tokens_run"] / n, 2) if n else None}


def parse_arm(arm: str) -> tuple[str, int | None, int | None, str, str | None]:
    """A kakeya arm's name -> (--batching, --prefill-chunk or None, --prefill-chunk-shared or None, --compile,
    --activations or None): batching-on|off[-chunkN][-sharedN][-compile|-auto][-int8]."""
    rest, activations = arm, None
    if rest.endswith("-int8"):
        rest, activations = rest[: -len("-int8")], "int8"
    compile_mode = "off"
    for suffix, m in (("-compile", "on"), ("-auto", "auto")):
        if rest.endswith(suffix):
            rest, compile_mode = rest[: -len(suffix)], m
    rest, _, shared = rest.partition("-shared")
    mode, _, chunk = rest.removeprefix("batching-").partition("-chunk")
    return mode, int(chunk) if chunk else None, int(shared) if shared else None, compile_mode, activations


class Daemon:
    def __init__(self, model, weights, batching, threads, state_dir, prefill_chunk=None, compile="off", shared=None,
                 activations=None):
        # Product defaults otherwise (capacity 16, --persist turn): at 16+ sessions eviction spills to disk.
        from inference_engine.server.cluster import free_port

        self.metrics_port = free_port()
        cmd = [os.path.join(os.path.dirname(sys.executable), "kakeya"), "serve", "--bind", "127.0.0.1:0", "--model", model,
               "--weights", weights, "--compile", compile, "--metrics-port", str(self.metrics_port),
               "--batching", batching, "--threads", str(threads), "--state-dir", state_dir]
        if prefill_chunk:
            cmd += ["--prefill-chunk", str(prefill_chunk)]
        if shared is not None:
            cmd += ["--prefill-chunk-shared", str(shared)]
        if activations is not None:
            cmd += ["--activations", activations]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"kakeya serve did not start: {line!r}")
        self.target = f"127.0.0.1:{line.split()[1]}"

    def engine(self) -> dict:
        """The daemon's engine counters now (its /metrics, read with prometheus_client's parser)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).read().decode()
        return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in ENGINE_COUNTERS}

    def measured(self, fn):
        """fn()'s result (a dict) with the engine's make-up over the call (`engine_make_up`) as its "engine"."""
        before, t0 = self.engine(), time.perf_counter()
        out = fn()
        out["engine"] = engine_make_up(before, self.engine(), time.perf_counter() - t0)
        return out

    def rss(self):
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def turns_of(session: int, args, vocab: int = 40000):
    """The session's tool-result appends: --turns of them, or (--duration-s) as many as fit."""
    if not args.duration_s:
        yield from workload(session, args.turns, args.seed, vocab)
        return
    deadline, k = time.perf_counter() + args.duration_s, 0
    while time.perf_counter() < deadline:
        yield from workload(session, 1, args.seed * 7919 + k, vocab)
        k += 1


def run_level_kakeya(target, n, args, rss_probe, big_append: int = 0):
    """n sessions through the Python SDK; big_append > 0: one more session appends that many tokens
    (and generates --generate) once the others are streaming, and only the n sessions are measured."""
    import kakeya

    results = [None] * n
    peak = [rss_probe()]
    stop = threading.Event()
    streaming = threading.Semaphore(0)  # released once per session at its first token

    def sample_rss():
        while not stop.wait(0.1):
            peak[0] = max(peak[0], rss_probe())

    def session_thread(i):
        rec = {"itl": [], "ttft": [], "tokens": 0, "decode_s": 0.0, "errors": [], "lost": False, "turns": 0}
        try:
            with kakeya.Client(target) as client, client.create_session(ignore_eos=True) as s:
                for turn in turns_of(i, args, client.server_info().vocab_size):
                    s.append(turn)
                    timed_turn(rec, s.generate(max_tokens=args.generate), streaming.release if rec["turns"] == 0 else None)
                    rec["turns"] += 1
        except Exception as e:  # noqa: BLE001 - recorded per session
            rec["errors"].append(f"{type(e).__name__}: {e}")
            rec["lost"] = "NotFound" in type(e).__name__
        results[i] = rec

    big = {}

    def big_thread():
        try:
            with kakeya.Client(target) as client, client.create_session(ignore_eos=True) as s:
                for _ in range(n):  # every measured session is streaming
                    streaming.acquire(timeout=600)
                t0 = time.perf_counter()
                hi = min(40000, client.server_info().vocab_size)
                s.append([100 + (i * 37) % (hi - 100) for i in range(big_append)])
                toks = list(s.generate(max_tokens=args.generate))
                big.update(tokens=len(toks), seconds=round(time.perf_counter() - t0, 2))
        except Exception as e:  # noqa: BLE001
            big["error"] = f"{type(e).__name__}: {e}"

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    extra = threading.Thread(target=big_thread) if big_append else None
    if extra is not None:
        extra.start()
    wall = run_sessions(session_thread, n)
    if extra is not None:
        extra.join()
    stop.set()
    out = summarize(results, wall, peak[0])
    if big_append:
        out["big_append"] = {"tokens": big_append, **big}
        out["errors"] += int("error" in big)
    return out


def decode_kakeya(target, n, args) -> dict:
    """Pure decode at n sessions: each session holds a short history (32 tokens, prefilled), then
    all start generating --decode-tokens at once; aggregate decode tok/s = n * tokens / time until
    the last stream ends."""
    import kakeya

    start, ends, errors = threading.Barrier(n + 1), [None] * n, []

    def one(i):
        try:
            with kakeya.Client(target) as client:
                s = client.create_session(workload(i, 1, args.seed + 99, client.server_info().vocab_size)[0][:32], ignore_eos=True)
                list(s.generate(max_tokens=1))  # prefilled: what follows is decode only
                start.wait(timeout=600)
                got = list(s.generate(max_tokens=args.decode_tokens))
                ends[i] = (time.perf_counter(), len(got))
                s.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
            start.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        start.wait(timeout=600)
    except threading.BrokenBarrierError:
        pass  # a session failed before the start: recorded in errors
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    done = [e for e in ends if e is not None]
    toks = sum(k for _, k in done)
    wall = max(t for t, _ in done) - t0 if done else float("nan")
    return {"sessions": n, "tokens": toks, "wall_s": round(wall, 3), "aggregate_decode_tok_s": round(toks / wall, 2),
            "errors": len(errors), "error_samples": errors[:3]}


def run_sessions(session_thread, n) -> float:
    """Run n session threads at once; the wall time until the last one ends."""
    threads = [threading.Thread(target=session_thread, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def timed_turn(rec, stream, on_first_token=None) -> list:
    """Consume one turn's token stream, recording time to first token, inter-token gaps and decode
    time; on_first_token (if any) is called once the first token is in."""
    t0, first, last, toks = time.perf_counter(), None, None, []
    for tok in stream:
        now = time.perf_counter()
        if last is None:
            rec["ttft"].append(now - t0)
            first = now
            if on_first_token is not None:
                on_first_token()
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
    llms.clear()  # frees the models (a `del` would unbind the name session_thread reads)
    return out


def run_level_llama_batched(gguf, n, args):
    """llama.cpp with n parallel sequences in one context, batched the way llama-server's slots are:
    each forward (`llama_decode`) carries one token of every decoding sequence plus prefill tokens of
    sequences whose tool result just arrived (up to --llama-chunk per forward), greedy argmax per
    sequence. Driven through llama-cpp-python's low-level API (its `Llama` class runs one sequence).
    Each session's turns follow the same workload as the daemon's; a session's next turn starts
    when its generation ends (the client's append)."""
    import ctypes

    import llama_cpp as lc
    import numpy as np
    import psutil

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    cp = lc.llama_context_default_params()
    cp.n_seq_max, cp.n_ctx = n, 2048 * n
    cp.n_batch = cp.n_ubatch = args.llama_chunk + n
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(model, cp)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(cp.n_batch, 0, n)
    turns = [workload(i, args.turns, args.seed) for i in range(n)]
    # per session: turn index, tokens left to prefill, pos, last sampled token, tokens to generate
    st = [{"turn": 0, "prefill": list(turns[i][0]), "pos": 0, "tok": None, "left": args.generate, "t_turn": None,
           "last": None} for i in range(n)]
    results = [{"itl": [], "ttft": [], "tokens": 0, "decode_s": 0.0, "errors": [], "lost": False, "turns": 0} for _ in range(n)]
    t0 = time.perf_counter()
    for s_ in st:
        s_["t_turn"] = t0
    while any(s_["turn"] < args.turns for s_ in st):
        k, rows = 0, []  # rows: (batch index, session) whose logits are read
        for i, s_ in enumerate(st):  # decoding sequences: one token each
            if s_["turn"] < args.turns and not s_["prefill"] and s_["tok"] is not None:
                rows.append((k, i))
                k = add_token(batch, k, s_["tok"], s_["pos"], i, True)
                s_["pos"] += 1
        room = args.llama_chunk
        for i, s_ in enumerate(st):  # prefill chunks, oldest sessions first, within the chunk budget
            if room <= 0:
                break
            if s_["turn"] < args.turns and s_["prefill"]:
                take, s_["prefill"] = s_["prefill"][:room], s_["prefill"][room:]
                for j, tok in enumerate(take):
                    last = j == len(take) - 1 and not s_["prefill"]
                    if last:
                        rows.append((k, i))
                    k = add_token(batch, k, tok, s_["pos"], i, last)
                    s_["pos"] += 1
                room -= len(take)
        batch.n_tokens = k
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        now = time.perf_counter()
        for idx, i in rows:
            s_, rec = st[i], results[i]
            logits = np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx, idx), ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
            tok = int(logits.argmax())
            if s_["left"] == args.generate:  # first token of the turn
                rec["ttft"].append(now - s_["t_turn"])
                s_["first"] = now
            else:
                rec["itl"].append(now - s_["last"])
            s_["last"], s_["tok"], s_["left"] = now, tok, s_["left"] - 1
            rec["tokens"] += 1
            if s_["left"] == 0:  # turn done: the sampled token is part of the history, the next tool result follows
                rec["decode_s"] += now - s_["first"]
                rec["turns"] += 1
                s_["turn"] += 1
                if s_["turn"] < args.turns:
                    s_["prefill"] = [tok] + list(turns[i][s_["turn"]])
                    s_["tok"], s_["left"], s_["t_turn"] = None, args.generate, now
    wall = time.perf_counter() - t0
    out = summarize(results, wall, psutil.Process().memory_info().rss)
    # Pure decode, as the daemon's: every sequence restarts from a 32-token history, then all decode
    # --decode-tokens in lockstep (one llama_decode per step carrying n tokens).
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    toks = [None] * n
    k = 0
    for i in range(n):
        for p, tok in enumerate(workload(i, 1, args.seed + 99)[0][:32]):
            k = add_token(batch, k, tok, p, i, p == 31)
        batch.n_tokens = k
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx, k - 1), ctypes.POINTER(ctypes.c_float)),
                                       shape=(n_vocab,))
        toks[i] = int(logits.argmax())
        k = 0
    t0 = time.perf_counter()
    for step in range(args.decode_tokens):
        for i in range(n):
            k = add_token(batch, i, toks[i], 32 + step, i, True)
        batch.n_tokens = k
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for i in range(n):
            logits = np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float)),
                                           shape=(n_vocab,))
            toks[i] = int(logits.argmax())
    dwall = time.perf_counter() - t0
    out["decode"] = {"sessions": n, "tokens": n * args.decode_tokens, "wall_s": round(dwall, 3),
                     "aggregate_decode_tok_s": round(n * args.decode_tokens / dwall, 2), "errors": 0}
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return out


def add_token(batch, k, tok, pos, seq, logits) -> int:
    batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = tok, pos, 1, logits
    batch.seq_id[k][0] = seq
    return k + 1


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
            "sessions_lost": sum(r["lost"] for r in results), "peak_rss_bytes": peak_rss,
            "turns": sum(r.get("turns", 0) for r in results),
            "turns_min_per_session": min((r.get("turns", 0) for r in results), default=0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--generate", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="batching-on,batching-off,batching-on-chunk32,llama.cpp-batched,llama.cpp",
                    help="batching-on|batching-off[-chunkN][-sharedN][-compile|-auto][-int8] (kakeya serve, --prefill-chunk "
                         "N, --prefill-chunk-shared N, --activations int8, --compile on "
                         "or auto (on the CPU: the native row step); otherwise --compile off), llama.cpp-batched (n "
                         "sequences in one context, batched decode) and llama.cpp (one Llama object per session, one "
                         "call at a time)")
    ap.add_argument("--decode-tokens", type=int, default=48,
                    help="per level, the pure-decode measurement: every session generates this many at once (0 = skip)")
    ap.add_argument("--llama-chunk", type=int, default=256, help="llama.cpp-batched: prefill tokens per forward")
    ap.add_argument("--duration-s", type=float, default=0.0,
                    help="each session keeps taking turns for this long instead of --turns (the long-load mode)")
    ap.add_argument("--big-append", type=int, default=2048,
                    help="at --interference-levels, one more session appends this many tokens while the others stream")
    ap.add_argument("--interference-levels", default="8", help="levels re-run with the big append ('' = none)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_load.json"))
    args = ap.parse_args()
    at_start = {"load_average_at_start": os.getloadavg(), "commit_at_start": git_state()[0],
                "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    levels = [int(x) for x in args.levels.split(",")]
    interference = [int(x) for x in args.interference_levels.split(",") if x]
    arms = args.arms.split(",")
    out = {"levels": levels, "arms": {}}
    for arm in arms:
        res = {}
        if arm.startswith("batching-"):
            import tempfile

            mode, chunk, shared, compile_mode, activations = parse_arm(arm)
            res["compile"] = compile_mode
            if shared is not None:
                res["prefill_chunk_shared"] = shared
            if activations is not None:
                res["activations"] = activations
            d = Daemon(args.model, args.weights, mode, args.threads, tempfile.mkdtemp(prefix="kakeya-load-"),
                       prefill_chunk=chunk, compile=res["compile"], shared=shared, activations=activations)
            try:
                for n in levels:
                    res[n] = d.measured(lambda: run_level_kakeya(d.target, n, args, d.rss))
                    if args.decode_tokens and not args.duration_s:
                        res[n]["decode"] = d.measured(lambda: decode_kakeya(d.target, n, args))
                        res[n]["errors"] += res[n]["decode"]["errors"]
                    print(arm, n, res[n]["aggregate_tok_s"], "tok/s", res[n].get("decode", {}).get("aggregate_decode_tok_s"),
                          "decode tok/s", flush=True)
                for n in interference:
                    key = f"{n}+append{args.big_append}"
                    res[key] = d.measured(lambda: run_level_kakeya(d.target, n, args, d.rss, big_append=args.big_append))
                    print(arm, key, "itl p95", res[key]["itl_p95_s"], flush=True)
            finally:
                d.close()
        elif arm in ("llama.cpp", "llama.cpp-batched"):
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                why = "llama_cpp is not installed: install the bench extra (make bench-deps)"
                print(f"{arm} arm skipped: {why}")
                out.setdefault("skipped_arms", {})[arm] = why  # asked for, not run: the JSON says so
                continue
            from inference_engine.model_store import resolve_model

            gguf = pathlib.Path(resolve_model(args.model)) / "source.gguf"
            for n in levels:
                res[n] = (run_level_llama_batched if arm == "llama.cpp-batched" else run_level_llama)(gguf, n, args)
                print(arm, n, res[n]["aggregate_tok_s"], "tok/s", flush=True)
        out["arms"][arm] = res
    if "batching-on" in out["arms"] and "batching-off" in out["arms"]:
        on, off = out["arms"]["batching-on"], out["arms"]["batching-off"]
        out["batching_gain"] = {n: round(on[n]["aggregate_tok_s"] / off[n]["aggregate_tok_s"], 3) for n in levels}
    for ref in ("llama.cpp-batched", "llama.cpp"):
        if "batching-on" in out["arms"] and ref in out["arms"]:
            on, ll = out["arms"]["batching-on"], out["arms"][ref]
            out[f"vs_{ref}"] = {n: round(on[n]["aggregate_tok_s"] / ll[n]["aggregate_tok_s"], 3) for n in levels}
            if all("decode" in on[n] and "decode" in ll[n] for n in levels):
                out[f"decode_vs_{ref}"] = {n: round(on[n]["decode"]["aggregate_decode_tok_s"]
                                                    / ll[n]["decode"]["aggregate_decode_tok_s"], 3) for n in levels}
    out["targets"] = targets(out, levels, interference, args.big_append)
    doc = run_metadata(vars(args) | at_start | {"load_average_at_end": os.getloadavg()}) | out
    path = pathlib.Path(args.out)
    write_json(path, doc)
    plot(out, path.with_suffix(".png"))
    print({k: out.get(k) for k in ("batching_gain", "vs_llama.cpp-batched", "vs_llama.cpp", "targets")})
    return 0


def targets(out, levels, interference, big_append) -> dict:
    """Issue 28's gates, per kakeya arm: aggregate decode at 8 sessions >= 3x one session; p95 inter-token
    latency at 8 sessions while a big append lands <= 5x one session's; zero errors and sessions lost."""
    t = {}
    for arm, res in out["arms"].items():
        levels_of = [r for r in res.values() if isinstance(r, dict)]
        row = {"errors": sum(r["errors"] for r in levels_of), "sessions_lost": sum(r["sessions_lost"] for r in levels_of)}
        if 1 in res and 8 in res:
            row["agent_mix_aggregate_8_vs_1"] = round(res[8]["aggregate_tok_s"] / res[1]["aggregate_tok_s"], 2)
            if "decode" in res[1] and "decode" in res[8]:
                row["decode_aggregate_8_vs_1"] = round(res[8]["decode"]["aggregate_decode_tok_s"]
                                                       / res[1]["decode"]["aggregate_decode_tok_s"], 2)
                row["decode_aggregate_8_vs_1_target"] = ">= 3"
        key = f"8+append{big_append}"
        if 1 in res and key in res and res[1]["itl_p95_s"] and res[key]["itl_p95_s"]:
            row["itl_p95_8_with_append_vs_1"] = round(res[key]["itl_p95_s"] / res[1]["itl_p95_s"], 2)
            row["itl_p95_8_with_append_vs_1_target"] = "<= 5"
        t[arm] = row
    return t


def plot(out, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    levels = out["levels"]
    for arm, res in out["arms"].items():
        if not all(n in res for n in levels):
            continue
        line = axes[0].plot(levels, [res[n]["aggregate_tok_s"] for n in levels], marker="o", label=arm)[0]
        if all("decode" in res[n] for n in levels):
            axes[0].plot(levels, [res[n]["decode"]["aggregate_decode_tok_s"] for n in levels], marker="x", linestyle="--",
                         color=line.get_color())
        axes[1].plot(levels, [res[n]["itl_p95_s"] or 0 for n in levels], marker="o", label=arm)
        axes[2].plot(levels, [res[n]["ttft_p95_s"] or 0 for n in levels], marker="o", label=arm)
    for a, t in zip(axes, ("aggregate tok/s (agent mix; dashed: pure decode)", "p95 inter-token latency (s)",
                           "p95 time to first token (s)")):
        a.set(title=t, xlabel="concurrent sessions", xscale="log", xticks=levels, xticklabels=levels)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
