"""Which positions does --restore-pin keep after prefilling a ladder document, and are the needle's
tokens among them? Runs the real engine (the server's build path) on ladder samples.

    .venv/bin/python scripts/research/pinned_positions.py --rung 7500 --samples 1,5 --pin 16
Writes results/research/pinned_positions.json.
"""
import argparse
import dataclasses
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "scripts" / "research")]

import torch  # noqa: E402

from bench_common import run_metadata, write_json  # noqa: E402
from niah_ladder import EVAL_NEEDLE, make_sample, sample_rng  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rung", type=int, default=7500)
    ap.add_argument("--samples", default="1,5")
    ap.add_argument("--pin", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "pinned_positions.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from inference_engine.model_store import resolve_model
    from inference_engine.server.app import ServeConfig, build_runtime, load_model

    torch.set_num_threads(args.threads)
    base = ServeConfig(bind="127.0.0.1:0", threads=args.threads, prefill_chunk=512, persist="off")
    model = load_model(base)
    tok = AutoTokenizer.from_pretrained(resolve_model(base.model))
    cfg = dataclasses.replace(base, kv_strategy="dlm_restore", sink=4, window=64, drafter="smollm2-135m-dlm", spec_k=0,
                              research={"restore_from": "drafter", "restore_pin": args.pin})
    engine = build_runtime(cfg, model).engine
    rows = []
    for i in (int(x) for x in args.samples.split(",")):
        ids, key, depth = make_sample(tok, args.rung, sample_rng("passkey", args.rung, i))
        needle = tok(EVAL_NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
        start = next(p for p in range(len(ids)) if ids[p:p + 3] == needle[3:6])  # the needle's " key is" run
        span = set(range(start - 4, start + len(needle)))
        kv = engine.new_session_kv()
        t = time.perf_counter()
        engine.prefill(kv, ids)
        pinned = kv.cache.pinned_positions
        digits = [p for p in span if tok.decode([ids[p]]).strip().isdigit()]
        rows.append({"sample": i, "key": key, "depth": round(depth, 3), "prompt_tokens": len(ids), "pinned": pinned,
                     "pinned_tokens": [tok.decode([ids[p]]) for p in pinned], "needle_digit_positions": sorted(digits),
                     "needle_digits_pinned": sum(p in pinned for p in digits), "prefill_seconds": round(time.perf_counter() - t, 1)})
        print(rows[-1], flush=True)
    write_json(pathlib.Path(args.out), run_metadata(vars(args)) | {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
