"""Session leases in a shared state directory (persistence/leases.py): one holder per generation, a live
holder is honoured and asked to let go, a silent one is taken over after the lease duration (on the taker's
own clock), and fencing: the old holder's writes fail once its generation directory is renamed away.
Plain files and fake clocks; no model, no daemon."""
from __future__ import annotations

import os
import time

import pytest

from inference_engine.errors import LeaseLost, SessionExists, SessionNotFound, SessionOwnedElsewhere
from inference_engine.persistence.leases import Leases
from inference_engine.persistence.state_dir import MANIFEST_NAME, StateDir, manifest_bytes, write_atomic

SID = "session-under-test-0001"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def daemons(tmp_path, ttl=2.0):
    d = StateDir(tmp_path).create()
    ca, cb = Clock(), Clock()
    a = Leases(d, shared=True, ttl_s=ttl, daemon_id="daemon-a", clock=ca)
    b = Leases(d, shared=True, ttl_s=ttl, daemon_id="daemon-b", clock=cb)
    return d, a, b, ca, cb


def save(lease, history_length: int, files=("00000001-history.safetensors",)):
    """What a save leaves: segments, then the manifest naming them."""
    for name in files:
        write_atomic(lease.path / name, name.encode())
    body = {"history_length": history_length, "segments": [{"file": f} for f in files]}
    write_atomic(lease.path / MANIFEST_NAME, manifest_bytes(body))


def test_a_live_holder_is_honoured_and_asked_to_let_go(tmp_path):
    d, a, b, _, _ = daemons(tmp_path)
    lease = a.claim_new(SID)
    assert lease.generation == 1 and lease.path == d.data_dir(SID)
    with pytest.raises(SessionExists):
        b.claim_new(SID)
    save(lease, 3)
    with pytest.raises(SessionOwnedElsewhere) as e:
        b.acquire(SID)
    assert e.value.owner == "daemon-a" and e.value.trailers() == (("kakeya-session-owner", "daemon-a"),)
    assert a.release_requests() == [SID] and a.release_requests() == []  # asked once, read once
    a.release(lease)  # e.g. spilled: the next daemon takes it at once, without waiting for the lease to expire
    taken = b.acquire(SID)
    assert taken.generation == 2 and d.data_dir(SID) == taken.path and d.has(SID)
    with pytest.raises(LeaseLost):
        a.check(lease)


def test_a_silent_holder_is_taken_over_after_the_lease_and_fenced(tmp_path):
    d, a, b, ca, cb = daemons(tmp_path, ttl=2.0)
    lease = a.claim_new(SID)
    save(lease, 5, ("00000001-history.safetensors", "00000001-tail.safetensors"))
    b.heartbeat()  # b watches a's beat from here on (its own clock)
    cb.t = 1.9
    a.heartbeat()  # a renews: the window starts again on b's clock
    with pytest.raises(SessionOwnedElsewhere):
        b.acquire(SID)
    cb.t = 3.8  # 1.9 s since a's beat last changed, as b sees it: still live
    with pytest.raises(SessionOwnedElsewhere):
        b.acquire(SID)
    cb.t = 4.0  # a is paused (SIGSTOP) or partitioned: no beat for the whole lease
    taken = b.acquire(SID)
    assert taken.generation == 2 and b.takeovers == 1
    assert sorted(p.name for p in taken.path.iterdir()) == ["00000001-history.safetensors", "00000001-tail.safetensors",
                                                            "owner.json", MANIFEST_NAME]
    assert [p.name for p in d.sessions.joinpath(SID).iterdir()] == ["g00000002"]  # the fenced generation is gone
    # a wakes up: every write it tries lands on a path that no longer exists; it learns it lost the session
    with pytest.raises(FileNotFoundError):
        write_atomic(lease.path / "00000002-history.safetensors", b"stale")
    with pytest.raises(LeaseLost):
        a.check(lease)
    assert not (taken.path / "00000002-history.safetensors").exists()
    with pytest.raises(SessionOwnedElsewhere):  # and b, alive, is honoured in turn
        a.acquire(SID)


def test_one_holder_per_generation_when_two_take_over_at_once(tmp_path):
    d, a, b, _, _ = daemons(tmp_path)
    dead = Leases(d, shared=False, daemon_id="daemon-dead")
    save(dead.claim_new(SID), 2)
    assert a.acquire(SID).generation == 2
    # b decided at the same moment that generation 1's holder is dead, and claims 2 too: the rename of its
    # prepared directory onto a's (never empty) fails, so b does not hold it ...
    assert b._claim(d.sessions / SID, 2) is None
    assert [p.name for p in (d.sessions / SID).iterdir()] == ["g00000002"]  # (its prepared directory is gone too)
    with pytest.raises(SessionOwnedElsewhere) as e:  # ... and, looking again, finds a live holder
        b.acquire(SID)
    assert e.value.owner == "daemon-a"


def test_a_session_saved_before_leases_is_moved_into_its_first_generation(tmp_path):
    d = StateDir(tmp_path).create()
    old = d.sessions / SID
    old.mkdir(parents=True)
    (old / "00000001-history.safetensors").write_bytes(b"h")
    write_atomic(old / MANIFEST_NAME, manifest_bytes({"history_length": 1, "segments": [{"file": "00000001-history.safetensors"}]}))
    assert d.has(SID) and d.data_dir(SID) == old
    lease = Leases(d).acquire(SID)
    assert lease.generation == 1 and d.data_dir(SID) == lease.path and d.has(SID)
    assert sorted(p.name for p in old.iterdir()) == ["g00000001"]


def test_a_session_never_saved_whose_holder_died_is_gone(tmp_path):
    d, a, b, _, cb = daemons(tmp_path, ttl=1.0)
    a.claim_new(SID)  # created, then a died before the first save
    b.heartbeat()
    cb.t = 5.0
    with pytest.raises(SessionNotFound):
        b.acquire(SID)
    assert not (d.sessions / SID).exists()
    assert b.claim_new(SID).generation == 1  # the id is free again


def test_without_sharing_every_other_holder_is_a_dead_earlier_process(tmp_path):
    d = StateDir(tmp_path).create()
    first = Leases(d, daemon_id="before-restart")
    save(first.claim_new(SID), 4)
    again = Leases(d, daemon_id="after-restart")  # it holds daemon.lock: no waiting for the lease
    assert again.acquire(SID).generation == 2
    assert not (d.root / "daemons").exists()  # and no heartbeat files


def test_a_stopped_daemon_leaves_no_heartbeat_and_dead_peers_are_forgotten(tmp_path):
    d, a, b, ca, cb = daemons(tmp_path, ttl=1.0)
    assert (d.root / "daemons" / "daemon-a.json").exists()
    b.ask_to_release("daemon-a", SID)
    b.heartbeat()
    cb.t = 100.0  # a has not beaten for 100 lease durations
    b.heartbeat()
    assert not (d.root / "daemons" / "daemon-a.json").exists() and not (d.root / "daemons" / "daemon-a.inbox").exists()
    b.stop()
    assert list((d.root / "daemons").iterdir()) == []


def test_gc_removes_what_a_claim_or_takeover_that_died_half_way_left(tmp_path):
    d, a, _, _, _ = daemons(tmp_path)
    lease = a.claim_new(SID)
    save(lease, 3)
    top = d.sessions / SID
    (top / ".claim-dead00").mkdir()  # a claimer that died before its rename
    (top / "fenced-g00000000").mkdir()  # a taker that died before removing what it fenced
    (top / ".claim-young0").mkdir()  # a claim in progress right now: left alone
    old = time.time() - 3600
    for name in (".claim-dead00", "fenced-g00000000"):
        os.utime(top / name, (old, old))
    assert d.gc()["leftover_files"] == 2
    assert sorted(p.name for p in top.iterdir()) == [".claim-young0", "g00000001"] and d.has(SID)
