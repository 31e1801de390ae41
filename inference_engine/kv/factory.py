"""make_cache: the resident cache a KVStrategy names (through the strategy registry, registry.py)."""
from __future__ import annotations

from inference_engine.kv import registry
from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.slot_cache import STATE_FORMAT, CacheState, SlotKVCache, geometry_meta
from inference_engine.kv.stores import rows_deferred
from inference_engine.kv.strategy import KVStrategy


def make_cache(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
               resources: object = None) -> SlotKVCache:
    """resources: what the strategy's plugin built for the engine (StrategyPlugin.build_resources), shared by
    every cache it makes; None for the built-in strategies."""
    return registry.make_cache(strategy, geometry, max_step=max_step, max_context=max_context, resources=resources)


def cache_from_state(state: CacheState, geometry: CacheGeometry, *, max_step: int, max_context: int,
                     resources: object = None) -> SlotKVCache:
    """Rebuild the cache `state` describes for a model of `geometry` (checked against the state)."""
    meta = state.meta
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"cache state format {meta.get('format')!r} is not supported (this build reads {STATE_FORMAT})")
    got = geometry_meta(geometry)
    if meta["geometry"] != got:
        raise ValueError(f"cache state is for a model with {meta['geometry']}; this model has {got}")
    with rows_deferred():  # the store's slabs come from the state: not allocated (and zeroed) first
        cache = make_cache(registry.strategy_from_dict(meta["strategy"]), geometry, max_step=max_step,
                           max_context=max_context, resources=resources)
    cache.load_state(state)
    return cache
