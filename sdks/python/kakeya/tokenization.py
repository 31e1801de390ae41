"""Opt-in tokenization helpers. The runtime takes raw token ids only (ADR 0008 §2.4);
chat templates are the application's choice, applied here on the client side."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from kakeya.local_models import find_local_model


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


def load_tokenizer(model: str | os.PathLike, *, home: str | os.PathLike | None = None):
    """The tokenizer of a local model: a pulled model's name (looked up under `$KAKEYA_HOME`)
    or a model directory (`~` expanded). Needs transformers (the SDK's `tokenizer` extra)."""
    path = find_local_model(model, home=home)  # raises LocalModelNotFoundError naming `kakeya models pull`
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(f"load_tokenizer needs transformers ({e}); install the Kakeya SDK's `tokenizer` extra "
                          f"(pip install 'kakeya[tokenizer]') or `pip install transformers`") from e
    return AutoTokenizer.from_pretrained(str(path))


def chat_delta(previous_messages: Sequence[Mapping], messages: Sequence[Mapping], tokenizer, **kw) -> list[int]:
    """Tokens to append when a conversation grows from `previous_messages` to `messages`:
    the rendered suffix, checked to extend the earlier rendering exactly (append-only)."""
    before = tokens_for_chat(previous_messages, tokenizer, add_generation_prompt=False, **kw) if previous_messages else []
    after = tokens_for_chat(messages, tokenizer, **kw)
    if after[: len(before)] != before:
        raise ValueError("the chat template re-renders earlier turns differently; start a new session instead of appending")
    return after[len(before):]


_PROBE = "\x00kakeya-probe\x00"


def assistant_turn_end(reply_ids: Sequence[int], tokenizer, **template_kwargs) -> list[int]:
    """Tokens that close a generated assistant turn the way the chat template renders one
    (e.g. `<|im_end|>\\n` after the text): a reply stopped at EOS lacks what follows the end
    marker, one stopped by max_tokens or a cancel lacks the marker too. Append them before the
    next `chat_delta`, whose rendering assumes the turn was closed."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False, **template_kwargs)
    end = text[text.rindex(_PROBE) + len(_PROBE):]
    reply = tokenizer.decode(list(reply_ids), skip_special_tokens=False)
    last = tokenizer.decode(list(reply_ids[-1:]), skip_special_tokens=False)
    # The reply may already hold a prefix of `end` (its EOS marker); only a match that covers
    # the whole last token counts, so plain text ending in "<" is not mistaken for a marker.
    done = next((k for k in range(len(end), 0, -1) if k >= len(last) > 0 and reply.endswith(end[:k])), 0)
    return [int(t) for t in tokenizer.encode(end[done:], add_special_tokens=False)] if end[done:] else []


def _generation_prompt_ids(tokenizer, **template_kwargs) -> list[int]:
    """The token ids the template adds to open an assistant turn (e.g. `<|im_start|>assistant\n`)."""
    probe = [{"role": "user", "content": "x"}]
    bare = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False, **template_kwargs)
    opened = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **template_kwargs)
    if not opened.startswith(bare) or opened == bare:
        return []
    return [int(t) for t in tokenizer.encode(opened[len(bare):], add_special_tokens=False)]


class ChatHistory:
    """One conversation's messages, rendered with the model's chat template on the client:
    `user(text)` gives the token ids to append for a new user message (closing the previous
    reply the way the template does), `assistant(reply_ids)` records what the model generated.
    A session that received every `user(...)` holds the whole conversation, append-only."""

    def __init__(self, tokenizer, *, system: str | None = None, **template_kwargs):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; use an instruction-tuned model "
                             "(e.g. smollm2-135m-instruct) or build the token ids yourself")
        self.tokenizer, self._kw = tokenizer, template_kwargs
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self._turn_end: list[int] = []  # closes the last reply; sent with the next user turn

    def user(self, text: str) -> list[int]:
        """Token ids to append for the user message `text` (ends with the assistant prompt)."""
        before = list(self.messages)
        self.messages.append({"role": "user", "content": text})
        ids = self._turn_end + chat_delta(before, self.messages, self.tokenizer, **self._kw)
        self._turn_end = []
        return ids

    def resume(self, history_ids: Sequence[int]) -> None:
        """Continue a conversation that a session already holds as `history_ids` (e.g. after
        reattaching to it): later `user(...)` calls need only know that earlier turns exist, and
        the last reply is closed the way the template closes one. Earlier messages' text is not
        recovered (they stand as placeholders in `messages`)."""
        if not history_ids:
            return
        self.messages += [{"role": "user", "content": "…"}, {"role": "assistant", "content": "…"}]
        prompt = _generation_prompt_ids(self.tokenizer, **self._kw)
        starts = [i + len(prompt) for i in range(len(history_ids) - len(prompt), -1, -1)
                  if prompt and list(history_ids[i:i + len(prompt)]) == prompt]
        reply = list(history_ids[starts[0]:]) if starts else []
        self._turn_end = assistant_turn_end(reply, self.tokenizer, **self._kw) if reply else []

    def assistant(self, reply_ids: Sequence[int]) -> str:
        """Record the generated reply (as the session holds it); returns its text."""
        text = self.tokenizer.decode(list(reply_ids), skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        self._turn_end = assistant_turn_end(reply_ids, self.tokenizer, **self._kw)
        return text


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
