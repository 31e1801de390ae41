"""gRPC servicer: protobuf <-> Runtime calls, typed errors -> gRPC status codes.

Imports no framework (torch, mlx): plain objects in from the runtime, protobuf out.
"""
from __future__ import annotations

import dataclasses
import functools
import hmac
import logging

import grpc
from google.protobuf.message import DecodeError

from inference_engine.engine.events import GenerationDone, HistoryTruncated, TokenGenerated
from inference_engine.engine.requests import SamplingParams
from inference_engine.errors import KakeyaError, SessionOwnedElsewhere
from inference_engine.server.runtime import Runtime
from kakeya_wire.v1 import runtime_pb2 as pb
from kakeya_wire.v1 import runtime_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STOP_REASONS = {
    "max_tokens": pb.STOP_REASON_MAX_TOKENS,
    "eos": pb.STOP_REASON_EOS,
    "cancelled": pb.STOP_REASON_CANCELLED,
    "context_full": pb.STOP_REASON_CONTEXT_FULL,
}


def message_from(obj, message_type, **special):
    """A `message_type` holding the dataclass `obj`: each of its fields set on the message field of
    the same name (a tuple on a repeated field, a mapping on a map field), except those in
    `special`, name -> the value to set instead (None: nothing, for a field another one carries).
    A dataclass field the message lacks is a TypeError: add it to the proto too."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)} | special
    values = {k: v for k, v in values.items() if v is not None}
    missing = sorted(set(values) - set(message_type.DESCRIPTOR.fields_by_name))
    if missing:
        raise TypeError(f"{type(obj).__name__} fields {missing} have no field in {message_type.DESCRIPTOR.full_name}")
    return message_type(**values)


def _status(err: KakeyaError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.code, grpc.StatusCode.INTERNAL)


def _abort(context, err: KakeyaError, metrics=None):
    """Abort with the error's status; a session another daemon holds also names it in trailing metadata
    (`kakeya-session-owner`), which is how the SDKs tell it apart and retry."""
    if isinstance(err, SessionOwnedElsewhere):
        context.set_trailing_metadata(err.trailers())
        if metrics is not None:
            metrics.session_owned_elsewhere_total.inc()
    context.abort(_status(err), str(err))


def _typed_errors(method):
    """Map KakeyaError to its status; anything else is INTERNAL and logged (the daemon lives on)."""

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except KakeyaError as e:
            _abort(context, e, self.rt.metrics)
        except Exception as e:  # noqa: BLE001 - a bug must not take the daemon down
            log.exception("internal error in %s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    return unary


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    def __init__(self, runtime: Runtime):
        self.rt = runtime

    @_typed_errors
    def CreateSession(self, request, context):
        s = self.rt.create_session(list(request.initial_tokens), list(request.eos_token_ids), request.ignore_eos,
                                   session_id=request.session_id)
        return pb.CreateSessionResponse(session_id=s.id, history_length=len(s.history))

    @_typed_errors
    def AppendTokens(self, request, context):
        s = self.rt.append(request.session_id, list(request.token_ids))
        return pb.AppendTokensResponse(history_length=len(s.history), pending_tokens=len(s.pending_tokens),
                                       durable_length=s.durable_length, save_error=s.save_error)

    def Generate(self, request, context):
        sp = request.sampling
        sampling = SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p or 1.0, seed=sp.seed)
        try:
            for ev in self.rt.generate(request.session_id, request.max_tokens, sampling, lambda: not context.is_active()):
                if isinstance(ev, TokenGenerated):
                    yield pb.GenerateResponse(token=pb.TokenEvent(token_id=ev.token_id, position=ev.position))
                elif isinstance(ev, HistoryTruncated):
                    yield pb.GenerateResponse(
                        history_truncated=pb.HistoryTruncatedEvent(dropped_tokens=ev.dropped_tokens,
                                                                   total_dropped_tokens=ev.total_dropped_tokens)
                    )
                elif isinstance(ev, GenerationDone):
                    yield pb.GenerateResponse(
                        done=pb.DoneEvent(
                            stop_reason=STOP_REASONS[ev.stop_reason],
                            generated_tokens=ev.generated_tokens,
                            prefill_tokens=ev.prefill_tokens,
                            prefill_seconds=ev.prefill_seconds,
                            total_seconds=ev.total_seconds,
                            time_to_first_token_seconds=ev.time_to_first_token_seconds,
                            drafted_tokens=ev.drafted_tokens,
                            accepted_tokens=ev.accepted_tokens,
                            durable_length=getattr(ev, "durable_length", 0),
                            save_error=getattr(ev, "save_error", ""),
                            reencoded_tokens=ev.reencoded_tokens,
                        )
                    )
        except KakeyaError as e:
            _abort(context, e, self.rt.metrics)
        except Exception as e:  # noqa: BLE001
            log.exception("internal error in Generate")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    @_typed_errors
    def GetHistory(self, request, context):
        ids = self.rt.history(request.session_id, request.start)
        return pb.GetHistoryResponse(token_ids=ids, history_length=request.start + len(ids))

    @_typed_errors
    def CloseSession(self, request, context):
        self.rt.close(request.session_id)
        return pb.CloseSessionResponse()

    @_typed_errors
    def GetSessionInfo(self, request, context):
        return message_from(self.rt.session_info(request.session_id), pb.GetSessionInfoResponse)

    @_typed_errors
    def GetServerInfo(self, request, context):
        i = self.rt.server_info()
        return message_from(i, pb.GetServerInfoResponse, kv_strategy=pb.KVStrategyInfo(name=i.kv_strategy, params=dict(i.kv_params)),
                            kv_params=None, persistence=self._persistence())

    def _persistence(self) -> pb.PersistenceInfo:
        """A runtime with a persister saves every turn (--persist turn); without one, nothing."""
        persister = self.rt.persister
        if persister is None:
            return pb.PersistenceInfo(mode="off")
        state_dir = getattr(getattr(persister, "dir", None), "root", "")  # SessionFiles: its StateDir
        leases = getattr(persister, "leases", None)
        if leases is None or not leases.shared:
            return pb.PersistenceInfo(mode="turn", state_dir=str(state_dir))
        return pb.PersistenceInfo(mode="turn", state_dir=str(state_dir), shared=True, daemon_id=leases.daemon_id,
                                  lease_ttl_seconds=leases.ttl_s)


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Every RPC but health checks needs `authorization: Bearer <key>` (constant-time compare)."""

    EXEMPT_PREFIX = "/grpc.health.v1.Health/"

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send metadata 'authorization: Bearer <key>'")

        self._deny_unary: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self.EXEMPT_PREFIX):
            return continuation(handler_call_details)
        got = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(got, self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def add_runtime_service(servicer: RuntimeServicer, server) -> None:
    """Register `servicer` like the generated add_..._to_server, except that request bytes are
    parsed here: bytes that are not the method's message answer INVALID_ARGUMENT naming the
    message type, instead of grpcio's INTERNAL "Exception deserializing request!"."""
    service = pb.DESCRIPTOR.services_by_name["RuntimeService"]
    handlers: dict[str, grpc.RpcMethodHandler[bytes, object]] = {}
    for method in service.methods:
        request_type = getattr(pb, method.input_type.name)
        serialize = getattr(pb, method.output_type.name).SerializeToString
        impl = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _parsed_stream(impl, request_type), request_deserializer=None, response_serializer=serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsed_unary(impl, request_type), request_deserializer=None, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _parse(request_type, raw: bytes, context):
    try:
        return request_type.FromString(raw)
    except DecodeError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"request body is not a valid {request_type.DESCRIPTOR.full_name}: {e}")


def _parsed_unary(impl, request_type):
    def handler(raw, context):
        return impl(_parse(request_type, raw, context), context)

    return handler


def _parsed_stream(impl, request_type):
    def handler(raw, context):
        yield from impl(_parse(request_type, raw, context), context)

    return handler
