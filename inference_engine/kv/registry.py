"""The KV strategies this runtime can run, by name: the built-in ones and those research packages bring.

Each is a StrategyPlugin (plugins.py). The built-ins (full, sink_window, paged) are listed here; the
research strategies come from `kakeya_research.kv_strategies()`, looked up when first asked for. This
module is the one place of the product that imports the research package (tests/test_import_graph.py
holds every other product module to that); without the package installed the daemon runs and its
strategies are unknown names.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from inference_engine.kv.plugins import StrategyOption, StrategyPlugin
from inference_engine.kv.strategy import KVStrategy

if TYPE_CHECKING:  # the caches load torch: imported where a strategy's cache is made, not to list the strategies
    from inference_engine.kv.full import FullKVCache
    from inference_engine.kv.layout import CacheGeometry
    from inference_engine.kv.paged import PagedCache
    from inference_engine.kv.sink_window import SinkWindowCache
    from inference_engine.kv.slot_cache import SlotKVCache


def _full(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
          resources: object = None) -> FullKVCache:
    from inference_engine.kv.full import FullKVCache

    return FullKVCache(strategy, geometry)


def _sink_window(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
                 resources: object = None) -> SinkWindowCache:
    from inference_engine.kv.sink_window import SinkWindowCache

    return SinkWindowCache(strategy, geometry, max_step, max_context)


def _paged(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
           resources: object = None) -> PagedCache:
    from inference_engine.kv.paged import PagedCache

    return PagedCache(strategy, geometry, max_step, max_context)


BUILTIN = (
    StrategyPlugin("full", KVStrategy, _full, help="every position resident"),
    StrategyPlugin("sink_window", KVStrategy, _sink_window,
                   help="attention sink + sliding window resident; older positions leave attention"),
    StrategyPlugin("paged", KVStrategy, _paged,
                   help="sink_window's resident cache + every evicted position kept exactly in pages, each query "
                        "attending to its top --recall-pages pages"),
)


def _research() -> tuple[StrategyPlugin, ...]:
    try:
        import kakeya_research
    except ModuleNotFoundError as e:
        if e.name != "kakeya_research":
            raise
        return ()
    return tuple(kakeya_research.kv_strategies())


@functools.cache
def plugins() -> dict[str, StrategyPlugin]:
    """Every strategy, by name: the built-ins first, then the research ones."""
    out: dict[str, StrategyPlugin] = {}
    options: set[str] = set()
    for p in (*BUILTIN, *_research()):
        if p.name in out:
            raise RuntimeError(f"two kv strategies are named {p.name!r}")
        mine = {o.name for o in p.options}
        if mine & options:
            raise RuntimeError(f"kv strategy {p.name!r} repeats the option(s) {sorted(mine & options)} of another strategy")
        out[p.name] = p
        options |= mine
    return out


def names() -> tuple[str, ...]:
    return tuple(plugins())


def plugin(name: str) -> StrategyPlugin:
    found = plugins().get(name)
    if found is None:
        raise ValueError(f"unknown kv strategy {name!r}; choose one of {', '.join(names())}")
    return found


def make_strategy(name: str, *args: Any, **params: Any) -> KVStrategy:
    """The parameters of strategy `name` (positional args after the name as KVStrategy's: sink, window, ...);
    a parameter the strategy does not have is a ValueError that names it."""
    cls = plugin(name).params
    unknown = sorted(set(params) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"kv strategy {name} has no parameter {', '.join(unknown)}")
    return cls(name, *args, **params)


# what every strategy's saved parameters held before strategies kept parameters of their own (2f15d79): dlm_restore's
LEGACY_SHARED_KEYS = frozenset({"restore_from", "restore_refresh", "restore_pin"})


class StrategyUnknownHere(ValueError):
    """A saved strategy this daemon cannot read, though nothing is wrong with it: a strategy or a parameter it does not
    have (written by a newer daemon, or a plugin not installed here). A session saved so stays where it is."""


def strategy_from_dict(d: Mapping[str, Any]) -> KVStrategy:
    """The strategy a saved `asdict(strategy)` describes. Another strategy's parameters are left out (a state written
    before strategies kept parameters of their own names every strategy's, at their defaults); a strategy or a
    parameter no strategy here has is StrategyUnknownHere, never dropped: a newer daemon's parameter (such as
    `far_after` once was) read as absent would resume the session under another strategy than it ran."""
    name = d["name"]
    if name not in plugins():
        raise StrategyUnknownHere(f"kv strategy {name!r} is not one this daemon has (it has {', '.join(names())}): "
                                  f"saved by a newer daemon, or one with a strategy plugin not installed here")
    known = LEGACY_SHARED_KEYS.union(*({f.name for f in dataclasses.fields(p.params)} for p in plugins().values()))
    unknown = sorted(set(d) - known)
    if unknown:
        raise StrategyUnknownHere(f"kv strategy {name} was saved with parameter(s) {', '.join(unknown)} this daemon does "
                                  f"not have: saved by a newer daemon")
    fields = {f.name for f in dataclasses.fields(plugin(name).params)}
    return plugin(name).params(**{k: v for k, v in d.items() if k in fields})


def make_cache(strategy: KVStrategy, geometry: CacheGeometry, *, max_step: int, max_context: int,
               resources: object = None) -> SlotKVCache:
    p = plugin(strategy.name)
    if not isinstance(strategy, p.params):
        raise ValueError(f"kv strategy {strategy.name} takes its parameters as {p.params.__name__}, got "
                         f"{type(strategy).__name__} (registry.make_strategy makes them)")
    return p.make_cache(strategy, geometry, max_step=max_step, max_context=max_context, resources=resources)


def describe(strategy: KVStrategy, resources: object = None) -> dict[str, str]:
    """The strategy's parameters as strings, with what its resources add (GetServerInfo's kv_params)."""
    out = dict(strategy.describe())
    p = plugin(strategy.name)
    if p.describe_resources is not None:
        out |= p.describe_resources(strategy, resources)
    return out


def research_options() -> dict[str, tuple[StrategyPlugin, StrategyOption]]:
    """Every research option by name, with the strategy that takes it."""
    return {o.name: (p, o) for p in plugins().values() for o in p.options}


def options_for(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Strategy `name`'s options: its defaults, overridden by `given` (option name -> value). `given` may set
    options of other strategies only to their defaults; an unknown option or a value outside an option's
    choices is a ValueError."""
    known = research_options()
    for key, value in given.items():
        if key not in known:
            raise ValueError(f"unknown research option {key!r}; the options are {', '.join(sorted(known)) or 'none'}")
        owner, o = known[key]
        if o.choices is not None and value not in o.choices:
            raise ValueError(f"{o.flag} must be {' or '.join(map(repr, o.choices))}, got {value!r}")
        if owner.name != name and value != o.default:
            raise ValueError(f"{o.flag} {value} applies to --kv-strategy {owner.name} only")
    return {o.name: given.get(o.name, o.default) for o in plugin(name).options}
