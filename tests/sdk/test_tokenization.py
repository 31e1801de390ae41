import pytest

from factories import require_smollm2
from kakeya.tokenization import chat_delta, from_openai_messages, tokens_for_chat


def test_from_openai_messages_normalizes_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": None}]
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
    delta = chat_delta(msgs + [{"role": "assistant", "content": "hello"}], msgs + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}], tok)
    assert "more" in tok.decode(delta)
