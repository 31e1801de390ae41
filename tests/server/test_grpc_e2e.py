"""Every RPC end to end: Python SDK -> real gRPC server on a real port -> engine (tiny model)."""
import threading
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kakeya
from factories import NO_VIOLATIONS, invariant_violations, make_engine, start_server

VOCAB = 256


@pytest.fixture(scope="module")
def server():
    srv = start_server(make_engine("llama", "sink_window", 4, 32, prefill_chunk=16), capacity=4)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    with kakeya.Client(f"127.0.0.1:{server.port}") as c:
        yield c


def history(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_server_info(client):
    info = client.server_info()
    assert info.vocab_size == VOCAB and info.kv_strategy == "sink_window" and (info.sink, info.window) == (4, 32)
    assert info.default_eos_token_ids == (2,) and info.max_context == 2048 and info.session_capacity == 4
    # The strategy is reported generically: a name and its parameters as strings; no research knobs.
    assert info.kv_params == {"compressor": "identity", "sink": "4", "window": "32"} and info.compressor == "identity"
    assert (info.backend, info.device) == ("torch", "cpu")


def test_session_lifecycle(server, client):
    with client.create_session(history(10, 0), ignore_eos=True) as s:
        assert s.append(history(5, 1)) == 15
        toks = list(s.generate(max_tokens=8))
        assert len(toks) == 8 and all(0 <= t < VOCAB for t in toks)
        r = s.last_result
        assert r.stop_reason == "max_tokens" and r.prefill_tokens == 15 and r.generated_tokens == 8
        info = s.info()
        assert info.history_length == 23 and info.pending_tokens == 1 and info.kv_live_bytes > 0
        assert info.eos_token_ids == () and invariant_violations(server.runtime) == NO_VIOLATIONS
        # next turn prefills only the delta: last generated token + appended tokens
        s.append(history(4, 2))
        s.generate_all(max_tokens=2)
        assert s.last_result.prefill_tokens == 5
        assert s.history() == history(10, 0) + history(5, 1) + toks + history(4, 2) + list(s.last_result.tokens)
        with pytest.raises(kakeya.InvalidArgumentError, match="start"):
            s.history(1000)
    with pytest.raises(kakeya.SessionNotFoundError):
        s.info()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=42)])
def test_inv3_one_append_vs_one_per_token(client, seed, sampling):
    """ADR 0008 G3: whole history in one AppendTokens vs. one call per token -> identical tokens."""
    h = history(60 + 17 * seed, seed)  # longer than the 4+32 window: eviction happens
    with client.create_session(ignore_eos=True) as one:
        one.append(h)
        a = list(one.generate(max_tokens=16, **sampling))
    with client.create_session(ignore_eos=True) as many:
        for t in h:
            many.append([t])
        b = list(many.generate(max_tokens=16, **sampling))
    assert a == b


def test_bad_tokens_are_invalid_argument_and_session_unchanged(client):
    with client.create_session([5, 6, 7]) as s:
        for bad in ([VOCAB], [-1], [1, 2, VOCAB + 10]):
            with pytest.raises(kakeya.InvalidArgumentError, match="vocabulary"):
                s.append(bad)
        with pytest.raises(kakeya.InvalidArgumentError, match="empty"):
            s.append([])
        assert s.info().history_length == 3
        assert len(list(s.generate(max_tokens=2))) >= 1


def test_unknown_session_is_not_found(client):
    for call in (lambda s: s.append([1]), lambda s: list(s.generate(max_tokens=1)), lambda s: s.info(), lambda s: s.close()):
        with pytest.raises(kakeya.SessionNotFoundError):
            call(client.session("no-such-session"))


def test_a_client_chosen_session_id(client):
    chosen = "agent-7_" + "x" * 24
    with client.create_session([5, 6], session_id=chosen, ignore_eos=True) as s:
        assert s.id == chosen and s.info().history_length == 2
        with pytest.raises(kakeya.AlreadyExistsError, match="already exists"):
            client.create_session(session_id=chosen)
        assert s.info().history_length == 2  # the live session is untouched
    with client.create_session(session_id=chosen) as again:  # a closed id may be chosen again
        assert again.info().history_length == 0
    for bad in ("short", "has space in it", "x" * 129, "sl/ash" * 3):
        with pytest.raises(kakeya.InvalidArgumentError, match="not a valid session id"):
            client.create_session(session_id=bad)
    # a raw-wire client that leaves the id empty gets a server-issued one; the same rule is checked there
    stub = client._stub
    from kakeya_wire.v1 import runtime_pb2 as pb
    issued = stub.CreateSession(pb.CreateSessionRequest()).session_id
    assert len(issued) == 32
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateSession(pb.CreateSessionRequest(session_id="../etc"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid session id" in e.value.details()
    stub.CloseSession(pb.CloseSessionRequest(session_id=issued))


def test_bad_generate_params(client):
    with client.create_session([5]) as s:
        with pytest.raises(kakeya.InvalidArgumentError, match="max_tokens"):
            list(s.generate(max_tokens=0))
        with pytest.raises(kakeya.InvalidArgumentError, match="top_p"):
            list(s.generate(max_tokens=2, temperature=1.0, top_p=2.0))
    with client.create_session() as empty:
        with pytest.raises(kakeya.FailedPreconditionError, match="empty"):
            list(empty.generate(max_tokens=2))


def test_the_server_refuses_an_infinite_temperature(client, server):
    """Decided once, in the server: a raw-wire client (no SDK check) gets INVALID_ARGUMENT too."""
    from kakeya_wire.v1 import runtime_pb2 as pb
    from kakeya_wire.v1 import runtime_pb2_grpc as pb_grpc

    with client.create_session([5, 6]) as s, grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.RuntimeServiceStub(ch)
        for t in (float("inf"), float("nan")):
            req = pb.GenerateRequest(session_id=s.id, max_tokens=2, sampling=pb.SamplingParams(temperature=t))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature must be a finite number" in e.value.details()
        assert s.history() == [5, 6]


def test_client_cancel_mid_stream_keeps_session_usable(client, server):
    with client.create_session(history(20, 3), ignore_eos=True) as s:
        gen = s.generate(max_tokens=10_000)
        got = [next(gen) for _ in range(3)]
        gen.close()  # cancels the RPC
        # the server notices, stops, and commits what it streamed; the session lives on
        for _ in range(100):
            if not server.runtime.store.get(s.id, touch=False).lock.locked():
                break
            threading.Event().wait(0.05)
        info = s.info()
        assert 20 + 3 <= info.history_length < 20 + 10_000
        committed = s.history(20)  # includes tokens streamed after the client stopped reading
        assert committed[:3] == got and len(committed) == info.history_length - 20
        assert len(list(s.generate(max_tokens=3))) == 3


def test_a_full_daemon_without_persistence_refuses_new_sessions(server):
    """capacity 4, sessions in memory only: the fifth CreateSession is RESOURCE_EXHAUSTED (no
    session in use is dropped for it); closing one admits the next."""
    c = kakeya.Client(f"127.0.0.1:{server.port}")
    live = len(server.runtime.store)
    sessions = [c.create_session([3]) for _ in range(4 - live)]
    with pytest.raises(kakeya.ResourceExhaustedError, match="session slots are taken"):
        c.create_session([3])
    for s in sessions:
        s.append([4])  # every admitted session is still there
    sessions[0].close()
    sessions[0] = c.create_session([3])
    for s in sessions:
        s.close()
    c.close()


def test_concurrent_sessions_do_not_interfere(client, server):
    h = history(50, 9)
    with client.create_session(h, ignore_eos=True) as ref:
        expected = list(ref.generate(max_tokens=12))
    results = [None] * 3

    def worker(i):
        with kakeya.Client(f"127.0.0.1:{server.port}") as c2, c2.create_session(h, ignore_eos=True) as s:
            results[i] = list(s.generate(max_tokens=12))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results == [expected] * 3


def test_health_and_reflection(server):
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kakeya.v1.RuntimeService"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert "kakeya.v1.RuntimeService" in names
    ch.close()


def test_api_key_required_when_configured():
    srv = start_server(make_engine("llama", "full"), api_key="s3cret")
    target = f"127.0.0.1:{srv.port}"
    try:
        for key in (None, "wrong"):
            with kakeya.Client(target, api_key=key) as c:
                with pytest.raises(kakeya.UnauthenticatedError):
                    c.create_session([1])
                with pytest.raises(kakeya.UnauthenticatedError):
                    list(c.session("x").generate(max_tokens=1))
        with kakeya.Client(target, api_key="s3cret") as c, c.create_session([5, 6]) as s:
            assert len(list(s.generate(max_tokens=2))) >= 1
    finally:
        srv.stop()


def test_metrics_endpoint_exposes_session_metrics():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    srv = start_server(make_engine("llama", "sink_window", 4, 8), metrics_port=port)
    try:
        with kakeya.Client(f"127.0.0.1:{srv.port}") as c, c.create_session(history(40, 4), ignore_eos=True) as s:
            list(s.generate(max_tokens=4))
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        for name in (
            "session_active", 'session_total{outcome="closed"}', "session_kv_live_bytes", "session_history_tokens_bucket",
            "session_kv_resident_bytes", "session_kv_selection_bytes", "session_kv_stored_bytes", "session_kv_cold_bytes 0.0",
            "generate_prefill_tokens_bucket", "generate_prefill_duration_seconds_bucket", 'cache_invariant_violations_total{kind="inv1"}',
            'session_evicted_total{reason="lru"}', "generate_tokens_total 4.0", "generate_time_to_first_token_seconds_bucket",
            "generate_decode_tokens_per_second_bucket", "history_truncated_tokens_total", "engine_forward_seconds",
            "engine_prefill_tokens_run 40.0", "engine_row_tokens_run 3.0",  # 40 prompt tokens; 4 tokens = 3 decode rows
        ):
            assert name in text, name
    finally:
        srv.stop()


def test_non_loopback_bind_without_key_is_refused():
    from inference_engine.server.app import ConfigError, ServeConfig, check_exposure

    with pytest.raises(ConfigError, match="API key"):
        check_exposure(ServeConfig(bind="0.0.0.0:50051"))
    check_exposure(ServeConfig(bind="0.0.0.0:50051", api_key="k"))
    check_exposure(ServeConfig(bind="127.0.0.1:50051"))
    check_exposure(ServeConfig(bind="[::1]:50051"))


def test_sink_window_kv_bytes_do_not_depend_on_history_length():
    """Default 4 + 1020 window: a 1k-token and a 6k-token session hold the same KV bytes."""
    srv = start_server(make_engine("llama", "sink_window", 4, 1020, max_position_embeddings=8192))
    try:
        with kakeya.Client(f"127.0.0.1:{srv.port}") as c:
            sizes = {}
            for n in (1000, 6000):
                with c.create_session(history(n, n), ignore_eos=True) as s:
                    list(s.generate(max_tokens=2))
                    info = s.info()
                    sizes[n] = info.kv_live_bytes
                    assert info.resident_positions == min(n + 1, 4 + 1020 - 1)
            assert sizes[1000] == sizes[6000] > 0
    finally:
        srv.stop()


KV_GAUGES = ("session_kv_resident_bytes", "session_kv_selection_bytes", "session_kv_stored_bytes", "session_kv_cold_bytes")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kv_gauges(port: int) -> tuple:
    """The four KV tier gauges of /metrics (resident, selection, stored, cold), in that order."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    got = {name: float(line.split()[1]) for line in text.splitlines() for name in KV_GAUGES if line.startswith(name + " ")}
    return tuple(got[name] for name in KV_GAUGES)


def tiers_of(info) -> tuple:
    return (info.kv_resident_bytes, info.kv_selection_bytes, info.kv_stored_bytes, info.kv_cold_bytes)


def test_paged_kv_tiers_resident_flat_selection_and_stored_grow():
    """paged 4 + 32, pages of 8: the hot set (resident) does not grow with the history; the compact keys
    (selection) and the page store (stored) grow with the archived positions, through the RPC and /metrics;
    under its RAM budget (page_ram_mb's default, 128 MB) nothing is on disk (cold 0)."""
    from factories import load_model, tiny_model_dir
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    port = free_port()
    model = load_model(str(tiny_model_dir("llama")))
    # shortlist_pages 0: selection is the compact keys alone (with a shortlist it also holds the page bounds,
    # made 64 pages at a time; tests/kv/test_paged.py counts those)
    srv = start_server(Engine(model, KVStrategy("paged", 4, 32, page_size=8, recall_pages=2, shortlist_pages=0), prefill_chunk=16),
                       metrics_port=port)
    try:
        with kakeya.Client(f"127.0.0.1:{srv.port}") as c:
            tiers = {}
            for n in (100, 300):
                with c.create_session(history(n, n), ignore_eos=True) as s:
                    list(s.generate(max_tokens=2))
                    i = s.info()
                    tiers[n] = tiers_of(i)
                    assert i.kv_live_bytes == i.kv_resident_bytes + i.kv_selection_bytes
                    assert i.dropped_tokens == 0  # archived, not dropped
                    assert i.kv_cold_bytes == 0  # a few KB of pages: all in RAM
                    if n == 300:  # one session open: the gauges are its tiers
                        assert kv_gauges(port) == tiers[n]
        (r1, sel1, st1, _), (r3, sel3, st3, _) = tiers[100], tiers[300]
        assert r1 == r3 > 0
        # every position out of the window is archived: (history + 1 - sink - window) rows, in whole pages
        assert 0 < sel1 < sel3 and 0 < st1 < st3
        assert sel3 / sel1 == pytest.approx(st3 / st1, rel=0.1) and st3 / st1 > 2.5
        assert st3 > sel3  # exact K and V vs 4-bit keys
    finally:
        srv.stop()


def test_paged_page_store_past_its_ram_budget_goes_cold():
    """page_ram_mb=1: a session whose page store outgrows 1 MB keeps at most 1 MB of it in RAM (stored, warm)
    and the rest on disk (cold), through the RPC and /metrics; together they hold every archived position,
    and it attends to them as a session with no disk tier (page_ram_mb=0) does."""
    from factories import load_model, tiny_model_dir
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    # 8 layers x 2 KV heads x 16 dims x K and V x fp32: 2 KB of exact K/V a position, so 1400 positions
    # archive ~2.7 MB
    model = load_model(str(tiny_model_dir("llama", num_hidden_layers=8)))
    h = history(1400, 7)
    tiers = {}
    for ram_mb in (1, 0):
        port = free_port()
        strategy = KVStrategy("paged", 4, 32, page_size=8, recall_pages=2, shortlist_pages=0, page_ram_mb=ram_mb)
        srv = start_server(Engine(model, strategy, prefill_chunk=256), metrics_port=port)
        try:
            with kakeya.Client(f"127.0.0.1:{srv.port}") as c, c.create_session(h, ignore_eos=True) as s:
                toks = list(s.generate(max_tokens=2))
                i = s.info()
                tiers[ram_mb] = tiers_of(i)
                archived = i.history_length - i.pending_tokens - 4 - 32  # positions out of sink + window
                assert i.dropped_tokens == 0 and i.kv_live_bytes == i.kv_resident_bytes + i.kv_selection_bytes
                assert kv_gauges(port) == tiers[ram_mb]  # one session open: the gauges are its tiers
                tiers[ram_mb, "tokens"] = toks
        finally:
            srv.stop()
    (r1, sel1, warm1, cold1), (r0, sel0, warm0, cold0) = tiers[1], tiers[0]
    exact = archived * 8 * 2 * 16 * 2 * 4  # the archived positions' K/V bytes
    assert cold0 == 0 and warm0 >= exact > 2 * 2**20  # no disk tier: the whole page store in RAM
    assert 0 < warm1 <= 2**20 and cold1 > 2**20  # 1 MB in RAM, the rest on disk
    assert warm1 + cold1 >= exact and (r1, sel1) == (r0, sel0)  # every archived position kept, in RAM or on disk
    assert tiers[1, "tokens"] == tiers[0, "tokens"]  # pages read back from disk attend as the ones in RAM


def test_non_paged_strategies_report_everything_resident(client):
    with client.create_session(history(80, 5), ignore_eos=True) as s:
        list(s.generate(max_tokens=2))
        i = s.info()
        assert tiers_of(i) == (i.kv_live_bytes, 0, 0, 0)
        assert i.kv_live_bytes > 0


def test_server_info_reports_persistence_off(client):
    # this server's runtime has no persister (tests/persistence/test_server_restart.py: mode "turn")
    p = client.server_info().persistence
    assert (p.mode, p.state_dir) == ("off", "")


def test_speculative_server_reports_drafted_and_accepted():
    from drafters import SelfDrafter
    from factories import load_model, tiny_model_dir
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    model = load_model(str(tiny_model_dir("llama")))
    # full attention: the cache-free self drafter sees what the verifier sees, so its drafts are accepted
    # (over a 4+16 window it sees more than the verifier, misses, and the engine's DraftGate pauses drafting)
    spec = start_server(Engine(model, KVStrategy("full"), drafter=SelfDrafter(model), spec_k=3, drafter_name="self-test"))
    plain = start_server(Engine(model, KVStrategy("full")))
    try:
        h = history(40, 11)
        outs, results = [], []
        for srv in (spec, plain):
            with kakeya.Client(f"127.0.0.1:{srv.port}") as c, c.create_session(h, ignore_eos=True) as s:
                outs.append(list(s.generate(max_tokens=20)))
                results.append(s.last_result)
        with kakeya.Client(f"127.0.0.1:{spec.port}") as c:
            info = c.server_info()
            assert (info.drafter, info.spec_k) == ("self-test", 3)
        assert outs[0] == outs[1]
        m = spec.runtime.metrics
        assert m.spec_drafted_tokens_total._value.get() > 0 and m.spec_accepted_tokens_total._value.get() > 0
        assert results[0].drafted_tokens > 0 and 0 < results[0].accepted_tokens <= results[0].drafted_tokens
        assert results[1].drafted_tokens == results[1].accepted_tokens == 0
    finally:
        spec.stop()
        plain.stop()


def test_a_turn_that_re_encodes_a_paged_session_says_so(caplog):
    """A `paged` session (far_from 40 once past a trained context of 64) whose turn passes the context re-encodes its
    53 positions (fp32 weights: all of them, Engine._chunk_invariant): Done's reencoded_tokens (SDK:
    GenerationResult.reencoded_tokens) says how many, apart from the turn's prefill_tokens; the turns before and after
    it say 0; the daemon's log says it once."""
    import logging

    caplog.set_level(logging.INFO, logger="inference_engine.server.runtime")
    from factories import load_model, tiny_model_dir
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    model = load_model(str(tiny_model_dir("llama", max_position_embeddings=64)))
    st = KVStrategy("paged", 4, 12, page_size=8, recall_pages=2, far_from=40, far_after="context")
    srv = start_server(Engine(model, st, prefill_chunk=16))
    try:
        with kakeya.Client(f"127.0.0.1:{srv.port}") as c, c.create_session(history(50, 12), ignore_eos=True) as s:
            list(s.generate(max_tokens=4))  # positions up to 53: past far_from, under the context
            assert s.last_result.reencoded_tokens == 0
            s.append(history(20, 13))
            list(s.generate(max_tokens=4))
            r = s.last_result
            assert (r.reencoded_tokens, r.prefill_tokens) == (53, 21)
            list(s.generate(max_tokens=2))
            assert s.last_result.reencoded_tokens == 0
        assert srv.runtime.metrics.registry.get_sample_value("reencoded_tokens_total") == 53
        said = [r.getMessage() for r in caplog.records if "passed the model's trained context" in r.getMessage()]
        assert len(said) == 1 and f"session {s.id} " in said[0] and "53 earlier positions encoded again" in said[0]
    finally:
        srv.stop()
