"""Where pulled models live on this machine (`$KAKEYA_HOME/models/<name>`): the rule is shared
with the daemon, so it lives in `kakeya_wire.local_models`; this module is its SDK name."""
from __future__ import annotations

from kakeya_wire.local_models import (LocalModelNotFoundError, find_local_model, kakeya_home, looks_like_path, model_dir,
                                      models_dir)

__all__ = ["LocalModelNotFoundError", "kakeya_home", "models_dir", "model_dir", "looks_like_path", "find_local_model"]
