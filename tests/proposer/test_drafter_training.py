"""Training: windows line up with teacher rows, the driver runs end to end, resumes, and runs under torchrun."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from proposer_factories import tiny_model_dir

from kv_cache_proposer import load_drafter
from kv_cache_proposer.training.losses import LossWeights, drafter_loss
from kv_cache_proposer.training.teacher import TeacherData
from kv_cache_proposer.training.trainer import TrainConfig, WindowSampler

torch.set_num_threads(1)
ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = ROOT / "scripts" / "training" / "train_drafter.py"


def fake_teacher(n_seqs=3, L=30, H=8, V=50, K=4):
    lens = [L + i for i in range(n_seqs)]
    N = sum(lens)
    offs = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    tokens = torch.arange(N, dtype=torch.int32) % V
    hidden = torch.arange(N, dtype=torch.float16)[:, None].repeat(1, H)  # row i is filled with i
    topk_idx = ((torch.arange(N)[:, None] + 1 + torch.arange(K)[None]) % V).int()
    return TeacherData(tokens, hidden, topk_idx, torch.zeros(N, K, dtype=torch.float16), offs,
                       torch.tensor([5, 1, 1]), torch.zeros(n_seqs, dtype=torch.int64), "x")


def test_window_targets_line_up_with_teacher_rows():
    d = fake_teacher()
    col_of = torch.arange(50)
    s = WindowSampler(d, 8, col_of)
    tc = TrainConfig(short_context_frac=0.3, no_hidden_frac=0.2)
    bt = s.batch(torch.Generator().manual_seed(0), 64, 4, tc)
    C = 8
    for b, pos, th, tcol in zip(bt["t_b"], bt["t_pos"], bt["t_hidden"], bt["t_col"]):
        row = int(th[0])  # the teacher row = global index of the token before the predicted slot
        assert int(tcol) == int(d.tokens[row + 1])  # target = next token
        assert bt["masked"][b, pos + 1]  # its slot is masked
        if pos >= C:  # predicted from a block slot: that slot holds the previous token or a mask
            assert bt["masked"][b, pos] or int(bt["ids"][b, pos]) == int(d.tokens[row])
        else:
            assert int(bt["ids"][b, pos]) == int(d.tokens[row])  # the last context token
    # hidden inputs are the previous token's verifier hidden, and never appear in block slots
    hh = bt["has_hidden"]
    assert not hh[:, C:].any()
    ok = bt["in_hidden"][hh][:, 0].float()
    assert ok.numel() > 0
    for b, p in hh.nonzero().tolist():
        tok = int(bt["ids"][b, p])
        assert int(bt["in_hidden"][b, p, 0]) % 50 == (tok - 1) % 50


def test_loss_parts_are_finite_and_ignore_out_of_vocab_targets():
    M, H, N = 6, 8, 20
    pred = torch.randn(M, H, requires_grad=True)
    logits = pred @ torch.randn(N, H).T
    col = torch.randint(0, N, (M, 4))
    col[0, 1] = -1
    tgt = torch.randint(0, N, (M,))
    tgt[2] = -1
    loss, parts = drafter_loss(pred, logits, torch.randn(M, H), col, torch.randn(M, 4), tgt, LossWeights())
    loss.backward()
    assert torch.isfinite(loss) and all(v == v for v in parts.values())
    assert torch.isfinite(pred.grad).all()


def _run_driver(args, nproc=0):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(DRIVER)] if not nproc else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(DRIVER)]
    r = subprocess.run(cmd + args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _tiny_args(work, out, steps):
    return ["--verifier", str(tiny_model_dir("llama")), "--synthetic", "70", "--work-dir", str(work), "--out", str(out),
            "--steps", str(steps), "--batch-size", "4", "--hidden", "32", "--heads", "4", "--intermediate", "64",
            "--context-window", "12", "--draft-vocab", "100", "--max-new", "12", "--save-every", "1", "--no-progress"]


def test_driver_runs_two_steps_end_to_end_and_resumes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "ck"
    _run_driver(_tiny_args(work, out, 2))
    st = torch.load(work / "train_state.pt", weights_only=False)
    assert st["step"] == 2
    man = json.loads((out / "manifest.json").read_text())
    assert man["training"]["steps_done"] == 2 and man["data"]["teacher_cache"]["tokens"] > 0
    _run_driver(_tiny_args(work, out, 4))
    st = torch.load(work / "train_state.pt", weights_only=False)
    assert st["step"] == 4
    assert [h["step"] for h in st["history"]] == [2, 4]  # continued (a restart would log only [4])
    from transformers import AutoModelForCausalLM

    v = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")))
    d = load_drafter(str(out), verifier_embed=v.get_input_embeddings().weight, verifier_lm_head=v.get_output_embeddings().weight)
    assert d.draft(torch.tensor([5, 6, 7]), 4).ids.shape == (4,)


@pytest.mark.slow
def test_driver_under_torchrun_two_processes(tmp_path):
    work, out = tmp_path / "work", tmp_path / "ck"
    _run_driver(_tiny_args(work, out, 3), nproc=2)
    man = json.loads((out / "manifest.json").read_text())
    assert man["training"]["world_size"] == 2 and man["training"]["steps_done"] == 3
