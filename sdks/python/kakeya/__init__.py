"""Kakeya Python SDK: sessions over gRPC with raw token ids.

    from kakeya import Client
    with Client("127.0.0.1:50051") as client, client.create_session() as s:
        s.append(ids)
        for tok in s.generate(max_tokens=64):
            ...
"""
from kakeya.aio import AsyncClient, AsyncSession
from kakeya.client import Client, Session
from kakeya.errors import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KakeyaError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SessionNotFoundError,
    SessionNotSavedWarning,
    SessionOwnedElsewhereError,
    UnauthenticatedError,
    UnavailableError,
)
from kakeya.routing import SESSION_HEADER
from kakeya.types import GenerationResult, PersistenceInfo, ServerInfo, SessionInfo

__all__ = [
    "AsyncClient", "AsyncSession", "Client", "Session", "GenerationResult", "PersistenceInfo", "ServerInfo", "SessionInfo",
    "KakeyaError", "InvalidArgumentError", "SessionNotFoundError", "UnauthenticatedError", "PermissionDeniedError",
    "FailedPreconditionError", "OutOfRangeError", "ResourceExhaustedError", "CancelledError", "DeadlineExceededError",
    "UnavailableError", "InternalError", "SessionNotSavedWarning", "AlreadyExistsError", "SessionOwnedElsewhereError",
    "SESSION_HEADER",
]
__version__ = "0.4.0"
