"""SessionFiles: the SessionPersister that keeps sessions in a StateDir as safetensors segments.

A save writes, each under a new sequence number `seq`:

    <seq>-history.safetensors  tokens appended since the last save                  (append-only)
    <seq>-rows.safetensors     the stored rows (codes, for a compressed store) of the positions
                               committed since the last save that are still resident  (append-only)
    <seq>-tail.safetensors     the rest of the cache state: slot map, last logits, drafter
                               features, the strategy's own tensors (small; replaced each save)
    session.json               the manifest naming them (model identity, strategy, cache meta,
                               sha256 per segment), replaced last: the save's commit point

What changed since the last save is the cache's to say (`SessionKV.delta_state(SaveMark)`: the
slot map, the rows of positions committed since, the rest of its state, and the new rows of the
tables it declares append-only, written as `<seq>-append.safetensors` segments); this module
knows segments and the manifest, not strategies or stores.
A committed position's row never changes, so a rows segment is never rewritten: a turn writes
only what it added. A bounded strategy's positions leave the resident set; once the rows on disk
exceed twice the resident rows, one compacted rows segment of the resident rows replaces them
(amortised, still proportional to what was added). History segments are merged past 32.
Loading rebuilds the CacheState `SessionKV.state()` would have produced (rows of empty slots are
zeros: masked, never read) and hands it to `SessionKV.from_state`. Segments are read as tensors
viewing the file's map (`segment_tensors`): a row is copied once, from the page cache into the
rebuilt store; only the small tail is cloned (it outlives the load).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import torch

from inference_engine.engine.session_kv import SessionKV
from inference_engine.errors import SessionOwnedElsewhere, SessionStateUnusable
from inference_engine.kv.registry import StrategyUnknownHere, strategy_from_dict
from inference_engine.kv.slot_cache import CacheState, Pieces, SaveMark
from inference_engine.kv.strategy import KVStrategy
from inference_engine.persistence.leases import DEFAULT_TTL_S, Lease, Leases
from inference_engine.persistence.model_identity import identity_mismatch, legacy_weights_sha256, model_identity
from inference_engine.persistence.state_dir import (MANIFEST_NAME, RELEASED_NAME, StateDir, StateFileError, check_segment, fsync_dir,
                                                    manifest_bytes, read_manifest, read_segment, write_atomic, write_atomic_pieces)
from inference_engine.session.store import PersistedSession

log = logging.getLogger(__name__)

ROW_PREFIX = "row."
HISTORY_SEGMENTS_MAX = 32
ROWS_SEGMENTS_MAX = 64
APPEND_SEGMENTS_MAX = 64
COMPACT_SLACK_ROWS = 64
RUNS_MAX = 64  # a rows segment's rows land in at most this many runs of slots: block copies (else one indexed copy)
SLOT_MAP = "store.pos"  # the tail's slot map (position per slot, -1 empty), for rows saved per slot
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
             "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def segment_tensors(session_dir, seg: dict, checks: list | None = None) -> dict:
    """A checked segment's tensors as views of its map (no copy; the map lives as long as they do).
    With `checks` (a list), the checksum runs on a background thread, beside whatever the caller does
    with the tensors, and its future is appended: the caller waits for it (`wait_checks`) before it
    trusts anything it read. The safetensors layout: 8-byte little-endian header size, JSON header
    (name -> dtype, shape, data_offsets relative to the end of the header), data."""
    buf = read_segment(session_dir, seg, check=checks is None)
    if checks is not None:
        checks.append(_checker().submit(check_segment, seg, buf))
    n = int.from_bytes(buf[:8], "little")
    if len(buf) < 8 or 8 + n > len(buf):
        raise StateFileError(f"segment {seg['file']} is not a safetensors file (header of {n} bytes)")
    header = json.loads(bytes(buf[8:8 + n]))
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = ST_DTYPES.get(info["dtype"])
        start, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if dtype is None or end - start != count * dtype.itemsize or base + end > len(buf):
            raise StateFileError(f"segment {seg['file']}: tensor {name!r} ({info}) does not fit the file")
        t = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0, dtype=dtype)
        out[name] = t.view(info["shape"])
    return out


def _joined(parts: list, axis: int):
    """Append segments' views of one tensor, in order, as the loading cache takes them (Pieces)."""
    return Pieces(parts, axis)


def safetensors_pieces(tensors: dict):
    """A safetensors file of `tensors`, as bytes-like pieces in order, for `write_atomic_pieces`: each value a tensor
    or a lazily read one (`shape`, `dtype` and `pieces()`, tensors whose bytes in order are the tensor's, as
    `kv.paged_store.RowSpan` has them), so the file is written without its payload ever whole in memory: safetensors
    itself serializes from tensors in memory only, and copies each into a bytes object first (`save` returns the
    whole file as one; `save_file` too holds a tensor's bytes copy), twice a segment's size at the peak. The layout
    is its own: 8-byte little-endian header size, the JSON header padded with spaces to a multiple of 8, then the
    tensors back to back, wider dtypes first so each starts aligned to its element size."""
    names = {dtype: name for name, dtype in ST_DTYPES.items()}
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header, at = {}, 0
    for k in order:
        t = tensors[k]
        n = int(np.prod(t.shape, dtype=np.int64)) * t.dtype.itemsize
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield len(text).to_bytes(8, "little") + text
    for k in order:
        t = tensors[k]
        for piece in t.pieces() if not isinstance(t, torch.Tensor) else [t]:
            if piece.numel():
                yield piece.contiguous().reshape(-1).view(torch.uint8).numpy()


_checker_pool: ThreadPoolExecutor | None = None
_checker_lock = threading.Lock()


def _checker() -> ThreadPoolExecutor:
    """One thread for segment checksums (zlib releases the GIL over large buffers), made on first use."""
    global _checker_pool
    with _checker_lock:
        if _checker_pool is None:
            _checker_pool = ThreadPoolExecutor(1, thread_name_prefix="kakeya-segment-check")
        return _checker_pool


def wait_checks(checks: list) -> None:
    """Wait for every checksum in `checks`; StateFileError for the first segment that does not match."""
    errors = [f.exception() for f in checks]
    checks.clear()
    for e in errors:
        if e is not None:
            raise e


@dataclass(frozen=True)
class _Template:
    """What every load of this engine's sessions needs of a fresh session (built once)."""

    hidden_keep: int
    row_axes: dict | None  # payload name -> slot axis; None: a store saved whole
    payload: dict  # payload name -> (shape with 0 slots, dtype)
    append_axes: dict  # append-only tensor name -> row axis ({} when the cache has none)
    append_rows_key: str | None  # the cache meta key holding their row count


class SessionFiles:
    """Sessions of one engine (model + strategy) under `state_dir`."""

    def __init__(self, state_dir: StateDir, engine, *, exclusive: bool = False, shared: bool = False,
                 lease_ttl_s: float = DEFAULT_TTL_S, daemon_id: str | None = None):
        """exclusive: hold the directory's lock (what a daemon does; tests that play two daemons in
        one process leave it off). shared: other live daemons use the directory too (`kakeya serve
        --shared-state-dir`): their session leases are honoured until they expire (`lease_ttl_s`)."""
        if exclusive and shared:
            raise ValueError("a shared state directory is not held exclusively")
        self.dir = state_dir.create()
        self._lock_file = state_dir.lock() if exclusive else None
        self.leases = Leases(state_dir, shared=shared, ttl_s=lease_ttl_s, daemon_id=daemon_id)
        self.engine = engine
        info = engine.model_info
        self.identity = model_identity(info.model_id, info.path, info.weights, info.backend)
        self._model_path = info.path
        self.bytes_written = 0  # since start
        self._fresh: _Template | None = None  # see _template
        self.closed = False

    def close(self) -> None:
        """Stop saving and release the directory's lock, so that another daemon (in this process
        too) can take the directory; a save after close fails (counted, logged) instead of writing."""
        self.closed = True
        self.leases.stop()
        if self._lock_file is not None:
            self._lock_file.close()  # closing the file drops its flock (closing it again is a no-op)

    # -- SessionPersister ---------------------------------------------------------------
    def has(self, session_id: str) -> bool:
        """Saved here, or held by a daemon (maybe another one, not saved yet)."""
        return self.dir.has(session_id) or self.leases.known(session_id)

    def claim(self, session_id: str) -> Lease:
        return self.leases.claim_new(session_id)

    def check(self, session) -> None:
        if session.lease is not None:
            self.leases.check(session.lease)

    def release(self, session) -> None:
        if session.lease is not None:
            self.leases.release(session.lease)

    def delete(self, session_id: str, session=None) -> None:
        """Remove the session's files. `session`: the live session this daemon holds; without it (the
        session is only on disk here) a session another live daemon holds is not deleted."""
        if session is None or session.lease is None:
            holder = self.leases.holder_of(session_id)
            d = self.dir.data_dir(session_id)
            if holder and self.leases.alive(holder) and not (d / RELEASED_NAME).exists():
                raise SessionOwnedElsewhere(f"session {session_id!r} is held by daemon {holder}; close it through it "
                                            f"(retry: the SDKs do)", holder)
        self.dir.delete(session_id)

    def set_aside(self, session_id: str, reason: str) -> str | None:
        dest = self.dir.set_aside(session_id)
        if dest is not None:
            (dest / "SET_ASIDE_REASON.txt").write_text(reason + "\n")
            log.warning("session %s set aside to %s: %s", session_id, dest, reason)
        return str(dest) if dest is not None else None

    def save(self, session) -> None:
        """Write what changed. The files go to the directory of the session's lease generation: once
        another daemon fenced it, every write fails and LeaseLost is raised (nothing of this save counts)."""
        if self.closed:
            raise RuntimeError(f"session {session.id!r} not saved: the state directory {self.dir.root} was released "
                               "(its daemon stopped)")
        lease = session.lease
        if lease is None:
            raise RuntimeError(f"session {session.id!r} holds no lease in {self.dir.root}")
        self.leases.check(lease)
        try:
            self._save(session, lease.path)
        except OSError:
            self.leases.check(lease)  # a write refused because the generation was fenced meanwhile: LeaseLost
            raise

    def _save(self, session, d) -> None:
        kv, history = session.kv, session.history
        prev = session.saved
        seq = prev["seq"] + 1 if prev else 1
        segments = list(prev["segments"]) if prev else []
        written = 0

        def write(kind: str, tensors: dict, **extra) -> dict:
            nonlocal written
            name = f"{seq:08d}-{kind}.safetensors"
            done = write_atomic_pieces(d / name, safetensors_pieces(tensors), sync_dir=False)  # no copy of the file whole
            written += done["bytes"]
            return {"file": name, "kind": kind, **done, **extra}

        # history: the appended tokens (all of it again once there are too many segments)
        done = prev["history_length"] if prev else 0
        if len(history) > done:
            if sum(g["kind"] == "history" for g in segments) >= HISTORY_SEGMENTS_MAX:
                segments, done = [g for g in segments if g["kind"] != "history"], 0
            tokens = torch.tensor(history[done:], dtype=torch.int32)
            segments.append(write("history", {"tokens": tokens}, start=done, end=len(history)))

        # what the cache holds beyond what the segments kept hold (append segments: all again past the limit)
        since = SaveMark(prev["rows_through"], prev.get("appended_rows", 0)) if prev else SaveMark()
        if prev and prev["cache_meta"].get("session.epoch", 0) != kv.epoch:
            # the cache was made again from the session's tokens (Engine._switch_far): none of its rows on disk hold
            segments, since = [g for g in segments if g["kind"] == "history"], SaveMark()
        if sum(g["kind"] == "append" for g in segments) >= APPEND_SEGMENTS_MAX:
            segments, since = [g for g in segments if g["kind"] != "append"], SaveMark(since.rows_through, 0)
        delta = kv.delta_state(since)

        # rows: resident positions committed since the last save (or, compacting, every resident one)
        pos = delta.pos
        resident = pos >= 0
        slots = delta.new_slots
        on_disk = sum(g["rows"] for g in segments if g["kind"] == "rows")
        if delta.row_axes is None:  # the store is in the tail whole
            segments, slots = [g for g in segments if g["kind"] != "rows"], slots[:0]
        elif on_disk and (on_disk + slots.size > 2 * int(resident.sum()) + COMPACT_SLACK_ROWS
                          or sum(g["kind"] == "rows" for g in segments) >= ROWS_SEGMENTS_MAX):
            segments = [g for g in segments if g["kind"] != "rows"]
            slots = np.flatnonzero(resident)
        if slots.size:
            rows = delta.read_rows(slots)
            segments.append(write("rows", {"positions": torch.from_numpy(pos[slots].copy())}
                                  | {ROW_PREFIX + n: t for n, t in rows.items()}, rows=int(slots.size)))

        # tail: everything else, small; replaced (the whole store too, for a store saved whole)
        st = delta.state
        tail = dict(st.tensors) | {SLOT_MAP: torch.from_numpy(pos)}
        appended = 0
        grown = delta.appended
        if grown is not None:  # grown tables: the new rows only, as "append" segments
            if grown.start != since.appended_rows:  # the cache gave every row again: start over
                segments = [g for g in segments if g["kind"] != "append"]
            appended = grown.end
            if appended:  # (with no rows yet the empty tables stay in the tail)
                if appended > grown.start:
                    part = {k: tail[k] for k in grown.axes}  # rows start .. end - 1
                    segments.append(write("append", part, start=grown.start, end=appended))
                tail = {k: v for k, v in tail.items() if k not in grown.axes}
        segments = [g for g in segments if g["kind"] != "tail"] + [write("tail", tail)]
        fsync_dir(d)  # the segments are durable before the manifest that names them

        now = time.time()
        body = {
            "session_id": session.id, "seq": seq, "saved_at": now, "created_at": prev["created_at"] if prev else now,
            "model": self.identity, "strategy": asdict(self.engine.strategy), "cache_meta": st.meta,
            "eos_token_ids": sorted(int(t) for t in session.eos_token_ids), "history_length": len(history),
            "next_position": kv.next_position, "rows_through": kv.next_position, "appended_rows": appended,
            "segments": segments,
        }
        data = manifest_bytes(body)
        write_atomic(d / MANIFEST_NAME, data)
        self.bytes_written += written + len(data)
        self.dir.collect_leftovers(d, {g["file"] for g in segments})
        session.saved = body

    def load(self, session_id: str) -> PersistedSession:
        """Take the session's lease over (SessionOwnedElsewhere while a live daemon holds it) and rebuild
        it from the files of the newest saved generation."""
        lease = self.leases.acquire(session_id)
        try:
            return self._load(session_id, lease)
        except BaseException:
            self.leases.release(lease)  # e.g. another strategy: kept in place for a daemon that serves it
            raise

    @functools.cached_property
    def _legacy_weights(self) -> str | None:
        """legacy_weights_sha256 of the model, made on the first mismatch only (it hashes the derived files)."""
        return legacy_weights_sha256(self._model_path)

    def _load(self, session_id: str, lease: Lease) -> PersistedSession:
        d = lease.path
        try:
            body = read_manifest(d)
        except StateFileError as e:
            self._unusable(session_id, str(e))
        saved_model = body.get("model") or {}
        problem = identity_mismatch(saved_model, self.identity)
        if problem and saved_model.get("weights_sha256") == self._legacy_weights and not identity_mismatch(
                dict(saved_model, weights_sha256=self.identity["weights_sha256"]), self.identity):
            problem = None  # saved before the identity left the derived start-up files out, which have not changed since
        if problem:
            self._unusable(session_id, problem)
        try:
            saved_strategy = strategy_from_dict(body["strategy"])
        except StrategyUnknownHere as e:  # the files are fine: kept in place for a daemon that reads them
            raise SessionStateUnusable(f"session {session_id!r} cannot be resumed by this daemon: {e}. Its files are "
                                       f"kept in place: resume it with the daemon that saved it, or remove it with "
                                       f"`kakeya sessions rm {session_id}`") from None
        except (TypeError, ValueError, KeyError) as e:
            self._unusable(session_id, f"its manifest names no valid kv strategy ({e})")
        if not same_strategy(saved_strategy, self.engine.strategy):
            # The files are fine; this daemon was started with other settings. Kept in place.
            raise SessionStateUnusable(
                f"session {session_id!r} was saved under kv strategy {_strategy_text(saved_strategy)}; this daemon "
                f"serves {_strategy_text(self.engine.strategy)}. Restart it with the session's settings, or remove the "
                f"session with `kakeya sessions rm {session_id}`")
        try:
            kv, history = self._rebuild(d, body)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the files, this session only
            self._unusable(session_id, f"{type(e).__name__}: {e}")
        return PersistedSession(kv=kv, history=history, eos_token_ids=frozenset(body["eos_token_ids"]), saved=body,
                                lease=lease)

    # -- loading ----------------------------------------------------------------------------
    def _rebuild(self, d, body: dict):
        segments = body["segments"]
        history: list = []
        for g in sorted((g for g in segments if g["kind"] == "history"), key=lambda g: g["start"]):
            if g["start"] != len(history):
                raise StateFileError(f"history segment {g['file']} starts at {g['start']}, expected {len(history)}")
            history.extend(segment_tensors(d, g)["tokens"].tolist())
        if len(history) != body["history_length"]:
            raise StateFileError(f"history segments hold {len(history)} tokens, the manifest says {body['history_length']}")
        tails = [g for g in segments if g["kind"] == "tail"]
        if len(tails) != 1:
            raise StateFileError(f"the manifest names {len(tails)} tail segments, expected 1")
        tail = {k: v.clone() for k, v in segment_tensors(d, tails[0]).items()}  # kept by the cache: not a view of the file
        e = self.engine
        t = self._template()
        hidden_keep, axes = t.hidden_keep, t.row_axes
        tail |= self._appended(d, body, t)
        # saved under the other of fp32 / fp16 resident K/V, or (paged) with far_from at the trained context where this
        # daemon applies far_from once past it (same_strategy): the cache is this daemon's kind
        mine = {"kv_dtype": e.strategy.kv_dtype} | (
            {"far_from": e.strategy.far_from, "far_after": e.strategy.far_after,
             "choice_every": e.strategy.choice_every} if e.strategy.name == "paged" else {})
        meta = dict(body["cache_meta"], strategy=dict(body["cache_meta"]["strategy"], **mine))
        if any(k.startswith("store.") and k != SLOT_MAP for k in tail):  # a store saved whole
            kv = SessionKV.from_state(CacheState(tail, meta), e.model.geometry(), max_step=e.prefill_chunk,
                                      max_context=e.max_context, resources=e.strategy_resources, hidden_keep=hidden_keep)
            return kv, history
        pos = tail.pop(SLOT_MAP).numpy().astype(np.int64)
        if axes is None:
            raise StateFileError("the rows were saved incrementally, but this daemon's cache store saves whole states")
        payload = {}
        for n, (shape, dtype) in t.payload.items():
            shape = list(shape)
            shape[axes[n]] = pos.size
            payload[n] = torch.empty(shape, dtype=dtype)  # resident rows copied in below, empty slots zeroed
        # The rows segments' checksums run on another thread while their rows are copied (both read the
        # same page-cache pages); nothing is trusted before they match, and a corrupted segment is reported
        # as such, not as whatever its bytes made the parsing do.
        checks: list = []
        try:
            res_slots, filled = self._copy_rows(d, segments, pos, payload, axes, checks)
        except BaseException:
            wait_checks(checks)
            raise
        wait_checks(checks)
        missing = res_slots[~filled[res_slots]]
        if missing.size:
            raise StateFileError(f"rows of {missing.size} resident positions are missing (first: position {pos[missing[0]]})")
        empty = np.flatnonzero(~filled)  # a few runs (full: the room past the last position): zeroed block by block
        if empty.size:
            cuts = np.flatnonzero(np.diff(empty) != 1) + 1
            for n, dst in payload.items():
                if cuts.size < RUNS_MAX:
                    for r in np.split(empty, cuts):
                        dst.narrow(axes[n], int(r[0]), r.size).zero_()
                else:
                    dst.index_fill_(axes[n], torch.from_numpy(empty), 0)
        tensors = tail | {SLOT_MAP: torch.from_numpy(pos)} | {f"store.{n}": x for n, x in payload.items()}
        kv = SessionKV.from_state(CacheState(tensors, meta), e.model.geometry(), max_step=e.prefill_chunk,
                                  max_context=e.max_context, resources=e.strategy_resources, hidden_keep=hidden_keep)
        if kv.next_position > len(history):
            raise StateFileError(f"the cache holds {kv.next_position} positions but the history only {len(history)} tokens")
        return kv, history

    @staticmethod
    def _copy_rows(d, segments: list, pos: np.ndarray, payload: dict, axes: dict, checks: list):
        """Copy the rows segments' rows of the resident positions into their slots of `payload`;
        returns (resident slots, which slots were filled)."""
        res_slots = np.flatnonzero(pos >= 0)
        order = np.argsort(pos[res_slots], kind="stable")
        sorted_pos = pos[res_slots][order]
        filled = np.zeros(pos.size, dtype=bool)
        for g in (g for g in segments if g["kind"] == "rows"):
            seg = segment_tensors(d, g, checks)
            if not sorted_pos.size:
                continue
            positions = seg["positions"].numpy()
            at = np.clip(np.searchsorted(sorted_pos, positions), 0, sorted_pos.size - 1)
            hit = sorted_pos[at] == positions
            if not hit.any():
                continue
            src_ids = np.flatnonzero(hit)  # the segment's rows still resident ...
            slot_ids = res_slots[order[at[hit]]]  # ... and their slots
            # rows saved in slot order (the usual case) land in a few runs of consecutive rows and slots: block
            # copies straight from the map (a compacted segment's rows of evicted positions only cut the runs)
            cuts = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(slot_ids) != 1)) + 1
            runs = np.split(np.arange(slot_ids.size), cuts) if cuts.size <= RUNS_MAX else None
            for n, dst in payload.items():
                src = seg[ROW_PREFIX + n]
                if src.dtype != dst.dtype and {src.dtype, dst.dtype} != {torch.float32, torch.float16}:
                    # fp32 and fp16 resident K/V load into each other (same_strategy), converted as they are copied
                    raise StateFileError(f"rows segment {g['file']} holds {n} as {src.dtype}, this cache stores {dst.dtype}")
                if runs is not None:
                    for r in runs:
                        dst.narrow(axes[n], int(slot_ids[r[0]]), r.size).copy_(src.narrow(axes[n], int(src_ids[r[0]]), r.size))
                else:
                    rows = src if src_ids.size == positions.size else src.index_select(axes[n], torch.from_numpy(src_ids))
                    dst.index_copy_(axes[n], torch.from_numpy(slot_ids), rows.to(dst.dtype))
            filled[slot_ids] = True
        return res_slots, filled

    @staticmethod
    def _appended(d, body: dict, template: _Template) -> dict:
        """The cache's append-only tables rebuilt from their append segments; {} when none."""
        parts: dict = {}
        end = 0
        for g in sorted((g for g in body["segments"] if g["kind"] == "append"), key=lambda g: g["start"]):
            if g["start"] != end:
                raise StateFileError(f"append segment {g['file']} starts at row {g['start']}, expected {end}")
            for k, v in segment_tensors(d, g).items():
                parts.setdefault(k, []).append(v)
            end = g["end"]
        if not parts:
            return {}
        rows_key, axes = template.append_rows_key, template.append_axes
        if rows_key is None or set(parts) - set(axes):
            raise StateFileError(f"append segments hold {sorted(set(parts) - set(axes))}, which this daemon's cache "
                                 f"does not grow ({sorted(axes)})")
        if end != int(body["cache_meta"][rows_key]):
            raise StateFileError(f"append segments hold {end} rows, the cache state says {body['cache_meta'][rows_key]}")
        # one segment: its views as they are; several: their views as Pieces (the cache copies them into its tables,
        # one after another: never a concatenated copy of the whole archive)
        return {k: v[0] if len(v) == 1 else _joined(v, axes[k]) for k, v in parts.items()}

    def prepare_loads(self) -> None:
        """Build what every load needs first (the session template), e.g. at daemon start."""
        self._template()

    def _template(self) -> _Template:
        """What this engine's fresh session state looks like; built once (making a cache allocates
        its slabs: not something to do per load)."""
        if self._fresh is None:
            kv = self.engine.new_session_kv()
            fresh = kv.delta_state()
            # shapes and dtypes from zero rows (the whole state would copy every slab)
            empty = fresh.read_rows(np.zeros(0, dtype=np.int64)) if fresh.row_axes is not None else {}
            grown = fresh.appended
            self._fresh = _Template(
                hidden_keep=kv.hidden_keep, row_axes=fresh.row_axes,
                payload={n: (tuple(x.shape), x.dtype) for n, x in empty.items()},
                append_axes=dict(grown.axes) if grown else {}, append_rows_key=grown.rows_key if grown else None)
        return self._fresh

    def _unusable(self, session_id: str, problem: str):
        dest = self.set_aside(session_id, problem)
        where = f"its files were moved to {dest} (not deleted)" if dest else "it has no files"
        raise SessionStateUnusable(f"session {session_id!r} cannot be resumed: {problem}; {where}; create a new session")


def same_strategy(saved: KVStrategy, serving: KVStrategy) -> bool:
    """Whether a session saved under `saved` loads into a daemon serving `serving`: the same strategy, except that fp32
    and fp16 resident K/V load into each other (rows converted as they load: exactly from fp16, rounded to fp16 the
    other way, so a session moved between the two continues, though not bit for bit as it would have), and a paged
    session saved with far_from at the trained context loads where far_from applies once past it (far_after "context":
    it is that session until then). A paged session's choice_every is the serving daemon's (`--page-choice-every`: how
    often queries past the context choose their pages, not what the session holds): a session past the context
    continues under the daemon's, from its next choice position (its rows choose themselves until then)."""
    if serving.far_after == "context" and saved.far_from == 0 and saved.name == serving.name == "paged":
        # saved under the trained context's layout: what a far_after "context" session is until it passes the context
        # (one saved past it is re-encoded at its next step, as any that crosses there)
        saved = dataclasses.replace(saved, far_from=serving.far_from, far_after="context")
    if saved.name == serving.name == "paged":
        saved = dataclasses.replace(saved, choice_every=serving.choice_every)
    if {saved.kv_dtype, serving.kv_dtype} <= {"fp32", "fp16"}:
        return dataclasses.replace(saved, kv_dtype=serving.kv_dtype) == serving
    return saved == serving


def _strategy_text(s: KVStrategy) -> str:
    return s.name + "(" + ", ".join(f"{k}={v}" for k, v in sorted(s.describe().items())) + ")"
