"""KVStrategy: which positions a query may attend to and how the resident cache stores them.

A frozen, framework-free description; `make_cache` (factory.py) turns it into a cache. It holds the
parameters of the built-in strategies; a strategy with parameters of its own (a research one, registry.py)
subclasses it with those fields and its own NAMES."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from inference_engine.kv.compressor_names import COMPRESSOR_NAMES, MAX_Q_RANGE

KV_DTYPES = ("fp32", "fp16", "int8")  # resident K/V rows (KVStrategy.kv_dtype)
PAGE_COMPRESSORS = ("identity", "int8", "kakeya_d4", "kakeya_e8")  # paged: how stored (evicted) pages are kept
FAR_LAYOUTS = ("packed", "spread")  # paged, from far_from on: where the recalled pages and the sink sit
FAR_AFTER = ("start", "context")  # paged: far_from applies from a session's start, or once it passes the trained context
PAGE_KEY_BITS = (4, 8)  # paged: bits per element of the compact keys pages are scored by


@dataclass(frozen=True)
class KVStrategy:
    """`sink`/`window` apply to the bounded strategies; `compressor`/`q_range` to every strategy
    (identity = uncompressed slabs); `page_*` / `recall_pages` to paged."""

    NAMES: ClassVar[tuple[str, ...]] = ("full", "sink_window", "paged")  # the strategies these fields describe

    name: str = "full"
    sink: int = 4
    window: int = 1020
    compressor: str = "identity"
    q_range: int = 38
    # resident rows: fp32 (the model's dtype), fp16 (half the bytes; attention computes in fp32 on the stored values;
    # paged: its page store holds the same fp16 rows) or int8 (+ a scale per position, read without decoding)
    kv_dtype: str = "fp32"
    page_size: int = 64
    recall_pages: int = 8
    page_compressor: str = "identity"
    page_key_bits: int = 4
    # paged: past `shortlist_from` candidate pages, a query ranks them by their key bounds and scores the keys of
    # its best max(shortlist_pages, recall_pages) only (0 = always score every candidate key)
    shortlist_pages: int = 64
    shortlist_from: int = 256
    # paged: host RAM for the page store, per session, in MB (2^20 bytes): the newest pages that fit stay in RAM, older
    # ones move to a memory-mapped spill file (paged_store.SpillingRowTable); 0 = every page in RAM
    page_ram_mb: float = 128
    # paged: positions from which a query attends in InfLLM's layout (its chosen pages and the sink moved next to its
    # window, every distance under sink + window + recall_pages * page_size); 0 = the model's trained context. Below
    # it a query attends at true positions. A smaller value keeps the layout the model reads well for more of the
    # history (docs/paged.md, "Where the InfLLM layout starts")
    far_from: int = 0
    # paged, from far_from on: where the chosen pages and the sink sit. "packed": next to the window, in position order
    # (InfLLM's layout); "spread": in position order with the gaps between them (and to the sink and the window) scaled
    # down together, so the whole history seen from the query spans far_from positions (order and relative spacing kept)
    far_layout: str = "packed"
    # paged with far_from: "start" = from a session's first position on; "context" = a session runs as far_from 0 (the
    # trained context) until an append or a step would take it past the trained context, and from then on as one that
    # ran far_from from its start (the positions it holds at or past far_from are written again first: the engine
    # re-encodes the session once, docs/paged.md "far_from once past the context")
    far_after: str = "start"
    # paged, at positions from the trained context on: a query at p chooses its pages itself only at every
    # `choice_every`-th position from the context (p - context divisible by it); the others attend to the pages the
    # last of those chose (at most choice_every - 1 positions earlier), each with its own window and its own view
    # of them. A function of the position, so chunks, verify blocks and one-token steps still agree bit for bit;
    # 1 = every query chooses (the default). Below the trained context every query chooses, whatever it is.
    choice_every: int = 1

    def __post_init__(self) -> None:
        if self.name not in self.NAMES:
            raise ValueError(f"unknown kv strategy {self.name!r} for {type(self).__name__}; choose one of {', '.join(self.NAMES)} "
                             "(registry.make_strategy makes any registered strategy)")
        if self.bounded and (self.sink < 0 or self.window < 1):
            raise ValueError(f"{self.name} needs sink >= 0 and window >= 1, got sink={self.sink} window={self.window}")
        if self.compressor not in COMPRESSOR_NAMES:
            raise ValueError(f"unknown kv compressor {self.compressor!r}; choose one of {', '.join(COMPRESSOR_NAMES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        if self.kv_dtype != "fp32" and (self.name not in ("full", "sink_window", "paged") or self.compressor != "identity"):
            raise ValueError(f"kv dtype {self.kv_dtype} is a resident store for the full, sink_window and paged strategies "
                             f"without a compressor; got strategy {self.name!r} with compressor {self.compressor!r}")
        if self.name == "paged" and self.kv_dtype != "fp32" and (self.kv_dtype != "fp16" or self.page_compressor != "identity"):
            raise ValueError(f"kv dtype {self.kv_dtype} on paged: paged takes fp16 with page compressor identity only (its "
                             f"pages then hold the fp16 rows exactly); got page compressor {self.page_compressor!r}")
        if not isinstance(self.q_range, int) or not 1 <= self.q_range <= MAX_Q_RANGE:
            raise ValueError(f"kv q_range must be an int in [1, {MAX_Q_RANGE}], got {self.q_range!r} (38 is the default)")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1 (tokens per page; 64 is the default), got {self.page_size!r}")
        if not isinstance(self.recall_pages, int) or self.recall_pages < 0:
            raise ValueError(f"recall_pages must be an int >= 0 (pages each query attends besides sink and window), "
                             f"got {self.recall_pages!r}")
        if self.page_compressor not in PAGE_COMPRESSORS:
            raise ValueError(f"unknown page compressor {self.page_compressor!r}; choose one of {', '.join(PAGE_COMPRESSORS)}")
        if self.page_key_bits not in PAGE_KEY_BITS:
            raise ValueError(f"page_key_bits must be one of {PAGE_KEY_BITS}, got {self.page_key_bits!r}")
        for name in ("shortlist_pages", "shortlist_from"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0 (shortlist_pages 0: score every candidate key), "
                                 f"got {getattr(self, name)!r}")

        reach = self.sink + self.window + self.recall_pages * self.page_size
        if isinstance(self.far_from, bool) or not isinstance(self.far_from, int) or not (self.far_from == 0 or self.far_from >= reach):
            raise ValueError(f"far_from must be 0 (the trained context) or a position >= sink + window + recall_pages * "
                             f"page_size = {reach} (the distances the layout reaches), got {self.far_from!r}")
        if self.far_from and self.name != "paged":
            raise ValueError(f"far_from applies to the paged strategy only, not {self.name!r}")
        if self.far_layout not in FAR_LAYOUTS:
            raise ValueError(f"unknown far layout {self.far_layout!r}; choose one of {', '.join(FAR_LAYOUTS)}")
        if self.far_after not in FAR_AFTER:
            raise ValueError(f"unknown far_after {self.far_after!r}; choose one of {', '.join(FAR_AFTER)}")
        if self.far_after != "start" and not self.far_from:
            raise ValueError(f"far_after {self.far_after!r} (--page-far-after) needs a far_from (--page-far-from, a position "
                             f"under the trained context): without one the layout starts at the trained context anyway")
        if self.far_layout != "packed" and self.name != "paged":
            raise ValueError(f"far_layout applies to the paged strategy only, not {self.name!r}")
        if isinstance(self.choice_every, bool) or not isinstance(self.choice_every, int) or self.choice_every < 1:
            raise ValueError(f"choice_every must be an int >= 1 (1: every query chooses its pages), got {self.choice_every!r}")
        if self.choice_every != 1 and self.name != "paged":
            raise ValueError(f"choice_every applies to the paged strategy only, not {self.name!r}")
        if isinstance(self.page_ram_mb, bool) or not isinstance(self.page_ram_mb, (int, float)) or not 0 <= self.page_ram_mb < 2 ** 40:
            raise ValueError(f"page_ram_mb must be a number >= 0 (MB of host RAM for a session's pages; 0: all in RAM), "
                             f"got {self.page_ram_mb!r}")

    def describe(self) -> dict:
        """Parameters that shape this strategy, as strings (GetServerInfo reports them as a map)."""
        out = {"compressor": self.compressor}
        if self.kv_dtype != "fp32":
            out["kv_dtype"] = self.kv_dtype
        if self.compressor != "identity":
            out["q_range"] = str(self.q_range)
        if self.bounded:
            out |= {"sink": str(self.sink), "window": str(self.window)}
        if self.name == "paged":
            out |= {"page_size": str(self.page_size), "recall_pages": str(self.recall_pages),
                    "page_compressor": self.page_compressor, "page_key_bits": str(self.page_key_bits)}
            out |= {"shortlist_pages": str(self.shortlist_pages), "shortlist_from": str(self.shortlist_from),
                    "page_ram_mb": f"{self.page_ram_mb:g}"}
            out["far_from"] = str(self.far_from) if self.far_from else "trained context"
            out["far_layout"] = self.far_layout
            if self.far_from:
                out["far_after"] = self.far_after
            if self.choice_every != 1:
                out["choice_every"] = str(self.choice_every)
        return out

    @property
    def bounded(self) -> bool:
        """Resident memory stays bounded whatever the history length."""
        return self.name != "full"

    @property
    def forgets(self) -> bool:
        """Positions leave attention for good (sink_window; paged recalls them)."""
        return self.name == "sink_window"

    @property
    def unbounded(self) -> bool:
        """Serves histories of any length: sink_window (sink re-anchored past the trained context) and paged
        (InfLLM's layout past it); `full` attends at true positions and stops there."""
        return self.name in ("sink_window", "paged")
