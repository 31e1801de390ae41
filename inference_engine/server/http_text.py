"""Text for the deprecated HTTP shim: the served model's own tokenizer renders prompts (its
chat template) and turns generated ids back into text.

The runtime takes raw token ids only (ADR 0008 §2.2); the shim is the one server-side place
where text exists. Nothing here touches sessions or HTTP.
"""
from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kakeya_wire.text import IncrementalDecoder, tokens_for_chat

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")


class TokenizerUnavailable(ValueError):
    """The model directory cannot give the shim a usable tokenizer."""


@dataclass(frozen=True)
class ModelText:
    tokenizer: Any  # transformers tokenizer (PreTrainedTokenizerBase, not imported here); used from the event-loop thread only
    eos_token_ids: frozenset  # model config's EOS plus the tokenizer's end-of-turn token

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: Sequence[Mapping]) -> list[int]:
        """Token ids of `messages` under the model's own chat template, ending in the assistant cue."""
        return tokens_for_chat(messages, self.tokenizer)

    def encode(self, prompt: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(prompt)]

    def detokenizer(self) -> IncrementalDecoder:
        """Generated ids -> text deltas that never split a multi-byte character (the one the SDK uses)."""
        return IncrementalDecoder(self.tokenizer)


def load_model_text(model_dir: str | pathlib.Path, *, vocab_size: int, model_eos_token_ids: Iterable[int] = ()) -> ModelText:
    """Load the tokenizer shipped in `model_dir`; refuse one that could emit ids past the model's vocabulary."""
    model_dir = pathlib.Path(model_dir)
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise TokenizerUnavailable(
            f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); the HTTP shim renders prompts "
            f"and detokenizes with the model's own tokenizer. Serve a pulled model (`kakeya models pull NAME`), "
            f"add the tokenizer files to the directory, or drop --http-port and use the gRPC API with raw token ids"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        raise TokenizerUnavailable(f"could not load the tokenizer in {model_dir}: {type(e).__name__}: {e}") from e
    if len(tokenizer) > vocab_size:
        raise TokenizerUnavailable(
            f"the tokenizer in {model_dir} has {len(tokenizer)} tokens but the served model's vocabulary is {vocab_size}: "
            f"they do not belong together (does --model name the directory the runtime loaded?)"
        )
    eos = set(model_eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id < vocab_size:
        eos.add(int(tokenizer.eos_token_id))
    return ModelText(tokenizer, frozenset(eos))


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back any tail that could begin one."""

    def __init__(self, stops: Sequence[str]):
        self._stops = list(stops)
        self._held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Text now safe to emit; after a match, everything before it and `hit` is set."""
        if self.hit:
            return ""
        buf = self._held + text
        found = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if found:
            self.hit, self._held = True, ""
            return buf[: min(found)]
        keep = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
