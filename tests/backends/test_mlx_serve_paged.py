"""`kakeya serve --backend mlx --kv-strategy paged`: the daemon offers the paged strategy on MLX
(the engine-level paged recall runs on MLX: kv/paged.py, tests/backends/test_backend_parity.py)
and its tokens over gRPC equal the torch daemon's, recall included; stored page compressors
other than identity stay torch-only, refused by name."""
from __future__ import annotations

import pytest
import torch

import kakeya
from factories import NO_VIOLATIONS, invariant_violations, require_backend, tiny_model_dir
from inference_engine.server.app import ConfigError, build_runtime, start
from inference_engine.server.cli import build_parser, serve_config


def serve_args(*extra: str):
    return serve_config(build_parser().parse_args(["serve", "--bind", "127.0.0.1:0", *extra]))


def history(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_paged_daemon_on_mlx_equals_torch(tmp_path):
    require_backend("mlx")
    model = str(tiny_model_dir("llama"))
    out = {}
    for backend in ("torch", "mlx"):
        cfg = serve_args("--model", model, "--backend", backend, "--weights", "fp32", "--kv-strategy", "paged", "--sink", "4",
                         "--window", "16", "--page-size", "8", "--recall-pages", "2", "--prefill-chunk", "8",
                         "--persist", "off")
        running = start(cfg)
        try:
            with kakeya.Client(f"127.0.0.1:{running.port}") as c:
                with c.create_session(history(60, 4), ignore_eos=True) as s:  # 40 positions paged out
                    toks = list(s.generate(max_tokens=12))
                    info = s.info()
                    assert info.kv_stored_bytes > 0
                assert invariant_violations(running.runtime) == NO_VIOLATIONS
                out[backend] = toks
        finally:
            running.stop()
    assert len(out["mlx"]) == 12 and out["mlx"] == out["torch"]


def test_paged_on_mlx_refuses_other_page_compressors_by_name():
    require_backend("mlx")
    with pytest.raises(ConfigError, match="--page-compressor int8 runs on --backend torch only"):
        build_runtime(serve_args("--model", str(tiny_model_dir("llama")), "--backend", "mlx", "--kv-strategy", "paged",
                                 "--page-compressor", "int8", "--persist", "off"))
