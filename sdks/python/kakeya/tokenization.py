"""Opt-in tokenization helpers. The runtime takes raw token ids only (ADR 0008 §2.4);
chat templates are the application's choice, applied here on the client side. The rules the
daemon's HTTP shim applies too (`from_openai_messages`, `tokens_for_chat`, `IncrementalDecoder`)
live in `kakeya_wire.text` and are re-exported here."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from kakeya.local_models import find_local_model
from kakeya_wire.text import IncrementalDecoder, from_openai_messages, tokens_for_chat

__all__ = ["ChatHistory", "IncrementalDecoder", "assistant_turn_end", "chat_delta", "from_openai_messages", "load_tokenizer",
           "tokens_for_chat"]


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
