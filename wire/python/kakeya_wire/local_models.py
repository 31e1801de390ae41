"""Where pulled models live on this machine: `$KAKEYA_HOME/models/<name>`, the home
defaulting to `~/.cache/kakeya`. This is the one copy of the rule, shared here because both sides
need it and neither may import the other: the daemon's model store pulls into it and its state
directory defaults under the home; the SDK (`kakeya.local_models`) finds a pulled model's
tokenizer with it. Standard library only.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LocalModelNotFoundError", "kakeya_home", "models_dir", "model_dir", "looks_like_path", "find_local_model"]


class LocalModelNotFoundError(FileNotFoundError):
    """A model name or directory that is not on this machine; the message says how to get it."""


def kakeya_home() -> Path:
    """`$KAKEYA_HOME` (with `~` expanded), else `~/.cache/kakeya` (not created here)."""
    env = os.environ.get("KAKEYA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kakeya"


def models_dir(home: str | os.PathLike | None = None) -> Path:
    """The folder holding one directory per pulled model."""
    return (Path(home).expanduser() if home is not None else kakeya_home()) / "models"


def model_dir(name: str, *, home: str | os.PathLike | None = None) -> Path:
    """Directory a pulled model `name` has (or would have); it may not exist."""
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"model name {name!r} must be a plain name such as 'smollm2-135m-instruct', not a path")
    return models_dir(home) / name


def looks_like_path(name_or_path: str) -> bool:
    """Is a `--model` argument meant as a path (relative, `~`, or with a separator) rather than a name?"""
    return name_or_path.startswith((".", "~")) or "/" in name_or_path or os.sep in name_or_path


def find_local_model(name_or_path: str | os.PathLike, *, home: str | os.PathLike | None = None) -> Path:
    """An existing model directory: a directory path (`~` expanded) or a pulled model's name."""
    raw = os.fspath(name_or_path)
    local = Path(raw).expanduser()
    if local.is_dir():
        return local
    if looks_like_path(raw):
        raise LocalModelNotFoundError(f"model directory {raw!r} does not exist ({local}); pass a model directory "
                                      f"or the name of a pulled model (`kakeya models list`)")
    pulled = model_dir(raw, home=home)
    if not pulled.is_dir():
        raise LocalModelNotFoundError(f"model {raw!r} is not pulled on this machine (no {pulled}); "
                                      f"run `kakeya models pull {raw}`")
    return pulled
