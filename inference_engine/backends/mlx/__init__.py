"""The MLX backend: the Backend protocol on Apple's array framework (model.py, store.py).

Importing this package needs no MLX; `require_mlx()` says what to install when it is missing.
MLX runs natively on Apple Silicon (`pip install mlx`) and on Linux CPUs (`pip install 'mlx[cpu]'`).
"""
from __future__ import annotations

import importlib.util
import sys

INSTALL_HINT = ("pip install 'kakeya-runtime[mlx]' (or: pip install " + ("mlx mlx-lm" if sys.platform == "darwin" else "'mlx[cpu]' mlx-lm")
                + "), or run with --backend torch")


class MlxUnavailable(ImportError):
    """MLX (or mlx-lm) is not installed, or cannot load on this machine."""


def mlx_available() -> bool:
    try:
        require_mlx()
    except MlxUnavailable:
        return False
    return True


def require_mlx() -> None:
    """Raise MlxUnavailable, naming the fix, unless mlx and mlx-lm import."""
    for name in ("mlx", "mlx_lm"):
        if importlib.util.find_spec(name) is None:
            raise MlxUnavailable(f"--backend mlx needs the {name.replace('_', '-')} package, which is not installed: {INSTALL_HINT}")
    try:
        import mlx.core  # noqa: F401  (the wheel can be present without a usable runtime)
    except Exception as e:  # noqa: BLE001 - any load failure means the same thing to the user
        raise MlxUnavailable(f"--backend mlx: mlx is installed but does not load here ({e}); {INSTALL_HINT}") from e
