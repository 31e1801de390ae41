"""Training and held-out evaluation of the v2 drafter on the device, over a `gpu_data.SeqBuffer`.

The recipe is dflash_trainer's (DFlash as SpecForge trains it, plus ADR 0001's hidden alignment): random
anchors a; the block [x_a, MASK x (B-1)] attends to the captured features of positions [a - W, a - 1] and to
itself; slot j is trained with cross-entropy on the verifier's greedy token x_{a+j} over the draft
vocabulary, weighted exp(-(j-1)/gamma), only while x_{a+1..a+j} is the verifier's greedy continuation;
smooth-L1 of out_proj(slot j) to the verifier's final hidden at a+j-1 is the auxiliary loss. What differs is
the batching, built for a GPU: a batch is `windows` context windows of W + span - 1 positions, each with
`anchors` blocks whose anchors lie in the window's last `span` positions, all gathered on the device
(vectorised, no Python loop per sequence), so one window's features serve many blocks; bf16 autocast on
CUDA; metrics are read back only every `log_every` steps; the learning rate follows the wall clock.

Evaluation drafts at every position of the held-out continuations in batches through the same forward
(which equals DFlashDrafter.draft at that position: tests/proposer/test_gpu_drafter_run.py) and replays
greedy speculative decoding at k = 4 along each continuation: a verify step at position p drafts
min(4, tokens left) and accepts the matching prefix; the next step starts after the accepted drafts and the
verifier's own token. alpha per slot = P(slot j accepted | slots before it accepted), tokens per verify
step = 1 + mean accepted (scripts/bench_speculative.py's figures, offline).
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel
from kv_cache_proposer.training.dflash_trainer import LossWeights


@dataclasses.dataclass
class GpuTrainConfig:
    windows: int = 128  # context windows per step
    anchors: int = 16  # blocks per window
    span: int = 64  # anchors lie in a window's last `span` positions
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    feat_dropout: float = 0.1
    log_every: int = 25
    val_every_s: float = 10.0
    val_batches: int = 4
    seed: int = 0
    amp: bool = True  # bf16 autocast on CUDA
    loss: LossWeights = dataclasses.field(default_factory=LossWeights)


def _block_mask(n: int, bs: int, device) -> torch.Tensor:
    g = torch.arange(n * bs, device=device) // bs
    return g[:, None] == g[None, :]


def build_batch(buf, a0: torch.Tensor, a: torch.Tensor, avalid: torch.Tensor, W: int, span: int, bs: int,
                feat_cols: torch.Tensor | None = None, feat_dtype=None) -> dict:
    """a0 (B,) the window's first anchor, a (B, N) anchors (flat positions, same sequence as a0, in
    [a0, a0 + span)), avalid (B, N). Context rows: flat positions [a0 - W, a0 + span - 1) of a0's sequence."""
    dev = buf.device
    B, N = a.shape
    S = W + span - 1
    p = a0[:, None] - W + torch.arange(S, device=dev)
    s0, se = buf.seq_start[a0], buf.seq_end[a0]
    cvalid = (p >= s0[:, None]) & (p < se[:, None])
    pc = p.clamp(0, buf.cap - 1)
    feats = buf.feats[pc] if feat_cols is None else buf.feats[pc[..., None], feat_cols]
    if feat_dtype is not None:
        feats = feats.to(feat_dtype)
    cpos = (p - s0[:, None]).clamp(min=0)
    j = torch.arange(1, bs, device=dev)
    bpos = ((a - s0[:, None])[..., None] + torch.arange(bs, device=dev)).flatten(1)
    idx = torch.minimum(a[..., None] + j, (se - 1)[:, None, None])
    tvalid = (buf.run[a][..., None] >= j) & (a[..., None] + j < se[:, None, None]) & avalid[..., None]
    ctx = cvalid[:, None, :] & (p[:, None, :] <= a[..., None] - 1) & (p[:, None, :] >= a[..., None] - W)
    mask = torch.cat([ctx.repeat_interleave(bs, dim=1), _block_mask(N, bs, dev).expand(B, -1, -1)], 2)[:, None]
    return {"feats": feats, "cpos": cpos, "first": buf.tokens[a], "bpos": bpos, "mask": mask, "tgt": buf.tokens[idx],
            "tvalid": tvalid, "hid": buf.final[idx - 1], "ends": se, "a": a}


def sample_windows(buf, anchors: torch.Tensor, windows: int, n: int, span: int, gen: torch.Generator):
    """Random windows: a0 uniform over the anchors (so sequences count by their anchors), then n anchors
    uniform (with replacement) among the anchors of a0's sequence in [a0, a0 + span)."""
    dev = anchors.device
    A = anchors.numel()
    i0 = torch.randint(A, (windows,), device=dev, generator=gen)
    a0 = anchors[i0]
    hi = torch.minimum(a0 + span, buf.seq_end[a0])
    cnt = (torch.searchsorted(anchors, hi) - i0).clamp(min=1)
    off = torch.minimum((torch.rand(windows, n, device=dev, generator=gen) * cnt[:, None]).long(), cnt[:, None] - 1)
    a = anchors[i0[:, None] + off].sort(1).values
    return a0, a, torch.ones_like(a, dtype=torch.bool)


def forward_logits(model: DFlashModel, b: dict, feat_dropout: float = 0.0):
    """(proj (B, N, K, Hv), logits (B, N, K, draft vocab)) of the mask slots."""
    B, N, K = b["tgt"].shape
    proj = model(b["feats"], b["cpos"], b["first"], b["bpos"], b["mask"], feat_dropout=feat_dropout)
    proj = proj.view(B, N, K + 1, -1)[:, :, 1:]
    return proj, proj @ model.draft_head.T.to(proj.dtype)


def loss_fn(model: DFlashModel, b: dict, col_of: torch.Tensor, w: LossWeights, feat_dropout: float, metrics: bool):
    proj, logits = forward_logits(model, b, feat_dropout)
    B, N, K = b["tgt"].shape
    cols = col_of[b["tgt"]]
    valid = b["tvalid"] & (cols >= 0)
    decay = torch.exp(-torch.arange(K, device=logits.device, dtype=torch.float32) / w.slot_decay_gamma)
    wt = valid.float() * decay
    denom = wt.sum().clamp(min=1.0)
    ce = F.cross_entropy(logits.flatten(0, 2).float(), cols.clamp(min=0).flatten(), reduction="none").view(B, N, K)
    hl = F.smooth_l1_loss(proj.float(), b["hid"].float(), reduction="none").mean(-1)
    ce_m, hl_m = (ce * wt).sum() / denom, (hl * wt).sum() / denom
    loss = w.ce * ce_m + w.hidden * hl_m
    if not metrics:
        return loss, None
    with torch.no_grad():
        hit = (logits.argmax(-1) == cols) & valid
        top1 = hit.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)
        full = b["tvalid"].all(-1)
        acc = torch.cumprod(hit.long(), -1).sum(-1)[full].float().mean() if bool(full.any()) else torch.zeros((), device=hit.device)
        vals = torch.stack([loss.detach(), ce_m.detach(), hl_m.detach(), acc]).tolist()
    return loss, {"loss": round(vals[0], 4), "ce": round(vals[1], 4), "hidden": round(vals[2], 4),
                  "accepted_per_block": round(vals[3], 4), "top1_slot": [round(x, 4) for x in top1.tolist()]}


def choose_draft_vocab(counts: torch.Tensor, n: int, always: list[int]) -> torch.Tensor:
    V = counts.numel()
    if n <= 0 or n >= V:
        return torch.arange(V)
    c = counts.float().clone()
    if always:
        c[torch.tensor(always, dtype=torch.long)] = float("inf")
    return torch.sort(torch.topk(c, n).indices).values


class Trainer:
    def __init__(self, cfg: DFlashConfig, tc: GpuTrainConfig, embed, head, draft_vocab: torch.Tensor, device, *,
                 init_state: dict | None = None, log=print):
        torch.manual_seed(tc.seed)
        self.cfg, self.tc, self.device, self.log = cfg, tc, torch.device(device), log
        self.model = DFlashModel(cfg, embed.to(device), head.to(device)).to(device)
        if init_state is not None:
            self.model.load_state_dict(init_state, strict=False)
        self.model.set_draft_vocab(draft_vocab.to(device))
        self.col_of = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=device)
        self.col_of[self.model.draft_vocab] = torch.arange(self.model.draft_vocab.numel(), device=device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.params = params
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        kw = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), **kw)
        self.gen = torch.Generator(device=self.device).manual_seed(tc.seed + 1)
        self.amp = tc.amp and self.device.type == "cuda"
        self.step, self.history, self.train_s = 0, [], 0.0
        self.best: tuple | None = None  # (val accepted per block, step, state on the device)
        self.val_set: list[dict] | None = None
        self.val_rows: list[dict] = []
        self.snapshot_cpu: dict | None = None
        self.snapshot_step = -1

    def _autocast(self):
        if self.amp:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        import contextlib

        return contextlib.nullcontext()

    def lr_at(self, progress: float) -> float:
        tc = self.tc
        if self.step < tc.warmup:
            return tc.lr * (self.step + 1) / tc.warmup
        p = min(1.0, max(0.0, progress))
        return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))

    def _make_val_set(self, buf) -> None:
        va = buf.anchors("val")
        if va.numel() < 8:
            return
        g = torch.Generator(device=self.device).manual_seed(12345)
        tc = self.tc
        self.val_set = []
        for _ in range(tc.val_batches):
            a0, a, av = sample_windows(buf, va, max(1, tc.windows // 2), tc.anchors, tc.span, g)
            self.val_set.append(build_batch(buf, a0, a, av, self.cfg.context_window, tc.span, self.cfg.block_size))

    @torch.no_grad()
    def validate(self, buf) -> dict | None:
        if self.val_set is None:
            self._make_val_set(buf)
        if not self.val_set:
            return None
        self.model.eval()
        rows = []
        with self._autocast():
            for b in self.val_set:
                rows.append(loss_fn(self.model, b, self.col_of, self.tc.loss, 0.0, True)[1])
        self.model.train()
        out = {"val_accepted_per_block": round(sum(r["accepted_per_block"] for r in rows) / len(rows), 4),
               "val_top1_slot": [round(sum(r["top1_slot"][j] for r in rows) / len(rows), 4) for j in range(len(rows[0]["top1_slot"]))],
               "val_ce": round(sum(r["ce"] for r in rows) / len(rows), 4)}
        if self.best is None or out["val_accepted_per_block"] > self.best[0]:
            self.best = (out["val_accepted_per_block"], self.step, {k: v.detach().clone() for k, v in self.model.state_dict().items()})
            self.take_snapshot()
        return out

    def take_snapshot(self) -> None:
        """A CPU copy of the weights to export if the run is cut short (the best validated ones when there are)."""
        src = self.best[2] if self.best is not None else self.model.state_dict()
        self.snapshot_cpu = {k: v.detach().to("cpu", copy=True) for k, v in src.items()}
        self.snapshot_step = self.best[1] if self.best is not None else self.step

    def train_until(self, buf, deadline: float, window: tuple[float, float], stop=None, min_anchors: int = 1,
                    min_steps: int = 1) -> str:
        """Train until time.monotonic() >= deadline (or stop() is true), at least min_steps steps once there is
        data. window = (start, end) of the training time this run plans, for the learning-rate schedule.
        Returns why it stopped."""
        tc, cfg = self.tc, self.cfg
        self.model.train()
        t_start = time.monotonic()
        last_val = last_snap = t_start
        acc_rows: list[dict] = []
        version, anchors = -1, None
        reason = "deadline"
        while True:
            now = time.monotonic()
            if buf.version != version:
                version, anchors = buf.version, buf.anchors("train")
            have = anchors is not None and anchors.numel() >= min_anchors
            if now >= deadline and (self.step >= min_steps or not have):
                break
            if stop is not None and stop():
                reason = "stopped"
                break
            if not have:
                time.sleep(0.05)
                continue
            prog = (now - window[0]) / max(1e-6, window[1] - window[0])
            lr = self.lr_at(prog)
            for g in self.opt.param_groups:
                g["lr"] = lr
            a0, a, av = sample_windows(buf, anchors, tc.windows, tc.anchors, tc.span, self.gen)
            b = build_batch(buf, a0, a, av, cfg.context_window, tc.span, cfg.block_size)
            want = (self.step + 1) % tc.log_every == 0
            with self._autocast():
                loss, met = loss_fn(self.model, b, self.col_of, tc.loss, tc.feat_dropout, want)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip)
            self.opt.step()
            self.step += 1
            if met is not None:
                met["grad_norm"] = round(float(gn), 3)
                acc_rows.append(met)
                row = {"step": self.step, "lr": round(lr, 6), "train_s": round(self.train_s + time.monotonic() - t_start, 1),
                       "anchors": int(anchors.numel()), **met}
                now = time.monotonic()
                if now - last_val >= tc.val_every_s:
                    last_val = now
                    v = self.validate(buf)
                    if v:
                        row.update(v)
                self.history.append(row)
                self.log("train " + " ".join(f"{k}={v}" for k, v in row.items()))
                if now - last_snap >= max(5.0, tc.val_every_s) and self.best is None:
                    last_snap = now
                    self.take_snapshot()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.train_s += time.monotonic() - t_start
        return reason

    def final_state(self, buf) -> tuple[dict, dict]:
        """(state to export, which): the best validated weights (validated once more at the last step) if
        validation ran, else the last step's."""
        last = self.validate(buf) if self.step else None
        if self.best is not None:
            return self.best[2], {"which": "best validated weights", "step": self.best[1],
                                  "val_accepted_per_block": self.best[0], "last_step": self.step, "last_step_val": last}
        return self.model.state_dict(), {"which": "last step", "step": self.step}


# ----------------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def draft_every_position(model: DFlashModel, buf, seqs: list[dict], feat_cols, *, span: int = 64, windows: int = 64,
                         deadline: float | None = None) -> tuple[dict, bool]:
    """Drafts at every position p of each sequence's continuation ([gen_start, end - 1)): the block is
    [x_p, MASK...] at p, its context the W positions before p. Returns ({seq index: (positions, drafts (n, K),
    targets (n, K), avail (n,))}, complete)."""
    cfg = model.cfg
    W, bs, K, dev = cfg.context_window, cfg.block_size, cfg.block_size - 1, buf.device
    fdt = model.fc.weight.dtype
    wins = []  # (seq index, [positions])
    for si, m in enumerate(seqs):
        ps = list(range(m["gen_start"], m["end"] - 1))
        for i in range(0, len(ps), span):
            wins.append((si, ps[i : i + span]))
    out: dict = {}
    complete = True
    model.eval()
    for w0 in range(0, len(wins), windows):
        if deadline is not None and time.monotonic() > deadline:
            complete = False
            break
        grp = wins[w0 : w0 + windows]
        a = torch.tensor([ps + [ps[-1]] * (span - len(ps)) for _, ps in grp], device=dev)
        av = torch.tensor([[True] * len(ps) + [False] * (span - len(ps)) for _, ps in grp], device=dev)
        b = build_batch(buf, a[:, 0], a, av, W, span, bs, feat_cols=feat_cols, feat_dtype=fdt)
        _, logits = forward_logits(model, b)
        drafts = model.draft_vocab[logits.argmax(-1)]  # (B, span, K)
        for r, (si, ps) in enumerate(grp):
            n = len(ps)
            pos = torch.tensor(ps)
            end = seqs[si]["end"]
            tg = buf.tokens[torch.minimum(a[r, :n, None] + torch.arange(1, bs, device=dev), torch.tensor(end - 1, device=dev))]
            e = out.setdefault(si, [[], [], [], []])
            e[0].append(pos)
            e[1].append(drafts[r, :n].cpu())
            e[2].append(tg.cpu())
            e[3].append(torch.clamp(end - 1 - pos, max=K))
    res = {si: tuple(torch.cat(x) for x in e) for si, e in out.items()}
    return res, complete


def replay(drafts: dict, seqs: list[dict], k: int = 4) -> list[dict]:
    """Greedy speculative decoding replayed along each continuation: per verify step (drafted, accepted)."""
    rows = []
    for si, (pos, d, tg, avail) in drafts.items():
        m = seqs[si]
        n = len(pos)
        match = (d[:, :k] == tg[:, :k])
        steps = []
        i = 0
        while i < n:
            dk = int(min(k, int(avail[i])))
            if dk <= 0:
                break
            acc = int(match[i, :dk].long().cumprod(0).sum())
            steps.append((dk, acc))
            i += acc + 1
        all_pos = match[:, :k].long().cumprod(1)  # per position: accepted prefix, slot by slot
        ok = torch.arange(1, k + 1)[None] <= avail[:, None].clamp(max=k)
        rows.append({"style": m["style"], "key": m["key"], "steps": steps,
                     "slot_reached": [int((ok[:, j] & ((all_pos[:, j - 1] == 1) if j else torch.ones(n, dtype=torch.bool))).sum())
                                      for j in range(k)],
                     "slot_hit": [int((ok[:, j] & (all_pos[:, j] == 1)).sum()) for j in range(k)],
                     "positions": n})
    return rows


def summarize(rows: list[dict], k: int = 4) -> dict:
    steps = [s for r in rows for s in r["steps"]]
    if not steps:
        return {"sequences": len(rows), "verify_steps": 0}
    alpha = []
    for j in range(1, k + 1):
        reached = sum(1 for d, a in steps if d >= j and a >= j - 1)
        alpha.append(round(sum(1 for _, a in steps if a >= j) / reached, 4) if reached else None)
    acc = sum(a for _, a in steps)
    reached = [sum(r["slot_reached"][j] for r in rows) for j in range(k)]
    hit = [sum(r["slot_hit"][j] for r in rows) for j in range(k)]
    return {
        "sequences": len(rows), "verify_steps": len(steps), "drafted": sum(d for d, _ in steps), "accepted": acc,
        "alpha": round(acc / max(1, sum(d for d, _ in steps)), 4),
        "alpha_per_slot": alpha,
        "tokens_per_verify_step": round(1 + acc / len(steps), 4),
        "accepted_histogram": [sum(1 for _, a in steps if a == n) for n in range(k + 1)],
        "every_position": {"positions": sum(r["positions"] for r in rows),
                           "alpha_per_slot": [round(h / c, 4) if c else None for h, c in zip(hit, reached)],
                           "mean_accepted": round(sum(hit) / max(1, sum(r["positions"] for r in rows)), 4)},
    }


def evaluate(model: DFlashModel, buf, seqs: list[dict], layers_in_buffer: tuple, *, k: int = 4, span: int = 64,
             windows: int = 64, deadline: float | None = None) -> dict:
    """Per eval set and style (seqs[i]['key'] is '<set>|<style>|<source key>'): the replayed figures at k."""
    cols = torch.tensor([layers_in_buffer.index(x) for x in model.cfg.capture_layers], device=buf.device)
    H = buf.feats.shape[1] // len(layers_in_buffer)
    fcols = (cols[:, None] * H + torch.arange(H, device=buf.device)).flatten()
    if fcols.numel() == buf.feats.shape[1] and bool((fcols == torch.arange(fcols.numel(), device=buf.device)).all()):
        fcols = None
    t0 = time.monotonic()
    drafts, complete = draft_every_position(model, buf, seqs, fcols, span=span, windows=windows, deadline=deadline)
    rows = replay(drafts, seqs, k)
    out: dict = {"k": k, "complete": complete, "seconds": round(time.monotonic() - t0, 2),
                 "sequences_evaluated": len(rows), "sequences_planned": len(seqs)}
    groups: dict = {}
    for r in rows:
        set_name, style = r["key"].split("|")[:2]
        groups.setdefault(set_name, {}).setdefault(style, []).append(r)
    for set_name, by_style in groups.items():
        out[set_name] = {style: summarize(rs, k) for style, rs in sorted(by_style.items())}
        out[set_name]["all"] = summarize([r for rs in by_style.values() for r in rs], k)
    return out
