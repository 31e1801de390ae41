"""The v2 (DFlash-style) drafter over tiny random verifiers: the engine captures the verifier layers it
reads during the steps it runs anyway, its cache drafts what a cache-free call drafts, speculation with
it is token-identical to autoregressive greedy decoding, and checkpoints round-trip."""
import json
import threading

import pytest
import torch

from factories import load_model, load_script, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine, GenerateParams
from inference_engine.engine.steps import StepInput, forward_batch
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy
from kv_cache_proposer import load_drafter, save_drafter
from kv_cache_proposer.dflash_drafter import DFlashDrafter
from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel

LAYERS = (0, 1)  # of a 3-layer tiny verifier: neither is the last (whose HF hidden_states entry is normed)


def tiny_verifier_dir():
    return tiny_model_dir("llama", num_hidden_layers=3)


def tiny_dflash(model, *, window: int = 12, block: int = 5, draft_vocab: int = 0, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    V, H = model.embed.shape
    cfg = DFlashConfig(vocab_size=V, verifier_hidden_size=H, capture_layers=LAYERS, hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=draft_vocab,
                       context_window=window, block_size=block)
    m = DFlashModel(cfg, model.embed.float(), model.lm_head.float())
    with torch.no_grad():  # decisive, input-sensitive outputs
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return DFlashDrafter(m)


def prompt(n, seed=0, vocab=256):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(engine, history, n, kv=None):
    kv = kv or engine.new_session_kv()
    evs = list(engine.generate(kv, history, GenerateParams(max_tokens=n)))
    return [e.token_id for e in evs if isinstance(e, TokenGenerated)], evs[-1], kv


def hf_layer_outputs(path, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hs = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in LAYERS], -1)


def test_forward_captures_the_requested_layers_and_nothing_when_off():
    path = tiny_verifier_dir()
    model = load_model(str(path))
    ids = prompt(9)
    cache = make_cache(KVStrategy("full"), model.geometry(), max_step=64, max_context=model.spec.max_context)
    off = StepInput(torch.tensor(ids), range(0, 9), cache, "last")
    forward_batch(model, [off])
    cache.abort()
    assert off.captured is None
    on = StepInput(torch.tensor(ids), range(0, 9), cache, "last", capture=LAYERS)
    forward_batch(model, [on])
    cache.abort()
    want = hf_layer_outputs(path, ids)
    assert on.captured.shape == (9, len(LAYERS) * model.spec.hidden_size)
    torch.testing.assert_close(on.captured.float(), want, rtol=1e-4, atol=1e-4)


def test_batched_forward_gives_each_step_its_own_capture():
    model = load_model(str(tiny_verifier_dir()))
    mk = lambda: make_cache(KVStrategy("full"), model.geometry(), max_step=64, max_context=model.spec.max_context)  # noqa: E731
    a, b = prompt(7, 1), prompt(5, 2)
    alone = []
    for ids in (a, b):
        inp = StepInput(torch.tensor(ids), range(len(ids)), mk(), "last", capture=LAYERS)
        forward_batch(model, [inp])
        alone.append(inp.captured)
    both = [StepInput(torch.tensor(a), range(7), mk(), "last", capture=LAYERS), StepInput(torch.tensor(b), range(5), mk(), "last")]
    forward_batch(model, both)
    torch.testing.assert_close(both[0].captured, alone[0], rtol=1e-5, atol=1e-5)
    assert both[1].captured is None


def test_engine_keeps_the_captured_features_of_committed_positions():
    path = tiny_verifier_dir()
    model = load_model(str(path))
    d = tiny_dflash(model, window=12)
    engine = Engine(model, KVStrategy("full"), prefill_chunk=16, drafter=d, spec_k=4)
    history = prompt(20, seed=3)
    toks, _, kv = generate(engine, history, 10)
    assert kv.capture_layers == LAYERS and kv.recent_hidden.shape == (12, len(LAYERS) * model.spec.hidden_size)
    # the features of the last 12 committed positions are the verifier's layer outputs there
    seq = (history + toks)[: kv.next_position]
    want = hf_layer_outputs(path, seq)[-12:]
    torch.testing.assert_close(kv.recent_hidden.float(), want, rtol=1e-3, atol=1e-3)
    assert Engine(model, KVStrategy("full")).new_session_kv().capture_layers == ()


def test_cached_drafts_equal_cache_free_drafts():
    model = load_model(str(tiny_verifier_dir()))
    d = tiny_dflash(model, window=10)
    F = len(LAYERS) * model.spec.hidden_size
    feats = torch.randn(40, F, generator=torch.Generator().manual_seed(0))
    state = d.new_state()
    pos = 3
    for step, last in enumerate([5, 9, 11, 7, 30, 4, 8]):
        pos += [1, 3, 2, 5, 1, 4, 2][step]  # positions advance by 1 + accepted, sometimes past the window
        r_cached = d.draft([last], 4, context_hidden=feats[max(0, pos - 10) : pos], state=state, position=pos)
        r_free = d.draft([last], 4, context_hidden=feats[max(0, pos - 10) : pos], position=pos)
        assert r_cached.ids.tolist() == r_free.ids.tolist()
        torch.testing.assert_close(r_cached.probs, r_free.probs, rtol=1e-4, atol=1e-5)
        assert state.positions == min(pos, 10)
    # the drafts depend on the verifier features (it is conditioned on them)
    other = d.draft([8], 4, context_hidden=torch.zeros(10, F), position=pos)
    assert not torch.allclose(other.probs, r_free.probs)
    assert d.draft([8], 9, context_hidden=feats[:pos][-10:]).ids.numel() == 4  # at most block_size - 1 drafts


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 24)], ids=lambda s: s.name)
def test_greedy_speculation_with_the_v2_drafter_equals_autoregressive(strategy):
    model = load_model(str(tiny_verifier_dir()))
    ar = Engine(model, strategy, prefill_chunk=32)
    for k, dv in ((1, 0), (3, 64), (4, 0)):
        spec = Engine(model, strategy, prefill_chunk=32, drafter=tiny_dflash(model, draft_vocab=dv, seed=k), spec_k=k)
        history = prompt(50, seed=k)  # longer than the 4+24 window and the drafter's 12
        want, _, _ = generate(ar, history, 40)
        got, done, _ = generate(spec, history, 40)
        assert got == want
        assert done.drafted_tokens > 0


def test_multi_turn_and_concurrent_sessions_stay_exact():
    from inference_engine.backends.torch.model import TorchCausalLM

    model = TorchCausalLM.load(str(tiny_verifier_dir()), weights="int8")  # row-independent kernels: batching is exact
    strategy = KVStrategy("sink_window", 4, 16)
    ar = Engine(model, strategy, prefill_chunk=16)
    spec = Engine(model, strategy, prefill_chunk=16, drafter=tiny_dflash(model, window=8), spec_k=4, batching="on")
    out = {}

    def session(engine, seed, key):
        kv, history = engine.new_session_kv(), []
        for turn in range(3):
            history += prompt(9 + 20 * (turn == 1), seed=seed * 10 + turn)  # turn 1 is longer than the drafter's window
            toks, _, kv = generate(engine, history, 11, kv)
            history += toks
        out[key] = history

    threads = [threading.Thread(target=session, args=(spec, s, ("spec", s))) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in (1, 2):
        session(ar, s, ("ar", s))
        assert out[("spec", s)] == out[("ar", s)]


def test_session_state_round_trip_keeps_the_capture_layers():
    from inference_engine.engine.session_kv import SessionKV

    model = load_model(str(tiny_verifier_dir()))
    engine = Engine(model, KVStrategy("full"), prefill_chunk=16, drafter=tiny_dflash(model), spec_k=3)
    _, _, kv = generate(engine, prompt(15), 6)
    st = kv.state()
    back = SessionKV.from_state(st, model.geometry(), max_step=16, max_context=model.spec.max_context)
    assert back.capture_layers == LAYERS and torch.equal(back.recent_hidden, kv.recent_hidden)


def test_checkpoint_round_trip_by_directory(tmp_path):
    model = load_model(str(tiny_verifier_dir()))
    d = tiny_dflash(model, draft_vocab=64)
    d.model.set_draft_vocab(torch.arange(100, 164))
    save_drafter(d.model, tmp_path / "ck", {"name": "tiny-dflash"})
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["format"] == "kakeya-drafter/2" and manifest["config"]["capture_layers"] == list(LAYERS)
    back = load_drafter(str(tmp_path / "ck"), verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    assert isinstance(back, DFlashDrafter) and back.capture_layers == LAYERS
    feats = torch.randn(6, len(LAYERS) * model.spec.hidden_size)
    a, b = d.draft([7], 4, context_hidden=feats), back.draft([7], 4, context_hidden=feats)
    assert a.ids.tolist() == b.ids.tolist() and bool((a.ids >= 100).all() and (a.ids < 164).all())


def _train_args(tmp_path, verifier, steps=40):
    return ["--verifier", str(verifier), "--name", "tiny-dflash", "--out", str(tmp_path / "ck"), "--work-dir", str(tmp_path / "work"),
            "--synthetic", "40", "--max-new", "12", "--layers", "0,1", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
            "--intermediate", "64", "--draft-vocab", "0", "--context-window", "16", "--steps", str(steps), "--seqs-per-step", "4",
            "--anchors-per-seq", "8", "--lr", "3e-3"]


def _copy_data(tmp_path, name):
    """A copy of the tiny run's data chunks (its work dir without the train state, which would be resumed instead)."""
    import shutil

    d = tmp_path / name
    d.mkdir()
    for f in (tmp_path / "work").glob("*"):
        if f.name != "train_state_v2.pt":
            shutil.copy(f, d / f.name)
    return d


def test_training_script_learns_the_tiny_verifier_and_exports_a_loadable_checkpoint(tmp_path):
    mod = load_script("scripts/training/train_drafter_v2.py")
    verifier = tiny_verifier_dir()
    assert mod.main(_train_args(tmp_path, verifier, steps=60)) == 0
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    hist = manifest["training"]["history"]
    assert manifest["format"] == "kakeya-drafter/2" and manifest["training"]["steps_done"] == 60
    assert hist[-1]["ce"] < hist[0]["ce"]  # the drafter learns the verifier's greedy continuations
    model = load_model(str(verifier))
    d = load_drafter(str(tmp_path / "ck"), verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    ar = Engine(model, KVStrategy("full"), prefill_chunk=16)
    spec_engine = Engine(model, KVStrategy("full"), prefill_chunk=16, drafter=d, spec_k=4)
    assert generate(spec_engine, prompt(12, 9), 20)[0] == generate(ar, prompt(12, 9), 20)[0]


def test_a_warm_start_begins_from_the_checkpoint_bit_for_bit(tmp_path):
    """--init-from: the checkpoint's config, draft vocabulary and weights are where training starts (0 steps exports
    them unchanged); a checkpoint conditioned on other layers than the data's is refused by name."""
    import shutil

    from safetensors.torch import load_file

    mod = load_script("scripts/training/train_drafter_v2.py")
    verifier = tiny_verifier_dir()
    assert mod.main(_train_args(tmp_path, verifier, steps=8)) == 0
    warm = _copy_data(tmp_path, "warm")
    args = _train_args(tmp_path, verifier, steps=0)
    args[args.index("--out") + 1], args[args.index("--work-dir") + 1] = str(tmp_path / "ck2"), str(warm)
    args[args.index("--hidden") + 1] = "16"  # shape flags are ignored: the checkpoint's config wins
    assert mod.main([*args, "--stage", "train", "--init-from", str(tmp_path / "ck")]) == 0
    a, b = load_file(str(tmp_path / "ck" / "drafter.safetensors")), load_file(str(tmp_path / "ck2" / "drafter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((tmp_path / "ck2" / "manifest.json").read_text())
    assert manifest["training"]["init_from"]["checkpoint"] == str(tmp_path / "ck") and manifest["config"]["hidden_size"] == 32
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "ck", other)
    m = json.loads((other / "manifest.json").read_text())
    m["config"]["capture_layers"] = [1, 0]
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit, match="conditions on layers"):
        mod.main([*args, "--stage", "train", "--init-from", str(other)])


def test_extra_data_directories_train_together_and_must_share_the_layers(tmp_path):
    """--extra-data: the train stage takes the chunks of more directories with the work dir's (cpu_features.py's
    teacher-forced and generated directories together); the manifest names them; other capture layers are refused."""
    mod = load_script("scripts/training/train_drafter_v2.py")
    verifier = tiny_verifier_dir()
    assert mod.main(_train_args(tmp_path, verifier, steps=2)) == 0
    one = json.loads((tmp_path / "ck" / "manifest.json").read_text())["data"]["used"]
    data = [_copy_data(tmp_path, name) for name in ("a", "b")]
    args = _train_args(tmp_path, verifier, steps=2)
    args[args.index("--out") + 1], args[args.index("--work-dir") + 1] = str(tmp_path / "ck2"), str(data[0])
    assert mod.main([*args, "--stage", "train", "--extra-data", str(data[1])]) == 0
    man = json.loads((tmp_path / "ck2" / "manifest.json").read_text())["data"]
    assert man["used"]["tokens"] == 2 * one["tokens"] and man["used"]["chunks"] == one["chunks"]
    assert man["extra_data"] == [{"dir": str(data[1]), "stage": man.get("stage"), "max_new": man["max_new_tokens"],
                                  "chunks": one["chunks"]}]
    spec = json.loads((data[1] / "jobs.json").read_text())
    spec["layers"] = list(reversed(spec["layers"]))
    (data[1] / "jobs.json").write_text(json.dumps(spec))
    with pytest.raises(SystemExit, match="holds features of layers"):
        mod.main([*args, "--stage", "train", "--extra-data", str(data[1])])


def test_a_train_state_is_resumed_only_by_the_run_that_wrote_it(tmp_path, capsys):
    """The work dir's train_state_v2.pt resumes a cut-off run (same data and flags, more steps); a run on other data
    (here --extra-data) or with other flags is refused by name instead of silently continuing another run's steps,
    optimizer and spent time budget."""
    mod = load_script("scripts/training/train_drafter_v2.py")
    verifier = tiny_verifier_dir()
    assert mod.main(_train_args(tmp_path, verifier, steps=2)) == 0
    more = _copy_data(tmp_path, "more")
    with pytest.raises(SystemExit, match=r"train state of another run \(differs in: chunks\)"):
        mod.main([*_train_args(tmp_path, verifier, steps=4), "--stage", "train", "--extra-data", str(more)])
    args = _train_args(tmp_path, verifier, steps=4)
    args[args.index("--lr") + 1] = "1e-3"
    with pytest.raises(SystemExit, match=r"differs in: train\)"):
        mod.main([*args, "--stage", "train"])
    capsys.readouterr()
    assert mod.main([*_train_args(tmp_path, verifier, steps=4), "--stage", "train"]) == 0  # the same run: resumed
    assert "resumed at step 2" in capsys.readouterr().out
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["training"]["steps_done"] == 4


@pytest.mark.slow
def test_training_runs_under_torchrun_with_two_processes(tmp_path):
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(root / "scripts" / "training" / "train_drafter_v2.py"),
           *_train_args(tmp_path, tiny_verifier_dir(), steps=20)]
    subprocess.run(cmd, check=True, cwd=root, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["training"]["world_size"] == 2 and manifest["training"]["backend"] == "gloo"


def test_int8_weights_keep_a_drafts_logits_close_and_its_speculation_exact():
    """DFlashModel.int8_weights: every linear and the draft head as per-row int8 (torch's weight-only kernel, bf16
    activations): a draft's logits stay close to fp32's, the drafter still reads its device and dtype off the fp32
    rows, and speculation with it is still token-identical to plain greedy decoding (the verifier decides)."""
    model = load_model(str(tiny_verifier_dir()))
    fp32, q8 = tiny_dflash(model), tiny_dflash(model)
    q8.model.int8_weights()
    assert q8.model.fc.weight.dtype == torch.float32 and q8.model.head_int8 is not None
    feats = torch.randn(20, fp32.config.feature_size, generator=torch.Generator().manual_seed(1))
    a = fp32.draft([5], 4, context_hidden=feats, position=20)
    b = q8.draft([5], 4, context_hidden=feats, position=20)
    rel = (a.hidden - b.hidden).norm() / a.hidden.norm()
    assert 0 < rel < 0.05, rel  # quantized (not the same numbers), close
    engine = Engine(model, KVStrategy("full"), prefill_chunk=8)
    spec = Engine(model, KVStrategy("full"), prefill_chunk=8, drafter=q8, spec_k=4)
    history = prompt(24, seed=3)
    assert generate(spec, history, 16)[0] == generate(engine, history, 16)[0]


def test_load_drafter_weights_auto_is_int8_for_a_v2_drafter_on_the_cpu(tmp_path):
    """What the daemon loads (weights="auto"): a v2 drafter on the CPU with int8 weights; "fp32" as trained; anything
    else, or int8 asked of a v1 drafter, a ValueError naming the problem."""
    model = load_model(str(tiny_verifier_dir()))
    save_drafter(tiny_dflash(model).model, tmp_path / "ck", {"name": "tiny-dflash"})
    kw = dict(verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    auto = load_drafter(str(tmp_path / "ck"), weights="auto", **kw)
    assert getattr(auto.model, "head_int8", None) is not None and type(auto.model.fc).__name__ == "Int8Linear"
    assert getattr(load_drafter(str(tmp_path / "ck"), **kw).model, "head_int8", None) is None  # fp32 by default
    with pytest.raises(ValueError, match="must be fp32, int8 or auto"):
        load_drafter(str(tmp_path / "ck"), weights="int4", **kw)


def test_the_streamed_vocabulary_projection_gives_the_packed_ones_logits():
    """DFlashModel.logits of a draft's few rows as head @ rows^T (stream_head, the default at inference) against rows @
    head^T (the form before, and training's): the same logits up to float summation order, the same argmax."""
    model = load_model(str(tiny_verifier_dir()))
    m = tiny_dflash(model).model
    h = torch.randn(4, m.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        m.stream_head = True
        a = m.logits(h)
        m.stream_head = False
        b = m.logits(h)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_v2_drafts_cost_is_measured_on_features_it_makes_up():
    """verify_costs times a v2 drafter as decoding drives it (random features for the context, one more position a
    draft, its own state) and adds its share of a decode step to every block that drafts."""
    from inference_engine.engine.tuning import verify_costs

    model = load_model(str(tiny_verifier_dir()))
    costs, share = verify_costs(model, 3, timed_steps=2, context=16, drafter=tiny_dflash(model))
    assert share > 0 and all(c >= 1.0 + share for c in costs[1:])
