"""SessionStore lifecycle: ids, validation, LRU, TTL, close, failure. No model needed."""
import threading

import pytest

from inference_engine.errors import (CacheInvariantError, CapacityExhausted, ContextExhausted, InvalidArgument, SessionExists,
                                     SessionNotFound, TooManyPendingTokens)
from inference_engine.session.store import SessionStore, StoreEvents


class FakeKV:
    next_position = 0
    nbytes = 100
    resident_positions = 0
    dropped_total = 0


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def store(**kw):
    events = {"evicted": [], "ended": [], "violations": []}
    ev = StoreEvents(
        on_evicted=events["evicted"].append, on_ended=events["ended"].append, on_violation=events["violations"].append
    )
    defaults = dict(vocab_size=100, kv_factory=FakeKV, capacity=3, idle_ttl_s=60.0, clock=Clock(), events=ev)
    defaults.update(kw)
    return SessionStore(**defaults), events


def test_ids_are_unique_and_unguessable():
    s, _ = store(capacity=1000)
    ids = {s.create().id for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) >= 32 for i in ids)  # token_urlsafe(24): 192 random bits


def test_a_client_may_choose_the_id_once_it_is_free():
    s, _ = store()
    chosen = "Abc_-123" * 4
    assert s.create([1], session_id=chosen).id == chosen
    with pytest.raises(SessionExists, match="already exists"):
        s.create(session_id=chosen)
    for bad in ("short", "x" * 129, "a/b/c/d/e", "dot.dot.dot", "naïve-id-here"):
        with pytest.raises(InvalidArgument, match="not a valid session id"):
            s.create(session_id=bad)
    s.close(chosen)
    assert s.create(session_id=chosen).history == []


def test_append_validates_against_vocab_and_leaves_history_unchanged():
    s, _ = store()
    sess = s.create([1, 2])
    for bad in ([5, 100], [-1], [3, 4, 1000]):
        with pytest.raises(InvalidArgument, match="outside the model vocabulary"):
            s.append(sess.id, bad)
    assert sess.history == [1, 2]
    with pytest.raises(InvalidArgument, match="empty"):
        s.append(sess.id, [])
    s.append(sess.id, [99])
    assert sess.history == [1, 2, 99]


def test_unknown_closed_and_evicted_sessions_are_not_found():
    s, ev = store(capacity=2)
    with pytest.raises(SessionNotFound):
        s.get("nope")
    a = s.create()
    s.close(a.id)
    with pytest.raises(SessionNotFound):
        s.append(a.id, [1])
    assert ev["evicted"] == ["close"] and ev["ended"] == ["closed"]


def test_a_full_store_without_persistence_refuses_rather_than_drops():
    """Without a persister an evicted session would be lost while its client may still use it:
    at capacity, CreateSession is refused (naming the ways out) and every session stays."""
    s, ev = store(capacity=2)
    a, b = s.create(), s.create()
    with pytest.raises(CapacityExhausted, match=r"all 2 session slots .* --persist turn"):
        s.create()
    assert ev["evicted"] == []
    s.get(a.id), s.get(b.id)
    s.close(b.id)  # a freed slot admits the next one
    c = s.create()
    s.get(a.id), s.get(c.id)


def test_busy_sessions_are_not_evicted():
    s, _ = store(capacity=1)
    a = s.create()
    with s.generation(a.id):
        with pytest.raises(CapacityExhausted, match="generating|slots"):
            s.create()
    s.get(a.id)  # still there


def test_idle_ttl_eviction():
    clock = Clock()
    s, ev = store(clock=clock, idle_ttl_s=10)
    a, b = s.create(), s.create()
    clock.t = 5
    s.get(b.id)
    clock.t = 12
    with pytest.raises(SessionNotFound):
        s.get(a.id)
    s.get(b.id)
    assert ev["evicted"] == ["ttl"]


def test_invariant_violation_fails_and_frees_the_session():
    s, ev = store()
    a = s.create([1])
    with pytest.raises(CacheInvariantError):
        with s.generation(a.id):
            raise CacheInvariantError("inv2", "positions went backwards")
    assert ev["violations"] == ["inv2"] and ev["ended"] == ["failed"]
    with pytest.raises(SessionNotFound):
        s.get(a.id)


def test_history_limit_refuses_and_keeps_session():
    s, _ = store(history_limit=5)
    a = s.create([1, 2, 3])
    with pytest.raises(ContextExhausted, match="past the model's context of 5"):
        s.append(a.id, [4, 5, 6])
    assert a.history == [1, 2, 3]
    s.append(a.id, [4, 5])


def test_one_generation_per_session_at_a_time():
    s, _ = store()
    a = s.create([1])
    order = []

    def second():
        with s.generation(a.id):
            order.append("second")

    with s.generation(a.id):
        t = threading.Thread(target=second)
        t.start()
        t.join(0.2)
        order.append("first-done")
    t.join()
    assert order == ["first-done", "second"]


def test_appends_are_capped_per_call_and_pending_tokens_per_session():
    st, _ = store(max_append_tokens=8, max_pending_tokens=12)
    with pytest.raises(InvalidArgument, match=r"token_ids has 1000000 tokens, more than one call may carry \(--max-append-tokens 8\)"):
        st.append(st.create().id, [1] * 1_000_000)
    with pytest.raises(InvalidArgument, match=r"initial_tokens has 9 tokens.*--max-append-tokens 8"):
        st.create([1] * 9)
    s = st.create([1] * 8)
    st.append(s.id, [2] * 4)  # 12 pending: at the limit
    with pytest.raises(TooManyPendingTokens, match=r"would hold 13 tokens not yet prefilled \(12 already pending\), more than "
                                                  r"--max-pending-tokens 12.*Run Generate") as e:
        st.append(s.id, [3])
    assert e.value.code == "RESOURCE_EXHAUSTED" and len(s.history) == 12  # nothing was appended
    s.kv = FakeKV()
    s.kv.next_position = 12  # a Generate prefilled them
    st.append(s.id, [3] * 8)
    assert len(s.history) == 20
    unlimited, _ = store()
    assert len(unlimited.create([1] * 100_000).history) == 100_000  # 0 = no limit (the store's default)
    with pytest.raises(ValueError, match="token limits must be >= 0"):
        store(max_pending_tokens=-1)
