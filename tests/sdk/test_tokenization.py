import sys

import pytest

from factories import require_smollm2
from kakeya.local_models import LocalModelNotFoundError
from kakeya.tokenization import (
    ChatHistory,
    IncrementalDecoder,
    assistant_turn_end,
    chat_delta,
    from_openai_messages,
    load_tokenizer,
    tokens_for_chat,
)


def test_from_openai_messages_normalizes_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
    assert from_openai_messages(msgs) == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    with pytest.raises(ValueError, match="non-text"):
        from_openai_messages([{"role": "user", "content": [{"type": "image_url"}]}])


@pytest.mark.model
def test_tokens_for_chat_uses_the_model_template():
    path = require_smollm2()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": "hi"}]
    ids = tokens_for_chat(msgs, tok)
    assert "<|im_start|>assistant" in tok.decode(ids)
    replied = msgs + [{"role": "assistant", "content": "hello"}]
    delta = chat_delta(replied, replied + [{"role": "user", "content": "more"}], tok)
    assert "more" in tok.decode(delta)


class ByteTokenizer:
    """Token id = one UTF-8 byte, as a byte-level BPE can split a character."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_decoder_holds_back_split_characters():
    text = "a é 日本 😀!"
    dec = IncrementalDecoder(ByteTokenizer())
    pieces = [dec.push(b) for b in text.encode()] + [dec.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert pieces[text.encode().index("😀".encode()):][:4] == ["", "", "", " 😀"[1:]]


def test_incremental_decoder_flushes_an_unfinished_character():
    dec = IncrementalDecoder(ByteTokenizer())
    assert [dec.push(b) for b in b"ok\xe6\x97"] == ["o", "k", "", ""]
    assert dec.flush() == "\ufffd"


def test_load_tokenizer_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("KAKEYA_HOME", str(tmp_path))
    with pytest.raises(LocalModelNotFoundError, match=r"kakeya models pull smollm2-135m-instruct"):
        load_tokenizer("smollm2-135m-instruct")
    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "transformers", None)  # the `tokenizer` extra is not installed
    with pytest.raises(ImportError, match="tokenizer"):
        load_tokenizer("m")


@pytest.mark.model
def test_load_tokenizer_by_name_and_by_tilde_path(monkeypatch, tmp_path):
    path = require_smollm2()
    (tmp_path / ".cache" / "kakeya" / "models").mkdir(parents=True)
    (tmp_path / ".cache" / "kakeya" / "models" / "smollm2-135m-instruct").symlink_to(path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KAKEYA_HOME", raising=False)
    by_name = load_tokenizer("smollm2-135m-instruct")  # the default home, ~/.cache/kakeya
    by_path = load_tokenizer("~/.cache/kakeya/models/smollm2-135m-instruct")  # the old README's path, now expanded
    assert by_name("Hi!")["input_ids"] == by_path("Hi!")["input_ids"]


@pytest.mark.model
def test_chat_history_closes_each_reply_like_the_template():
    path = require_smollm2()
    tok = load_tokenizer(path)
    end = tok.encode("<|im_end|>\n", add_special_tokens=False)
    cut = tok.encode("Bonjour", add_special_tokens=False)  # stopped by max_tokens: no end marker
    assert assistant_turn_end(cut, tok) == end
    assert assistant_turn_end(cut + end[:1], tok) == end[1:]  # stopped at EOS: only the newline
    chat = ChatHistory(tok)
    history = chat.user("Hi")
    history += cut
    chat.assistant(cut)
    history += chat.user("More")
    # The session's history renders as the template renders the conversation, except for the
    # reply's own tokens (which the model chose), so the next turn extends it append-only.
    rendered = tokens_for_chat(chat.messages, tok)
    assert history == rendered
    text = "日本語 😀 ok"
    dec = IncrementalDecoder(tok)
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join([dec.push(t) for t in ids] + [dec.flush()]) == text
