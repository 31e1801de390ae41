"""scripts/research/verify_split.py on a tiny random-weight int4 model, run in this process (no second interpreter to
start): every cell at every row count timed in the same rounds, the per-extra-row figures and ratios derived from
the medians, written with the provenance. Nothing here reads a timing's value."""
import json

import pytest

from factories import main_in_process, require_native, tiny_model_dir
from inference_engine.backends.torch import native

SCRIPT = "scripts/research/verify_split.py"


def _main(monkeypatch, *args):
    return main_in_process(SCRIPT, args, monkeypatch)


def test_verify_split_times_every_cell_at_every_row_count(tmp_path, monkeypatch):
    mod = require_native()
    if mod.q4_isa() == 0:
        pytest.skip("no AVX2 here: the native step keeps torch's int4 kernel")
    out = tmp_path / "verify_split.json"
    assert _main(monkeypatch, "--model", tiny_model_dir("llama"), "--threads", "1", "--context", "20", "--rows", "1,3",
                 "--rounds", "2", "--steps", "1", "--out", out) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("scripts/research/verify_split.py ") and doc["commit"]
    assert doc["planes"] == native.PLANES and set(doc["by_rows"]) == {"1", "3"}
    one, three = doc["by_rows"]["1"], doc["by_rows"]["3"]
    cells = ("forward", "layers_default", "layers_one_plane", "layers_two_planes", "head")
    if mod.q4_isa() == 2:  # the AVX-512 kernel's row tiles against its loop before them
        cells += ("forward_chain", "layers_two_planes_chain")
    assert {k[:-len("_ms_median")] for k in one if k.endswith("_ms_median")} == set(cells)
    for c in cells:
        assert one[f"{c}_ms_median"] > 0 and three[f"{c}_ms_median"] > 0
        # derived from the unrounded medians: equal to the rounded ones' up to their rounding (0.00005 ms each)
        assert three[f"{c}_vs_1"] == pytest.approx(three[f"{c}_ms_median"] / one[f"{c}_ms_median"], rel=0.03, abs=0.002)
        per_row = (three[f"{c}_ms_median"] - one[f"{c}_ms_median"]) / 2
        assert three[f"{c}_ms_per_extra_row"] == pytest.approx(per_row, abs=0.002)
    rest = one["forward_ms_median"] - one["layers_default_ms_median"] - one["head_ms_median"]
    assert abs(one["rest_ms"] - rest) < 0.002


def test_verify_split_wants_the_decode_row_first(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="must start with 1"):
        _main(monkeypatch, "--model", "unused", "--rows", "2,5", "--out", tmp_path / "x.json")
