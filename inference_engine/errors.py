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


class SessionOwnedElsewhere(KakeyaError):
    """Another live daemon sharing the state directory holds the session's lease. Nothing was done;
    the holder was asked to let it go, so the call succeeds when retried (the SDKs retry it). The
    holder travels to the client as `kakeya-session-owner` trailing metadata."""

    code = "UNAVAILABLE"
    OWNER_KEY = "kakeya-session-owner"

    def __init__(self, message: str, owner: str = ""):
        super().__init__(message)
        self.owner = owner

    def trailers(self) -> tuple:
        return ((self.OWNER_KEY, self.owner or "unknown"),)


class LeaseLost(SessionOwnedElsewhere):
    """This daemon's lease on a session was fenced by another daemon (e.g. while this one was paused
    past the lease): its writes are refused, and it drops the session from memory."""


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
