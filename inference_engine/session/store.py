"""SessionStore: server-issued sessions over raw, append-only token histories.

Pure Python (no torch, mlx or grpc). A session owns an opaque engine-side KV handle and
looks at it only through `nbytes`, `resident_positions`, `next_position` and
`dropped_total`. The store enforces: unguessable ids, vocabulary-checked appends, capacity
(admission: spill the least recently used idle session, or refuse when sessions are not
persisted), idle-TTL eviction, one Generate per session at a time, and failing (and
freeing) a session whose cache broke an invariant. A closed or failed session is gone: later
calls get SessionNotFound, never a silent new session.

With a `SessionPersister` (engine-side, e.g. inference_engine/persistence) sessions outlive the
process: `persist(s)` saves what changed, eviction spills to disk instead of dropping, the first
call naming a session that is only on disk loads it, and `close` deletes its files. Without one,
a full store refuses new sessions (RESOURCE_EXHAUSTED) rather than drop one in use, and only
the idle TTL removes sessions (gone like a closed one). A session records how much of it is on
disk (`durable_length`) and why its saves fail (`save_error`); one that cannot be saved is never
evicted (that would roll it back), and failed saves are retried with backoff and logged sparingly.
"""
from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from inference_engine.errors import (CacheInvariantError, ContextExhausted, InvalidArgument, LeaseLost, SessionExists,
                                     SessionNotFound, SessionStateUnusable, TooManyPendingTokens)

log = logging.getLogger(__name__)


SHOWN_ID_CHARS = 64
# What a session id may be: what the server issues (token_urlsafe(24): 32 characters) and what a client may
# choose (CreateSessionRequest.session_id); it names a directory in the state dir, so nothing else is allowed.
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,128}")


def issue_session_id() -> str:
    """A server-issued id: token_urlsafe(24) (192 random bits, 32 characters), never starting with "-", which
    a command line (`kakeya sessions rm ID`) would read as an option."""
    while True:
        sid = secrets.token_urlsafe(24)
        if not sid.startswith("-"):
            return sid


# A session whose save failed is not tried again by the flusher or by eviction for 1 s, then 2, 4, ...
# up to a minute (a turn's end still tries at once); failures are logged at most once a minute.
SAVE_RETRY_FIRST_S = 1.0
SAVE_RETRY_MAX_S = 60.0
SAVE_LOG_EVERY_S = 60.0


def is_session_id(session_id: str) -> bool:
    return isinstance(session_id, str) and bool(SESSION_ID.fullmatch(session_id))


def check_session_id(session_id: str) -> str:
    """A client-chosen id, checked (InvalidArgument names the rule)."""
    if not is_session_id(session_id):
        raise InvalidArgument(f"session_id {_shown(session_id)} is not a valid session id: use 8 to 128 characters of "
                              f"[A-Za-z0-9_-] (e.g. 32 url-safe base64 characters of 24 random bytes), or leave it empty "
                              f"for a server-issued id")
    return session_id


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
    on_saved: Callable[[float], None] = lambda seconds: None
    on_save_failed: Callable[[], None] = lambda: None
    on_loaded: Callable[[str, float], None] = lambda outcome, seconds: None  # ok | unusable
    on_lease_lost: Callable[[], None] = lambda: None  # another daemon took a session this one held
    on_write_refused: Callable[[], None] = lambda: None  # a save refused: this daemon's lease was fenced


@dataclass
class Session:
    id: str
    kv: Any  # engine-side handle (the engine's SessionKV; None once the session failed)
    eos_token_ids: frozenset
    history: list = field(default_factory=list)
    created_at: float = 0.0
    last_access: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    closed: bool = False
    saved: object = None  # the persister's record of what is on disk (None: nothing yet)
    saved_history_length: int = -1  # history length at the last save (-1: never saved)
    spilled: bool = False  # evicted to disk: a call that waited on it loads it again
    ephemeral: bool = False  # never persisted (the HTTP shim's one-request sessions)
    save_error: str = ""  # why the last save failed ("" once one succeeds)
    save_failures: int = 0  # consecutive failed saves
    retry_save_at: float = 0.0  # store clock before which the flusher and eviction do not try again
    lease: object = None  # the persister's lease on the session (None: not persisted)

    @property
    def pending_tokens(self) -> list:
        """History not yet run through the model (the next Generate prefills it)."""
        return self.history[self.kv.next_position :]

    def record_generated(self, token_id: int) -> None:
        self.history.append(token_id)

    @property
    def unsaved(self) -> bool:
        return self.saved_history_length != len(self.history)

    @property
    def durable_length(self) -> int:
        """History tokens on disk: what this session resumes with after a crash (0: nothing saved)."""
        return max(self.saved_history_length, 0)


@dataclass
class PersistedSession:
    """What a persister loads: enough to make the session live again."""

    kv: object
    history: list
    eos_token_ids: frozenset
    saved: object
    lease: object = None


class SessionPersister(Protocol):
    """Where sessions go when they leave memory; the engine side implements it (no framework here).

    A persisted session is held through a lease (possibly shared with other daemons): `claim` at
    creation, `load` takes it over, `release` when it leaves memory. While another live daemon holds
    it, `claim` raises SessionExists and `load` / `delete` SessionOwnedElsewhere; once another daemon
    took it over, `check` and `save` raise LeaseLost (its writes are refused)."""

    def has(self, session_id: str) -> bool:
        """Whether the id is known to the state (saved, or held by some daemon)."""

    def claim(self, session_id: str) -> object:
        """The lease of a session being created (SessionExists when the id is in use)."""

    def check(self, session: Session) -> None: ...

    def release(self, session: Session) -> None: ...

    def save(self, session: Session) -> None:
        """Write what changed since the last save; the caller holds `session.lock`. Sets `session.saved`."""

    def load(self, session_id: str) -> PersistedSession:
        """Raises SessionStateUnusable (files set aside, or kept when only this daemon's config differs)."""

    def delete(self, session_id: str, session: Session | None = None) -> None:
        """`session`: the live session this daemon holds (None: only on disk here)."""

    def set_aside(self, session_id: str, reason: str) -> None: ...


class SaveFailureReport:
    """The operator's view of failing saves: the first failure logged at once, then at most one line
    per `every_s` that counts what the quiet time hid, and one line per session when it saves again."""

    def __init__(self, clock: Callable[[], float], every_s: float = SAVE_LOG_EVERY_S):
        self.clock, self.every_s = clock, every_s
        self._next_at = float("-inf")
        self._hidden = 0
        self._hidden_sessions: set[str] = set()

    def failed(self, s: Session, error: BaseException) -> None:
        now = self.clock()
        if now < self._next_at:
            self._hidden += 1
            self._hidden_sessions.add(s.id)
            return
        hidden = (f"; {self._hidden} more failed saves of {len(self._hidden_sessions)} sessions since the last report"
                  if self._hidden else "")
        # A full or read-only disk needs no traceback; anything else is a bug and gets one.
        log.error("session %s not saved (%s): durable through %d of %d tokens%s; retrying with backoff (up to every "
                  "%g s), reported again in %g s at most", _shown(s.id), s.save_error, s.durable_length, len(s.history),
                  hidden, SAVE_RETRY_MAX_S, self.every_s, exc_info=None if isinstance(error, OSError) else error)
        self._next_at = now + self.every_s
        self._hidden, self._hidden_sessions = 0, set()

    def recovered(self, s: Session, failures: int) -> None:
        log.warning("session %s saved again after %d failed saves: durable through %d tokens", _shown(s.id), failures,
                    s.durable_length)


def save_error_text(error: BaseException) -> str:
    """What a client is told about a failed save: the OS's reason (no server paths), else the error."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}"


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
        persister: SessionPersister | None = None,
        max_append_tokens: int = 0,
        max_pending_tokens: int = 0,
    ):
        """max_append_tokens: most tokens one AppendTokens (or CreateSession) may carry; max_pending_tokens:
        most tokens a session may hold appended but not yet prefilled (0 = no limit): one client's paste
        cannot queue unbounded prefill work in a daemon that others use interactively."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_append_tokens < 0 or max_pending_tokens < 0:
            raise ValueError(f"token limits must be >= 0 (0 = none), got max_append_tokens={max_append_tokens} "
                             f"max_pending_tokens={max_pending_tokens}")
        self.max_append_tokens, self.max_pending_tokens = max_append_tokens, max_pending_tokens
        self.vocab_size = vocab_size
        self.kv_factory = kv_factory
        self.capacity = capacity
        self.idle_ttl_s = idle_ttl_s
        self.history_limit = history_limit
        self.default_eos_token_ids = frozenset(default_eos_token_ids)
        self.clock = clock
        self.events = events or StoreEvents()
        self.persister = persister
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order: oldest first
        self._lock = threading.RLock()
        self._loading: dict[str, threading.Lock] = {}  # one load per session id at a time
        self.save_report = SaveFailureReport(clock)

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

    def _check_append_size(self, n: int, what: str) -> None:
        if self.max_append_tokens and n > self.max_append_tokens:
            raise InvalidArgument(
                f"{what} has {n} tokens, more than one call may carry (--max-append-tokens {self.max_append_tokens}); "
                f"nothing was appended. Send it in pieces of at most {self.max_append_tokens} tokens"
            )

    def _check_pending(self, pending: int, extra: int) -> None:
        if self.max_pending_tokens and pending + extra > self.max_pending_tokens:
            raise TooManyPendingTokens(
                f"the session would hold {pending + extra} tokens not yet prefilled ({pending} already pending), more "
                f"than --max-pending-tokens {self.max_pending_tokens}; nothing was appended. Run Generate (it prefills "
                f"what is pending) before appending more"
            )

    def _check_length(self, session_len: int, extra: int) -> None:
        if self.history_limit is not None and session_len + extra > self.history_limit:
            raise ContextExhausted(
                f"history would reach {session_len + extra} tokens, past the model's context of {self.history_limit} "
                f"under the 'full' KV strategy; nothing was appended. Start a new session, or serve with "
                f"--kv-strategy sink_window for unbounded sessions"
            )

    # -- lifecycle --------------------------------------------------------------------
    def create(self, initial_tokens: Sequence[int] = (), eos_token_ids: Iterable[int] | None = None, *,
               ephemeral: bool = False, session_id: str = "") -> Session:
        """session_id: the client's choice (checked; ALREADY_EXISTS when in use), "" = a server-issued id."""
        if session_id:
            check_session_id(session_id)
        self._check_append_size(len(initial_tokens), "initial_tokens")
        self._check_pending(0, len(initial_tokens))
        initial = self._check_tokens(initial_tokens, "initial_tokens")
        self._check_length(0, len(initial))
        eos = frozenset(eos_token_ids) if eos_token_ids is not None else self.default_eos_token_ids
        self._check_tokens(sorted(eos), "eos_token_ids")
        sid = session_id or issue_session_id()
        with self._lock:
            if session_id and (session_id in self._sessions or session_id in self._loading):
                raise self._exists(session_id)
        persister = None if ephemeral else self.persister
        try:
            lease = persister.claim(sid) if persister is not None else None  # SessionExists when in use here or elsewhere
        except SessionExists:
            raise self._exists(sid) from None
        now = self.clock()
        session = Session(id=sid, kv=None, eos_token_ids=eos, history=initial, created_at=now, last_access=now,
                          ephemeral=ephemeral, lease=lease)
        try:
            with self._lock:
                self.evict_idle()
                while len(self._sessions) >= self.capacity:
                    self._evict_lru()
                session.kv = self.kv_factory()
                self._sessions[sid] = session
        except BaseException:
            if persister is not None:
                persister.delete(sid, session)
            raise
        self.events.on_created()
        return session

    @staticmethod
    def _exists(session_id: str) -> SessionExists:
        return SessionExists(f"session {_shown(session_id)} already exists; choose another id, or call the existing "
                             f"session (AppendTokens, Generate) instead of creating it")

    def get(self, session_id: str, *, touch: bool = True) -> Session:
        """Look a session up (loading it when it is only on disk); `touch` marks it used (LRU order
        and idle clock)."""
        with self._lock:
            self.evict_idle()
            s = self._sessions.get(session_id)
            if s is None and self.persister is None:
                raise SessionNotFound(f"session {_shown(session_id)} does not exist (never created, closed, evicted or failed); "
                                      "create a new session")
            if s is not None and touch:
                s.last_access = self.clock()
                self._sessions.move_to_end(session_id)
        if s is not None:
            self._check_lease(s)  # a file-system look outside the store's lock (a shared directory may be remote)
            return s
        return self._resume(session_id)

    def _check_lease(self, s: Session) -> None:
        """LeaseLost (the session leaves memory unsaved) once another daemon took the session over."""
        if self.persister is None or s.lease is None:
            return
        try:
            self.persister.check(s)
        except LeaseLost:
            self._drop_moved(s)
            raise

    def _drop_moved(self, s: Session) -> None:
        with self._lock:
            if self._sessions.get(s.id) is s:
                del self._sessions[s.id]
                self.events.on_ended("moved")
        if not s.closed:
            s.closed = True
            self.events.on_lease_lost()
            log.warning("session %s was taken over by another daemon: dropped here, its unsaved changes refused",
                        _shown(s.id))

    def _resume(self, session_id: str) -> Session:
        persister = self.persister
        if persister is None:  # get() resumes only with a persister
            raise SessionNotFound(f"session {_shown(session_id)} does not exist; create a new session")
        with self._lock:
            loading = self._loading.setdefault(session_id, threading.Lock())
        with loading:  # a second caller waits for the first load, then finds the session live
            with self._lock:
                s = self._sessions.get(session_id)
            if s is not None:
                return s
            if not persister.has(session_id):
                with self._lock:
                    self._loading.pop(session_id, None)
                raise SessionNotFound(f"session {_shown(session_id)} does not exist (never created, closed or failed); "
                                      f"create a new session")
            t0 = time.perf_counter()
            try:
                loaded = persister.load(session_id)
            except BaseException as e:
                if isinstance(e, SessionStateUnusable):
                    self.events.on_loaded("unusable", time.perf_counter() - t0)
                with self._lock:
                    self._loading.pop(session_id, None)
                raise
            self.events.on_loaded("ok", time.perf_counter() - t0)
            now = self.clock()
            s = Session(id=session_id, kv=loaded.kv, eos_token_ids=loaded.eos_token_ids, history=loaded.history,
                        created_at=now, last_access=now, saved=loaded.saved, saved_history_length=len(loaded.history),
                        lease=loaded.lease)
            with self._lock:
                try:
                    while len(self._sessions) >= self.capacity:
                        self._evict_lru()
                    self._sessions[session_id] = s
                finally:  # only once the session is live (or the load failed): a later caller finds it
                    self._loading.pop(session_id, None)
            return s

    @contextmanager
    def _held(self, session_id: str) -> Iterator[Session]:
        """The live session, its lock held. A session spilled to disk while this call waited for
        the lock is loaded again (a few tries: an eviction needs the session idle, so this is rare)."""
        for _ in range(4):
            s = self.get(session_id)
            with s.lock:
                if s.spilled:
                    continue
                self._ensure_live(s)
                self._check_lease(s)  # taken over while this call waited (or while the daemon was paused)
                yield s
                return
        raise SessionNotFound(f"session {_shown(session_id)} kept being evicted while this call waited; retry")

    def append(self, session_id: str, token_ids: Sequence[int]) -> Session:
        if len(token_ids) == 0:
            raise InvalidArgument("token_ids is empty; append at least one token")
        self._check_append_size(len(token_ids), "token_ids")
        ids = self._check_tokens(token_ids, "token_ids")
        with self._held(session_id) as s:  # appends wait for an in-flight Generate, keeping history append-only
            self._check_pending(len(s.history) - s.kv.next_position, len(ids))
            self._check_length(len(s.history), len(ids))
            s.history.extend(ids)
            s.last_access = self.clock()
        return s

    def history(self, session_id: str, start: int = 0) -> list:
        """Token ids from `start`; waits for an in-flight Generate so the answer is settled."""
        with self._held(session_id) as s:
            if start < 0 or start > len(s.history):
                raise InvalidArgument(f"start must be in [0, {len(s.history)}] (the history length), got {start}")
            return s.history[start:]

    def close(self, session_id: str) -> None:
        """End a session for good: out of memory and, with a persister, its files deleted (refused with
        SessionOwnedElsewhere while another live daemon holds it)."""
        with self._lock:
            s = self._sessions.get(session_id)
        persister = self.persister
        on_disk = persister is not None and persister.has(session_id)
        if s is None and not on_disk:
            raise SessionNotFound(f"session {_shown(session_id)} does not exist (already closed)")
        if s is None:
            if persister is not None:  # (there is one: the session is on disk)
                persister.delete(session_id)  # only on disk here: not while another daemon holds it
        else:
            with s.lock:  # an in-flight Generate finishes (and saves) before the files go
                with self._lock:
                    if self._sessions.get(session_id) is s:
                        del self._sessions[session_id]
                s.closed = True
            if self.persister is not None:
                self.persister.delete(session_id, s)
        self.events.on_evicted("close")
        self.events.on_ended("closed")

    @contextmanager
    def generation(self, session_id: str) -> Iterator[Session]:
        """Hold the session for one Generate: waits for a prior one on the same session.

        A CacheInvariantError escaping the block fails the session: it is counted, removed
        and re-raised (FAILED_PRECONDITION to the client).
        """
        with self._held(session_id) as s:
            try:
                yield s
            except CacheInvariantError as e:
                self.fail(s, e.kind)
                raise
            finally:
                s.last_access = self.clock()

    def fail(self, s: Session, kind: str) -> None:
        """Count the violation (`events.on_violation`: the metrics, the only place it can be seen) and
        remove the session: no live session ever carries a violation."""
        self.events.on_violation(kind)
        with self._lock:
            removed = self._sessions.pop(s.id, None)
        s.closed = True
        s.kv = None
        if self.persister is not None:  # its last saved turn is kept aside for inspection, never resumed
            self.persister.set_aside(s.id, f"cache invariant {kind} violated")
        if removed is not None:
            self.events.on_ended("failed")

    # -- persistence ------------------------------------------------------------------
    def persist(self, s: Session) -> bool:
        """Save what changed in `s` (the caller holds s.lock). A failed save is counted, reported
        (SaveFailureReport) and recorded on the session (`save_error`, which clients see; its durable
        length stays where it was); the session stays live, and the next save writes the change again:
        at the end of its next turn, or from the flusher or an eviction after a backoff. LeaseLost (another
        daemon took the session over) drops the session from memory and is raised."""
        if self.persister is None or s.closed or s.kv is None or s.ephemeral:
            return False
        t0 = time.perf_counter()
        try:
            self.persister.save(s)
        except LeaseLost:  # another daemon holds the session now: nothing of it is written here again
            self.events.on_write_refused()
            self._drop_moved(s)
            raise
        except Exception as e:  # noqa: BLE001 - a full disk must not fail the RPC that triggered the save
            s.save_failures += 1
            s.save_error = save_error_text(e)
            s.retry_save_at = self.clock() + min(SAVE_RETRY_MAX_S, SAVE_RETRY_FIRST_S * 2 ** (s.save_failures - 1))
            self.events.on_save_failed()
            self.save_report.failed(s, e)
            return False
        s.saved_history_length = len(s.history)
        failures, s.save_error, s.save_failures, s.retry_save_at = s.save_failures, "", 0, 0.0
        if failures:
            self.save_report.recovered(s, failures)
        self.events.on_saved(time.perf_counter() - t0)
        return True

    def _save_backing_off(self, s: Session) -> bool:
        return s.save_failures > 0 and self.clock() < s.retry_save_at

    def flush(self, *, idle_s: float = 0.0, wait_s: float = 0.0) -> int:
        """Save sessions with unsaved changes that have been idle for `idle_s`; a session inside a
        Generate is skipped unless `wait_s` allows waiting for it. Returns how many were saved."""
        if self.persister is None:
            return 0
        now, n = self.clock(), 0
        for s in self.sessions():
            if not s.unsaved or now - s.last_access < idle_s or (wait_s <= 0 and self._save_backing_off(s)):
                continue
            got = s.lock.acquire(timeout=wait_s) if wait_s > 0 else s.lock.acquire(blocking=False)
            if not got:
                continue
            try:
                if not s.closed and s.unsaved:
                    n += self.persist(s)
            except LeaseLost:
                pass  # dropped: its new holder has it
            finally:
                s.lock.release()
        return n

    def _ensure_live(self, s: Session) -> None:
        if s.closed:
            raise SessionNotFound(f"session {_shown(s.id)} was closed or evicted while this call waited")

    # -- eviction ---------------------------------------------------------------------
    def _remove(self, session_id: str, reason: str) -> bool:
        """Evict an idle session: spilled to disk with a persister (it comes back on its next call),
        dropped without one. A session that cannot be saved (a full disk) is not evicted: dropping it
        would silently roll it back to its durable length; it stays live and False is returned."""
        s = self._sessions[session_id]
        persister = None if s.ephemeral else self.persister
        spill = persister is not None
        if persister is not None:
            if s.unsaved and self._save_backing_off(s):
                return False
            if not s.lock.acquire(blocking=False):  # a call took it meanwhile: not idle after all
                return False
            try:
                if s.unsaved and not self.persist(s):
                    return False
                s.spilled = s.closed = True
                if s.lease is not None:
                    persister.release(s)  # on disk and let go: any daemon may take it now
            except LeaseLost:
                return True  # another daemon holds it: dropped already
            finally:
                s.lock.release()
        del self._sessions[session_id]
        s.closed = True
        self.events.on_evicted(reason)
        self.events.on_ended("spilled" if spill else "evicted")
        return True

    def _evict_lru(self) -> None:
        """Make room for one more live session (admission). With a persister the least recently
        used idle session spills to disk and comes back on its next call: nothing is lost. Without
        one, evicting would drop a session its client may still be using, so a full store refuses
        the new session instead. A session inside a Generate (or the HTTP shim's one-request
        session while its request runs) is never evicted."""
        from inference_engine.errors import CapacityExhausted

        for sid, s in list(self._sessions.items()):  # oldest first; an idle one-request session is never coming back
            if not s.lock.locked() and (self.persister is not None or s.ephemeral) and self._remove(sid, "lru"):
                return
        unsaveable = [s for s in self._sessions.values() if s.save_error and not s.lock.locked()]
        if unsaveable:
            raise CapacityExhausted(
                f"all {self.capacity} session slots are taken and the {len(unsaveable)} idle session(s) cannot be saved to "
                f"disk to make room ({unsaveable[0].save_error}); free space under the state directory, close sessions "
                f"or raise --capacity")
        if self.persister is None:
            raise CapacityExhausted(
                f"all {self.capacity} session slots are taken and sessions are not persisted (--persist off), so none "
                f"is evicted to make room: close sessions, let idle ones expire (--idle-ttl {self.idle_ttl_s:g} s), raise "
                f"--capacity, or run with --persist turn (idle sessions then spill to disk)")
        raise CapacityExhausted(f"all {self.capacity} sessions are generating; retry later or raise --capacity")

    def hand_off(self, session_id: str) -> bool:
        """Another daemon asked for this session (a proxy now routes it there): spill it if it is idle.
        False while a call holds it (ask again later)."""
        with self._lock:
            if session_id not in self._sessions:
                return True
            return self._remove(session_id, "handoff")

    def release_all(self, *, wait_s: float = 5.0) -> int:
        """Save and let go of every session (the daemon stops): another daemon may take each over at once."""
        n = 0
        for s in self.sessions():
            if not s.lock.acquire(timeout=wait_s):
                continue
            try:
                if s.closed or s.ephemeral or self.persister is None:
                    continue
                if s.unsaved:
                    self.persist(s)
                if s.lease is not None:
                    self.persister.release(s)
                    n += 1
            except LeaseLost:
                pass
            finally:
                s.lock.release()
        return n

    def evict_idle(self) -> int:
        if self.idle_ttl_s <= 0:
            return 0
        now = self.clock()
        with self._lock:
            expired = [sid for sid, s in self._sessions.items() if now - s.last_access > self.idle_ttl_s and not s.lock.locked()]
            return sum(self._remove(sid, "ttl") for sid in expired)

    # -- introspection ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list:
        with self._lock:
            return list(self._sessions.values())

    def kv_live_bytes(self) -> int:
        return sum(s.kv.nbytes for s in self.sessions() if s.kv is not None)
