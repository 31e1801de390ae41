"""Text rules the daemon's HTTP shim and the SDK both apply to a tokenizer they are handed (a
transformers tokenizer, duck-typed: nothing here imports transformers): OpenAI-style messages to
chat-template input, chat-template rendering to token ids, and generated ids back to streamed text.
One copy, shared here because neither side may import the other. Standard library only.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["IncrementalDecoder", "from_openai_messages", "tokens_for_chat"]


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


class IncrementalDecoder:
    """Token ids in, printable text out, one token at a time: a character whose bytes span
    several tokens is held back until complete, so streamed text never shows a broken
    character (the offsets method of vLLM's detokenizer)."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # decode from here, so the new token sees its left context
        self._read = 0  # text of ids[_prefix:_read] has been returned already

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """The new printable text `token_id` completes ("" while a character is unfinished)."""
        self.ids.append(int(token_id))
        seen = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) > len(seen) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(seen):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream (an unfinished character shows as U+FFFD)."""
        seen = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(seen):]
