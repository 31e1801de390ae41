"""Attention-mass calibration of a drafter's f_θ (cross-model K/V restoration).

Seen from the queries of the resident window, the verifier's attention logits over the evicted
positions are the same per-position quantities whether the keys are true or restored; what f_θ gets
wrong shows up as a shift of their log-sum-exp (the total attention mass the evicted positions draw)
that is roughly constant per (layer, query head): restored keys under-draw in the first layers and
over-draw by 1-3 nats in the upper half of SmolLM2, where the retrieval heads are, so a needle that
is restored or pinned exactly loses its share to the filler, and more so the longer the history.

This script measures that shift,

    shift[l, h] = mean over documents and window queries of
                  logsumexp_e(q·k̂_e · scale) - logsumexp_e(q·k_e · scale)     (e: evicted positions)

and writes logit_bias = -shift as `restore_calibration.safetensors` next to f_θ (manifest:
`restore.calibration`). `--restore-bias calibrated` makes the verifier add it to the restored
columns of every attention (backends/torch/model.py).

Data: retrieval documents from the training generator (kv_cache_proposer/training/restore_data.py,
TRAIN_* templates, seed TRAIN_SEED + 2000: disjoint from the ladder's EVAL_* templates and seed and
from f_θ's own training/held-out seeds) and general-text chunks (man pages + Python stdlib, the
training split of f_θ's corpus). Held-out documents (another seed) report the needle's attention
share with true keys, restored keys, and restored keys + the calibration.

    .venv/bin/python scripts/training/calibrate_restore.py            # ~5 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from kv_cache_proposer import load_drafter, resolve_checkpoint  # noqa: E402
from kv_cache_proposer.restore import DrafterRestoreSource, load_projection, save_calibration  # noqa: E402
from kv_cache_proposer.same_model import causal_layer_output  # noqa: E402
from kv_cache_proposer.training import corpus as corpus_mod  # noqa: E402
from kv_cache_proposer.training import restore_data as rd  # noqa: E402

CALIBRATION_SEED = rd.TRAIN_SEED + 2_000
HELDOUT_SEED = rd.TRAIN_SEED + 3_000


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="smollm2-135m-dlm")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--retrieval-docs", type=int, default=16)
    ap.add_argument("--general-docs", type=int, default=8)
    ap.add_argument("--doc-min", type=int, default=1000)
    ap.add_argument("--doc-max", type=int, default=3000)
    ap.add_argument("--heldout-docs", type=int, default=6)
    ap.add_argument("--heldout-tokens", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="measure and report; write nothing")
    return ap.parse_args(argv)


class Measure:
    """True vs restored attention logits over the evicted positions, from the window's queries."""

    def __init__(self, model, source, sink: int, window: int):
        self.m, self.source, self.sink, self.window = model, source, sink, window

    @torch.inference_mode()
    def __call__(self, ids: list[int], needle: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> dict:
        m, s = self.m, self.m.spec
        n = len(ids)
        hist = torch.tensor(ids)
        ev = torch.arange(self.sink, n - self.window + 1)
        win = torch.cat([torch.arange(self.sink), torch.arange(n - self.window + 1, n)])
        g = s.num_heads // s.num_kv_heads
        step = self.source.open_step(hist, ev)
        x = m.embed_ids(hist)
        rope = m.rope(torch.arange(n))
        ev_rope = rope.select(ev)
        shift, share = [], []
        try:
            for i in range(s.num_layers):
                q_raw, k_raw, v = m.project(i, x)
                k_hat, _ = step.kv_for_layer(i)
                q, _ = m.position_q(i, q_raw, rope)
                k = m.position_k(i, k_raw, rope)
                k_hat = m.position_k(i, k_hat, ev_rope)
                qw = q[:, n - self.window:]  # (H, W, D): the resident window's queries

                def logits(keys):
                    return (qw @ keys.repeat_interleave(g, 0).transpose(1, 2)) * s.attn_scale  # (H, W, |keys|)

                true_ev, rest_ev, resident = logits(k[:, ev]), logits(k_hat), logits(k[:, win])
                shift.append((torch.logsumexp(rest_ev, -1) - torch.logsumexp(true_ev, -1)).mean(-1))  # (H,)
                if needle is not None:  # the needle's share of attention (the needle itself exact, as when pinned)
                    at = (ev >= needle[0]) & (ev < needle[1])
                    row = []
                    for filler in (true_ev[..., ~at], rest_ev[..., ~at],
                                   rest_ev[..., ~at] + (bias[i][:, None, None] if bias is not None else 0)):
                        total = torch.logsumexp(torch.cat([resident, filler, true_ev[..., at]], -1), -1)
                        row.append((torch.logsumexp(true_ev[..., at], -1) - total).exp().mean(-1))
                    share.append(torch.stack(row, -1))  # (H, 3)
                x = causal_layer_output(m, i, x, q_raw, k_raw, v, rope)
        finally:
            step.close()
        out = {"shift": torch.stack(shift)}  # (L, H)
        if needle is not None:
            out["needle_share"] = torch.stack(share)  # (L, H, 3): true / restored / restored + bias
        return out


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from bench_common import run_metadata
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.model_store import resolve_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    path = resolve_model(args.verifier)
    model = TorchCausalLM.load(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    drafter = load_drafter(args.drafter, verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    source = DrafterRestoreSource(drafter, load_projection(args.drafter), args.drafter)
    measure = Measure(model, source, args.sink, args.window)

    rng = random.Random(CALIBRATION_SEED)
    docs = [rd.make_retrieval_doc(tok, rng.randint(args.doc_min, args.doc_max), rng).prompt for _ in range(args.retrieval_docs)]
    corp = corpus_mod.build_corpus(seed=11)
    texts = [p.text for p in corp.code_text + corp.chat if not corpus_mod.is_heldout(p.key)]
    random.Random(CALIBRATION_SEED).shuffle(texts)
    docs += rd.text_chunks(tok, texts, args.doc_max, args.general_docs)
    shifts = []
    for j, ids in enumerate(docs):
        shifts.append(measure(ids)["shift"])
        print(f"calibration doc {j + 1}/{len(docs)} ({len(ids)} tokens): mean shift {float(shifts[-1].mean()):+.2f} nats "
              f"({time.time() - t0:.0f}s)", flush=True)
    shift = torch.stack(shifts)  # (docs, L, H)
    bias = -shift.mean(0)

    held_rng = random.Random(HELDOUT_SEED)
    held = [rd.make_retrieval_doc(tok, args.heldout_tokens, held_rng, 0.8) for _ in range(args.heldout_docs)]
    shares, held_shift = [], []
    for d in held:
        r = measure(d.prompt, needle=d.needle, bias=bias)
        shares.append(r["needle_share"])
        held_shift.append(r["shift"])
    share = torch.stack(shares).mean(0)  # (L, H, 3)
    hs = torch.stack(held_shift).mean(0)
    top = share[..., 0].flatten().topk(10).indices  # the heads that read the needle most with true keys
    L, H = bias.shape
    report = {
        "objective": "logit_bias[l, h] = -mean(logsumexp over evicted positions of restored logits - same of true logits); "
                     "queries: the resident window's",
        "sink": args.sink, "window": args.window,
        "data": {"retrieval": {"generator": "kv_cache_proposer/training/restore_data.py make_retrieval_doc (TRAIN_* templates)",
                               "seed": CALIBRATION_SEED, "docs": args.retrieval_docs, "tokens": [args.doc_min, args.doc_max]},
                 "general_text": {"sources": corp.describe(), "docs": args.general_docs, "tokens": args.doc_max,
                                  "split": "training keys only"},
                 "disjoint_from": "scripts/research/niah_ladder.py EVAL_SEED/EVAL_* templates"},
        "bias_mean_per_layer": [round(float(x), 3) for x in bias.mean(1)],
        "spread_over_docs_per_layer": [round(float(x), 3) for x in shift.std(0).mean(1)],
        "heldout": {
            "docs": args.heldout_docs, "tokens": args.heldout_tokens, "seed": HELDOUT_SEED,
            "shift_after_calibration_mean_abs": round(float((hs + bias).abs().mean()), 3),
            "shift_before_mean_abs": round(float(hs.abs().mean()), 3),
            "needle_share_top10_heads": {
                "heads": [[int(t) // H, int(t) % H] for t in top],
                "true_keys": [round(float(share[int(t) // H, int(t) % H, 0]), 4) for t in top],
                "restored": [round(float(share[int(t) // H, int(t) % H, 1]), 4) for t in top],
                "restored_calibrated": [round(float(share[int(t) // H, int(t) % H, 2]), 4) for t in top],
            },
            # how far the needle's share of attention is from the true-key share, mean over those heads
            "needle_share_abs_error_top10": {
                "restored": round(float((share[..., 1] - share[..., 0]).flatten()[top].abs().mean()), 4),
                "restored_calibrated": round(float((share[..., 2] - share[..., 0]).flatten()[top].abs().mean()), 4),
            },
        },
    }
    meta = run_metadata(vars(args))
    report |= {"command": meta["command"], "commit": meta["commit"], "date_utc": meta["date_utc"],
               "seconds": round(time.time() - t0, 1)}
    h = report["heldout"]
    e = h["needle_share_abs_error_top10"]
    print(f"held-out: |shift| {h['shift_before_mean_abs']} -> {h['shift_after_calibration_mean_abs']} nats; on the 10 heads that "
          f"read the needle most, |needle share - true-key share| {e['restored']} -> {e['restored_calibrated']}", flush=True)
    if args.dry_run:
        return 0
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = save_calibration(bias, resolve_checkpoint(args.drafter), report | {"created_utc": created})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
