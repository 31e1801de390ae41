"""Sessions on disk (SessionFiles + SessionStore): resume token-identical, segments, spill, bad state.

"Restart" = a new Engine, SessionFiles and Runtime over the same state directory; the reference
is the same session in the first runtime, which never stopped.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from factories import load_model, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import SamplingParams
from inference_engine.errors import SessionNotFound, SessionStateUnusable
from inference_engine.kv.registry import make_strategy
from inference_engine.kv.strategy import KVStrategy
from inference_engine.persistence import session_files, state_dir
from inference_engine.persistence.session_files import SessionFiles
from inference_engine.persistence.state_dir import MANIFEST_NAME, OWNER_NAME, StateDir
from inference_engine.server.runtime import Runtime

SINK, WINDOW = 4, 24

STRATEGIES = {
    "full": KVStrategy("full"),
    "sink_window": KVStrategy("sink_window", SINK, WINDOW),
    "dlm_restore": make_strategy("dlm_restore", SINK, WINDOW),  # a research strategy, found through the registry
    "dlm_restore_refresh3": make_strategy("dlm_restore", SINK, WINDOW, restore_refresh=3),
    "dlm_restore_pin4": make_strategy("dlm_restore", SINK, WINDOW, restore_from="drafter", restore_pin=4),
    "paged": KVStrategy("paged", SINK, WINDOW, page_size=8, recall_pages=2),
    # one page of the page store in RAM, the rest in the spill file
    "paged_spilled": KVStrategy("paged", SINK, WINDOW, page_size=8, recall_pages=2, page_ram_mb=1e-9),
}


def ids(n, seed=0):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def strategy(name, compressor="identity"):
    st = STRATEGIES[name]
    return dataclasses.replace(st, compressor=compressor)


def engine(st: KVStrategy, model_dir=None):
    m = load_model(str(model_dir or tiny_model_dir("llama")))
    if getattr(st, "restore_from", None) == "drafter":
        from kv_cache_proposer.same_model import VerifierRestoreSource

        return Engine(m, st, prefill_chunk=16, strategy_resources=VerifierRestoreSource(m))
    return Engine(m, st, prefill_chunk=16)


def runtime(root, st: KVStrategy, model_dir=None, **kw) -> Runtime:
    e = engine(st, model_dir)
    return Runtime(e, persister=SessionFiles(StateDir(root), e), **kw)


def restarted(root, st: KVStrategy, model_dir=None, **kw) -> Runtime:
    """A runtime started on a copy of `root`: a restart, while the runtime that wrote `root` keeps going as
    the never-stopped reference (on one directory the restarted one would fence it: one holder per session)."""
    copy = root.parent / f"{root.name}-restart-{len(list(root.parent.glob(root.name + '-restart-*')))}"
    shutil.copytree(root, copy, symlinks=True)
    return runtime(copy, st, model_dir, **kw)


def turn(rt, sid, n, sampling=SamplingParams()):
    return [e.token_id for e in rt.generate(sid, n, sampling) if isinstance(e, TokenGenerated)]


def manifest(root, sid) -> dict:
    return json.loads((StateDir(root).data_dir(sid) / MANIFEST_NAME).read_text())["body"]


@pytest.mark.parametrize("compressor", ["identity", "kakeya_d4", "kakeya_e8"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_resumed_session_continues_token_identical(name, compressor, tmp_path):
    if compressor != "identity":
        pytest.importorskip("kakeyalattice")
    st = strategy(name, compressor)
    kept = runtime(tmp_path / "kept", st)
    s = kept.create_session(ids(40))
    turn(kept, s.id, 6)
    kept.append(s.id, ids(30, seed=1))  # past the window: bounded strategies have evicted rows
    turn(kept, s.id, 5, SamplingParams(temperature=0.9, seed=3))
    kept.append(s.id, ids(7, seed=2))  # appended, not yet generated: saved by the flush
    assert kept.store.flush() == 1

    # Copy the state dir as it is now: the restarted daemon starts from these files.
    import shutil
    shutil.copytree(tmp_path / "kept", tmp_path / "restarted")
    resumed = runtime(tmp_path / "restarted", st)
    assert resumed.history(s.id) == kept.history(s.id)
    a, b = resumed.session_info(s.id), kept.session_info(s.id)
    assert (a.resident_positions, a.pending_tokens, a.kv_live_bytes, a.dropped_tokens) == \
           (b.resident_positions, b.pending_tokens, b.kv_live_bytes, b.dropped_tokens)
    for seed in (4, 5):
        more = ids(11, seed=seed)
        kept.append(s.id, more)
        resumed.append(s.id, more)
        assert turn(resumed, s.id, 7) == turn(kept, s.id, 7)
        # bit for bit: the logits after the turn were computed through the reloaded rows
        assert torch.equal(resumed.store.get(s.id).kv.last_logits, kept.store.get(s.id).kv.last_logits)
        sampled = SamplingParams(temperature=0.8, seed=seed)
        assert turn(resumed, s.id, 5, sampled) == turn(kept, s.id, 5, sampled)


@pytest.mark.parametrize("runs_max", [-1, session_files.RUNS_MAX])
@pytest.mark.parametrize("name", ["full", "sink_window", "paged"])
def test_rows_copied_by_runs_or_by_index_resume_identical(name, runs_max, tmp_path, monkeypatch):
    """A load copies each rows segment's still-resident rows in blocks (runs of consecutive rows and slots,
    cut by the rows of evicted positions a segment still holds) or, past RUNS_MAX runs (-1: always), by index;
    both rebuild the same cache. Several turns without compaction: segments hold evicted rows."""
    monkeypatch.setattr(session_files, "COMPACT_SLACK_ROWS", 1000)
    st = strategy(name)
    kept = runtime(tmp_path / "kept", st)
    s = kept.create_session(ids(20))
    for k in range(4):
        kept.append(s.id, ids(13, seed=k + 1))
        turn(kept, s.id, 3)
    assert sum(g["kind"] == "rows" for g in manifest(tmp_path / "kept", s.id)["segments"]) > 2
    import shutil
    shutil.copytree(tmp_path / "kept", tmp_path / "restarted")
    monkeypatch.setattr(session_files, "RUNS_MAX", runs_max)
    resumed = runtime(tmp_path / "restarted", st)
    more = ids(9, seed=9)
    kept.append(s.id, more)
    resumed.append(s.id, more)
    assert turn(resumed, s.id, 6) == turn(kept, s.id, 6)
    assert torch.equal(resumed.store.get(s.id).kv.last_logits, kept.store.get(s.id).kv.last_logits)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp16"])
@pytest.mark.parametrize("name", ["full", "sink_window"])
def test_resident_kv_dtypes_resume_identical(name, kv_dtype, tmp_path):
    """--kv-dtype int8 (a store persistence saves whole in the tail) and fp16 (rows, as fp32's) resume bit for bit too."""
    st = dataclasses.replace(STRATEGIES[name], kv_dtype=kv_dtype)
    kept = runtime(tmp_path, st)
    s = kept.create_session(ids(40))
    turn(kept, s.id, 5)
    kept.append(s.id, ids(20, seed=1))
    turn(kept, s.id, 4)
    resumed = restarted(tmp_path, st)
    assert turn(resumed, s.id, 8) == turn(kept, s.id, 8)
    assert torch.equal(resumed.store.get(s.id).kv.last_logits, kept.store.get(s.id).kv.last_logits)


def test_sink_window_past_the_trained_context_resumes_identical(tmp_path):
    """Past max_context the sink is re-anchored; a resumed session must keep doing exactly that."""
    model_dir = tiny_model_dir("llama", max_position_embeddings=64)
    st = KVStrategy("sink_window", SINK, WINDOW)
    kept = runtime(tmp_path, st, model_dir)
    s = kept.create_session(ids(50))
    turn(kept, s.id, 30)  # position 80 > 64
    resumed = restarted(tmp_path, st, model_dir)
    out = turn(resumed, s.id, 20)
    assert out == turn(kept, s.id, 20)


def test_a_turn_writes_only_what_it_added(tmp_path):
    rt = runtime(tmp_path, KVStrategy("full"))
    s = rt.create_session(ids(100))
    turn(rt, s.id, 4)
    for k in range(3):
        before = {g["file"] for g in manifest(tmp_path, s.id)["segments"]}
        rt.append(s.id, ids(9, seed=k))
        next_before = s.kv.next_position
        turn(rt, s.id, 4)
        body = manifest(tmp_path, s.id)
        new = [g for g in body["segments"] if g["file"] not in before]
        assert sorted(g["kind"] for g in new) == ["history", "rows", "tail"]
        hist = next(g for g in new if g["kind"] == "history")
        assert hist["end"] - hist["start"] == 9 + 4  # the appended tokens and the generated ones
        rows = next(g for g in new if g["kind"] == "rows")
        assert rows["rows"] == s.kv.next_position - next_before == 9 + 4
        seg = load_file(str(StateDir(tmp_path).data_dir(s.id) / rows["file"]))
        assert seg["positions"].tolist() == list(range(next_before, s.kv.next_position))
        # Earlier segments are kept as they were (append-only); only the tail is replaced.
        assert before - {g["file"] for g in body["segments"]} == {g["file"] for g in manifest_tail(before)}
    files = {p.name for p in StateDir(tmp_path).data_dir(s.id).iterdir()}
    assert files == {g["file"] for g in manifest(tmp_path, s.id)["segments"]} | {MANIFEST_NAME, OWNER_NAME}


def manifest_tail(files):
    return [{"file": f} for f in files if f.endswith("-tail.safetensors")]


def test_bounded_rows_on_disk_are_compacted(tmp_path, monkeypatch):
    monkeypatch.setattr(session_files, "COMPACT_SLACK_ROWS", 0)
    st = KVStrategy("sink_window", SINK, WINDOW)
    rt = runtime(tmp_path, st)
    s = rt.create_session(ids(20))
    for k in range(12):
        rt.append(s.id, ids(7, seed=k))
        turn(rt, s.id, 3)
        rows_on_disk = sum(g["rows"] for g in manifest(tmp_path, s.id)["segments"] if g["kind"] == "rows")
        assert rows_on_disk <= 2 * s.kv.resident_positions + 10
    resumed = restarted(tmp_path, st)
    rt.append(s.id, [5, 6])
    resumed.append(s.id, [5, 6])
    assert turn(resumed, s.id, 6) == turn(rt, s.id, 6)


def test_eviction_spills_and_the_next_call_loads(tmp_path):
    st = KVStrategy("sink_window", SINK, WINDOW)
    ref = runtime(tmp_path / "ref", st, capacity=8)
    rt = runtime(tmp_path / "rt", st, capacity=1)
    a_ref, a = ref.create_session(ids(30)), None
    a = rt.create_session(ids(30))
    assert turn(rt, a.id, 4) == turn(ref, a_ref.id, 4)
    rt.append(a.id, [7, 8, 9])  # unsaved change: the spill writes it
    ref.append(a_ref.id, [7, 8, 9])
    b = rt.create_session(ids(10, seed=1))  # capacity 1: a is spilled, not dropped
    assert len(rt.store) == 1 and StateDir(tmp_path / "rt").has(a.id)
    assert rt.metrics.session_total.labels(outcome="spilled")._value.get() == 1
    assert turn(rt, a.id, 6) == turn(ref, a_ref.id, 6)  # loaded again (b spilled in turn)
    assert rt.metrics.session_loads_total.labels(outcome="ok")._value.get() == 1
    turn(rt, b.id, 2)

    ttl = runtime(tmp_path / "rt", st, idle_ttl_s=0.05)
    ttl.append(a.id, [1])
    ref.append(a_ref.id, [1])
    time.sleep(0.1)
    assert ttl.store.evict_idle() == 1 and len(ttl.store) == 0
    assert turn(ttl, a.id, 5) == turn(ref, a_ref.id, 5)


def test_close_deletes_the_files_even_of_a_session_only_on_disk(tmp_path):
    st = KVStrategy("full")
    rt = runtime(tmp_path, st)
    s = rt.create_session(ids(10))
    turn(rt, s.id, 2)
    rt.close(s.id)
    assert not (StateDir(tmp_path).sessions / s.id).exists()
    with pytest.raises(SessionNotFound):
        rt.append(s.id, [1])
    t = rt.create_session(ids(10))
    turn(rt, t.id, 2)
    other = runtime(tmp_path, st)  # t is only on disk for this one
    other.close(t.id)
    assert not (StateDir(tmp_path).sessions / t.id).exists()
    with pytest.raises(SessionNotFound):
        other.close(t.id)
    with pytest.raises(SessionNotFound):
        other.history("../../etc")  # never a path


def _saved_session(root, st=KVStrategy("full")):
    rt = runtime(root, st)
    s = rt.create_session(ids(30))
    turn(rt, s.id, 3)
    rt.append(s.id, ids(5, seed=9))
    turn(rt, s.id, 3)
    good = rt.create_session(ids(12, seed=3))
    turn(rt, good.id, 2)
    return s.id, good.id, rt.history(good.id)


def _truncate_rows(d, body):
    f = d / next(g["file"] for g in body["segments"] if g["kind"] == "rows")
    f.write_bytes(f.read_bytes()[:-100])


def _flip_a_byte(d, body):
    f = d / next(g["file"] for g in body["segments"] if g["kind"] == "rows")
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x40
    f.write_bytes(bytes(data))


def _flip_a_header_byte(d, body):
    """A byte of the rows segment's safetensors header: its parse fails (or misreads the data) while the
    checksum runs beside it; the checksum's verdict is what is reported."""
    f = d / next(g["file"] for g in body["segments"] if g["kind"] == "rows")
    data = bytearray(f.read_bytes())
    data[12] ^= 0x21
    f.write_bytes(bytes(data))


def _edit_manifest(d, edit):
    doc = json.loads((d / MANIFEST_NAME).read_text())
    edit(doc)
    (d / MANIFEST_NAME).write_text(json.dumps(doc))


BAD = {
    "truncated segment": (_truncate_rows, "truncated"),
    "corrupted segment": (_flip_a_byte, "crc32: corrupted"),
    "corrupted segment header": (_flip_a_header_byte, "crc32: corrupted"),
    "missing segment": (lambda d, body: (d / body["segments"][0]["file"]).unlink(), "missing"),
    "truncated manifest": (lambda d, body: (d / MANIFEST_NAME).write_bytes((d / MANIFEST_NAME).read_bytes()[:200]),
                           "not valid JSON"),
    "edited manifest": (lambda d, body: _edit_manifest(d, lambda doc: doc["body"].update(history_length=3)), "sha256"),
    "other format version": (lambda d, body: _edit_manifest(d, lambda doc: doc.update(format="kakeya-session/99")),
                             "kakeya-session/99"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_state_is_refused_set_aside_and_others_keep_working(case, tmp_path):
    sid, good, good_history = _saved_session(tmp_path)
    d = StateDir(tmp_path).data_dir(sid)
    damage, words = BAD[case]
    damage(d, json.loads((d / MANIFEST_NAME).read_text())["body"])
    rt = runtime(tmp_path, KVStrategy("full"))
    with pytest.raises(SessionStateUnusable, match=words) as e:
        rt.append(sid, [1])
    assert "moved to" in str(e.value) and e.value.code == "FAILED_PRECONDITION"
    assert not d.exists()
    aside = list(StateDir(tmp_path).quarantine.iterdir())
    assert len(aside) == 1 and aside[0].name.startswith(sid) and (aside[0] / "SET_ASIDE_REASON.txt").is_file()
    with pytest.raises(SessionNotFound):  # set aside: not retried on every call
        rt.append(sid, [1])
    assert rt.history(good) == good_history
    assert len(turn(rt, good, 3)) == 3


def _as_sha256_manifest(d):
    """Rewrite a manifest as saves before 2026-11-24 wrote it: a sha256 per segment instead of a CRC-32."""
    doc = json.loads((d / MANIFEST_NAME).read_text())
    for g in doc["body"]["segments"]:
        del g["crc32"]
        g["sha256"] = state_dir.sha256_bytes((d / g["file"]).read_bytes())
    (d / MANIFEST_NAME).write_bytes(state_dir.manifest_bytes(doc["body"]))


def test_manifests_with_sha256_segment_checksums_still_load_and_are_checked(tmp_path):
    sid, good, _ = _saved_session(tmp_path)
    kept = runtime(tmp_path / "kept", KVStrategy("full"))
    k = kept.create_session(runtime(tmp_path, KVStrategy("full")).history(sid))
    for session in (sid, good):
        _as_sha256_manifest(StateDir(tmp_path).data_dir(session))
    rt = runtime(tmp_path, KVStrategy("full"))
    assert turn(rt, sid, 5) == turn(kept, k.id, 5)
    d = StateDir(tmp_path).data_dir(good)
    _flip_a_byte(d, json.loads((d / MANIFEST_NAME).read_text())["body"])
    with pytest.raises(SessionStateUnusable, match="sha256: corrupted"):
        runtime(tmp_path, KVStrategy("full")).history(good)


def test_foreign_weights_are_refused_and_set_aside(tmp_path):
    sid, _, _ = _saved_session(tmp_path)
    other = runtime(tmp_path, KVStrategy("full"), tiny_model_dir("llama", seed=1))  # same shapes, other weights
    with pytest.raises(SessionStateUnusable, match="weights_sha256"):
        other.history(sid)
    assert not StateDir(tmp_path).has(sid)


def test_the_derived_files_beside_the_model_are_not_its_identity(tmp_path):
    """The backends keep derived start-up files next to the model (hidden `.kakeya-*.safetensors`: packed and native
    blocks), written, replaced and pruned by every build that starts on it. A session saved before one appeared or
    changed resumes after a restart (before 2026-12-01 they were hashed into weights_sha256, and a restart after
    another build - the 4-hour bench's SIGKILL - set every session aside); the weights themselves still count."""
    from inference_engine.persistence.model_identity import model_identity

    model = shutil.copytree(tiny_model_dir("llama"), tmp_path / "model")
    st = KVStrategy("sink_window", SINK, WINDOW)
    root = tmp_path / "state"
    kept = runtime(root, st, model)
    s = kept.create_session(ids(30))
    turn(kept, s.id, 3)
    before = model_identity("m", str(model), "fp32", "torch")
    (model / ".kakeya-native-head-int4-0123abcd.safetensors").write_bytes(b"derived, made by another build")
    assert model_identity("m", str(model), "fp32", "torch") == before
    again = restarted(root, st, model)
    assert again.history(s.id) == kept.history(s.id)
    assert turn(again, s.id, 4) == turn(kept, s.id, 4)


def test_a_session_saved_with_the_derived_files_in_its_identity_still_loads(tmp_path):
    """A manifest written before the fix names weights_sha256 over the derived files too: it loads while they are what
    they were; with them changed since, it is refused as before (nothing can tell those files from weights then)."""
    from inference_engine.persistence.model_identity import legacy_weights_sha256

    model = shutil.copytree(tiny_model_dir("llama"), tmp_path / "model")
    (model / ".kakeya-packed-int4.safetensors").write_bytes(b"derived")
    st = KVStrategy("sink_window", SINK, WINDOW)
    root = tmp_path / "state"
    rt = runtime(root, st, model)
    s = rt.create_session(ids(30))
    turn(rt, s.id, 3)
    d = StateDir(root).data_dir(s.id)
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["body"]["model"]["weights_sha256"] = legacy_weights_sha256(str(model))  # as the daemon before wrote it
    (d / MANIFEST_NAME).write_bytes(state_dir.manifest_bytes(doc["body"]))
    again = restarted(root, st, model)
    assert again.history(s.id) == rt.history(s.id) and len(turn(again, s.id, 2)) == 2
    (model / ".kakeya-packed-int4.safetensors").write_bytes(b"derived, by another build")
    with pytest.raises(SessionStateUnusable, match="weights_sha256"):
        restarted(root, st, model).history(s.id)


def test_other_strategy_is_refused_and_the_files_kept(tmp_path):
    sid, _, _ = _saved_session(tmp_path)
    other = runtime(tmp_path, KVStrategy("sink_window", SINK, WINDOW))
    with pytest.raises(SessionStateUnusable, match="saved under kv strategy full"):
        other.history(sid)
    assert StateDir(tmp_path).has(sid)
    assert runtime(tmp_path, KVStrategy("full")).history(sid)


@pytest.mark.parametrize("edit,words", [
    (lambda st: st.update(far_after_v2="context"), "saved with parameter.s. far_after_v2 this daemon does not have"),
    (lambda st: st.update(name="paged_v9"), "kv strategy 'paged_v9' is not one this daemon has"),
])
def test_a_newer_daemons_strategy_is_refused_and_the_files_kept(edit, words, tmp_path):
    """A session whose manifest names a strategy or a parameter this daemon does not have (a newer daemon saved it) is
    refused with FAILED_PRECONDITION naming it, its files kept in place (not set aside: it is not damaged), and is
    never read with the parameter dropped (as a daemon before this one read `far_after`: another strategy than the
    session ran)."""
    sid, good, good_history = _saved_session(tmp_path)
    d = StateDir(tmp_path).data_dir(sid)
    doc = json.loads((d / MANIFEST_NAME).read_text())
    edit(doc["body"]["strategy"])
    (d / MANIFEST_NAME).write_bytes(state_dir.manifest_bytes(doc["body"]))  # a well-formed manifest, checksums right
    rt = runtime(tmp_path, KVStrategy("full"))
    with pytest.raises(SessionStateUnusable, match=words) as e:
        rt.append(sid, [1])
    assert e.value.code == "FAILED_PRECONDITION" and "kept in place" in str(e.value)
    assert StateDir(tmp_path).has(sid) and not list(StateDir(tmp_path).quarantine.iterdir())
    with pytest.raises(SessionStateUnusable, match=words):  # asked again: the same answer, the files still there
        rt.history(sid)
    assert rt.history(good) == good_history and len(turn(rt, good, 2)) == 2


@pytest.mark.parametrize("name", ["full", "sink_window", "paged", "paged_spilled"])
def test_a_session_moves_between_fp32_and_fp16_resident_kv(name, tmp_path):
    """--kv-dtype auto picks fp16 on some daemons and fp32 on others: a session saved under one loads under the other
    (its rows converted as they load; paged: its page store's too, in RAM or spilled), continues there, and comes
    back; int8 stays refused (its store is another format)."""
    fp32 = STRATEGIES[name]
    fp16 = dataclasses.replace(fp32, kv_dtype="fp16")
    first = runtime(tmp_path, fp32)
    s = first.create_session(ids(40))
    turn(first, s.id, 5)
    first.append(s.id, ids(20, seed=1))
    turn(first, s.id, 3)  # fp32 rows segments from both turns
    moved_root = tmp_path.parent / f"{tmp_path.name}-moved"
    shutil.copytree(tmp_path, moved_root, symlinks=True)
    moved = runtime(moved_root, fp16)
    kv = moved.store.get(s.id).kv
    assert kv.cache.store.k[0].dtype == torch.float16 and moved.history(s.id) == first.history(s.id)
    moved.append(s.id, ids(9, seed=2))
    assert len(turn(moved, s.id, 4)) == 4  # saved as fp16 rows on top of the fp32 ones
    back = restarted(moved_root, fp32)
    assert back.history(s.id) == moved.history(s.id)
    got, had = back.store.get(s.id).kv.cache.store, moved.store.get(s.id).kv.cache.store
    assert got.k[0].dtype == torch.float32 and np.array_equal(got.pos, had.pos)
    # the rows saved as fp16 load exactly; the older ones, still in their fp32 segments, load as saved (the fp16 daemon
    # held them rounded): so every row within fp16 rounding of the moved session's
    held = torch.from_numpy(np.flatnonzero(had.pos >= 0))  # the occupied slots (an evicted one keeps stale rows)
    for a, b in zip(got.k + got.v, had.k + had.v):
        a, b = a.index_select(1, held), b.index_select(1, held).float()
        assert torch.allclose(a, b, rtol=2 ** -10, atol=2 ** -24), float((a - b).abs().max())
    if name.startswith("paged"):  # the page store: fp16 rows on the fp16 daemon, back to fp32 rows within its rounding
        pages, moved_pages = back.store.get(s.id).kv.cache.pages, moved.store.get(s.id).kv.cache.pages
        assert moved_pages.codec.dtype == torch.float16 and pages.codec.dtype == torch.float32
        assert pages.rows == moved_pages.rows > 0 and (pages.cold_pages > 0) == name.endswith("spilled")
        for layer in range(len(got.k)):
            a, b = pages.read(layer), moved_pages.read(layer).float()
            assert torch.allclose(a, b, rtol=2 ** -10, atol=2 ** -24), float((a - b).abs().max())
    assert len(turn(back, s.id, 5)) == 5
    if name.startswith("paged"):  # no int8 paged daemon to move to (tests/kv/test_resident_kv_dtypes.py)
        return
    with pytest.raises(SessionStateUnusable, match="saved under kv strategy"):
        restarted(moved_root, dataclasses.replace(fp32, kv_dtype="int8")).history(s.id)


def test_a_save_that_dies_before_its_manifest_leaves_the_previous_turn(tmp_path, monkeypatch):
    st = KVStrategy("full")
    rt = runtime(tmp_path, st)
    s = rt.create_session(ids(30))
    turn(rt, s.id, 3)
    saved = rt.history(s.id)
    real = state_dir.write_atomic

    def dies_at_manifest(path, data, **kw):
        if path.name == MANIFEST_NAME:
            raise OSError("disk full (simulated)")
        return real(path, data, **kw)

    monkeypatch.setattr(session_files, "write_atomic", dies_at_manifest)
    rt.append(s.id, ids(20, seed=4))
    out = turn(rt, s.id, 3)  # the save fails; the turn does not
    assert len(out) == 3 and rt.metrics.session_save_failures_total._value.get() == 1
    monkeypatch.setattr(session_files, "write_atomic", real)
    resumed = runtime(tmp_path, st)
    assert resumed.history(s.id) == saved  # the previous turn, whole
    ref = runtime(tmp_path / "ref", st)
    r = ref.create_session(saved)
    assert turn(resumed, s.id, 5) == turn(ref, r.id, 5)
    # and the leftover segments of the failed save were collected by the next one
    d = StateDir(tmp_path).data_dir(s.id)
    assert {p.name for p in d.iterdir()} == {g["file"] for g in manifest(tmp_path, s.id)["segments"]} | {MANIFEST_NAME, OWNER_NAME}


def test_resume_after_a_restart_matches_prefilling_the_history(tmp_path):
    """INV-3 across a restart: a resumed session's continuation equals a fresh session's over the same history."""
    st = KVStrategy("full")
    rt = runtime(tmp_path, st)
    s = rt.create_session(ids(64))
    turn(rt, s.id, 10)
    resumed = restarted(tmp_path, st)
    fresh = runtime(tmp_path / "fresh", st)
    f = fresh.create_session(resumed.history(s.id))
    assert turn(resumed, s.id, 12) == turn(fresh, f.id, 12)
    assert np.array_equal(resumed.history(s.id)[:74], rt.history(s.id))


def test_a_store_without_row_access_is_saved_whole_and_resumes(tmp_path, monkeypatch):
    """Stores that read no rows per slot (row_axes None) go into the tail whole: correct, not incremental."""
    from inference_engine.kv.stores import SlabStore

    monkeypatch.setattr(SlabStore, "row_axes", None)
    st = KVStrategy("sink_window", SINK, WINDOW)
    kept = runtime(tmp_path, st)
    s = kept.create_session(ids(40))
    turn(kept, s.id, 5)
    body = manifest(tmp_path, s.id)
    assert not [g for g in body["segments"] if g["kind"] == "rows"]
    resumed = restarted(tmp_path, st)
    assert turn(resumed, s.id, 8) == turn(kept, s.id, 8)


def test_paged_archived_pages_are_append_segments(tmp_path, monkeypatch):
    """A paged session's archive grows with the history; a save writes only the rows archived since the last,
    and reads only those out of the cache (not a copy of the whole archive)."""
    from inference_engine.kv.paged_store import RowTable

    st = STRATEGIES["paged"]
    kept = runtime(tmp_path, st)
    s = kept.create_session(ids(60))
    turn(kept, s.id, 3)
    archived = s.kv.cache.pages.rows
    assert archived > 0
    read_from = []
    state = RowTable.state  # the page store's, the keys' and far_keys' (SpillingRowTables)
    monkeypatch.setattr(RowTable, "state", lambda self, start=0, **kw: read_from.append(start) or state(self, start, **kw))
    for k in range(3):
        kept.append(s.id, ids(10, seed=k))
        read_from.clear()
        turn(kept, s.id, 3)
        assert read_from == [archived] * 3  # pages, keys and far_keys, from the first row not saved yet
        body = manifest(tmp_path, s.id)
        last = [g for g in body["segments"] if g["kind"] == "append"][-1]
        assert (last["start"], last["end"]) == (archived, s.kv.cache.pages.rows)
        archived = s.kv.cache.pages.rows
        tail = next(g for g in body["segments"] if g["kind"] == "tail")
        assert not [k for k in load_file(str(StateDir(tmp_path).data_dir(s.id) / tail["file"])) if k.startswith("pages.")]
    resumed = restarted(tmp_path, st)
    kept.append(s.id, [9, 8])
    resumed.append(s.id, [9, 8])
    assert turn(resumed, s.id, 6) == turn(kept, s.id, 6)
    assert torch.equal(resumed.store.get(s.id).kv.last_logits, kept.store.get(s.id).kv.last_logits)


def test_a_save_reads_the_archive_a_piece_at_a_time(tmp_path, monkeypatch):
    """A save writes a paged session's new archive rows into the segment (`safetensors_pieces`) one (layer, K/V, KV
    head) piece at a time, from both tiers of a spilled table: it never holds more of them at once (a 32k-token
    turn's fp32 pages are 1.5 GB, a copy of them and the serialized bytes twice that); the session resumes the same."""
    from inference_engine.kv.paged_store import RowTable, SpillingRowTable

    st = STRATEGIES["paged_spilled"]
    kept = runtime(tmp_path, st)
    s = kept.create_session(ids(60))
    turn(kept, s.id, 3)
    assert s.kv.cache.pages.cold_nbytes > 0  # rows in the spill file and in the ring
    spans = []
    for cls in (RowTable, SpillingRowTable):
        def spy(self, a, b, at=(), span=cls.span):
            spans.append((at, self.spilled))
            return span(self, a, b, at)

        monkeypatch.setattr(cls, "span", spy)
    kept.append(s.id, ids(40, seed=1))
    turn(kept, s.id, 3)
    g = s.kv.cache.geometry
    assert spans and {len(at) for at, _ in spans} == {3}  # a piece at a time, never more
    assert ((0, 0, 0), True) in spans and ((g.num_layers - 1, 1, g.num_kv_heads - 1), True) in spans  # spilled ones too
    resumed = restarted(tmp_path, st)
    kept.append(s.id, [9, 8])
    resumed.append(s.id, [9, 8])
    assert turn(resumed, s.id, 6) == turn(kept, s.id, 6)


@pytest.mark.parametrize("name", ["paged", "paged_spilled"])
def test_a_load_reads_the_archive_segments_in_turn(tmp_path, monkeypatch, name):
    """A paged session saved over several turns (an append segment each) loads its archive segment after segment
    into its tables (slot_cache.Pieces), never one concatenated copy of the whole archive; it resumes the same."""
    from inference_engine.kv import paged_store
    from inference_engine.kv.slot_cache import Pieces

    st = STRATEGIES[name]
    kept = runtime(tmp_path, st)
    s = kept.create_session(ids(60))
    turn(kept, s.id, 3)
    for k in range(3):
        kept.append(s.id, ids(20, seed=k))
        turn(kept, s.id, 3)
    appends = [g for g in manifest(tmp_path, s.id)["segments"] if g["kind"] == "append"]
    assert len(appends) == 4
    monkeypatch.setattr(Pieces, "tensor", lambda self: pytest.fail("a load concatenated the archive's segments"))
    pieces = []
    in_pieces = paged_store._in_pieces
    monkeypatch.setattr(paged_store, "_in_pieces", lambda tensors: pieces.append(len(in_pieces(tensors))) or in_pieces(tensors))
    resumed = restarted(tmp_path, st)
    kept.append(s.id, [9, 8])
    resumed.append(s.id, [9, 8])
    assert turn(resumed, s.id, 6) == turn(kept, s.id, 6)
    assert pieces[:2] == [4, 4]  # the page store's and the compact keys' rows, a segment at a time


def test_a_segment_written_in_pieces_is_the_safetensors_file_of_its_tensors(tmp_path):
    """`safetensors_pieces`: tensors of every dtype a state holds, empty ones, and a lazily read one (`pieces()`),
    written through `write_atomic_pieces`: safetensors' own loader and the segment reader read back the same
    tensors, and the manifest's size and checksum are the file's."""
    from safetensors.torch import load as st_load

    from inference_engine.persistence.session_files import ST_DTYPES, safetensors_pieces, segment_tensors
    from inference_engine.persistence.state_dir import segment_checksum, write_atomic_pieces

    g = torch.Generator().manual_seed(0)
    tensors = {f"t.{name}": (torch.randn(3, 5, generator=g) * 50).to(dtype) for name, dtype in ST_DTYPES.items()}
    tensors |= {"empty": torch.zeros(2, 0, 4), "scalar": torch.tensor(7, dtype=torch.int64)}

    class Lazy:  # what a RowSpan gives: shape, dtype, the bytes in order over its first axis
        def __init__(self, t):
            self.t, self.shape, self.dtype = t, tuple(t.shape), t.dtype

        def pieces(self):
            yield from self.t.unbind(0)

    big = torch.randn(4, 3, 7, generator=g)
    pieces = tensors | {"lazy": Lazy(big), "lazy_empty": Lazy(torch.zeros(3, 0, dtype=torch.float16))}
    path = tmp_path / "seg.safetensors"
    done = write_atomic_pieces(path, safetensors_pieces(pieces), sync_dir=False)
    data = path.read_bytes()
    assert done == {"bytes": len(data), **segment_checksum(data)}
    assert int.from_bytes(data[:8], "little") % 8 == 0
    want = tensors | {"lazy": big, "lazy_empty": torch.zeros(3, 0, dtype=torch.float16)}
    for got in (st_load(data), segment_tensors(tmp_path, {"file": path.name, **done})):
        assert got.keys() == want.keys()
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    assert not [p for p in tmp_path.iterdir() if p.name != path.name]  # no temporary file left


def test_one_daemon_per_state_dir(tmp_path):
    from inference_engine.server.app import build_persister
    from inference_engine.server.config import ConfigError, ServeConfig

    e = engine(KVStrategy("full"))
    first = build_persister(ServeConfig(state_dir=str(tmp_path)), e)
    with pytest.raises(ConfigError, match="another kakeya daemon is using the state directory"):
        build_persister(ServeConfig(state_dir=str(tmp_path)), e)
    assert build_persister(ServeConfig(state_dir=str(tmp_path), persist="off"), e) is None
    first._lock_file.close()  # the holder goes away (a killed daemon's lock goes with its process)
    build_persister(ServeConfig(state_dir=str(tmp_path)), e)._lock_file.close()


def test_paged_far_keys_are_saved_again_after_a_load_without_them(tmp_path, monkeypatch):
    """A session saved without far_keys (by a build before they were saved) makes them from its page store at its
    first step after a load; its next save writes every archived row again, far_keys with them (its append segments
    start over), so the load after that reads them instead of making them. The logits stay the never-stopped
    session's."""
    from inference_engine.kv.paged import PagedCache

    st = STRATEGIES["paged"]
    real_extra, real_load = PagedCache._extra_state, PagedCache._load_extra_state
    loads = []

    def spy_load(self, tensors, meta):
        real_load(self, tensors, meta)
        loads.append((self.pages.rows, self.far_keys.rows))

    def older_build(self, appended_from, lazy=False):
        tensors, meta = real_extra(self, appended_from, lazy)
        return {k: v for k, v in tensors.items() if not k.startswith("far_keys.")}, meta

    monkeypatch.setattr(PagedCache, "_load_extra_state", spy_load)
    monkeypatch.setattr(PagedCache, "_extra_state", older_build)
    root = tmp_path / "state"
    kept = runtime(root, st)
    s = kept.create_session(ids(60))
    turn(kept, s.id, 3)
    monkeypatch.setattr(PagedCache, "_extra_state", real_extra)
    first = restarted(root, st)
    assert turn(first, s.id, 5) == turn(kept, s.id, 5)  # far_keys made at the first step, then saved whole
    archived = first.store.get(s.id).kv.cache.pages.rows
    assert loads[-1][1] == 0 and [g["start"] for g in manifest(root.parent / "state-restart-0", s.id)["segments"]
                                  if g["kind"] == "append"] == [0]
    second = restarted(root.parent / "state-restart-0", st)
    assert turn(second, s.id, 5) == turn(kept, s.id, 5)
    assert loads[-1] == (archived, archived)  # read from the files this time
    assert torch.equal(second.store.get(s.id).kv.last_logits, kept.store.get(s.id).kv.last_logits)


def test_paged_far_after_context_re_encoded_session_is_saved_whole_and_resumes(tmp_path):
    """far_after "context": a session past far_from crossing the trained context is re-encoded into a new cache
    (Engine._switch_far); its next save writes that cache whole (none of the earlier rows hold), and a restart after it
    - or one before the crossing, which then crosses in the new daemon - continues as the never-stopped session."""
    short = tiny_model_dir("llama", max_position_embeddings=64)
    st = KVStrategy("paged", 4, 12, page_size=8, recall_pages=2, far_from=40, far_after="context")
    root = tmp_path / "state"
    kept = runtime(root, st, short)
    s = kept.create_session(ids(50))
    turn(kept, s.id, 4)  # positions up to 53: past far_from, under the context
    first_files = {g["file"] for g in manifest(root, s.id)["segments"] if g["kind"] != "history"}
    early = restarted(root, st, short)  # a restart before the crossing
    for rt in (kept, early):
        rt.append(s.id, ids(20, seed=1))
    crossed = turn(kept, s.id, 4)
    assert turn(early, s.id, 4) == crossed  # the resumed session crosses (re-encodes) as the never-stopped one
    kv = kept.store.get(s.id).kv
    assert kv.epoch == 1 and kv.cache.far_from == 40
    # its 53 positions, once, all of them (fp32 weights: no copy, Engine._chunk_invariant)
    assert kept.metrics.registry.get_sample_value("reencoded_tokens_total") == 53
    body = manifest(root, s.id)
    assert body["cache_meta"]["session.epoch"] == 1
    assert not first_files & {g["file"] for g in body["segments"]}  # saved whole: no earlier row or append segment
    assert [g["start"] for g in body["segments"] if g["kind"] == "append"] == [0]
    late = restarted(root, st, short)  # a restart after it
    for rt in (kept, early, late):
        rt.append(s.id, [9, 8])
    want = turn(kept, s.id, 6)
    assert turn(late, s.id, 6) == want and turn(early, s.id, 6) == want
    for rt in (early, late):
        got = rt.store.get(s.id).kv
        assert got.epoch == 1 and got.cache.far_from == 40
        assert torch.equal(got.last_logits, kept.store.get(s.id).kv.last_logits)


def test_a_paged_session_saved_under_the_trained_context_loads_where_far_from_applies_past_it(tmp_path):
    """A session saved with far_from at the trained context (paged's default before 2026-12-01) loads into a daemon
    whose far_from applies once past the context: it is that session until then (the same tokens as the never-stopped
    one under the context), and its first step past the context re-encodes it. The other way it is refused."""
    short = tiny_model_dir("llama", max_position_embeddings=64)
    old = KVStrategy("paged", 4, 12, page_size=8, recall_pages=2)
    new = dataclasses.replace(old, far_from=40, far_after="context")
    root = tmp_path / "state"
    kept = runtime(root, old, short)
    s = kept.create_session(ids(45))
    turn(kept, s.id, 4)
    moved = restarted(root, new, short)
    for rt in (kept, moved):
        rt.append(s.id, [7, 8])
    assert turn(moved, s.id, 6) == turn(kept, s.id, 6)  # positions up to 56: under the context, the same bits
    assert moved.store.get(s.id).kv.epoch == 0
    moved.append(s.id, ids(20, seed=2))
    turn(moved, s.id, 3)
    kv = moved.store.get(s.id).kv
    assert (kv.epoch, kv.cache.far_from, kv.cache.far_target, kv.next_position) == (1, 40, 40, 79)
    back = restarted(tmp_path / "state-restart-0", old, short)  # saved under far_after "context": refused by the old
    with pytest.raises(SessionStateUnusable, match="far_after=context"):
        back.history(s.id)


def test_a_paged_session_is_resumed_under_the_daemons_choice_every(tmp_path):
    """--page-choice-every is how often queries past the context choose their pages, not what a session holds: a session
    saved between two choice positions resumes under the same N as the never-stopped one (its kept choice saved with
    it: the same tokens), and under another N it loads too (restarting a daemon with another setting keeps its
    sessions), continuing under that N."""
    short = tiny_model_dir("llama", max_position_embeddings=64)
    four = KVStrategy("paged", 4, 12, page_size=8, recall_pages=2, choice_every=4)
    root = tmp_path / "state"
    kept = runtime(root, four, short)
    s = kept.create_session(ids(80))
    turn(kept, s.id, 3)  # positions to 82: the kept choice made at 80
    assert kept.store.get(s.id).kv.cache._choice_pos == 80
    same = restarted(root, four, short)
    one = restarted(root, dataclasses.replace(four, choice_every=1), short)
    for rt in (kept, same, one):
        rt.append(s.id, [7, 8])
    want = turn(kept, s.id, 8)
    assert turn(same, s.id, 8) == want
    assert len(turn(one, s.id, 8)) == 8 and one.store.get(s.id).kv.cache.choice_every == 1


def test_a_saved_page_choice_of_the_wrong_shape_sets_the_session_aside(tmp_path):
    """The kept choice is checked as it loads (shape, dtype, pages the session holds): a damaged one is an unusable
    session, not an out-of-range read in the native recall."""
    from inference_engine.kv.factory import make_cache

    m = load_model(str(tiny_model_dir("llama", max_position_embeddings=64)))
    s = KVStrategy("paged", 4, 12, page_size=8, recall_pages=2, choice_every=4)
    a = make_cache(s, m.geometry(), max_step=16, max_context=64)
    from factories import feed

    feed(m, a, ids(70), 1, row_exact=True)
    for bad in (torch.zeros(2, 2, dtype=torch.long), torch.full(tuple(a._choice.shape), 999, dtype=torch.long)):
        st = a.state()
        st.tensors["choice.pages"] = bad
        with pytest.raises(ValueError, match="the saved page choice must be"):
            make_cache(s, m.geometry(), max_step=16, max_context=64).load_state(st)
