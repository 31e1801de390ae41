"""Session calls a proxy can route, and the wait for a session another daemon still holds.

Every call about a session carries its id as `x-kakeya-session` request metadata, so a proxy in
front of several daemons (deploy/haproxy) hashes it without parsing protobuf. A session the SDK
creates gets a client-chosen id (192 random bits, like the server's), so CreateSession routes the
same way as the calls after it.

A daemon that reaches a session another live daemon holds (its lease in the shared state
directory) answers UNAVAILABLE with `kakeya-session-owner` trailing metadata: nothing was done,
and the holder is asked to let it go. The SDK retries such a call through the same channel
(backoff up to 0.5 s) for up to `owner_wait_s`, then raises SessionOwnedElsewhereError.
"""
from __future__ import annotations

import re
import secrets
import time

from kakeya.errors import InvalidArgumentError, SessionOwnedElsewhereError

SESSION_HEADER = "x-kakeya-session"
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,128}")  # the daemon's rule (inference_engine/session/store.py)
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 0.5
DEFAULT_OWNER_WAIT_S = 60.0


def new_session_id() -> str:
    """token_urlsafe(24), never starting with "-" (as the daemon's ids): a command line (`kakeya chat --session ID`,
    `kakeya sessions rm ID`) would read such an id as an option."""
    while True:
        sid = secrets.token_urlsafe(24)
        if not sid.startswith("-"):
            return sid


def check_session_id(session_id) -> str:
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise InvalidArgumentError(f"session_id {session_id!r:.80} is not a valid session id: use 8 to 128 characters of "
                                   f"[A-Za-z0-9_-], or leave it out for a random one")
    return session_id


def session_metadata(base, session_id: str) -> tuple:
    """The call's metadata: the client's (API key) plus the routing header. An id no session can have
    (not 8-128 characters of [A-Za-z0-9_-]; some are not even legal header values) is not routed: any
    daemon answers NOT_FOUND for it."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        return tuple(base or ())
    return (*(base or ()), (SESSION_HEADER, session_id))


class OwnerWait:
    """Backoff for calls answered SessionOwnedElsewhereError: `retry(err)` sleeps and returns, or
    re-raises `err` once `wait_s` has passed since the first call."""

    def __init__(self, wait_s: float):
        self.deadline = time.monotonic() + max(0.0, wait_s)
        self.delay = RETRY_FIRST_S

    def next_delay(self, err: SessionOwnedElsewhereError) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise err
        delay, self.delay = min(self.delay, left), min(RETRY_MAX_S, self.delay * 2)
        return delay

    def retry(self, err: SessionOwnedElsewhereError) -> None:
        time.sleep(self.next_delay(err))
