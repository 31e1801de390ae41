#!/usr/bin/env python
"""Train the v2 drafter (DFlash-style block drafter conditioned on multi-layer verifier hidden states).

Stages: `data` (the verifier's greedy generations on chat / code / edit prompts + teacher-forced hidden
states of the captured layers, cached in chunks under --work-dir; resumable), `train` (DDP over the
cached chunks; gloo on CPU, nccl on CUDA) which also exports the checkpoint (fp16 safetensors +
manifest) into kv_cache_proposer/checkpoints/<name>.

    python scripts/training/train_drafter_v2.py --stage data --verifier ~/.cache/kakeya/models/smollm2-135m-instruct
    torchrun --nproc-per-node 1 scripts/training/train_drafter_v2.py --stage train --verifier ... --time-budget-min 35
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kv_cache_proposer.training import dflash_data  # noqa: E402
from kv_cache_proposer.training.dataset import eos_ids, pad_id, vocab_of, write_json  # noqa: E402
from kv_cache_proposer.training.teacher import default_teacher_dir, load_verifier, verifier_embed_and_head  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", required=True, help="local HF directory of the verifier")
    ap.add_argument("--name", default="smollm2-135m-dflash")
    ap.add_argument("--out", default=None, help="checkpoint dir (default kv_cache_proposer/checkpoints/<name>)")
    ap.add_argument("--work-dir", default=None, help="data cache + train state (default $KAKEYA_HOME/cache/drafter_teacher/<name>)")
    ap.add_argument("--stage", default="all", choices=["all", "data", "train"])
    ap.add_argument("--extra-data", nargs="*", default=[], metavar="DIR",
                    help="train stage: also the chunks in these directories (same capture layers; e.g. "
                         "cpu_features.py's teacher-forced and --generate directories together)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    # data
    ap.add_argument("--layers", default="1,8,15,22,28", help="verifier layers whose outputs condition the drafter")
    ap.add_argument("--chat-prompts", type=int, default=320)
    ap.add_argument("--code-prompts", type=int, default=224)
    ap.add_argument("--edit-prompts", type=int, default=160)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--synthetic", type=int, default=0, help="random-token prompts instead of the corpus (tiny test models)")
    ap.add_argument("--data-budget-min", type=float, default=0.0, help="stop building chunks after this long (0 = all)")
    # model
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=0, help="drafter width (default: the verifier's)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--context-window", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=5, help="[last token, block_size - 1 masks]")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary size (0 = full)")
    # training
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--seqs-per-step", type=int, default=8)
    ap.add_argument("--anchors-per-seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--time-budget-min", type=float, default=0.0)
    ap.add_argument("--feat-dropout", type=float, default=0.0, help="dropout on the fused verifier features (training)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--val-every-seq", type=int, default=0,
                    help="hold out 1 in n sequences of each style (at random) for validation; export the best validated weights (0 = off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", default="", help="warm start from this v2 checkpoint (shipped name or directory): its "
                    "config, draft vocabulary and weights; the drafter-shape flags are then ignored")
    ap.add_argument("--note", default="", help="recorded in the manifest's data section (how the data stage ran)")
    return ap.parse_args(argv)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def data_stage(args, model, tok, work: pathlib.Path, rank: int, world: int) -> None:
    layers = tuple(int(x) for x in args.layers.split(","))
    jobs_file = work / "jobs.json"
    if rank == 0 and not jobs_file.exists():
        jobs, desc = dflash_data.plan_jobs(tok, chat=args.chat_prompts, code=args.code_prompts, edit=args.edit_prompts,
                                           seed=args.seed, vocab_size=vocab_of(model), synthetic=args.synthetic)
        write_json(jobs_file, {"layers": list(layers), "max_new": args.max_new, "description": desc, "jobs": jobs})
    barrier()
    spec = json.loads(jobs_file.read_text())
    if tuple(spec["layers"]) != layers:
        raise SystemExit(f"{jobs_file} was planned for layers {spec['layers']}, not {list(layers)}; use another --work-dir")
    t0 = time.time()
    eos, pad = eos_ids(model, tok), pad_id(model, tok)
    for c, items in enumerate(dflash_data.chunk_jobs(spec["jobs"])):
        path = dflash_data.chunk_path(work, c)
        if c % world != rank or path.exists():
            continue
        if args.data_budget_min and time.time() - t0 > args.data_budget_min * 60:
            print(f"r{rank}: data budget spent, stopping before chunk {c}", flush=True)
            break
        info = dflash_data.build_chunk(model, items, layers=layers, max_new=spec["max_new"], eos=eos, pad=pad,
                                       gen_batch=args.gen_batch, path=path)
        print(f"r{rank}: chunk {c} {info} ({time.time() - t0:.0f}s)", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if "LOCAL_RANK" in os.environ and not dist.is_initialized():  # under torchrun (any number of processes): DDP
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(hours=3))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = pathlib.Path(args.out) if args.out else ROOT / "kv_cache_proposer" / "checkpoints" / args.name
    work = pathlib.Path(args.work_dir).expanduser() if args.work_dir else default_teacher_dir(args.name)
    work.mkdir(parents=True, exist_ok=True)
    model, tok = load_verifier(pathlib.Path(args.verifier).expanduser())
    t_start = time.time()
    if args.stage in ("all", "data"):
        data_stage(args, model, tok, work, rank, world)
    barrier()
    if args.stage == "data":
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    from kv_cache_proposer.training.dflash_trainer import run_training

    embed, head = verifier_embed_and_head(model)
    run_training(args, embed, head, eos_ids(model, tok), work, out, rank=rank, world=world,
                 data_seconds=time.time() - t_start, commit=git_commit(),
                 machine={"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                          "device": "cuda" if torch.cuda.is_available() else "cpu"})
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
