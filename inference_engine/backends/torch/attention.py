"""Attention of one layer over what a resident cache returned for a step's layout (torch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_layout(model, layer: int, q, q_normed, k_all, v_all, layout, restored=None, sink_rope=None) -> torch.Tensor:
    """q (H, T, D) over k_all, v_all (Hkv, N, D) with the layout's mask for this layer's window.

    restored: (raw k, raw v, rope at their positions, logit_bias or None) of a dlm_restore
    step, prepended as extra keys visible through the plan's masks. sink_rope: RoPE at the
    virtual query position used for sink keys past the trained context (SinkWindowCache)."""
    s = model.spec
    w = s.layer_windows[layer]
    mask = layout.masks[w]
    if layout.row_exact and restored is None:
        return _attend_rows(model, layer, q, q_normed, k_all, v_all, layout, w, sink_rope)
    if restored is not None:
        k_all, v_all, mask = _with_restored(model, layer, layout, restored, k_all, v_all, mask)
    if sink_rope is not None and w is None:
        return _attend_with_sink_shift(model, layer, q, q_normed, k_all, v_all, mask, layout.positions, layout.key_positions,
                                       layout.sink_shift, sink_rope)
    return F.scaled_dot_product_attention(q[None], k_all[None], v_all[None], attn_mask=mask, scale=s.attn_scale,
                                          enable_gqa=True)[0]


def _attend_rows(model, layer, q, q_normed, k_all, v_all, layout, w, sink_rope):
    """A row-exact step: row j attends alone, through the same call a one-token step at its
    position makes, over the same key columns (layout.row_keys). A batched call's reduction
    order depends on the block's shape, and bf16 activations turn those last-bit differences
    into different tokens; row by row, a verified block equals sequential decode bit for bit."""
    s = model.spec
    mask, out = layout.masks[w], []
    for j, keys in enumerate(layout.row_keys(w)):
        # as the one-token step at this row's position: shifted sink scores only from shift.from_position on
        shift = sink_rope is not None and w is None and layout.first_position + j >= layout.sink_shift.from_position
        if isinstance(keys, int):
            k, v, m, kp = k_all[:, :keys], v_all[:, :keys], mask[j:j + 1, :keys], layout.key_positions[:keys]
        else:
            k, v, m, kp = k_all.index_select(1, keys), v_all.index_select(1, keys), mask[j:j + 1, keys], layout.key_positions[keys]
        qj = q[:, j:j + 1]  # (H, 1, D)
        if shift:
            out.append(_attend_with_sink_shift(model, layer, qj, q_normed[:, j:j + 1], k, v, m, layout.positions[j:j + 1], kp,
                                               layout.sink_shift, sink_rope.select(slice(j, j + 1))))
        else:
            out.append(F.scaled_dot_product_attention(qj[None], k[None], v[None], attn_mask=m, scale=s.attn_scale,
                                                      enable_gqa=True)[0])
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def _with_restored(model, layer, layout, restored, k_all, v_all, mask):
    """Prepend the restored K/V of `layer` (those any query of the step may see) to the resident keys."""
    s = model.spec
    k_r, v_r, rope, bias = restored  # k_r, v_r (Hkv, E, D) raw
    r_mask = layout.restore.masks[s.layer_windows[layer]]
    visible = r_mask.any(0)
    if not bool(visible.any()):  # a local layer whose window lies inside the resident keys
        return k_all, v_all, mask
    if not bool(visible.all()):
        idx = visible.nonzero().flatten()
        k_r, v_r, r_mask, rope = k_r[:, idx], v_r[:, idx], r_mask[:, idx], rope.select(idx)
    k_r = model.position_k(layer, k_r, rope)
    mask = torch.cat([r_mask, mask], 1)
    if bias is not None:  # attention-mass calibration: a per-head logit offset on the restored columns
        ninf = torch.tensor(float("-inf"), dtype=k_all.dtype, device=k_all.device)
        col = torch.zeros(s.num_heads, 1, mask.shape[1], dtype=k_all.dtype, device=k_all.device)
        col[:, :, : r_mask.shape[1]] = bias[layer].to(k_all.dtype)[:, None, None]
        mask = torch.where(mask, col, ninf)  # (H, T, N) float mask
    return torch.cat([k_r.to(k_all.dtype), k_all], 1), torch.cat([v_r.to(v_all.dtype), v_all], 1), mask


def _attend_with_sink_shift(model, layer, q, q_normed, k_all, v_all, mask, positions, key_positions, shift, sink_rope):
    s = model.spec
    groups = s.num_heads // s.num_kv_heads
    kx = k_all.repeat_interleave(groups, 0)
    vx = v_all.repeat_interleave(groups, 0)
    scores = (q @ kx.transpose(1, 2)) * s.attn_scale  # (H, T, N)
    q_virt = model.rotate(q_normed, *sink_rope.for_layer(s, layer))
    sink_scores = (q_virt @ kx.transpose(1, 2)) * s.attn_scale
    kp = key_positions[None, :]
    shifted = (positions[:, None] >= shift.from_position) & (kp >= 0) & (kp < shift.sink)
    if mask.shape[1] != kp.shape[1]:  # restored columns come first and are never sink keys
        pad = torch.zeros(mask.shape[0], mask.shape[1] - kp.shape[1], dtype=torch.bool, device=mask.device)
        shifted = torch.cat([pad, shifted], 1)
    scores = torch.where(shifted, sink_scores, scores).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), -1).to(v_all.dtype) @ vx
