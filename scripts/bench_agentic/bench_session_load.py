"""Resume cost of a persisted session, in-process: SessionFiles.load alone, and load + append + first
token (what the long-run bench's "resumed from disk" TTFT arm measures, without the gRPC hop and the
daemon restart).

The session is prefilled and saved once under --state-dir/<strategy> (reused by later runs, so a
before / after comparison loads the same files); every sample then loads it with a fresh
SessionFiles, from the page cache (warm: the files were just written or read). --profile prints
where one load spends its time.

    OMP_NUM_THREADS=1 python scripts/bench_agentic/bench_session_load.py --strategy sink_window

Comparing with code from before the CRC-32 segment checksums (3ff9319 and earlier read sha256
only): rewrite the saved manifests' checksums with `--segment-checksums sha256` (this script), then
run the old code's copy of this script on the same --state-dir; `--segment-checksums crc32` turns
them back. The segments themselves are not touched.

--llama-cpp adds llama.cpp's restore of the same history (llama-cpp-python on the model's GGUF: its
state file, saved once beside the session after prefilling the same token ids, loaded with
llama_state_load_file, then the same new tokens evaluated; model and context creation excluded), one
sample after each of ours in the same process at the same thread count: side by side, so a shared
box's load moves both arms alike.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pathlib
import pstats
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--strategy", default="sink_window")
    ap.add_argument("--history", type=int, default=8000)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--state-dir", default=str(pathlib.Path.home() / ".cache" / "kakeya" / "bench_session_load"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--llama-cpp", action="store_true", help="interleave llama.cpp state-file restores (see above)")
    ap.add_argument("--segment-checksums", choices=("keep", "sha256", "crc32"), default="keep",
                    help="rewrite the saved manifests' segment checksums first (see above)")
    args = ap.parse_args()
    from bench_common import run_metadata

    meta = run_metadata(vars(args))  # at the start: its load average is the one the samples began under

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.requests import SamplingParams
    from inference_engine.model_store import resolve_model
    from inference_engine.persistence.session_files import SessionFiles
    from inference_engine.persistence.state_dir import StateDir
    from inference_engine.server.app import build_engine
    from inference_engine.server.config import ServeConfig
    from inference_engine.server.runtime import Runtime

    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    engine = build_engine(ServeConfig(model=args.model, kv_strategy=args.strategy, threads=args.threads), model)
    root = pathlib.Path(args.state_dir) / f"{args.strategy}-{args.weights}-{args.history}"
    sid_file = root / "session_id.txt"
    vocab = engine.model_info.vocab_size
    ids = torch.randint(3, vocab, (args.history + args.new,), generator=torch.Generator().manual_seed(0)).tolist()

    def first_token(rt, sid) -> int:
        for ev in rt.generate(sid, 1, SamplingParams()):
            if isinstance(ev, TokenGenerated):
                return ev.token_id
        raise RuntimeError("no token")

    prefill_ttft = None  # the same history prefilled from scratch (what a server that re-prefills pays): made in this run
    if not sid_file.exists():
        t0 = time.perf_counter()
        rt = Runtime(engine, persister=SessionFiles(StateDir(root), engine))
        s = rt.create_session(ids[:args.history])
        first_token(rt, s.id)  # prefill, first token (the turn's save runs when the turn ends, after it)
        prefill_ttft = time.perf_counter() - t0
        rt.store.flush()
        sid_file.write_text(s.id)
        print(f"prefilled {args.history} tokens to the first token in {prefill_ttft:.1f} s, then saved "
              f"({time.perf_counter() - t0:.1f} s in all)", flush=True)
    sid = sid_file.read_text().strip()
    if args.segment_checksums != "keep":
        rewrite_checksums(StateDir(root).data_dir(sid), args.segment_checksums)
    disk = sum(p.stat().st_size for p in StateDir(root).data_dir(sid).iterdir() if p.is_file())

    class LoadOnly(SessionFiles):  # samples must not save their turn over the files the next one loads
        def save(self, session) -> None:
            pass

    llama = LlamaRestore(args, root, ids) if args.llama_cpp else None
    loads, ttfts, tokens = [], [], []
    for i in range(args.loads):
        files = SessionFiles(StateDir(root), engine)
        t0 = time.perf_counter()
        files.load(sid)
        loads.append(time.perf_counter() - t0)
        rt = Runtime(engine, persister=LoadOnly(StateDir(root), engine))
        t0 = time.perf_counter()
        rt.append(sid, ids[args.history:])  # loads the session
        tokens.append(first_token(rt, sid))
        ttfts.append(time.perf_counter() - t0)
        print(f"sample {i}: load {loads[-1]:.3f} s, load + append + first token {ttfts[-1]:.3f} s", flush=True)
        if llama is not None:
            print(f"sample {i}: llama.cpp restore + eval + first token {llama.sample():.3f} s", flush=True)
    if args.profile:
        files = SessionFiles(StateDir(root), engine)
        prof = cProfile.Profile()
        prof.enable()
        files.load(sid)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    doc = meta | {"strategy": args.strategy, "weights": args.weights, "history": args.history, "new": args.new,
           "threads": args.threads, "disk_bytes": disk, "load_s": loads, "ttft_s": ttfts,
           "load_s_median": statistics.median(loads), "ttft_s_median": statistics.median(ttfts),
           "first_tokens": sorted(set(tokens)), "prefill_ttft_s": prefill_ttft,
           "resume_speedup_vs_prefill": None if prefill_ttft is None else prefill_ttft / statistics.median(ttfts)}
    if llama is not None:
        doc["llama_cpp"] = llama.summary()
        doc["ttft_vs_llama_cpp"] = doc["ttft_s_median"] / doc["llama_cpp"]["restore_ttft_s_median"]
    print(json.dumps({k: v for k, v in doc.items() if not isinstance(v, list) or k == "first_tokens"}))
    doc["load_average_at_end"] = os.getloadavg()
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


class LlamaRestore:
    """llama.cpp's side: the state file of the same history (made once), restored into one context."""

    def __init__(self, args, root: pathlib.Path, ids: list):
        import llama_cpp

        from inference_engine.model_store import resolve_model

        self.lc = llama_cpp
        gguf = str(resolve_model(args.model) / "source.gguf")
        self.n_ctx = args.history + 4 * args.new + 64
        self.hist, self.new = ids[:args.history], ids[args.history:]
        self.path = root.parent / f"llama-{args.history}.state"  # one per history: the token ids do not depend on the strategy
        self.info = {"llama_cpp_version": llama_cpp.__version__, "threads": args.threads}
        if not self.path.exists():
            llm = llama_cpp.Llama(model_path=gguf, n_ctx=self.n_ctx, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                                  verbose=False)
            t0 = time.perf_counter()
            llm.eval(self.hist)
            arr = (llama_cpp.llama_token * len(self.hist))(*self.hist)
            assert llama_cpp.llama_state_save_file(llm._ctx.ctx, str(self.path).encode(), arr, len(self.hist))
            print(f"llama.cpp: prefilled and saved {args.history} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
            del llm
        self.info["state_file_bytes"] = self.path.stat().st_size
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=self.n_ctx, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                                   verbose=False)
        self.times, self.tokens = [], set()

    def sample(self) -> float:
        import ctypes

        import numpy as np

        lc, llm = self.lc, self.llm
        t0 = time.perf_counter()
        out = (lc.llama_token * self.n_ctx)()
        n_out = ctypes.c_size_t(0)
        assert lc.llama_state_load_file(llm._ctx.ctx, str(self.path).encode(), out, self.n_ctx, n_out)
        n = n_out.value
        llm.n_tokens = n
        llm.input_ids[:n] = np.array(out[:n], dtype=np.intc)
        llm.eval(self.new)
        self.tokens.add(int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)))))
        self.times.append(time.perf_counter() - t0)
        return self.times[-1]

    def summary(self) -> dict:
        return self.info | {"restore_ttft_s": self.times, "restore_ttft_s_median": statistics.median(self.times),
                            "first_tokens": sorted(self.tokens)}


def rewrite_checksums(session_dir: pathlib.Path, kind: str) -> None:
    """Record each segment's checksum as `kind` (sha256: what saves before 2026-11-24 wrote)."""
    import hashlib
    import zlib

    from inference_engine.persistence.state_dir import MANIFEST_NAME, manifest_bytes, read_manifest, write_atomic

    body = read_manifest(session_dir)
    for g in body["segments"]:
        data = (session_dir / g["file"]).read_bytes()
        g.pop("crc32", None)
        g.pop("sha256", None)
        g[kind] = hashlib.sha256(data).hexdigest() if kind == "sha256" else f"{zlib.crc32(data):08x}"
    write_atomic(session_dir / MANIFEST_NAME, manifest_bytes(body))


if __name__ == "__main__":
    raise SystemExit(main())
