"""Refusals at start: a port another daemon serves, a state directory in use and side ports taken are
refused with a message naming them, before any model loads (issue 30, items 1 and 5)."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

import kakeya
from factories import make_engine, start_server, tiny_model_dir
from inference_engine.persistence.state_dir import StateDir
from inference_engine.server.app import ConfigError, ServeConfig, start
from inference_engine.server.runtime import Runtime

ROOT = pathlib.Path(__file__).resolve().parents[2]
MISSING_MODEL = "/nonexistent/kakeya-model"  # a load would fail on it: a refusal naming something else came first


def _serve(*argv, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "inference_engine.server.cli", "serve", "--threads", "1", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def first():
    """The daemon already serving a port."""
    srv = start_server(make_engine("llama", "sink_window", 4, 32, prefill_chunk=16))
    yield srv
    srv.stop()


def test_a_second_server_on_a_port_in_use_is_refused(first):
    engine = first.runtime.engine
    cfg = ServeConfig(bind=f"127.0.0.1:{first.port}", model=str(tiny_model_dir("llama")), persist="off")
    with pytest.raises(ConfigError, match=rf"--bind 127.0.0.1:{first.port}: the address is already in use"):
        second = start(cfg, Runtime(engine))
        second.stop()  # (today's bug: it served too)
    with kakeya.Client(f"127.0.0.1:{first.port}") as c, c.create_session([5, 6, 7]) as s:
        for _ in range(20):  # every new connection reaches the one daemon that holds the session
            with kakeya.Client(f"127.0.0.1:{first.port}") as other:
                assert other.session(s.id).info().history_length == 3


def test_kakeya_serve_on_a_port_in_use_exits_before_loading_the_model(first):
    r = _serve("--bind", f"127.0.0.1:{first.port}", "--model", MISSING_MODEL, "--persist", "off")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--bind 127.0.0.1:{first.port}: the address is already in use" in r.stderr
    assert "READY" not in r.stdout


def test_a_state_dir_in_use_is_refused_before_loading_the_model(tmp_path):
    held = StateDir(tmp_path).create().lock()  # another daemon's lock
    try:
        r = _serve("--bind", "127.0.0.1:0", "--model", MISSING_MODEL, "--state-dir", str(tmp_path))
    finally:
        held.close()
    assert r.returncode == 2, r.stderr[-2000:]
    assert "another kakeya daemon is using the state directory" in r.stderr and MISSING_MODEL not in r.stderr


def test_a_side_port_in_use_is_refused_before_loading_the_model(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--metrics-port", "--http-port"):
            r = _serve("--bind", "127.0.0.1:0", "--model", MISSING_MODEL, "--persist", "off", flag, str(port))
            assert r.returncode == 2 and f"{flag} {port}: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]


def test_a_spill_dir_that_cannot_be_made_is_refused_before_loading_the_model(tmp_path):
    (tmp_path / "a-file").write_text("")
    r = _serve("--bind", "127.0.0.1:0", "--model", MISSING_MODEL, "--persist", "off", "--kv-strategy", "paged",
               "--page-spill-dir", str(tmp_path / "a-file" / "spill"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--page-spill-dir {tmp_path / 'a-file' / 'spill'}:" in r.stderr and MISSING_MODEL not in r.stderr


def test_flags_that_need_no_model_are_checked_before_loading(tmp_path):
    cfg = ServeConfig(bind="127.0.0.1:0", model=MISSING_MODEL, persist="sometimes", state_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--persist must be 'off' or 'turn'"):
        start(cfg)
    cfg = ServeConfig(bind="127.0.0.1:0", model=MISSING_MODEL, backend="mlx", kv_strategy="dlm_restore", persist="off")
    with pytest.raises(ConfigError, match="runs on --backend torch only"):
        start(cfg)


@pytest.mark.parametrize("kw, message", [
    (dict(compile="sometimes"), "--compile must be"),
    (dict(capacity=0), "--capacity takes"),
    (dict(threads=0), "--threads takes"),
    (dict(idle_ttl=-1), "--idle-ttl takes"),
    (dict(drafter="ngram", spec_k=300), r"spec_k must be in \[0, 255\]"),
    (dict(prefill_chunk_shared=-1), "prefill_chunk_shared must be >= 0"),
    (dict(batching="sometimes"), "batching must be auto, on or off"),
    (dict(kv_strategy="paged", page_size=0), "page_size must be an int >= 1"),
    (dict(kv_strategy="paged", page_ram_mb=-1), "--page-ram-mb takes a number of MB >= 0"),
    (dict(malloc_mmap_threshold_kb=-1), "--malloc-mmap-threshold-kb takes a number of KiB >= 0"),
    (dict(bind="nowhere"), "--bind must be HOST:PORT"),
    (dict(activations="fp8"), "--activations must be 'int16' or 'int8'"),
    (dict(backend="mlx", activations="int8"), "--activations int8 sets the torch backend's CPU int4 kernel"),
    (dict(kv_dtype="fp16", device="cuda"), "--kv-dtype fp16 is a CPU K/V store"),
    (dict(kv_dtype="fp16", kv_strategy="dlm_restore"), "kv dtype fp16 is a resident store for the full, sink_window and"),
    (dict(kv_dtype="fp16", kv_strategy="paged", page_compressor="int8"), "kv dtype fp16 on paged: paged takes fp16 with"),
    (dict(kv_dtype="int8", kv_strategy="paged"), "kv dtype int8 on paged"),
    (dict(kv_dtype="fp16", backend="mlx"), "--kv-dtype fp16 runs on --backend torch only"),
    (dict(loader="hf"), "--loader must be 'auto' or 'transformers'"),
    (dict(backend="mlx", loader="transformers"), "--loader transformers sets how the torch backend reads the weights"),
])
def test_serve_config_validate_names_the_option(kw, message):
    """ServeConfig.validate: every model-free rule in one place, the engine's and the strategy's included."""
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**kw).validate()


def test_the_defaults_validate():
    ServeConfig().validate()
    ServeConfig(kv_strategy="paged", drafter="ngram", threads="auto", idle_ttl=0).validate()  # 0 = never expire


def test_sigusr1_dumps_every_threads_stack_and_sigterm_still_stops_it(tmp_path):
    """`kill -USR1` makes a running daemon write its threads' stacks to stderr (how a hung daemon says where it is);
    it keeps serving, and SIGTERM then stops it cleanly."""
    import signal
    import threading
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), HF_HUB_OFFLINE="1")
    log = tmp_path / "daemon.log"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "inference_engine.server.cli", "serve", "--threads", "1", "--model",
                              str(tiny_model_dir("llama")), "--bind", "127.0.0.1:0", "--weights", "fp32", "--persist", "off"],
                             stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    try:
        line = p.stdout.readline()
        assert line.startswith("READY"), line
        p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while "serve_forever" not in log.read_text():  # the main thread's stack, waiting for a signal
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            threading.Event().wait(0.05)
        assert "most recent call first" in log.read_text() and "model_thread.py" in log.read_text()
        with kakeya.Client(f"127.0.0.1:{line.split()[1]}") as c:  # still serving
            assert c.create_session([5, 6, 7]).history() == [5, 6, 7]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=180) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_activations_set_the_native_int4_kernels_planes_and_fail_loudly_where_it_does_not_run():
    """--activations int16 (the default: two int8 planes, the >= 99 % agreement gate) or int8 (one plane with outlier
    channels) reaches the native row step's int4 kernel; asked of a daemon that does not run that kernel, it is a
    ConfigError naming the option, not a silent no-op."""
    from factories import require_native

    from inference_engine.backends.torch import native
    from inference_engine.server.app import _load_model

    mod = require_native()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    tiny = str(tiny_model_dir("llama"))
    default = _load_model(ServeConfig(model=tiny, weights="int4"))
    assert native.PLANES == 2 and default.native_step.planes == 2 and default.describe_step()["row_step"].endswith(
        "(activation planes 2)")
    int8 = _load_model(ServeConfig(model=tiny, weights="int4", activations="int8"))
    assert int8.native_step.planes == 1 and int8.native_step.outliers > 0
    with pytest.raises(ConfigError, match="--activations int8 sets the native CPU step's int4 kernel"):
        _load_model(ServeConfig(model=tiny, weights="fp32", activations="int8"))


def test_kv_dtype_auto_is_fp16_where_the_native_steps_attention_reads_it_in_registers_and_fp32_elsewhere():
    """--kv-dtype auto (the default) resolves once the model is loaded: fp16 for full / sink_window where the native
    CPU row step's attention converts fp16 in its registers (its AVX2 code, an AVX-512 build's 16-lane code: where
    fp16 slabs were measured faster with the same agreement), and for paged with exact pages (identity: its page store
    in fp16 too); fp32 for paged with coded pages, without the native step (fp32 weights, --compile off) or with an
    attention that converts a copy of each chunk (the 16-lane code of a build without AVX-512); a value given is kept;
    the engine's strategy carries what it resolved to."""
    from factories import require_native

    from inference_engine.server.app import _load_model, build_engine, resolve_kv_dtype

    mod = require_native()
    tiny = str(tiny_model_dir("llama"))
    assert ServeConfig().kv_dtype == "auto"
    int4 = _load_model(ServeConfig(model=tiny, weights="int4"))
    avx2 = mod.fp16_in_registers()  # the AVX2 attention, or an AVX-512 build's 16-lane one: fp16 in registers
    assert resolve_kv_dtype(ServeConfig(), int4) == ("fp16" if avx2 else "fp32")
    assert resolve_kv_dtype(ServeConfig(kv_strategy="sink_window"), int4) == ("fp16" if avx2 else "fp32")
    assert build_engine(ServeConfig(model=tiny, weights="int4"), int4).strategy.kv_dtype == ("fp16" if avx2 else "fp32")
    assert resolve_kv_dtype(ServeConfig(kv_strategy="paged"), int4) == ("fp16" if avx2 else "fp32")
    assert build_engine(ServeConfig(model=tiny, weights="int4", kv_strategy="paged"), int4).strategy.kv_dtype == (
        "fp16" if avx2 else "fp32")
    assert resolve_kv_dtype(ServeConfig(kv_strategy="paged", page_compressor="int8"), int4) == "fp32"
    assert resolve_kv_dtype(ServeConfig(kv_compressor="kakeya_e8"), int4) == "fp32"
    assert resolve_kv_dtype(ServeConfig(kv_dtype="fp32"), int4) == "fp32"
    assert resolve_kv_dtype(ServeConfig(kv_dtype="int8"), int4) == "int8"
    if mod.row_attention(-1) == 1:
        was = mod.row_attention(0)  # the 16-lane attention of a build without AVX-512: a converted copy per chunk
        try:
            assert not mod.fp16_in_registers() and resolve_kv_dtype(ServeConfig(), int4) == "fp32"
        finally:
            mod.row_attention(was)
    else:  # an AVX-512 build: its 16-lane attention converts fp16 in its registers, and so does the AVX2 code
        was = mod.row_attention(1)
        try:
            assert mod.fp16_in_registers() and resolve_kv_dtype(ServeConfig(), int4) == "fp16"
        finally:
            mod.row_attention(was)
    assert resolve_kv_dtype(ServeConfig(), _load_model(ServeConfig(model=tiny, weights="fp32"))) == "fp32"
    assert resolve_kv_dtype(ServeConfig(compile="off"), _load_model(ServeConfig(model=tiny, weights="int4",
                                                                                  compile="off"))) == "fp32"
