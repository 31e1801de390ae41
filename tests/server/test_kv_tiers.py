"""KV bytes by tier (kv/byte_counts.py) and their /metrics gauges, on stand-in caches (no model)."""
from types import SimpleNamespace

from prometheus_client import generate_latest

from inference_engine.kv.byte_counts import KVBytes, kv_bytes
from inference_engine.server.metrics import RuntimeMetrics


class TieredCache:
    def __init__(self, resident, selection=0, stored=0, cold=None):
        self.resident_nbytes, self.selection_nbytes, self.stored_nbytes = resident, selection, stored
        if cold is not None:
            self.cold_nbytes = cold


def test_tiers_are_read_by_duck_typing_cold_0_when_absent():
    assert kv_bytes(TieredCache(10, 20, 30, 40)) == KVBytes(10, 20, 30, 40)
    assert kv_bytes(SimpleNamespace(cache=TieredCache(10, 20, 30, 40))) == KVBytes(10, 20, 30, 40)  # a SessionKV
    assert kv_bytes(TieredCache(10, 20, 30)) == KVBytes(10, 20, 30, 0)  # no disk tier
    assert kv_bytes(SimpleNamespace(nbytes=7)) == KVBytes(7, 0, 0, 0)  # everything resident
    assert kv_bytes(None) == KVBytes()


def test_tiers_add_up_field_by_field():
    assert KVBytes(1, 2, 3, 4) + KVBytes(10, 20, 30, 40) == KVBytes(11, 22, 33, 44)
    assert sum((KVBytes(1, 2, 3, 4), KVBytes(1, 1, 1, 1)), KVBytes()) == KVBytes(2, 3, 4, 5)


def test_metrics_gauges_sum_each_tier_over_the_live_sessions_at_scrape_time():
    m = RuntimeMetrics()
    sessions = [SimpleNamespace(kv=TieredCache(100, 20, 3000, 50_000)), SimpleNamespace(kv=TieredCache(100, 10, 500))]
    m.track_kv_tiers(lambda: sessions)
    value = m.registry.get_sample_value
    tiers = ("session_kv_resident_bytes", "session_kv_selection_bytes", "session_kv_stored_bytes", "session_kv_cold_bytes")
    assert [value(name) for name in tiers] == [200, 30, 3500, 50_000]
    sessions.pop(0)
    assert [value(name) for name in tiers] == [100, 10, 500, 0]
    assert b"session_kv_cold_bytes" in generate_latest(m.registry)
