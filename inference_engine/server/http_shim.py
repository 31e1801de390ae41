"""Deprecated OpenAI-style HTTP shim (ADR 0008 §2.7): FastAPI + uvicorn on a background thread.

Routes: POST /v1/chat/completions, POST /v1/completions (both with SSE streaming), GET /v1/models.
Every request is one single-shot session on the shared Runtime: create (with the rendered
prompt) -> generate -> close, always closed, also on errors and abandoned streams. No
session id leaves the server; long-session features are gRPC-only. Every response carries
Deprecation / Sunset / Link headers; with an API key, every route needs `Authorization:
Bearer <key>` (constant-time compare, like gRPC).

The shim needs the model's tokenizer (from the model directory): without one it refuses to
start; without a chat template it serves /v1/completions and answers chat with 400. A prompt
longer than the KV strategy attends to (sink + window; the model context under `full`) is
refused with 400 rather than silently losing its middle.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import pathlib
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_engine.engine.events import GenerationDone, TokenGenerated
from inference_engine.engine.requests import SamplingParams
from inference_engine.errors import KakeyaError, SessionNotFound
from inference_engine.server.config import ConfigError, ServeConfig, split_bind
from inference_engine.server.http_openai import (
    DEPRECATION_HEADERS,
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ResponseShape,
    ShimError,
    from_kakeya_error,
    model_card,
    sse,
    unsupported_field,
)
from inference_engine.server.http_text import ModelText, StopMatcher, TokenizerUnavailable, load_model_text
from inference_engine.server.runtime import MAX_TOKENS_PER_CALL, Runtime

log = logging.getLogger(__name__)
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # what the OpenAI API accepts

_CREATED, _END = object(), object()


def error_response(err: ShimError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# -- one request = one session -------------------------------------------------------------
class SingleShot:
    """create -> generate -> close on a worker thread; engine events flow to the event loop.

    The worker owns the session and always closes it. `cancel()` (client gone, stop string
    hit, server stopping) makes the engine stop at its next step.
    """

    def __init__(self, runtime: Runtime, prompt: list[int], eos_token_ids, max_tokens: int, sampling: SamplingParams):
        self._rt, self._prompt, self._eos = runtime, prompt, sorted(eos_token_ids)
        self._max_tokens, self._sampling = max_tokens, sampling
        self._cancel = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        self._cancel.set()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # event loop already closed (server stopped); nobody is listening
            self._cancel.set()

    def _work(self) -> None:
        try:
            session = self._rt.create_session(self._prompt, self._eos, ephemeral=True)  # closed right after: never saved
        except BaseException as e:  # noqa: BLE001 - handed to the request
            self._put(e)
            return
        self._put(_CREATED)
        try:
            for ev in self._rt.generate(session.id, self._max_tokens, self._sampling, self._cancel.is_set):
                self._put(ev)
        except BaseException as e:  # noqa: BLE001
            self._put(e)
        finally:
            try:
                self._rt.close(session.id)
            except SessionNotFound:
                pass  # evicted or failed meanwhile: already gone
            self._put(_END)

    async def start(self) -> None:
        """Returns once the session exists; raises the runtime's error if it could not be created."""
        threading.Thread(target=self._work, name="kakeya-http-request", daemon=True).start()
        try:
            first = await self._queue.get()
        except BaseException:  # the request died while the session was being created: don't generate for nobody
            self.cancel()
            raise
        if isinstance(first, BaseException):
            raise first

    async def events(self):
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class _Outcome:
    finish_reason = "stop"
    completion_tokens = 0


async def _texts(shot: SingleShot, text: ModelText, stops: list[str], out: _Outcome):
    """Text deltas of one generation, cut at the first stop string; fills `out` at the end."""
    detok, matcher = text.detokenizer(), StopMatcher(stops)
    async for ev in shot.events():
        if isinstance(ev, TokenGenerated):
            out.completion_tokens += 1
            piece = matcher.feed(detok.push(ev.token_id))
            if piece:
                yield piece
            if matcher.hit:
                shot.cancel()
                out.finish_reason = "stop"
                return
        elif isinstance(ev, GenerationDone):
            if ev.stop_reason == "cancelled":  # not by us (stop strings return above): client gone or server stopping
                raise ShimError(503, "generation was cancelled: the server is shutting down or the client went away; retry",
                                type="server_error", code="cancelled")
            out.finish_reason = FINISH_REASONS[ev.stop_reason]
    tail = matcher.feed(detok.flush())
    if matcher.hit:
        out.finish_reason = "stop"
    else:
        tail += matcher.flush()
    if tail:
        yield tail


async def _watch_disconnect(request: Request, on_gone) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    on_gone()


# -- the app -------------------------------------------------------------------------------
class HttpShim:
    def __init__(self, runtime: Runtime, text: ModelText, *, model_names: set[str]):
        self.rt, self.text = runtime, text
        info = runtime.server_info()
        self.model_id, self.max_context, self.kv_strategy = info.model_id, info.max_context, info.kv_strategy
        self.model_names = {self.model_id, *model_names}
        # Longest prompt the model attends to in full: past it a strategy that forgets (no history
        # limit: sink_window) would silently drop the prompt's middle, and `full` has no room left
        # to generate.
        self.prompt_limit = self.max_context - 1
        if runtime.engine.strategy.forgets:
            sink, window = int(info.kv_params.get("sink", 0)), int(info.kv_params.get("window", 0))
            self.prompt_limit = min(self.prompt_limit, sink + window)

    def app(self) -> FastAPI:
        app = FastAPI(title="kakeya deprecated OpenAI-style shim", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ShimError, _shim_error)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        app.get("/v1/models")(self.list_models)
        app.get("/v1/models/{model_id:path}")(self.get_model)
        return app

    async def list_models(self):
        return {"object": "list", "data": [model_card(self.model_id)]}

    async def get_model(self, model_id: str):
        self._check_model(model_id)
        return model_card(self.model_id)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_common(body)
        if not self.text.has_chat_template:
            raise ShimError(400, f"model {self.model_id!r} ships no chat template, so the shim cannot render messages; "
                                 f"use /v1/completions with a raw prompt, or the gRPC API with your own token ids",
                            param="messages", code="chat_template_missing")
        for i, m in enumerate(body.messages):  # a template would render any role name as text: refuse it, as OpenAI does
            role = m.get("role")
            if isinstance(role, str) and role not in OPENAI_ROLES:
                raise ShimError(400, f"messages[{i}].role {role[:40]!r} is not a chat role; use one of "
                                     f"{', '.join(OPENAI_ROLES)}", param=f"messages[{i}].role")
        try:
            prompt = self.text.render_chat(body.messages)
        except (ValueError, TypeError, KeyError) as e:
            raise ShimError(400, f"messages could not be rendered with the model's chat template: {e}", param="messages") from e
        except Exception as e:  # noqa: BLE001 - jinja raises its own errors (e.g. raise_exception in templates)
            raise ShimError(400, f"messages could not be rendered with the model's chat template: {type(e).__name__}: {e}",
                            param="messages") from e
        return await self._respond(request, body, prompt, ResponseShape(chat=True, model=self.model_id), "messages")

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_common(body)
        p = body.prompt
        first = p[0] if isinstance(p, list) and p else None
        if isinstance(first, (str, list)):  # a list of prompts (strings or token lists): one only
            if len(p) != 1:
                raise ShimError(400, f"prompt holds {len(p)} prompts; the shim serves one prompt per request", param="prompt")
            prompt = self.text.encode(first) if isinstance(first, str) else [int(t) for t in first]
        elif isinstance(p, str):
            prompt = self.text.encode(p)
        else:  # one token list (its first item is an int) or empty
            prompt = [int(t) for t in cast("list[int]", p)]
        return await self._respond(request, body, prompt, ResponseShape(chat=False, model=self.model_id), "prompt")

    # -- shared ------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ShimError(404, f"model {name!r} is not served here; this daemon serves {self.model_id!r} (GET /v1/models)",
                            param="model", code="model_not_found")

    def _check_common(self, body: GenerationRequest) -> None:
        err = unsupported_field(body)
        if err is not None:
            raise err
        self._check_model(body.model)

    def _plan(self, body, prompt: list[int], prompt_param: str) -> tuple[int, SamplingParams]:
        if not prompt:
            raise ShimError(400, "the prompt is empty; send at least one token of text", param=prompt_param)
        if len(prompt) > self.prompt_limit:
            raise ShimError(400, f"the prompt is {len(prompt)} tokens; this server attends to at most {self.prompt_limit} "
                                 f"(model context {self.max_context}, kv strategy {self.kv_strategy}). "
                                 f"Shorten it, serve with a larger --window, or use the gRPC API for long sessions",
                            param=prompt_param, code="context_length_exceeded")
        max_tokens = body.token_limit() or max(1, self.max_context - len(prompt))
        if max_tokens > MAX_TOKENS_PER_CALL:
            raise ShimError(400, f"max_tokens must be at most {MAX_TOKENS_PER_CALL}, got {max_tokens}", param="max_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default
        top_p = 1.0 if body.top_p is None else body.top_p
        if top_p == 0.0:  # OpenAI's limit of a vanishing nucleus; the engine reads top_p=0 as "off"
            temperature, top_p = 0.0, 1.0
        seed = secrets.randbits(63) if body.seed is None else body.seed % (1 << 64)  # no seed: fresh randomness, as OpenAI
        return max_tokens, SamplingParams(temperature=temperature, top_p=top_p, seed=seed)

    async def _respond(self, request: Request, body, prompt: list[int], shape: ResponseShape, prompt_param: str):
        stops = body.stop_strings()
        max_tokens, sampling = self._plan(body, prompt, prompt_param)
        shot = SingleShot(self.rt, prompt, self.text.eos_token_ids, max_tokens, sampling)
        try:
            await shot.start()
        except KakeyaError as e:
            raise from_kakeya_error(e) from e
        watcher = asyncio.create_task(_watch_disconnect(request, shot.cancel))
        if body.stream:
            return StreamingResponse(self._stream(shot, stops, shape, len(prompt), body.include_usage(), watcher),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        out = _Outcome()
        try:
            parts = [piece async for piece in _texts(shot, self.text, stops, out)]
        except KakeyaError as e:
            raise from_kakeya_error(e) from e
        finally:
            shot.cancel()
            watcher.cancel()
        return shape.full("".join(parts), out.finish_reason, len(prompt), out.completion_tokens)

    async def _stream(self, shot: SingleShot, stops, shape: ResponseShape, prompt_tokens: int, include_usage: bool, watcher):
        out = _Outcome()
        try:
            if shape.chat:
                yield sse(shape.chunk(None, first=True))
            async for piece in _texts(shot, self.text, stops, out):
                yield sse(shape.chunk(piece))
            yield sse(shape.chunk(None, out.finish_reason))
            if include_usage:
                yield sse(shape.usage_chunk(prompt_tokens, out.completion_tokens))
            yield sse("[DONE]")
        except KakeyaError as e:
            yield sse(from_kakeya_error(e).body())  # headers are gone; the OpenAI client raises on an error event
        except ShimError as e:
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001
            log.exception("internal error in the HTTP shim stream")
            yield sse(ShimError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body())
        finally:
            shot.cancel()
            watcher.cancel()


# -- error handlers: everything leaves in OpenAI's error shape --------------------------------
# Starlette types every exception handler as taking Exception; each is registered for its own class only.
async def _shim_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, ShimError)
    return error_response(e)


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
    code = "not_found" if e.status_code == 404 else None
    return error_response(ShimError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.error("internal error in the HTTP shim on %s %s", request.method, request.url.path, exc_info=e)
    return error_response(ShimError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


async def _validation_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        err = ShimError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    else:
        where = ".".join(loc) or "body"
        err = ShimError(400, f"invalid request body at {where}: {first.get('msg', 'invalid')} (got {first.get('input')!r})"[:2000],
                        param=loc[0] if loc else None)
    return error_response(err)


class _DeprecationAndAuth:
    """Outermost ASGI layer: adds the deprecation headers to every response (errors and 500s
    included) and checks the bearer key before anything reads the body."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._headers = [(k.lower().encode(), v.encode()) for k, v in DEPRECATION_HEADERS.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_marked(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *self._headers]}
            await send(message)

        if self._expected is not None:
            got = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    got = v
            if not hmac.compare_digest(got, self._expected):
                err = ShimError(401, "missing or wrong API key: send header 'Authorization: Bearer <key>'",
                                type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await error_response(err)(scope, receive, send_marked)
        await self.app(scope, receive, send_marked)


# -- lifecycle -----------------------------------------------------------------------------
def _model_dir(runtime: Runtime, cfg: ServeConfig) -> pathlib.Path:
    recorded = runtime.model_info.path  # where the runtime loaded its weights, if recorded
    if recorded:
        return pathlib.Path(recorded)
    try:
        from inference_engine.model_store import resolve_model
    except ImportError:
        return pathlib.Path(cfg.model).expanduser()
    return pathlib.Path(resolve_model(cfg.model))


def _listen(host: str, port: int) -> socket.socket:
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def start_http_shim(runtime: Runtime, cfg: ServeConfig) -> Callable[[], None]:
    """Serve the shim on the gRPC bind host at `cfg.http_port`; returns a zero-arg stop callable."""
    import uvicorn

    model_dir = _model_dir(runtime, cfg)
    info = runtime.model_info
    try:
        text = load_model_text(model_dir, vocab_size=info.vocab_size, model_eos_token_ids=info.eos_token_ids)
    except TokenizerUnavailable as e:
        raise ConfigError(f"--http-port: {e}") from e
    shim = HttpShim(runtime, text, model_names={str(cfg.model), model_dir.name})
    host = split_bind(cfg.bind)[0] or "127.0.0.1"
    try:
        sock = _listen(host, cfg.http_port)
    except OSError as e:
        raise ConfigError(f"--http-port: could not listen on {host}:{cfg.http_port}: {e}") from e
    config = uvicorn.Config(_DeprecationAndAuth(shim.app(), cfg.api_key), lifespan="off", log_config=None,
                            access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kakeya-http-shim", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise ConfigError(f"--http-port: the HTTP shim did not start on {host}:{cfg.http_port}")
        time.sleep(0.01)
    log.warning("deprecated OpenAI-style HTTP shim on http://%s:%d/v1 (single-shot sessions; long sessions are gRPC-only)",
                host, sock.getsockname()[1])

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()

    return stop
