"""`kakeya chat` against a real daemon serving the pulled model, driven with scripted input."""
import io
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


def test_cli_registers_chat():
    from inference_engine.server.cli import build_parser
    from kakeya import chat

    args = build_parser().parse_args(["chat", "--address", "h:1", "--max-tokens", "8", "--system", "be brief"])
    assert args.func is chat.run and (args.address, args.max_tokens, args.system, args.model) == ("h:1", 8, "be brief", None)


def test_no_daemon_says_how_to_start_one(capsys):
    assert main(["--address", "127.0.0.1:1"]) == 1
    assert "make run" in capsys.readouterr().err
