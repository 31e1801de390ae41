"""make_cache: the resident cache a KVStrategy names."""
from __future__ import annotations

from inference_engine.kv.dlm_restore import DLMRestoreCache
from inference_engine.kv.full import FullKVCache
from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.sink_window import SinkWindowCache
from inference_engine.kv.slot_cache import SlotKVCache
from inference_engine.kv.strategy import KVStrategy


def make_cache(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
               restore_source=None) -> SlotKVCache:
    """restore_source: for dlm_restore, the RestoreSource to use; None lets the backend use
    `strategy.restore_from` ("verifier" = the model itself, f_θ = identity)."""
    if strategy.name == "full":
        return FullKVCache(strategy, geometry)
    if strategy.name == "dlm_restore":
        return DLMRestoreCache(strategy, geometry, max_step, max_context, restore_source=restore_source)
    return SinkWindowCache(strategy, geometry, max_step, max_context)
