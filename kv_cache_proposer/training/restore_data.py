"""Training data and verifier-side pieces for the restoration projection f_θ.

Retrieval documents here use their own generator seed and templates (TRAIN_*), disjoint from the
evaluation ladder's (scripts/research/niah_ladder.py, EVAL_*): other intros, fillers, needle phrasing,
question and key lengths; the phrase "pass key" never appears. General text comes from the same
on-machine corpus as the drafter (man pages, Python stdlib sources; training split only).

The verifier pieces work on the backend's TorchCausalLM (inference_engine/backends/torch/model.py)
and are differentiable (no inference_mode), so Stage 2 can back-propagate the verifier's logit loss
into the restored K/V.
"""
from __future__ import annotations

import dataclasses
import random

import torch

TRAIN_SEED = 7_000_001
TRAIN_INTROS = [
    "Below is a long note. Somewhere in it there is one number that matters. Read carefully.\n",
    "Read the following notes. One line contains a code you will be asked about later.\n",
    "This is a log of ordinary observations with a single important detail hidden in it.\n",
    "",
]
TRAIN_FILLERS = [
    "The river runs past the old mill. Birds sing in the morning. The road turns left at the hill. ",
    "A cat sleeps on the warm step. The kettle boils at noon. Clouds drift over the quiet town. ",
    "Trains leave the station every hour. The library opens at nine. Leaves fall in the park. ",
    "The baker makes bread before dawn. Children walk to school. The wind is calm today. ",
]
TRAIN_NEEDLES = [
    ("The secret code is {key}. Keep it in mind. {key} is the secret code. ", "\nWhat is the secret code? The secret code is"),
    ("My locker number is {key}. Do not forget it. The locker number is {key}. ", "\nWhat is the locker number? The locker number is"),
    ("The access number is {key}. Write it down: {key}. ", "\nWhat is the access number? The access number is"),
    ("Remember this ticket number: {key}. The ticket number is {key}. ", "\nWhat is the ticket number? The ticket number is"),
]


@dataclasses.dataclass
class RetrievalDoc:
    prompt: list[int]  # ends with the question
    answer: list[int]  # the key as the verifier would continue (leading space)
    key: str
    needle: tuple[int, int] = (0, 0)  # token span [a, b) of the needle sentence in `prompt`


def make_retrieval_doc(tok, n_tokens: int, rng: random.Random, max_depth: float = 1.0) -> RetrievalDoc:
    """A needle document of about n_tokens tokens; the needle sits at a random depth <= max_depth."""
    digits = rng.choice((4, 5, 6))
    key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    intro = rng.choice(TRAIN_INTROS)
    filler = rng.choice(TRAIN_FILLERS)
    needle, question = rng.choice(TRAIN_NEEDLES)
    needle = needle.format(key=key)
    per = len(tok(filler * 4, add_special_tokens=False)["input_ids"]) / 4
    overhead = len(tok(intro + needle + question, add_special_tokens=False)["input_ids"])
    reps = max(1, int((n_tokens - overhead) / per))
    k = rng.randint(0, int(reps * max_depth))
    prompt = tok(intro + filler * k + needle + filler * (reps - k) + question, add_special_tokens=False)["input_ids"]
    answer = tok(" " + key, add_special_tokens=False)["input_ids"]
    # Token boundaries can merge across the joins, so the span is measured on the text before and
    # through the needle and widened by one token each side.
    a = len(tok(intro + filler * k, add_special_tokens=False)["input_ids"])
    b = len(tok(intro + filler * k + needle, add_special_tokens=False)["input_ids"])
    return RetrievalDoc(list(prompt), list(answer), key, (max(0, a - 1), min(len(prompt), b + 1)))


def text_chunks(tok, texts: list[str], length: int, limit: int) -> list[list[int]]:
    """Concatenate texts (separated by blank lines) into token chunks of `length`."""
    out, buf = [], []
    for t in texts:
        buf.extend(tok(t + "\n\n", add_special_tokens=False)["input_ids"])
        while len(buf) >= length and len(out) < limit:
            out.append(buf[:length])
            buf = buf[length:]
        if len(out) >= limit:
            break
    return out


@torch.no_grad()
def verifier_kv(model, ids: torch.Tensor) -> torch.Tensor:
    """The verifier's pre-norm, pre-RoPE K and V at every position of `ids`: (L, n, 2 * Hkv * D).

    Reuses the same-model restore step (the verifier run causally without a cache)."""
    from kv_cache_proposer.same_model import VerifierRestoreSource

    n = ids.numel()
    step = VerifierRestoreSource(model).open_step(ids, torch.arange(n))
    out = []
    try:
        for layer in range(model.spec.num_layers):
            k, v = step.kv_for_layer(layer)  # (Hkv, n, D)
            out.append(torch.cat([k.transpose(0, 1).reshape(n, -1), v.transpose(0, 1).reshape(n, -1)], dim=-1))
    finally:
        step.close()
    return torch.stack(out)


def tail_logits(model, ids: torch.Tensor, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], tail_start: int,
                prefix_keep: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (t, V) of positions tail_start..n-1 of `ids`, run through the verifier while attending to
    `prefix_kv` (per layer pre-RoPE (K, V), each (Hkv, tail_start, D)) for positions 0..tail_start-1.
    prefix_keep: optional (tail_start,) bool, False = that prefix position is not attended at all.
    Differentiable in prefix_kv. Global-attention models only (no per-layer windows)."""
    s = model.spec
    if any(w is not None for w in s.layer_windows):
        raise ValueError("tail_logits supports global-attention models only")
    n = ids.numel()
    t = n - tail_start
    x = model.embed_ids(ids[tail_start:])
    rope = model.rope(torch.arange(n))
    tail_rope = rope.select(slice(tail_start, n))
    qp = torch.arange(tail_start, n)[:, None]
    mask = torch.arange(n)[None, :] <= qp  # (t, n) causal
    if prefix_keep is not None:
        mask = mask & torch.cat([prefix_keep.to(torch.bool), torch.ones(t, dtype=torch.bool)])[None, :]
    for i in range(s.num_layers):
        q, k, v = model.project(i, x)
        kp, vp = prefix_kv[i]
        k_all = model.position_k(i, torch.cat([kp.to(k.dtype), k], 1), rope)
        v_all = torch.cat([vp.to(v.dtype), v], 1)
        q, _ = model.position_q(i, q, tail_rope)
        x = model.finish(i, x, model.attend(i, q, k_all, v_all, mask))
    return model.logits(model.final_norm(x))


def split_kv(flat: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 2 * Hkv * D) -> K, V each (Hkv, n, D)."""
    n, kvd = flat.shape[0], num_kv_heads * head_dim
    k = flat[:, :kvd].reshape(n, num_kv_heads, head_dim).transpose(0, 1)
    v = flat[:, kvd:].reshape(n, num_kv_heads, head_dim).transpose(0, 1)
    return k, v


def rel_mse(pred: torch.Tensor, target: torch.Tensor, kv_dim: int,
            weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer relative MSE of K and V: pred/target (L, E, 2 * kv_dim) -> (L,), (L,).

    weights: optional (E,) per-position weights (error and target energy are both weighted)."""
    err = (pred - target).pow(2)
    tgt = target.pow(2)
    if weights is not None:
        w = weights.to(err.dtype)[None, :, None]
        err, tgt = err * w, tgt * w
    tk = tgt[..., :kv_dim].sum((1, 2)).clamp_min(1e-12)
    tv = tgt[..., kv_dim:].sum((1, 2)).clamp_min(1e-12)
    return err[..., :kv_dim].sum((1, 2)) / tk, err[..., kv_dim:].sum((1, 2)) / tv
