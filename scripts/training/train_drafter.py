#!/usr/bin/env python
"""Train the dLM drafter for a verifier (ADR 0001 §4 recipe, CPU-sized).

Stages: `data` (on-policy generations + teacher hidden/top-k cached to disk in chunks), `train`
(DDP over cached targets, resumable), `export` (safetensors + manifest into the checkpoint dir).
Runs unchanged as `python scripts/training/train_drafter.py ...` (one process) or
`torchrun --nproc-per-node N scripts/training/train_drafter.py ...` (gloo DDP on CPU).

    torchrun --nproc-per-node 2 scripts/training/train_drafter.py \
        --verifier ~/.cache/kakeya/models/smollm2-135m-instruct --name smollm2-135m-dlm
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kv_cache_proposer.drafter import CHECKPOINTS_DIR, save_drafter  # noqa: E402
from kv_cache_proposer.model import DrafterConfig  # noqa: E402
from kv_cache_proposer.training import dataset  # noqa: E402
from kv_cache_proposer.training.teacher import default_teacher_dir, load_shards, load_verifier, verifier_embed_and_head  # noqa: E402
from kv_cache_proposer.training.trainer import TrainConfig, choose_draft_vocab, dist_info, train  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", required=True, help="local HF directory of the verifier")
    ap.add_argument("--name", default="smollm2-135m-dlm", help="drafter name (checkpoint folder)")
    ap.add_argument("--out", default=None, help="checkpoint dir (default kv_cache_proposer/checkpoints/<name>)")
    ap.add_argument("--work-dir", default=None, help="teacher cache + train state (default $KAKEYA_HOME/cache/drafter_teacher/<name>)")
    ap.add_argument("--stage", default="all", choices=["all", "data", "train"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    # data
    ap.add_argument("--chat-prompts", type=int, default=1000)
    ap.add_argument("--code-prompts", type=int, default=600)
    ap.add_argument("--code-texts", type=int, default=300)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=24)
    ap.add_argument("--allow-partial-data", action="store_true", help="train on the teacher chunks built so far")
    ap.add_argument("--synthetic", type=int, default=0, help="random-token jobs instead of the corpus (tiny test models)")
    # model
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=0, help="drafter width (default: the verifier's)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--context-window", type=int, default=32)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary size (0 = full)")
    ap.add_argument("--no-verifier-hidden", action="store_true", help="tokens-only drafter (ablation)")
    # training
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--block-sizes", default="2,4,8")
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--time-budget-min", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=3))
    rank, world = dist_info()
    out = pathlib.Path(args.out) if args.out else CHECKPOINTS_DIR / args.name
    work = pathlib.Path(args.work_dir).expanduser() if args.work_dir else default_teacher_dir(args.name)
    work.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    model, tok = load_verifier(pathlib.Path(args.verifier).expanduser())
    plan = dataset.DataPlan(chat_prompts=args.chat_prompts, code_prompts=args.code_prompts, code_texts=args.code_texts,
                            max_new=args.max_new, gen_batch=args.gen_batch, seed=args.seed, synthetic=args.synthetic)
    t_start = time.time()
    # ---- data
    jobs_file = work / "jobs.json"
    if rank == 0 and not jobs_file.exists():
        jobs, held, desc = dataset.plan_jobs(plan, tok, dataset.vocab_of(model))
        dataset.write_json(jobs_file, {"plan": plan.__dict__, "description": desc, "jobs": jobs})
        if held["chat"] or held["code"]:
            dataset.write_json(out / "heldout_prompts.json", held)
    barrier()
    spec = json.loads(jobs_file.read_text())
    chunk_list = dataset.chunks(spec["jobs"])
    mine = [(i, c) for i, c in enumerate(chunk_list) if i % world == rank]
    if args.stage in ("all", "data"):
        todo = [(i, c) for i, c in mine if not dataset.chunk_path(work, c[0], c[1]).exists()]
        bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc=f"teacher data r{rank}", position=rank,
                   disable=args.no_progress, dynamic_ncols=True)
        for _, (kind, c, items) in todo:
            dataset.build_chunk(model, dataset.eos_ids(model, tok), dataset.pad_id(model, tok), kind, items, plan,
                                dataset.chunk_path(work, kind, c), progress=bar)
        bar.close()
    barrier()
    t_data = time.time() - t_start
    if args.stage == "data":
        return 0
    # ---- train
    paths = [dataset.chunk_path(work, k, c) for k, c, _ in chunk_list]
    missing = [str(p) for p in paths if not p.exists()]
    if missing and not args.allow_partial_data:
        raise SystemExit(f"teacher data incomplete ({len(missing)} chunks missing, e.g. {missing[0]}); "
                         "run --stage data first, or pass --allow-partial-data to train on the chunks built so far")
    paths = [p for p in paths if p.exists()]
    data = load_shards(paths)
    used = {"chunks": [p.name for p in paths]}
    for style, code in (("chat_on_policy", 0), ("code", 1)):
        sel = (data.style == code).nonzero().squeeze(1)
        used[f"{style}_sequences"] = int(sel.numel())
    used["tokens"] = data.n_tokens
    embed, head = verifier_embed_and_head(model)
    V, Hv = embed.shape
    dcfg = DrafterConfig(vocab_size=V, verifier_hidden_size=Hv, hidden_size=args.hidden or Hv, num_layers=args.layers,
                         num_heads=args.heads, intermediate_size=args.intermediate, context_window=args.context_window,
                         draft_vocab_size=args.draft_vocab if 0 < args.draft_vocab < V else 0,
                         uses_verifier_hidden=not args.no_verifier_hidden, verifier=pathlib.Path(args.verifier).name)
    always = dataset.eos_ids(model, tok)
    draft_vocab = choose_draft_vocab(data, V, dcfg.draft_vocab_size, always)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     block_sizes=tuple(int(x) for x in args.block_sizes.split(",")), save_every=args.save_every,
                     seed=args.seed, time_budget_s=args.time_budget_min * 60)
    del model
    drafter, info = train(tc, dcfg, data, embed, head, work, draft_vocab=draft_vocab, progress=not args.no_progress)
    if rank == 0:
        covered = torch.isin(data.topk_idx[:, 0].long(), drafter.draft_vocab).float().mean().item()
        last = info["history"][-5:]
        manifest = {
            "name": args.name,
            "verifier": {"name": dcfg.verifier, "path_at_training": str(pathlib.Path(args.verifier).expanduser()),
                         "shares": "token embedding + LM head (frozen, passed in at load time, not stored)"},
            "data": {**spec["description"], "plan": spec["plan"], "used": used,
                     "teacher_cache": {"dir": str(work), "chunks": len(paths), "tokens": data.n_tokens, "sha256": data.sha256,
                                       "topk": plan.topk},
                     "draft_vocab_coverage_of_teacher_argmax": round(covered, 4)},
            "training": {
                "command": " ".join(["torchrun" if world > 1 else "python"] + sys.argv),
                "world_size": world, "threads_per_process": args.threads, "backend": "gloo" if world > 1 else "none",
                "config": {**tc.__dict__, "loss": tc.loss.__dict__},
                "steps_done": info["steps_done"], "train_seconds": info["elapsed_s"],
                "data_stage_seconds_this_run": round(t_data, 1),
                "stopped_by_time_budget": info["stopped_by_time_budget"],
                "final_metrics_mean_last_50_steps": {k: round(sum(r[k] for r in last) / len(last), 4)
                                                     for k in ("loss", "hidden", "kd", "ce", "top1")} if last else {},
                "history": info["history"],
                "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
            },
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        save_drafter(drafter, out, manifest)
        print(f"wrote {out}")
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
