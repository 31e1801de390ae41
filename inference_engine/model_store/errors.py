"""Typed errors of the model store; every message names what failed and what to do next."""
from __future__ import annotations


class ModelStoreError(RuntimeError):
    """Base class for model store failures (download, extraction, conversion, verification)."""


class ModelNotFoundError(ValueError):
    """`--model` named neither a local model directory nor a pulled model."""


class PullError(ModelStoreError):
    """`kakeya models pull` could not produce a verified model directory."""
