"""The runtime facade both transports share: SessionStore + Engine + metrics.

Plain Python in, plain Python out. The gRPC servicer and the deprecated HTTP shim only
convert their wire formats to these calls. The engine is reached through its public calls
and its frozen `model_info` / `strategy_info()`; no framework is imported here, so the
servers load torch only when an engine is built.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference_engine.engine.events import GenerationDone, HistoryTruncated
from inference_engine.engine.requests import GenerateParams, ModelInfo, SamplingParams
from inference_engine.errors import InvalidArgument, LeaseLost
from inference_engine.kv.byte_counts import kv_bytes
from inference_engine.server.metrics import RuntimeMetrics
from inference_engine.session.store import SessionPersister, SessionStore, StoreEvents

if TYPE_CHECKING:
    from inference_engine.engine.generate import Engine

log = logging.getLogger(__name__)

SERVER_VERSION = "0.4.0"
MAX_TOKENS_PER_CALL = 1 << 20


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    history_length: int
    resident_positions: int
    pending_tokens: int
    kv_live_bytes: int
    idle_seconds: float
    dropped_tokens: int
    eos_token_ids: tuple
    kv_resident_bytes: int = 0  # the hot set (kv/byte_counts.py)
    kv_selection_bytes: int = 0  # what queries score to choose pages
    kv_stored_bytes: int = 0  # exact K/V kept outside the hot set, in host RAM (warm)
    durable_length: int = 0  # history tokens on disk (what a crash keeps); 0 without persistence
    save_error: str = ""  # why this session's saves fail ("" while they do not)
    kv_cold_bytes: int = 0  # exact K/V kept outside the hot set, on disk (paged: the spill file)


@dataclass(frozen=True)
class TurnDone(GenerationDone):
    """The engine's Done plus the turn's save, made before Done goes out: the client learns
    whether the turn it was just answered is on disk."""

    durable_length: int = 0
    save_error: str = ""


@dataclass(frozen=True)
class ServerInfo:
    model_id: str
    vocab_size: int
    default_eos_token_ids: tuple
    kv_strategy: str
    max_context: int
    backend: str
    device: str
    server_version: str
    session_capacity: int
    idle_ttl_seconds: float
    drafter: str
    spec_k: int
    kv_params: Mapping[str, str] = field(default_factory=dict)  # the strategy's parameters (StrategyInfo.as_dict())
    max_append_tokens: int = 0  # per AppendTokens / CreateSession (0 = no limit)
    max_pending_tokens: int = 0  # appended but not yet prefilled, per session (0 = no limit)


class Runtime:
    def __init__(self, engine: Engine, *, capacity: int = 16, idle_ttl_s: float = 1800.0, metrics: RuntimeMetrics | None = None,
                 persister: SessionPersister | None = None, max_append_tokens: int = 0, max_pending_tokens: int = 0):
        """persister: where sessions are saved after each turn, spilled on eviction and loaded from
        on first use (None = sessions live in memory only). max_append_tokens / max_pending_tokens:
        the store's per-call and per-session token limits (0 = none; `kakeya serve` sets both)."""
        self.engine = engine
        self.persister = persister
        self.model_info: ModelInfo = engine.model_info
        self.metrics = metrics or RuntimeMetrics()
        m = self.metrics
        self.store = SessionStore(
            vocab_size=self.model_info.vocab_size,
            kv_factory=engine.new_session_kv,
            capacity=capacity,
            idle_ttl_s=idle_ttl_s,
            history_limit=engine.history_limit(),
            default_eos_token_ids=self.model_info.eos_token_ids,
            events=StoreEvents(
                on_created=m.sessions_created.inc,
                on_ended=lambda outcome: m.session_total.labels(outcome=outcome).inc(),
                on_evicted=lambda reason: m.session_evicted_total.labels(reason=reason).inc(),
                on_violation=lambda kind: m.cache_invariant_violations_total.labels(kind=kind).inc(),
                on_saved=self._observe_save,
                on_save_failed=m.session_save_failures_total.inc,
                on_loaded=self._observe_load,
                on_lease_lost=m.session_lease_lost_total.inc,
                on_write_refused=m.session_writes_refused_total.inc,
            ),
            persister=persister,
            max_append_tokens=max_append_tokens,
            max_pending_tokens=max_pending_tokens,
        )
        m.session_active.set_function(lambda: len(self.store))
        m.session_kv_live_bytes.set_function(self.store.kv_live_bytes)
        m.track_kv_tiers(self.store.sessions)
        stats = engine.loop.stats  # the engine loop's counters, read at scrape time
        m.batch_size.set_function(lambda: stats.last_batch_size)
        m.step_queue_depth.set_function(lambda: stats.queue_depth)
        m.forwards_run.set_function(lambda: stats.forwards)
        m.steps_run.set_function(lambda: stats.steps)
        m.forward_seconds.set_function(lambda: stats.forward_seconds)
        m.row_tokens_run.set_function(lambda: stats.row_tokens)
        m.prefill_tokens_run.set_function(lambda: stats.prefill_tokens)

    def _observe_save(self, seconds: float) -> None:
        self.metrics.session_saves_total.inc()
        self.metrics.session_save_duration_seconds.observe(seconds)

    def _observe_load(self, outcome: str, seconds: float) -> None:
        self.metrics.session_loads_total.labels(outcome=outcome).inc()
        self.metrics.session_load_duration_seconds.observe(seconds)

    def start_flusher(self, *, idle_s: float = 1.0, interval_s: float = 0.25) -> Callable[[], None]:
        """Save appended-but-not-generated sessions once idle for `idle_s` (an AppendTokens with no
        Generate right behind it); returns a stop function that also saves everything left."""
        if self.persister is None:
            return lambda: None
        stop = threading.Event()

        def loop():
            while not stop.wait(interval_s):
                self.store.flush(idle_s=idle_s)

        thread = threading.Thread(target=loop, daemon=True, name="kakeya-session-flush")
        thread.start()

        def stopper():
            stop.set()
            thread.join(timeout=5.0)
            self.store.flush(wait_s=5.0)

        return stopper

    def start_lease_keeper(self) -> Callable[[], None]:
        """With a shared state directory: beat every ttl/4 (renewing every lease this daemon holds) and let go
        of the sessions other daemons ask for (a proxy routes them there now; a busy one is asked about again at
        the next beat). Returns a stop function that lets go of every session first (the daemon stops)."""
        leases = getattr(self.persister, "leases", None)
        if leases is None or not leases.shared:
            return lambda: None
        stop, pending = threading.Event(), set()

        def loop():
            while not stop.wait(leases.ttl_s / 4):
                try:
                    leases.heartbeat()
                    pending.update(leases.release_requests())
                    for sid in list(pending):
                        if self.store.hand_off(sid):
                            pending.discard(sid)
                except Exception:  # noqa: BLE001 - a failed beat is retried at the next one (the lease lasts 4 of them)
                    log.exception("lease keeper")

        thread = threading.Thread(target=loop, daemon=True, name="kakeya-lease-keeper")
        thread.start()

        def stopper():
            stop.set()
            thread.join(timeout=5.0)
            self.store.release_all()

        return stopper

    # -- RPCs ----------------------------------------------------------------------------
    def create_session(self, initial_tokens: Sequence[int] = (), eos_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                       *, ephemeral: bool = False, session_id: str = ""):
        """ephemeral: a one-request session (the HTTP shim's) that is never written to disk; session_id: the
        client's choice ("" = a server-issued id)."""
        eos = () if ignore_eos else (eos_token_ids or None)
        return self.store.create(initial_tokens, eos, ephemeral=ephemeral, session_id=session_id)

    def append(self, session_id: str, token_ids: Sequence[int]):
        return self.store.append(session_id, token_ids)

    def history(self, session_id: str, start: int = 0) -> list:
        return self.store.history(session_id, start)

    def close(self, session_id: str) -> None:
        self.store.close(session_id)

    def generate(self, session_id: str, max_tokens: int, sampling: SamplingParams,
                 should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        if max_tokens < 1 or max_tokens > MAX_TOKENS_PER_CALL:
            raise InvalidArgument(f"max_tokens must be in [1, {MAX_TOKENS_PER_CALL}], got {max_tokens}")
        t_arrival = time.perf_counter()
        m = self.metrics
        with self.store.generation(session_id) as s:
            m.session_history_tokens.observe(len(s.history))
            params = GenerateParams(max_tokens, sampling, s.eos_token_ids)

            def record(token_id: int) -> None:  # on the engine loop, as the token is emitted
                s.record_generated(token_id)
                m.generated_tokens_total.inc()

            try:
                for ev in self.engine.generate(s.kv, s.history, params, should_stop, arrived_at=t_arrival, on_token=record):
                    if isinstance(ev, HistoryTruncated):
                        m.history_truncated_tokens_total.inc(ev.dropped_tokens)
                    elif isinstance(ev, GenerationDone):
                        self._observe_done(ev)
                        if ev.reencoded_tokens:
                            log.info("session %s passed the model's trained context: %d earlier positions encoded again "
                                     "(--page-far-after context) in a turn of %.1f s", s.id, ev.reencoded_tokens,
                                     ev.total_seconds)
                        # The tokens have streamed; the turn is saved before Done, so Done says what is durable
                        # (the call ends after the save either way).
                        self.store.persist(s)
                        ev = TurnDone(**vars(ev), durable_length=s.durable_length, save_error=s.save_error)
                    yield ev
            except GeneratorExit:  # the client went away: what was committed is still this turn's
                if s.unsaved:
                    try:
                        self.store.persist(s)
                    except LeaseLost:
                        pass  # another daemon took the session over: this turn is refused, and nobody is listening
                raise

    def _observe_done(self, done: GenerationDone) -> None:
        m = self.metrics
        m.generate_prefill_tokens.observe(done.prefill_tokens)
        if done.reencoded_tokens:
            m.reencoded_tokens_total.inc(done.reencoded_tokens)
        m.generate_prefill_duration_seconds.observe(done.prefill_seconds)
        m.generate_requests_total.labels(stop_reason=done.stop_reason).inc()
        if done.generated_tokens:
            m.time_to_first_token_seconds.observe(done.time_to_first_token_seconds)
        if done.generated_tokens > 1:  # a re-encode while decoding (a paged session passing the context) is not decoding
            decode_s = done.total_seconds - done.time_to_first_token_seconds - done.reencode_decode_seconds
            if decode_s > 0:
                m.decode_tokens_per_second.observe((done.generated_tokens - 1) / decode_s)
        m.spec_drafted_tokens_total.inc(done.drafted_tokens)
        m.spec_accepted_tokens_total.inc(done.accepted_tokens)

    def session_info(self, session_id: str) -> SessionInfo:
        s = self.store.get(session_id, touch=False)
        kv = s.kv
        tiers = kv_bytes(kv)
        return SessionInfo(
            session_id=s.id,
            history_length=len(s.history),
            resident_positions=kv.resident_positions,
            pending_tokens=len(s.history) - kv.next_position,
            kv_live_bytes=kv.nbytes,
            idle_seconds=0.0 if s.lock.locked() else max(0.0, self.store.clock() - s.last_access),
            dropped_tokens=kv.dropped_total,
            eos_token_ids=tuple(sorted(s.eos_token_ids)),
            kv_resident_bytes=tiers.resident,
            kv_selection_bytes=tiers.selection,
            kv_stored_bytes=tiers.stored,
            kv_cold_bytes=tiers.cold,
            durable_length=s.durable_length,
            save_error=s.save_error,
        )

    def server_info(self) -> ServerInfo:
        e, m = self.engine, self.model_info
        strategy = e.strategy_info()
        return ServerInfo(
            model_id=m.model_id,
            vocab_size=m.vocab_size,
            default_eos_token_ids=tuple(m.eos_token_ids),
            kv_strategy=strategy.name,
            max_context=m.max_context,
            backend=m.backend,
            device=m.device,
            server_version=SERVER_VERSION,
            session_capacity=self.store.capacity,
            idle_ttl_seconds=self.store.idle_ttl_s,
            drafter=e.drafter_name,
            spec_k=e.spec_k,
            kv_params=strategy.as_dict(),
            max_append_tokens=self.store.max_append_tokens,
            max_pending_tokens=self.store.max_pending_tokens,
        )
