"""Drafter training loop over cached teacher targets: DDP (gloo on CPU) from 1 to N processes, tqdm
progress on rank 0, resumable from `<out>/train_state.pt` (model, optimizer, step, metric history).

Each step samples windows (context of up to `context_window` tokens + a block of k slots) with an RNG
seeded by (seed, rank, step), so a resumed run draws exactly the batches it would have drawn.
"""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import time

import torch
import torch.distributed as dist

from kv_cache_proposer.model import DrafterConfig, DrafterModel
from kv_cache_proposer.training.losses import LossWeights, drafter_loss
from kv_cache_proposer.training.teacher import TeacherData

STATE_FILE = "train_state.pt"


@dataclasses.dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 32  # windows per rank per step
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    block_sizes: tuple[int, ...] = (2, 4, 8)
    all_masked_frac: float = 0.5  # else MDLM random-ratio masking of the block
    short_context_frac: float = 0.15
    hidden_lag2_frac: float = 0.15  # the last two context tokens lack verifier hidden states
    no_hidden_frac: float = 0.05
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    time_budget_s: float = 0.0  # stop (and save) once exceeded; 0 = no budget
    loss: LossWeights = dataclasses.field(default_factory=LossWeights)


def dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def choose_draft_vocab(data: TeacherData, vocab_size: int, n: int, always: list[int]) -> torch.Tensor:
    """The n most frequent tokens of the teacher's argmax predictions and of the sequences (FR-Spec)."""
    if n <= 0 or n >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(data.tokens.long(), minlength=vocab_size).float()
    counts += torch.bincount(data.topk_idx[:, 0].long(), minlength=vocab_size).float()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf") if always else counts[:0]
    top = torch.topk(counts, n).indices
    return torch.sort(top).values


class WindowSampler:
    def __init__(self, data: TeacherData, context_window: int, col_of: torch.Tensor):
        self.d, self.C, self.col_of = data, context_window, col_of
        self.starts = data.seq_offsets[:-1]
        self.ends = data.seq_offsets[1:]
        self._cum: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _anchors(self, k: int):
        if k not in self._cum:
            lo = self.starts + self.d.target_start.clamp(min=1)
            hi = self.ends - k  # last anchor a with a + k - 1 <= end - 1
            cnt = (hi - lo + 1).clamp(min=0)
            if int(cnt.sum()) == 0:
                raise ValueError(f"no training window fits a block of {k}: sequences are too short")
            self._cum[k] = (lo, torch.cumsum(cnt, 0))
        return self._cum[k]

    def batch(self, g: torch.Generator, B: int, k: int, tc: TrainConfig) -> dict[str, torch.Tensor]:
        d, C = self.d, self.C
        lo, cum = self._anchors(k)
        u = torch.randint(0, int(cum[-1]), (B,), generator=g)
        si = torch.searchsorted(cum, u, right=True)
        a = lo[si] + (u - torch.cat([torch.zeros(1, dtype=cum.dtype), cum])[si])  # anchor = first block token
        s0 = self.starts[si]
        L = C + k
        c_eff = torch.minimum(torch.full_like(a, C), a - s0)
        short = torch.rand(B, generator=g) < tc.short_context_frac
        c_rand = (torch.rand(B, generator=g) * c_eff.float()).long().clamp(min=1)
        c_eff = torch.where(short, torch.minimum(c_rand, c_eff), c_eff)
        pos = torch.arange(L)
        gidx = a[:, None] - C + pos[None, :]  # global index of each local position (B, L)
        valid = pos[None, :] >= (C - c_eff)[:, None]  # not left padding
        ids = torch.where(valid, d.tokens[gidx.clamp(0, d.n_tokens - 1)].long(), torch.zeros_like(gidx))
        # verifier hidden of the previous token, for context indices 1..T_h of the window
        r = torch.rand(B, generator=g)
        th = torch.where(r < tc.no_hidden_frac, torch.zeros_like(c_eff),
                         torch.where(r < tc.no_hidden_frac + tc.hidden_lag2_frac, c_eff - 2, c_eff - 1)).clamp(min=0)
        i_win = pos[None, :] - (C - c_eff)[:, None]
        has_hidden = valid & (i_win >= 1) & (i_win <= th[:, None]) & (pos[None, :] < C)
        in_hidden = d.hidden[(gidx - 1).clamp(0, d.n_tokens - 1)]  # (B, L, Hv)
        # block masking
        all_m = torch.rand(B, generator=g) < tc.all_masked_frac
        ratio = torch.rand(B, 1, generator=g)
        bm = (torch.rand(B, k, generator=g) < ratio) | all_m[:, None]
        none = ~bm.any(1)
        force = torch.randint(0, k, (B,), generator=g)
        bm[none, force[none]] = True
        masked = torch.zeros(B, L, dtype=torch.bool)
        masked[:, C:] = bm
        masked |= ~valid
        # targets: masked slot j (global a+j) is predicted at local position C-1+j from teacher row a+j-1
        b_idx, j_idx = bm.nonzero(as_tuple=True)
        trow = a[b_idx] + j_idx - 1
        return {
            "ids": ids, "masked": masked, "in_hidden": in_hidden, "has_hidden": has_hidden,
            "pad_mask": valid[:, None, None, :],
            "t_b": b_idx, "t_pos": C - 1 + j_idx,
            "t_hidden": d.hidden[trow], "t_topk_col": self.col_of[d.topk_idx[trow].long()],
            "t_topk_val": d.topk_val[trow], "t_col": self.col_of[d.tokens[trow + 1].long()],
        }


def _lr_at(step: int, tc: TrainConfig, elapsed_s: float = 0.0) -> float:
    """Linear warmup, then cosine to min_lr_frac over the steps or the time budget, whichever runs out first."""
    if step < tc.warmup:
        return (step + 1) / tc.warmup
    frac = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    if tc.time_budget_s > 0:
        frac = max(frac, elapsed_s / tc.time_budget_s)
    return tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def train(tc: TrainConfig, dcfg: DrafterConfig, data: TeacherData, embed: torch.Tensor, head: torch.Tensor,
          out_dir: str | pathlib.Path, *, draft_vocab: torch.Tensor, progress: bool = True) -> tuple[DrafterModel, dict]:
    from tqdm import tqdm

    rank, world = dist_info()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tc.seed)  # identical init on every rank
    model = DrafterModel(dcfg, embed, head)
    model.set_draft_vocab(draft_vocab)
    col_of = torch.full((dcfg.vocab_size,), -1, dtype=torch.long)
    col_of[model.draft_vocab] = torch.arange(model.draft_vocab.numel())
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95))
    start, history, elapsed0 = 0, [], 0.0
    state_path = out / STATE_FILE
    if state_path.exists():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["opt"])
        start, history, elapsed0 = st["step"], st["history"], st.get("elapsed_s", 0.0)
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, broadcast_buffers=False)
    sampler = WindowSampler(data, dcfg.context_window, col_of)
    bar = tqdm(total=tc.steps, initial=start, desc="train drafter", disable=not progress or rank != 0, dynamic_ncols=True)
    t0 = time.time()
    acc: dict[str, float] = {}
    n_acc = 0
    step = start
    stop = False

    def save(step_done: int):
        if rank == 0:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step_done, "history": history,
                        "elapsed_s": elapsed0 + time.time() - t0, "train_config": dataclasses.asdict(tc),
                        "drafter_config": dcfg.to_dict()}, tmp)
            os.replace(tmp, state_path)
        if world > 1:
            dist.barrier()

    while step < tc.steps and not stop:
        for gr in opt.param_groups:
            gr["lr"] = tc.lr * _lr_at(step, tc, elapsed0 + time.time() - t0)
        k = tc.block_sizes[int(torch.randint(0, len(tc.block_sizes), (1,), generator=torch.Generator().manual_seed(tc.seed * 7 + step)))]
        g = torch.Generator().manual_seed(tc.seed * 1_000_003 + rank * 7919 + step)
        bt = sampler.batch(g, tc.batch_size, k, tc)
        h, _ = net(bt["ids"], bt["masked"], bt["in_hidden"], bt["has_hidden"], bt["pad_mask"]) if world > 1 else \
            model.encode(bt["ids"], bt["masked"], bt["in_hidden"], bt["has_hidden"], bt["pad_mask"])
        ht = h[bt["t_b"], bt["t_pos"]]  # (M, d)
        pred = model.project(ht)
        logits = pred @ model.draft_head.T
        loss, parts = drafter_loss(pred, logits, bt["t_hidden"], bt["t_topk_col"], bt["t_topk_val"], bt["t_col"], tc.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        step += 1
        for kk, v in parts.items():
            acc[kk] = acc.get(kk, 0.0) + v
        n_acc += 1
        if step % tc.log_every == 0 or step == tc.steps:
            rec = {kk: round(v / n_acc, 4) for kk, v in acc.items()}
            rec.update(step=step, lr=round(opt.param_groups[0]["lr"], 6), grad_norm=round(float(gnorm), 3),
                       elapsed_s=round(elapsed0 + time.time() - t0, 1))
            history.append(rec)
            bar.set_postfix(loss=rec["loss"], top1=rec["top1"], hid=rec["hidden"])
            acc, n_acc = {}, 0
        bar.update(1)
        if tc.time_budget_s > 0:
            over = torch.tensor([1.0 if time.time() - t0 + elapsed0 > tc.time_budget_s else 0.0])
            if world > 1:
                dist.all_reduce(over, op=dist.ReduceOp.MAX)
            stop = bool(over.item() > 0)
        if step % tc.save_every == 0 or step == tc.steps or stop:
            save(step)
    bar.close()
    return model, {"steps_done": step, "history": history, "elapsed_s": round(elapsed0 + time.time() - t0, 1),
                   "world_size": world, "stopped_by_time_budget": stop and step < tc.steps}
