"""Offline greedy acceptance of a drafter against its transformers verifier.

For each held-out prompt the verifier decodes greedily; at every `stride`-th position t of its
continuation the drafter sees the last `context_window` tokens of seq[:t] plus the verifier hidden
states of all but the last of them (what the engine has after a verify step) and drafts k tokens.
accepted(t, k) = length of the prefix of the draft equal to seq[t:t+k]; α(k) = E[accepted] / k,
and tokens per verifier step = E[accepted] + 1 (the verifier's correction/bonus token).
"""
from __future__ import annotations

import statistics
import time

import torch

from kv_cache_proposer.drafter import Drafter
from kv_cache_proposer.training.teacher import greedy_generate, teacher_forward


def verifier_continuations(model, prompts: list[list[int]], max_new: int, eos: list[int], pad: int):
    gens = greedy_generate(model, prompts, max_new, eos, pad, batch_size=16)
    seqs = [p + g for p, g in zip(prompts, gens)]
    hidden = [t[0].float() for t in teacher_forward(model, seqs, topk=1)]
    return seqs, hidden


@torch.inference_mode()
def acceptance(drafter: Drafter, seqs, hidden, prompt_lens, ks=(2, 4, 8), stride: int = 2, steps=None, threshold=None,
               use_hidden: bool = True):
    cw = drafter.context_window
    acc = {k: [] for k in ks}
    first = []
    for seq, hid, pl in zip(seqs, hidden, prompt_lens):
        ids = torch.tensor(seq)
        for t in range(pl + 1, len(seq), stride):
            lo = max(0, t - cw)
            ctx = ids[lo:t]
            ctx_h = hid[lo : t - 1] if drafter.uses_verifier_hidden and use_hidden else None
            for k in ks:
                if t + k > len(seq):
                    continue
                d = drafter.draft(ctx, k, context_hidden=ctx_h, steps=steps, threshold=threshold).ids
                match = (d == ids[t : t + k]).long()
                n = int(match.cumprod(0).sum())
                acc[k].append(n)
                if k == ks[0]:
                    first.append(int(match[0]))
    out = {"positions": {str(k): len(v) for k, v in acc.items()}}
    for k, v in acc.items():
        m = statistics.fmean(v) if v else 0.0
        out[f"alpha_k{k}"] = round(m / k, 4)
        out[f"accepted_per_step_k{k}"] = round(m + 1, 4)
    out["first_token_acc"] = round(statistics.fmean(first), 4) if first else 0.0
    return out


@torch.inference_mode()
def draft_latency_ms(drafter: Drafter, hidden_size: int, ks=(2, 4, 8, 16), T: int | None = None, reps: int = 20,
                     steps=None, threshold=None, vocab: int = 1000) -> dict:
    T = T or drafter.context_window
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, vocab, (T,), generator=g)
    hid = torch.randn(T - 1, hidden_size, generator=g) * 3 if drafter.uses_verifier_hidden else None
    res = {}
    for k in ks:
        for _ in range(3):
            drafter.draft(ctx, k, context_hidden=hid, steps=steps, threshold=threshold)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            drafter.draft(ctx, k, context_hidden=hid, steps=steps, threshold=threshold)
            ts.append((time.perf_counter() - t0) * 1000)
        res[str(k)] = round(statistics.median(ts), 2)
    return res
