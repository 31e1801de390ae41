"""The greedy steps' 4-bit LM head (backends/torch/linear.py RefinedHead, greedy path): is it safe, does it pay?

1. Containment: SmolLM2 int4's final hidden states at every position of --positions tokens of
   text already on this machine (Python stdlib sources and, where present, man pages), the fp32
   head's argmax, and whether it ranks in the top r of the 4-bit and int8 scores (r = 1, 4, 16,
   64; the greedy path refines 64); mean and max |approx - exact| logit error.
2. Speed: decode steps of two sessions (same 128-token context) interleaved one by one, one
   taking the int8 head and one the 4-bit greedy head, median step time per arm, at each of
   --threads. The ratio is the measurement; absolute times move with the machine's load
   (recorded at the start and the end).

Writes results/research/greedy_head.json.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def texts(n_tokens: int, tok) -> list:
    """Token id lists of local text: stdlib modules, then a man page if the machine has one."""
    import gzip
    import json
    import pathlib
    import textwrap

    srcs = [inspect.getsource(json.decoder), inspect.getsource(textwrap)]
    man = sorted(pathlib.Path("/usr/share/man/man1").glob("*.1.gz"))[:1]
    if man:
        srcs.append(gzip.open(man[0], "rt", errors="replace").read())
    per = max(1, n_tokens // len(srcs))
    return [tok(s)["input_ids"][:per] for s in srcs]


def containment(model, tok, n_tokens: int) -> dict:
    import torch

    from inference_engine.backends.torch.linear import RefinedHead
    from inference_engine.engine import steps
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    head = model.head
    if not isinstance(head, RefinedHead) or head.greedy_approx is None:
        raise SystemExit("the loaded model has no 4-bit greedy head (needs --weights int4/int8 on the CPU)")
    hs = []
    for ids in texts(n_tokens, tok):
        cache = make_cache(KVStrategy("full"), model.geometry(), max_step=len(ids), max_context=model.spec.max_context)
        _, hid = steps.forward(model, torch.tensor(ids), range(0, len(ids)), cache, logits="none")
        cache.abort()
        hs.append(hid)
    h = torch.cat(hs)
    exact = h @ head.w.T
    top1 = exact.argmax(-1)
    out = {"positions": int(h.shape[0])}
    for name, approx in (("int4", head.greedy_approx), ("int8", head.approx)):
        a = approx(h).float()
        err = (a - exact).abs()
        out[name] = {"top1_in_top_r": {r: float((a.topk(r, -1).indices == top1[:, None]).any(-1).float().mean()) for r in (1, 4, 16, 64)},
                     "logit_abs_err_mean": float(err.mean()), "logit_abs_err_max": float(err.max())}
    out["greedy_refine"] = head.greedy_refine
    return out


def speed(model, threads: int, steps_n: int, context: int) -> dict:
    import torch

    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    torch.set_num_threads(threads)
    engine = Engine(model, KVStrategy("sink_window"), batching="off")
    kvs = {}
    for greedy in (False, True):
        kvs[greedy] = engine.new_session_kv()
        steps.prefill_chunk(model, kvs[greedy], [100 + (i * 37) % 20000 for i in range(context)])
    ts = {False: [], True: []}
    for i in range(steps_n):
        for greedy in ((False, True) if i % 2 else (True, False)):  # alternate which arm goes first
            t = time.perf_counter()
            steps.decode_step(model, kvs[greedy], 1000 + i % 50, greedy=greedy)
            ts[greedy].append(time.perf_counter() - t)
    med = {g: sorted(v)[len(v) // 2] for g, v in ts.items()}
    return {"threads": threads, "steps_per_arm": steps_n, "context": context, "int8_head_step_ms": med[False] * 1e3,
            "greedy_4bit_head_step_ms": med[True] * 1e3, "speedup": med[False] / med[True]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--positions", type=int, default=2000)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "greedy_head.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.model_store import resolve_model

    path = resolve_model(args.model)
    model = TorchCausalLM.load(path, weights="int4")
    doc = run_metadata(vars(args))
    doc["containment"] = containment(model, AutoTokenizer.from_pretrained(path), args.positions)
    doc["speed"] = [speed(model, int(t), args.steps, args.context) for t in args.threads.split(",")]
    doc["machine"]["load_average_at_end"] = list(os.getloadavg())
    write_json(ROOT / args.out if not os.path.isabs(args.out) else __import__("pathlib").Path(args.out), doc)
    print({k: doc[k] for k in ("containment", "speed")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
