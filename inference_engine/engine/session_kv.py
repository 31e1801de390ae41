"""SessionKV: a session's engine-side state, as the session layer holds it (opaquely)."""
from __future__ import annotations

from typing import Any

import torch

from inference_engine.engine.speculative import DraftGate
from inference_engine.kv.factory import cache_from_state
from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.slot_cache import CacheDelta, CacheState, SaveMark, SlotKVCache


class SessionKV:
    """The resident cache, the logits after the last committed token, and the verifier hidden
    states of the most recent positions (drafter features): the final hidden states, or with
    `capture_layers` (a v2 drafter) the outputs of those layers, concatenated."""

    def __init__(self, cache: SlotKVCache, hidden_keep: int = 0, capture_layers: tuple[int, ...] = ()):
        self.cache = cache
        self.last_logits: torch.Tensor | None = None  # (V,) float32, host
        self.hidden_keep = hidden_keep
        self.capture_layers = tuple(capture_layers)
        self.recent_hidden: torch.Tensor | None = None  # (<= hidden_keep, H or len(capture_layers) * H), ends at next_position
        # a v2 drafter's own cache (its DraftCache: drafters are duck-typed) (not saved: rebuilt from recent_hidden)
        self.drafter_state: Any = None
        self.draft_gate = DraftGate()  # speculative decoding's back-off (not saved: it never changes output)
        # how many times the session's cache was made again from its tokens (`adopt`): a saver holding rows of an
        # earlier one writes everything again
        self.epoch = 0
        self.reencoded_tokens = 0  # positions re-encoded into an adopted cache, in all (not saved: a counter)
        # while the session is re-encoded (Engine._switch_far), the new SessionKV being filled: its bytes are the
        # session's too (both caches are held until it adopts the new one), so `nbytes` and kv_bytes count them
        self.reencoding: SessionKV | None = None

    def adopt(self, other: "SessionKV") -> None:
        """Take `other`'s cache and what was computed with it: the session re-encoded from its tokens into a new cache
        (Engine._switch_far). The saver sees a new epoch and saves the cache whole."""
        self.cache, self.last_logits = other.cache, other.last_logits
        self.hidden_keep, self.capture_layers, self.recent_hidden = other.hidden_keep, other.capture_layers, other.recent_hidden
        self.drafter_state = None  # a v2 drafter's cache: rebuilt from recent_hidden
        self.epoch += 1

    def remember_hidden(self, hidden: torch.Tensor, n_committed: int) -> None:
        if not self.hidden_keep:
            return
        h = hidden[:n_committed]
        if self.recent_hidden is not None:
            h = torch.cat([self.recent_hidden, h])
        self.recent_hidden = h[-self.hidden_keep :].clone()

    @property
    def next_position(self) -> int:
        return self.cache.next_position

    @property
    def nbytes(self) -> int:
        fresh = self.reencoding  # read once: other threads (GetSessionInfo, the gauges) ask while the loop sets it
        return self.cache.nbytes + (fresh.nbytes if fresh is not None else 0)

    @property
    def resident_positions(self) -> int:
        return self.cache.resident_positions

    @property
    def dropped_total(self) -> int:
        return self.cache.dropped_total

    # -- persistence ----------------------------------------------------------------------
    def state(self, *, with_store: bool = True) -> CacheState:
        return self._with_session(self.cache.state(with_store=with_store))

    def delta_state(self, since: SaveMark | None = None) -> CacheDelta:
        """The cache's `delta_state(since)`, its state with this session's tensors added (see `state`)."""
        delta = self.cache.delta_state(since)
        delta.state = self._with_session(delta.state)
        return delta

    def _with_session(self, st: CacheState) -> CacheState:
        tensors, meta = dict(st.tensors), dict(st.meta)
        if self.last_logits is not None:
            tensors["session.last_logits"] = self.last_logits.cpu()
        if self.recent_hidden is not None:
            tensors["session.recent_hidden"] = self.recent_hidden.cpu()
        meta["session.hidden_keep"] = self.hidden_keep
        if self.epoch:
            meta["session.epoch"] = self.epoch
        if self.capture_layers:
            meta["session.capture_layers"] = list(self.capture_layers)
        return CacheState(tensors, meta)

    @classmethod
    def from_state(cls, state: CacheState, geometry: CacheGeometry, *, max_step: int, max_context: int, resources: object = None,
                   hidden_keep: int | None = None) -> "SessionKV":
        cache = cache_from_state(state, geometry, max_step=max_step, max_context=max_context,
                                 resources=resources)
        keep = state.meta["session.hidden_keep"] if hidden_keep is None else hidden_keep
        kv = cls(cache, hidden_keep=keep, capture_layers=tuple(state.meta.get("session.capture_layers", ())))
        kv.epoch = int(state.meta.get("session.epoch", 0))
        kv.last_logits = state.tensors.get("session.last_logits")
        h = state.tensors.get("session.recent_hidden")
        kv.recent_hidden = h.to(geometry.device) if h is not None and keep else None
        return kv
