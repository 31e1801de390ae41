"""Request messages, checked on the client: a value the wire cannot carry (a token id past 32 bits, a
negative seed, a non-finite temperature) raises InvalidArgumentError naming it, as the TypeScript SDK
does, instead of protobuf's bare ValueError (or, over the raw wire, a silent truncation). Range checks
the daemon makes itself (the vocabulary, max_tokens, top_p) stay the daemon's."""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable

from kakeya.errors import InvalidArgumentError
from kakeya_wire.v1 import runtime_pb2 as pb

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1


def _int(value) -> int | None:
    """`value` as an int when it is one (numpy integers too; never a bool or a float), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def token_ids(ids: Iterable[int], what: str) -> list[int]:
    try:
        out = list(ids)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an iterable of integer token ids, got {type(ids).__name__}") from None
    checked = [_int(t) for t in out]
    for i, t in enumerate(checked):
        if t is None or not INT32_MIN <= t <= INT32_MAX:
            raise InvalidArgumentError(f"{what}[{i}] = {out[i]!r} is not a 32-bit integer token id; pass integer ids from "
                                       f"your tokenizer")
    return checked


def integer_option(name: str, value, lo: int, hi: int) -> int:
    n = _int(value)
    if n is None or not lo <= n <= hi:
        raise InvalidArgumentError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return n


def number_option(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def create_request(initial_tokens, eos_token_ids, ignore_eos: bool, session_id: str = ""):
    return pb.CreateSessionRequest(initial_tokens=token_ids(initial_tokens, "initial_tokens"),
                                   eos_token_ids=token_ids(eos_token_ids, "eos_token_ids"), ignore_eos=bool(ignore_eos),
                                   session_id=session_id)


def append_request(session_id: str, ids):
    return pb.AppendTokensRequest(session_id=session_id, token_ids=token_ids(ids, "token_ids"))


def generate_request(session_id: str, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int):
    return pb.GenerateRequest(
        session_id=session_id,
        max_tokens=integer_option("max_tokens", max_tokens, 0, UINT32_MAX),
        sampling=pb.SamplingParams(temperature=number_option("temperature", temperature),
                                   top_k=integer_option("top_k", top_k, 0, INT32_MAX), top_p=number_option("top_p", top_p),
                                   seed=integer_option("seed", seed, 0, UINT64_MAX)),
    )


def history_request(session_id: str, start: int):
    return pb.GetHistoryRequest(session_id=session_id, start=integer_option("start", start, 0, UINT64_MAX))
