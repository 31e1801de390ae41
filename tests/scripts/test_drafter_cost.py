"""scripts/research/drafter_cost.py, run in this process on int4 SmolLM2 and the shipped v2 drafter: both arms timed in
the same rounds, and the two forms of the drafter's vocabulary projection give the same logits up to float summation
order. Nothing here reads a timing's value. Slow (it loads SmolLM2: the suite sits at its 10-minute bound); the
projections' agreement is in the default suite (tests/proposer/test_dflash_drafter.py)."""
import json
import sys
from importlib import util

import pytest
import torch

from factories import ROOT, require_smollm2

SCRIPT = "scripts/research/drafter_cost.py"


@pytest.mark.model
@pytest.mark.slow
def test_drafter_cost_times_both_projections_and_they_agree(tmp_path, monkeypatch):
    path = require_smollm2()
    spec = util.spec_from_file_location("drafter_cost", ROOT / SCRIPT)
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "drafter_cost.json"
    argv = ["--model", str(path), "--threads", "1", "--rounds", "1", "--drafts", "2", "--context", "40", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    threads = torch.get_num_threads()
    try:
        assert mod.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/drafter_cost.py ") and doc["commit"]
    assert set(doc["by_arm"]) == {"streamed", "packed"} and all(v["draft_ms_median"] > 0 for v in doc["by_arm"].values())
    assert doc["packed_vs_streamed"] == pytest.approx(
        doc["by_arm"]["packed"]["draft_ms_median"] / doc["by_arm"]["streamed"]["draft_ms_median"], rel=0.01)
    assert doc["logits_argmax_equal"] and doc["logits_max_abs_diff"] < 1e-3
