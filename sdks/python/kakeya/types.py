"""Plain result objects the SDK returns (no protobuf types leak to callers)."""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from kakeya.errors import SessionNotSavedWarning
from kakeya_wire.v1 import runtime_pb2 as pb

STOP_REASONS = {
    pb.STOP_REASON_MAX_TOKENS: "max_tokens",
    pb.STOP_REASON_EOS: "eos",
    pb.STOP_REASON_CANCELLED: "cancelled",
    pb.STOP_REASON_CONTEXT_FULL: "context_full",
    pb.STOP_REASON_UNSPECIFIED: "unspecified",
}


def _from_pb(cls, r, **special):
    """A `cls` (a dataclass) from the message `r`: each field read from the message field of the
    same name (repeated -> tuple, map -> dict by key), except those in `special`, name -> value."""
    return cls(**{f.name: special[f.name] if f.name in special else _plain(getattr(r, f.name)) for f in fields(cls)})


def _plain(v):
    if isinstance(v, Mapping):
        return dict(sorted(v.items()))
    if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        return tuple(v)
    return v


@dataclass(frozen=True)
class GenerationResult:
    stop_reason: str
    generated_tokens: int
    prefill_tokens: int
    prefill_seconds: float
    total_seconds: float
    time_to_first_token_seconds: float
    drafted_tokens: int
    accepted_tokens: int
    tokens: tuple = ()
    history_truncated: tuple = ()  # (dropped_tokens, total_dropped_tokens) per event
    # History tokens on disk once this turn was saved (the daemon saves it before Done): what the
    # session resumes with after a crash; 0 when the daemon does not persist sessions.
    durable_length: int = 0
    save_error: str = ""  # why the save failed (e.g. "No space left on device"); "" when it did not
    # positions the daemon ran through the model again before this turn (not in prefill_tokens): a `paged` session
    # re-encoded as it passed the model's trained context; 0 otherwise (and from daemons before the field)
    reencoded_tokens: int = 0

    @classmethod
    def from_pb(cls, done, tokens, truncated) -> "GenerationResult":
        return cls(
            stop_reason=STOP_REASONS.get(done.stop_reason, "unspecified"),
            generated_tokens=done.generated_tokens,
            prefill_tokens=done.prefill_tokens,
            prefill_seconds=done.prefill_seconds,
            total_seconds=done.total_seconds,
            time_to_first_token_seconds=done.time_to_first_token_seconds,
            drafted_tokens=done.drafted_tokens,
            accepted_tokens=done.accepted_tokens,
            tokens=tuple(tokens),
            history_truncated=tuple(truncated),
            durable_length=done.durable_length,
            save_error=done.save_error,
            reencoded_tokens=getattr(done, "reencoded_tokens", 0),  # a kakeya-wire built before the field: 0
        )


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    history_length: int
    resident_positions: int
    pending_tokens: int
    kv_live_bytes: int
    idle_seconds: float
    dropped_tokens: int
    eos_token_ids: tuple = field(default=())
    # KV bytes by tier (kv_live_bytes = resident + selection). Resident: the hot set (sink, window,
    # recalled pages), flat in the history length for bounded strategies. Selection: what queries
    # score to choose pages (paged: compact keys). Stored (warm): exact K/V of evicted positions kept
    # outside the hot set in host RAM (paged: the page store, at most the daemon's --page-ram-mb a
    # session). Cold: the rest of them, on disk (paged: pages past --page-ram-mb, in a memory-mapped
    # spill file). Strategies without pages report selection = stored = cold = 0.
    kv_resident_bytes: int = 0
    kv_selection_bytes: int = 0
    kv_stored_bytes: int = 0
    # History tokens on disk: what the session resumes with after a crash or restart (only saved
    # turns are durable); 0 when the daemon does not persist sessions. save_error: why its saves
    # fail ("" while they do not).
    durable_length: int = 0
    save_error: str = ""
    kv_cold_bytes: int = 0

    @classmethod
    def from_pb(cls, r) -> "SessionInfo":
        return _from_pb(cls, r)


@dataclass(frozen=True)
class PersistenceInfo:
    # "turn": sessions saved after every turn and resumed after a restart; "off": memory only;
    # "" from a server too old to report it.
    mode: str = ""
    state_dir: str = ""  # where they are saved ("" when off)
    # Several daemons share the state directory (replicas behind a proxy): this one's name in the
    # sessions' leases, and the seconds after which a silent daemon's sessions are taken over.
    shared: bool = False
    daemon_id: str = ""
    lease_ttl_seconds: float = 0.0

    @classmethod
    def from_pb(cls, r) -> "PersistenceInfo":
        return _from_pb(cls, r)


@dataclass(frozen=True)
class ServerInfo:
    model_id: str
    vocab_size: int
    default_eos_token_ids: tuple
    kv_strategy: str  # "full", "sink_window" or "dlm_restore"
    max_context: int
    backend: str
    device: str
    server_version: str
    session_capacity: int
    idle_ttl_seconds: float
    drafter: str
    spec_k: int
    # The strategy's parameters as the server reports them (strings): "compressor" always,
    # "sink" / "window" for bounded strategies, research keys for research strategies.
    kv_params: Mapping[str, str] = field(default_factory=dict)
    persistence: PersistenceInfo = field(default_factory=PersistenceInfo)
    # Most tokens one append (or create_session's initial tokens) may carry, and most a session may
    # hold appended but not yet prefilled (generate prefills them); 0 = no limit.
    max_append_tokens: int = 0
    max_pending_tokens: int = 0

    @property
    def sink(self) -> int:
        """Attention-sink positions of a bounded strategy (0 under `full`)."""
        return int(self.kv_params.get("sink", 0))

    @property
    def window(self) -> int:
        """Sliding-window positions of a bounded strategy (0 under `full`)."""
        return int(self.kv_params.get("window", 0))

    @property
    def compressor(self) -> str:
        """The resident cache store ("identity" = uncompressed)."""
        return self.kv_params.get("compressor", "identity")

    @classmethod
    def from_pb(cls, r) -> "ServerInfo":
        k = r.kv_strategy
        return _from_pb(cls, r, kv_strategy=k.name, kv_params=_plain(k.params), persistence=PersistenceInfo.from_pb(r.persistence))


class GenerateStream:
    """Folds Generate response events into token ids and, at the end, a GenerationResult."""

    def __init__(self):
        self.tokens, self.truncated, self.result = [], [], None

    def token(self, ev):
        """The token id an event carries, or None (truncation / done events are recorded)."""
        kind = ev.WhichOneof("event")
        if kind == "token":
            self.tokens.append(ev.token.token_id)
            return ev.token.token_id
        if kind == "history_truncated":
            self.truncated.append((ev.history_truncated.dropped_tokens, ev.history_truncated.total_dropped_tokens))
        elif kind == "done":
            self.result = GenerationResult.from_pb(ev.done, self.tokens, self.truncated)
        return None


def note_durability(session, durable_length: int, save_error: str, history_length: int | None = None) -> None:
    """Record on a session handle what the daemon reported durable; warn (SessionNotSavedWarning)
    when its saves start failing."""
    if save_error and not session.save_error:
        warnings.warn(SessionNotSavedWarning(session.id, durable_length, history_length, save_error), stacklevel=4)
    session.durable_length, session.save_error = durable_length, save_error

