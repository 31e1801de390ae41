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
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pathlib
import pstats
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


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
    ap.add_argument("--segment-checksums", choices=("keep", "sha256", "crc32"), default="keep",
                    help="rewrite the saved manifests' segment checksums first (see above)")
    args = ap.parse_args()

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

    if not sid_file.exists():
        t0 = time.perf_counter()
        rt = Runtime(engine, persister=SessionFiles(StateDir(root), engine))
        s = rt.create_session(ids[:args.history])
        first_token(rt, s.id)  # prefill + save
        sid_file.write_text(s.id)
        print(f"prefilled and saved {args.history} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    sid = sid_file.read_text().strip()
    if args.segment_checksums != "keep":
        rewrite_checksums(root / "sessions" / sid, args.segment_checksums)
    disk = sum(p.stat().st_size for p in (root / "sessions" / sid).iterdir())

    class LoadOnly(SessionFiles):  # samples must not save their turn over the files the next one loads
        def save(self, session) -> None:
            pass

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
    if args.profile:
        files = SessionFiles(StateDir(root), engine)
        prof = cProfile.Profile()
        prof.enable()
        files.load(sid)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    doc = {"strategy": args.strategy, "weights": args.weights, "history": args.history, "new": args.new,
           "threads": args.threads, "disk_bytes": disk, "load_s": loads, "ttft_s": ttfts,
           "load_s_median": statistics.median(loads), "ttft_s_median": statistics.median(ttfts),
           "first_tokens": sorted(set(tokens))}
    print(json.dumps({k: v for k, v in doc.items() if not isinstance(v, list) or k == "first_tokens"}))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


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
