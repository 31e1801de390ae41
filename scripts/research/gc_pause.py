"""Python's garbage collector in a process holding the served model: what a full collection costs, before and after
the daemon's gc.freeze() of its start-up objects (server/app.freeze_startup_objects), and the collections that run
while it decodes.

Loads the model as `kakeya serve` does (int4, the native row step where it builds), warms up, then:
  1. full collection: median ms of --collections gc.collect() calls, and the objects the collector tracks;
  2. decoding: --steps greedy decode steps of one session, every collection timed through gc.callbacks (generation
     and ms);
each without freezing, then after gc.freeze(). Writes results/research/gc_pause.json.

    python scripts/research/gc_pause.py
"""
from __future__ import annotations

import argparse
import gc
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--model-dir", default=None, help="a model directory instead of the store's --model")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--collections", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "gc_pause.json"))
    args = ap.parse_args(argv)

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.tuning import warm_up
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store.store import kakeya_home
    from inference_engine.server.app import freeze_startup_objects

    torch.set_num_threads(args.threads)
    path = pathlib.Path(args.model_dir) if args.model_dir else kakeya_home() / "models" / args.model
    model = TorchCausalLM.load(path, weights=args.weights)
    native = model.use_native_step(q4=True) if args.weights in ("int4", "int8") else False
    engine = Engine(model, KVStrategy("full"), prefill_chunk=256)
    warm_up(engine)

    pauses: list = []
    started: dict = {}

    def callback(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started["t"]) * 1e3))

    out: dict = {}
    for arm in ("unfrozen", "frozen"):
        if arm == "frozen":
            freeze_startup_objects()  # what `kakeya serve` does before READY
        ts = []
        for _ in range(args.collections):
            t = time.perf_counter()
            gc.collect()
            ts.append((time.perf_counter() - t) * 1e3)
        kv = engine.new_session_kv()
        vocab = model.spec.vocab_size
        engine.prefill(kv, [(100 + i) % vocab for i in range(128)])
        pauses.clear()
        gc.callbacks.append(callback)
        try:
            t = time.perf_counter()
            for i in range(args.steps):
                steps.decode_step(model, kv, (300 + i) % vocab, greedy=True)
            seconds = time.perf_counter() - t
        finally:
            gc.callbacks.remove(callback)
        out[arm] = {
            "tracked_objects": len(gc.get_objects()),
            "frozen_objects": gc.get_freeze_count(),
            "full_collection_ms_median": round(statistics.median(ts), 3),
            "decode_steps": args.steps,
            "decode_seconds": round(seconds, 3),
            "collections_while_decoding": {str(g): sum(1 for gen, _ in pauses if gen == g) for g in (0, 1, 2)},
            "collection_ms_while_decoding_max": round(max((ms for _, ms in pauses), default=0.0), 3),
            "collection_ms_while_decoding_total": round(sum(ms for _, ms in pauses), 3),
        }
        print(arm, out[arm], flush=True)
    gc.unfreeze()
    result = run_metadata(vars(args)) | {"native_step": bool(native), "arms": out}
    write_json(pathlib.Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
