"""Every Python block in README.md is a file in sdks/python/examples/, and every example
runs to exit 0 against a live daemon serving the pulled default model (KAKEYA_ADDRESS)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from factories import require_smollm2

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "sdks" / "python" / "examples"


def normalized(code: str) -> str:
    return "\n".join(line.rstrip() for line in code.strip().splitlines())


def readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.M | re.S)


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.py"))


def test_every_readme_python_block_is_an_example_file():
    blocks = readme_python_blocks()
    assert blocks, "README.md has no ```python block; this test would check nothing"
    files = {normalized(p.read_text()): p.name for p in example_files()}
    for block in blocks:
        assert normalized(block) in files, (
            f"README block starting {block.strip().splitlines()[0]!r} is not the contents of any file in "
            f"{EXAMPLES.relative_to(ROOT)}; put it there and show the file's contents in the README")


@pytest.mark.parametrize("example", example_files(), ids=lambda p: p.name)
def test_examples_use_only_the_sdk(example):
    imported = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", example.read_text(), flags=re.M)
    assert not [m for m in imported if m.split(".")[0] in ("inference_engine", "kv_cache_proposer", "torch")]


@pytest.fixture(scope="module")
def daemon():
    from inference_engine.server.app import ServeConfig, start

    running = start(ServeConfig(bind="127.0.0.1:0", model=str(require_smollm2()), capacity=4))
    yield f"127.0.0.1:{running.port}"
    running.stop()


@pytest.mark.model
@pytest.mark.parametrize("example", example_files(), ids=lambda p: p.name)
def test_example_runs_against_a_live_daemon(daemon, example):
    env = {**os.environ, "KAKEYA_ADDRESS": daemon, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(example)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{example.name} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip()
