"""Training of the v2 (DFlash-style) drafter over the cached chunks of dflash_data.

Recipe (DFlash, as SpecForge trains it, plus ADR 0001 where it applies): random anchors a in the
verifier's own sequences; the block [x_a, MASK x (B-1)] attends to the captured hidden states of
positions [a - W, a - 1] and to itself (a mask isolates every block); slot j is supervised with the
verifier's greedy token x_{a+j} (cross-entropy over the draft vocabulary), weighted exp(-(j-1)/gamma)
so later slots count less, and only while x_{a+1..a+j} is the verifier's greedy continuation (on its
own generations always; in prompts where the text agrees with it). ADR 0001's hidden-state alignment
is the auxiliary loss: smooth-L1 between out_proj(slot j) and the verifier's final hidden at a+j-1.
Shared embedding and head stay frozen. Runs alone or under torchrun (DDP: gloo on CPU, nccl on CUDA).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import pathlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel
from kv_cache_proposer.training import dflash_data


@dataclasses.dataclass
class LossWeights:
    ce: float = 1.0
    hidden: float = 0.5
    slot_decay_gamma: float = 4.0


@dataclasses.dataclass
class TrainConfig:
    steps: int = 100000
    seqs_per_step: int = 8
    anchors_per_seq: int = 16
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    time_budget_s: float = 0.0
    feat_dropout: float = 0.0  # dropout on the fused context features (the verifier states identify training positions)
    val_every_seq: int = 0  # > 0: 1 in n sequences of each style, at random, held out; the best validated weights are kept
    eval_every: int = 50
    loss: LossWeights = dataclasses.field(default_factory=LossWeights)


class AnchorSampler:
    """Batches of (sequence window, anchors) from the cached data."""

    def __init__(self, data: dict, cfg: DFlashConfig, gen: torch.Generator, keep=lambda s: True):
        self.d, self.cfg, self.g = data, cfg, gen
        toks, am = data["tokens"].long(), data["argmax"].long()
        offs = data["seq_offsets"].tolist()
        ok = torch.zeros(toks.numel(), dtype=torch.bool)
        ok[:-1] = am[:-1] == toks[1:]
        run = torch.zeros(toks.numel() + 1, dtype=torch.int64)
        okl = ok.tolist()
        ends = set(offs[1:])
        r = 0
        for t in range(toks.numel() - 1, -1, -1):  # greedy-agreement run length from t, within its sequence
            r = 0 if (t + 1 in ends) or not okl[t] else r + 1
            run[t] = r
        self.run = run[:-1]
        self.seqs = []
        for s in range(len(offs) - 1):
            lo, hi = offs[s], offs[s + 1]
            anchors = (torch.arange(lo + 1, hi)[self.run[lo + 1 : hi] >= 1])  # >= 1 context position, slot 1 valid
            if anchors.numel() and keep(s):
                self.seqs.append((lo, hi, anchors))
        self.weights = torch.tensor([float(a.numel()) for _, _, a in self.seqs])

    @property
    def n_anchors(self) -> int:
        return int(self.weights.sum())

    def batch(self, n_seqs: int, n_anchors: int) -> dict:
        cfg, d = self.cfg, self.d
        W, bs = cfg.context_window, cfg.block_size
        pick = torch.multinomial(self.weights, n_seqs, replacement=True, generator=self.g).tolist()
        rows = []
        for s in pick:
            lo, hi, anchors = self.seqs[s]
            a = anchors[torch.randint(anchors.numel(), (n_anchors,), generator=self.g)].sort().values
            c0 = max(lo, int(a[0]) - W)
            rows.append((lo, hi, c0, int(a[-1]), a))
        S = max(c1 - c0 for _, _, c0, c1, _ in rows)
        B, N, Fz, H = n_seqs, n_anchors, d["feats"].shape[1], d["final"].shape[1]
        feats = torch.zeros(B, S, Fz, dtype=torch.float32)
        cpos = torch.zeros(B, S, dtype=torch.int64)
        cvalid = torch.zeros(B, S, dtype=torch.bool)
        first = torch.zeros(B, N, dtype=torch.int64)
        bpos = torch.zeros(B, N, bs, dtype=torch.int64)
        tgt = torch.zeros(B, N, bs - 1, dtype=torch.int64)
        tvalid = torch.zeros(B, N, bs - 1, dtype=torch.bool)
        hid = torch.zeros(B, N, bs - 1, H, dtype=torch.float32)
        toks = d["tokens"].long()
        j = torch.arange(1, bs)
        for b, (lo, hi, c0, c1, a) in enumerate(rows):
            n = c1 - c0
            feats[b, :n] = d["feats"][c0:c1].float()
            cpos[b, :n] = torch.arange(c0 - lo, c1 - lo)
            cvalid[b, :n] = True
            first[b] = toks[a]
            bpos[b] = (a - lo)[:, None] + torch.arange(bs)
            idx = (a[:, None] + j).clamp(max=hi - 1)
            tgt[b] = toks[idx]
            tvalid[b] = (self.run[a][:, None] >= j) & (a[:, None] + j < hi)
            hid[b] = d["final"][idx - 1].float()
        # mask: block n of row b sees context positions [a_n - W, a_n - 1] and its own block
        apos = bpos[:, :, 0]  # (B, N) anchor positions (relative to the sequence)
        ctx = cvalid[:, None, :] & (cpos[:, None, :] <= apos[:, :, None] - 1) & (cpos[:, None, :] >= apos[:, :, None] - W)
        ctx = ctx.repeat_interleave(bs, dim=1)  # (B, N*bs, S)
        blk = torch.block_diag(*[torch.ones(bs, bs, dtype=torch.bool)] * N).expand(B, -1, -1)
        mask = torch.cat([ctx, blk], dim=2)[:, None]
        return {"feats": feats, "cpos": cpos, "first": first, "bpos": bpos.flatten(1), "mask": mask, "tgt": tgt,
                "tvalid": tvalid, "hid": hid}


def choose_draft_vocab(data: dict, vocab_size: int, n: int, always: list[int]) -> torch.Tensor:
    """The n most frequent verifier greedy tokens (FR-Spec), always including `always` (EOS)."""
    if n <= 0 or n >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(data["argmax"].long(), minlength=vocab_size).float()
    counts += 0.5 * torch.bincount(data["tokens"].long(), minlength=vocab_size).float()
    if always:
        counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return torch.sort(torch.topk(counts, n).indices).values


def step_loss(model: DFlashModel, b: dict, col_of: torch.Tensor, w: LossWeights, device,
              feat_dropout: float = 0.0) -> tuple[torch.Tensor, dict]:
    m = model.module if hasattr(model, "module") else model
    b = {k: v.to(device) for k, v in b.items()}
    B, N, K = b["tgt"].shape
    proj = model(b["feats"], b["cpos"], b["first"], b["bpos"], b["mask"], feat_dropout=feat_dropout)  # (B, N*bs, Hv), via DDP's forward
    proj = proj.view(B, N, K + 1, -1)[:, :, 1:]  # the mask slots
    logits = proj @ m.draft_head.T.to(proj.dtype)
    cols = col_of.to(device)[b["tgt"]]
    valid = b["tvalid"] & (cols >= 0)
    decay = torch.exp(-torch.arange(K, device=device, dtype=torch.float32) / w.slot_decay_gamma)
    wt = valid.float() * decay
    denom = wt.sum().clamp(min=1.0)
    ce = F.cross_entropy(logits.flatten(0, 2).float(), cols.clamp(min=0).flatten(), reduction="none").view(B, N, K)
    hl = F.smooth_l1_loss(proj.float(), b["hid"], reduction="none").mean(-1)
    loss = w.ce * (ce * wt).sum() / denom + w.hidden * (hl * wt).sum() / denom
    with torch.no_grad():
        hit = (logits.argmax(-1) == cols) & valid
        per_slot = [(hit[..., j].sum() / valid[..., j].sum().clamp(min=1)).item() for j in range(K)]
        # accepted drafts per block if the verifier checked them in order (on blocks whose targets are all greedy)
        full = b["tvalid"].all(-1)
        acc_len = torch.cumprod(hit.long(), dim=-1).sum(-1)[full].float().mean().item() if full.any() else 0.0
    return loss, {"loss": loss.item(), "ce": ((ce * wt).sum() / denom).item(), "hidden": ((hl * wt).sum() / denom).item(),
                  "top1_slot": [round(x, 4) for x in per_slot], "accepted_per_block": round(acc_len, 4)}


def lr_at(tc: TrainConfig, step: int, elapsed: float) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    prog = step / max(1, tc.steps)
    if tc.time_budget_s:
        prog = max(prog, elapsed / tc.time_budget_s)
    prog = min(1.0, prog)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def validation_split(style: torch.Tensor, n: int, seed: int = 12345) -> torch.Tensor:
    """Held-out sequences: 1 in n of each style (at least one), drawn at random. Every n-th sequence would not do:
    the corpus interleaves styles with a period that can divide n (cpu_features' plan made every 50th one chat)."""
    g = torch.Generator().manual_seed(seed)
    held = torch.zeros(style.numel(), dtype=torch.bool)
    for st in style.unique().tolist():
        idx = (style == st).nonzero().flatten()
        held[idx[torch.randperm(idx.numel(), generator=g)[: max(1, idx.numel() // n)]]] = True
    return held


def train(tc: TrainConfig, cfg: DFlashConfig, data: dict, embed, head, work: pathlib.Path, *, draft_vocab: torch.Tensor,
          rank: int = 0, world: int = 1, device="cpu", log=print, init_state: dict | None = None,
          run_key: dict | None = None) -> tuple[DFlashModel, dict]:
    torch.manual_seed(tc.seed)
    model = DFlashModel(cfg, embed.to(device), head.to(device)).to(device)
    model.set_draft_vocab(draft_vocab)
    if init_state is not None:  # warm start (--init-from): a checkpoint's weights, its config and draft vocabulary
        missing, unexpected = model.load_state_dict(init_state, strict=False)
        if missing or unexpected:
            raise SystemExit(f"--init-from does not match the drafter's config: missing {missing}, unexpected {unexpected}")
    col_of = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    col_of[model.draft_vocab.cpu()] = torch.arange(model.draft_vocab.numel())
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95))
    state_path = work / "train_state_v2.pt"
    step, history, elapsed0 = 0, [], 0.0
    if state_path.exists():
        st = torch.load(state_path, map_location=device, weights_only=False)
        if st.get("run_key") != run_key:  # a state of another run (other data, flags, warm start) is never resumed
            was = st.get("run_key") or {}
            diff = sorted(k for k in set(was) | set(run_key or {}) if was.get(k) != (run_key or {}).get(k))
            raise SystemExit(f"{state_path} is the train state of another run (differs in: {', '.join(diff)}); "
                             "move it away to train from the start, or rerun with that run's data and flags to resume it")
        model.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["opt"])
        step, history, elapsed0 = st["step"], st["history"], st["elapsed"]
        log(f"resumed at step {step} ({elapsed0:.0f}s trained)")
    net = model
    if dist.is_initialized():  # torchrun: gradients all-reduced over the processes (gloo on CPU, nccl on CUDA)
        net = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    gen = torch.Generator().manual_seed(tc.seed * 1000 + rank * 7919 + step)
    n = tc.val_every_seq
    held = validation_split(data["style"], n) if n else torch.zeros(data["style"].numel(), dtype=torch.bool)
    sampler = AnchorSampler(data, cfg, gen, keep=lambda s: not held[s])
    val_batches, best = [], None
    if n:
        vs = AnchorSampler(data, cfg, torch.Generator().manual_seed(12345), keep=lambda s: bool(held[s]))
        val_batches = [vs.batch(tc.seqs_per_step, tc.anchors_per_seq) for _ in range(6)]
        log(f"r{rank}: validation: {len(vs.seqs)} sequences, {len(val_batches)} fixed batches")
    log(f"r{rank}: {len(sampler.seqs)} sequences, {sampler.n_anchors} anchors")
    t0 = time.time()
    stopped = False
    acc: list[dict] = []
    while step < tc.steps:
        elapsed = elapsed0 + time.time() - t0
        if tc.time_budget_s and elapsed >= tc.time_budget_s:
            stopped = True
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(tc, step, elapsed)
        b = sampler.batch(tc.seqs_per_step, tc.anchors_per_seq)
        loss, met = step_loss(net, b, col_of, tc.loss, device, feat_dropout=tc.feat_dropout)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip).item()
        opt.step()
        step += 1
        acc.append(met)
        if step % tc.log_every == 0:
            row = {"step": step, "lr": round(opt.param_groups[0]["lr"], 6), "grad_norm": round(gn, 3),
                   "elapsed_s": round(elapsed0 + time.time() - t0, 1)}
            for k in ("loss", "ce", "hidden", "accepted_per_block"):
                row[k] = round(sum(a[k] for a in acc) / len(acc), 4)
            row["top1_slot"] = [round(sum(a["top1_slot"][j] for a in acc) / len(acc), 4) for j in range(cfg.block_size - 1)]
            acc = []
            if val_batches and step % tc.eval_every == 0:
                model.eval()
                with torch.no_grad():
                    vm = [step_loss(model, vb, col_of, tc.loss, device)[1] for vb in val_batches]
                model.train()
                row["val_accepted_per_block"] = round(sum(v["accepted_per_block"] for v in vm) / len(vm), 4)
                row["val_top1_slot"] = [round(sum(v["top1_slot"][j] for v in vm) / len(vm), 4) for j in range(cfg.block_size - 1)]
                if best is None or row["val_accepted_per_block"] > best[0]:
                    best = (row["val_accepted_per_block"], step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            history.append(row)
            if rank == 0:
                log(f"step {step} " + " ".join(f"{k}={v}" for k, v in row.items() if k != "step"))
        if step % tc.save_every == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                        "elapsed": elapsed0 + time.time() - t0, "run_key": run_key}, state_path)
    elapsed = elapsed0 + time.time() - t0
    best_info = None
    if best is not None:  # export the best validated weights, not the last (the small data set is memorised)
        best_info = {"val_accepted_per_block": best[0], "step": best[1]}
        model.load_state_dict(best[2])
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                    "elapsed": elapsed, "run_key": run_key}, state_path)
    return model, {"steps_done": step, "elapsed_s": round(elapsed, 1), "stopped_by_time_budget": stopped, "history": history,
                   "best_validated": best_info}


def warm_start(name_or_path: str, layers, vocab_size: int, verifier_hidden: int) -> tuple[DFlashConfig, dict]:
    """A v2 checkpoint's config and weights (fp32) to start training from; its captured layers must be the data's."""
    import json

    from safetensors.torch import load_file

    from kv_cache_proposer.drafter import FORMAT_V2, MANIFEST_FILE, WEIGHTS_FILE, resolve_checkpoint

    path = resolve_checkpoint(name_or_path)
    man = json.loads((path / MANIFEST_FILE).read_text())
    if man.get("format") != FORMAT_V2:
        raise SystemExit(f"--init-from {path}: format {man.get('format')!r} is not {FORMAT_V2}")
    cfg = DFlashConfig.from_dict(man["config"])
    if list(cfg.capture_layers) != list(layers):
        raise SystemExit(f"--init-from {path} conditions on layers {list(cfg.capture_layers)}, the data on {list(layers)}")
    if (cfg.vocab_size, cfg.verifier_hidden_size) != (vocab_size, verifier_hidden):
        raise SystemExit(f"--init-from {path} was trained for vocab {cfg.vocab_size} x hidden {cfg.verifier_hidden_size}, "
                         f"the verifier has {vocab_size} x {verifier_hidden}")
    state = load_file(str(path / man.get("weights", WEIGHTS_FILE)))
    return cfg, {k: (v.float() if v.is_floating_point() else v.long()) for k, v in state.items()}


def run_training(args, embed, head, always_ids, work: pathlib.Path, out: pathlib.Path, *, rank: int, world: int,
                 data_seconds: float, commit: str, machine: dict) -> None:
    """scripts/training/train_drafter_v2.py's train stage: load the chunks, train, export with a manifest."""
    import json

    from kv_cache_proposer.drafter import resolve_checkpoint, save_drafter

    spec = json.loads((work / "jobs.json").read_text())
    own = sorted(work.glob("part-*.safetensors"))
    paths = list(own)
    extras = []
    for extra in getattr(args, "extra_data", None) or []:  # more chunk directories (e.g. teacher forced + generated)
        extra = pathlib.Path(extra).expanduser()
        other = json.loads((extra / "jobs.json").read_text())
        if other["layers"] != spec["layers"]:
            raise SystemExit(f"{extra} holds features of layers {other['layers']}, {work} of {spec['layers']}")
        more = sorted(extra.glob("part-*.safetensors"))
        extras.append({"dir": str(extra), "stage": other["description"].get("stage"), "max_new": other["max_new"],
                       "chunks": [p.name for p in more]})
        paths += more
    if not paths:
        raise SystemExit(f"no data chunks in {work}; run --stage data first")
    data = dflash_data.load_chunks(paths, mapped=True)  # feats and final read from the files as batches need them
    V, Hv = embed.shape
    init_from, init_state = getattr(args, "init_from", ""), None
    if init_from:
        cfg, init_state = warm_start(init_from, spec["layers"], V, Hv)
        draft_vocab = init_state["draft_vocab"]
    else:
        cfg = DFlashConfig(vocab_size=V, verifier_hidden_size=Hv, capture_layers=tuple(spec["layers"]),
                       hidden_size=args.hidden or Hv, num_layers=args.drafter_layers, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                       draft_vocab_size=args.draft_vocab if 0 < args.draft_vocab < V else 0,
                       context_window=args.context_window, block_size=args.block_size,
                       verifier=pathlib.Path(args.verifier).expanduser().name)
        draft_vocab = choose_draft_vocab(data, V, cfg.draft_vocab_size, always_ids)
    tc = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq, lr=args.lr,
                     save_every=args.save_every, seed=args.seed, time_budget_s=args.time_budget_min * 60,
                     feat_dropout=args.feat_dropout, val_every_seq=args.val_every_seq, weight_decay=args.weight_decay)
    device = f"cuda:{rank % max(1, torch.cuda.device_count())}" if torch.cuda.is_available() else "cpu"
    # what makes a run resumable: its data, its warm start, its drafter and the flags that shape its steps (not
    # --steps / --time-budget-min: a cut-off run is resumed with more of either)
    run_key = {"chunks": [str(p) for p in paths], "init_from": str(init_from), "config": dataclasses.asdict(cfg),
               "train": {k: v for k, v in dataclasses.asdict(tc).items() if k not in ("steps", "time_budget_s", "save_every", "log_every")}}
    model, info = train(tc, cfg, data, embed, head, work, draft_vocab=draft_vocab, rank=rank, world=world, device=device,
                        log=lambda s: print(s, flush=True), init_state=init_state, run_key=run_key)
    if rank != 0:
        return
    styles = {v: k for k, v in dflash_data.STYLES.items()}
    per_style = {}
    offs = data["seq_offsets"]
    for s, st in enumerate(data["style"].tolist()):
        e = per_style.setdefault(styles[st], {"sequences": 0, "tokens": 0, "generated_tokens": 0})
        e["sequences"] += 1
        e["tokens"] += int(offs[s + 1] - offs[s])
        e["generated_tokens"] += int(offs[s + 1] - offs[s] - data["gen_start"][s])
    greedy = data["argmax"].long()
    last = info["history"][-5:]
    manifest = {
        "name": out.name,
        "kind": "v2: DFlash-style block drafter conditioned on multi-layer verifier hidden states (dflash_model.py)",
        "verifier": {"name": cfg.verifier, "path_at_training": str(pathlib.Path(args.verifier).expanduser()),
                     "shares": "token embedding + LM head (frozen, passed in at load time, not stored)",
                     "captured_layers": list(cfg.capture_layers)},
        "data": {**spec["description"], "max_new_tokens": spec["max_new"],
                 "used": {"chunks": [p.name for p in own], "chunks_planned": len(dflash_data.chunk_jobs(spec["jobs"])),
                          "per_style": per_style, "tokens": int(data["tokens"].numel())},
                 "cache": {"dir": str(work), "sha256": data["sha256"]},
                 "extra_data": extras,
                 "heldout_prompts": "the benchmark uses kv_cache_proposer/checkpoints/smollm2-135m-dlm/heldout_prompts.json "
                                    "(same split rule; none of its keys reach a job)",
                 "note": getattr(args, "note", ""),
                 "draft_vocab_coverage_of_verifier_greedy_tokens": round(torch.isin(greedy, model.draft_vocab).float().mean().item(), 4)},
        "training": {
            "command": " ".join(["torchrun" if dist.is_initialized() else "python"] + sys.argv),
            "init_from": ({"checkpoint": str(resolve_checkpoint(init_from)), "note": "warm start: its config, draft "
                           "vocabulary and weights; the optimizer starts fresh"} if init_from else None),
            "world_size": world, "threads_per_process": torch.get_num_threads(),
            "backend": dist.get_backend() if dist.is_initialized() else "none (one process, no DDP)",
            "trained_on": machine, "commit_at_start": commit,
            "config": {**{k: v for k, v in tc.__dict__.items() if k != "loss"}, "loss": tc.loss.__dict__},
            "steps_done": info["steps_done"], "train_seconds": info["elapsed_s"],
            "exported": {"which": "best validated weights", **info["best_validated"]} if info["best_validated"] else "last step",
            "data_stage_seconds_this_run": round(data_seconds, 1), "stopped_by_time_budget": info["stopped_by_time_budget"],
            "final_metrics_mean_last_50_steps": {
                k: round(sum(r[k] for r in last) / len(last), 4) for k in ("loss", "ce", "hidden", "accepted_per_block")} if last else {},
            "final_top1_per_slot_last_50_steps": [round(sum(r["top1_slot"][j] for r in last) / len(last), 4)
                                                  for j in range(cfg.block_size - 1)] if last else [],
            "history": info["history"],
        },
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    save_drafter(model, out, manifest)
    print(f"wrote {out}", flush=True)
