"""The one model path rule, `$KAKEYA_HOME/models/<name>`, and its use by the server's store."""
from pathlib import Path

import pytest

from kakeya import local_models
from kakeya.local_models import LocalModelNotFoundError, find_local_model, kakeya_home, model_dir, models_dir


def test_home_from_env_with_tilde_else_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KAKEYA_HOME", "~/k")
    assert kakeya_home() == tmp_path / "k" and model_dir("m") == tmp_path / "k" / "models" / "m"
    monkeypatch.delenv("KAKEYA_HOME")
    assert kakeya_home() == tmp_path / ".cache" / "kakeya"
    assert models_dir("~/other") == tmp_path / "other" / "models"


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "../m"])
def test_model_dir_takes_plain_names_only(bad):
    with pytest.raises(ValueError, match="plain name"):
        model_dir(bad)


def test_find_local_model_by_name_or_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KAKEYA_HOME", str(tmp_path / "home"))
    pulled = model_dir("m")
    pulled.mkdir(parents=True)
    assert find_local_model("m") == pulled
    assert find_local_model("~/home/models/m") == pulled  # a path, `~` expanded
    with pytest.raises(LocalModelNotFoundError, match=r"run `kakeya models pull other`"):
        find_local_model("other")
    with pytest.raises(LocalModelNotFoundError, match="does not exist"):
        find_local_model("~/nowhere")


def test_the_server_store_imports_the_same_rule():
    """One copy, in kakeya_wire (the daemon and the SDK both depend on it; neither imports the other)."""
    import kakeya_wire.local_models as shared
    from inference_engine.model_store import store
    from inference_engine.persistence import state_dir

    assert store.kakeya_home is shared.kakeya_home is local_models.kakeya_home is state_dir.kakeya_home
    assert store.models_dir is shared.models_dir is local_models.models_dir
    assert Path(store.__file__).read_text().count('os.environ.get("KAKEYA_HOME")') == 0
