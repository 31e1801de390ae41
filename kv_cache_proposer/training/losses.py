"""The ADR 0001 §4 loss on masked block slots: hidden-state alignment (smooth-L1 between the drafter's
projected hidden and the verifier's hidden) + temperature-scaled KD on the verifier's top-k logits
+ mask-recovery cross-entropy, all over the drafter's draft vocabulary."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class LossWeights:
    hidden: float = 1.0
    kd: float = 0.5
    ce: float = 0.1
    kd_temperature: float = 2.0


def drafter_loss(pred_hidden, logits, t_hidden, t_topk_col, t_topk_val, target_col, w: LossWeights):
    """pred_hidden/t_hidden (M, Hv); logits (M, N) over the draft vocab; t_topk_col (M, K) teacher top-k
    as draft-vocab columns (-1 = outside it); t_topk_val (M, K) teacher logits; target_col (M,) (-1 = ignore).
    Returns (total, parts dict of floats)."""
    l_hid = F.smooth_l1_loss(pred_hidden.float(), t_hidden.float())
    T = w.kd_temperature
    inside = t_topk_col >= 0
    tv = t_topk_val.float().masked_fill(~inside, float("-inf")) / T
    p_t = torch.softmax(tv, dim=-1).nan_to_num(0.0)  # renormalised over the top-k inside the draft vocab
    logq = torch.log_softmax(logits.float() / T, dim=-1).gather(1, t_topk_col.clamp(min=0))
    kl_rows = (p_t * (torch.log(p_t.clamp_min(1e-12)) - logq)).masked_fill(~inside, 0.0).sum(-1)
    l_kd = kl_rows.mean() * T * T
    valid = target_col >= 0
    l_ce = F.cross_entropy(logits.float()[valid], target_col[valid]) if bool(valid.any()) else logits.sum() * 0
    total = w.hidden * l_hid + w.kd * l_kd + w.ce * l_ce
    with torch.no_grad():
        acc = (logits.argmax(-1) == t_topk_col[:, 0]).float().mean() if logits.numel() else torch.zeros(())
    return total, {"loss": float(total.detach()), "hidden": float(l_hid.detach()), "kd": float(l_kd.detach()), "ce": float(l_ce.detach()),
                   "top1": float(acc)}
