"""Data of the v2 drafter's one-command GPU run: the verifier's own greedy continuations, generated in large
batches with transformers' `generate`, and the features the drafter conditions on, captured on the way.

Captured features match what the daemon's engine captures at serve time (inference_engine/engine/steps.py:
`StepInput.capture` keeps `x` after `backend.finish(i, ...)`, the residual stream after decoder layer i,
before the final norm; concatenated in the drafter's layer order). Here a forward hook on decoder layer i
keeps that layer's output, which is the same tensor (HF `hidden_states[i + 1]` for every layer but the last;
a hook needs no exception for the last). A hook on the final norm keeps the final hidden (the drafter's
hidden-alignment target) and the verifier's argmax at every position (greedy agreement of prompt text; bf16
scoring on CUDA; at generated positions the buffer keeps the generated token, generate()'s own fp32 argmax).
Prompt rows come from the prefill, then one row per decode step; the last generated token is never fed, so
its row is a copy of the one before and is never read (training reads features, final hidden and argmax
only at positions before a target).

`SeqBuffer` holds everything on the device in preallocated tensors, so a generation thread can append
while a training loop samples from what is published (`publish` after the writes are synchronised).
"""
from __future__ import annotations

import contextlib
import threading

import torch

from kv_cache_proposer.training.teacher import left_padded


def decoder_layers(model):
    """The decoder layer list and final norm of a transformers causal LM (Llama-style: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    if layers is None or norm is None:
        raise ValueError(f"{type(model).__name__}: no model.layers / model.norm to capture from")
    return layers, norm


class LayerCapture:
    """Forward hooks that keep the outputs of `layers` (concatenated, as `feat_dtype`), the final normed hidden
    (fp16) and the verifier's argmax of every row of every forward run inside `with capture.on():`."""

    def __init__(self, model, layers: tuple[int, ...], feat_dtype=torch.float16, argmax_rows: int = 4096):
        self.model, self.layers, self.feat_dtype, self.argmax_rows = model, tuple(layers), feat_dtype, argmax_rows
        blocks, self.norm = decoder_layers(model)
        if max(self.layers) >= len(blocks) or min(self.layers) < 0:
            raise ValueError(f"capture layers {list(self.layers)} outside the verifier's {len(blocks)} layers")
        self.blocks = blocks
        self.reset()

    def reset(self):
        self._cur: dict[int, torch.Tensor] = {}
        self.feats: list[torch.Tensor] = []  # per forward: (B, t, L*H)
        self.final: list[torch.Tensor] = []  # per forward: (B, t, H)
        self.argmax: list[torch.Tensor] = []  # per forward: (B, t)

    def _layer_hook(self, i):
        def hook(_mod, _inp, out):
            self._cur[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    def _norm_hook(self, _mod, _inp, out):
        h = out.detach()
        self.feats.append(torch.cat([self._cur[i] for i in self.layers], -1).to(self.feat_dtype))
        self._cur = {}
        self.final.append(h.half())
        head = self.model.get_output_embeddings().weight
        if head.is_cuda:  # bf16 scoring: only prompt rows need it (generated rows' argmax is the next token); ties aside, the same
            if getattr(self, "_head16", None) is None or self._head16.device != head.device:
                self._head16 = head.detach().to(torch.bfloat16)
            head = self._head16
        flat = h.reshape(-1, h.shape[-1])
        am = torch.cat([(flat[r : r + self.argmax_rows].to(head.dtype) @ head.T).argmax(-1)
                        for r in range(0, flat.shape[0], self.argmax_rows)]) if flat.shape[0] else flat.new_zeros(0, dtype=torch.long)
        self.argmax.append(am.view(h.shape[:-1]))

    @contextlib.contextmanager
    def on(self):
        hs = [self.blocks[i].register_forward_hook(self._layer_hook(i)) for i in set(self.layers)]
        hs.append(self.norm.register_forward_hook(self._norm_hook))
        try:
            yield self
        finally:
            for h in hs:
                h.remove()


@torch.no_grad()
def generate_batch(model, capture: LayerCapture, prompts: list[list[int]], max_new: int, eos: list[int], pad: int,
                   cache_implementation: str | None = None):
    """Greedy continuations of a batch of prompts with the captured rows of every prompt + generated position.
    Returns (generations, feats (B, P+n, F), final (B, P+n, H), argmax (B, P+n), pad_left (B,)): row r's real
    positions are [pad_left[r], pad_left[r] + len(prompt) + len(generation))."""
    dev = model.get_input_embeddings().weight.device
    ids, att = left_padded(prompts, pad)
    ids, att = ids.to(dev), att.to(dev)
    L = ids.shape[1]
    capture.reset()
    kw = {"cache_implementation": cache_implementation, "disable_compile": True} if cache_implementation else {}
    with capture.on():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad, temperature=None, top_p=None, top_k=None, **kw)
    feats = torch.cat(capture.feats, 1)
    final = torch.cat(capture.final, 1)
    am = torch.cat(capture.argmax, 1)
    capture.reset()
    seqs = out[:, L:].tolist()
    eos_set = set(eos)
    gens = []
    for g in seqs:
        for j, t in enumerate(g):
            if t in eos_set:
                g = g[: j + 1]
                break
        gens.append(g)
    need = L + max((len(g) for g in gens), default=0)
    if feats.shape[1] < need:  # the last generated token was never fed: its row copies the one before (never read)
        extra = need - feats.shape[1]
        feats = torch.cat([feats, feats[:, -1:].expand(-1, extra, -1)], 1)
        final = torch.cat([final, final[:, -1:].expand(-1, extra, -1)], 1)
        am = torch.cat([am, am[:, -1:].expand(-1, extra)], 1)
    pad_left = [L - len(p) for p in prompts]
    return gens, feats, final, am, pad_left


class SeqBuffer:
    """Sequences (prompt + the verifier's continuation) with their features, flat on the device.

    Per position t: tokens, feats (L*H), final (H), run (how many of the next block_size - 1 tokens are the
    verifier's greedy continuation, 0..block_size-1), seq_start / seq_end (the flat bounds of t's sequence).
    Anchors (positions a block may start at: at least one context position before, run >= 1) are kept in
    ascending flat order, training and validation sequences apart (every val_every-th sequence)."""

    def __init__(self, capacity: int, feat_dim: int, hidden: int, device, block_size: int, feat_dtype=torch.float16,
                 val_every: int = 0):
        self.cap, self.device, self.K, self.val_every = int(capacity), device, block_size - 1, val_every
        self.tokens = torch.zeros(self.cap, dtype=torch.long, device=device)
        self.feats = torch.zeros(self.cap, feat_dim, dtype=feat_dtype, device=device)
        self.final = torch.zeros(self.cap, hidden, dtype=torch.float16, device=device)
        self.argmax = torch.zeros(self.cap, dtype=torch.long, device=device)
        self.run = torch.zeros(self.cap, dtype=torch.long, device=device)
        self.seq_start = torch.zeros(self.cap, dtype=torch.long, device=device)
        self.seq_end = torch.zeros(self.cap, dtype=torch.long, device=device)
        self.n = 0  # written
        self.published = 0  # visible to readers
        self.seqs: list[dict] = []  # start, end, gen_start (flat), style, key
        self._anchor_parts = {"train": [], "val": []}
        self._anchors = {"train": None, "val": None}
        self.lock = threading.Lock()
        self.full = False
        self.version = 0

    @property
    def bytes_per_token(self) -> int:
        return self.feats.shape[1] * self.feats.element_size() + self.final.shape[1] * 2 + 5 * 8

    @torch.no_grad()
    def add(self, prompts, gens, feats, final, argmax, pad_left, styles, keys, stream=None) -> int:
        """Append a generated batch; returns the number of sequences taken (fewer when the buffer is full)."""
        taken = 0
        n0 = self.n
        metas = []
        for r, (p, g) in enumerate(zip(prompts, gens)):
            T = len(p) + len(g)
            if T < 2:
                continue
            if self.n + T > self.cap:
                self.full = True
                break
            lo, s = pad_left[r], self.n
            self.tokens[s : s + T] = torch.tensor(p + g, dtype=torch.long, device="cpu").to(self.device, non_blocking=False)
            self.feats[s : s + T] = feats[r, lo : lo + T]
            self.final[s : s + T] = final[r, lo : lo + T]
            self.argmax[s : s + T] = argmax[r, lo : lo + T]
            if g:  # generated rows: the verifier's argmax is the token it generated (exact, whatever the scoring dtype)
                self.argmax[s + len(p) - 1 : s + T - 1] = self.tokens[s + len(p) : s + T]
            self.seq_start[s : s + T] = s
            self.seq_end[s : s + T] = s + T
            metas.append({"start": s, "end": s + T, "gen_start": s + len(p), "style": styles[r], "key": keys[r]})
            self.n += T
            taken += 1
        if self.n == n0:
            return taken
        n1 = self.n
        # greedy-agreement run of each new position, capped at K, never crossing its sequence's end
        t = torch.arange(n0, n1, device=self.device)
        ok = torch.zeros(n1 - n0 + self.K, dtype=torch.bool, device=self.device)
        nxt = (t + 1).clamp(max=self.cap - 1)
        ok[: n1 - n0] = (self.argmax[n0:n1] == self.tokens[nxt]) & (t + 1 < self.seq_end[n0:n1])
        run = torch.zeros(n1 - n0, dtype=torch.long, device=self.device)
        prod = torch.ones(n1 - n0, dtype=torch.bool, device=self.device)
        for j in range(self.K):
            prod = prod & ok[j : j + n1 - n0]
            run += prod.long()
        self.run[n0:n1] = run
        is_anchor = (run >= 1) & (t > self.seq_start[n0:n1])
        seq_idx0 = len(self.seqs)
        lens = torch.tensor([m["end"] - m["start"] for m in metas], device=self.device)
        val_seq = torch.tensor([bool(self.val_every) and (seq_idx0 + i) % self.val_every == self.val_every - 1
                                for i in range(len(metas))], dtype=torch.bool, device=self.device)
        val_pos = torch.repeat_interleave(val_seq, lens)
        parts = {"train": [(is_anchor & ~val_pos).nonzero().squeeze(1) + n0],
                 "val": [(is_anchor & val_pos).nonzero().squeeze(1) + n0]}
        if stream is not None:
            stream.synchronize()
        with self.lock:
            self.seqs += metas
            for k in parts:
                self._anchor_parts[k] += parts[k]
                self._anchors[k] = None
            self.published = self.n
            self.version += 1
        return taken

    def anchors(self, split: str = "train") -> torch.Tensor:
        with self.lock:
            if self._anchors[split] is None:
                ps = self._anchor_parts[split]
                if ps and ps[0].is_cuda:  # made on the generation thread's stream, read on this one
                    for p in ps:
                        p.record_stream(torch.cuda.current_stream(p.device))
                self._anchors[split] = torch.cat(ps) if ps else torch.zeros(0, dtype=torch.long, device=self.device)
                self._anchor_parts[split] = [self._anchors[split]] if ps else []
            return self._anchors[split]

    def stats(self) -> dict:
        with self.lock:
            seqs = list(self.seqs)
        per: dict = {}
        for m in seqs:
            e = per.setdefault(m["style"], {"sequences": 0, "tokens": 0, "generated_tokens": 0})
            e["sequences"] += 1
            e["tokens"] += m["end"] - m["start"]
            e["generated_tokens"] += m["end"] - m["gen_start"]
        return {"sequences": len(seqs), "tokens": sum(e["tokens"] for e in per.values()),
                "generated_tokens": sum(e["generated_tokens"] for e in per.values()), "per_style": per,
                "anchors_train": int(self.anchors("train").numel()), "anchors_val": int(self.anchors("val").numel()),
                "buffer_full": self.full}
