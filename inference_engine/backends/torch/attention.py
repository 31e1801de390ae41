"""Attention of one layer over what a resident cache returned for a step's layout (torch)."""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from inference_engine.kv.stores import Int8Rows


def attend_layout(model, layer: int, q, q_normed, k_all, v_all, layout, extra=None, sink_rope=None) -> torch.Tensor:
    """q (H, T, D) over k_all, v_all (Hkv, N, D) with the layout's mask for this layer's window.

    extra: this layer's ExtraKeys (kv/layout.py) of the layout's extra keys, prepended to the
    cache's keys; a step with extra keys attends batched, never row by row. sink_rope: RoPE at
    the virtual query position used for sink keys past the trained context (SinkWindowCache)."""
    s = model.spec
    w = s.layer_windows[layer]
    mask = layout.masks[w]
    if layout.row_exact and extra is None:
        return _attend_rows(model, layer, q, q_normed, k_all, v_all, layout, w, sink_rope)
    if extra is not None:
        k_all, v_all, mask = _with_extra_keys(s, extra, k_all, v_all, mask)
    if sink_rope is not None and w is None:
        return _attend_with_sink_shift(model, layer, q, q_normed, k_all, v_all, mask, layout.positions, layout.key_positions,
                                       layout.sink_shift, sink_rope)
    return _attend(q, k_all, v_all, mask, s.attn_scale)


def _attend(q, k, v, mask, scale):
    if isinstance(k, Int8Rows):
        return _attend_int8(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)[0]


def _attend_int8(q, k: Int8Rows, v: Int8Rows, mask, scale):
    """q (H, T, D) over int8 rows without decoding them: per KV head, scores = q @ K^T through
    torch's int8 weight kernel (per-position scales), then the probabilities, scaled by V's
    per-position scales, @ V through the same kernel over V^T. bf16 activations: the kernel's
    fast path (fp32 and fp16 activations measured 10-70x slower here)."""
    h, t, d = q.shape
    hkv = k.codes.shape[0]
    g = h // hkv
    ones = _unit_scales(d, q.device)
    out = []
    for j in range(hkv):
        qj = q[j * g:(j + 1) * g].reshape(g * t, d).to(torch.bfloat16)
        scores = torch._weight_int8pack_mm(qj, k.codes[j], k.scales[j]).float().view(g, t, -1) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, -1) * v.scales[j].float()
        o = torch._weight_int8pack_mm(p.view(g * t, -1).to(torch.bfloat16), v.codes[j], ones)
        out.append(o.float().view(g, t, d))
    return torch.cat(out)


@functools.lru_cache(maxsize=8)
def _unit_scales(d: int, device) -> torch.Tensor:
    """The V pass's per-output scales (all 1: V's scales go into the probabilities); made once."""
    return torch.ones(d, dtype=torch.bfloat16, device=device)


def _columns(x, keys):
    """The key columns a row reads: the prefix 0..keys-1 (int) or an index."""
    if isinstance(x, Int8Rows):
        if isinstance(keys, int):
            if keys != x.width:
                raise ValueError(f"an int8 store is read whole ({x.width} columns), not a {keys}-column prefix")
            return x
        return x.select(keys)
    return x[:, :keys] if isinstance(keys, int) else x.index_select(1, keys)


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
        k, v = _columns(k_all, keys), _columns(v_all, keys)
        cols = slice(None, keys) if isinstance(keys, int) else keys
        m, kp = mask[j:j + 1, cols], layout.key_positions[cols]
        qj = q[:, j:j + 1]  # (H, 1, D)
        if shift:
            out.append(_attend_with_sink_shift(model, layer, qj, q_normed[:, j:j + 1], k, v, m, layout.positions[j:j + 1], kp,
                                               layout.sink_shift, sink_rope.select(slice(j, j + 1))))
        else:
            out.append(_attend(qj, k, v, m, s.attn_scale))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def attend_layout_row(qj, k_all, v_all, layout, w, j: int, scale):
    """Row j of a row-exact step, qj (H, 1, D), attending as a one-token step at its position does (_attend_rows,
    no sink shift): paged's rows that see nothing out of their window (kv/paged.py), so a verify block's row there
    equals the one-token step bit for bit."""
    keys = layout.row_keys(w)[j]
    cols = slice(None, keys) if isinstance(keys, int) else keys
    return _attend(qj, _columns(k_all, keys), _columns(v_all, keys), layout.masks[w][j:j + 1, cols], scale)


def _with_extra_keys(s, extra, k_all, v_all, mask):
    """Prepend a layer's extra keys (ExtraKeys: positioned k, v (Hkv, E, D), mask (T, E), logit_bias) to the cache's."""
    e = extra.mask.shape[1]
    if not e:  # none of them visible in this layer (e.g. a local layer's window lies inside the resident keys)
        return k_all, v_all, mask
    mask = torch.cat([extra.mask, mask], 1)
    if extra.logit_bias is not None:  # a per-head logit offset on the extra columns
        ninf = torch.tensor(float("-inf"), dtype=k_all.dtype, device=k_all.device)
        col = torch.zeros(s.num_heads, 1, mask.shape[1], dtype=k_all.dtype, device=k_all.device)
        col[:, :, :e] = extra.logit_bias.to(k_all.dtype)[:, None, None]
        mask = torch.where(mask, col, ninf)  # (H, T, N) float mask
    return torch.cat([extra.k.to(k_all.dtype), k_all], 1), torch.cat([extra.v.to(v_all.dtype), v_all], 1), mask


def _attend_with_sink_shift(model, layer, q, q_normed, k_all, v_all, mask, positions, key_positions, shift, sink_rope):
    s = model.spec
    groups = s.num_heads // s.num_kv_heads
    if isinstance(k_all, Int8Rows):  # past the trained context only: decode the rows for the two-score path
        k_all, v_all = k_all.dequantize(), v_all.dequantize()
    kx = k_all.repeat_interleave(groups, 0)
    vx = v_all.repeat_interleave(groups, 0)
    scores = (q @ kx.transpose(1, 2)) * s.attn_scale  # (H, T, N)
    q_virt = model.rotate(q_normed, *sink_rope.for_layer(s, layer))
    sink_scores = (q_virt @ kx.transpose(1, 2)) * s.attn_scale
    kp = key_positions[None, :]
    shifted = (positions[:, None] >= shift.from_position) & (kp >= 0) & (kp < shift.sink)
    if mask.shape[1] != kp.shape[1]:  # extra key columns come first and are never sink keys
        pad = torch.zeros(mask.shape[0], mask.shape[1] - kp.shape[1], dtype=torch.bool, device=mask.device)
        shifted = torch.cat([pad, shifted], 1)
    scores = torch.where(shifted, sink_scores, scores).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), -1).to(v_all.dtype) @ vx


# -- attention in parts, merged by log-sum-exp (paged recall: kv/paged.py) ----------------------
# torch's CPU flash kernel also returns each row's log-sum-exp, so two attention parts (recalled
# rows, resident slab) merge exactly without concatenating them. It is CPU-only (and private API);
# on other devices, or without it, `attention_lse` computes the same in fp32 (tests compare the two).
_FLASH_CPU = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None)


def attention_lse(q, k, v, bias, scale):
    """q (1, H, T, D), k/v (1, H or 1, N, D), bias None or additive (0 / -inf) broadcastable to (1, H, T, N)
    -> out (1, H, T, D), lse (1, H, T). A row that sees no key has out 0 and an lse the caller masks."""
    if q.device.type == "cpu" and _FLASH_CPU is not None:
        return _FLASH_CPU(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.float()
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.matmul(p, v.float()).to(q.dtype), lse


def attend_masked_lse(q, k, v, mask, scale):
    """attention_lse under a (T, N) bool mask; rows with no visible key get lse = -inf."""
    ninf = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = attention_lse(q, k, v, ninf, scale)
    return out, lse.masked_fill(~mask.any(-1), float("-inf"))


def attend_row_two_part(qj, kr, vr, bias_r, k_all, v_all, bias_w, scale):
    """One query row, qj (1, Hkv, G, D) (a KV head's query heads as its rows): attention over its
    recalled rows kr, vr (Hkv, E, D) (bias_r: None or (1, Hkv or 1, 1, E)) and over the resident slab
    k_all, v_all (Hkv, N, D) under bias_w (N,), merged by log-sum-exp; kr None: the slab alone (the
    row always sees its own key, so the resident part is never empty, and a row with recalled rows
    sees at least one of them)."""
    ow, lw = attention_lse(qj, k_all[None], v_all[None], bias_w[None], scale)
    if kr is None:
        return ow
    orr, lr = attention_lse(qj, kr[None], vr[None], bias_r, scale)
    lse = torch.logaddexp(lw, lr)
    return ow * (lw - lse).exp_()[..., None] + orr * (lr - lse).exp_()[..., None]


def attend_merged(q, k_all, v_all, mask_w, kr, vr, mask_r, scale):
    """softmax attention of q (H, T, D) over [resident keys (mask_w (T, N), shared by every head) +
    recalled keys kr, vr (Hkv, E, D) (mask_r (Hkv, T, E), per KV head)], as the log-sum-exp merge of
    one resident call and one recalled call per KV head; each call has a 2-D mask."""
    h, t, d = q.shape
    hkv = k_all.shape[0]
    g = h // hkv
    ow, lw = attend_masked_lse(q[None], k_all.repeat_interleave(g, 0)[None], v_all.repeat_interleave(g, 0)[None], mask_w, scale)
    outs, lses = [], []
    for j in range(hkv):
        kj = kr[j:j + 1].expand(g, -1, -1)[None]
        vj = vr[j:j + 1].expand(g, -1, -1)[None]
        o, lse = attend_masked_lse(q[j * g:(j + 1) * g][None], kj.contiguous(), vj.contiguous(), mask_r[j], scale)
        outs.append(o)
        lses.append(lse)
    orr, lr = torch.cat(outs, 1), torch.cat(lses, 1)  # (1, H, T, D), (1, H, T)
    lse = torch.logaddexp(lw, lr)
    wr = torch.exp(lr - lse).nan_to_num(0.0)  # no recalled key: weight 0
    return (ow * (1 - wr)[..., None] + orr * wr[..., None])[0]


def attend_decode_batch(model, layer: int, q, kvs, layouts, scratch: dict) -> torch.Tensor:
    """Several sessions' one-token decode rows in one attention call: q (H, B, D), kvs[b] = session
    b's (k_all, v_all) (Hkv, N_b, D) as its cache returned them, layouts[b] its step layout (mask
    (1, N_b)). Slabs of unequal width are padded to the widest, the padding masked. The (B, 1, 1, N)
    mask is built once a step per window from the host masks (`scratch`: per-forward memo)."""
    s = model.spec
    w = s.layer_windows[layer]
    widths = [k.shape[1] for k, _ in kvs]
    n = max(widths)
    key = ("decode_batch_bias", w)
    if key not in scratch:
        visible = np.zeros((len(kvs), n), dtype=bool)
        for b, lay in enumerate(layouts):
            visible[b, : widths[b]] = lay.host_masks[w][0]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)
        scratch[key] = torch.from_numpy(bias).to(device=q.device, dtype=q.dtype).view(len(kvs), 1, 1, n)
    if min(widths) == n:
        k, v = torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])
    else:
        k = torch.stack([F.pad(k, (0, 0, 0, n - k.shape[1])) for k, _ in kvs])
        v = torch.stack([F.pad(v, (0, 0, 0, n - v.shape[1])) for _, v in kvs])
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[:, :, None], k, v, attn_mask=scratch[key], scale=s.attn_scale,
                                       enable_gqa=True)  # (B, H, 1, D)
    return o[:, :, 0].transpose(0, 1)


def attend_moved_row(qj, moved, k_all, v_all, bias_w, scale):
    """One query row whose recalled keys and sink sit at moved positions (past the trained context), qj (1, Hkv, G, D):
    `moved` = [(q (Hkv, n, G, D), k (Hkv, n * E, D), v, bias None or broadcastable to (Hkv, G, n * E)), ...], each
    part's keys in n groups of E, group i scored against q[:, i] (the row's query counter-rotated for that group's
    move: q . R(d) k = R(-d) q . k, so G query vectors turn instead of E keys); then the window, qj over k_all, v_all
    (Hkv, N, D) under bias_w (N,) at true positions. The moved parts' scores in float32 share one softmax; merged
    with the window's by log-sum-exp. Returns (1, Hkv, G, D)."""
    hkv, g, d = qj.shape[1:]
    scores, values = [], []
    for q, k, v, bias in moved:
        n = q.shape[1]
        sc = torch.matmul(q.float(), k.float().view(hkv, n, -1, d).transpose(-1, -2))  # (Hkv, n, G, E)
        sc = sc.transpose(1, 2).reshape(hkv, g, -1) * scale
        scores.append(sc if bias is None else sc + bias)
        values.append(v.float())
    ow, lw = attention_lse(qj, k_all[None], v_all[None], bias_w[None, None, None], scale)  # (1, Hkv, G, D), (1, Hkv, G)
    if not scores:
        return ow
    s = torch.cat(scores, -1)
    lr = torch.logsumexp(s, -1)  # (Hkv, G); -inf when the row sees none of the moved keys
    pr = torch.exp(s - torch.where(torch.isfinite(lr), lr, 0.0)[..., None])
    orr = torch.matmul(pr, torch.cat(values, 1))  # (Hkv, G, D)
    lse = torch.logaddexp(lw[0], lr)
    wr = torch.exp(lr - lse)[..., None]
    return (ow[0].float() * (1 - wr) + orr * wr).to(qj.dtype)[None]


def page_tiles(pair_page, n_pages: int, size: int = 16):
    """Pairs (a query row with one page it reads) grouped by page, `size` pairs to a tile: pair_page (N,) the page
    of each pair -> slot (N,), each pair's row in a (tiles * size) grid, and tile_page (tiles,), each tile's page.
    A page read by c pairs gets ceil(c / size) tiles, so a tile is one small matmul against one page's rows and no
    pair copies the page it reads (a prefill chunk's rows share most of their pages). Made once, used by
    `page_pair_scores` and `page_pair_mix`."""
    n, dev = pair_page.numel(), pair_page.device
    order = torch.argsort(pair_page, stable=True)
    counts = torch.bincount(pair_page, minlength=n_pages)
    tiles = (counts + size - 1) // size
    first_tile, first_pair = torch.cumsum(tiles, 0) - tiles, torch.cumsum(counts, 0) - counts
    by_page = pair_page[order]
    rank = torch.arange(n, device=dev) - first_pair[by_page]  # a pair's place among its page's pairs
    slot = torch.empty_like(order).index_copy_(0, order, (first_tile[by_page] + rank // size) * size + rank % size)
    return slot, torch.repeat_interleave(torch.arange(n_pages, device=dev), tiles)


def page_pair_scores(q, slot, tile_page, k_pages, size: int = 16):
    """q (N, G, D) each pair's query vectors, k_pages (pages, P, D) -> (N, G, P): q . k over the P rows of the pair's
    page (`page_tiles` with the same size gives slot and tile_page); empty grid rows compute zeros, never read."""
    n, g, d = q.shape
    nt = tile_page.numel()
    grid = q.new_zeros(nt * size, g, d).index_copy_(0, slot, q)
    s = torch.bmm(grid.view(nt, size * g, d), k_pages.index_select(0, tile_page).transpose(1, 2))
    return s.view(nt * size, g, -1).index_select(0, slot)


def page_pair_mix(w, slot, tile_page, v_pages, size: int = 16):
    """w (N, G, P) each pair's weights over its page's rows, v_pages (pages, P, D) -> (N, G, D): w @ v per pair."""
    n, g, p = w.shape
    nt = tile_page.numel()
    grid = w.new_zeros(nt * size, g, p).index_copy_(0, slot, w)
    o = torch.bmm(grid.view(nt, size * g, p), v_pages.index_select(0, tile_page))
    return o.view(nt * size, g, -1).index_select(0, slot)


def rotate_keys(model, layer: int | None, k, deltas):
    """RoPE rotation of positioned keys k (Hkv, E, D) by deltas (Hkv, E) positions: a key at p moves to p + delta
    (rotations compose). The paged strategy's recall past the trained context. layer None: k (L, Hkv, E, D), every
    layer by its own rope kind, the tables made once for all of them (what paged archives each step)."""
    # few distinct moves (a recalled page's rows all move alike): the tables for those only, then gathered
    moves, at = torch.unique(deltas.reshape(-1), return_inverse=True)
    rope = model.rope(moves).select(at)  # (1, Hkv * E, D) per kind: unique sorts, so even distinct moves are gathered
    if layer is not None:
        hkv, e, d = k.shape
        return model.rotate(k.reshape(1, hkv * e, d), *rope.for_layer(model.spec, layer)).view(hkv, e, d)
    n, hkv, e, d = k.shape
    kinds = [model.spec.layer_rope[i] for i in range(n)]
    if len(set(kinds)) == 1:
        return model.rotate(k.reshape(n, hkv * e, d), *rope.tables[kinds[0]]).view(n, hkv, e, d)
    return torch.stack([model.rotate(k[i].reshape(1, hkv * e, d), *rope.tables[kinds[i]]).view(hkv, e, d) for i in range(n)])


def attend_rows(q, ak, av, slot, bias, keys: int, scale: float):
    """Each row alone over columns 0..keys-1 of its session's arena slot, in plain ops (inductor fuses them
    where it cannot see into scaled_dot_product_attention's math path): q (H, B, D); ak, av (slots, Hkv,
    rows, D); slot (B,); bias (B, 1, 1, keys) additive. Returns o (H, B, D). Query head h reads kv head
    h // (H / Hkv), as enable_gqa does."""
    h, b, d = q.shape
    kk, vv = ak[slot, :, :keys], av[slot, :, :keys]  # (B, Hkv, keys, D)
    g = h // kk.shape[1]
    qg = q.transpose(0, 1).reshape(b, kk.shape[1], g, d)  # (B, Hkv, G, D)
    p = torch.softmax(torch.matmul(qg, kk.transpose(-1, -2)) * scale + bias, dim=-1)  # (B, Hkv, G, keys)
    return torch.matmul(p, vv).reshape(b, h, d).transpose(0, 1)
