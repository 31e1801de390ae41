"""`kakeya chat` against a real daemon serving the pulled model, driven with scripted input."""
import io
import pathlib
import re

import pytest

import kakeya
from factories import require_smollm2
from kakeya.chat import ChatOptions, Conversation, main, run_chat
from kakeya.tokenization import ChatHistory, load_tokenizer

MODEL = "smollm2-135m-instruct"


class RecordingStream(io.StringIO):
    """Keeps every write separately, so a test can see text arrive in pieces."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


@pytest.fixture(scope="module")
def daemon():
    from inference_engine.server.app import ServeConfig, start

    running = start(ServeConfig(bind="127.0.0.1:0", model=str(require_smollm2()), capacity=4))
    yield f"127.0.0.1:{running.port}"
    running.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.mark.model
def test_scripted_chat_streams_appends_deltas_and_resets(daemon, tokenizer):
    script = "Say hello in French.\nNow in German.\n/info\n/reset\n/info\n/nonsense\n/quit\nnever read\n"
    out = RecordingStream()
    with kakeya.Client(daemon) as client:
        assert run_chat(client, tokenizer, io.StringIO(script), out, ChatOptions(max_tokens=8)) == 0
        text = out.getvalue()
        first_session = re.search(r"session (\S+)\n", text).group(1)
        turns = [(int(g), int(p)) for g, p in re.findall(r"\[(\d+) tokens.*?prefilled (\d+) new tokens", text)]
        infos = re.findall(r"session (\S+): history (\d+) tokens .*?resident KV (\d+) bytes", text)
        new_session = re.search(r"\[new session (\S+)\]", text).group(1)

        # The first reply reached the stream in several writes, between the prompt and its figures.
        start = out.writes.index("> ")
        stats = next(i for i, w in enumerate(out.writes) if w.startswith("[") and "prefilled" in w)
        assert len([w for w in out.writes[start + 1:stats] if w.strip()]) >= 2
        assert "never read" not in text and "unknown command '/nonsense'" in text

        # Turn 1 prefilled its rendered prompt; turn 2 only its delta (plus the one pending
        # token the first reply left), and the history holds exactly both turns.
        (g1, p1), (g2, p2) = turns
        assert p1 == len(ChatHistory(tokenizer).user("Say hello in French."))
        assert 1 < p2 < p1 and 1 <= g1 <= 8 and 1 <= g2 <= 8
        (sid1, hist1, kv1), (sid2, hist2, _kv2) = infos
        assert sid1 == first_session and int(hist1) == p1 + g1 + (p2 - 1) + g2 and int(kv1) > 0
        assert new_session != first_session and (sid2, hist2) == (new_session, "0")
        # the window is preallocated: /info says the bytes are allocated and how many positions are used
        assert "bytes allocated" in text and re.search(r"\d+ of 1024 resident positions", text)
        for closed in (first_session, new_session):  # /reset closed the first one, /quit the second
            with pytest.raises(kakeya.SessionNotFoundError):
                client.session(closed).info()


@pytest.mark.model
def test_conversation_history_is_exactly_what_was_appended_and_generated(daemon, tokenizer):
    with kakeya.Client(daemon) as client:
        conv = Conversation(client, tokenizer, ChatOptions(max_tokens=6, system="Answer briefly."))
        mirror, expected = ChatHistory(tokenizer, system="Answer briefly."), []
        for question in ("Hi!", "Who are you?"):
            expected += mirror.user(question)
            conv.turn(question, io.StringIO())
            reply = list(conv.session.last_result.tokens)
            expected += reply
            mirror.assistant(reply)
        assert conv.session.history() == expected
        assert conv.history.messages == mirror.messages and conv.history.messages[0]["role"] == "system"
        conv.close()


def test_the_chat_is_the_sdks_own_console_script():
    """`kakeya-chat` ships with the SDK distribution; the daemon's `kakeya chat` runs it (tests/server/test_chat_command.py)."""
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "sdks" / "python" / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["kakeya-chat"] == "kakeya.chat:main"


def test_no_daemon_says_how_to_start_one(capsys):
    assert main(["--address", "127.0.0.1:1"]) == 1
    assert "make run" in capsys.readouterr().err


def test_a_wrong_or_missing_api_key_is_one_line(capsys):
    from factories import make_engine, start_server

    running = start_server(make_engine("llama", "full"), api_key="right")
    capsys.readouterr()  # (building the tiny model reports progress)
    try:
        for extra, said in ((["--api-key", "wrong"], "the API key given was refused"), ([], "the daemon requires an API key")):
            assert main(["--address", f"127.0.0.1:{running.port}", *extra]) == 2
            err = capsys.readouterr().err
            assert said in err and "--api-key" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    finally:
        running.stop()


def test_the_address_comes_from_kakeya_address(monkeypatch, capsys):
    monkeypatch.setenv("KAKEYA_ADDRESS", "127.0.0.1:1")
    assert main([]) == 1 and "no daemon at 127.0.0.1:1" in capsys.readouterr().err
    assert kakeya.Client().target == "127.0.0.1:1"


class StopsTheDaemon(io.StringIO):
    """Scripted input that stops the daemon when the chat asks for line `at` (the daemon dies mid-chat)."""

    def __init__(self, text, at, stop):
        super().__init__(text)
        self.at, self.stop, self.read = at, stop, 0

    def readline(self, *a):
        self.read += 1
        if self.read == self.at:
            self.stop()
        return super().readline(*a)


@pytest.mark.model
def test_chat_prints_its_session_and_reattaches_after_the_daemon_went_away(tmp_path, tokenizer, monkeypatch, capsys):
    from inference_engine.server.app import ServeConfig, start

    cfg = ServeConfig(bind="127.0.0.1:0", model=str(require_smollm2()), capacity=4, state_dir=str(tmp_path))
    first = start(cfg)
    monkeypatch.setattr("sys.stdin", StopsTheDaemon("Say hello in French.\nNow in German.\n", at=2, stop=first.stop))
    assert main(["--address", f"127.0.0.1:{first.port}", "--max-tokens", "8"]) == 1
    out, err = capsys.readouterr()
    sid = re.search(r"kakeya chat --session=(\S+)\)", out).group(1)  # printed when the chat started
    assert f"lost the daemon at 127.0.0.1:{first.port}" in err and f"`kakeya chat --session={sid}`" in err
    first_turn = int(re.search(r"\[(\d+) tokens", out).group(1))

    second = start(cfg)  # the daemon is back: the session was saved after its turn
    try:
        with kakeya.Client(f"127.0.0.1:{second.port}") as c:
            held = c.session(sid).history()
        monkeypatch.setattr("sys.stdin", io.StringIO("Now in German.\n/quit\n"))
        assert main(["--address", f"127.0.0.1:{second.port}", "--max-tokens", "8", "--session", sid]) == 0
        out = capsys.readouterr().out
        assert f"reattached to session {sid} ({len(held)} tokens)" in out and first_turn >= 1
        generated, prefilled = map(int, re.search(r"\[(\d+) tokens.*?prefilled (\d+) new tokens", out).groups())
        # Only the new turn went in: the closing of the last reply, the user message and the assistant prompt.
        mirror = ChatHistory(tokenizer)  # the same conversation never interrupted
        first_prompt = mirror.user("Say hello in French.")
        mirror.assistant(held[len(first_prompt):])
        assert prefilled == 1 + len(mirror.user("Now in German.")) and generated >= 1  # + the reply's last token, pending
        with pytest.raises(kakeya.SessionNotFoundError):  # /quit closed it
            kakeya.Client(f"127.0.0.1:{second.port}").session(sid).info()
        assert main(["--address", f"127.0.0.1:{second.port}", "--session", sid]) == 2
        assert "does not exist" in capsys.readouterr().err
    finally:
        second.stop()


def test_a_turn_line_says_when_the_daemon_re_encoded_the_session():
    from kakeya.chat import describe_turn
    from kakeya.types import GenerationResult

    r = GenerationResult(stop_reason="max_tokens", generated_tokens=5, prefill_tokens=21, prefill_seconds=0.5,
                         total_seconds=1.0, time_to_first_token_seconds=0.6, drafted_tokens=0, accepted_tokens=0)
    assert "again" not in describe_turn(r) and "prefilled 21 new tokens," in describe_turn(r)
    again = describe_turn(GenerationResult(**{**r.__dict__, "reencoded_tokens": 3840}))
    assert "prefilled 21 new tokens (and 3840 earlier ones again: the session passed the model's context)" in again
