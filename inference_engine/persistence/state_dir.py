"""The state directory: where persisted sessions live, and how a file gets there safely.

    <state-dir>/sessions/<id>/g<gen>/session.json            the manifest: written last, names every segment
    <state-dir>/sessions/<id>/g<gen>/<seq>-<kind>.safetensors segments (history, rows, tail), never rewritten
    <state-dir>/sessions/<id>/g<gen>/owner.json, released     the lease of generation <gen> (leases.py)
    <state-dir>/quarantine/<id>-<utc time>/                    sessions whose files could not be resumed

(`data_dir(id)` is the newest generation's directory; a session saved before leases existed keeps its
files in sessions/<id>/ itself until a daemon takes it over.)

Every file is written to a temporary name, fsynced, renamed into place, and the directory
fsynced, so a crash leaves either the old file or the new one. A save's segments are renamed in
before the manifest that names them; files the manifest does not name are leftovers of a save
that never finished and are ignored (and collected by `gc`). The manifest carries the sha256 of
its own body and the size and CRC-32 of every segment (sha256 in manifests written before
2026-11-24, still read), so truncation and bit flips are caught at load. A segment is read through
a private memory map: the checksum and the tensors read the page cache in place, nothing is copied
into a bytes object first (a CRC-32 is ~2x faster than sha256 here, and the segment checksums are
most of a load's time).

Plain Python (no torch): the `kakeya sessions` commands use this module alone.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import mmap
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from inference_engine.session.store import is_session_id
from kakeya_wire.local_models import kakeya_home

SESSION_FORMAT = "kakeya-session/1"
MANIFEST_NAME = "session.json"
TMP_PREFIX = ".tmp-"
# A session's files live in the directory of its lease's generation (leases.py): sessions/<id>/g<gen>/,
# beside the lease's own files. Sessions saved before leases have their files in sessions/<id>/ itself.
OWNER_NAME, RELEASED_NAME = "owner.json", "released"
LEASE_FILES = frozenset({OWNER_NAME, RELEASED_NAME})


def generation_of(name: str) -> int | None:
    """The generation a directory name `g<8 digits>` stands for, else None."""
    if len(name) == 9 and name[0] == "g" and name[1:].isdigit():
        return int(name[1:])
    return None


class StateFileError(Exception):
    """A persisted file is missing, truncated, corrupted or foreign; the message says which and how."""


def default_state_dir() -> Path:
    """$KAKEYA_STATE_DIR when set (sessions elsewhere than the models, e.g. a test suite's own
    directory), else $KAKEYA_HOME/state."""
    env = os.environ.get("KAKEYA_STATE_DIR")
    return Path(env).expanduser() if env else kakeya_home() / "state"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def segment_checksum(data) -> dict:
    """The checksum a manifest records for a segment (any bytes-like object)."""
    return {"crc32": f"{zlib.crc32(data):08x}"}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write `data` to `path` through a temporary file: fsync, rename, fsync the directory."""
    write_atomic_pieces(path, [data], sync_dir=sync_dir)


def write_atomic_pieces(path: Path, pieces, *, sync_dir: bool = True) -> dict:
    """`write_atomic` of the bytes-like `pieces` in order (an iterable, consumed as it is written: the file's bytes
    are never all in memory at once). Returns the file's size and checksum (`segment_checksum`'s keys)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    size, crc = 0, 0
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
                size += memoryview(piece).nbytes
                crc = zlib.crc32(piece, crc)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def manifest_bytes(body: dict) -> bytes:
    """The manifest file: the body and the sha256 of its canonical JSON."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return (json.dumps({"format": SESSION_FORMAT, "sha256": sha256_bytes(canonical.encode()), "body": body},
                       sort_keys=True, indent=1) + "\n").encode()


def read_manifest(session_dir: Path) -> dict:
    """The manifest body, checked (format version and checksum); StateFileError otherwise."""
    path = session_dir / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StateFileError(f"{path} is missing (the session was never saved completely)") from None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise StateFileError(f"{path} is not valid JSON ({e}): truncated or corrupted") from None
    if not isinstance(doc, dict) or doc.get("format") != SESSION_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise StateFileError(f"{path} has format {got!r}; this build reads {SESSION_FORMAT!r}")
    body = doc.get("body")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    if sha256_bytes(canonical.encode()) != doc.get("sha256"):
        raise StateFileError(f"{path} does not match its recorded sha256: corrupted")
    if not isinstance(body, dict):
        raise StateFileError(f"{path} has a body of type {type(body).__name__}, not an object")
    return body


def read_segment(session_dir: Path, seg: dict, *, check: bool = True):
    """A segment's bytes (a private, copy-on-write map of the file: writable, never written back),
    checked against the size and (unless check=False: the caller runs `check_segment` itself, before
    it trusts what it read) the checksum the manifest records."""
    path = session_dir / seg["file"]
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise StateFileError(f"segment {seg['file']} is missing") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != seg["bytes"]:
            raise StateFileError(f"segment {seg['file']} has {size} bytes, the manifest says {seg['bytes']}: truncated")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else bytearray()
    if check:
        check_segment(seg, data)
    return data


def check_segment(seg: dict, data) -> None:
    """StateFileError unless `data` (a segment's bytes) matches the checksum the manifest records.
    Thread-safe; zlib and hashlib release the GIL over large buffers."""
    if "crc32" in seg:
        ok, kind = segment_checksum(data)["crc32"] == seg["crc32"], "crc32"
    elif "sha256" in seg:
        ok, kind = sha256_bytes(data) == seg["sha256"], "sha256"
    else:
        raise StateFileError(f"the manifest records no checksum for segment {seg['file']}")
    if not ok:
        raise StateFileError(f"segment {seg['file']} does not match its recorded {kind}: corrupted")


@dataclass(frozen=True)
class SessionEntry:
    session_id: str
    path: Path
    disk_bytes: int
    history_length: int
    saved_at: float  # unix time of the last save (0 when unreadable)
    model_id: str
    kv_strategy: str
    problem: str | None = None  # why the manifest is unreadable


class StateDir:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root is not None else default_state_dir()
        self.sessions = self.root / "sessions"
        self.quarantine = self.root / "quarantine"

    def create(self) -> "StateDir":
        self.sessions.mkdir(parents=True, exist_ok=True)
        self.quarantine.mkdir(parents=True, exist_ok=True)
        return self

    def lock(self):
        """Hold the directory for this process (one daemon per state dir: two would overwrite each
        other's saves). Returns the open lock file (the lock lives as long as it does); OSError when
        another process holds it. The kernel drops the lock when the holder dies, kill -9 included."""
        import fcntl

        f = open(self.root / "daemon.lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise OSError(f"another kakeya daemon is using the state directory {self.root} "
                          f"(pass a different --state-dir, or --persist off)") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        return f

    def session_dir(self, session_id: str) -> Path:
        if not is_session_id(session_id):
            raise ValueError(f"{session_id[:64]!r} is not a session id")
        return self.sessions / session_id

    def data_dir(self, session_id: str) -> Path:
        """Where the session's files are: its newest lease generation's directory (sessions/<id>/ for a
        session saved before leases)."""
        d = self.session_dir(session_id)
        try:
            gens = [g for g in (generation_of(p.name) for p in d.iterdir()) if g is not None]
        except (FileNotFoundError, NotADirectoryError):
            return d
        return d / f"g{max(gens):08d}" if gens else d

    def has(self, session_id: str) -> bool:
        return is_session_id(session_id) and (self.data_dir(session_id) / MANIFEST_NAME).is_file()

    def delete(self, session_id: str) -> bool:
        d = self.session_dir(session_id)
        if not d.exists():
            return False
        shutil.rmtree(d)
        return True

    def set_aside(self, session_id: str) -> Path | None:
        """Move a session's files to quarantine/ (never deleted); returns where they went."""
        d = self.session_dir(session_id)
        if not d.exists():
            return None
        self.quarantine.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        dest = self.quarantine / f"{session_id}-{stamp}"
        os.replace(d, dest)
        fsync_dir(self.sessions)
        return dest

    def entries(self) -> list[SessionEntry]:
        if not self.sessions.is_dir():
            return []
        out = []
        for top in sorted(self.sessions.iterdir()):
            if not top.is_dir() or not is_session_id(top.name):
                continue
            d = self.data_dir(top.name)
            size = _file_bytes(d)
            try:
                body = read_manifest(d)
                out.append(SessionEntry(top.name, d, size, int(body["history_length"]), float(body["saved_at"]),
                                        body["model"]["model_id"], body["strategy"]["name"]))
            except (StateFileError, KeyError, TypeError, ValueError) as e:
                if d != top and not (d / MANIFEST_NAME).exists():
                    continue  # created and not saved yet (or never: its daemon died first): nothing to list
                out.append(SessionEntry(top.name, d, size, 0, 0.0, "", "", problem=str(e)))
        return out

    def collect_leftovers(self, session_dir: Path, keep: set[str], *, min_age_s: float = 0.0) -> int:
        """Delete files in `session_dir` the manifest does not name (temporary files and segments of
        a save that never finished) older than `min_age_s`; returns how many."""
        now, n = time.time(), 0
        for p in session_dir.iterdir():
            if p.name == MANIFEST_NAME or p.name in keep or p.name in LEASE_FILES or not p.is_file():
                continue
            try:
                if now - p.stat().st_mtime >= min_age_s:
                    p.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n

    def _stale_lease_dirs(self, now: float, min_age_s: float) -> int:
        """Remove what a claim or a takeover that died half-way left (leases.py): prepared `.claim-*`
        directories and `fenced-g*` generations older than `min_age_s` (a takeover in progress is younger)."""
        n = 0
        for top in self.sessions.iterdir() if self.sessions.is_dir() else ():
            for p in top.iterdir() if top.is_dir() else ():
                if p.is_dir() and p.name.startswith((".claim-", "fenced-g")):
                    try:
                        if now - p.stat().st_mtime >= min_age_s:
                            shutil.rmtree(p, ignore_errors=True)
                            n += 1
                    except FileNotFoundError:
                        pass
        return n

    def gc(self, *, older_than_s: float | None = None, quarantine: bool = False, min_age_s: float = 60.0) -> dict:
        """Remove leftovers of unfinished saves (older than `min_age_s`, so a running daemon's save in
        flight is left alone); with `older_than_s`, whole sessions not saved for that long; with
        `quarantine`, everything set aside."""
        leftover_files = 0
        sessions_removed: list[str] = []
        quarantine_removed: list[str] = []
        now = time.time()
        for e in self.entries():
            if e.problem is None:
                body = read_manifest(e.path)
                keep = {s["file"] for s in body["segments"]}
                leftover_files += self.collect_leftovers(e.path, keep, min_age_s=min_age_s)
            if older_than_s is not None and e.problem is None and now - e.saved_at > older_than_s:
                shutil.rmtree(self.sessions / e.session_id)
                sessions_removed.append(e.session_id)
        leftover_files += self._stale_lease_dirs(now, min_age_s)
        if quarantine and self.quarantine.is_dir():
            for d in sorted(self.quarantine.iterdir()):
                shutil.rmtree(d) if d.is_dir() else d.unlink()
                quarantine_removed.append(d.name)
        return {"leftover_files": leftover_files, "sessions_removed": sessions_removed, "quarantine_removed": quarantine_removed}


def _file_bytes(d: Path) -> int:
    """Bytes of the files in `d`; a file a daemon's save in flight renames or removes meanwhile (or the whole
    directory, a session removed meanwhile) counts as nothing, instead of ending a listing beside running daemons."""
    total = 0
    try:
        files = list(d.iterdir())
    except FileNotFoundError:
        return 0
    for p in files:
        try:
            if p.is_file():
                total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total
