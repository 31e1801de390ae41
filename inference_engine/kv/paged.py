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

Past the trained context (`max_context`) there is no limit (InfLLM's layout, arXiv 2402.04617): a
query at p >= far_from (the trained context unless the strategy's `far_from` is smaller) attends to its
window at true positions, to its chosen pages as if they sat in position order right before the window,
and to the sink right before those, so no distance it sees exceeds sink + window + recall_pages *
page_size (checked against the trained context); with `far_layout` "spread" the pages keep their order and
the gaps between them scaled down to fit far_from positions (`_far_slots`). Keys stay
post-RoPE at their true positions in every tier; the recalled ones are rotated on recall (RoPE
composes: rotating a key at p_k by d puts it at p_k + d), by the backend's `rotate_keys`. Below
far_from nothing changes: every query attends at true positions. Page choice, too, scores at
true positions below it; past it (`far_keys`), it scores every out-of-window key as if it sat at one
in-range distance from the query (InfLLM gives its memory units one position as well): a second compact
copy of each archived key rotated back to position 0 (kept from a session's first step, archived and saved with
the page store, made from it for a state saved without them), scored against the query rotated to `far_distance`.
Where the backend has a fused recall (the native CPU step: `paged_row_attention`, backends/torch/csrc/paged_rows.h),
every row of a step (decode, verify, prefill chunk) takes it instead of the Python path below, each row as the
one-token step at its position: the same page choice, read from the same tables (`_native_view` hands them over as
views), and the same attention to float rounding; a decode step is then one whole-step call (`layout.recall`). The
Python path stays the reference and serves every other case (coded page stores, MLX, CUDA).
Byte counts: `resident_nbytes` (sink + window slab; flat), `selection_nbytes` (compact keys;
grows with the pages), `stored_nbytes` (page store). `nbytes` = resident + selection, what a
session holds for attention every step; the page store is a cheaper tier.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from inference_engine.backends.torch.attention import (attend_layout_row, attend_merged, attend_moved_row, attend_row_two_part,
                                                       attention_lse, page_pair_mix, page_pair_scores, page_tiles)
from inference_engine.errors import CacheInvariantError
from inference_engine.kv.layout import AttentionLayout, CacheGeometry, SinkShift
from inference_engine.kv.paged_store import IdentityRows, RowQuant, RowTable, SpillingRowTable, make_row_codec, ram_rows_for
from inference_engine.kv.sink_window import SinkWindowCache
from inference_engine.kv.slot_cache import AppendOnly, CacheDelta, SaveMark
from inference_engine.kv.stores import HalfSlabStore, SlabStore
from inference_engine.kv.strategy import KVStrategy

# The backend's RoPE rotation of positioned keys: (layer, k (Hkv, E, D), deltas (Hkv, E)) -> rotated k; layer None:
# k (L, Hkv, E, D), every layer at once.
RotateKeys = Callable[[int | None, torch.Tensor, torch.Tensor], torch.Tensor]
# A step's host bookkeeping (_plan_step), shared by its layers: named entries, and per-window ones
# made once a step (a (name, window) key).
Plan = dict[str | tuple[str, int | None], Any]


class PagedCache(SinkWindowCache):
    ARCHIVE_ROWS = 64  # rows archived in one slice (a prefill chunk's in several): its transient copies and codes
    FAR_CATCH_UP_ROWS = 128  # far_keys rows made in one slice when they catch up with the page store

    def __init__(self, strategy: KVStrategy, geometry: CacheGeometry, max_step: int, max_context: int):
        super().__init__(strategy, geometry, max_step, max_context)
        g = geometry
        self.page_size, self.recall_pages = strategy.page_size, strategy.recall_pages
        self.groups = None  # query heads per KV head, known at the first recall
        dims: dict[str, Any] = dict(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                                    page=self.page_size, device=g.device)
        # the page store keeps the rows as the resident store held them: fp16 ones (kv_dtype fp16) exactly in fp16
        self.page_dtype = torch.float16 if strategy.kv_dtype == "fp16" else g.dtype
        page_codec = make_row_codec(strategy.page_compressor, head_dim=g.head_dim, dtype=self.page_dtype,
                                    q_range=strategy.q_range, device=g.device)
        # int4 / int8 names make a RowQuant, whose group_max_scores scores the candidates
        key_codec = cast(RowQuant, make_row_codec(f"int{strategy.page_key_bits}", head_dim=g.head_dim, dtype=g.dtype))
        # page_ram_mb of host RAM (0: no limit) holds the newest rows of the page store and, once the shortlist applies
        # (the compact keys are then read for shortlisted pages only), of the compact keys and far_keys; older pages
        # are in spill files (SpillingRowTable). One row count for the three: a row of each fits the budget. It is a
        # host-RAM budget: on an accelerator the tables are in device memory and it does not apply.
        row_bytes = g.num_layers * g.num_kv_heads * (2 * page_codec.bytes_per_row + 2 * key_codec.bytes_per_row)
        on_host = torch.device(g.device).type == "cpu"
        self.ram_rows = ram_rows_for(strategy.page_ram_mb * 2 ** 20 if on_host else 0, row_bytes, self.page_size)
        self.pages = SpillingRowTable(page_codec, ram_rows=self.ram_rows, stack=2, **dims)
        self._key_table = lambda: SpillingRowTable(key_codec, ram_rows=None, stack=1, **dims)
        self.keys = self._key_table()  # limited when the shortlist applies
        # past the trained context: the same compact keys of every archived position, rotated to position 0, scored
        # against queries rotated to far_distance: every candidate at that distance. Kept from the first step on (the
        # first step brings the backend's rotation), archived and saved with the page store, so neither the first
        # step past the context nor a resumed session builds them from the whole store; idle (within the RAM
        # budget's ring, as the page store) until then (`far_active`).
        self.far_keys = self._key_table()
        self.far_active = False  # page choice past the trained context (through far_keys) has started
        self._far_unsaved = False  # loaded without far_keys: a saver's segments lack them (delta_state)
        self.far_distance = self.window + self.page_size
        # queries at p >= far_from attend (and choose pages) in InfLLM's layout; below it at true positions
        far_from = min(strategy.far_from, max_context) if strategy.far_from else max_context
        # far_after "context": the session runs as far_from = the trained context until the engine switches it
        # (`switch_far`, before its first position past the context); from then on as one that ran far_from from its start
        self.far_target = far_from
        self.far_from = max_context if strategy.far_after == "context" else far_from
        self.far_layout = strategy.far_layout  # where those queries see their chosen pages (`_far_slots`)
        # choice_every > 1: from the trained context on, only a query at choice_from + k * choice_every chooses its
        # pages; the others take the pages the last of those chose (`_choice_source`), kept across steps and saved (a
        # row whose source's choice is not held, after a history written without attention, chooses itself)
        self.choice_every, self.choice_from = strategy.choice_every, max_context
        if self.choice_every > 1 and any(w is not None for w in g.layer_windows):
            raise ValueError(f"choice_every {self.choice_every} needs a model whose layers all attend globally: a local "
                             f"layer's window would hide pages another query chose")
        self._choice: torch.Tensor | None = None  # (L, Hkv, M) the pages, in position order, of the last committed choice
        self._choice_pos = -1  # the position whose query made them
        self._rotate: RotateKeys | None = None  # the backend's rotate_keys, from the first step
        self._resident_rows: Callable | None = None  # the backend's fused-step attention of resident rows (recall_hook)
        self._recalled_rows: Callable | None = None  # the backend's attention of a row over recalled rows + slab
        self._native_rows: Callable | None = None  # the backend's fused recall of a step's rows (`_native_attend`)
        # shortlist_pages > 0: per complete page, per layer and KV head, the elementwise max and min of its compact keys
        # (decoded), rounded outward to float16: `bounds` row j = page j, stack (max, min)
        self.shortlist = max(strategy.shortlist_pages, strategy.recall_pages) if strategy.shortlist_pages else 0
        self.shortlist_from = max(strategy.shortlist_from, self.shortlist)  # candidate pages past which it applies
        # rows here are pages: 64 at a time, no proportional growth (a copy of the table every 4,096 positions is cheap,
        # and the bounds are hot bytes)
        self.bounds = RowTable(IdentityRows(g.head_dim, torch.float16), stack=2, **(dims | {"page": 64}), grow=0.0)
        self.evicted_total = 0
        self.timings = {"score_s": 0.0, "fetch_s": 0.0, "attend_s": 0.0, "recalls": 0}  # cumulative, for the cost split
        self._step: Plan | None = None  # per-step host bookkeeping for recall (see prepare)

    # -- bytes ------------------------------------------------------------------------------
    @property
    def resident_nbytes(self) -> int:
        return self.store.nbytes

    @property
    def shortlisting(self) -> bool:
        """A decode step now chooses through the shortlist (more candidate pages than `shortlist_from`)."""
        return bool(self.shortlist) and -(-self.keys.rows // self.page_size) > self.shortlist_from

    @property
    def choice_keys(self) -> RowTable:
        """The compact keys page choice scores: at true positions, or past the trained context `far_keys`."""
        return self.far_keys if self.far_active else self.keys

    @property
    def selection_nbytes(self) -> int:
        """What a step reads to choose pages: the compact keys it scores, read whole until the shortlist applies;
        from then on the page bounds (made then) only (the shortlisted pages' compact keys are read from the
        stored tier)."""
        return self.bounds.nbytes + (0 if self.shortlisting else self.choice_keys.nbytes)

    @property
    def stored_nbytes(self) -> int:
        idle = self.keys if self.far_active else self.far_keys  # the key table page choice does not read
        return self.pages.nbytes + idle.nbytes + (self.choice_keys.nbytes if self.shortlisting else 0)

    @property
    def cold_nbytes(self) -> int:
        """What the session holds on disk (spill files) past `page_ram_mb` of RAM: pages, and compact keys once the
        shortlist applies."""
        return sum(t.cold_nbytes for t in (self.pages, self.keys, self.far_keys))

    @property
    def nbytes(self) -> int:
        return self.resident_nbytes + self.selection_nbytes

    @property
    def archived_end(self) -> int:
        """First position not (yet) in the page store: the store holds [sink, archived_end)."""
        return self.sink + self.pages.rows

    # -- far_from once past the context (KVStrategy.far_after "context") ------------------------
    def far_switch_due(self, end: int) -> bool:
        """Whether a step that writes positions up to `end` (exclusive) must first switch this session to its far_from:
        it reaches past the trained context and the session still runs as far_from = the trained context."""
        return self.far_from != self.far_target and end > self.max_context

    def switch_far(self) -> None:
        """From now on the session runs as one that ran far_from from its start. Nothing it holds depends on far_from
        while no query has reached it, so that takes only the switch; a session already holding positions at or past
        far_from must be re-encoded instead (the engine does: `Engine._switch_far`)."""
        if self.next_position > self.far_target:
            raise ValueError(f"a session at position {self.next_position} holds positions written at true positions past "
                             f"far_from ({self.far_target}): it must be re-encoded from its tokens, not switched")
        self.far_from = self.far_target

    def copyable_prefix(self, other: "PagedCache") -> int:
        """For a re-encode (Engine._switch_far): the positions [0, far_target) of this session whose K/V `copy_rows` can
        write into `other`, an empty cache of the same kind that runs far_from = far_target throughout. Below far_from
        nothing depends on it, so those rows are the bits `other` would compute from the tokens; only the positions
        from far_target on must be encoded again. far_target, or 0 where they cannot be read back exactly (a lossy
        resident store or page codec: the rows read back are not what was written, and writing them again codes them
        again; other settings; some of them not yet archived)."""
        upto = self.far_target
        same = (type(other) is type(self) and other.geometry == self.geometry and other.page_dtype == self.page_dtype
                and type(other.store) is type(self.store) and (other.sink, other.far_target, other.far_from) == (self.sink, upto, upto))
        exact = type(self.store) in (SlabStore, HalfSlabStore) and isinstance(self.pages.codec, IdentityRows)
        if other.next_position or not same or not exact or not self.sink <= upto <= self.archived_end:
            return 0
        pos = self.store.pos
        return upto if int(((pos >= 0) & (pos < self.sink)).sum()) == self.sink else 0

    def copy_rows(self, other: "PagedCache", a: int, b: int) -> None:
        """Write this session's K/V of positions [a, b) (within `copyable_prefix(other)`) into `other`, which holds
        [0, a), as one step through its own API (prepare, update_and_fetch, commit: its archive, compact keys and bounds
        made as in serving): the sink's rows from the slab, the others from the page store (in RAM or spilled)."""
        if other.next_position != a or not 0 <= a < b <= min(self.far_target, self.archived_end):
            raise ValueError(f"copy_rows({a}, {b}): the target holds {other.next_position} positions, and rows are "
                             f"copied from under far_from ({self.far_target}) and the page store's end ({self.archived_end})")
        parts = []
        if a < self.sink:
            pos = self.store.pos
            slots = np.flatnonzero((pos >= a) & (pos < min(b, self.sink)))
            parts.append(self._read_all_layers(slots[np.argsort(pos[slots])]))  # (L, 2, Hkv, n, D)
        if b > self.sink:
            parts.append(self.pages.span(max(a, self.sink) - self.sink, b - self.sink)["rows"])
        kv = torch.cat(parts, 3) if len(parts) > 1 else parts[0]
        dtype = self.geometry.dtype
        other.prepare(range(a, b))
        for layer in range(self.geometry.num_layers):
            other.update_and_fetch(layer, kv[layer, 0].to(dtype), kv[layer, 1].to(dtype))
        other.commit()

    # -- step ---------------------------------------------------------------------------------
    def prepare(self, positions: range | torch.Tensor, ids: torch.Tensor | None = None) -> AttentionLayout:
        t = len(positions) if isinstance(positions, range) else positions.numel()
        reach = self.sink + self.window + self.recall_pages * self.page_size
        if self.next_position + t - 1 >= self.max_context and reach >= self.max_context:  # before any slot is taken
            raise ValueError(
                f"position {self.next_position + t - 1} is past the model's context of {self.max_context}, and this paged "
                f"layout reaches {reach} positions back (sink {self.sink} + window {self.window} + {self.recall_pages} pages "
                f"of {self.page_size}): past the trained context it must stay under {self.max_context}")
        if self.far_switch_due(self.next_position + t):
            raise ValueError(f"positions up to {self.next_position + t - 1} reach past the trained context ({self.max_context}) "
                             f"of a session that runs far_from {self.far_target} once past it: switch it first "
                             f"(switch_far, or the engine's re-encode)")
        layout = super().prepare(positions, ids)
        self._step = self._plan_step(layout)
        return layout

    def _plan_step(self, layout: AttentionLayout) -> Plan | None:
        """Host bookkeeping shared by the step's layers (computed once a step, not per layer):
        candidate positions [sink, cand_end), their count C and pages; which candidates each query
        may recall per model window (None: all of them, as for a decode step on a global layer);
        resident columns of candidates not yet archived; per query row, its visible resident
        columns (row-exact steps)."""
        first, t = layout.first_position, layout.positions.numel()
        cand_end = first + t - self.window  # exclusive: the last query's out-of-window keys end at p - window
        if self.recall_pages == 0 or cand_end <= self.sink:
            return None
        c = cand_end - self.sink
        n_pages = -(-c // self.page_size)
        dev = self.store.device
        # a local layer sees nothing its cache window does not hold; the others recall (their `allowed` made on demand)
        windows = {w for w in self.geometry.layer_windows if w is None or w > self.window}
        cols = None
        if cand_end > self.archived_end:  # out-of-window keys still resident (a step longer than the window)
            key_pos = layout.key_positions.cpu().numpy()
            where = {int(p): i for i, p in enumerate(key_pos) if p >= 0}
            missing = [p for p in range(self.archived_end, cand_end) if p not in where]
            if missing:
                raise CacheInvariantError("inv1", f"positions {missing[:4]}... are neither archived nor resident")
            cols = torch.tensor([where[p] for p in range(self.archived_end, cand_end)], device=dev)
        far = np.arange(first, first + t) >= self.far_from  # rows that choose through far_keys
        plan: Plan = {"cand_end": cand_end, "c": c, "n_pages": n_pages, "windows": windows, "allowed": {}, "free": {},
                      "cols": cols, "first": first, "t": t, "far": "all" if far.all() else ("some" if far.any() else "none"),
                      "far_rows": torch.from_numpy(far).to(dev), "choice_src": None, "choice_out": None,
                      # rows whose own candidates span more than shortlist_from pages (each chooses through the
                      # shortlist as its one-row step would, and as the native recall's tasks do)
                      "short_rows": -(-(np.arange(first + 1, first + t + 1) - self.window - self.sink) // self.page_size)
                      > self.shortlist_from}
        if self.choice_every > 1 and first + t - 1 >= self.choice_from:
            src = self._choice_source(np.arange(first, first + t, dtype=np.int64))
            # a source before the step whose choice the cache does not hold (a history written without attention, as
            # bench_common.fill_with_random_kv writes it, or a state saved without it): the row chooses itself
            held = (src >= first) | (src == self._choice_pos)
            src = np.where(held, src, np.arange(first, first + t))
            g = self.geometry
            plan["choice_src"] = src
            # every row's pages per layer and KV head (position order), as the step's recall makes or takes them
            plan["choice_out"] = torch.full((g.num_layers, t, g.num_kv_heads, self.recall_pages), -1, dtype=torch.long)
        return plan

    def _choice_source(self, p: np.ndarray) -> np.ndarray:
        """The positions whose queries choose the pages the queries at positions p attend to: p itself, or from the
        trained context on with choice_every > 1 the last position at or before p that is choice_from plus a multiple
        of choice_every."""
        return np.where(p < self.choice_from, p, p - (p - self.choice_from) % self.choice_every)

    def _recall_allowed(self, plan: Plan, w: int | None) -> torch.Tensor:
        """(T, C) bool: which candidates each of the step's queries may recall under model window w (made on first use
        and kept in the plan: the native step never reads it, and a prefill chunk's is T x history, 16 MB for 512
        rows at 32k, which was made for every step before 2026-12-01); plan["free"][w]: whether every one may."""
        a = plan["allowed"].get(w)
        if a is None:
            cpos = np.arange(self.sink, plan["cand_end"])
            qpos = np.arange(plan["first"], plan["first"] + plan["t"])[:, None]
            m = cpos[None, :] <= qpos - self.window
            if w is not None:
                m &= cpos[None, :] > qpos - w
            a = plan["allowed"][w] = torch.from_numpy(m).to(self.store.device)
            plan["free"][w] = bool(m.all())
        return a

    def recall_hook(self, rotate_keys: RotateKeys | None = None, resident_rows: Callable | None = None,
                    recalled_rows: Callable | None = None, paged_rows: Callable | None = None) -> Callable | None:
        """The prepared step's per-layer recall (`attend_with_pages`), or None when it recalls nothing (no query has a
        key out of its window: every layer would attend to the resident slab as sink_window does) and the backend
        gives `resident_rows`, its fused row step's attention: the engine may then run the step through that fused
        step, and a verify block's rows that recall nothing attend through `resident_rows` (`_attend_rows`), so they
        equal the one-token steps bit for bit. `recalled_rows`: the backend's attention of a row over its recalled rows
        and the slab (row-exact rows below the trained context; None: torch's two-part call). `paged_rows`: the
        backend's fused recall of a step's rows (`_native_attend`), None where it has none; a decode step whose every
        candidate is archived then gets `layout.recall`, so the backend's fused row step may take it whole. Binds the backend's
        rotation on the first step, as attend_with_pages does."""
        if rotate_keys is not None and self._rotate is None:
            self._keep_far_keys(rotate_keys)
        self._resident_rows, self._recalled_rows, self._native_rows = resident_rows, recalled_rows, paged_rows
        plan, layout = self._step, self._layout
        if (plan is not None and paged_rows is not None and layout is not None and getattr(layout, "row_exact", False)
                and plan["cols"] is None and all(w is None for w in self.geometry.layer_windows)):
            # every candidate archived (a decode step): the backend's fused row step may take the step whole, its
            # recall reading layout.recall; attend_with_pages stays the per-layer path if it declines
            if plan["far"] != "none" and self._rotate is not None and not self.far_active:
                self._start_far_choice()
            layout.recall = self._native_plan(plan, layout)
        return self.attend_with_pages if self._step is not None or resident_rows is None else None

    @torch.inference_mode()
    def attend_with_pages(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                          layout: AttentionLayout, scale: float, rotate_keys: RotateKeys | None = None) -> torch.Tensor | None:
        """Attention output (H, T, D) of this layer's queries q (H, T, D, post-RoPE) over sink +
        window (k_all, v_all (Hkv, N, D) with the layout's mask) + the keys of each query's chosen
        pages; None when nothing is out of any query's window (attend as sink_window does).

        Each KV head reads only the keys its own queries chose. A row-exact step (decode,
        speculative verify) attends row by row over exactly the columns a one-token step at that
        position would: its chosen keys in position order, then its visible resident columns, in
        one call for all heads (a per-head mask only when a chosen page holds keys the row may not
        see: the last, partial page).
        Arrays of another backend (MLX) are copied to CPU torch tensors and the output is torch; the
        backend takes it back (MlxCausalLM.finish), and the store's `read` returns torch rows.
        rotate_keys(layer, k (Hkv, E, D), deltas (Hkv, E)): the backend's RoPE rotation of positioned keys
        by `deltas` positions; queries past the trained context need it (they attend row by row, their
        recalled keys and the sink moved next to the window)."""
        if rotate_keys is not None and self._rotate is None:
            self._keep_far_keys(rotate_keys)
        w = self.geometry.layer_windows[layer]
        plan = self._step
        if plan is None or w not in plan["windows"]:
            return None
        if not isinstance(q, torch.Tensor):  # another backend's arrays (MLX): recall runs on host torch tensors
            q, k_all, v_all = (torch.from_numpy(np.array(x)) for x in (q, k_all, v_all))
        t0 = time.perf_counter()
        if plan["far"] != "none" and self._rotate is not None and not self.far_active:
            self._start_far_choice()
        if self._native_rows is not None and w is None:  # every row as a one-token step at its position would
            o = self._native_attend(layer, q, k_all, v_all, layout, plan)
            if o is not None:
                self._time(t0, t0, t0)  # choice, reads and attention in one call: counted as attention
                return o
        idx, ok = self._choose_pages(layer, q, k_all, plan, w)  # (Hkv, T, M) page indices
        c = plan["c"]
        t1 = time.perf_counter()
        t = idx.shape[1]
        if not getattr(layout, "row_exact", False) and layout.first_position >= self.far_from:
            o = self._attend_far_chunk(layer, q, k_all, v_all, layout, plan, w, idx, scale, rotate_keys)
            if o is not None:
                self._time(t0, t1, t1)
                return o
        if getattr(layout, "row_exact", False) or layout.last_position >= self.far_from:
            return self._attend_rows(layer, q, k_all, v_all, layout, plan, w, idx, scale, t0, t1, rotate_keys)
        sel = self._selection(idx, ok, self._recall_allowed(plan, w), c)  # (Hkv, T, C)
        rows, valid = _rows_per_head(sel.any(1))  # per head: keys any of the step's queries chose
        kr, vr = self._rows_kv(layer, rows, k_all, v_all, plan["cols"])
        mask_r = sel.gather(2, rows[:, None].expand(-1, t, -1)) & valid[:, None]  # (Hkv, T, E)
        t2 = time.perf_counter()
        # a step of many queries: two-part attention (the backend's kernels), resident part on the 2-D mask
        o = attend_merged(q, k_all, v_all, layout.masks[w], kr, vr, mask_r, scale)
        self._time(t0, t1, t2)
        return o

    def _attend_rows(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, layout: AttentionLayout,
                     plan: Plan, w: int | None, idx: torch.Tensor, scale: float, t0: float, t1: float,
                     rotate_keys: RotateKeys | None = None) -> torch.Tensor:
        """Row-exact attention: row j attends, in one call for all heads (each KV head's query heads
        as the call's query rows, so a per-KV-head mask broadcasts over them), over exactly what a
        one-token step at its position reads: its recalled rows, then its visible resident columns
        in slot order (with torch's flash kernel: the recalled rows and the whole resident slab under the
        row's mask, two calls merged by their log-sum-exp; a position's slot does not depend on how steps
        were grouped (the sink_window ring), so the slab's visible columns are where a one-token step has
        them). Its recalled rows depend on its own position only: the first pages of the
        page table as they are when it has at most `recall_pages` pages (then all are chosen), else
        its chosen pages' rows in position order; masked (rows past its candidates, or out of a
        local window) exactly when its own candidates do not fill whole visible pages. So a
        verified block's rows are bit-equal to one-token steps. A row past the trained context
        (`_far_row`) also attends this way, its recalled rows and the sink moved next to its window."""
        hkv = idx.shape[0]
        g, d = q.shape[0] // hkv, q.shape[2]
        p, m = self.page_size, self.recall_pages
        cols = plan["cols"]
        vis = self._row_visible(plan, w, q.dtype)
        table = None
        fetch = attend = 0.0
        out = []
        for j in range(idx.shape[1]):
            ta = time.perf_counter()
            qj = q[:, j].reshape(1, hkv, g, d)
            n_pages = vis["pages"][j]  # this row's candidate pages
            bias = None
            pages = None  # (Hkv, n) the row's pages in position order (for a row past the trained context)
            if n_pages == 0:
                kr = vr = None
            elif n_pages <= m:  # every page of this row chosen: the table's first pages as they are
                pages = torch.arange(n_pages, device=idx.device).expand(hkv, -1)
                if cols is None:
                    kr, vr = self.pages.read_pages(layer, n_pages * p).to(k_all.dtype)
                else:  # some of them still resident (a verify row past the first): the same rows, from the slab
                    rows = torch.arange(n_pages * p, device=idx.device).clamp_(max=plan["c"] - 1).expand(hkv, -1)
                    kr, vr = self._rows_kv(layer, rows, k_all, v_all, cols)
                if vis["masked"][j]:
                    bias = vis["page_bias"][j][:n_pages].reshape(1, 1, 1, -1)
            else:
                table = self._page_rows(plan, idx.device) if table is None else table  # (Hkv * pages, P)
                pages = idx[:, j].sort(-1).values  # (Hkv, M): position order
                flat = (pages + plan["head_pages"]).flatten()
                if cols is None:  # every candidate archived; rows past C stay inside the table's whole pages
                    kr, vr = self.pages.gather_pages(layer, pages).to(k_all.dtype)
                else:
                    rows = table.index_select(0, flat).view(hkv, -1) - plan["head_rows"]
                    kr, vr = self._rows_kv(layer, rows.clamp(max=plan["c"] - 1), k_all, v_all, cols)
                if vis["masked"][j]:
                    bias = vis["page_bias"][j].index_select(0, flat % plan["n_pages"]).view(1, hkv, 1, -1)
            tb = time.perf_counter()  # two calls merged by log-sum-exp: no copy of the resident slab
            p_row = layout.first_position + j
            if n_pages == 0 and p_row < self.far_from:  # nothing out of its window: a one-token step here recalls
                # nothing either and attends to the resident slab (the backend's fused step, or the pieces' call); so
                # does this row
                o = self._resident_rows(layer, q[:, j:j + 1], self.store, layout, [j]) if self._resident_rows else None
                if o is None:
                    o = attend_layout_row(q[:, j:j + 1], k_all, v_all, layout, w, j, scale)
            elif p_row >= self.far_from:
                o = self._far_row(layer, qj, kr, vr, bias, pages, p_row, k_all, v_all, layout,
                                  self._resident_bias(plan, layout, w, q.dtype)[j], scale, rotate_keys)
            else:
                o = (self._recalled_rows(layer, qj, kr, vr, bias, self.store, layout, j)
                     if self._recalled_rows is not None else None)
                if o is None:
                    o = attend_row_two_part(qj, kr, vr, bias, k_all, v_all, self._resident_bias(plan, layout, w, q.dtype)[j],
                                            scale)
            out.append(o.view(hkv * g, 1, d))
            fetch += tb - ta
            attend += time.perf_counter() - tb
        self._time(t0, t1, t1 + fetch, t1 + fetch + attend)
        return out[0] if len(out) == 1 else torch.cat(out, 1)

    def _native_attend(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, layout: AttentionLayout,
                       plan: Plan) -> torch.Tensor | None:
        """Every row of the step (decode, verify block, prefill chunk) through the backend's fused recall (the native
        CPU step's `paged_rows`), each as the one-token step at its position: the page choice `_choose_pages` makes
        for a one-row step there (compact keys at true positions, or far_keys past the trained context; the bounds'
        shortlist past `shortlist_from` of the row's own pages), the chosen pages read from either tier, and the
        attention `_attend_rows` gives it, in one call per layer. Taken for every step of a session it can take (the
        page store exact fp32 or fp16 rows, a global layer) or for none, so verify blocks and prefill chunks give the
        one-token steps' bits (a prompt's K/V is what decoding it writes). None: not a session for it (the Python path)."""
        view = self._native_plan(plan, layout)
        if view is None or self._native_rows is None:
            return None
        fresh = []
        cols = plan["cols"]
        if cols is not None:  # a verify row's candidates past the first row's are still resident: as the tables will hold them
            codes, sc = self._fresh_codes(layer, k_all, cols, self.keys)
            far_codes, far_sc = (self._fresh_codes(layer, k_all, cols, self.far_keys) if view["far_rows"]
                                 else (codes[:, :0], sc[:, :0]))
            kv = torch.stack([k_all.index_select(1, cols), v_all.index_select(1, cols)])
            fresh = [codes, sc, far_codes, far_sc, kv.to(self.page_dtype)]  # as the page store will hold them
        return self._native_rows(layer, q, view, fresh, self.store, layout)

    def _native_plan(self, plan: Plan, layout: AttentionLayout) -> dict | None:
        """The step's tables, their bookkeeping and its rows' candidates as a backend's fused recall reads them (made
        once a step, after far choice started if it does), or None when this session's pages are not exact fp32 / fp16
        rows or its compact keys not a RowQuant. Views, not copies: valid until the step commits."""
        if "native" not in plan:
            view = plan["native"] = self._native_view(layout)
            if view is not None:  # choice_every: the kept choice, and where each row's pages go (or empty), then K,
                # the first position it applies at and the kept choice's position
                out, none = plan["choice_out"], torch.empty(0, dtype=torch.long)
                kept = self._choice if out is not None and self._choice is not None else none
                view["tables"] += [kept, out if out is not None else none]
                view["meta"] += [self.choice_every if out is not None else 1, self.choice_from, self._choice_pos]
        return plan["native"]

    def _native_view(self, layout: AttentionLayout) -> dict | None:
        if (not isinstance(self.pages.codec, IdentityRows) or self.pages.codec.dtype not in (torch.float32, torch.float16)
                or not isinstance(self.keys.codec, RowQuant) or self.page_size > 256 or self.sink > 256
                or torch.device(self.geometry.device).type != "cpu"):
            return None

        def tier(table: SpillingRowTable, name: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
            cold = table.cold_pages
            file = table.files[name].tensor if cold else torch.empty(0)
            return table.data[name], file, [table.rows, cold, table.ram_rows if table.wrapped and table.ram_rows else 0]

        tables, meta = [], []
        for table in (self.keys, self.far_keys):
            (cr, cf, m), (sr, sf, _) = tier(table, "codes"), tier(table, "scale")
            tables += [cr, sr, cf, sf]
            meta += m
        pr, pf, m = tier(self.pages, "rows")
        tables += [pr, pf, self.bounds.data["rows"]]
        meta += m
        meta += [self.sink, self.window, self.page_size, self.recall_pages, self.shortlist, self.shortlist_from,
                 self.far_distance, self.far_from, self.bounds.rows, int(self.far_active), int(self.far_layout == "spread")]
        first, t = layout.first_position, layout.positions.numel()
        positions = np.arange(first, first + t)
        kp = layout.key_positions
        return {"tables": tables, "meta": meta, "positions": positions,
                "candidates": np.maximum(positions - self.window + 1 - self.sink, 0),
                "sink_cols": torch.nonzero((kp >= 0) & (kp < self.sink)).flatten(),
                "far_rows": bool(self.far_active and positions[-1] >= self.far_from)}

    def _far_row(self, layer: int, qj: torch.Tensor, kr: torch.Tensor | None, vr: torch.Tensor | None,
                 bias_r: torch.Tensor | None, pages: torch.Tensor | None, p: int, k_all: torch.Tensor, v_all: torch.Tensor,
                 layout: AttentionLayout, bias_w: torch.Tensor, scale: float, rotate_keys: RotateKeys | None) -> torch.Tensor:
        """One query row at p >= far_from (InfLLM's layout): its window at true positions; its recalled
        rows (pages (Hkv, n) in position order) as if they sat in that order right before the window, the
        sink right before them (or, "spread", at their gaps scaled down: `_far_slots`). A page moves as a whole,
        so the row's G query vectors are counter-rotated once per page (and once for the sink) instead of its keys
        being rotated (`attend_moved_row`)."""
        if rotate_keys is None:
            raise ValueError(f"position {p} is past far_from ({self.far_from}; the trained context: {self.max_context}): "
                             "paged needs the backend's rotate_keys there (the torch backend has it)")
        hkv, g, d = qj.shape[1:]
        q = qj[0]  # (Hkv, G, D)
        n = 0 if pages is None else pages.shape[1]
        moved = []
        at = pages if pages is not None else torch.empty(hkv, 0, dtype=torch.long, device=q.device)
        moves, sink_start = self._far_slots(at, torch.tensor(p, device=q.device))
        if kr is not None:
            assert pages is not None and vr is not None  # _attend_rows sets a row's pages with its recalled rows
            back = -moves  # (Hkv, n)
            q_pages = rotate_keys(layer, q[:, None].expand(hkv, n, g, d).reshape(hkv, n * g, d),
                                  back[..., None].expand(hkv, n, g).reshape(hkv, -1)).view(hkv, n, g, d)
            moved.append((q_pages, kr, vr, None if bias_r is None else bias_r[0]))
        kp = layout.key_positions
        sink_cols = torch.nonzero((kp >= 0) & (kp < self.sink)).flatten()
        if sink_cols.numel():
            q_sink = rotate_keys(layer, q, (-sink_start)[:, None].expand(hkv, g))
            moved.append((q_sink[:, None], k_all.index_select(1, sink_cols), v_all.index_select(1, sink_cols), None))
            bias_w = bias_w.clone()
            bias_w[sink_cols] = float("-inf")  # the sink is attended above, moved; the window stays where it is
        return attend_moved_row(qj, moved, k_all, v_all, bias_w, scale)

    def _attend_far_chunk(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, layout: AttentionLayout,
                          plan: Plan, w: int | None, idx: torch.Tensor, scale: float,
                          rotate_keys: RotateKeys | None) -> torch.Tensor | None:
        """A prefill chunk past the trained context, each row in the layout `_far_row` gives it (its chosen pages in
        position order right before its window, the sink right before them; or spread: `_far_slots`), every row at once. A page moves as
        a whole (one rotation for its P keys), and RoPE is a rotation: q . R(d) k = R(-d) q . k, so each row's
        queries are counter-rotated once per chosen page (G vectors) instead of its P keys being rotated
        (the page store's keys are read as stored). Each KV head's chosen pages are read once (their union), and
        the rows' (row, page) pairs are grouped by page (`page_tiles`): a row never copies the pages it reads.
        Part one: each row over its pages' keys and the moved sink (scores by batched products per page tile, one
        softmax); part two: every row over the resident slab under its mask
        (one attention call); merged by log-sum-exp. Not row-exact (a chunk's rows attend batched, as below the
        context); decode and verify rows keep `_attend_rows`. None: a row with at most `recall_pages` pages."""
        hkv, t = idx.shape[0], idx.shape[1]
        g, d = q.shape[0] // hkv, q.shape[2]
        p, m = self.page_size, idx.shape[2]
        vis = self._row_visible(plan, w, q.dtype)
        if rotate_keys is None or min(vis["pages"]) <= self.recall_pages:
            return None
        dev = idx.device
        pages = idx.sort(-1).values  # (Hkv, T, M): position order
        k_u, v_u, pair_page = self._candidate_pages(layer, pages, k_all, v_all, plan)  # (Hkv * U, P, D) x2, (Hkv * T * M,)
        slot, tile_page = page_tiles(pair_page, k_u.shape[0])  # the (row, page) pairs grouped by page
        positions = layout.first_position + torch.arange(t, device=dev)  # (T,)
        deltas, first = self._far_slots(pages, positions)  # (Hkv, T, M): each chosen page's move; (Hkv, T): the sink's start
        qh = q.reshape(hkv, g, t, d).transpose(1, 2)  # (Hkv, T, G, D)
        q_pages = rotate_keys(layer, qh[:, :, None].expand(hkv, t, m, g, d).reshape(hkv, -1, d),
                              (-deltas)[..., None].expand(hkv, t, m, g).reshape(hkv, -1)).view(hkv, t, m, g, d)
        scores = page_pair_scores(q_pages.view(-1, g, d), slot, tile_page, k_u).view(hkv, t, m, g, p)
        scores = scores.transpose(2, 3).reshape(hkv, t, g, m * p) * scale
        bias_r = vis["page_bias"][torch.arange(t, device=dev)[None, :, None], pages]  # (Hkv, T, M, P)
        scores = scores + bias_r.reshape(hkv, t, 1, m * p)
        bias_w = self._resident_bias(plan, layout, w, q.dtype)  # (T, N)
        kp = layout.key_positions
        sink_cols = torch.nonzero((kp >= 0) & (kp < self.sink)).flatten()
        sink_scores = None
        if sink_cols.numel():  # the sink, moved to sit right before each row's pages: its queries counter-rotated
            q_sink = rotate_keys(layer, qh.reshape(hkv, -1, d), (-first)[:, :, None].expand(hkv, t, g).reshape(hkv, -1))
            sink_scores = torch.einsum("htgd,hsd->htgs", q_sink.view(hkv, t, g, d), k_all.index_select(1, sink_cols)) * scale
            bias_w = bias_w.clone()
            bias_w[:, sink_cols] = float("-inf")  # attended above, moved; the window stays where it is
        # one softmax over each row's page keys and moved sink (scores only concatenated: values stay apart)
        lse_r = torch.logsumexp(scores if sink_scores is None else torch.cat([scores, sink_scores], -1), -1)  # (Hkv, T, G)
        weights = torch.exp(scores - lse_r[..., None]).view(hkv, t, g, m, p).transpose(2, 3).reshape(-1, g, p)
        o_r = page_pair_mix(weights, slot, tile_page, v_u).view(hkv, t, m, g, d).sum(2)  # (Hkv, T, G, D)
        if sink_scores is not None:
            o_r = o_r + torch.einsum("htgs,hsd->htgd", torch.exp(sink_scores - lse_r[..., None]), v_all.index_select(1, sink_cols))
        o_w, lse_w = attention_lse(q.reshape(1, hkv, g * t, d), k_all[None], v_all[None], bias_w.repeat(g, 1)[None, None], scale)
        o_w, lse_w = o_w.view(hkv, g, t, d), lse_w.view(hkv, g, t)  # query rows in (G, T) order
        o_r, lse_r = o_r.transpose(1, 2), lse_r.transpose(1, 2)  # (Hkv, G, T, ...)
        total = torch.logaddexp(lse_r, lse_w)
        o = o_r * (lse_r - total).exp()[..., None] + o_w * (lse_w - total).exp()[..., None]
        return o.reshape(hkv * g, t, d).to(q.dtype)

    def _candidate_pages(self, layer: int, pages: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                         plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chosen pages (Hkv, T, M) of many rows at once, each KV head's union of them read once (`_rows_kv`:
        archived rows from the page store, whichever tier holds them, still-resident ones through the page codec;
        rows past C repeat the last candidate, which the page masks hide): exact K and V (Hkv * U, P, D), head h's
        pages at h * U .. (U: the most any head chose), and each (head, row, page) pair's page among them
        (Hkv * T * M,)."""
        hkv, d, p = k_all.shape[0], k_all.shape[2], self.page_size
        n_pages = plan["n_pages"]
        dev = pages.device
        chosen = torch.zeros(hkv, n_pages, dtype=torch.bool, device=dev).scatter_(1, pages.flatten(1), True)
        pages_u, valid_u = _rows_per_head(chosen)  # (Hkv, U): each head's chosen pages, ascending
        u = pages_u.shape[1]
        rows = ((pages_u * p)[:, :, None] + torch.arange(p, device=dev)).view(hkv, -1).clamp_(max=plan["c"] - 1)
        k_u, v_u = self._rows_kv(layer, rows, k_all, v_all, plan["cols"])  # (Hkv, U * P, D)
        at = torch.zeros(hkv, n_pages + 1, dtype=torch.long, device=dev)  # page -> its place among the head's U
        at.scatter_(1, torch.where(valid_u, pages_u, n_pages), torch.arange(u, device=dev).expand(hkv, -1))
        pair_page = (at.gather(1, pages.flatten(1)) + torch.arange(hkv, device=dev)[:, None] * u).flatten()
        return k_u.reshape(hkv * u, p, d), v_u.reshape(hkv * u, p, d), pair_page

    def _far_slots(self, pages: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a query at p >= far_from sees its chosen pages and the sink: pages (..., n) in position order, p
        broadcastable to pages' leading dims. Returns each page's move (..., n) (its slot's start less its true start)
        and where the sink starts (pages' leading dims).

        "packed" (InfLLM's layout): page i goes to the i-th of n page slots ending right before the query's window,
        the sink right before them. "spread": the same order, with the gaps before each page, and from the last one to
        the window, scaled down together (integer floor of gap * free / total gaps, free = far_from - window - sink -
        n * page_size) so everything the query sees spans at most far_from positions; a page straddling the window's
        start counts a gap of 0 after it. Order and relative spacing are kept; a query at p < far_from (where nothing
        is scaled) would see every page at its true position. A row that recalls nothing sees the sink next to its
        window in either layout (`_sink_shift`). Kept equal, integer for integer, to paged_rows.h's `far_slots`."""
        n, size, dev = pages.shape[-1], self.page_size, pages.device
        starts = self.sink + pages.to(torch.long) * size
        w0 = torch.broadcast_to(torch.as_tensor(p, device=dev) - self.window + 1, pages.shape[:-1])  # the window's start
        if self.far_layout == "packed" or n == 0:
            slot_start = w0[..., None] - (n - torch.arange(n, device=dev)) * size
            return slot_start - starts, w0 - n * size - self.sink
        prev_end = torch.cat([torch.full_like(starts[..., :1], self.sink), starts[..., :-1] + size], -1)
        gaps = torch.cat([starts - prev_end, (w0[..., None] - starts[..., -1:] - size).clamp(min=0)], -1)  # (..., n + 1)
        free = self.far_from - self.window - self.sink - n * size
        total = gaps.sum(-1, keepdim=True)
        gaps = torch.where(total > free, gaps * free // total.clamp(min=1), gaps)
        after = gaps.flip(-1).cumsum(-1).flip(-1)  # after[i]: the gaps from gap i on (gap i: before page i; gap n: the last)
        slot_start = w0[..., None] - after[..., 1:] - (n - torch.arange(n, device=dev)) * size
        return slot_start - starts, w0 - after[..., 0] - n * size - self.sink

    def _sink_shift(self) -> SinkShift | None:
        """Past far_from (not only past the trained context) a query that recalls nothing sees the sink next to its
        window, as its chosen pages would see it."""
        return SinkShift(self.far_from, self.sink, self.sink + self.window - 1)

    def _stored_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Keys as the page store returns them (its codec's round trip; themselves for the exact `identity` one): what
        far_keys are made from on every path (archived, still resident, or made again from the page store)."""
        return k if isinstance(self.pages.codec, IdentityRows) else self._as_stored(k, k.dtype)

    def _as_stored(self, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Still-resident rows kv (2, Hkv, E, D) as the page store would return them once archived (its codec)."""
        codec = self.pages.codec
        return codec.decode(codec.encode(kv.reshape(-1, kv.shape[-1]))).reshape(kv.shape).to(dtype)

    def _resident_bias(self, plan: Plan, layout: AttentionLayout, w: int | None, dtype: torch.dtype) -> torch.Tensor:
        """(T, N) additive mask (0 / -inf) of the resident slab per query row; once a step per window."""
        key = ("resident_bias", w)
        if key not in plan:
            m = layout.masks[w]
            plan[key] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
        return plan[key]

    def _row_visible(self, plan: Plan, w: int | None, dtype: torch.dtype) -> dict[str, Any]:
        """Per query row (made once a step per window, shared by the layers): its candidate pages
        (through its last visible candidate), additive masks (0 / -inf) of the step's candidate
        rows by page ((pages, P): allowed, nothing past C), and whether the row's own pages hold
        rows it may not see (then its call is masked)."""
        key = ("visible", w)
        if key not in plan:
            p, n_pages = self.page_size, plan["n_pages"]
            ok = F.pad(self._recall_allowed(plan, w), (0, n_pages * p - plan["c"]), value=False)  # (T, pages * P)
            host = ok.cpu().numpy()
            last = [int(np.flatnonzero(r)[-1]) + 1 if r.any() else 0 for r in host]  # rows through the last visible one
            pages = [-(-n // p) for n in last]
            masked = [not host[j, : pages[j] * p].all() for j in range(len(host))]
            ninf = torch.tensor(float("-inf"), dtype=dtype, device=ok.device)
            zero = torch.zeros((), dtype=dtype, device=ok.device)
            plan[key] = {"pages": pages, "masked": masked, "page_bias": torch.where(ok, zero, ninf).view(ok.shape[0], n_pages, p)}
        return plan[key]

    def _page_rows(self, plan: Plan, device: torch.device) -> torch.Tensor:
        """(Hkv * pages, P): page j of KV head h at row h * pages + j, holding the rows h * stride +
        j * P + (0 .. P-1) of the row table's flat rows (`row_stride`); made once a step."""
        if "page_rows" not in plan:
            hkv, p, n_pages, cap = self.geometry.num_kv_heads, self.page_size, plan["n_pages"], self.pages.row_stride
            heads = torch.arange(hkv, device=device)
            plan["head_pages"] = (heads * n_pages)[:, None]
            plan["head_rows"] = (heads * cap)[:, None]
            plan["page_rows"] = ((heads * cap)[:, None, None] + torch.arange(n_pages * p, device=device).view(1, n_pages, p)).view(-1, p)
        return plan["page_rows"]

    def _time(self, t0: float, t1: float, t2: float, t3: float | None = None) -> None:
        t3 = time.perf_counter() if t3 is None else t3
        self.timings["score_s"] += t1 - t0
        self.timings["fetch_s"] += t2 - t1
        self.timings["attend_s"] += t3 - t2
        self.timings["recalls"] += 1

    def _choose(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, w: int | None = None) -> torch.Tensor:
        """(Hkv, T, C) bool: candidate c (position sink + c) is recalled by query t for KV head h."""
        plan = self._step
        if plan is None:
            raise CacheInvariantError("inv1", "page choice outside a prepared step")
        idx, ok = self._choose_pages(layer, q, k_all, plan, w)
        return self._selection(idx, ok, self._recall_allowed(plan, w), plan["c"])

    def _selection(self, idx: torch.Tensor, ok: torch.Tensor, allowed: torch.Tensor, c: int) -> torch.Tensor:
        """(Hkv, T, C) bool from the chosen pages: keys of a chosen page the query may see."""
        n_pages = -(-c // self.page_size)
        chosen = torch.zeros(*idx.shape[:2], n_pages, dtype=torch.bool, device=idx.device).scatter_(-1, idx, ok)
        return chosen.repeat_interleave(self.page_size, -1)[..., :c] & allowed

    def _choose_pages(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, plan: Plan,
                      w: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's pages per KV head (`_choose_own_pages`), except, with choice_every > 1, a query past the
        trained context whose position does not choose: it takes the pages its source position chose (`_choice_source`),
        from this step's row there or from the choice the cache kept. Every row's pages (position order) are noted in
        the plan for the commit."""
        src, first = plan["choice_src"], plan["first"]
        if src is not None and bool((src < first).all()):  # every row takes the kept choice: nothing to score
            kept = cast(torch.Tensor, self._choice)[layer].to(q.device)  # (Hkv, M)
            idx = kept[:, None].expand(-1, plan["t"], -1)
            plan["choice_out"][layer] = idx.transpose(0, 1).cpu()
            return idx, torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
        idx, ok = self._choose_own_pages(layer, q, k_all, plan, w)
        if src is None:
            return idx, ok
        own, order = idx.sort(-1)  # position order
        own_ok = ok.gather(-1, order)
        before = src < first  # rows taking the kept choice (_plan_step: its position is theirs)
        rows = torch.from_numpy(np.where(before, np.arange(len(src)), src - first)).to(idx.device)
        idx, ok = own.index_select(1, rows), own_ok.index_select(1, rows)  # a row of this step chose them, or it did
        if before.any():
            at = torch.from_numpy(np.flatnonzero(before)).to(idx.device)
            kept = cast(torch.Tensor, self._choice)[layer].to(idx.device)  # (Hkv, M)
            idx[:, at] = kept[:, None]
            ok[:, at] = True
        plan["choice_out"][layer] = idx.transpose(0, 1).cpu()
        return idx, ok

    def _choose_own_pages(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, plan: Plan,
                          w: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's top pages per KV head: idx (Hkv, T, M) page indices and ok (Hkv, T, M) (the
        page holds a key the query may see). Every candidate is scored through its compact code:
        archived ones as stored, still-resident ones (a long prefill chunk) encoded on the fly, by
        the same codec and the same scoring call."""
        hkv, t, c, n_pages = k_all.shape[0], q.shape[1], plan["c"], plan["n_pages"]
        span = n_pages * self.page_size
        if n_pages <= self.recall_pages:  # every page is chosen, whatever the scores: nothing to score
            key = ("every_page", w)
            if key not in plan:
                seen = F.pad(self._recall_allowed(plan, w), (0, span - c), value=False).view(t, n_pages, -1).any(-1)  # (T, pages)
                plan[key] = (torch.arange(n_pages, device=seen.device).expand(hkv, t, n_pages), seen.expand(hkv, t, n_pages))
            return plan[key]
        far = plan["far"] if self.far_active else "none"
        if not self.shortlist or n_pages <= self.shortlist_from:
            return self._choose_exact(layer, q, k_all, plan, w, far)
        short = plan["short_rows"]  # (T,) rows with more than shortlist_from candidate pages of their own
        if far != "some" and short.all():
            return self._choose_shortlisted(layer, q, k_all, plan, w)
        # a step across shortlist_from or the trained context: each row chooses as its one-row step at its position
        idx: torch.Tensor | None = None
        ok: torch.Tensor | None = None
        if not short.all():
            idx, ok = self._choose_exact(layer, q, k_all, plan, w, far)
        rows = torch.from_numpy(short).to(q.device)
        for far_side in ((True, False) if far == "some" else (far == "all",)):
            si, so = self._choose_shortlisted(layer, q, k_all, plan, w, far=far_side)
            if idx is None or ok is None:
                idx, ok = si, so
                continue
            take = (rows & (plan["far_rows"] == far_side))[None, :, None]
            idx, ok = torch.where(take, si, idx), torch.where(take, so, ok)
        assert idx is not None and ok is not None
        return idx, ok

    def _choose_exact(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, plan: Plan, w: int | None,
                      far: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`_choose_own_pages` scoring every candidate's compact key (no shortlist); far: "none", "all" or "some" (a
        step across the trained context: each row scores as a one-row step at its position would)."""
        hkv, d, p = k_all.shape[0], k_all.shape[2], self.page_size
        g, t = q.shape[0] // hkv, q.shape[1]
        c, n_pages = plan["c"], plan["n_pages"]
        span = n_pages * p

        def scored(far_side: bool) -> torch.Tensor:
            codes, sc = self._candidate_codes(layer, k_all, plan, far_side)
            qq = self._far_queries(layer, q, plan) if far_side else q
            return self.keys.codec.group_max_scores(qq.reshape(hkv, g, t, d).float(), codes, sc)  # (Hkv, T, span)

        if far == "some":  # a step across the trained context: each row scores as a one-row step at its position would
            scores = torch.where(plan["far_rows"][None, :, None], scored(True), scored(False))
        else:
            scores = scored(far == "all")
        if span > c:
            scores[..., c:] = float("-inf")
        allowed = self._recall_allowed(plan, w)
        if not plan["free"][w]:
            scores[..., :c].masked_fill_(~allowed, float("-inf"))
        page_scores = scores.view(hkv, t, n_pages, p).amax(-1)  # (Hkv, T, pages): a page's best key
        best, idx = _top(page_scores, min(self.recall_pages, n_pages))
        return idx, best > float("-inf")

    def _candidate_codes(self, layer: int, k_all: torch.Tensor, plan: Plan,
                         far: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact codes and scales (Hkv, span, ...) of the step's candidates laid out as whole pages: archived ones
        as stored, still-resident ones encoded on the fly by the same codec; rows past C are spare (callers mask them).
        far: from far_keys (each key rotated to position 0), the resident ones rotated likewise before encoding."""
        hkv = k_all.shape[0]
        span, cols = plan["n_pages"] * self.page_size, plan["cols"]
        table = self._code_table(far)
        if table.spilled:
            return self._codes_at(layer, k_all, plan, far, torch.arange(span, device=k_all.device).expand(hkv, -1))
        if cols is None:
            stored = table.whole_pages(layer, span)
            return stored["codes"][0], stored["scale"][0]
        stored = table.payload(layer)
        fc, fs = self._fresh_codes(layer, k_all, cols, table)
        codes = torch.cat([stored["codes"][0], fc], 1)
        sc = torch.cat([stored["scale"][0], fs], 1)
        pad = span - codes.shape[1]
        return F.pad(codes, (0, 0, 0, pad)), F.pad(sc, (0, 0, 0, pad))

    def _code_table(self, far: bool) -> SpillingRowTable:
        return self.far_keys if far else self.keys

    def _fresh_codes(self, layer: int, k_all: torch.Tensor, cols: torch.Tensor,
                     table: RowTable) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact codes (Hkv, nf, Dc) and scales (Hkv, nf, 1) of the still-resident candidates (resident columns
        `cols`, positions archived_end ..), as `table` would hold them once archived (far_keys: rotated to 0 first)."""
        hkv, d = k_all.shape[0], k_all.shape[2]
        ks = k_all.index_select(1, cols)
        if table is not self.keys:
            assert self._rotate is not None  # set with far_keys
            back = -torch.arange(self.archived_end, self.archived_end + cols.numel(), device=ks.device)
            ks = self._rotate(layer, self._stored_keys(ks), back.expand(hkv, -1))
        fresh = self.keys.codec.encode(ks.reshape(-1, d))
        nf = cols.numel()
        return fresh["codes"].reshape(hkv, nf, -1), fresh["scale"].reshape(hkv, nf, 1)

    def _codes_at(self, layer: int, k_all: torch.Tensor, plan: Plan, far: bool,
                  rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact codes (Hkv, E, Dc) and scales (Hkv, E, 1) of candidate rows[h] (Hkv, E) per KV head: archived ones
        as stored (from either tier of the key table), still-resident ones encoded on the fly (`_fresh_codes`);
        a row past both repeats the last one (callers mask it)."""
        table = self._code_table(far)
        n_st, cols = table.rows, plan["cols"]
        codes = sc = None
        if n_st:
            got = table.take(layer, rows.clamp(max=n_st - 1))
            codes, sc = got["codes"][0], got["scale"][0]
        if cols is not None and (codes is None or bool((rows >= n_st).any())):
            fc, fs = self._fresh_codes(layer, k_all, cols, table)
            at = (rows - n_st).clamp(0, cols.numel() - 1)
            fc, fs = _head_rows(fc, at), _head_rows(fs, at)
            fresh = (rows >= n_st)[..., None]
            codes = fc if codes is None else torch.where(fresh, fc, codes)
            sc = fs if sc is None else torch.where(fresh, fs, sc)
        assert codes is not None and sc is not None  # nothing archived means candidates are resident (cols)
        return codes, sc

    def _page_bounds(self, codes: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
        """Per page of codes (..., n * P, Dc) / scales (..., n * P, 1): (2, ..., n, D) float16, the elementwise max
        and min of its decoded compact keys, rounded outward (so q . k <= sum max(q * hi, q * lo) for every key k
        of the page up to float rounding). A function of the page's codes only: the same on every path."""
        lead, rows = codes.shape[:-2], codes.shape[-2]
        x = self.keys.codec.decode({"codes": codes.reshape(-1, codes.shape[-1]), "scale": sc.reshape(-1, 1)})
        x = x.view(*lead, rows // self.page_size, self.page_size, -1)
        hi, lo = x.amax(-2), x.amin(-2)
        # outward before rounding to the nearest float16 (relative spacing 2^-10, subnormal spacing 2^-24): the
        # float16 max is >= the max and the float16 min <= the min, on any device
        return torch.stack([hi + hi.abs() * 2 ** -10 + 2 ** -24, lo - lo.abs() * 2 ** -10 - 2 ** -24]).half()

    def _update_bounds(self) -> None:
        """Bounds of the pages the key table completed since the last call (every layer at once)."""
        done, full = self.bounds.rows, self.keys.rows // self.page_size
        if not self.shortlist or full <= done:
            return
        p = self.page_size
        self.bounds.reserve(full)
        for a in range(done, full, 8):  # 8 pages at a time (~12 MB of decoded keys for SmolLM2), not the history's
            e = min(full, a + 8)
            part = {name: x[:, 0] for name, x in self.choice_keys.span(a * p, e * p).items()}  # (L, Hkv, n * P, ...)
            self.bounds.write_all(a, self._page_bounds(part["codes"], part["scale"]).transpose(0, 1))  # (L, 2, Hkv, n, D)
            self.bounds.rows = e
        self._limit_keys()

    def _limit_keys(self) -> None:
        """Key tables no step reads whole hold at most `ram_rows` in RAM, as the page store does (their older pages
        spill): the one page choice scores once the shortlist applies (a step reads its shortlisted pages' keys
        only), and the other always (far_keys below the trained context, idle; the true-position keys past it,
        kept for the saved state). At the first step past the context far_keys are copied into one RAM table
        (`_start_far_choice`), read whole until the shortlist applies."""
        if self.ram_rows is None:
            return
        for t in (self.keys, self.far_keys):
            if self.shortlisting or t is not self.choice_keys:
                t.limit(self.ram_rows)

    def _far_queries(self, layer: int, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """q (H, T, D) at its rows' positions, rotated to far_distance: against far_keys (keys at position 0) every
        candidate then scores at that one distance, inside the trained range."""
        assert self._rotate is not None
        h, t, d = q.shape
        hkv = self.geometry.num_kv_heads
        moves = self.far_distance - (plan["first"] + torch.arange(t, device=q.device))  # (T,)
        return self._rotate(layer, q.reshape(hkv, -1, d), moves.repeat(h // hkv)[None].expand(hkv, -1)).view(h, t, d)

    def _at_zero(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """k (L, 1, Hkv, n, D) post-RoPE at positions start.. -> rotated to position 0 (every layer, one call)."""
        assert self._rotate is not None
        back = -torch.arange(start, start + k.shape[3], device=k.device).expand(k.shape[2], -1)
        return self._rotate(None, k[:, 0], back)[:, None]

    def _keep_far_keys(self, rotate_keys: RotateKeys) -> None:
        """The first step (the backend's rotation now known): far_keys brought up to the page store (nothing to do
        for a new session; a whole store for one loaded from a state that did not hold them) and kept from now on."""
        self._rotate = rotate_keys
        self._limit_keys()  # first: rows made now stream through the RAM ring
        self._catch_up_far_keys()

    def _far_current(self) -> bool:
        """far_keys hold every row of the page store: caught up first where the rotation is known (below the context
        they are made a page at a time, so a save finds up to a page missing)."""
        if self._rotate is not None and self.far_keys.rows < self.pages.rows:
            with torch.inference_mode():  # the tables are the steps' (inference tensors); a save runs outside a step
                self._catch_up_far_keys()
        return self.far_keys.rows == self.pages.rows

    def _catch_up_far_keys(self) -> None:
        """far_keys rows for the page store's rows they lack, from its keys as it returns them, rotated to position 0
        and encoded, FAR_CATCH_UP_ROWS rows of every layer at a time (their keys, rotated copies and codes are what a
        call holds beside the tables: ~15 MB for SmolLM2 at 128 rows; 4,096 rows held ~94 MB of keys alone)."""
        g, table, n = self.geometry, self.far_keys, self.pages.rows
        for a in range(table.rows, n, self.FAR_CATCH_UP_ROWS):
            b = min(n, a + self.FAR_CATCH_UP_ROWS)
            rows = torch.arange(a, b, device=self.pages.device)
            k = torch.stack([self.pages.read(i, rows)[0] for i in range(g.num_layers)])  # (L, Hkv, rows, D)
            table.reserve(b)
            table.write_all(a, self._at_zero(k[:, None].to(g.dtype), self.sink + a))
            table.rows = b

    def _start_far_choice(self) -> None:
        """The first step past the trained context: page choice goes through far_keys (kept since the first step),
        the bounds made again from them."""
        self._catch_up_far_keys()
        self.far_active = True
        if not self.shortlisting:  # read whole from now on: one table in RAM (past the budget's ring until now)
            far = self.far_keys
            self.far_keys = self._key_table()
            self.far_keys.load_state(far.span(0, far.rows), far.rows)
        self._limit_keys()
        self.bounds.rows = 0
        if self.shortlisting:
            self._update_bounds()

    def _choose_shortlisted(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, plan: Plan,
                            w: int | None, far: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`_choose_pages` through a shortlist (Quest's bound, arXiv 2406.10774, as a coarse stage): each query ranks
        the pages wholly visible to it by their bound, max over its group of sum max(q * hi, q * lo), keeps the top
        `shortlist_pages` and every page it sees in part, scores those pages' compact keys exactly, and keeps its
        top `recall_pages` pages by best key, as the exact path does. Equal to the exact path whenever the pages it
        would choose are in the shortlist. A step of many queries scores the union of their shortlists in one call
        (per KV head) and masks each query to its own. far: score every row past the trained context (True) or
        under it (False), whatever the step's rows; None: as the step's rows are, all past it or not."""
        sc = self._shortlist_scores(layer, q, k_all, plan, w, far)
        pages_u, page_scores = sc["pages_u"], sc["page_scores"]
        hkv, t, u = page_scores.shape
        n_pages, m = plan["n_pages"], self.recall_pages
        k = min(m, u)
        best, at_u = _top(page_scores, k)
        ok = best > float("-inf")
        # a slot that holds no page (a local layer's row with fewer pages than recall_pages) says page 0, whatever the
        # union of the step's shortlists is: past the context the listed pages are packed before the window in order
        idx = pages_u.gather(1, at_u.reshape(hkv, -1)).view(hkv, t, k).masked_fill(~ok, 0)
        if k < min(m, n_pages):  # fewer pages in every shortlist than recall_pages: the rest chosen as nothing
            idx, ok = F.pad(idx, (0, min(m, n_pages) - k)), F.pad(ok, (0, min(m, n_pages) - k), value=False)
        return idx, ok

    def _shortlist_scores(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, plan: Plan, w: int | None,
                          far: bool | None = None) -> dict:
        """The shortlisted choice's scores (research scripts read them too): bound (Hkv, T, pages) per query and
        whole page (-inf where it sees the page in part or not at all), short (Hkv, T, pages) the pages each query
        scores, pages_u (Hkv, U) their union per head, page_scores (Hkv, T, U) each one's best compact-key score for
        each query (-inf outside its shortlist), whole (T, pages), far (scored past the trained context)."""
        hkv, d, p = k_all.shape[0], k_all.shape[2], self.page_size
        g, t = q.shape[0] // hkv, q.shape[1]
        n_pages = plan["n_pages"]
        key = ("shortlist", w)
        if key not in plan:  # per step, shared by the layers
            seen = self._row_visible(plan, w, q.dtype)["page_bias"] == 0  # (T, pages, P): rows each query may see
            whole = seen.all(-1)  # (T, pages): pages a query sees whole (ranked by bound)
            ranked = torch.nonzero(whole.any(0)).flatten()
            plan[key] = {"seen": seen, "whole": whole, "part": seen.any(-1) & ~whole,
                         "n_whole": int(ranked[-1]) + 1 if ranked.numel() else 0}
        sl = plan[key]
        seen, whole = sl["seen"], sl["whole"]
        if far is None:
            far = plan["far"] == "all" and self.far_active  # ("some": _choose_own_pages asks for each side)
        if far:
            q = self._far_queries(layer, q, plan)
        # the bounds table is made from far_keys once far choice has started (_start_far_choice): a row under the
        # context in a step across it (or after a rejected one) makes its bounds from its own codes, as natively
        nb = min(self.bounds.rows, n_pages) if far == self.far_active else 0
        n_whole = sl["n_whole"]
        parts = [self.bounds.read(layer)[:, :, :nb]] if nb else []  # (2, Hkv, nb, D)
        if nb < n_whole:  # pages not (yet) complete in the key table: the same bounds, from the step's codes
            recent = torch.arange(nb * p, n_whole * p, device=q.device).expand(hkv, -1)
            parts.append(self._page_bounds(*self._codes_at(layer, k_all, plan, far, recent)))
        if not parts:  # no page seen whole by any row (a local layer's window) and no bounds yet
            parts = [torch.zeros(2, hkv, 0, d, device=q.device)]
        hi, lo = (x.float() for x in (parts[0] if len(parts) == 1 else torch.cat(parts, 2)))  # (Hkv, >= n_whole, D)
        if hi.shape[1] < n_pages:  # pages nobody sees whole: never ranked
            hi, lo = (F.pad(x, (0, 0, 0, n_pages - x.shape[1])) for x in (hi, lo))
        qf = q.reshape(hkv, g * t, d).float()
        bound = torch.baddbmm(torch.bmm(qf.clamp(min=0), hi.transpose(1, 2)), qf.clamp(max=0), lo.transpose(1, 2))
        bound = bound.view(hkv, g, t, n_pages).amax(1).masked_fill_(~whole, float("-inf"))  # (Hkv, T, pages)
        top, at = _top(bound, min(self.shortlist, n_pages))
        short = torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, at, top > float("-inf"))
        short |= sl["part"]  # pages a query sees in part: always scored
        pages_u, valid_u = _rows_per_head(short.any(1))  # (Hkv, U): the union of the step's shortlists per head
        u = pages_u.shape[1]
        rows = ((pages_u * p)[:, :, None] + torch.arange(p, device=q.device)).view(hkv, -1)  # (Hkv, U * P)
        if plan["cols"] is None:  # every candidate archived: whole pages, one block copy each from either tier
            got = self._code_table(far).take_pages(layer, pages_u)
            cu, su = got["codes"][0], got["scale"][0]
        else:
            cu, su = self._codes_at(layer, k_all, plan, far, rows)
        scores = self.keys.codec.group_max_scores(q.reshape(hkv, g, t, d).float(), cu, su).view(hkv, t, u, p)
        scores.masked_fill_(~seen[:, pages_u].permute(1, 0, 2, 3), float("-inf"))  # (Hkv, T, U, P)
        mine = short.gather(-1, pages_u[:, None].expand(hkv, t, u)) & valid_u[:, None]  # (Hkv, T, U)
        page_scores = scores.amax(-1).masked_fill_(~mine, float("-inf"))
        return {"bound": bound, "short": short, "pages_u": pages_u, "page_scores": page_scores, "whole": whole,
                "far": far}

    def _rows_kv(self, layer: int, rows: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                 cols: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V (Hkv, E, D) of candidate rows[h] per KV head: archived ones decoded from the page
        store, still-resident ones from k_all/v_all through the same page codec."""
        n_st = self.pages.rows
        kv = self.pages.gather(layer, rows.clamp(max=max(n_st - 1, 0))).to(k_all.dtype) if n_st else None
        if cols is not None and (kv is None or bool((rows >= n_st).any())):
            c = cols[(rows - n_st).clamp(0, cols.numel() - 1)]  # (Hkv, E)
            heads = torch.arange(k_all.shape[0], device=rows.device)[:, None]
            fresh = self._as_stored(torch.stack([k_all[heads, c], v_all[heads, c]]), k_all.dtype)  # (2, Hkv, E, D)
            kv = fresh if kv is None else torch.where((rows >= n_st)[None, :, :, None], fresh, kv)
        # An empty page store means the candidates are still resident (_plan_step sets cols then).
        assert kv is not None
        return kv[0], kv[1]

    def _on_commit(self, layout: AttentionLayout, n_keep: int) -> None:
        plan = self._step
        if plan is not None and plan["choice_out"] is not None and n_keep and plan["first"] + n_keep - 1 >= self.choice_from:
            out = plan["choice_out"][:, n_keep - 1]  # (L, Hkv, M): the last kept row's pages, its source's choice
            if bool((out < 0).any()):  # written without attention (no choice made): none kept
                self._choice, self._choice_pos = None, -1
            else:
                self._choice = out.clone(memory_format=torch.contiguous_format)
                self._choice_pos = int(plan["choice_src"][n_keep - 1])
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
            order = live[np.argsort(pos[live])]
            self.pages.reserve(self.pages.rows + n)
            self.keys.reserve(self.keys.rows + n)
            # far_keys: past the context (page choice reads them) with every step's rows; below it (idle until then)
            # a page at a time, caught up below, and before a save (_far_current): one call, not one a step
            far_in_step = self._rotate is not None and self.far_active and self.far_keys.rows == self.pages.rows
            if far_in_step:
                self.far_keys.reserve(self.far_keys.rows + n)
            for a in range(0, n, self.ARCHIVE_ROWS):  # a prefill chunk's rows in slices: its copies and codes are a slice's
                part = order[a:a + self.ARCHIVE_ROWS]
                kv = self._read_all_layers(part)  # (L, 2, Hkv, m, D)
                self.pages.write_all(self.pages.rows, kv)
                self.keys.write_all(self.keys.rows, kv[:, :1])
                if far_in_step:
                    self.far_keys.write_all(self.far_keys.rows, self._at_zero(self._stored_keys(kv[:, :1]), start + a))
                    self.far_keys.rows += part.size
                self.pages.rows += part.size
                self.keys.rows += part.size
                del kv
            if self._rotate is not None and not self.far_active and self.pages.rows - self.far_keys.rows >= self.page_size:
                self._catch_up_far_keys()
            if self.shortlisting:  # made when the shortlist starts to apply (all pages at once), then page by page
                self._update_bounds()
        return super()._evict_dead()

    def _read_all_layers(self, slots: np.ndarray) -> torch.Tensor:
        """(L, 2, Hkv, n, D) in the model's dtype: every layer's K and V at resident `slots`. A plain slab store
        (fp32, or fp16 rows, which convert exactly) whose slots form one run (a decode step archives one position) is
        read in one copy, not 30 layers' reads."""
        layers = range(self.geometry.num_layers)
        store = self.store
        if type(store) in (SlabStore, HalfSlabStore) and slots.size and bool((np.diff(slots) == 1).all()):  # one run
            return store.read_run(int(slots[0]), int(slots[-1]) + 1).to(self.geometry.dtype)
        t = store.slots_tensor(slots)
        return torch.stack([torch.stack(store.read(i, t)) for i in layers])

    def _dropped(self, evicted: int) -> int:
        self.evicted_total += evicted
        return 0  # archived, still attendable

    # -- persistence ------------------------------------------------------------------------------
    # The archive only grows: `delta_state` carries the rows archived since a saver's last save only, so
    # a turn's save copies what the turn archived, not the whole archive.
    # far_keys are saved too when they are up to date (rows 0 .. archived_rows); a state whose segments hold fewer
    # (some saves without them, or an older file) loads without them, and the first step makes them again.
    APPEND_ONLY = AppendOnly("archived_rows", {"pages.": 3, "keys.": 3, "far_keys.": 3})  # RowTables: (L, stack, Hkv, rows, ...)

    def delta_state(self, since: SaveMark | None = None) -> CacheDelta:
        """As for any cache; but a saver holding append segments without far_keys (the session was loaded from a
        state without them) gets every archived row again once far_keys are up to date, so its next load has them."""
        if self._far_unsaved and since is not None and since.appended_rows and self._far_current():
            since = SaveMark(since.rows_through, 0)
        delta = super().delta_state(since)
        if delta.appended is not None and delta.appended.start == 0 and any(k.startswith("far_keys.") for k in delta.appended.axes):
            self._far_unsaved = False
        return delta

    def _extra_state(self, appended_from: int, lazy: bool = False) -> tuple[dict, dict]:
        start = min(appended_from, self.pages.rows)
        tensors = {f"pages.{k}": v for k, v in self.pages.state(start, lazy=lazy).items()}
        tensors |= {f"keys.{k}": v for k, v in self.keys.state(start, lazy=lazy).items()}
        if self._far_current():  # up to date (not before a loaded session's first step, nor on MLX)
            tensors |= {f"far_keys.{k}": v for k, v in self.far_keys.state(start, lazy=lazy).items()}
        meta = {"evicted_total": self.evicted_total, "archived_rows": self.pages.rows, "far_from": self.far_from}
        if self._choice is not None:  # choice_every > 1 past the context: the pages later rows take
            tensors["choice.pages"] = self._choice  # replaced at a commit, never written in place
            meta["choice_pos"] = self._choice_pos
        return tensors, meta

    def _load_extra_state(self, tensors: dict, meta: dict) -> None:
        rows = int(meta["archived_rows"])
        if "far_from" in meta and int(meta["far_from"]) in (self.far_target, self.max_context):  # switched, or not yet
            self.far_from = int(meta["far_from"])
        if self.ram_rows is not None and self.shortlist and -(-rows // self.page_size) > self.shortlist_from:
            self.keys.limit(self.ram_rows)  # the shortlist applies from the start: the keys stream in past the ring
        self.pages.load_state({k.removeprefix("pages."): v for k, v in tensors.items() if k.startswith("pages.")}, rows)
        self.keys.load_state({k.removeprefix("keys."): v for k, v in tensors.items() if k.startswith("keys.")}, rows)
        far = {k.removeprefix("far_keys."): v for k, v in tensors.items() if k.startswith("far_keys.")}
        held = next(iter(far.values())).shape[3] if far else 0
        self.far_keys = self._key_table()
        if self.ram_rows is not None:
            self.far_keys.limit(self.ram_rows)  # idle until the first step past the context: stream in past the ring
        if held == rows:  # else made again from the page store at the first step
            self.far_keys.load_state(far, rows)
        self._far_unsaved = held != rows > 0
        self.far_active = False  # page choice past the context starts again at the first step there
        self.bounds.rows = 0  # derived from the keys: rebuilt, not saved
        if self.shortlisting and self.next_position < self.far_from:
            self._update_bounds()
        self.evicted_total = int(meta["evicted_total"])
        choice = tensors.get("choice.pages")
        g = self.geometry
        if choice is not None and self.choice_every > 1:  # kept for the rows after it (else unused: not kept)
            pages = -(-rows // self.page_size)
            if (tuple(choice.shape) != (g.num_layers, g.num_kv_heads, self.recall_pages) or choice.dtype != torch.long
                    or bool(((choice < 0) | (choice >= max(pages, 1))).any())):
                raise ValueError(f"the saved page choice must be ({g.num_layers}, {g.num_kv_heads}, {self.recall_pages}) "
                                 f"int64 pages under {pages}, got {tuple(choice.shape)} {choice.dtype}")
            self._choice, self._choice_pos = choice.clone(), int(meta["choice_pos"])


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along the last axis (values, indices), ties to the lower index whatever the axis' length (topk's
    order among ties depends on it), as the native recall breaks them (csrc/paged_rows.h). Equal keys tie exactly
    (past the trained context every candidate scores at one distance; int4 codes under it), and a verify block, which
    sees more pages (and a wider union of shortlists) than its first rows' one-token steps, must break the tie as they
    do: with topk under the context a rejected-draft run chose page 4 where its steps chose page 17 (2026-12-02)."""
    vals, idx = x.sort(dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def _head_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[h, rows[h]] for every head h: x (H, N, *trailing) with contiguous rows (a view into a larger table is
    fine), rows (H, E) -> (H, E, *trailing), in one index_select over x's rows seen as one flat run."""
    h, stride = x.shape[0], x.stride(0) // x.stride(1)
    flat = x.as_strided(((h - 1) * stride + x.shape[1], *x.shape[2:]), x.stride()[1:])
    return flat.index_select(0, (rows + torch.arange(h, device=rows.device)[:, None] * stride).flatten()).view(
        h, rows.shape[1], *x.shape[2:])


def _rows_per_head(need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """need (Hkv, C) bool -> rows (Hkv, E) ascending chosen indices per head (padded with 0) and
    valid (Hkv, E), E = the most any head chose."""
    counts = need.sum(1)
    e = int(counts.max()) if need.numel() else 0
    order = torch.sort((~need).to(torch.int8), dim=1, stable=True).indices[:, :e]  # chosen first, in order
    valid = torch.arange(e, device=need.device)[None] < counts[:, None]
    return torch.where(valid, order, 0), valid
