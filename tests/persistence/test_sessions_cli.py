"""`kakeya sessions list|rm|gc` over a state directory written by a real runtime."""
from __future__ import annotations

import os
import time

from factories import load_model, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import SamplingParams
from inference_engine.kv.strategy import KVStrategy
from inference_engine.persistence.session_files import SessionFiles
from inference_engine.persistence.state_dir import StateDir
from inference_engine.server.cli import main
from inference_engine.server.runtime import Runtime


def _saved(root, n):
    e = Engine(load_model(str(tiny_model_dir("llama"))), KVStrategy("full"), prefill_chunk=16)
    rt = Runtime(e, persister=SessionFiles(StateDir(root), e))
    out = []
    for i in range(n):
        s = rt.create_session(list(range(3, 13 + i)))
        [ev for ev in rt.generate(s.id, 2, SamplingParams()) if isinstance(ev, TokenGenerated)]
        out.append(s.id)
    return out


def test_list_rm_gc(tmp_path, capsys):
    a, b, c = _saved(tmp_path, 3)
    assert main(["sessions", "--state-dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert all(i in out for i in (a, b, c)) and "12 tokens" in out and "tiny-llama" in out and "full" in out

    assert main(["sessions", "list", "--state-dir", str(tmp_path)]) == 0  # the flag after the subcommand works too
    assert capsys.readouterr().out == out

    assert main(["sessions", "--state-dir", str(tmp_path), "rm", a, "nosuchsession"]) == 1
    assert not StateDir(tmp_path).has(a) and StateDir(tmp_path).has(b)
    assert "nosuchsession" in capsys.readouterr().err

    d = StateDir(tmp_path)
    leftover = d.data_dir(b) / "00000099-rows.safetensors"  # a save that died before its manifest
    leftover.write_bytes(b"x" * 10)
    fresh_tmp = d.data_dir(b) / ".tmp-session.json.123"  # a save in flight right now: left alone
    fresh_tmp.write_bytes(b"{")
    old = time.time() - 3600
    os.utime(leftover, (old, old))
    d.set_aside(c)
    assert main(["sessions", "--state-dir", str(tmp_path), "gc", "--quarantine"]) == 0
    assert "removed 1 leftover file(s), 0 session(s), 1 set-aside entry" in capsys.readouterr().out
    assert not leftover.exists() and fresh_tmp.exists() and not list(d.quarantine.iterdir())
    os.utime(d.data_dir(b) / "session.json", (old, old))
    assert main(["sessions", "--state-dir", str(tmp_path), "gc", "--older-than", "10d"]) == 0
    assert StateDir(tmp_path).has(b)  # saved_at is inside the manifest: an hour ago is not 10 days
    assert main(["sessions", "--state-dir", str(tmp_path), "gc", "--older-than", "0s"]) == 0
    assert not StateDir(tmp_path).has(b)
    assert main(["sessions", "--state-dir", str(tmp_path), "list"]) == 0
    assert "no persisted sessions" in capsys.readouterr().out


def test_kakeya_state_dir_overrides_the_default_state_directory(monkeypatch, tmp_path):
    from inference_engine.persistence.state_dir import StateDir, default_state_dir

    monkeypatch.setenv("KAKEYA_STATE_DIR", str(tmp_path / "elsewhere"))
    assert default_state_dir() == tmp_path / "elsewhere" and StateDir().root == tmp_path / "elsewhere"
    monkeypatch.delenv("KAKEYA_STATE_DIR")
    monkeypatch.setenv("KAKEYA_HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / "state"


def test_list_survives_a_file_removed_while_it_looks(tmp_path, capsys, monkeypatch):
    """`kakeya sessions list` (and gc, which lists) beside running daemons: a file a save in flight renames away
    between the listing of a session's directory and the look at its size is skipped, not a traceback."""
    import pathlib

    (a,) = _saved(tmp_path, 1)
    d = StateDir(tmp_path)
    session_dir = d.data_dir(a)
    real_iterdir = pathlib.Path.iterdir

    def with_a_vanished_temp(self):
        found = list(real_iterdir(self))
        return iter(found + [self / ".tmp-session.json.gone"] if self == session_dir else found)

    real_stat, looks = pathlib.Path.stat, []

    def racing_stat(self, *args, **kwargs):  # there when is_file() looks, gone when its size is read
        if self.name == ".tmp-session.json.gone":
            looks.append(1)
            if len(looks) % 2:
                return real_stat(session_dir / "session.json")
            raise FileNotFoundError(str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "iterdir", with_a_vanished_temp)
    monkeypatch.setattr(pathlib.Path, "stat", racing_stat)
    assert main(["sessions", "--state-dir", str(tmp_path), "list"]) == 0
    assert looks  # the listing met the file
    assert a in capsys.readouterr().out
    assert [e.session_id for e in d.entries()] == [a] and d.entries()[0].problem is None
