"""Typed SDK exceptions, one per gRPC status the runtime returns."""
from __future__ import annotations

import grpc


class KakeyaError(Exception):
    """Base class. `code` is the grpc.StatusCode, `details` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgumentError(KakeyaError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class SessionNotFoundError(KakeyaError):
    code = grpc.StatusCode.NOT_FOUND


class UnauthenticatedError(KakeyaError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(KakeyaError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPreconditionError(KakeyaError):
    """The session's cache broke an invariant (it was freed) or the call needs prior state."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRangeError(KakeyaError):
    """The history would exceed the model context under the server's KV strategy."""

    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhaustedError(KakeyaError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class CancelledError(KakeyaError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceededError(KakeyaError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(KakeyaError):
    code = grpc.StatusCode.UNAVAILABLE


class SessionOwnedElsewhereError(UnavailableError):
    """Another live daemon sharing the state directory holds the session (a proxy sent the call to a
    replica that does not hold it, e.g. while a replica comes back). Nothing was done; the daemon
    asked the holder to let the session go. The SDK retries such calls for `owner_wait_s` (a Client
    option) before raising this. `owner` names the holder."""

    OWNER_KEY = "kakeya-session-owner"

    def __init__(self, details: str, code: grpc.StatusCode | None = None, owner: str = ""):
        super().__init__(details, code)
        self.owner = owner


class AlreadyExistsError(KakeyaError):
    """create_session(session_id=...) named an id already in use (live or saved)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class InternalError(KakeyaError):
    code = grpc.StatusCode.INTERNAL


class SessionNotSavedWarning(UserWarning):
    """The daemon could not save a session (e.g. its disk is full): what was appended or generated
    since `durable_length` would be lost in a crash. Issued once each time a session's saves start
    failing; `warnings.simplefilter("error", SessionNotSavedWarning)` turns it into an exception."""

    def __init__(self, session_id: str, durable_length: int, history_length: int | None, reason: str):
        of = f" of {history_length}" if history_length is not None else ""
        super().__init__(f"session {session_id} is not being saved ({reason}): only {durable_length}{of} tokens are "
                         f"durable; the daemon retries, and durable_length grows again once a save succeeds")
        self.session_id, self.durable_length, self.history_length, self.reason = (session_id, durable_length,
                                                                                  history_length, reason)


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        SessionNotFoundError,
        AlreadyExistsError,
        UnauthenticatedError,
        PermissionDeniedError,
        FailedPreconditionError,
        OutOfRangeError,
        ResourceExhaustedError,
        CancelledError,
        DeadlineExceededError,
        UnavailableError,
        InternalError,
    )
}


def from_rpc_error(err: grpc.RpcError) -> KakeyaError:
    code = err.code()
    details = err.details() or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
        owner = next((v for k, v in trailers or () if k == SessionOwnedElsewhereError.OWNER_KEY), None)
        if owner is not None:
            return SessionOwnedElsewhereError(details, code, owner=owner)
    return _BY_CODE.get(code, KakeyaError)(details, code)
