"""`kakeya serve --backend mlx` end to end: the CLI's config -> app.load_model -> MLX engine -> gRPC ->
Python SDK, token-identical to the torch backend's daemon; clear errors for what MLX does not run."""
from __future__ import annotations

import pytest
import torch

import kakeya
from factories import NO_VIOLATIONS, invariant_violations, require_backend, tiny_model_dir
from inference_engine.server.app import ConfigError, build_runtime, load_model, start
from inference_engine.server.cli import build_parser, serve_config


def serve_args(*extra: str):
    return serve_config(build_parser().parse_args(["serve", "--bind", "127.0.0.1:0", *extra]))


def history(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_backend_mlx_over_grpc_equals_torch(tmp_path):
    require_backend("mlx")
    model = str(tiny_model_dir("qwen3"))
    out = {}
    for backend in ("torch", "mlx"):
        cfg = serve_args("--model", model, "--backend", backend, "--weights", "fp32", "--kv-strategy", "sink_window",
                         "--sink", "4", "--window", "16", "--prefill-chunk", "8", "--state-dir", str(tmp_path / backend))
        running = start(cfg)
        try:
            with kakeya.Client(f"127.0.0.1:{running.port}") as c:
                info = c.server_info()
                assert info.backend == backend
                with c.create_session(history(30, 0), ignore_eos=True) as s:
                    toks = list(s.generate(max_tokens=12))
                    s.append(history(5, 1))
                    toks += list(s.generate(max_tokens=12, temperature=0.8, top_p=0.9, seed=5))
                assert invariant_violations(running.runtime) == NO_VIOLATIONS
                out[backend] = toks
        finally:
            running.stop()
    assert len(out["mlx"]) == 24 and out["mlx"] == out["torch"]


def test_missing_mlx_is_a_clear_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("mlx", "mlx_lm") else real(name, *a))
    with pytest.raises(ConfigError, match=r"--backend mlx needs the mlx package.*pip install.*--backend torch"):
        load_model(serve_args("--model", str(tiny_model_dir("llama")), "--backend", "mlx"))


@pytest.mark.parametrize("extra, match", [
    (("--kv-strategy", "dlm_restore"), "dlm_restore runs on --backend torch only"),
    (("--kv-compressor", "kakeya_d4"), "kakeya_d4 runs on --backend torch only"),
    (("--weights", "int8"), "fp32, fp16, int4"),
])
def test_what_mlx_does_not_run_is_refused_by_name(extra, match):
    require_backend("mlx")
    with pytest.raises(ConfigError, match=match):
        build_runtime(serve_args("--model", str(tiny_model_dir("llama")), "--backend", "mlx", "--persist", "off", *extra))


def test_mlx_session_resumes_after_a_restart_as_torch_does(tmp_path):
    """--persist turn on MLX: the session's K/V rows are saved per turn (MlxSlabStore.read_rows) and a
    restarted daemon resumes it; the tokens equal the torch daemon's through the same restart."""
    require_backend("mlx")
    model = str(tiny_model_dir("llama"))
    out = {}
    for backend in ("torch", "mlx"):
        args = ("--model", model, "--backend", backend, "--weights", "fp32", "--kv-strategy", "sink_window", "--sink", "4",
                "--window", "16", "--prefill-chunk", "8", "--state-dir", str(tmp_path / backend), "--persist", "turn")
        running = start(serve_args(*args))
        try:
            with kakeya.Client(f"127.0.0.1:{running.port}") as c:
                s = c.create_session(history(30, 2), ignore_eos=True)
                toks = list(s.generate(max_tokens=10))
        finally:
            running.stop()
            # RunningServer.stop() keeps the state-dir lock (a daemon's goes with its process); release it
            # so this process can play the restarted daemon
            running.runtime.persister._lock_file.close()
        running = start(serve_args(*args))
        try:
            with kakeya.Client(f"127.0.0.1:{running.port}") as c:
                s = c.session(s.id)
                s.append(history(5, 3))
                toks += list(s.generate(max_tokens=10))
                assert s.last_result.prefill_tokens == 6  # resumed: only the delta ran
        finally:
            running.stop()
        out[backend] = toks
    assert len(out["mlx"]) == 20 and out["mlx"] == out["torch"]
