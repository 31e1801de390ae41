"""Teacher targets from the verifier, cached to disk: for every token of every training sequence the
verifier's final post-norm hidden state (fp16) and its top-k next-token logits.

Sequences are on-policy (the verifier's own greedy continuation of a prompt; only the continuation
is a drafting target) or teacher-forced text (every position is a target). Shards are safetensors:
tokens (N,) i32, hidden (N, H) f16, topk_idx (N, K) i32, topk_val (N, K) f16, seq_offsets (S+1,)
i64, target_start (S,) i64 (index of the first token that may be a block target), style (S,) i64.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

import torch

STYLES = {"chat": 0, "code": 1, "text": 2, "synthetic": 3}


def kakeya_home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KAKEYA_HOME", "~/.cache/kakeya")).expanduser()


def default_teacher_dir(tag: str) -> pathlib.Path:
    return kakeya_home() / "cache" / "drafter_teacher" / tag


def load_verifier(path: str | pathlib.Path):
    """(model, tokenizer-or-None) from a local HF directory; never touches a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError):
        tok = None
    return model, tok


def verifier_embed_and_head(model) -> tuple[torch.Tensor, torch.Tensor]:
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


@torch.inference_mode()
def left_padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each (len(seqs), longest): the sequences left-padded with pad_id."""
    L = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for r, x in enumerate(seqs):
        ids[r, L - len(x) :] = torch.tensor(x)
        att[r, L - len(x) :] = 1
    return ids, att


def greedy_generate(model, prompts: list[list[int]], max_new: int, eos_ids: list[int], pad_id: int,
                    batch_size: int = 16, progress=None) -> list[list[int]]:
    """The verifier's greedy continuation of each prompt (up to and including an EOS)."""
    out: list[list[int] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        ids, att = left_padded([prompts[i] for i in idx], pad_id)
        L = ids.shape[1]
        gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
        for r, i in enumerate(idx):
            g = gen[r, L:].tolist()
            for j, t in enumerate(g):
                if t in eos_ids:
                    g = g[: j + 1]
                    break
            out[i] = g
        if progress is not None:
            progress.update(len(idx))
    return out  # type: ignore[return-value]


@torch.inference_mode()
def teacher_forward(model, seqs: list[list[int]], topk: int = 20, max_batch_tokens: int = 4096, progress=None):
    """Per sequence: (hidden (L, H) f16, topk_idx (L, K) i32, topk_val (L, K) f16)."""
    res = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    b = 0
    while b < len(order):
        L = len(seqs[order[b]])
        n = 1
        while b + n < len(order) and (n + 1) * len(seqs[order[b + n]]) <= max_batch_tokens:
            n += 1
        idx = order[b : b + n]
        L = max(len(seqs[i]) for i in idx)
        ids = torch.zeros((len(idx), L), dtype=torch.long)
        att = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            att[r, : len(seqs[i])] = 1
        h = model.model(input_ids=ids, attention_mask=att).last_hidden_state  # (B, L, H), after the final norm
        logits = model.lm_head(h)
        val, ix = logits.topk(topk, dim=-1)
        for r, i in enumerate(idx):
            n_i = len(seqs[i])
            res[i] = (h[r, :n_i].half(), ix[r, :n_i].int(), val[r, :n_i].half())
        if progress is not None:
            progress.update(sum(len(seqs[i]) for i in idx))
        b += n
    return res


def save_sequences(path: pathlib.Path, seqs: list[list[int]], tensors: dict) -> None:
    """A shard of token sequences: their tokens concatenated (int32) and seq_offsets (n + 1) beside `tensors`,
    written to `path` atomically (a temporary file, then renamed)."""
    from safetensors.torch import save_file

    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    out = {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
           "seq_offsets": torch.tensor(offsets, dtype=torch.int64)} | tensors
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(out, str(tmp))
    os.replace(tmp, path)


def write_shard(path: pathlib.Path, seqs: list[list[int]], targets, target_start: list[int], styles: list[int]):
    save_sequences(path, seqs, {
        "hidden": torch.cat([t[0] for t in targets]).contiguous(),
        "topk_idx": torch.cat([t[1] for t in targets]).contiguous(),
        "topk_val": torch.cat([t[2] for t in targets]).contiguous(),
        "target_start": torch.tensor(target_start, dtype=torch.int64),
        "style": torch.tensor(styles, dtype=torch.int64),
    })


@dataclasses.dataclass
class TeacherData:
    tokens: torch.Tensor
    hidden: torch.Tensor
    topk_idx: torch.Tensor
    topk_val: torch.Tensor
    seq_offsets: torch.Tensor
    target_start: torch.Tensor
    style: torch.Tensor
    sha256: str

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


def load_shards(paths: list[pathlib.Path]) -> TeacherData:
    from safetensors.torch import load_file

    parts = [load_file(str(p)) for p in sorted(paths)]
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    offs, base = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        offs.append(p["seq_offsets"][1:] + base)
        base += int(p["seq_offsets"][-1])
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    return TeacherData(cat("tokens"), cat("hidden"), cat("topk_idx"), cat("topk_val"), torch.cat(offs),
                       cat("target_start"), cat("style"), h.hexdigest())
