"""Opt-in tokenization helpers. The runtime takes raw token ids only (ADR 0008 §2.4);
chat templates are the application's choice, applied here on the client side."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def from_openai_messages(messages: Iterable[Mapping]) -> list[dict]:
    """Normalize OpenAI-style messages (content as str or a list of text parts) to
    [{"role": ..., "content": str}] for `apply_chat_template`."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] has no string 'role'")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content has a non-text part {part!r}; only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def tokens_for_chat(messages: Sequence[Mapping], tokenizer, *, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
    """Render `messages` with the tokenizer's own chat template and return token ids."""
    ids = tokenizer.apply_chat_template(
        from_openai_messages(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    if hasattr(ids, "get") and "input_ids" in ids:  # BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def load_tokenizer(model_dir: str):
    """AutoTokenizer from a local model directory (e.g. one pulled by `kakeya models pull`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_delta(previous_messages: Sequence[Mapping], messages: Sequence[Mapping], tokenizer, **kw) -> list[int]:
    """Tokens to append when a conversation grows from `previous_messages` to `messages`:
    the rendered suffix, checked to extend the earlier rendering exactly (append-only)."""
    before = tokens_for_chat(previous_messages, tokenizer, add_generation_prompt=False, **kw) if previous_messages else []
    after = tokens_for_chat(messages, tokenizer, **kw)
    if after[: len(before)] != before:
        raise ValueError("the chat template re-renders earlier turns differently; start a new session instead of appending")
    return after[len(before):]
