"""PagedCache: sink + window resident, every evicted position kept exactly in pages, and each
query recalls its own top pages.

Resident memory is sink_window's (same slots, same masks). A position leaving the window is
archived, not dropped: its exact K/V (post-RoPE, as attended) go to the page store (a RowTable
through `page_compressor`), and a compact copy of its key (`page_key_bits` int4 / int8 per row)
to the selection data. Pages are fixed position ranges, page j = [sink + j*P, sink + (j+1)*P).

At every layer of every step (prefill chunk, decode, speculative verify) `attend_with_pages`
scores, for each query p and KV head, every key out of p's window, [sink, p - window], by its
compact key (q . k, max over the query heads of the group), takes each page's best key as the
page score, and keeps the top `recall_pages` pages. The query then attends exactly to sink +
window + the chosen pages' keys at their true positions. Token-level scores are what make the
choice work on SmolLM2 (issue 15's probe: a page's min/max bound or mean key loses half the gap).

Selection is per query and by position, so it does not depend on how the history was appended
(INV-3): a key still resident but out of a query's window (a long prefill chunk) is scored through
the same compact code it gets when archived. With `recall_pages` >= the number of pages every
query attends to its whole history: paged == full.

Positions are never re-based: a session stops at the trained context, like `full`.
Byte counts: `resident_nbytes` (sink + window slab; flat), `selection_nbytes` (compact keys;
grows with the pages), `stored_nbytes` (page store). `nbytes` = resident + selection, what a
session holds for attention every step; the page store is a cheaper tier.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F

from inference_engine.errors import CacheInvariantError
from inference_engine.kv.layout import AttentionLayout, CacheGeometry, SinkShift
from inference_engine.kv.paged_store import RowTable, make_row_codec
from inference_engine.kv.sink_window import SinkWindowCache
from inference_engine.kv.strategy import KVStrategy


class PagedCache(SinkWindowCache):
    def __init__(self, strategy: KVStrategy, geometry: CacheGeometry, max_step: int, max_context: int):
        super().__init__(strategy, geometry, max_step, max_context)
        g = geometry
        self.page_size, self.recall_pages = strategy.page_size, strategy.recall_pages
        self.groups = None  # query heads per KV head, known at the first recall
        dims = dict(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, page=self.page_size,
                    device=g.device)
        self.pages = RowTable(make_row_codec(strategy.page_compressor, head_dim=g.head_dim, dtype=g.dtype,
                                             q_range=strategy.q_range, device=g.device), stack=2, **dims)
        self.keys = RowTable(make_row_codec(f"int{strategy.page_key_bits}", head_dim=g.head_dim, dtype=g.dtype),
                             stack=1, **dims)
        self.evicted_total = 0
        self.timings = {"score_s": 0.0, "fetch_s": 0.0, "attend_s": 0.0, "recalls": 0}  # cumulative, for the cost split
        self._step = None  # per-step host bookkeeping for recall (see prepare)

    # -- bytes ------------------------------------------------------------------------------
    @property
    def resident_nbytes(self) -> int:
        return self.store.nbytes

    @property
    def selection_nbytes(self) -> int:
        return self.keys.nbytes

    @property
    def stored_nbytes(self) -> int:
        return self.pages.nbytes

    @property
    def nbytes(self) -> int:
        return self.resident_nbytes + self.selection_nbytes

    @property
    def archived_end(self) -> int:
        """First position not (yet) in the page store: the store holds [sink, archived_end)."""
        return self.sink + self.pages.rows

    # -- step ---------------------------------------------------------------------------------
    def prepare(self, positions, ids: torch.Tensor | None = None) -> AttentionLayout:
        t = len(positions) if isinstance(positions, range) else positions.numel()
        if self.next_position + t - 1 >= self.max_context:  # checked before any slot is taken
            raise ValueError(
                f"position {self.next_position + t - 1} is past the model's context of {self.max_context}; paged attends "
                "at true positions (no re-basing), so sessions stop at the trained context like `full`")
        layout = super().prepare(positions, ids)
        self._step = self._plan_step(layout)
        return layout

    def _plan_step(self, layout: AttentionLayout):
        """Host bookkeeping shared by the step's layers: candidate positions [sink, cand_end) and
        which of them each query may recall (per model window), resident columns of candidates
        not yet archived."""
        first, t = layout.first_position, layout.positions.numel()
        cand_end = first + t - self.window  # exclusive: the last query's out-of-window keys end at p - window
        if self.recall_pages == 0 or cand_end <= self.sink:
            return None
        cpos = np.arange(self.sink, cand_end)
        qpos = np.arange(first, first + t)[:, None]
        dev = self.store.device
        allowed = {}
        for w in set(self.geometry.layer_windows):
            if w is not None and w <= self.window:
                continue  # a local layer sees nothing its cache window does not hold
            a = cpos[None, :] <= qpos - self.window
            if w is not None:
                a &= cpos[None, :] > qpos - w
            allowed[w] = torch.from_numpy(a).to(dev)
        cols = None
        if cand_end > self.archived_end:  # out-of-window keys still resident (a step longer than the window)
            key_pos = layout.key_positions.cpu().numpy()
            where = {int(p): i for i, p in enumerate(key_pos) if p >= 0}
            missing = [p for p in range(self.archived_end, cand_end) if p not in where]
            if missing:
                raise CacheInvariantError("inv1", f"positions {missing[:4]}... are neither archived nor resident")
            cols = torch.tensor([where[p] for p in range(self.archived_end, cand_end)], device=dev)
        return {"cand_end": cand_end, "allowed": allowed, "cols": cols}

    @torch.inference_mode()
    def attend_with_pages(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                          layout: AttentionLayout, scale: float) -> torch.Tensor | None:
        """Attention output (H, T, D) of this layer's queries q (H, T, D, post-RoPE) over sink +
        window (k_all, v_all (Hkv, N, D) with the layout's mask) + the keys of each query's chosen
        pages; None when nothing is out of any query's window (attend as sink_window does).

        Each KV head reads only the keys its own queries chose. A row-exact step (decode,
        speculative verify) attends row by row over exactly the columns a one-token step at that
        position would: its chosen keys in position order, then its visible resident columns.
        Arrays of another backend (MLX) are copied to CPU torch tensors and the output is torch; the
        backend takes it back (MlxCausalLM.finish), and the store's `read` returns torch rows."""
        w = self.geometry.layer_windows[layer]
        plan = self._step
        if plan is None or w not in plan["allowed"]:
            return None
        if not isinstance(q, torch.Tensor):  # another backend's arrays (MLX): recall runs on host torch tensors
            q, k_all, v_all = (torch.from_numpy(np.array(x)) for x in (q, k_all, v_all))
        t0 = time.perf_counter()
        allowed = plan["allowed"][w]
        idx, ok, c = self._choose_pages(layer, q, k_all, allowed, plan["cols"])  # (Hkv, T, M) page indices
        row_exact = getattr(layout, "row_exact", False)
        sel = None if row_exact else self._selection(idx, ok, allowed, c)  # (Hkv, T, C)
        t1 = time.perf_counter()
        hkv, t = idx.shape[0], idx.shape[1]
        h = q.shape[0]
        g = h // hkv
        jobs = []
        if row_exact:
            host = layout.host_masks[w]
            p = self.page_size
            offsets = torch.arange(p, device=idx.device)
            for j in range(t):
                pages, order = idx[:, j].sort(-1)  # (Hkv, M): this row's pages in position order
                rows = (pages[..., None] * p + offsets).flatten(1)  # (Hkv, M * P) candidate rows, ascending
                valid = ok[:, j].gather(-1, order).repeat_interleave(p, -1) & (rows < c)
                rows = rows.clamp(max=c - 1)
                valid &= allowed[j][rows]
                kr, vr = self._rows_kv(layer, rows, k_all, v_all, plan["cols"])
                cols = torch.from_numpy(np.flatnonzero(host[j])).to(k_all.device)
                mask = torch.cat([valid, valid.new_ones(hkv, cols.numel())], 1)  # (Hkv, E + n): per KV head
                jobs.append((q[:, j:j + 1], torch.cat([kr, k_all.index_select(1, cols)], 1),
                             torch.cat([vr, v_all.index_select(1, cols)], 1), mask))
        else:
            rows, valid = _rows_per_head(sel.any(1))  # per head: keys any of the step's queries chose
            kr, vr = self._rows_kv(layer, rows, k_all, v_all, plan["cols"])
            mask_r = sel.gather(2, rows[:, None].expand(-1, t, -1)) & valid[:, None]  # (Hkv, T, E)
            t2 = time.perf_counter()
            if _FLASH is not None:  # a step of many queries: two-part attention, resident part on the 2-D mask
                o = _attend_merged(q, k_all, v_all, layout.masks[w], kr, vr, mask_r, scale)
                self.timings["score_s"] += t1 - t0
                self.timings["fetch_s"] += t2 - t1
                self.timings["attend_s"] += time.perf_counter() - t2
                self.timings["recalls"] += 1
                return o
            mask = torch.cat([mask_r.repeat_interleave(g, 0), layout.masks[w][None].expand(h, -1, -1)], 2)  # (H, T, E + N)
            jobs.append((q, torch.cat([kr, k_all], 1), torch.cat([vr, v_all], 1), mask))
        t2 = time.perf_counter()
        o = [_attend_per_head(qq, kk, vv, mm, scale) if mm.dim() == 2 else
             F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mm, scale=scale, enable_gqa=True)[0]
             for qq, kk, vv, mm in jobs]
        self.timings["score_s"] += t1 - t0
        self.timings["fetch_s"] += t2 - t1
        self.timings["attend_s"] += time.perf_counter() - t2
        self.timings["recalls"] += 1
        return o[0] if len(o) == 1 else torch.cat(o, 1)

    def _choose(self, layer, q, k_all, allowed, cols) -> torch.Tensor:
        """(Hkv, T, C) bool: candidate c (position sink + c) is recalled by query t for KV head h."""
        idx, ok, c = self._choose_pages(layer, q, k_all, allowed, cols)
        return self._selection(idx, ok, allowed, c)

    def _selection(self, idx, ok, allowed, c) -> torch.Tensor:
        """(Hkv, T, C) bool from the chosen pages: keys of a chosen page the query may see."""
        n_pages = -(-c // self.page_size)
        chosen = torch.zeros(*idx.shape[:2], n_pages, dtype=torch.bool, device=idx.device).scatter_(-1, idx, ok)
        return chosen.repeat_interleave(self.page_size, -1)[..., :c] & allowed

    def _choose_pages(self, layer, q, k_all, allowed, cols):
        """Each query's top pages per KV head: idx (Hkv, T, M) page indices, ok (Hkv, T, M) (the page
        holds a key the query may see), and C, the number of candidate keys."""
        hkv, d, p = k_all.shape[0], k_all.shape[2], self.page_size
        g, t = q.shape[0] // hkv, q.shape[1]
        codec = self.keys.codec
        stored = self.keys.payload(layer)
        codes, sc = stored["codes"][0], stored["scale"][0]  # (Hkv, n_archived, ...)
        if cols is not None:  # candidates still resident: the same code they get when archived
            fresh = codec.encode(k_all.index_select(1, cols).reshape(-1, d))
            nf = cols.numel()
            codes = torch.cat([codes, fresh["codes"].reshape(hkv, nf, -1)], 1)
            sc = torch.cat([sc, fresh["scale"].reshape(hkv, nf, 1)], 1)
        c = codes.shape[1]
        scores = codec.group_max_scores(q.reshape(hkv, g, t, d).float(), codes, sc)  # (Hkv, T, C)
        scores.masked_fill_(~allowed, float("-inf"))
        whole = c // p
        page_scores = scores[..., : whole * p].unflatten(-1, (whole, p)).amax(-1)  # (Hkv, T, pages): a page's best key
        if whole * p < c:  # the last, partial page
            page_scores = torch.cat([page_scores, scores[..., whole * p:].amax(-1, keepdim=True)], -1)
        n_pages = page_scores.shape[-1]
        best, idx = page_scores.topk(min(self.recall_pages, n_pages), -1)
        return idx, best > float("-inf"), c

    def _rows_kv(self, layer, rows, k_all, v_all, cols):
        """Exact K/V (Hkv, E, D) of candidate rows[h] per KV head: archived ones decoded from the page
        store, still-resident ones from k_all/v_all through the same page codec."""
        n_st = self.pages.rows
        kv = self.pages.gather(layer, rows.clamp(max=max(n_st - 1, 0))).to(k_all.dtype) if n_st else None
        if cols is not None and (kv is None or bool((rows >= n_st).any())):
            c = cols[(rows - n_st).clamp(0, cols.numel() - 1)]  # (Hkv, E)
            heads = torch.arange(k_all.shape[0], device=rows.device)[:, None]
            fresh = torch.stack([k_all[heads, c], v_all[heads, c]])  # (2, Hkv, E, D)
            codec = self.pages.codec
            fresh = codec.decode(codec.encode(fresh.reshape(-1, fresh.shape[-1]))).reshape(fresh.shape).to(k_all.dtype)
            kv = fresh if kv is None else torch.where((rows >= n_st)[None, :, :, None], fresh, kv)
        return kv[0], kv[1]

    def _on_commit(self, layout, n_keep: int) -> None:
        self._step = None

    def _on_abort(self) -> None:
        self._step = None

    # -- eviction = archiving ------------------------------------------------------------------
    def _evict_dead(self) -> int:
        upto = self.next_position - self.window  # leaves the window: archive [archived_end, upto]
        start = self.archived_end
        if upto >= start:
            pos = self.store.pos
            n = upto - start + 1
            live = np.flatnonzero((pos >= start) & (pos <= upto))
            if live.size != n:
                raise CacheInvariantError("inv1", f"archiving positions {start}..{upto}: {live.size} of {n} are resident")
            slots = self.store.slots_tensor(live[np.argsort(pos[live])])
            self.pages.reserve(self.pages.rows + n)
            self.keys.reserve(self.keys.rows + n)
            for layer in range(self.geometry.num_layers):
                k, v = self.store.read(layer, slots)
                self.pages.write(layer, self.pages.rows, torch.stack([k, v]))
                self.keys.write(layer, self.keys.rows, k[None])
            self.pages.rows += n
            self.keys.rows += n
        return super()._evict_dead()

    def _dropped(self, evicted: int) -> int:
        self.evicted_total += evicted
        return 0  # archived, still attendable

    def _sink_shift(self) -> SinkShift | None:
        return None

    # -- persistence ------------------------------------------------------------------------------
    # Archive rows a saver already holds (persistence/session_files.py sets it around `state()`): the
    # state then carries rows archive_rows_saved .. archived_rows - 1 of the tables only, so a turn's save
    # copies what the turn archived, not the whole archive. 0 (the default): a complete state.
    archive_rows_saved = 0

    def _extra_state(self) -> tuple[dict, dict]:
        start = min(self.archive_rows_saved, self.pages.rows)
        tensors = {f"pages.{k}": v for k, v in self.pages.state(start).items()}
        tensors |= {f"keys.{k}": v for k, v in self.keys.state(start).items()}
        return tensors, {"evicted_total": self.evicted_total, "archived_rows": self.pages.rows}

    def _load_extra_state(self, tensors: dict, meta: dict) -> None:
        rows = int(meta["archived_rows"])
        self.pages.load_state({k.removeprefix("pages."): v for k, v in tensors.items() if k.startswith("pages.")}, rows)
        self.keys.load_state({k.removeprefix("keys."): v for k, v in tensors.items() if k.startswith("keys.")}, rows)
        self.evicted_total = int(meta["evicted_total"])


def _rows_per_head(need: torch.Tensor):
    """need (Hkv, C) bool -> rows (Hkv, E) ascending chosen indices per head (padded with 0) and
    valid (Hkv, E), E = the most any head chose."""
    counts = need.sum(1)
    e = int(counts.max()) if need.numel() else 0
    order = torch.sort((~need).to(torch.int8), dim=1, stable=True).indices[:, :e]  # chosen first, in order
    valid = torch.arange(e, device=need.device)[None] < counts[:, None]
    return torch.where(valid, order, 0), valid


# torch's CPU flash kernel, which also returns each row's log-sum-exp: two attention parts can
# then be merged exactly. Private API; without it, steps attend through one call with a per-head
# mask (correct, several times slower for long prefill chunks).
_FLASH = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None)


def _flash(q, k, v, mask, scale):
    """q (1, H, T, D), k/v (1, H, N, D), mask (T, N) bool -> out (1, H, T, D), lse (1, H, T); rows with
    no visible key get lse = -inf (the kernel reports 0)."""
    ninf = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = _FLASH(q, k, v, 0.0, False, attn_mask=ninf, scale=scale)
    return out, lse.masked_fill(~mask.any(-1), float("-inf"))


def _attend_per_head(q, k, v, mask, scale):
    """q (H, T, D) over k, v (Hkv, N, D) with a mask per KV head, (Hkv, N) shared by its queries: one
    call per KV head, each on a 1-row mask (the fast kernel; a per-head 3-D mask takes the slow path)."""
    hkv = k.shape[0]
    g = q.shape[0] // hkv
    return torch.cat([F.scaled_dot_product_attention(q[j * g:(j + 1) * g][None], k[j:j + 1][None], v[j:j + 1][None],
                                                     attn_mask=mask[j][None], scale=scale, enable_gqa=True)[0]
                      for j in range(hkv)])


def _attend_merged(q, k_all, v_all, mask_w, kr, vr, mask_r, scale):
    """softmax attention of q (H, T, D) over [resident keys (mask_w (T, N), shared by every head) +
    recalled keys kr, vr (Hkv, E, D) (mask_r (Hkv, T, E), per KV head)], as the log-sum-exp merge of
    one resident call and one recalled call per KV head; each call has a 2-D mask."""
    h, t, d = q.shape
    hkv = k_all.shape[0]
    g = h // hkv
    ow, lw = _flash(q[None], k_all.repeat_interleave(g, 0)[None], v_all.repeat_interleave(g, 0)[None], mask_w, scale)
    outs, lses = [], []
    for j in range(hkv):
        kj = kr[j:j + 1].expand(g, -1, -1)[None]
        vj = vr[j:j + 1].expand(g, -1, -1)[None]
        o, lse = _flash(q[j * g:(j + 1) * g][None], kj.contiguous(), vj.contiguous(), mask_r[j], scale)
        outs.append(o)
        lses.append(lse)
    orr, lr = torch.cat(outs, 1), torch.cat(lses, 1)  # (1, H, T, D), (1, H, T)
    lse = torch.logaddexp(lw, lr)
    wr = torch.exp(lr - lse).nan_to_num(0.0)  # no recalled key: weight 0
    return (ow * (1 - wr)[..., None] + orr * wr[..., None])[0]
