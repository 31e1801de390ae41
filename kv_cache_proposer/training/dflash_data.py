"""Training data of the v2 (DFlash-style) drafter: the verifier's own greedy generations on chat,
code-completion and code-editing prompts, with the teacher-forced hidden states of a few verifier
layers, cached to disk in chunks.

A chunk is a safetensors file: tokens (N,) i32, feats (N, L*H) f16 (residual stream after each
captured layer, concatenated in layer order), final (N, H) f16 (the verifier's final normed hidden),
argmax (N,) i32 (the verifier's greedy next token at each position), seq_offsets (S+1,) i64,
gen_start (S,) i64 (index of the first generated token), style (S,) i64 (STYLES).
Held-out source keys (corpus.is_heldout) never reach a job.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import pathlib
import random

import numpy as np
import torch

from kv_cache_proposer.training import corpus as corpus_mod
from kv_cache_proposer.training.dataset import chat_ids, code_ids
from kv_cache_proposer.training.teacher import left_padded, save_sequences

STYLES = {"chat": 0, "code": 1, "edit": 2, "synthetic": 3}
CHUNK = 32
# the editing request of scripts/bench_speculative.py (training uses training-split functions only)
EDIT_INSTRUCTION = "Add type hints to this Python function. Reply with the complete function only."


def edit_ids(tok, code: str) -> list[int]:
    msg = [{"role": "user", "content": f"{EDIT_INSTRUCTION}\n\n```python\n{code}\n```"}]
    text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def plan_jobs(tok, *, chat: int, code: int, edit: int, seed: int = 0, vocab_size: int = 0,
              synthetic: int = 0) -> tuple[list[dict], dict]:
    """(jobs, description). synthetic > 0: random-token prompts (tiny test verifiers, no tokenizer)."""
    rng = random.Random(seed)
    if synthetic:
        jobs = [{"kind": "synthetic", "key": f"syn:{i}", "ids": [rng.randrange(3, vocab_size) for _ in range(rng.randint(6, 16))]}
                for i in range(synthetic)]
        return jobs, {"synthetic": synthetic}
    c = corpus_mod.build_corpus(seed=seed)
    chat_tr, _ = corpus_mod.split(c.chat)
    code_tr, _ = corpus_mod.split(c.code)
    text_tr, _ = corpus_mod.split(c.code_text)
    for lst in (chat_tr, code_tr, text_tr):
        rng.shuffle(lst)
    per = {
        "chat": [{"kind": "chat", "key": p.key, "ids": chat_ids(tok, p.text)} for p in chat_tr[:chat]],
        "code": [{"kind": "code", "key": p.key, "ids": code_ids(tok, p.text)[-192:]} for p in code_tr[:code]],
        "edit": [{"kind": "edit", "key": p.key, "ids": edit_ids(tok, tok.decode(code_ids(tok, p.text)[:200]))}
                 for p in text_tr[:edit]],
    }
    leaked = [j["key"] for js in per.values() for j in js if corpus_mod.is_heldout(j["key"])]
    if leaked:
        raise RuntimeError(f"held-out source keys leaked into training jobs: {leaked[:5]}")
    jobs = []  # kinds interleaved chunk by chunk, so a partial data stage covers every kind
    for i in range(0, max(len(v) for v in per.values()), CHUNK):
        for kind in ("chat", "code", "edit"):
            jobs += per[kind][i : i + CHUNK]
    desc = {
        "sources": c.describe(),
        "jobs": {k: len(v) for k, v in per.items()},
        "chat": "user turns from templates over man-page NAME lines and stdlib function docstrings (chat template)",
        "code": "raw Python prefix: def line + docstring + first 25-50% of the body of a stdlib function (last 192 tokens)",
        "edit": f"chat-templated editing request {EDIT_INSTRUCTION!r} over the first 200 tokens of a stdlib function",
        "heldout_rule": f"sha1(source key) % {corpus_mod.HELDOUT_MOD} == 0 (keys: man:<command>, py:<module>) never used",
        "targets": "the verifier's own greedy continuation (fp32 HF forward); hidden states teacher-forced over prompt + continuation",
    }
    return jobs, desc


def chunk_jobs(jobs: list[dict]) -> list[list[dict]]:
    return [jobs[i : i + CHUNK] for i in range(0, len(jobs), CHUNK)]


def chunk_path(work: pathlib.Path, c: int) -> pathlib.Path:
    return work / f"part-{c:03d}.safetensors"


@torch.inference_mode()
def teacher_features(model, seqs: list[list[int]], layers: tuple[int, ...], max_batch_tokens: int = 4096):
    """Per sequence: (feats (T, L*H) f16, final (T, H) f16, argmax (T,) i32). feats[:, l*H:(l+1)*H] is the
    residual stream after decoder layer layers[l] (HF hidden_states[layers[l] + 1])."""
    res = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    b = 0
    while b < len(order):
        n = 1
        while b + n < len(order) and (n + 1) * len(seqs[order[b + n]]) <= max_batch_tokens:
            n += 1
        idx = order[b : b + n]
        L = max(len(seqs[i]) for i in idx)
        ids = torch.zeros((len(idx), L), dtype=torch.long)
        att = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):  # right padding: real tokens keep positions 0..T-1
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            att[r, : len(seqs[i])] = 1
        out = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
        hs = out.hidden_states
        feats = torch.cat([hs[layer + 1] for layer in layers], dim=-1)
        final = out.last_hidden_state
        am = model.lm_head(final).argmax(-1)
        for r, i in enumerate(idx):
            t = len(seqs[i])
            res[i] = (feats[r, :t].half(), final[r, :t].half(), am[r, :t].int())
        b += n
    return res


@torch.inference_mode()
def generate_with_features(model, prompts: list[list[int]], layers: tuple[int, ...], max_new: int, eos: list[int],
                           pad: int, batch_size: int = 32):
    """One pass instead of generate + teacher_features: the verifier's greedy continuation of each prompt and
    the hidden states its own generate() computed on the way (prompt rows from the prefill, then one row per
    decode step; the last generated token is never fed, so its row is the last one's copy and is never read:
    training reads features, final hidden and argmax only at positions before a target). Returns
    (generations, [(feats, final, argmax)] per sequence) like teacher_features."""
    gens, res = [None] * len(prompts), [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for b0 in range(0, len(order), batch_size):
        idx = order[b0 : b0 + batch_size]
        ids, att = left_padded([prompts[i] for i in idx], pad)
        L = ids.shape[1]
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad, temperature=None, top_p=None, top_k=None, output_hidden_states=True,
                             return_dict_in_generate=True)
        steps = out.hidden_states  # per step: (embeddings, layer 0 out, ..., final normed), each (B, t, H)
        feats = torch.cat([torch.cat([st[layer + 1] for layer in layers], -1) for st in steps], 1)  # (B, L + n - 1, L*H)
        final = torch.cat([st[-1] for st in steps], 1)
        am = model.lm_head(final).argmax(-1)
        for r, i in enumerate(idx):
            g = out.sequences[r, L:].tolist()
            for j, t in enumerate(g):
                if t in eos:
                    g = g[: j + 1]
                    break
            gens[i] = g
            lo, n = L - len(prompts[i]), len(prompts[i]) + len(g)
            f, h, a = feats[r, lo:], final[r, lo:], am[r, lo:]
            pad_rows = n - f.shape[0]  # the last generated token was not fed
            if pad_rows > 0:
                f, h, a = (torch.cat([x, x[-1:].expand(pad_rows, *x.shape[1:])]) for x in (f, h, a))
            res[i] = (f[:n].half(), h[:n].half(), a[:n].int())
    return gens, res


def build_chunk(model, items: list[dict], *, layers: tuple[int, ...], max_new: int, eos: list[int], pad: int,
                gen_batch: int, path: pathlib.Path) -> dict:
    prompts = [j["ids"] for j in items]
    gens, feats = generate_with_features(model, prompts, layers, max_new, eos, pad, batch_size=gen_batch)
    seqs = [p + g for p, g in zip(prompts, gens)]
    save_sequences(path, seqs, {
        "feats": torch.cat([f[0] for f in feats]).contiguous(),
        "final": torch.cat([f[1] for f in feats]).contiguous(),
        "argmax": torch.cat([f[2] for f in feats]).contiguous(),
        "gen_start": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        "style": torch.tensor([STYLES[j["kind"]] for j in items], dtype=torch.int64),
    })
    return {"sequences": len(seqs), "tokens": sum(len(s) for s in seqs), "generated": sum(len(g) for g in gens)}


class ChunkRows:
    """One per-token tensor (feats or final) of many chunk files, each chunk's rows a memory map of its file: nothing
    is read until indexed, so data larger than RAM trains (the kernel's page cache keeps what fits). Indexed as the
    trainer indexes the concatenated tensor: a slice (rows of one sequence, so of one chunk; across chunks they are
    joined) or a LongTensor of rows."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts
        self.starts = [0]
        for t in parts:
            self.starts.append(self.starts[-1] + t.shape[0])
        self.shape = torch.Size((self.starts[-1], *parts[0].shape[1:]))
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(self.shape[0])
            if step != 1:
                raise IndexError("ChunkRows takes slices of step 1")
            i = bisect.bisect_right(self.starts, a) - 1
            out = []
            while a < b:
                e = min(b, self.starts[i + 1])
                out.append(self.parts[i][a - self.starts[i]:e - self.starts[i]])
                a, i = e, i + 1
            return out[0] if len(out) == 1 else (torch.cat(out) if out else self.parts[0][:0])
        idx = torch.as_tensor(key, dtype=torch.long)
        flat = idx.flatten()
        chunk = torch.bucketize(flat, torch.tensor(self.starts[1:]), right=True)
        out = torch.empty(flat.numel(), *self.shape[1:], dtype=self.dtype)
        for c in torch.unique(chunk).tolist():
            at = torch.nonzero(chunk == c).flatten()
            out[at] = self.parts[c][flat[at] - self.starts[c]]
        return out.view(*idx.shape, *self.shape[1:])


_ST_DTYPES = {"F16": np.float16, "BF16": None, "F32": np.float32, "I32": np.int32, "I64": np.int64}


def map_safetensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as copy-on-write memory maps (the format: an 8-byte little-endian header length,
    a JSON header of dtype / shape / data_offsets, then the data): nothing is read until used."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which map_safetensors does not map")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == begin:
            out[name] = torch.from_numpy(np.zeros(shape, dtype=dt))
            continue
        out[name] = torch.from_numpy(np.memmap(path, dtype=dt, mode="c", offset=8 + n + begin, shape=shape))
    return out


def load_chunks(paths: list[pathlib.Path], mapped: bool = False) -> dict:
    """The chunks concatenated (seq_offsets rebased) plus their sha256. mapped: feats and final stay memory maps of
    the files (ChunkRows), the rest (8 bytes a token and per-sequence fields) in RAM: for data larger than RAM."""
    from safetensors.torch import load_file

    parts = [map_safetensors(p) if mapped else load_file(str(p)) for p in paths]
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for blk in iter(lambda: f.read(1 << 22), b""):
                h.update(blk)
    offs, base = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        offs.append(p["seq_offsets"][1:] + base)
        base += int(p["seq_offsets"][-1])
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    rows = (lambda k: ChunkRows([p[k] for p in parts])) if mapped else cat  # noqa: E731
    return {"tokens": cat("tokens"), "feats": rows("feats"), "final": rows("final"), "argmax": cat("argmax"),
            "seq_offsets": torch.cat(offs), "gen_start": cat("gen_start"), "style": cat("style"), "sha256": h.hexdigest()}
