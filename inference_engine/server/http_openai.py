"""OpenAI wire format for the deprecated HTTP shim: request bodies, response and SSE chunk
shapes, the error JSON, and the deprecation headers every response carries.

Plain data only; no sessions, no tokenizer, no server.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from inference_engine.errors import KakeyaError

# ADR 0008 §2.7: every shim response says it is deprecated and where to go instead.
# Deprecation is RFC 9745's structured date (2026-06-01, ADR 0008 accepted); Sunset (RFC 8594)
# is the earliest removal date we announce (OQ-3: not before v0.5); Link names the migration doc.
DEPRECATED_SINCE = 1780272000
SUNSET = "Tue, 01 Jun 2027 00:00:00 GMT"
MIGRATION_DOC = "docs/grpc.md"
DEPRECATION_HEADERS = {
    "Deprecation": f"@{DEPRECATED_SINCE}",
    "Sunset": SUNSET,
    "Link": f'<{MIGRATION_DOC}>; rel="deprecation"; type="text/markdown", <{MIGRATION_DOC}>; rel="sunset"; type="text/markdown"',
}

FINISH_REASONS = {"eos": "stop", "max_tokens": "length", "context_full": "length"}  # "cancelled" is an error


class ShimError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_kakeya_error(e: KakeyaError) -> ShimError:
    """Runtime errors -> HTTP status, following the gRPC status each error carries."""
    if e.code == "INVALID_ARGUMENT":
        return ShimError(400, str(e))
    if e.code == "OUT_OF_RANGE":
        return ShimError(400, str(e), param="messages", code="context_length_exceeded")
    if e.code == "RESOURCE_EXHAUSTED":
        return busy(str(e))
    if e.code == "NOT_FOUND":
        # A single-shot session can only vanish if the store evicted it between create and generate.
        return busy(f"the runtime evicted this request's session under load ({e}); retry")
    return ShimError(500, f"internal error: {e}", type="server_error", code=e.code.lower())


def busy(message: str) -> ShimError:
    return ShimError(503, message, type="server_error", code="capacity_exhausted", headers={"Retry-After": "1"})


# -- requests ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are accepted (clients send many); the
    ones that would change the result are refused by `unsupported_field`."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ShimError(400, "stop strings must be non-empty", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]

    def token_limit(self) -> int | None:
        return self.max_tokens


# Accepted when absent or at their default; anything else would be silently ignored, so refuse it.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "echo": (None, False),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}


def unsupported_field(req: GenerationRequest) -> ShimError | None:
    for name, value in (req.model_extra or {}).items():
        neutral = _NEUTRAL.get(name)
        if neutral is not None and value not in neutral:
            return ShimError(
                400,
                f"{name}={value!r} is not supported by the deprecated HTTP shim (feature-frozen, ADR 0008 §2.7); "
                f"drop the field, or move to the gRPC API",
                param=name,
                code="unsupported_parameter",
            )
    return None


# -- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class ResponseShape:
    """Builds one request's response objects; `chat` picks chat.completion vs text_completion."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None,
                "choices": choices, **extra}

    def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], usage=usage(prompt_tokens, completion_tokens))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=usage(prompt_tokens, completion_tokens))


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "kakeya"}
