"""dlm_restore (ADR 0008 §11.5): sink_window's resident cache, every evicted position's K/V restored for
each step by a proposer (the verifier itself, or the dLM drafter + its learned f_θ).

    strategy.py  DLMRestoreStrategy: the parameters (restore_from, restore_refresh, restore_pin)
    plugin.py    PLUGIN: what the runtime's registry finds (cache, --research-* options, proposer)
    cache.py     DLMRestoreCache: sink_window's slots + the token history; its layout's extra keys are a RestorePlan
    seam.py      RestoreSource / RestoreStep (proposer -> verifier), RestorePlan, HeldRestore
    policies.py  which evicted positions are restored when: every step / pin the worst P / hold for N steps

The proposers are kv_cache_proposer's: same_model.py (VerifierRestoreSource) and restore.py
(DrafterRestoreSource, f_θ).
"""
