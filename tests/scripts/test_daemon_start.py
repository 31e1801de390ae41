"""scripts/research/daemon_start.py on a tiny int4 model: one start of the `made` arm (its head-blocks file removed
first) reaches READY, its log's phases are read in order, and the start writes the file again for the next. Nothing
here reads a timing's value."""
import json
import shutil

from factories import main_in_process, require_native, tiny_model_dir


def test_a_made_start_reads_its_phases_and_keeps_the_head_blocks_for_the_next(tmp_path, monkeypatch):
    require_native()
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-*"))
    (d / ".kakeya-native-head-int4-0123456789ab.safetensors").write_bytes(b"stale")  # removed by the made arm
    out = tmp_path / "start.json"
    (d / ".kakeya-native-layers-int4.safetensors").write_bytes(b"stale")  # from before the tags: removed by the packed arm
    assert main_in_process("scripts/research/daemon_start.py", ["--model", d, "--arms", "made,packed", "--rounds", "1",
                                                                "--threads", "1", "--out", out], monkeypatch) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/daemon_start.py ")
    (run,), (packed,) = doc["arms"]["made"], doc["arms"]["packed"]
    assert run["ready_s"] > 0 and run["head_blocks_file_after"] and run["rss_mb_at_ready"] > 50
    assert packed["layer_blocks_file_after"] and all(f.stat().st_size > 1000 for f in d.glob(".kakeya-native-layers-*"))
    assert not (d / ".kakeya-native-layers-int4.safetensors").exists()
    assert list(run["phases_s"]) == ["imports_and_weights", "native_load", "native_packing", "compile_auto", "warm_up", "freeze", "serving"]
    heads = list(d.glob(".kakeya-native-head-int4-*.safetensors"))
    assert len(heads) == 1 and heads[0].stat().st_size > 1000 and "0123456789ab" not in heads[0].name


def test_the_fallback_arm_keeps_the_torch_copies_the_default_drops(tmp_path, monkeypatch):
    require_native()
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-*"))
    out = tmp_path / "start.json"
    assert main_in_process("scripts/research/daemon_start.py", ["--model", d, "--arms", "kept,fallback", "--rounds", "1",
                                                                "--threads", "1", "--out", out], monkeypatch) == 0
    doc = json.loads(out.read_text())
    (kept,), (fallback,) = doc["arms"]["kept"], doc["arms"]["fallback"]
    assert kept["torch_copies_dropped"] and not fallback["torch_copies_dropped"]
    assert fallback["rss_mb_at_ready"] > 50
