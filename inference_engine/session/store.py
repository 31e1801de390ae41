"""SessionStore: server-issued sessions over raw, append-only token histories.

Pure Python (no torch, mlx or grpc). A session owns an opaque engine-side KV handle and
looks at it only through `nbytes`, `resident_positions`, `next_position` and
`dropped_total`. The store enforces: unguessable ids, vocabulary-checked appends, capacity
with LRU eviction, idle-TTL eviction, one Generate per session at a time, and failing (and
freeing) a session whose cache broke an invariant. A closed, evicted or failed session is
gone: later calls get SessionNotFound, never a silent new session.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from inference_engine.errors import CacheInvariantError, ContextExhausted, InvalidArgument, SessionNotFound


SHOWN_ID_CHARS = 64


def _shown(session_id: str) -> str:
    """A caller's session id as error messages quote it: bounded, because the message travels in a
    gRPC trailer (8 KiB soft limit, non-ASCII percent-encoded) and an unbounded echo of a huge id
    turned NOT_FOUND into the client's RESOURCE_EXHAUSTED 'metadata size exceeds soft limit'."""
    if len(session_id) <= SHOWN_ID_CHARS:
        return repr(session_id)
    return f"{session_id[:SHOWN_ID_CHARS]!r}... ({len(session_id)} characters)"


@dataclass
class StoreEvents:
    """Hooks the server wires to metrics; all optional."""

    on_created: Callable[[], None] = lambda: None
    on_ended: Callable[[str], None] = lambda outcome: None  # closed | evicted | failed
    on_evicted: Callable[[str], None] = lambda reason: None  # ttl | lru | close
    on_violation: Callable[[str], None] = lambda kind: None  # inv1 | inv2


@dataclass
class Session:
    id: str
    kv: object  # engine-side handle
    eos_token_ids: frozenset
    history: list = field(default_factory=list)
    created_at: float = 0.0
    last_access: float = 0.0
    inv1_violations: int = 0
    inv2_violations: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    closed: bool = False

    @property
    def pending_tokens(self) -> list:
        """History not yet run through the model (the next Generate prefills it)."""
        return self.history[self.kv.next_position :]

    def record_generated(self, token_id: int) -> None:
        self.history.append(token_id)


class SessionStore:
    def __init__(
        self,
        *,
        vocab_size: int,
        kv_factory: Callable[[], object],
        capacity: int = 16,
        idle_ttl_s: float = 1800.0,
        history_limit: int | None = None,
        default_eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        events: StoreEvents | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.vocab_size = vocab_size
        self.kv_factory = kv_factory
        self.capacity = capacity
        self.idle_ttl_s = idle_ttl_s
        self.history_limit = history_limit
        self.default_eos_token_ids = frozenset(default_eos_token_ids)
        self.clock = clock
        self.events = events or StoreEvents()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order: oldest first
        self._lock = threading.RLock()

    # -- validation -------------------------------------------------------------------
    def _check_tokens(self, ids: Sequence[int], what: str) -> list:
        ids = list(ids)
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
        if bad:
            i, t = bad[0]
            raise InvalidArgument(
                f"{what}[{i}] = {t} is outside the model vocabulary [0, {self.vocab_size}); "
                f"{len(bad)} invalid id(s); nothing was appended"
            )
        return ids

    def _check_length(self, session_len: int, extra: int) -> None:
        if self.history_limit is not None and session_len + extra > self.history_limit:
            raise ContextExhausted(
                f"history would reach {session_len + extra} tokens, past the model's context of {self.history_limit} "
                f"under the 'full' KV strategy; nothing was appended. Start a new session, or serve with "
                f"--kv-strategy sink_window for unbounded sessions"
            )

    # -- lifecycle --------------------------------------------------------------------
    def create(self, initial_tokens: Sequence[int] = (), eos_token_ids: Iterable[int] | None = None) -> Session:
        initial = self._check_tokens(initial_tokens, "initial_tokens")
        self._check_length(0, len(initial))
        eos = frozenset(eos_token_ids) if eos_token_ids is not None else self.default_eos_token_ids
        self._check_tokens(sorted(eos), "eos_token_ids")
        with self._lock:
            self.evict_idle()
            while len(self._sessions) >= self.capacity:
                self._evict_lru()
            now = self.clock()
            session = Session(
                id=secrets.token_urlsafe(24),  # 192 random bits
                kv=self.kv_factory(),
                eos_token_ids=eos,
                history=initial,
                created_at=now,
                last_access=now,
            )
            self._sessions[session.id] = session
        self.events.on_created()
        return session

    def get(self, session_id: str, *, touch: bool = True) -> Session:
        """Look a session up; `touch` marks it used (LRU order and idle clock)."""
        with self._lock:
            self.evict_idle()
            s = self._sessions.get(session_id)
            if s is None:
                raise SessionNotFound(f"session {_shown(session_id)} does not exist (never created, closed, evicted or failed); create a new session")
            if touch:
                s.last_access = self.clock()
                self._sessions.move_to_end(session_id)
            return s

    def append(self, session_id: str, token_ids: Sequence[int]) -> Session:
        if len(token_ids) == 0:
            raise InvalidArgument("token_ids is empty; append at least one token")
        ids = self._check_tokens(token_ids, "token_ids")
        s = self.get(session_id)
        with s.lock:  # appends wait for an in-flight Generate, keeping history append-only
            self._ensure_live(s)
            self._check_length(len(s.history), len(ids))
            s.history.extend(ids)
            s.last_access = self.clock()
        return s

    def history(self, session_id: str, start: int = 0) -> list:
        """Token ids from `start`; waits for an in-flight Generate so the answer is settled."""
        s = self.get(session_id)
        with s.lock:
            self._ensure_live(s)
            if start < 0 or start > len(s.history):
                raise InvalidArgument(f"start must be in [0, {len(s.history)}] (the history length), got {start}")
            return s.history[start:]

    def close(self, session_id: str) -> None:
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            raise SessionNotFound(f"session {_shown(session_id)} does not exist (already closed or evicted)")
        s.closed = True
        self.events.on_evicted("close")
        self.events.on_ended("closed")

    @contextmanager
    def generation(self, session_id: str):
        """Hold the session for one Generate: waits for a prior one on the same session.

        A CacheInvariantError escaping the block fails the session: it is counted, removed
        and re-raised (FAILED_PRECONDITION to the client).
        """
        s = self.get(session_id)
        with s.lock:
            self._ensure_live(s)
            try:
                yield s
            except CacheInvariantError as e:
                self.fail(s, e.kind)
                raise
            finally:
                s.last_access = self.clock()

    def fail(self, s: Session, kind: str) -> None:
        if kind == "inv1":
            s.inv1_violations += 1
        else:
            s.inv2_violations += 1
        self.events.on_violation(kind)
        with self._lock:
            removed = self._sessions.pop(s.id, None)
        s.closed = True
        s.kv = None
        if removed is not None:
            self.events.on_ended("failed")

    def _ensure_live(self, s: Session) -> None:
        if s.closed:
            raise SessionNotFound(f"session {_shown(s.id)} was closed or evicted while this call waited")

    # -- eviction ---------------------------------------------------------------------
    def _remove(self, session_id: str, reason: str) -> None:
        s = self._sessions.pop(session_id)
        s.closed = True
        self.events.on_evicted(reason)
        self.events.on_ended("evicted")

    def _evict_lru(self) -> None:
        # Oldest idle session first; a session inside a Generate is never evicted.
        for sid, s in self._sessions.items():
            if not s.lock.locked():
                self._remove(sid, "lru")
                return
        from inference_engine.errors import CapacityExhausted

        raise CapacityExhausted(f"all {self.capacity} sessions are generating; retry later or raise --capacity")

    def evict_idle(self) -> int:
        if self.idle_ttl_s <= 0:
            return 0
        now = self.clock()
        with self._lock:
            expired = [sid for sid, s in self._sessions.items() if now - s.last_access > self.idle_ttl_s and not s.lock.locked()]
            for sid in expired:
                self._remove(sid, "ttl")
        return len(expired)

    # -- introspection ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list:
        with self._lock:
            return list(self._sessions.values())

    def kv_live_bytes(self) -> int:
        return sum(s.kv.nbytes for s in self.sessions() if s.kv is not None)
