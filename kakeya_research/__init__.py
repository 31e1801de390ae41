"""Research code that plugs into the runtime through its seams; none of it is product surface.

The runtime finds the research KV strategies through `kv_strategies()` (inference_engine/kv/registry.py is
the one product module that imports this package; tests/test_import_graph.py checks it). Each strategy is a
StrategyPlugin (inference_engine/kv/plugins.py); its cache speaks the cache protocol
(inference_engine/kv/slot_cache.py) and may hand attention extra keys through its layout
(inference_engine/kv/layout.py: ExtraKeySource).

    dlm_restore/  evicted positions restored each step by a proposer (ADR 0008 §11.5)
"""
from __future__ import annotations


def kv_strategies() -> tuple:
    """The research strategies' StrategyPlugins (imports no torch)."""
    from kakeya_research.dlm_restore.plugin import PLUGIN

    return (PLUGIN,)
