"""The KV strategy registry (inference_engine/kv/registry.py): every strategy by name, the built-ins and the
research ones it finds, their parameters, saved parameters read back, and research options checked. No model."""
import dataclasses

import pytest

from inference_engine.kv import registry
from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.strategy import KVStrategy

GEOM = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, layer_windows=(None, None))


def test_the_builtins_and_the_research_strategies_by_name():
    assert registry.names() == ("full", "sink_window", "paged", "dlm_restore")
    for name in ("full", "sink_window", "paged"):
        p = registry.plugin(name)
        assert p.params is KVStrategy and not p.research and p.exact_verify and not p.options
        assert registry.make_strategy(name, 4, 12) == KVStrategy(name, 4, 12)
    research = registry.plugin("dlm_restore")
    assert research.research and research.params is not KVStrategy and issubclass(research.params, KVStrategy)
    with pytest.raises(ValueError, match="unknown kv strategy 'h2o'; choose one of full, sink_window, paged, dlm_restore"):
        registry.plugin("h2o")


class _AnyName(KVStrategy):
    NAMES = ("full", "sink_window", "paged", "dlm_restore")


def test_a_strategy_takes_only_its_own_parameters():
    with pytest.raises(ValueError, match="sink_window has no parameter restore_pin"):
        registry.make_strategy("sink_window", 4, 12, restore_pin=4)
    with pytest.raises(ValueError, match="unknown kv strategy 'dlm_restore' for KVStrategy"):
        KVStrategy("dlm_restore")
    with pytest.raises(ValueError, match="takes its parameters as DLMRestoreStrategy"):  # not the plugin's parameters class
        registry.make_cache(_AnyName("dlm_restore", 4, 12), GEOM, max_step=8, max_context=64)


def test_saved_parameters_read_back_and_other_strategies_parameters_are_left_out():
    for st in (KVStrategy("sink_window", 4, 12), KVStrategy("paged", 4, 12, page_size=8),
               registry.make_strategy("dlm_restore", 4, 12, restore_refresh=3)):
        back = registry.strategy_from_dict(dataclasses.asdict(st))
        assert back == st and type(back) is type(st)
    # a state written before strategies had parameters of their own names every strategy's, at their defaults
    old = dataclasses.asdict(KVStrategy("sink_window", 4, 12)) | {"restore_from": "verifier", "restore_refresh": 1,
                                                                  "restore_pin": 0}
    assert registry.strategy_from_dict(old) == KVStrategy("sink_window", 4, 12)


def test_a_strategy_or_parameter_unknown_here_is_refused_not_dropped():
    saved = dataclasses.asdict(KVStrategy("paged", 4, 12, page_size=8))
    with pytest.raises(registry.StrategyUnknownHere, match="parameter.s. far_after_v2 this daemon does not have"):
        registry.strategy_from_dict(saved | {"far_after_v2": "context"})
    with pytest.raises(registry.StrategyUnknownHere, match="'paged_v9' is not one this daemon has"):
        registry.strategy_from_dict(saved | {"name": "paged_v9"})


def test_research_options_are_checked_against_the_strategy_that_takes_them():
    assert set(registry.research_options()) == {"restore_from", "restore_refresh", "restore_pin", "restore_bias"}
    assert registry.options_for("full", {}) == {}
    assert registry.options_for("dlm_restore", {"restore_pin": 3}) == {"restore_from": "verifier", "restore_refresh": 1,
                                                                      "restore_pin": 3, "restore_bias": "none"}
    assert registry.options_for("full", {"restore_bias": "none"}) == {}  # another strategy's option at its default
    with pytest.raises(ValueError, match="--research-restore-bias calibrated applies to --kv-strategy dlm_restore only"):
        registry.options_for("full", {"restore_bias": "calibrated"})
    with pytest.raises(ValueError, match="--research-restore-from must be 'verifier' or 'drafter', got 'oracle'"):
        registry.options_for("dlm_restore", {"restore_from": "oracle"})
    with pytest.raises(ValueError, match="unknown research option 'restore_depth'"):
        registry.options_for("dlm_restore", {"restore_depth": 2})


def test_describe_adds_what_the_resources_say():
    st = registry.make_strategy("dlm_restore", 4, 12, restore_from="drafter")

    class Source:
        drafter_name, logit_bias = "tiny-dlm", None

    assert registry.describe(st) == st.describe()  # no resources: the parameters alone
    assert registry.describe(st, Source()) == st.describe() | {"restore_from": "drafter:tiny-dlm", "restore_bias": "none"}
    assert registry.describe(KVStrategy("paged", 4, 12)) == KVStrategy("paged", 4, 12).describe()
