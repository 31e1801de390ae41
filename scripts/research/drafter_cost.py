"""What one draft of the v2 block drafter costs on this CPU, its vocabulary projection two ways, side by side (issue 33:
the drafter took 25-44 % of speculative decoding's time on the AVX2 EPYC, results/speculative_dflash_4m2_avx2.json).

The shipped drafter (--drafter) with its trained fp32 weights (load_drafter's default; the daemon runs v2 drafters
with int8 weights on the CPU, where the head's form no longer applies: bench_speculative.py measures that), on the
verifier's own embedding and LM head (--model, int4 as the daemon loads it); features are seeded random vectors (a
draft's cost does not depend on their values). Per round and arm: --drafts draft() calls of --k drafts at consecutive
positions (one new context position each, as in decoding), each after --verifier-steps greedy decode steps of the
verifier on a session that starts at --context tokens and grows by one token a step (what sits between two drafts in
use: the verifier's weights stream through the caches). Only draft() is timed. Arms:
  streamed  DFlashModel.logits as head @ rows^T (stream_head True, the default since 2026-11-29)
  packed    rows @ head^T (stream_head False, the form before)
Records the median ms per draft per arm, their ratio, and how far the two forms' logits (and their argmax) differ on
the same seeded rows (float summation order only).

    python scripts/research/drafter_cost.py --threads 2 --out results/research/drafter_cost_avx2.json
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

ARMS = {"streamed": True, "packed": False}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="smollm2-135m-dflash")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--drafts", type=int, default=20, help="timed drafts per arm and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--verifier-steps", type=int, default=1, help="verifier decode steps before each draft (0: none)")
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "drafter_cost.json"))
    args = p.parse_args(argv)

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.config import ServeConfig
    from kv_cache_proposer.drafter import load_drafter

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    m = TorchCausalLM.load(resolve_model(args.model), weights="int4")
    m.use_step_graphs("auto")
    drafter = load_drafter(args.drafter, verifier_embed=m.embed, verifier_lm_head=m.lm_head)
    if not hasattr(drafter.model, "stream_head"):
        raise SystemExit(f"drafter_cost: {args.drafter} is not a v2 (DFlash) drafter")
    cfg = ServeConfig()
    engine = Engine(m, KVStrategy(cfg.kv_strategy, cfg.sink, cfg.resolved_window), prefill_chunk=256)
    kv = engine.new_session_kv()
    span = min(1000, m.spec.vocab_size - 100)
    steps.prefill_chunk(m, kv, [(7 * i + 3) % span + 100 for i in range(args.context)])
    gen = torch.Generator().manual_seed(0)
    n_feats = args.context + args.rounds * len(ARMS) * (args.drafts + 1) + 2
    feats = torch.randn(n_feats, drafter.config.feature_size, generator=gen)
    states = {a: drafter.new_state() for a in ARMS}
    position = {a: args.context for a in ARMS}

    def verifier_steps():
        for _ in range(args.verifier_steps):
            steps.decode_step(m, kv, int(kv.last_logits.argmax()), greedy=True)

    def draft(arm):
        drafter.model.stream_head = ARMS[arm]
        position[arm] += 1
        pos = position[arm]
        return drafter.draft([int(pos % span) + 100], args.k, context_hidden=feats[:pos], state=states[arm], position=pos)

    for a in ARMS:  # warm-up: each arm's state covers the context
        draft(a)
    times = {a: [] for a in ARMS}
    for r in range(args.rounds):
        for a in ARMS:
            for _ in range(args.drafts):
                verifier_steps()
                t = time.perf_counter()
                draft(a)
                times[a].append(time.perf_counter() - t)
        print(f"round {r + 1}/{args.rounds}", flush=True)
    # the two forms of the projection on the same seeded rows
    h = torch.randn(args.k, drafter.config.hidden_size, generator=gen)
    with torch.inference_mode():
        drafter.model.stream_head = True
        a = drafter.model.logits(h)
        drafter.model.stream_head = False
        b = drafter.model.logits(h)
    drafter.model.stream_head = True
    med = {a_: statistics.median(v) * 1000 for a_, v in times.items()}
    doc = meta | {
        "step": m.describe_step(), "drafter_config": drafter.config.to_dict(),
        "by_arm": {a_: {"draft_ms_median": round(v, 3)} for a_, v in med.items()},
        "packed_vs_streamed": round(med["packed"] / med["streamed"], 3),
        "logits_max_abs_diff": float((a - b).abs().max()),
        "logits_argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1)))}
    print(doc["by_arm"], doc["packed_vs_streamed"], flush=True)
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
