"""Factories shared by the test modules (plain functions, no fixture chains)."""
from __future__ import annotations

import functools
import os
import pathlib
import tempfile

from inference_engine.model_store.tiny import make_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
_TINY_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="kakeya-tiny-"))


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str = "llama", seed: int = 0, **config_kwargs) -> pathlib.Path:
    suffix = "-".join(f"{k}{v}" for k, v in sorted(config_kwargs.items()))
    return make_tiny_model(arch, _TINY_ROOT / f"{arch}-{seed}{suffix}", seed=seed, **config_kwargs)


@functools.lru_cache(maxsize=None)
def load_model(path: str, backend: str = "torch"):
    if backend == "mlx":
        from inference_engine.backends.mlx.model import MlxCausalLM

        return MlxCausalLM.load(path)
    from inference_engine.backends.torch.model import TorchCausalLM

    return TorchCausalLM.load(path)


BACKENDS = ("torch", "mlx")


def require_native():
    """The native CPU row step's module; a test needing it fails where a C++ compiler could not build it and skips
    where there is none (the daemon then runs every step in Python)."""
    import shutil

    import pytest

    from inference_engine.backends.torch import native

    mod = native.load()
    if mod is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(f"the native row step did not build here: {native.unavailable_reason()}")
        pytest.skip("no C++ compiler: the daemon runs every step in Python here")
    return mod


def require_backend(backend: str) -> None:
    """Skip a test of `backend` that cannot run here (MLX not installed), except under CI, where
    `make test` installs MLX and a missing one is a failure."""
    if backend != "mlx":
        return
    import pytest

    from inference_engine.backends.mlx import MlxUnavailable, require_mlx

    try:
        require_mlx()
    except MlxUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and MLX is missing: {e}")
        pytest.skip(str(e))


def make_engine(arch: str = "llama", strategy: str = "full", sink: int = 4, window: int = 1020, *, prefill_chunk: int = 256,
                model_path: str | None = None, backend: str = "torch", **config_kwargs):
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    require_backend(backend)
    path = model_path or str(tiny_model_dir(arch, **config_kwargs))
    return Engine(load_model(path, backend), KVStrategy(strategy, sink, window), prefill_chunk=prefill_chunk)


def start_server(engine, *, api_key: str | None = None, capacity: int = 8, idle_ttl: float = 1800.0, metrics_port: int = 0,
                 http_port: int = 0):
    """A real server on a free loopback port around `engine` (its model dir is cfg.model)."""
    from inference_engine.server.app import ServeConfig, start
    from inference_engine.server.runtime import Runtime

    model_dir = str(getattr(engine.model, "path", None) or "")
    cfg = ServeConfig(bind="127.0.0.1:0", model=model_dir, capacity=capacity, idle_ttl=idle_ttl, api_key=api_key,
                      metrics_port=metrics_port, http_port=http_port)
    return start(cfg, Runtime(engine, capacity=capacity, idle_ttl_s=idle_ttl))


def invariant_violations(runtime) -> dict:
    """The daemon's cache invariant violations by kind, as /metrics reports them. A violating session
    is failed and removed at once, so this counter (not a live session's info) is where one shows."""
    registry = runtime.metrics.registry
    return {kind: registry.get_sample_value("cache_invariant_violations_total", {"kind": kind}) for kind in ("inv1", "inv2")}


NO_VIOLATIONS = {"inv1": 0.0, "inv2": 0.0}


def smollm2_dir() -> pathlib.Path | None:
    home = pathlib.Path(os.environ.get("KAKEYA_HOME", pathlib.Path.home() / ".cache" / "kakeya"))
    p = home / "models" / "smollm2-135m-instruct"
    return p if (p / "config.json").exists() else None


def require_smollm2() -> pathlib.Path:
    """The pulled default model's directory, for the real-model (`@pytest.mark.model`) tests.

    Missing, the test is skipped on a developer machine but fails when `CI` is set: `make test`
    pulls the model first, so a CI run without it would otherwise pass without testing anything."""
    import pytest

    path = smollm2_dir()
    if path is None:
        msg = "smollm2-135m-instruct is not pulled: run `kakeya models pull smollm2-135m-instruct` (or `make model`)"
        if os.environ.get("CI"):
            pytest.fail(f"{msg}; CI is set, so a missing model is a failure, not a skip")
        pytest.skip(msg)
    return path


class SlowModel:
    """A model with a pause per forward, so concurrent sessions' steps overlap in the engine loop."""

    def __init__(self, model, pause=0.02):
        self._m, self._pause = model, pause

    def embed_ids(self, ids):
        import time

        time.sleep(self._pause)
        return self._m.embed_ids(ids)

    def __getattr__(self, name):
        return getattr(self._m, name)


def feed(m, cache, tokens, chunk, row_exact=False):
    """Run tokens through the model in committed chunks; (T, V) host logits of every position (any backend)."""
    import torch

    from inference_engine.engine.steps import forward

    out = []
    for i in range(0, len(tokens), chunk):
        part = list(tokens[i : i + chunk])
        logits, _ = forward(m, m.tensor(part), range(cache.next_position, cache.next_position + len(part)), cache,
                            row_exact=row_exact)
        cache.commit()
        out.append(m.to_host(logits))
    return torch.cat(out)


def run_script(relpath: str, *args, timeout: float = 600):
    """A script under the repository root (e.g. "scripts/research/verify_cost.py") run with this interpreter from the
    root, its arguments str()-ed: the CompletedProcess, output captured as text."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(ROOT / relpath), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def load_script(relpath: str):
    """A script under the repository root (e.g. "scripts/bench_speculative.py") imported as a module, so tests call
    its functions and main() in-process."""
    import importlib.util

    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main_in_process(relpath: str, args, monkeypatch):
    """A script's main(argv) run in this process (no second interpreter to start): sys.argv set to the command its
    JSON records, torch's thread count put back after (scripts set their own)."""
    import sys

    import torch

    mod = load_script(relpath)
    argv = [str(a) for a in args]
    monkeypatch.setattr(sys, "argv", [relpath, *argv])
    threads = torch.get_num_threads()
    try:
        return mod.main(argv)
    finally:
        torch.set_num_threads(threads)
