"""SessionInfo / ServerInfo cross the wire field by field, by name: the runtime's dataclass -> the
proto (grpc_service.message_from) -> the SDK's dataclass (kakeya.types from_pb). Every field is
given a value of its own here, so a field one mapping drops or swaps fails; no daemon is needed."""
import dataclasses

import pytest

import kakeya
from inference_engine.server import runtime
from inference_engine.server.grpc_service import message_from
from kakeya_wire.v1 import runtime_pb2 as pb


def distinct(cls, **given):
    """A `cls` whose every field holds a value no other field holds (by its default's type)."""
    values = {}
    for i, f in enumerate(dataclasses.fields(cls), start=1):
        if f.name in given:
            continue
        sample = f.default if f.default is not dataclasses.MISSING else None
        if f.type in ("str",) or isinstance(sample, str):
            values[f.name] = f"{f.name}-{i}"
        elif f.type in ("float",) or isinstance(sample, float):
            values[f.name] = i + 0.5
        elif f.type in ("tuple",) or isinstance(sample, tuple):
            values[f.name] = (i, i + 100)
        else:
            values[f.name] = i
    return cls(**values, **given)


def test_session_info_every_field_round_trips():
    info = distinct(runtime.SessionInfo)
    got = kakeya.SessionInfo.from_pb(message_from(info, pb.GetSessionInfoResponse))
    assert dataclasses.asdict(got) == dataclasses.asdict(info)
    assert {f.name for f in dataclasses.fields(kakeya.SessionInfo)} == {f.name for f in dataclasses.fields(runtime.SessionInfo)}


def test_server_info_every_field_round_trips():
    info = distinct(runtime.ServerInfo, kv_params={"window": "32", "compressor": "kakeya_d4", "sink": "4"})
    persistence = pb.PersistenceInfo(mode="turn", state_dir="/s", shared=True, daemon_id="d-1", lease_ttl_seconds=7.5)
    msg = message_from(info, pb.GetServerInfoResponse, kv_strategy=pb.KVStrategyInfo(name=info.kv_strategy, params=info.kv_params),
                       kv_params=None, persistence=persistence)
    got = kakeya.ServerInfo.from_pb(msg)
    assert {k: v for k, v in dataclasses.asdict(got).items() if k != "persistence"} == dataclasses.asdict(info)
    assert list(got.kv_params) == ["compressor", "sink", "window"]  # by key
    assert (got.sink, got.window, got.compressor) == (4, 32, "kakeya_d4")
    assert got.persistence == kakeya.PersistenceInfo("turn", "/s", True, "d-1", 7.5)


def test_an_old_servers_missing_fields_read_as_defaults():
    got = kakeya.ServerInfo.from_pb(pb.GetServerInfoResponse(model_id="m"))
    assert got.persistence == kakeya.PersistenceInfo() and got.kv_params == {} and got.default_eos_token_ids == ()


def test_a_dataclass_field_the_proto_lacks_is_refused():
    @dataclasses.dataclass
    class Wider:
        session_id: str = "s"
        not_on_the_wire: int = 1

    with pytest.raises(TypeError, match="not_on_the_wire"):
        message_from(Wider(), pb.GetSessionInfoResponse)
