"""scripts/training/gpu_drafter_run.py, the v2 drafter's one-command GPU run, on the CPU with a tiny verifier:
the features it captures are the engine's, its batched evaluation drafts what the drafter drafts, and the
command runs end to end within a budget of seconds, writing a loadable checkpoint, its manifest and an eval JSON
(also when the watchdog has to cut it short). The end-to-end run ends after --max-steps training steps, not
at its budget, which only bounds it; the watchdog run is cut by its budget by design."""
import json
import os
import pathlib
import re
import subprocess
import sys

import torch

from factories import load_model, tiny_model_dir
from kv_cache_proposer import load_drafter
from kv_cache_proposer.dflash_drafter import DFlashDrafter
from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel
from kv_cache_proposer.training import gpu_data, gpu_train

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "training" / "gpu_drafter_run.py"
LAYERS = (0, 1, 2)  # every layer of the 3-layer tiny verifier, the last one included


def tiny_dir():
    return tiny_model_dir("llama", num_hidden_layers=3)


def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (11, 6, 17)]


def generated_buffer(model, layers=LAYERS, max_new=12):
    cap = gpu_data.LayerCapture(model, layers, feat_dtype=torch.float32)
    ps = prompts()
    gens, feats, final, am, pad_left = gpu_data.generate_batch(model, cap, ps, max_new, [2], 0)
    H = model.config.hidden_size
    buf = gpu_data.SeqBuffer(4096, len(layers) * H, H, torch.device("cpu"), 5, feat_dtype=torch.float32)
    buf.add(ps, gens, feats, final, am, pad_left, ["code"] * 3, [f"t|code|{i}" for i in range(3)])
    return ps, gens, buf


def test_captured_features_are_the_engines_capture_layers():
    """Left-padded batched generate() with hooks keeps, at every real position, what the engine's
    StepInput.capture keeps there (the residual stream after each layer, the last layer's before the norm)."""
    from inference_engine.engine.steps import StepInput, forward_batch
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    path = tiny_dir()
    ps, gens, buf = generated_buffer(hf(path))
    engine_model = load_model(str(path))
    for i, m in enumerate(buf.seqs):
        seq = ps[i] + gens[i]
        assert buf.tokens[m["start"] : m["end"]].tolist() == seq
        n = len(seq) - 1  # the last generated token is never fed: its row is never read
        cache = make_cache(KVStrategy("full"), engine_model.geometry(), max_step=64, max_context=engine_model.spec.max_context)
        inp = StepInput(torch.tensor(seq[:n]), range(n), cache, "none", capture=LAYERS)
        forward_batch(engine_model, [inp])
        cache.abort()
        torch.testing.assert_close(buf.feats[m["start"] : m["start"] + n], inp.captured.float(), rtol=1e-4, atol=1e-4)
        # the verifier's argmax at generated positions is the next generated token (greedy)
        g0 = m["gen_start"] - 1
        assert buf.argmax[g0 : m["end"] - 1].tolist() == seq[len(ps[i]) :]


def test_batched_evaluation_drafts_what_the_drafter_drafts():
    path = tiny_dir()
    model = hf(path)
    ps, gens, buf = generated_buffer(model)
    torch.manual_seed(1)
    V, H = model.get_input_embeddings().weight.shape
    cfg = DFlashConfig(vocab_size=V, verifier_hidden_size=H, capture_layers=(0, 2), hidden_size=32, num_layers=1, num_heads=4,
                       num_kv_heads=2, intermediate_size=64, draft_vocab_size=64, context_window=8, block_size=5)
    dm = DFlashModel(cfg, model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
    with torch.no_grad():
        for p in dm.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    dm.set_draft_vocab(torch.arange(100, 164))
    drafter = DFlashDrafter(dm)
    # the buffer holds layers 0, 1, 2; this drafter reads 0 and 2
    cols = torch.cat([torch.arange(0, H), torch.arange(2 * H, 3 * H)])
    drafts, complete = gpu_train.draft_every_position(dm, buf, buf.seqs, cols, span=5, windows=3)
    assert complete and set(drafts) == {0, 1, 2}
    checked = 0
    for si, (pos, d, _, _) in drafts.items():
        s = buf.seqs[si]["start"]
        for r in range(len(pos)):
            p = int(pos[r])
            ctx = buf.feats[max(s, p - cfg.context_window) : p][:, cols]
            want = drafter.draft([int(buf.tokens[p])], 4, context_hidden=ctx, position=p - s).ids
            assert d[r].tolist() == want.tolist(), (si, p)
            checked += 1
    assert checked == sum(len(g) - 1 for g in gens)
    # the replay: per verify step (drafted, accepted); a perfect drafter would accept every draft
    rows = gpu_train.replay(drafts, buf.seqs)
    perfect = {si: (pos, tg.clone(), tg, avail) for si, (pos, d, tg, avail) in drafts.items()}
    best = gpu_train.summarize(gpu_train.replay(perfect, buf.seqs))
    assert best["alpha"] == 1.0 and best["alpha_per_slot"] == [1.0] * 4
    assert sum(d for r in rows for d, _ in r["steps"]) >= sum(a for r in rows for _, a in r["steps"])


def run_script(out, *extra, minutes):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in (".", "wire/python", "sdks/python")),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--model-dir", str(tiny_dir()), "--minutes", minutes, "--out", str(out),
           "--threads", "1", "--corpus-files", "40", "--corpus-seconds", "2", "--man-pages", "10", "--max-prompts", "96",
           "--max-new", "12", "--gen-batch", "16", "--eval-prompts", "3", "--eval-max-new", "12", "--drafter-hidden", "32",
           "--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--context-window", "16", "--draft-vocab", "64",
           "--windows", "8", "--anchors", "8", "--span", "16", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def check_outputs(out: pathlib.Path):
    files = sorted(p for p in out.rglob("*"))
    assert len(files) <= 8 and all(p.is_file() and p.parent == out for p in files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    assert all(p.stat().st_size <= 16 * 1024 * 1024 for p in files)
    return json.loads((out / "manifest.json").read_text()), json.loads((out / "eval.json").read_text())


MAX_STEPS = 100


def test_the_command_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    # training ends after MAX_STEPS steps (~2 s here), so the run ends with its work; the budget is only the bound
    # (the whole command takes ~10 s on an idle 2-core box: 1.5 minutes is slack for a loaded one)
    r = run_script(out, "--max-steps", str(MAX_STEPS), minutes="1.5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert {"drafter.safetensors", "manifest.json", "eval.json", "run.log"} <= {p.name for p in out.iterdir()}
    manifest, ev = check_outputs(out)
    assert manifest["format"] == "kakeya-drafter/2" and manifest["config"]["capture_layers"] == list(LAYERS)
    assert manifest["run"]["completed"] is True and manifest["run"]["cut_short"] == [], manifest["run"]
    assert manifest["run"]["stages"]["train"]["stop"] == f"--max-steps {MAX_STEPS}", manifest["run"]["stages"]["train"]
    tr, data = manifest["training"], manifest["data"]
    assert tr["steps_done"] == MAX_STEPS and tr["trained_on"]["device"] == "cpu" and "gpu_drafter_run.py" in tr["command"]
    assert data["generation"]["generated_tokens"] > 0 and data["corpus"]["prompts_file"]["sha256"]
    assert data["corpus"]["per_source"]["stdlib"]["files"] > 0
    assert "features_from" in manifest["verifier"] and manifest["run"]["stages"]["eval"]["status"]
    # held-out evaluation at k = 4, per slot; the shipped drafter is for another verifier, which the JSON says
    new = ev["new"]["corpus_heldout"]["all"]
    assert ev["k"] == 4 and len(new["alpha_per_slot"]) == 4 and new["tokens_per_verify_step"] >= 1.0
    assert "skipped" in ev["shipped"] and "vocab" in ev["shipped"]["skipped"]
    assert manifest["eval"]["headline"]["corpus_heldout"]["all"]["new"]["tokens_per_verify_step"] == new["tokens_per_verify_step"]
    # the checkpoint loads through the project's loader and drafts for the tiny verifier
    model = load_model(str(tiny_dir()))
    d = load_drafter(str(out), verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    assert isinstance(d, DFlashDrafter) and d.capture_layers == LAYERS
    res = d.draft([7], 4, context_hidden=torch.randn(5, len(LAYERS) * model.spec.hidden_size))
    assert res.ids.numel() == 4 and bool(torch.isin(res.ids, d.model.draft_vocab).all())


def test_the_watchdog_writes_the_outputs_when_a_stage_overruns(tmp_path):
    out = tmp_path / "out"
    # the stall hangs the main thread as training starts and spends the budget there (the watchdog's deadline moved
    # to that moment), so the watchdog, not the box's speed, ends the run: 1.5 minutes only bounds a loaded box
    r = run_script(out, "--test-stall", "train", "--schedule", "sequential", minutes="1.5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    manifest, ev = check_outputs(out)
    cut = manifest["run"]["cut_short"]
    assert manifest["run"]["completed"] is False and any("watchdog" in c and "train" in c for c in cut), cut
    assert manifest["run"]["stages"]["train"]["status"] == "cut by the watchdog", manifest["run"]["stages"]
    assert "watchdog" in ev["status"] and ev["run"]["completed"] is False
    # the trainer's snapshot (taken as training started) is the checkpoint, and it loads
    assert manifest["training"]["exported"]["which"] == "snapshot (watchdog)"
    model = load_model(str(tiny_dir()))
    d = load_drafter(str(out), verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    assert isinstance(d, DFlashDrafter) and d.capture_layers == LAYERS
