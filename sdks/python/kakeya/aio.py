"""asyncio client on grpc.aio, mirroring the synchronous surface with `await` / `async for`."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from kakeya.client import default_address
from kakeya.errors import KakeyaError, SessionOwnedElsewhereError, from_rpc_error
from kakeya.requests import append_request, create_request, generate_request, history_request
from kakeya.routing import DEFAULT_OWNER_WAIT_S, OwnerWait, check_session_id, new_session_id, session_metadata
from kakeya.types import GenerateStream, GenerationResult, ServerInfo, SessionInfo, note_durability
from kakeya_wire.v1 import runtime_pb2 as pb
from kakeya_wire.v1 import runtime_pb2_grpc as pb_grpc


class AsyncSession:
    def __init__(self, client: "AsyncClient", session_id: str):
        self._client = client
        self.id = session_id
        self.last_result: GenerationResult | None = None
        self.closed = False
        # What the daemon last reported (append, generate, info): history tokens on disk, i.e. what
        # the session resumes with after a crash (0 with persistence off), and why saves fail ("").
        self.durable_length = 0
        self.save_error = ""

    async def append(self, token_ids: Sequence[int]) -> int:
        r = await self._client._call(self._client._stub.AppendTokens, append_request(self.id, token_ids), self.id)
        note_durability(self, r.durable_length, r.save_error, r.history_length)
        return r.history_length

    async def generate(self, max_tokens: int = 128, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                       timeout: float | None = None) -> AsyncIterator[int]:
        req = generate_request(self.id, max_tokens, temperature, top_k, top_p, seed)
        md = session_metadata(self._client._md, self.id)
        wait = OwnerWait(self._client.owner_wait_s)
        self.last_result = None
        while True:  # a call answered SessionOwnedElsewhereError before its first event is retried
            call = self._client._stub.Generate(req, metadata=md, timeout=timeout)
            stream, started = GenerateStream(), False
            try:
                async for ev in call:
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
            await asyncio.sleep(wait.next_delay(err))

    async def generate_all(self, max_tokens: int = 128, **kwargs) -> GenerationResult:
        async for _ in self.generate(max_tokens, **kwargs):
            pass
        return self.last_result

    async def info(self) -> SessionInfo:
        request = pb.GetSessionInfoRequest(session_id=self.id)
        info = SessionInfo.from_pb(await self._client._call(self._client._stub.GetSessionInfo, request, self.id))
        note_durability(self, info.durable_length, info.save_error, info.history_length)
        return info

    async def history(self, start: int = 0) -> list[int]:
        """Token ids from `start`; waits for an in-flight Generate (exact after a cancel)."""
        return list((await self._client._call(self._client._stub.GetHistory, history_request(self.id, start), self.id)).token_ids)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self._client._call(self._client._stub.CloseSession, pb.CloseSessionRequest(session_id=self.id), self.id)

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.close()
        except KakeyaError:
            pass


class AsyncClient:
    def __init__(self, target: str | None = None, *, api_key: str | None = None, options: Sequence | None = None,
                 owner_wait_s: float = DEFAULT_OWNER_WAIT_S):
        """`target`: HOST:PORT (default: $KAKEYA_ADDRESS, else 127.0.0.1:50051); `owner_wait_s`: as Client's."""
        self.target = target or default_address()
        self._channel = grpc.aio.insecure_channel(self.target, options=list(options or ()))
        self._stub = pb_grpc.RuntimeServiceStub(self._channel)
        self._md = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.owner_wait_s = owner_wait_s

    async def _call(self, method, request, session_id: str | None = None):
        md = self._md if session_id is None else session_metadata(self._md, session_id)
        wait = OwnerWait(self.owner_wait_s)
        while True:
            try:
                return await method(request, metadata=md)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if session_id is None or not isinstance(err, SessionOwnedElsewhereError):
                raise err
            await asyncio.sleep(wait.next_delay(err))

    async def create_session(self, initial_tokens: Sequence[int] = (), *, eos_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                             session_id: str | None = None) -> AsyncSession:
        """As Client.create_session: the id is `session_id`, else a random one chosen here."""
        sid = check_session_id(session_id) if session_id is not None else new_session_id()
        req = create_request(initial_tokens, eos_token_ids, ignore_eos, sid)
        return AsyncSession(self, (await self._call(self._stub.CreateSession, req, sid)).session_id)

    def session(self, session_id: str) -> AsyncSession:
        """A handle on an existing session id (no RPC)."""
        return AsyncSession(self, session_id)

    async def server_info(self) -> ServerInfo:
        return ServerInfo.from_pb(await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest()))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
