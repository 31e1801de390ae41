"""KVBytes: a session cache's bytes by tier, for any strategy, without importing torch.

    resident   the hot set: sink + window K/V (and whatever a strategy holds between steps to
               attend, e.g. the K/V a research strategy keeps for its extra keys); flat in the
               history length for the bounded strategies
    selection  what queries score to choose pages (paged: compact keys); grows with the pages
    stored     warm: exact K/V of evicted positions kept outside the hot set in host RAM (paged: the
               page store's pages in memory, at most `page_ram_mb` MB a session)
    cold       on disk: the rest of those exact K/V (paged: the page store's pages past its RAM
               budget, read back from a memory-mapped spill file); 0 without a disk tier

A cache reports the tiers through `resident_nbytes` / `selection_nbytes` / `stored_nbytes` /
`cold_nbytes` (each but the first optional, 0 when absent); one that has only `nbytes` keeps
everything resident (selection, stored and cold 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVBytes:
    resident: int = 0
    selection: int = 0
    stored: int = 0
    cold: int = 0

    def __add__(self, other: "KVBytes") -> "KVBytes":
        return KVBytes(self.resident + other.resident, self.selection + other.selection, self.stored + other.stored,
                       self.cold + other.cold)


def kv_bytes(kv: object) -> KVBytes:
    """The tiers of a session's KV (a SessionKV, whose `.cache` is the strategy's cache, or a cache); a SessionKV being
    re-encoded (its `reencoding`, the new state being filled) holds that state's bytes as well."""
    if kv is None:
        return KVBytes()
    cache: Any = getattr(kv, "cache", kv)  # its tiers are read by duck typing: any cache (torch, MLX, research)
    extra = kv_bytes(getattr(kv, "reencoding", None))
    resident = getattr(cache, "resident_nbytes", None)
    if resident is None:
        return KVBytes(int(cache.nbytes)) + extra
    return KVBytes(int(resident), int(getattr(cache, "selection_nbytes", 0)), int(getattr(cache, "stored_nbytes", 0)),
                   int(getattr(cache, "cold_nbytes", 0))) + extra
