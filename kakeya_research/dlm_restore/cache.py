"""DLMRestoreCache: sink_window's resident positions; evicted positions restored for each step."""
from __future__ import annotations

import numpy as np
import torch

from inference_engine.kv.layout import CacheGeometry, SinkShift
from inference_engine.kv.sink_window import SinkWindowCache
from kakeya_research.dlm_restore.policies import make_policy
from kakeya_research.dlm_restore.seam import RestorePlan, RestoreSource
from kakeya_research.dlm_restore.strategy import DLMRestoreStrategy


class DLMRestoreCache(SinkWindowCache):
    """Resident memory is sink_window's. The step's queries attend causally to every resident key
    and to the evicted positions [sink, next_position - window], whose K/V a RestoreSource
    computes for that step only (seam.py: the layout's extra keys, fetched layer by layer). Nothing
    leaves attention, so `commit` reports no dropped positions; evictions from the resident store
    are counted in `evicted_total`. The cache keeps the history's token ids (int32, 4 bytes a
    token; not K/V, not in `nbytes`) because the proposer re-reads them every step. Attention is
    `full`'s, so the history is limited to the trained context (no sink re-anchoring).

    Which evicted positions are restored when is the policy's (policies.py): every step
    (the default), with the worst-restored P pinned resident, or held for N steps."""

    RING = False  # restored columns make its steps batched, not row-exact; pins keep slots of their own

    def __init__(self, strategy: DLMRestoreStrategy, geometry: CacheGeometry, max_step: int, max_context: int, *,
                 restore_source: RestoreSource | None = None):
        if strategy.restore_from != "verifier" and restore_source is None:
            raise ValueError(f"dlm_restore from {strategy.restore_from!r} needs a restore_source (the engine's "
                             "strategy resources: e.g. kv_cache_proposer.restore.DrafterRestoreSource)")
        self.policy = make_policy(strategy, geometry.num_layers)
        super().__init__(strategy, geometry, max_step, max_context, extra_resident=self.policy.extra_resident)
        self.restore_from = strategy.restore_from
        self.restore_source = restore_source  # None: the verifier itself (same-model), from the step's backend
        self.evicted_total = 0
        self._tokens = np.zeros(256, dtype=np.int32)
        self._cover_upto = self.sink - 1  # this step: resident keys in [sink, _cover_upto] are served restored

    def token_history(self, n: int) -> torch.Tensor:
        """Token ids of positions 0..n-1 (what the proposer reads)."""
        return torch.from_numpy(self._tokens[:n].astype(np.int64))

    @property
    def nbytes(self) -> int:
        """Resident K/V bytes plus restored K/V the policy holds for reuse."""
        return self.store.nbytes + self.policy.nbytes

    @property
    def held_nbytes(self) -> int:
        return self.policy.nbytes

    @property
    def pinned_positions(self) -> list[int]:
        return sorted(int(p) for p in self.policy.pinned())

    def _allowed(self, qp, kp):
        restored = (kp >= self.sink) & (kp <= self._cover_upto)  # served from the restored set instead
        pinned = self.policy.pinned()
        if pinned.size:
            restored = restored & ~np.isin(kp, pinned)  # pinned: attended as resident rows
        return (kp >= 0) & (kp <= qp) & ~restored

    def _evict_dead(self) -> int:
        return self.policy.evict(self)

    def _settle(self) -> None:
        target = self.policy.settle_capacity(self)
        if self.capacity > target:
            self._resize(target)

    def _on_commit(self, layout, n_keep: int) -> None:
        self.policy.on_commit(self, layout, n_keep)

    def _on_abort(self) -> None:
        self.policy.on_abort()

    def _sink_shift(self) -> SinkShift | None:
        return None

    def _dropped(self, evicted: int) -> int:
        self.evicted_total += evicted
        return 0

    def prepare(self, positions, ids: torch.Tensor | None = None):
        # Checked before any slot is taken, so a refused step leaves the cache untouched.
        t = len(positions) if isinstance(positions, range) else positions.numel()
        if ids is None or ids.numel() != t:
            raise ValueError("a dlm_restore cache needs the step's token ids: call prepare(positions, ids)")
        if self.next_position + t - 1 >= self.max_context:
            raise ValueError(
                f"position {self.next_position + t - 1} is past the model's context of {self.max_context}; dlm_restore "
                "attends to the whole history like `full`, so sessions stop at the trained context"
            )
        # Positions out of the window for this step's first query: restored now, or the held set.
        self._cover_upto = self.policy.cover_upto(self)
        return super().prepare(positions, ids)

    def _extra_keys(self, first: int, t: int, ids: torch.Tensor | None) -> RestorePlan:
        if ids is None:
            raise ValueError("dlm_restore keeps the token history it restores from: prepare() needs the step's token ids")
        end = first + t
        if end > self._tokens.size:
            grown = np.zeros(max(end, 2 * self._tokens.size), dtype=np.int32)
            grown[: self._tokens.size] = self._tokens
            self._tokens = grown
        self._tokens[first:end] = ids.cpu().numpy()
        evicted = np.arange(self.sink, max(self.sink, self._cover_upto + 1), dtype=np.int64)
        pinned = self.policy.pinned()
        if pinned.size:
            evicted = evicted[~np.isin(evicted, pinned)]
        qp, kp = np.arange(first, end)[:, None], evicted[None, :]
        dev = self.store.device
        masks = {w: torch.from_numpy((kp <= qp) if w is None else (kp > qp - w)).to(dev) for w in set(self.geometry.layer_windows)}
        held, record = self.policy.held_and_record(self, evicted.size > 0)
        return RestorePlan(self.token_history(end).to(dev), torch.from_numpy(evicted).to(dev), masks, self.restore_source,
                           held, record)

    def _extra_state(self, appended_from: int, lazy: bool = False) -> tuple[dict, dict]:
        tensors, meta = self.policy.state()
        n = self.next_position
        return ({"tokens": torch.from_numpy(self._tokens[:n].copy())} | tensors,
                {"evicted_total": self.evicted_total, "policy": self.policy.name} | meta)

    def _load_extra_state(self, tensors: dict, meta: dict) -> None:
        if meta["policy"] != self.policy.name:
            raise ValueError(f"cache state was saved with restore policy {meta['policy']!r}, the strategy uses {self.policy.name!r}")
        tokens = tensors["tokens"].numpy().astype(np.int32)
        self._tokens = np.zeros(max(256, tokens.size), dtype=np.int32)
        self._tokens[: tokens.size] = tokens
        self.evicted_total = int(meta["evicted_total"])
        dev = self.store.device
        self.policy.load_state({k: v.to(dev) for k, v in tensors.items()}, meta)
