"""The daemon's token limits end to end (issue 30, item 4): --max-append-tokens answers INVALID_ARGUMENT
and --max-pending-tokens RESOURCE_EXHAUSTED, each naming its flag; GetServerInfo reports both; the
defaults are on."""
import pytest

import kakeya
from factories import tiny_model_dir
from inference_engine.server.app import ServeConfig, start
from inference_engine.server.cli import build_parser, serve_config


@pytest.fixture(scope="module")
def daemon():
    cfg = ServeConfig(bind="127.0.0.1:0", model=str(tiny_model_dir("llama")), weights="fp32", kv_strategy="sink_window",
                      sink=4, window=32, prefill_chunk=16, threads=1, persist="off", max_append_tokens=64,
                      max_pending_tokens=96)
    running = start(cfg)
    yield f"127.0.0.1:{running.port}"
    running.stop()


def test_limits_are_enforced_and_named(daemon):
    with kakeya.Client(daemon) as c:
        info = c.server_info()
        assert (info.max_append_tokens, info.max_pending_tokens) == (64, 96)
        with c.create_session(ignore_eos=True) as s:
            with pytest.raises(kakeya.InvalidArgumentError, match=r"1000000 tokens.*--max-append-tokens 64"):
                s.append([5] * 1_000_000)
            with pytest.raises(kakeya.InvalidArgumentError, match="--max-append-tokens 64"):
                c.create_session([5] * 65)
            assert s.append([5] * 64) == 64 and s.append([6] * 32) == 96
            with pytest.raises(kakeya.ResourceExhaustedError, match=r"--max-pending-tokens 96.*Run Generate"):
                s.append([7])
            assert len(s.generate_all(2).tokens) == 2  # prefills what was pending
            assert s.append([7] * 64) == 162


def test_the_defaults_protect_an_interactive_daemon():
    cfg = serve_config(build_parser().parse_args(["serve"]))
    assert (cfg.max_append_tokens, cfg.max_pending_tokens) == (16384, 32768)
    cfg = serve_config(build_parser().parse_args(["serve", "--max-append-tokens", "0", "--max-pending-tokens", "100"]))
    assert (cfg.max_append_tokens, cfg.max_pending_tokens) == (0, 100)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-pending-tokens", "-1"])
