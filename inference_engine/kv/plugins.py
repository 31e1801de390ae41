"""What a KV strategy plugs into the runtime with: a StrategyPlugin (registry.py lists them).

Every strategy, built-in or brought by a research package, is one of these: the dataclass of its
parameters (KVStrategy or a subclass: frozen, saved with each session), the cache it builds (the
protocol of slot_cache.py), and optionally the options it takes beyond the product's, the objects
every cache of an engine shares (`resources`, built once by `build_resources`) and what it adds to
the strategy's report. No torch here: the CLI reads these to list strategies and options.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference_engine.kv.strategy import KVStrategy


@dataclass(frozen=True)
class StrategyOption:
    """An option of a research strategy beyond the product's: `kakeya serve --research-<name>`, given to
    the daemon as ServeConfig.research[name]. An option named after a field of the strategy's parameters
    sets that field; the others reach the plugin's `build_resources`."""

    name: str
    default: Any
    help: str
    type: Callable[[str], Any] = str
    choices: tuple | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--research-" + self.name.replace("_", "-")


@dataclass(frozen=True)
class StrategyPlugin:
    name: str
    params: type[KVStrategy]  # the strategy's parameters: KVStrategy, or a subclass with fields of its own
    # (strategy, geometry, *, max_step, max_context, resources) -> a SlotKVCache; imports its cache when called
    make_cache: Callable[..., Any]
    help: str = ""  # one line for `kakeya serve --help`
    research: bool = False  # not product surface: its options are --research-* flags, it may change or go away
    options: tuple[StrategyOption, ...] = ()
    # (strategy, options, *, model, drafter, drafter_name, device) -> what every cache of one engine shares
    # (e.g. a model it reads from), or None; raises ValueError naming the option that does not fit
    build_resources: Callable[..., Any] | None = None
    # (strategy, resources) -> parameters of the resources for the strategy's report (str -> str)
    describe_resources: Callable[[Any, Any], dict] | None = None
    # Verify steps attend row by row as decode steps do (bit-equal to them); False: a step may attend
    # batched (e.g. over extra keys), so speculation is exact only where the kernels are (fp32 weights).
    exact_verify: bool = True
