#!/usr/bin/env python
"""Train the cross-model restoration projection f_θ for a shipped drafter (ADR 0008 §11.6).

    .venv/bin/python scripts/training/train_restore.py --drafter smollm2-135m-dlm \
        --stage1-minutes 15 --stage2-minutes 20

Stages (time-budgeted, single process):
  probe   closed-form ridge fits from candidate proposer representations to every layer's K/V, scored on
          held-out tokens; picks the representation f_θ trains on (recorded in the manifest).
  stage1  reconstruction: per-layer relative MSE of K and V against the verifier's true pre-RoPE K/V,
          on general text and retrieval documents (positions >= sink).
  stage2  logit loss: KL(verifier with true K/V || verifier with restored K/V) at the tail of retrieval
          documents (window + question + answer), with every position in [sink, tail) restored, plus a
          small reconstruction term.
  eval    per-layer K/V rel-MSE on held-out text and held-out retrieval documents, and teacher-forced
          answer accuracy with restored vs. true K/V.
Writes <drafter checkpoint>/restore_ftheta.safetensors and the manifest's `restore` section.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import pathlib
import platform
import random
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kv_cache_proposer import load_drafter, resolve_checkpoint  # noqa: E402
from kv_cache_proposer.restore import ProjectionConfig, RestoreProjection, feature_dim, proposer_features, save_projection  # noqa: E402
from kv_cache_proposer.training import corpus as corpus_mod  # noqa: E402
from kv_cache_proposer.training import restore_data as rd  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="smollm2-135m-dlm")
    ap.add_argument("--verifier", default="smollm2-135m-instruct", help="pulled model name or HF directory")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64, help="resident window assumed by Stage 2")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--features", default="auto", choices=("auto", "hidden", "kv"), help="auto = the probe's pick")
    ap.add_argument("--trunk-dim", type=int, default=1024)
    ap.add_argument("--trunk-out", type=int, default=512)
    ap.add_argument("--stage1-minutes", type=float, default=15)
    ap.add_argument("--stage2-minutes", type=float, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--chunk", type=int, default=768, help="general-text chunk length")
    ap.add_argument("--doc-min", type=int, default=400)
    ap.add_argument("--doc-max", type=int, default=1100)
    ap.add_argument("--eval-docs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="drafter checkpoint dir to write into (default: the drafter's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None,
                    help="warm start: a drafter name/dir whose shipped f_θ initialises this run (its config is kept)")
    ap.add_argument("--needle-weight", type=float, default=1.0,
                    help="reconstruction weight of a retrieval document's needle-sentence positions relative to the rest")
    ap.add_argument("--retrieval-frac", type=float, default=0.5, help="Stage 1: share of retrieval documents (rest: general text)")
    return ap.parse_args(argv)


EVICTED_DEPTH = 0.8  # Stage 2 / eval needles sit in the first 80% of the document: evicted, not in the window


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Setup:
    def __init__(self, args):
        from transformers import AutoTokenizer

        from inference_engine.backends.torch.model import TorchCausalLM
        from inference_engine.model_store import resolve_model

        path = resolve_model(args.verifier) if not pathlib.Path(args.verifier).exists() else pathlib.Path(args.verifier)
        self.model = TorchCausalLM.load(path)
        self.tok = AutoTokenizer.from_pretrained(str(path))
        self.drafter = load_drafter(args.drafter, verifier_embed=self.model.embed, verifier_lm_head=self.model.lm_head)
        s = self.model.spec
        self.kv_dim = s.num_kv_heads * s.head_dim
        self.verifier_name = self.model.model_id


def build_data(S: Setup, args):
    rng = random.Random(rd.TRAIN_SEED + args.seed)
    corp = corpus_mod.build_corpus(seed=11)
    texts_train = [p.text for p in corp.code_text + corp.chat if not corpus_mod.is_heldout(p.key)]
    texts_held = [p.text for p in corp.code_text + corp.chat if corpus_mod.is_heldout(p.key)]
    rng.shuffle(texts_train)
    general = rd.text_chunks(S.tok, texts_train, args.chunk, 4000)
    general_held = rd.text_chunks(S.tok, texts_held, args.chunk, args.eval_docs)
    held_rng = random.Random(rd.TRAIN_SEED + 1_000 + args.seed)
    retrieval_held = [rd.make_retrieval_doc(S.tok, held_rng.randint(args.doc_min, args.doc_max), held_rng, EVICTED_DEPTH)
                      for _ in range(args.eval_docs)]
    return rng, general, general_held, retrieval_held, corp.describe()


def targets(S: Setup, ids: list[int], sink: int):
    """(features (E, F), target K/V (L, E, 2kv)) at positions sink..n-1."""
    t = torch.tensor(ids)
    with torch.no_grad():
        kv = rd.verifier_kv(S.model, t)[:, sink:]
    return t, kv


def probe(S: Setup, args, rng, general, retrieval_held) -> dict:
    """Ridge regression from each candidate representation to all layers' K/V; held-out rel-MSE."""
    L = S.model.spec.num_layers
    train_docs = general[:6] + [rd.make_retrieval_doc(S.tok, 900, rng).prompt for _ in range(3)]
    held_docs = [d.prompt for d in retrieval_held[:3]] + general[6:9]
    emb_dim = 2 * S.model.spec.hidden_size

    def collect(docs, features):
        X, Y = [], []
        for ids in docs:
            t, kv = targets(S, ids, args.sink)
            with torch.no_grad():
                f = proposer_features(S.drafter.model, t, t.numel(), args.block, features)[args.sink:]
            X.append(f)
            Y.append(kv.permute(1, 0, 2).reshape(f.shape[0], -1))
        return torch.cat(X).double(), torch.cat(Y).double()

    out = {}
    for features in ("hidden", "kv"):
        Xtr, Ytr = collect(train_docs, features)
        Xte, Yte = collect(held_docs, features)
        cols = {"tokens_only": slice(0, emb_dim), f"tokens+drafter_{features}": slice(0, Xtr.shape[1]),
                f"drafter_{features}_only": slice(emb_dim, Xtr.shape[1])}
        for name, c in cols.items():
            if name in out:
                continue
            a, b = Xtr[:, c], Xte[:, c]
            mu, sd = a.mean(0), a.std(0).clamp_min(1e-6)
            a, b = (a - mu) / sd, (b - mu) / sd
            a1 = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
            b1 = torch.cat([b, torch.ones(b.shape[0], 1, dtype=b.dtype)], 1)
            W = torch.linalg.solve(a1.T @ a1 + 1.0 * torch.eye(a1.shape[1], dtype=a.dtype), a1.T @ Ytr)
            pred = (b1 @ W).reshape(-1, L, 2 * S.kv_dim).permute(1, 0, 2)
            rk, rv = rd.rel_mse(pred.float(), Yte.reshape(-1, L, 2 * S.kv_dim).permute(1, 0, 2).float(), S.kv_dim)
            out[name] = {"k_rel_mse_mean": float(rk.mean()), "v_rel_mse_mean": float(rv.mean()), "train_tokens": int(Xtr.shape[0])}
            log(f"probe {name}: K {out[name]['k_rel_mse_mean']:.3f}  V {out[name]['v_rel_mse_mean']:.3f}")
    return out


def stage1(S: Setup, proj: RestoreProjection, opt, args, rng, general, minutes: float) -> dict:
    t0, step, hist = time.time(), 0, []
    while time.time() - t0 < minutes * 60:
        doc = None
        if rng.random() < args.retrieval_frac:
            doc = rd.make_retrieval_doc(S.tok, rng.randint(args.doc_min, args.doc_max), rng)
        ids = doc.prompt if doc is not None else rng.choice(general)
        t, kv = targets(S, ids, args.sink)
        with torch.no_grad():
            f = proposer_features(S.drafter.model, t, t.numel(), args.block, proj.cfg.features)[args.sink:]
        pred = proj.all_layers(proj.trunk(f))
        rk, rv = rd.rel_mse(pred, kv, S.kv_dim, needle_weights(doc, t.numel(), args))
        loss = (rk + rv).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(proj.parameters(), 1.0)
        opt.step()
        step += 1
        hist.append((float(rk.detach().mean()), float(rv.detach().mean())))
        if step % 20 == 0:
            k, v = (sum(h[i] for h in hist[-20:]) / 20 for i in (0, 1))
            log(f"stage1 step {step}: K rel-MSE {k:.3f}  V {v:.3f}")
    return {"steps": step, "seconds": round(time.time() - t0), "last20_k_rel_mse": sum(h[0] for h in hist[-20:]) / max(1, len(hist[-20:])),
            "last20_v_rel_mse": sum(h[1] for h in hist[-20:]) / max(1, len(hist[-20:]))}


def needle_weights(doc, n: int, args):
    """(n - sink,) reconstruction weights: --needle-weight on the doc's needle sentence, 1 elsewhere; None = uniform."""
    if doc is None or args.needle_weight == 1.0:
        return None
    w = torch.ones(n)
    a, b = doc.needle
    w[a:b] = args.needle_weight
    return w[args.sink:]


def restored_prefix(S: Setup, proj, ids_t, kv_true, tail_start: int, sink: int):
    """Per-layer prefix K/V for positions 0..tail_start-1: true at the sink, f_θ elsewhere; and the f_θ output."""
    f = proposer_features(S.drafter.model, ids_t, tail_start, proj.cfg.block, proj.cfg.features)[sink:tail_start]
    pred = proj.all_layers(proj.trunk(f))  # (L, E, 2kv)
    s = S.model.spec
    prefix = []
    for layer in range(s.num_layers):
        flat = torch.cat([kv_true[layer, :sink], pred[layer]], 0)
        prefix.append(rd.split_kv(flat, s.num_kv_heads, s.head_dim))
    return prefix, pred


def doc_pass(S: Setup, proj, doc: rd.RetrievalDoc, sink: int, window: int, grad: bool):
    """Teacher and restored logits at the tail of a retrieval doc; returns dict of tensors."""
    s = S.model.spec
    ids = doc.prompt + doc.answer
    ids_t = torch.tensor(ids)
    n_prompt = len(doc.prompt)
    tail_start = max(sink + 1, n_prompt - window)
    with torch.no_grad():
        kv_true = rd.verifier_kv(S.model, ids_t[:tail_start])  # (L, tail_start, 2kv)
        true_prefix = [rd.split_kv(kv_true[layer], s.num_kv_heads, s.head_dim) for layer in range(s.num_layers)]
        teacher = rd.tail_logits(S.model, ids_t, true_prefix, tail_start)
    with torch.set_grad_enabled(grad):
        prefix, pred = restored_prefix(S, proj, ids_t, kv_true, tail_start, sink)
        student = rd.tail_logits(S.model, ids_t, prefix, tail_start)
    ans = slice(n_prompt - 1 - tail_start, len(ids) - 1 - tail_start)  # tail rows predicting the answer tokens
    return dict(teacher=teacher, student=student, ans=ans, pred=pred, kv_true=kv_true[:, sink:], answer=torch.tensor(doc.answer),
                tail_start=tail_start)


def kl(teacher, student):
    return F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="none").sum(-1)


def stage2(S: Setup, proj, opt, args, rng, minutes: float) -> dict:
    t0, step, hist = time.time(), 0, []
    while time.time() - t0 < minutes * 60:
        doc = rd.make_retrieval_doc(S.tok, rng.randint(args.doc_min, args.doc_max), rng, EVICTED_DEPTH)
        r = doc_pass(S, proj, doc, args.sink, args.window, grad=True)
        per_pos = kl(r["teacher"], r["student"])
        kl_ans, kl_tail = per_pos[r["ans"]].mean(), per_pos.mean()
        rk, rv = rd.rel_mse(r["pred"], r["kv_true"], S.kv_dim, needle_weights(doc, r["tail_start"], args))
        loss = kl_ans + 0.25 * kl_tail + 0.1 * (rk + rv).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(proj.parameters(), 1.0)
        opt.step()
        step += 1
        hit = bool((r["student"][r["ans"]].argmax(-1) == r["answer"]).all())
        hist.append((float(kl_ans), float(kl_tail), hit))
        if step % 10 == 0:
            last = hist[-10:]
            log(f"stage2 step {step}: KL answer {sum(h[0] for h in last) / 10:.3f}  KL tail {sum(h[1] for h in last) / 10:.3f}  "
                f"answer exact {sum(h[2] for h in last)}/10")
    last = hist[-20:]
    return {"steps": step, "seconds": round(time.time() - t0), "last20_kl_answer": sum(h[0] for h in last) / max(1, len(last)),
            "last20_answer_exact": sum(h[2] for h in last) / max(1, len(last))}


@torch.no_grad()
def evaluate(S: Setup, proj, args, general_held, retrieval_held) -> dict:
    L = S.model.spec.num_layers
    acc = {"general": [torch.zeros(L), torch.zeros(L)], "retrieval": [torch.zeros(L), torch.zeros(L)]}
    for name, docs in (("general", general_held), ("retrieval", [d.prompt for d in retrieval_held])):
        for ids in docs:
            t, kv = targets(S, ids, args.sink)
            f = proposer_features(S.drafter.model, t, t.numel(), proj.cfg.block, proj.cfg.features)[args.sink:]
            rk, rv = rd.rel_mse(proj.all_layers(proj.trunk(f)), kv, S.kv_dim)
            acc[name][0] += rk / len(docs)
            acc[name][1] += rv / len(docs)
    exact_restored = exact_true = 0
    kl_ans = 0.0
    needle_k = needle_v = 0.0
    for doc in retrieval_held:
        r = doc_pass(S, proj, doc, args.sink, args.window, grad=False)
        a, b = (max(0, x - args.sink) for x in doc.needle)
        nk, nv = rd.rel_mse(r["pred"][:, a:b], r["kv_true"][:, a:b], S.kv_dim)
        needle_k += float(nk.mean()) / len(retrieval_held)
        needle_v += float(nv.mean()) / len(retrieval_held)
        exact_true += bool((r["teacher"][r["ans"]].argmax(-1) == r["answer"]).all())
        exact_restored += bool((r["student"][r["ans"]].argmax(-1) == r["answer"]).all())
        kl_ans += float(kl(r["teacher"], r["student"])[r["ans"]].mean()) / len(retrieval_held)
    out = {
        "docs": {"general": len(general_held), "retrieval": len(retrieval_held)},
        "per_layer_k_rel_mse": {n: [round(float(x), 4) for x in v[0]] for n, v in acc.items()},
        "per_layer_v_rel_mse": {n: [round(float(x), 4) for x in v[1]] for n, v in acc.items()},
        "mean_k_rel_mse": {n: round(float(v[0].mean()), 4) for n, v in acc.items()},
        "mean_v_rel_mse": {n: round(float(v[1].mean()), 4) for n, v in acc.items()},
        "retrieval_answer_exact_true_kv": exact_true / len(retrieval_held),
        "retrieval_answer_exact_restored": exact_restored / len(retrieval_held),
        "retrieval_kl_answer": round(kl_ans, 4),
        "needle_k_rel_mse": round(needle_k, 4),
        "needle_v_rel_mse": round(needle_v, 4),
        "window_assumed": args.window,
    }
    log(f"eval: K rel-MSE {out['mean_k_rel_mse']}  V {out['mean_v_rel_mse']}  answer exact restored "
        f"{exact_restored}/{len(retrieval_held)} (true K/V {exact_true}/{len(retrieval_held)}); needle K {needle_k:.3f} V {needle_v:.3f}")
    return out


def _previous_section(name: str) -> dict:
    """The warm start's manifest record, minus bulky parts, so the lineage stays in the new manifest."""
    import json

    from kv_cache_proposer.drafter import MANIFEST_FILE

    section = json.loads((resolve_checkpoint(name) / MANIFEST_FILE).read_text()).get("restore", {})
    keep = ("command", "commit", "date_utc", "objective", "stage1", "stage2", "eval", "init")
    return {k: section[k] for k in keep if k in section}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    S = Setup(args)
    rng, general, general_held, retrieval_held, sources = build_data(S, args)
    log(f"data: {len(general)} general chunks of {args.chunk} tokens; "
        f"held-out {len(general_held)} general, {len(retrieval_held)} retrieval")
    run_probe = args.features == "auto" and not args.init  # a warm start keeps its representation
    report = {"probe": probe(S, args, rng, general, retrieval_held)} if run_probe else {}
    features = args.features
    if run_probe:
        best = min(report["probe"].items(), key=lambda kv: kv[1]["k_rel_mse_mean"] + kv[1]["v_rel_mse_mean"])[0]
        features = "kv" if "drafter_kv" in best else "hidden"
        report["probe_pick"] = {"best": best, "features": features}
        log(f"probe picks {best} -> features={features}")
    s = S.model.spec
    cfg = ProjectionConfig(feature_dim=feature_dim(S.drafter.model, features), num_layers=s.num_layers, kv_dim=S.kv_dim,
                           num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, trunk_dim=args.trunk_dim, trunk_out=args.trunk_out,
                           block=args.block, features=features, verifier=S.verifier_name)
    if args.init:
        from kv_cache_proposer.restore import load_projection

        proj = load_projection(args.init)  # its own config: the trained shape and features
        for p in proj.parameters():
            p.requires_grad_(True)
        report["init"] = {"from": args.init, "previous": _previous_section(args.init)}
    else:
        proj = RestoreProjection(cfg)
    opt = torch.optim.AdamW(proj.parameters(), lr=args.lr, weight_decay=0.0)
    report["stage1"] = stage1(S, proj, opt, args, rng, general, args.stage1_minutes)
    report["eval_after_stage1"] = evaluate(S, proj, args, general_held, retrieval_held)
    for g in opt.param_groups:
        g["lr"] = args.lr * 0.3
    report["stage2"] = stage2(S, proj, opt, args, rng, args.stage2_minutes)
    report["eval"] = evaluate(S, proj, args, general_held, retrieval_held)
    out = pathlib.Path(args.out) if args.out else resolve_checkpoint(args.drafter)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    section = {
        "trained_for_drafter": args.drafter,
        "command": " ".join([pathlib.Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "commit": commit,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "data": {
            "general_text": {"sources": sources, "chunk_tokens": args.chunk, "split": "training keys only (sha1(key) % 20 != 0)"},
            "retrieval": {"generator_seed": rd.TRAIN_SEED + args.seed, "heldout_seed": rd.TRAIN_SEED + 1000 + args.seed,
                          "templates_sha256": hashlib.sha256(
                              repr((rd.TRAIN_INTROS, rd.TRAIN_FILLERS, rd.TRAIN_NEEDLES)).encode()).hexdigest(),
                          "doc_tokens": [args.doc_min, args.doc_max],
                          "disjoint_from": "scripts/research/niah_ladder.py EVAL_SEED/EVAL_* templates (no 'pass key' phrase)"},
        },
        "objective": {"stage1": "mean over layers of K rel-MSE + V rel-MSE (positions >= sink; a retrieval doc's needle "
                                f"sentence weighted x{args.needle_weight})", "retrieval_frac": args.retrieval_frac,
                      "stage2": "KL(true || restored) at answer positions + 0.25 x KL over the tail + 0.1 x stage1 loss",
                      "sink": args.sink, "window": args.window},
    } | report
    save_projection(proj, out, section)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
