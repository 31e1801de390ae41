"""A state directory that fills up (issue 30, items 2 and 3): every turn still answers, the client
sees the durable length stop growing and a typed signal (SessionNotSavedWarning, `save_error`),
the log says so a few times rather than once per retry, and once there is room again saving
resumes and nothing is lost."""
from __future__ import annotations

import errno
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import kakeya
from factories import tiny_model_dir
from inference_engine.persistence import session_files
from inference_engine.server.app import ServeConfig, start

ROOT = pathlib.Path(__file__).resolve().parents[2]
NO_SPACE = os.strerror(errno.ENOSPC)


def _cfg(state_dir, **kw) -> ServeConfig:
    return ServeConfig(bind="127.0.0.1:0", model=str(tiny_model_dir("llama")), weights="fp32", kv_strategy="sink_window",
                       sink=4, window=32, prefill_chunk=16, threads=1, state_dir=str(state_dir), **kw)


def _ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_full_disk_stops_the_durable_length_and_says_so_and_nothing_is_lost(tmp_path, monkeypatch):
    full = threading.Event()
    real_write = session_files.write_atomic

    def write(path, data, **kw):  # what a full disk does to the daemon's writes
        if full.is_set():
            raise OSError(errno.ENOSPC, NO_SPACE, str(path))
        return real_write(path, data, **kw)

    monkeypatch.setattr(session_files, "write_atomic", write)
    running = start(_cfg(tmp_path))
    try:
        with kakeya.Client(f"127.0.0.1:{running.port}") as c:
            s = c.create_session(_ids(20, 1), ignore_eos=True)
            assert s.append(_ids(5, 2)) == 25 and s.durable_length <= 20  # an append is durable once its turn ends
            r = s.generate_all(4)
            assert (r.durable_length, r.save_error) == (29, "")  # the turn was saved before Done
            assert (s.durable_length, s.info().durable_length) == (29, 29)

            full.set()
            with pytest.warns(kakeya.SessionNotSavedWarning, match=f"{NO_SPACE}.*only 29 tokens are durable"):
                r = s.generate_all(4)
            assert (len(r.tokens), r.durable_length, r.save_error) == (4, 29, NO_SPACE)  # answered all the same
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # once per failing spell, not once per call
                assert s.append(_ids(3, 3)) == 36 and (s.durable_length, s.save_error) == (29, NO_SPACE)
                r = s.generate_all(4)
                info = s.info()
            assert (r.durable_length, info.durable_length, info.save_error, info.history_length) == (29, 29, NO_SPACE, 40)

            full.clear()  # room again: the next turn saves everything
            r = s.generate_all(4)
            assert (r.durable_length, r.save_error, s.save_error) == (44, "", "")
            want = s.history()
    finally:
        running.stop()
    assert running.runtime.metrics.session_save_failures_total._value.get() >= 2
    again = start(_cfg(tmp_path))
    try:
        with kakeya.Client(f"127.0.0.1:{again.port}") as c:
            resumed = c.session(s.id)
            assert resumed.history() == want and resumed.info().durable_length == 44
    finally:
        again.stop()


def _unshare_prefix() -> list[str] | None:
    """A private mount namespace where a tmpfs can be mounted without touching the machine's mounts."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return None
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    probe = subprocess.run([*cmd, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return cmd if probe.returncode == 0 else None


def test_a_daemon_on_a_full_tmpfs(tmp_path):
    """The issue's reproduction: `kakeya serve` with its state dir on a small tmpfs that fills up."""
    prefix = _unshare_prefix()
    if prefix is None:
        pytest.skip("no unprivileged mount namespace here (unshare --user --mount); the test above fakes the full disk")
    state = tmp_path / "state"
    state.mkdir()
    serve = [sys.executable, "-m", "inference_engine.server.cli", "serve", "--model", str(tiny_model_dir("llama")),
             "--bind", "127.0.0.1:0", "--state-dir", str(state), "--weights", "fp32", "--kv-strategy", "sink_window",
             "--sink", "4", "--window", "32", "--prefill-chunk", "16", "--threads", "1"]
    script = f'mount -t tmpfs -o size=1m tmpfs "{state}" && exec "$@"'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), HF_HUB_OFFLINE="1")
    p = subprocess.Popen([*prefix, "sh", "-c", script, "sh", *serve], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
    try:
        line = p.stdout.readline()
        assert line.startswith("READY"), p.stderr.read()[-3000:] if p.poll() is not None else line
        port = int(line.split()[1])
        inside = pathlib.Path(f"/proc/{p.pid}/root") / str(state).lstrip("/")  # the daemon's view of its tmpfs
        with kakeya.Client(f"127.0.0.1:{port}") as c:
            s = c.create_session(_ids(20, 1), ignore_eos=True)
            assert s.generate_all(4).durable_length == 24
            filler = inside / "filler"
            with open(filler, "wb", buffering=0) as f:  # fill the disk
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
            with pytest.warns(kakeya.SessionNotSavedWarning):
                for turn in range(12):
                    s.append(_ids(8, 10 + turn))
                    r = s.generate_all(4)
                    assert (r.durable_length, r.save_error, len(r.tokens)) == (24, NO_SPACE, 4)
            filler.unlink()  # room again
            r = s.generate_all(4)
            assert r.durable_length == len(s.history()) == 24 + 12 * 12 + 4 and r.save_error == ""
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert 1 <= len(errors) <= 2 and "Traceback" not in err, err[-3000:]
