"""Which model a saved session's K/V belongs to: weights sha256, tokenizer sha256, weight format.

K/V rows are only meaningful to the weights (and weight format: int4 and fp32 give different
rows) that computed them, and token ids only to the tokenizer that made them. A pulled model's
manifest already records every file's sha256 (verified at pull), so those are used; a directory
without one (tiny test models, local HF directories) is hashed once at startup.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from inference_engine.model_store.manifest import read_manifest, sha256_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def _file_hashes(model_dir: Path, names: list[str]) -> dict[str, str]:
    recorded = (read_manifest(model_dir) or {}).get("files") or {}
    out = {}
    for name in names:
        meta = recorded.get(name) if isinstance(recorded, dict) else None
        if isinstance(meta, dict) and meta.get("bytes") == (model_dir / name).stat().st_size and meta.get("sha256"):
            out[name] = meta["sha256"]
        else:
            out[name] = sha256_file(model_dir / name)
    return out


def _combined(hashes: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{n}\0{h}\n" for n, h in sorted(hashes.items())).encode()).hexdigest()


def _weight_files(d: Path, derived: bool) -> list[str]:
    """The weight files (and config.json) the identity hashes. Not the derived start-up files the backends keep beside
    the model (hidden: `.kakeya-packed-int4.safetensors`, `.kakeya-native-*-<build>.safetensors`, ...): they are made
    from the weights and written, replaced and pruned by every build that starts on the model, so hashing them made a
    daemon restarted after another build (an upgrade, a second checkout) refuse and set aside every saved session.
    derived=True: with them, as identities were made before 2026-12-01 (legacy_weights_sha256)."""
    files = sorted(p.name for p in d.iterdir() if p.is_file() and (derived or not p.name.startswith(".")))
    return [n for n in files if n.endswith(WEIGHT_SUFFIXES)] + [n for n in files if n == "config.json"]


def legacy_weights_sha256(model_dir: str) -> str | None:
    """weights_sha256 as daemons before 2026-12-01 made it (the derived start-up files included), over the directory as
    it is now: a session saved then, while the derived files present now were present, still matches."""
    d = Path(model_dir) if model_dir else None
    if d is None or not d.is_dir():
        return None
    return _combined(_file_hashes(d, _weight_files(d, derived=True)))


def model_identity(model_id: str, model_dir: str, weights_format: str, backend: str) -> dict:
    """The identity record a session manifest carries; two records are compatible iff equal."""
    d = Path(model_dir) if model_dir else None
    if d is None or not d.is_dir():
        weights = tokenizer = "unknown"
    else:
        files = sorted(p.name for p in d.iterdir() if p.is_file())
        weights = _combined(_file_hashes(d, _weight_files(d, derived=False)))
        tok = [n for n in files if n in TOKENIZER_FILES]
        tokenizer = _combined(_file_hashes(d, tok)) if tok else "none"
    return {"model_id": model_id, "weights_sha256": weights, "tokenizer_sha256": tokenizer,
            "weights_format": weights_format, "backend": backend}


def identity_mismatch(saved: dict, current: dict) -> str | None:
    """A sentence naming what differs, or None when the saved session belongs to this model."""
    diffs = [f"{k} {saved.get(k)!r} (saved) vs {current.get(k)!r} (this daemon)"
             for k in ("weights_sha256", "weights_format", "tokenizer_sha256", "backend") if saved.get(k) != current.get(k)]
    if not diffs:
        return None
    return f"saved for model {saved.get('model_id')!r} with other weights: " + "; ".join(diffs)
