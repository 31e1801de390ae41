"""The Python SDK is its own distribution: a fresh venv with only kakeya-wire and kakeya installed
(from wire/python and sdks/python) has no torch and no transformers, and talks to a live daemon.

The venv is made without pip (`--without-pip`) and filled by this interpreter's pip through
`pip --python`, which skips bootstrapping pip into it; grpcio/protobuf come from the package
index (pip's cache makes that quick). The packages are copied out of the tree first, so the
build writes nothing into the repository and the venv cannot see its sources.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from factories import make_engine, start_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "v1")

CLIENT = textwrap.dedent("""
    import json, sys
    import kakeya, kakeya_wire
    with kakeya.Client(sys.argv[1]) as client:
        info = client.server_info()
        with client.create_session([5, 6, 7], ignore_eos=True) as s:
            s.append([8, 9])
            tokens = list(s.generate(max_tokens=5))
            history = s.history()
            pending = s.info().pending_tokens
    print(json.dumps({"sdk": kakeya.__file__, "wire": kakeya_wire.__file__, "kv": [info.kv_strategy, dict(info.kv_params)],
                      "vocab": info.vocab_size, "tokens": tokens, "history": history, "pending": pending,
                      "result": s.last_result.stop_reason}))
""")


def _run(cmd, cwd, timeout=180):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sdk_python(tmp_path_factory) -> pathlib.Path:
    """Python of a fresh venv holding only the SDK, the stubs and their dependencies."""
    if not (ROOT / "wire" / "python" / "kakeya_wire" / "v1" / "runtime_pb2.py").exists():
        pytest.fail("the wire stubs are not generated: run `make proto`")
    tmp = tmp_path_factory.mktemp("sdk-venv")
    wire = shutil.copytree(ROOT / "wire" / "python", tmp / "wire", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    sdk = shutil.copytree(ROOT / "sdks" / "python", tmp / "sdk", ignore=IGNORE)
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], cwd=tmp)
    assert r.returncode == 0, r.stderr
    python = tmp / "venv" / "bin" / "python"
    r = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--disable-pip-version-check",
              str(wire), str(sdk)], cwd=tmp, timeout=600)
    assert r.returncode == 0, f"pip install of the SDK failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return python


@pytest.mark.parametrize("module", ["torch", "transformers", "inference_engine", "kv_cache_proposer"])
def test_the_sdk_venv_has_no_engine_and_no_framework(sdk_python, module):
    r = _run([str(sdk_python), "-c", f"import {module}"], cwd=sdk_python.parents[2])
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, f"{module} is importable next to the bare SDK"


def test_the_sdk_venv_talks_to_a_live_daemon(sdk_python):
    server = start_server(make_engine("llama", "sink_window", 4, 32, prefill_chunk=16))
    try:
        r = _run([str(sdk_python), "-c", CLIENT, f"127.0.0.1:{server.port}"], cwd=sdk_python.parents[2], timeout=60)
    finally:
        server.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    venv = str(sdk_python.parents[1])
    assert out["sdk"].startswith(venv) and out["wire"].startswith(venv), "the SDK must come from the fresh venv, not the tree"
    assert out["kv"] == ["sink_window", {"compressor": "identity", "sink": "4", "window": "32"}] and out["vocab"] == 256
    assert len(out["tokens"]) == 5 and out["result"] == "max_tokens" and out["pending"] == 1
    assert out["history"] == [5, 6, 7, 8, 9, *out["tokens"]]
