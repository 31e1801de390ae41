"""dlm_restore as a strategy the runtime's registry finds (inference_engine/kv/registry.py): its parameters,
its cache, its --research-* options and its proposer. Imports no torch until a cache or a proposer is made."""
from __future__ import annotations

from inference_engine.kv.plugins import StrategyOption, StrategyPlugin
from kakeya_research.dlm_restore.strategy import RESTORE_FROM, DLMRestoreStrategy

OPTIONS = (
    StrategyOption("restore_from", "verifier", choices=RESTORE_FROM,
                   help="the proposer: verifier = the model itself, cache-free (reproduces full); drafter = the --drafter "
                        "checkpoint and its learned f_θ (cross-model)"),
    StrategyOption("restore_refresh", 1, type=int, metavar="N",
                   help="reuse restored K/V for up to N steps (1 = restore every step; N > 1 holds all layers' restored K/V "
                        "between steps, counted in kv_live_bytes)"),
    StrategyOption("restore_pin", 0, type=int, metavar="P",
                   help="with --research-restore-from drafter: keep the P evicted positions the proposer restores worst "
                        "resident (measured as they leave the window); resident = sink + window + P rows"),
    StrategyOption("restore_bias", "none", choices=("none", "calibrated"),
                   help="with --research-restore-from drafter: add the drafter's shipped attention-mass calibration (a logit "
                        "offset per layer and head) to the restored positions' attention logits"),
)


def make_cache(strategy: DLMRestoreStrategy, geometry, *, max_step: int, max_context: int, resources=None):
    """resources: the RestoreSource of the cross-model proposer (None: the verifier itself)."""
    from kakeya_research.dlm_restore.cache import DLMRestoreCache

    return DLMRestoreCache(strategy, geometry, max_step, max_context, restore_source=resources)


def build_resources(strategy: DLMRestoreStrategy, options: dict, *, model, drafter, drafter_name: str | None, device: str):
    """The cross-model proposer (`restore_from` drafter): the drafter the daemon loaded plus the f_θ shipped
    with it (and its attention-mass calibration with restore_bias calibrated); None for same-model."""
    calibrated = options.get("restore_bias", "none") == "calibrated"
    if strategy.restore_from != "drafter":
        if calibrated:
            raise ValueError("--research-restore-bias calibrated applies to --kv-strategy dlm_restore --research-restore-from "
                             "drafter only (same-model restoration is exact: there is nothing to calibrate)")
        return None
    if drafter is None or not drafter_name:
        raise ValueError("--research-restore-from drafter needs --drafter NAME (a drafter checkpoint that ships its f_θ)")
    from kv_cache_proposer.restore import drafter_restore_source_for

    try:
        return drafter_restore_source_for(drafter_name, model, drafter, calibrated=calibrated, device=device)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from e


def describe_resources(strategy: DLMRestoreStrategy, source) -> dict:
    """Which drafter a cross-model proposer is, and whether its calibration is applied."""
    if source is None:
        return {}
    out = {"restore_bias": "calibrated" if getattr(source, "logit_bias", None) is not None else "none"}
    name = getattr(source, "drafter_name", "")
    if name:
        out["restore_from"] = f"{strategy.restore_from}:{name}"
    return out


PLUGIN = StrategyPlugin(
    "dlm_restore", DLMRestoreStrategy, make_cache, research=True, options=OPTIONS,
    help="(research) sink_window's resident cache + every evicted position restored each step",
    build_resources=build_resources, describe_resources=describe_resources,
    # Verify steps over restored columns attend batched, not row by row: exact only with row-independent
    # numerics (fp32 weights), not bf16-activation kernels, whose last-bit differences flip tokens.
    exact_verify=False,
)
