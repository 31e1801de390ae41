"""Prometheus metrics (ADR 0008 §2.9 set, plus generation throughput) on a private registry."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from inference_engine.kv.byte_counts import KVBytes, kv_bytes

TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RuntimeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.session_active = Gauge("session_active", "Currently allocated sessions.", registry=r)
        self.session_total = Counter("session_total", "Sessions that ended, by outcome.", ["outcome"], registry=r)
        self.sessions_created = Counter("session_opened_total", "Sessions created.", registry=r)
        self.session_kv_live_bytes = Gauge("session_kv_live_bytes",
                                           "KV bytes held for attention across allocated sessions (resident + selection).",
                                           registry=r)
        self.session_kv_resident_bytes = Gauge(
            "session_kv_resident_bytes", "Hot-set KV bytes (sink, window, recalled pages) across allocated sessions.", registry=r)
        self.session_kv_selection_bytes = Gauge(
            "session_kv_selection_bytes", "Page-selection bytes (paged: compact keys) across allocated sessions.", registry=r)
        self.session_kv_stored_bytes = Gauge(
            "session_kv_stored_bytes", "Page-store bytes in host RAM (warm: exact K/V of evicted positions) across allocated "
            "sessions.", registry=r)
        self.session_kv_cold_bytes = Gauge(
            "session_kv_cold_bytes", "Page-store bytes on disk (cold: exact K/V of evicted positions past --page-ram-mb, in "
            "memory-mapped spill files) across allocated sessions.", registry=r)
        self.session_history_tokens = Histogram(
            "session_history_tokens", "Per-session history length at Generate time.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generate_prefill_tokens = Histogram(
            "generate_prefill_tokens", "Tokens prefilled per Generate (the appended delta).", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generate_prefill_duration_seconds = Histogram(
            "generate_prefill_duration_seconds", "Wall time of the prefill phase per Generate.", buckets=SECONDS_BUCKETS, registry=r
        )
        self.cache_invariant_violations_total = Counter(
            "cache_invariant_violations_total", "Cache invariant violations (paging-grade when non-zero).", ["kind"], registry=r
        )
        self.session_evicted_total = Counter("session_evicted_total", "Sessions freed, by reason.", ["reason"], registry=r)
        self.generated_tokens_total = Counter("generate_tokens_total", "Tokens generated.", registry=r)
        self.generate_requests_total = Counter("generate_requests_total", "Generate calls by stop reason.", ["stop_reason"], registry=r)
        self.time_to_first_token_seconds = Histogram(
            "generate_time_to_first_token_seconds", "Request arrival to first generated token.", buckets=SECONDS_BUCKETS, registry=r
        )
        self.decode_tokens_per_second = Histogram(
            "generate_decode_tokens_per_second",
            "Decode throughput per Generate (tokens after the first / time after the first).",
            buckets=(1, 2, 5, 10, 20, 30, 40, 60, 80, 120, 200),
            registry=r,
        )
        self.history_truncated_tokens_total = Counter(
            "history_truncated_tokens_total", "History positions dropped from attention by a bounded KV strategy.", registry=r
        )
        self.reencoded_tokens_total = Counter(
            "reencoded_tokens_total", "Positions run through the model again: paged sessions re-encoded as they passed the "
            "trained context (--page-far-after context).", registry=r
        )
        self.spec_drafted_tokens_total = Counter("spec_drafted_tokens_total", "Tokens drafted for speculative decoding.", registry=r)
        self.spec_accepted_tokens_total = Counter("spec_accepted_tokens_total", "Drafted tokens the verifier accepted.", registry=r)
        self.session_saves_total = Counter("session_saves_total", "Session saves to the state directory.", registry=r)
        self.session_save_failures_total = Counter("session_save_failures_total", "Session saves that failed.", registry=r)
        self.session_save_duration_seconds = Histogram(
            "session_save_duration_seconds", "Wall time of one session save (segments + manifest).", buckets=SECONDS_BUCKETS, registry=r
        )
        self.session_loads_total = Counter("session_loads_total", "Sessions loaded from disk, by outcome.", ["outcome"], registry=r)
        self.session_lease_lost_total = Counter(
            "session_lease_lost_total", "Sessions another daemon took over while this one held them (their writes refused).",
            registry=r)
        self.session_writes_refused_total = Counter(
            "session_writes_refused_total", "Saves refused because another daemon had fenced this one's lease.", registry=r)
        self.session_owned_elsewhere_total = Counter(
            "session_owned_elsewhere_total", "Calls answered UNAVAILABLE because another live daemon holds the session.",
            registry=r)
        self.session_load_duration_seconds = Histogram(
            "session_load_duration_seconds", "Wall time of loading one session from disk.", buckets=SECONDS_BUCKETS, registry=r
        )
        self.batch_size = Gauge("engine_batch_size", "Sessions' steps in the engine's latest forward (continuous batching).", registry=r)
        self.step_queue_depth = Gauge("engine_step_queue_depth", "Sessions' steps waiting for a forward.", registry=r)
        self.forwards_run = Gauge("engine_forwards_run", "Forwards the engine ran since start (each serves one or more sessions' steps).",
                                  registry=r)
        self.steps_run = Gauge("engine_steps_run", "Sessions' steps the engine ran since start (steps / forwards = mean batch size).",
                               registry=r)
        self.forward_seconds = Gauge("engine_forward_seconds", "Seconds the engine spent in forwards since start (its rate = the "
                                     "model thread's busy share).", registry=r)
        self.row_tokens_run = Gauge("engine_row_tokens_run", "Decode and verify rows the engine ran since start.", registry=r)
        self.prefill_tokens_run = Gauge("engine_prefill_tokens_run", "Prefill tokens the engine ran since start (with "
                                        "engine_row_tokens_run and engine_forwards_run: a forward's make-up).", registry=r)
        for kind in ("inv1", "inv2"):
            self.cache_invariant_violations_total.labels(kind=kind)
        for reason in ("ttl", "lru", "close"):
            self.session_evicted_total.labels(reason=reason)
        for outcome in ("closed", "evicted", "spilled", "failed"):
            self.session_total.labels(outcome=outcome)
        for outcome in ("ok", "unusable"):
            self.session_loads_total.labels(outcome=outcome)

    def track_kv_tiers(self, sessions: Callable[[], Iterable]) -> None:
        """Read the four KV byte tiers of `sessions()` (objects with a `.kv`) at scrape time."""

        def total() -> KVBytes:
            return sum((kv_bytes(s.kv) for s in sessions()), KVBytes())

        self.session_kv_resident_bytes.set_function(lambda: total().resident)
        self.session_kv_selection_bytes.set_function(lambda: total().selection)
        self.session_kv_stored_bytes.set_function(lambda: total().stored)
        self.session_kv_cold_bytes.set_function(lambda: total().cold)

    def serve(self, port: int, addr: str = "127.0.0.1"):
        return start_http_server(port, addr=addr, registry=self.registry)
