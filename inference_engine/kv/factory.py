"""make_cache: the resident cache a KVStrategy names."""
from __future__ import annotations

from inference_engine.kv.dlm_restore import DLMRestoreCache
from inference_engine.kv.full import FullKVCache
from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.paged import PagedCache
from inference_engine.kv.sink_window import SinkWindowCache
from inference_engine.kv.slot_cache import STATE_FORMAT, CacheState, SlotKVCache, geometry_meta
from inference_engine.kv.stores import rows_deferred
from inference_engine.kv.strategy import KVStrategy


def make_cache(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
               restore_source=None) -> SlotKVCache:
    """restore_source: for dlm_restore, the RestoreSource to use; None lets the backend use
    `strategy.restore_from` ("verifier" = the model itself, f_θ = identity)."""
    if strategy.name == "full":
        return FullKVCache(strategy, geometry)
    if strategy.name == "dlm_restore":
        return DLMRestoreCache(strategy, geometry, max_step, max_context, restore_source=restore_source)
    if strategy.name == "paged":
        return PagedCache(strategy, geometry, max_step, max_context)
    return SinkWindowCache(strategy, geometry, max_step, max_context)


def cache_from_state(state: CacheState, geometry: CacheGeometry, *, max_step: int, max_context: int,
                     restore_source=None) -> SlotKVCache:
    """Rebuild the cache `state` describes for a model of `geometry` (checked against the state)."""
    meta = state.meta
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"cache state format {meta.get('format')!r} is not supported (this build reads {STATE_FORMAT})")
    got = geometry_meta(geometry)
    if meta["geometry"] != got:
        raise ValueError(f"cache state is for a model with {meta['geometry']}; this model has {got}")
    with rows_deferred():  # the store's slabs come from the state: not allocated (and zeroed) first
        cache = make_cache(KVStrategy(**meta["strategy"]), geometry, max_step=max_step, max_context=max_context,
                           restore_source=restore_source)
    cache.load_state(state)
    return cache
