"""DLMRestoreStrategy: dlm_restore's parameters (sink_window's, plus its research policies). No torch here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from inference_engine.kv.strategy import KVStrategy

# "verifier": same-model (the verifier itself, kv_cache_proposer/same_model.py, f_θ = identity);
# "drafter": cross-model, the shipped dLM drafter + its learned f_θ (kv_cache_proposer/restore.py).
RESTORE_FROM = ("verifier", "drafter")


@dataclass(frozen=True)
class DLMRestoreStrategy(KVStrategy):
    """`restore_from` the proposer, `restore_refresh` N reuses restored K/V for up to N steps,
    `restore_pin` P keeps the P evicted positions the proposer restores worst resident."""

    NAMES: ClassVar[tuple[str, ...]] = ("dlm_restore",)

    name: str = "dlm_restore"
    restore_from: str = "verifier"
    restore_refresh: int = 1
    restore_pin: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.restore_from not in RESTORE_FROM:
            raise ValueError(
                f"restore_from {self.restore_from!r} is not available; choose one of {', '.join(RESTORE_FROM)} "
                "(verifier = same-model, drafter = cross-model with --drafter NAME)"
            )
        if not isinstance(self.restore_refresh, int) or self.restore_refresh < 1:
            raise ValueError(f"restore_refresh must be an int >= 1 (1 = restore every step), got {self.restore_refresh!r}")
        if not isinstance(self.restore_pin, int) or self.restore_pin < 0:
            raise ValueError(f"restore_pin must be an int >= 0 (0 = no pinned positions), got {self.restore_pin!r}")
        if self.restore_pin and self.restore_from != "drafter":
            raise ValueError("restore_pin keeps the positions a learned proposer restores worst; it needs "
                             "kv_strategy dlm_restore with restore_from drafter (same-model restoration is exact)")
        if self.restore_pin and self.restore_refresh != 1:
            raise ValueError("restore_pin and restore_refresh > 1 cannot be combined (a held set cannot follow the pins)")

    def describe(self) -> dict:
        return super().describe() | {"restore_from": self.restore_from, "restore_refresh": str(self.restore_refresh),
                                     "restore_pin": str(self.restore_pin)}
