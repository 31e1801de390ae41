"""Session leases in a state directory that several daemons share: one daemon writes a session at a
time, and a daemon that lost a session can never write it again (fencing).

    <state-dir>/sessions/<id>/g<gen>/owner.json     the lease of generation <gen>: the daemon holding it
    <state-dir>/sessions/<id>/g<gen>/released       present once that daemon let it go (spill, close, stop)
    <state-dir>/sessions/<id>/g<gen>/session.json   the session's manifest and segments, written by <gen>'s
    <state-dir>/sessions/<id>/g<gen>/<seq>-*.safetensors    holder only (state_dir.py, session_files.py)
    <state-dir>/daemons/<daemon>.json               a daemon's heartbeat: renews every lease it holds at once
    <state-dir>/daemons/<daemon>.inbox/<id>         another daemon asks it to let session <id> go

Claiming generation g+1 renames a prepared directory (its owner.json inside) to g<g+1>: a rename onto
an existing non-empty directory fails, so exactly one daemon holds each generation, on a local disk and
on NFS alike. The claimer then fences every older generation by renaming g<k> to fenced-g<k>: a daemon
still holding k (paused, partitioned) names its files by the path g<k>/..., which no longer exists, so
each of its writes fails (ENOENT) - the file system refuses it, whatever that daemon believes. The newest
fenced generation's manifest and the segments it names are then hard-linked into g<g+1> (segments are
never rewritten; copied where links are refused) and the fenced directories removed. A paused writer's
half-done save is either wholly before the fence (its manifest renamed in: taken over) or refused.

A lease is live while it is not released and its holder's heartbeat file keeps changing: observed on
this daemon's monotonic clock (no comparison of two machines' clocks), a holder whose beat has not
changed for `ttl_s` is dead and its sessions may be taken over. Without `shared` (one daemon per state
directory, which holds daemon.lock) every other holder is a dead earlier process: taken over at once.

Plain Python (no torch); the layer above maps SessionExists / SessionOwnedElsewhere / LeaseLost to
ALREADY_EXISTS and UNAVAILABLE (with the holder in trailing metadata: clients retry).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from inference_engine.errors import LeaseLost, SessionExists, SessionNotFound, SessionOwnedElsewhere
from inference_engine.persistence.state_dir import (LEASE_FILES, MANIFEST_NAME, OWNER_NAME, RELEASED_NAME, StateDir,
                                                    StateFileError, fsync_dir, generation_of, is_session_id,
                                                    read_manifest, write_atomic)

DEFAULT_TTL_S = 10.0
GEN_PREFIX, FENCED_PREFIX, CLAIM_PREFIX = "g", "fenced-g", ".claim-"
# a peer whose heartbeat has not changed for this many lease durations is gone: its file is removed
FORGET_AFTER_TTLS = 30


@dataclass(frozen=True)
class Lease:
    """Generation `generation` of a session, held by this daemon; its files live under `path`."""

    session_id: str
    generation: int
    path: Path


def new_daemon_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class Leases:
    def __init__(self, state_dir: StateDir, *, shared: bool = False, ttl_s: float = DEFAULT_TTL_S,
                 daemon_id: str | None = None, clock=time.monotonic):
        """shared: other live daemons may use the directory (their leases are honoured until they expire);
        else this process is the only daemon (it holds daemon.lock) and any other holder is dead."""
        if ttl_s <= 0:
            raise ValueError(f"the lease duration must be > 0 s, got {ttl_s}")
        self.dir, self.shared, self.ttl_s, self.clock = state_dir, shared, float(ttl_s), clock
        self.daemon_id = daemon_id or new_daemon_id()
        self.daemons = state_dir.root / "daemons"
        self._beat = 0
        self._seen: dict[str, tuple[int, float]] = {}  # peer -> (its last beat, when this daemon saw it change)
        self._lock = threading.Lock()
        self.takeovers = 0  # sessions taken from another (dead or released) holder
        if shared:
            self.heartbeat()

    # -- heartbeat: renews every lease this daemon holds ------------------------------------
    @property
    def heartbeat_path(self) -> Path:
        return self.daemons / f"{self.daemon_id}.json"

    @property
    def inbox(self) -> Path:
        return self.daemons / f"{self.daemon_id}.inbox"

    def heartbeat(self) -> None:
        """Write this daemon's beat and look at the peers' (every ttl/4 or so, from the daemon)."""
        if not self.shared:
            return
        self.daemons.mkdir(parents=True, exist_ok=True)
        self._beat += 1
        body = {"daemon_id": self.daemon_id, "beat": self._beat, "ttl_s": self.ttl_s, "pid": os.getpid(),
                "host": socket.gethostname(), "at": time.time()}
        write_atomic(self.heartbeat_path, (json.dumps(body) + "\n").encode(), sync_dir=False)
        for p in self.daemons.glob("*.json"):
            peer = p.stem
            if peer != self.daemon_id:
                alive = self.alive(peer)
                since = self._seen.get(peer, (0, self.clock()))[1]
                if not alive and self.clock() - since > FORGET_AFTER_TTLS * self.ttl_s:
                    self._forget(peer)

    def stop(self) -> None:
        """This daemon leaves (its sessions were released first): its heartbeat and inbox go."""
        if self.shared:
            self.heartbeat_path.unlink(missing_ok=True)
            shutil.rmtree(self.inbox, ignore_errors=True)

    def _forget(self, peer: str) -> None:
        (self.daemons / f"{peer}.json").unlink(missing_ok=True)
        shutil.rmtree(self.daemons / f"{peer}.inbox", ignore_errors=True)
        with self._lock:
            self._seen.pop(peer, None)

    def alive(self, owner: str) -> bool:
        """Whether `owner` (another daemon) still renews its leases."""
        if owner == self.daemon_id or not self.shared:
            return False  # our own earlier claim that is no longer in memory, or a dead process
        try:
            beat = int(json.loads((self.daemons / f"{owner}.json").read_text())["beat"])
        except (OSError, ValueError, KeyError, TypeError):
            return False  # no heartbeat: stopped (it removes its file) or never started
        now = self.clock()
        with self._lock:
            seen = self._seen.get(owner)
            if seen is None or seen[0] != beat:
                self._seen[owner] = seen = (beat, now)
        return now - seen[1] < self.ttl_s

    # -- asking a holder to let a session go -------------------------------------------------
    def ask_to_release(self, owner: str, session_id: str) -> None:
        box = self.daemons / f"{owner}.inbox"
        try:
            box.mkdir(parents=True, exist_ok=True)
            (box / session_id).touch()
        except OSError:
            pass  # the holder expires anyway; asking only makes it quicker

    def release_requests(self) -> list[str]:
        """Sessions other daemons asked this one to let go (each removed once read)."""
        if not self.shared or not self.inbox.is_dir():
            return []
        out = []
        for p in self.inbox.iterdir():
            out.append(p.name)
            p.unlink(missing_ok=True)
        return out

    # -- leases ----------------------------------------------------------------------------
    def _generations(self, session_dir: Path) -> list[int]:
        try:
            names = [p.name for p in session_dir.iterdir()]
        except FileNotFoundError:
            return []
        return sorted(g for g in (generation_of(n) for n in names) if g is not None)

    def _holder(self, gen_dir: Path) -> tuple[str, bool]:
        """(owner, released) of a generation; an owner file not written yet reads as a dead owner."""
        try:
            owner = json.loads((gen_dir / OWNER_NAME).read_text())["daemon_id"]
        except (OSError, ValueError, KeyError, TypeError):
            return "", True
        return owner, (gen_dir / RELEASED_NAME).exists()

    def _claim(self, session_dir: Path, gen: int) -> Lease | None:
        """Generation `gen` for this daemon, or None when another daemon claimed it first."""
        tmp = session_dir / f"{CLAIM_PREFIX}{secrets.token_hex(6)}"
        tmp.mkdir()
        body = {"daemon_id": self.daemon_id, "generation": gen, "pid": os.getpid(), "host": socket.gethostname(),
                "acquired_at": time.time()}
        (tmp / OWNER_NAME).write_text(json.dumps(body) + "\n")
        dest = session_dir / f"{GEN_PREFIX}{gen:08d}"
        try:
            os.rename(tmp, dest)  # fails when dest exists (it is never empty): one holder per generation
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        return Lease(session_dir.name, gen, dest)

    def claim_new(self, session_id: str) -> Lease:
        """Generation 1 of a session being created; SessionExists when the id is in use here or elsewhere."""
        d = self.dir.session_dir(session_id)
        d.mkdir(parents=True, exist_ok=True)
        gens = self._generations(d)
        if gens or (d / MANIFEST_NAME).exists():  # a saved session (or one held right now): not ours to create
            raise SessionExists(f"session {session_id!r} already exists (saved in the state directory or live on a "
                                f"daemon sharing it); choose another id")
        lease = self._claim(d, 1)
        if lease is None:
            raise SessionExists(f"session {session_id!r} was created by another daemon at the same moment")
        return lease

    def acquire(self, session_id: str) -> Lease:
        """The next generation of a saved session, its files linked in from the newest saved generation.
        SessionOwnedElsewhere while a live daemon holds it (that daemon is asked to let it go);
        SessionNotFound when nothing of it was ever saved."""
        d = self.dir.session_dir(session_id)
        for _ in range(3):  # another daemon may claim the same generation at the same moment
            gens = self._generations(d)
            if gens:
                owner, released = self._holder(d / f"{GEN_PREFIX}{gens[-1]:08d}")
                if owner and not released and self.alive(owner):
                    self.ask_to_release(owner, session_id)
                    raise SessionOwnedElsewhere(
                        f"session {session_id!r} is held by daemon {owner} (it shares this state directory); it was "
                        f"asked to let the session go: retry (the SDKs do)", owner)
            elif not (d / MANIFEST_NAME).exists():
                raise SessionNotFound(f"session {session_id!r} has no saved state")
            lease = self._claim(d, (gens[-1] if gens else 0) + 1)
            if lease is not None:
                self._take_over(d, lease)
                return lease
        raise SessionOwnedElsewhere(f"session {session_id!r} is being taken over by another daemon; retry", "")

    def _take_over(self, d: Path, lease: Lease) -> None:
        # Fence first: from here on no older holder can write (its paths are gone), so what is linked
        # below is a settled state.
        for g in self._generations(d):
            if g < lease.generation:
                os.rename(d / f"{GEN_PREFIX}{g:08d}", d / f"{FENCED_PREFIX}{g:08d}")
        sources = sorted((p for p in d.iterdir() if p.name.startswith(FENCED_PREFIX)),
                         key=lambda p: int(p.name[len(FENCED_PREFIX):]), reverse=True) + [d]  # d: the pre-lease layout
        src = next((p for p in sources if (p / MANIFEST_NAME).is_file()), None)
        if src is None:
            shutil.rmtree(d, ignore_errors=True)  # never saved, and its holder is gone: nothing to resume
            raise SessionNotFound(f"session {d.name!r} was never saved before its daemon stopped")
        try:
            names = [g["file"] for g in read_manifest(src)["segments"]]
        except (StateFileError, KeyError, TypeError):  # unreadable: moved as it is; the load reports and sets it aside
            names = [p.name for p in src.iterdir() if p.is_file() and p.name not in LEASE_FILES and p.name != MANIFEST_NAME]
        for name in [*names, MANIFEST_NAME]:
            _link_or_copy(src / name, lease.path / name)
        fsync_dir(lease.path)
        self.takeovers += 1
        for p in d.iterdir():
            if p.name.startswith(FENCED_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_file():  # the pre-lease layout: its files now live in the new generation
                p.unlink(missing_ok=True)

    def known(self, session_id: str) -> bool:
        """Whether some daemon holds or held a lease on the id (saved or not)."""
        return is_session_id(session_id) and bool(self._generations(self.dir.sessions / session_id))

    def check(self, lease: Lease) -> None:
        """LeaseLost once another daemon took the session over (its generation directory is fenced)."""
        if not lease.path.is_dir():
            raise LeaseLost(f"session {lease.session_id!r} was taken over by another daemon (this daemon's lease "
                            f"generation {lease.generation} was fenced, e.g. while it was paused); retry through the "
                            f"proxy", self.holder_of(lease.session_id))

    def holder_of(self, session_id: str) -> str:
        d = self.dir.sessions / session_id
        gens = self._generations(d)
        return self._holder(d / f"{GEN_PREFIX}{gens[-1]:08d}")[0] if gens else ""

    def release(self, lease: Lease) -> None:
        """Let the session go (after its last save): any daemon may take it over at once."""
        try:
            (lease.path / RELEASED_NAME).touch()
        except FileNotFoundError:
            pass  # fenced already: nothing left to release


def _link_or_copy(src: Path, dst: Path) -> None:
    """A segment is never rewritten, so the new generation may share its inode. A missing one stays
    missing: the load names it and sets the session aside."""
    try:
        os.link(src, dst)
    except (FileExistsError, FileNotFoundError):
        pass
    except OSError:  # a file system without hard links
        shutil.copyfile(src, dst)
