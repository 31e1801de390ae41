"""Synchronous client: `Client(target).create_session()` -> Session with append/generate/info/close."""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import grpc

from kakeya.errors import KakeyaError, SessionOwnedElsewhereError, from_rpc_error
from kakeya.requests import append_request, create_request, generate_request, history_request
from kakeya.routing import DEFAULT_OWNER_WAIT_S, OwnerWait, check_session_id, new_session_id, session_metadata
from kakeya.types import GenerateStream, GenerationResult, ServerInfo, SessionInfo, note_durability
from kakeya_wire.v1 import runtime_pb2 as pb
from kakeya_wire.v1 import runtime_pb2_grpc as pb_grpc


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Session:
    """A server-side session: raw token history + resident attention state."""

    def __init__(self, client: "Client", session_id: str):
        self._client = client
        self.id = session_id
        self.last_result: GenerationResult | None = None
        self.closed = False
        # What the daemon last reported (append, generate, info): history tokens on disk, i.e. what
        # the session resumes with after a crash (0 with persistence off), and why saves fail ("").
        self.durable_length = 0
        self.save_error = ""

    def append(self, token_ids: Sequence[int]) -> int:
        """Append raw token ids; returns the history length. No model work happens here."""
        r = self._client._call(self._client._stub.AppendTokens, append_request(self.id, token_ids), self.id)
        note_durability(self, r.durable_length, r.save_error, r.history_length)
        return r.history_length

    def generate(self, max_tokens: int = 128, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 timeout: float | None = None) -> Iterator[int]:
        """Stream generated token ids. After the iterator ends, `last_result` has the Done event.

        Closing the iterator early (break / close()) cancels the call on the server; the
        tokens generated so far stay in the session history. A call answered
        SessionOwnedElsewhereError before its first event is retried (see Client's owner_wait_s).
        """
        req = generate_request(self.id, max_tokens, temperature, top_k, top_p, seed)
        md = session_metadata(self._client._md, self.id)
        wait = OwnerWait(self._client.owner_wait_s)
        self.last_result = None
        while True:
            call = self._client._stub.Generate(req, metadata=md, timeout=timeout)
            stream, started = GenerateStream(), False
            try:
                for ev in call:
                    started = True
                    tok = stream.token(ev)
                    if tok is not None:
                        yield tok
                self.last_result = stream.result
                if stream.result is not None:
                    note_durability(self, stream.result.durable_length, stream.result.save_error)
                return
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if started or not isinstance(err, SessionOwnedElsewhereError):
                    raise err from None
            finally:
                call.cancel()
            wait.retry(err)

    def generate_all(self, max_tokens: int = 128, **kwargs) -> GenerationResult:
        """Run a whole Generate and return its result (tokens included)."""
        for _ in self.generate(max_tokens, **kwargs):
            pass
        return self.last_result

    def info(self) -> SessionInfo:
        request = pb.GetSessionInfoRequest(session_id=self.id)
        info = SessionInfo.from_pb(self._client._call(self._client._stub.GetSessionInfo, request, self.id))
        note_durability(self, info.durable_length, info.save_error, info.history_length)
        return info

    def history(self, start: int = 0) -> list[int]:
        """Token ids from `start`; waits for an in-flight Generate (exact after a cancel)."""
        return list((self._client._call(self._client._stub.GetHistory, history_request(self.id, start), self.id)).token_ids)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._client._call(self._client._stub.CloseSession, pb.CloseSessionRequest(session_id=self.id), self.id)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        except KakeyaError:
            pass  # already gone server-side (evicted / failed); nothing left to free


def default_address() -> str:
    """$KAKEYA_ADDRESS (the one variable every client and example reads), else the daemon's default."""
    return os.environ.get("KAKEYA_ADDRESS") or "127.0.0.1:50051"


class Client:
    """Connection to a Kakeya daemon, or to a proxy in front of several (deploy/haproxy). `target` is
    HOST:PORT (default: $KAKEYA_ADDRESS, else 127.0.0.1:50051). `owner_wait_s`: how long a session
    call keeps retrying while another daemon still holds the session (SessionOwnedElsewhereError;
    e.g. a replica that died, until its lease expires) before raising it."""

    def __init__(self, target: str | None = None, *, api_key: str | None = None, options: Sequence | None = None,
                 owner_wait_s: float = DEFAULT_OWNER_WAIT_S):
        self.target = target or default_address()
        self._channel = grpc.insecure_channel(self.target, options=list(options or ()))
        self._stub = pb_grpc.RuntimeServiceStub(self._channel)
        self._md = _metadata(api_key)
        self.owner_wait_s = owner_wait_s

    def _call(self, method, request, session_id: str | None = None):
        """One unary call; with `session_id`, routed by it and retried while another daemon holds it."""
        md = self._md if session_id is None else session_metadata(self._md, session_id)
        wait = OwnerWait(self.owner_wait_s)
        while True:
            try:
                return method(request, metadata=md)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if session_id is None or not isinstance(err, SessionOwnedElsewhereError):
                raise err
            wait.retry(err)

    def create_session(self, initial_tokens: Sequence[int] = (), *, eos_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                       session_id: str | None = None) -> Session:
        """A new session. Its id is `session_id` when given (8-128 characters of [A-Za-z0-9_-]; an id in use
        raises AlreadyExistsError), else a random one chosen here, so that a proxy routes this call like
        every later call of the session."""
        sid = check_session_id(session_id) if session_id is not None else new_session_id()
        req = create_request(initial_tokens, eos_token_ids, ignore_eos, sid)
        return Session(self, self._call(self._stub.CreateSession, req, sid).session_id)

    def session(self, session_id: str) -> Session:
        """A handle on an existing session id (no RPC)."""
        return Session(self, session_id)

    def server_info(self) -> ServerInfo:
        return ServerInfo.from_pb(self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest()))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
