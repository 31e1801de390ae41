"""The daemon's `kakeya chat`: the arguments go to the Python SDK's `kakeya-chat` script (by exec,
so the daemon never imports its client), and a runtime without the SDK says how to get it."""
from __future__ import annotations

import pathlib
import subprocess
import sys

from inference_engine.server import chat_command

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kakeya(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inference_engine.server.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_kakeya_chat_is_the_sdk_script_with_the_same_arguments():
    assert pathlib.Path(chat_command.find_script()).name == "kakeya-chat"
    r = kakeya("chat", "--address", "127.0.0.1:1")
    assert r.returncode == 1 and "kakeya chat: no daemon at 127.0.0.1:1" in r.stderr, r.stderr
    r = kakeya("chat", "--help")
    assert r.returncode == 0 and "--session ID" in r.stdout and "--max-tokens" in r.stdout
    assert "chat" in kakeya("--help").stdout


def test_other_commands_still_refuse_unknown_arguments():
    r = kakeya("models", "list", "--no-such-flag")
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


def test_without_the_sdk_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(chat_command, "find_script", lambda: None)
    assert chat_command.run(["--address", "h:1"]) == 2
    err = capsys.readouterr().err
    assert "kakeya-chat" in err and "pip install 'kakeya[tokenizer]'" in err
