"""Typed errors shared by every layer; the server maps each to one gRPC / HTTP status.

No framework imports here: the session layer and the engine raise these, the servicer
translates them.
"""
from __future__ import annotations


class KakeyaError(Exception):
    """Base class; `code` names the gRPC status the server answers with."""

    code = "INTERNAL"


class InvalidArgument(KakeyaError):
    code = "INVALID_ARGUMENT"


class SessionNotFound(KakeyaError):
    code = "NOT_FOUND"


class SessionExists(KakeyaError):
    """CreateSession named an id already in use (live, or saved in the state directory)."""

    code = "ALREADY_EXISTS"


class ContextExhausted(KakeyaError):
    """The history would exceed what the KV strategy can attend to (`full` past max context)."""

    code = "OUT_OF_RANGE"


class NothingToGenerateFrom(KakeyaError):
    code = "FAILED_PRECONDITION"


class CapacityExhausted(KakeyaError):
    code = "RESOURCE_EXHAUSTED"


class TooManyPendingTokens(KakeyaError):
    """A session would hold more appended-but-not-prefilled tokens than the daemon allows (--max-pending-tokens)."""

    code = "RESOURCE_EXHAUSTED"


class CacheInvariantError(KakeyaError):
    """INV-1 / INV-2 violated inside a cache mutation: a bug; the session is failed and freed."""

    code = "FAILED_PRECONDITION"

    def __init__(self, kind: str, message: str):
        super().__init__(f"cache invariant {kind} violated: {message}")
        self.kind = kind


class SessionStateUnusable(KakeyaError):
    """A persisted session's files cannot be resumed (truncated, corrupted, another model or format)."""

    code = "FAILED_PRECONDITION"
