"""scripts/gpu_bundle.py splits a model's GGUF into one part per device call, within the per-call
limit with the tree that travels every time, and writes the calls' commands: the parts join back
into the GGUF (the last call checks its sha256)."""
import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_bundle  # noqa: E402


def test_plan_calls_fills_each_call_to_the_limit():
    assert gpu_bundle.plan_calls(100, tree=30, first_extra=10, limit=80, margin=0) == [40, 50, 10]
    assert sum(gpu_bundle.plan_calls(98_362_432, tree=13_000_000, first_extra=3_600_000)) == 98_362_432
    with pytest.raises(SystemExit, match="no room for a part"):
        gpu_bundle.plan_calls(100, tree=90, first_extra=0, limit=80, margin=0)


def test_bundle_parts_join_into_the_gguf(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    gguf = bytes(range(256)) * 16_000  # 4 MB
    (model / "source.gguf").write_bytes(gguf)
    (model / "tokenizer.json").write_text("{}")
    (model / "config.json").write_text("{}")
    tree = gpu_bundle.tree_bytes([])
    out = tmp_path / "gpu"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bundle.py"), "--model", str(model), "--out", str(out),
                    "--no-wheel", "--commit", "abc", "--limit-bytes", str(tree + gpu_bundle.MARGIN + 1_800_000),
                    "--check-args", "--long-context 1024,1,2"],
                   check=True, capture_output=True, cwd=ROOT)
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["calls"]) == len(plan["parts"]) >= 3
    joined = b"".join((out / f"call{k}" / "part").read_bytes() for k in range(1, len(plan["parts"]) + 1))
    assert joined == gguf and plan["gguf_sha256"] == hashlib.sha256(gguf).hexdigest()
    last = (out / f"call{len(plan['parts'])}" / "run.sh").read_text()
    assert "sha256sum -c" in last and "scripts/gpu_check.py --gguf /root/kk/source.gguf" in last and "--commit 'abc'" in last
    assert "--commit 'abc' --long-context 1024,1,2 > $OUT/gpu_check.log" in last
    assert plan["calls"][0]["carry"] == [f"{out}/call1", f"{out}/tok"] and (out / "tok" / "tokenizer.json").exists()
