"""`kakeya_model.json`: what a pulled model directory holds and where it came from.

The manifest is written last, after the weights were verified, and records every file's
size and sha256. A directory whose manifest is missing, foreign (e.g. a tiny test model's),
unverified, or disagrees with the files on disk is not a complete pulled model.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "kakeya_model.json"
MANIFEST_FORMAT = "kakeya-model/1"
_CHUNK = 1 << 20


def sha256_file(path: Path, *, bar=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    return digest.hexdigest()


def model_files(model_dir: Path) -> list[Path]:
    """Every regular file under `model_dir` except the manifest, sorted."""
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def hash_files(model_dir: Path, *, progress: bool = False) -> dict[str, dict]:
    """relative path -> {"bytes", "sha256"} for every file the manifest must vouch for."""
    from tqdm.auto import tqdm

    files = model_files(model_dir)
    out: dict[str, dict] = {}
    with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True,
              desc="sha256", disable=not progress) as bar:
        for p in files:
            out[p.relative_to(model_dir).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256_file(p, bar=bar)}
    return out


def write_manifest(model_dir: Path, record: dict, *, progress: bool = False) -> dict:
    """Hash the directory's files and write the manifest (format, verified=True, files) last."""
    manifest = {"format": MANIFEST_FORMAT, **record, "verified": True, "files": hash_files(model_dir, progress=progress)}
    tmp = model_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    tmp.replace(model_dir / MANIFEST_NAME)
    return manifest


def read_manifest(model_dir: Path) -> dict | None:
    """The parsed manifest, or None when it is absent or not valid JSON."""
    try:
        data = json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class DirCheck:
    ok: bool
    problem: str | None = None


def check_model_dir(model_dir: Path, *, deep: bool = False) -> DirCheck:
    """Is `model_dir` a complete, verified pulled model? Sizes always; sha256 too when `deep`."""
    if not model_dir.is_dir():
        return DirCheck(False, f"{model_dir} is not a directory")
    manifest = read_manifest(model_dir)
    if manifest is None:
        return DirCheck(False, f"no readable {MANIFEST_NAME} (interrupted or foreign directory)")
    if manifest.get("format") != MANIFEST_FORMAT:
        return DirCheck(False, f"{MANIFEST_NAME} is not a pulled-model manifest (format {manifest.get('format')!r})")
    if manifest.get("verified") is not True:
        return DirCheck(False, "manifest does not record a passed verification")
    files = manifest.get("files")
    source = manifest.get("source") or {}
    if source.get("gguf_file") and not source.get("gguf_kept_as"):
        return DirCheck(False, "pulled before the GGUF was kept (the int4 weights are built from it): pull again")
    if not isinstance(files, dict) or "config.json" not in files:
        return DirCheck(False, "manifest lists no model files")
    for rel, meta in files.items():
        path = model_dir / rel
        if not path.is_file():
            return DirCheck(False, f"{rel} is missing")
        if path.stat().st_size != meta.get("bytes"):
            return DirCheck(False, f"{rel} has {path.stat().st_size} bytes, manifest says {meta.get('bytes')}")
        if deep and sha256_file(path) != meta.get("sha256"):
            return DirCheck(False, f"{rel} does not match its recorded sha256")
    return DirCheck(True)
