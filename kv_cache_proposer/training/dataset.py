"""Builds the drafter's training set as world-size-independent chunks of teacher targets.

Jobs (one per sequence) are chat prompts and code prefixes completed greedily by the verifier
(on-policy) and teacher-forced Python sources; every 64 jobs of one kind form a chunk written to
`<work>/part-<kind>-<NNN>.safetensors`. Rank r builds the chunks c with c % world == r and skips
those already on disk, so the stage resumes and scales with the number of processes.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import random

from kv_cache_proposer.training import corpus as corpus_mod
from kv_cache_proposer.training.teacher import STYLES, greedy_generate, teacher_forward, write_shard

CHUNK = 64


@dataclasses.dataclass
class DataPlan:
    chat_prompts: int = 1000
    code_prompts: int = 600
    code_texts: int = 300
    max_new: int = 64
    max_text_tokens: int = 384
    gen_batch: int = 24
    topk: int = 20
    seed: int = 0
    synthetic: int = 0  # > 0: random-token jobs for tiny test models (no tokenizer needed)


def _ids(x) -> list[int]:
    if hasattr(x, "keys"):
        x = x["input_ids"]
    return list(x)


def chat_ids(tok, text: str) -> list[int]:
    return _ids(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))


def code_ids(tok, text: str) -> list[int]:
    return _ids(tok(text, add_special_tokens=False)["input_ids"])


def plan_jobs(plan: DataPlan, tok, vocab_size: int) -> tuple[list[dict], dict, dict]:
    """(training jobs, held-out prompts, data description). Held-out source keys never reach a job."""
    rng = random.Random(plan.seed)
    if plan.synthetic:
        jobs = []
        for i in range(plan.synthetic):
            kind = ("chat", "text")[i % 2]
            n = rng.randint(8, 24) if kind == "chat" else rng.randint(32, 48)
            jobs.append({"kind": kind, "ids": [rng.randrange(3, vocab_size) for _ in range(n)], "key": f"syn:{i}"})
        return jobs, {"chat": [], "code": []}, {"synthetic": plan.synthetic}
    c = corpus_mod.build_corpus(seed=plan.seed)
    chat_tr, chat_ho = corpus_mod.split(c.chat)
    code_tr, code_ho = corpus_mod.split(c.code)
    text_tr, _ = corpus_mod.split(c.code_text)
    rng.shuffle(chat_tr)
    rng.shuffle(code_tr)
    rng.shuffle(text_tr)
    jobs = [{"kind": "chat", "ids": chat_ids(tok, p.text), "key": p.key, "text": p.text} for p in chat_tr[: plan.chat_prompts]]
    jobs += [{"kind": "code", "ids": code_ids(tok, p.text)[-192:], "key": p.key, "text": p.text} for p in code_tr[: plan.code_prompts]]
    jobs += [{"kind": "text", "ids": code_ids(tok, p.text)[: plan.max_text_tokens], "key": p.key} for p in text_tr[: plan.code_texts]]
    held = {
        "split_rule": f"sha1(source key) % {corpus_mod.HELDOUT_MOD} == 0 (keys: man:<command>, py:<module>)",
        "chat": [{"key": p.key, "text": p.text, "ids": chat_ids(tok, p.text)} for p in chat_ho[:60]],
        "code": [{"key": p.key, "text": p.text, "ids": code_ids(tok, p.text)[-192:]} for p in code_ho[:60]],
    }
    held_keys = {p["key"] for p in held["chat"] + held["code"]}
    leaked = [j["key"] for j in jobs if j["key"] in held_keys]
    if leaked:
        raise RuntimeError(f"held-out source keys leaked into training jobs: {leaked[:5]}")
    desc = {
        "sources": c.describe(),
        "jobs": {"chat_on_policy": sum(j["kind"] == "chat" for j in jobs),
                 "code_on_policy": sum(j["kind"] == "code" for j in jobs),
                 "code_teacher_forced": sum(j["kind"] == "text" for j in jobs)},
        "chat_templates": "user turns from templates over man-page NAME lines and stdlib function docstrings",
        "code_prefixes": "def line + docstring + first 25-50% of body of stdlib functions",
        "max_new_tokens": plan.max_new,
        "heldout": {"chat": len(held["chat"]), "code": len(held["code"]), "rule": held["split_rule"]},
    }
    return jobs, held, desc


def chunk_path(work: pathlib.Path, kind: str, c: int) -> pathlib.Path:
    return work / f"part-{kind}-{c:03d}.safetensors"


def chunks(jobs: list[dict]) -> list[tuple[str, int, list[dict]]]:
    """Chunks of CHUNK jobs of one kind, kinds interleaved so a partial run covers every kind."""
    per_kind = []
    for kind in ("chat", "code", "text"):
        ks = [j for j in jobs if j["kind"] == kind]
        per_kind.append([(kind, c // CHUNK, ks[c : c + CHUNK]) for c in range(0, len(ks), CHUNK)])
    out = []
    for i in range(max((len(p) for p in per_kind), default=0)):
        out += [p[i] for p in per_kind if i < len(p)]
    return out


def build_chunk(model, tok_eos: list[int], pad_id: int, kind: str, items: list[dict], plan: DataPlan, path: pathlib.Path,
                progress=None) -> None:
    prompts = [j["ids"] for j in items]
    if kind in ("chat", "code"):
        gens = greedy_generate(model, prompts, plan.max_new, tok_eos, pad_id, batch_size=plan.gen_batch)
        seqs = [p + g for p, g in zip(prompts, gens)]
        starts = [len(p) for p in prompts]
    else:
        seqs, starts = prompts, [1] * len(prompts)
    keep = [i for i, s in enumerate(seqs) if len(s) >= 4]
    seqs, starts = [seqs[i] for i in keep], [starts[i] for i in keep]
    targets = teacher_forward(model, seqs, topk=plan.topk)
    style = STYLES["synthetic"] if plan.synthetic else STYLES[kind if kind != "text" else "code"]
    write_shard(path, seqs, targets, starts, [style] * len(seqs))
    if progress is not None:
        progress.update(1)


def write_json(path: pathlib.Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def vocab_of(model) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def eos_ids(model, tok) -> list[int]:
    ids = set()
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    e = model.config.eos_token_id
    for x in (e if isinstance(e, list) else [e]):
        if x is not None:
            ids.add(int(x))
    return sorted(ids)


def pad_id(model, tok) -> int:
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    return int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
