"""Cross-model restoration: drafter features, f_θ, the RestoreSource it plugs into, its checkpoint,
and the differentiable verifier tail its Stage 2 trains through."""
from __future__ import annotations

import gc
import json
import shutil
import weakref

import pytest
import torch
from proposer_factories import tiny_drafter, tiny_verifier

from factories import load_model, load_script, require_smollm2
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine, GenerateParams
from inference_engine.kv.registry import make_strategy
from inference_engine.kv.strategy import KVStrategy
from inference_engine.engine.steps import forward
from kv_cache_proposer import CHECKPOINTS_DIR, save_drafter
from kv_cache_proposer.restore import (
    CALIBRATION_FILE,
    FTHETA_FILE,
    DrafterRestoreSource,
    ProjectionConfig,
    RestoreProjection,
    check_compatible,
    feature_dim,
    load_calibration,
    load_projection,
    proposer_features,
    save_calibration,
    save_projection,
)
from kv_cache_proposer.same_model import VerifierRestoreSource
from kv_cache_proposer.training import restore_data as rd

BLOCK = 8


def verifier():
    path, _ = tiny_verifier()
    return load_model(str(path))


def projection(m, drafter, features="hidden", seed=0):
    s = m.spec
    torch.manual_seed(seed)
    cfg = ProjectionConfig(feature_dim=feature_dim(drafter.model, features), num_layers=s.num_layers,
                           kv_dim=s.num_kv_heads * s.head_dim, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                           trunk_dim=32, trunk_out=16, block=BLOCK, features=features)
    proj = RestoreProjection(cfg)
    with torch.no_grad():
        proj.head_b.normal_(0, 1.0)  # restored K/V far from zero, so using them shows in the logits
    return proj.eval()


def ids(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


@pytest.mark.parametrize("features", ["hidden", "kv"])
def test_features_of_some_positions_equal_the_full_computation(features):
    """positions=...: only their blocks are encoded, and each row equals the all-positions feature."""
    d = tiny_drafter()
    x = ids(5 * BLOCK + 3)
    for n in (x.numel(), 4 * BLOCK, 3 * BLOCK + 5, 1):
        full = proposer_features(d.model, x, n, BLOCK, features)
        for pos in (torch.arange(n), torch.tensor([0, 3, 2 * BLOCK + 1, n - 1]), torch.arange(max(0, n - 7), n), torch.tensor([n - 1])):
            pos = torch.unique(pos[pos < n])
            got = proposer_features(d.model, x, n, BLOCK, features, positions=pos)
            torch.testing.assert_close(got, full[pos], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("features", ["hidden", "kv"])
def test_features_depend_only_on_their_block(features):
    d = tiny_drafter()
    a = ids(3 * BLOCK + 5)
    b = a.clone()
    b[2 * BLOCK + 1:] = (b[2 * BLOCK + 1:] + 7) % 256  # changes only blocks 2 and 3
    fa = proposer_features(d.model, a, a.numel(), BLOCK, features)
    fb = proposer_features(d.model, b, b.numel(), BLOCK, features)
    assert fa.shape == (a.numel(), feature_dim(d.model, features))
    torch.testing.assert_close(fa[: 2 * BLOCK], fb[: 2 * BLOCK], rtol=0, atol=0)
    assert not torch.allclose(fa[2 * BLOCK + 2:], fb[2 * BLOCK + 2:])


def test_partial_last_block_ignores_its_padding():
    d = tiny_drafter()
    x = ids(BLOCK + 3)
    f = proposer_features(d.model, x, x.numel(), BLOCK)
    h_alone, _ = d.model.encode(x[None, BLOCK:], torch.zeros(1, 3, dtype=torch.bool))  # the 3-token block, no padding
    torch.testing.assert_close(f[BLOCK:, -d.model.cfg.hidden_size:], h_alone[0], rtol=1e-5, atol=1e-5)


def greedy(engine, history, n):
    kv = engine.new_session_kv()
    out = [e.token_id for e in engine.generate(kv, list(history), GenerateParams(max_tokens=n)) if isinstance(e, TokenGenerated)]
    return out, kv


def test_cross_model_restore_runs_in_the_engine_and_matters():
    m = verifier()
    d = tiny_drafter()
    proj = projection(m, d)
    source = DrafterRestoreSource(d, proj)
    strategy = make_strategy("dlm_restore", 4, 16, restore_from="drafter")
    history = ids(70, seed=3).tolist()
    got, kv = greedy(Engine(m, strategy, prefill_chunk=16, strategy_resources=source), history, 6)
    assert len(got) == 6
    assert kv.cache.resident_positions == 4 + 16 - 1
    bytes_1 = kv.cache.nbytes
    more, kv2 = greedy(Engine(m, strategy, prefill_chunk=16, strategy_resources=source), history, 12)
    assert more[:6] == got
    assert kv2.cache.nbytes == bytes_1  # restored tensors never stay resident
    # the restored K/V are attended: a different f_θ changes what the verifier computes
    other = DrafterRestoreSource(d, projection(m, d, seed=1))
    e1 = Engine(m, strategy, prefill_chunk=16, strategy_resources=source)
    e2 = Engine(m, strategy, prefill_chunk=16, strategy_resources=other)
    kv_a, kv_b = e1.new_session_kv(), e2.new_session_kv()
    e1.prefill(kv_a, history)
    e2.prefill(kv_b, history)
    assert not torch.allclose(kv_a.last_logits, kv_b.last_logits)


def test_step_runs_layers_in_order_and_frees_its_state():
    m = verifier()
    d = tiny_drafter()
    source = DrafterRestoreSource(d, projection(m, d))
    step = source.open_step(ids(40), torch.arange(4, 30))
    z = weakref.ref(step.z)
    with pytest.raises(RuntimeError, match="expected 0"):
        step.kv_for_layer(1)
    for layer in range(m.spec.num_layers):
        k, v = step.kv_for_layer(layer)
        assert k.shape == v.shape == (m.spec.num_kv_heads, 26, m.spec.head_dim)
    del k, v
    gc.collect()
    assert step.z is None and z() is None  # the trunk activations die with the step


def test_checkpoint_round_trip_and_missing_ftheta(tmp_path):
    m = verifier()
    d = tiny_drafter()
    proj = projection(m, d)
    ckpt = save_drafter(d.model, tmp_path / "tiny-dlm", {"name": "tiny-dlm"})
    with pytest.raises(FileNotFoundError, match="train_restore.py"):
        load_projection(str(ckpt))
    save_projection(proj, ckpt, {"trained_for_drafter": "tiny-dlm"})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["restore"]["weights"] == FTHETA_FILE and manifest["name"] == "tiny-dlm"
    loaded = load_projection(str(ckpt))
    for (name, a), (_, b) in zip(proj.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(b, a.half().float(), rtol=0, atol=0, msg=name)
    s = m.spec
    check_compatible(loaded, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, hidden=s.hidden_size, drafter=d)
    with pytest.raises(ValueError, match="trained for"):
        check_compatible(loaded, num_layers=s.num_layers + 1, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                         hidden=s.hidden_size, drafter=d)


def test_tail_logits_with_true_kv_equal_the_full_forward():
    m = verifier()
    x = ids(40, seed=5)
    kv = rd.verifier_kv(m, x)
    s = m.spec
    prefix = [rd.split_kv(kv[layer, :30], s.num_kv_heads, s.head_dim) for layer in range(s.num_layers)]
    got = rd.tail_logits(m, x, prefix, 30)
    from inference_engine.kv.factory import make_cache

    cache = make_cache(KVStrategy("full"), m.geometry(), max_step=64, max_context=s.max_context)
    ref, _ = forward(m, x, torch.arange(40), cache)
    torch.testing.assert_close(got, ref[30:], rtol=1e-4, atol=1e-4)


def test_stage2_loss_reaches_ftheta():
    m = verifier()
    d = tiny_drafter()
    proj = projection(m, d).train()
    x = ids(40, seed=6)
    s = m.spec
    kv = rd.verifier_kv(m, x)
    f = proposer_features(d.model, x, 30, BLOCK)[4:30]
    pred = proj.all_layers(proj.trunk(f))
    prefix = [rd.split_kv(torch.cat([kv[layer, :4], pred[layer]]), s.num_kv_heads, s.head_dim) for layer in range(s.num_layers)]
    teacher = rd.tail_logits(m, x, [rd.split_kv(kv[layer, :30], s.num_kv_heads, s.head_dim) for layer in range(s.num_layers)], 30)
    student = rd.tail_logits(m, x, prefix, 30)
    loss = torch.nn.functional.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean")
    loss.backward()
    assert proj.head_w.grad is not None and float(proj.head_w.grad.abs().sum()) > 0
    assert proj.trunk_in.weight.grad is not None and float(proj.trunk_in.weight.grad.abs().sum()) > 0


def test_build_engine_needs_a_drafter_for_cross_model(tmp_path):
    from inference_engine.server.app import ConfigError, ServeConfig, build_engine

    m = verifier()
    cfg = ServeConfig(kv_strategy="dlm_restore", sink=4, window=16, research={"restore_from": "drafter"})
    with pytest.raises(ConfigError, match="needs --drafter"):
        build_engine(cfg, m)


def test_restore_bias_is_refused_where_it_does_not_apply():
    from inference_engine.server.app import ConfigError, ServeConfig, build_engine

    m = verifier()
    calibrated = {"restore_bias": "calibrated"}
    for cfg in (ServeConfig(kv_strategy="dlm_restore", sink=4, window=16, research=calibrated),  # same-model
                ServeConfig(kv_strategy="full", research=calibrated)):
        with pytest.raises(ConfigError, match="restore-bias calibrated applies to"):
            build_engine(cfg, m)
    with pytest.raises(ConfigError, match="'none' or 'calibrated'"):
        build_engine(ServeConfig(kv_strategy="full", research={"restore_bias": "on"}), m)


def test_copied_checkpoint_without_calibration_names_the_missing_file(tmp_path):
    src = CHECKPOINTS_DIR / "smollm2-135m-dlm"
    dst = tmp_path / "copy"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(CALIBRATION_FILE))
    with pytest.raises(FileNotFoundError, match="--restore-bias none"):
        load_calibration(str(dst))
    bias = load_calibration(str(src))  # the shipped one: (layers, heads) of SmolLM2-135M
    assert tuple(bias.shape) == (30, 9) and bool(torch.isfinite(bias).all())


@pytest.mark.model
def test_shipped_drafter_restores_through_the_server_config():
    """The shipped SmolLM2 drafter loads with its f_θ via the same path as `--restore-from drafter`."""
    path = require_smollm2()
    if not (CHECKPOINTS_DIR / "smollm2-135m-dlm" / FTHETA_FILE).exists():
        pytest.fail("the shipped drafter has no f_θ")
    from inference_engine.server.app import ServeConfig, build_engine

    m = load_model(str(path))
    cfg = ServeConfig(kv_strategy="dlm_restore", sink=4, window=64, drafter="smollm2-135m-dlm", spec_k=0,
                      research={"restore_from": "drafter"})
    engine = build_engine(cfg, m)
    assert isinstance(engine.strategy_resources, DrafterRestoreSource) and engine.drafter is None
    history = list(range(1000, 1200))
    out, kv = greedy(engine, history, 3)
    assert len(out) == 3 and kv.cache.resident_positions == 4 + 64 - 1


def test_copied_checkpoint_without_ftheta_names_the_missing_file(tmp_path):
    # a copied shipped checkpoint without f_θ reports the missing file by path
    src = CHECKPOINTS_DIR / "smollm2-135m-dlm"
    dst = tmp_path / "copy"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(FTHETA_FILE))
    with pytest.raises(FileNotFoundError, match=str(dst)):
        load_projection(str(dst))


def test_cross_model_server_reports_its_proposer_and_generates():
    import kakeya
    from factories import start_server

    m = verifier()
    d = tiny_drafter()
    source = DrafterRestoreSource(d, projection(m, d), "tiny-dlm")
    cross = start_server(Engine(m, make_strategy("dlm_restore", 4, 16, restore_from="drafter", restore_refresh=3), prefill_chunk=16,
                                strategy_resources=source))
    biased = DrafterRestoreSource(d, projection(m, d), "tiny-dlm", logit_bias=torch.zeros(m.spec.num_layers, m.spec.num_heads))
    pinned = start_server(Engine(m, make_strategy("dlm_restore", 4, 16, restore_from="drafter", restore_pin=5), prefill_chunk=16,
                                 strategy_resources=biased))
    same = start_server(Engine(m, make_strategy("dlm_restore", 4, 16), prefill_chunk=16))
    try:
        for srv, want, refresh, pin, bias in ((cross, "drafter:tiny-dlm", 3, 0, "none"), (pinned, "drafter:tiny-dlm", 1, 5, "calibrated"),
                                              (same, "verifier", 1, 0, "")):
            with kakeya.Client(f"127.0.0.1:{srv.port}") as c:
                p = c.server_info().kv_params  # research knobs are reported as strategy params only
                assert (p.get("restore_from"), p.get("restore_refresh"), p.get("restore_pin"), p.get("restore_bias", "")) == \
                    (want, str(refresh), str(pin), bias)
                with c.create_session(ids(60, seed=9).tolist(), ignore_eos=True) as s:
                    assert len(list(s.generate(max_tokens=4))) == 4
                    assert s.info().kv_live_bytes > 0
    finally:
        cross.stop()
        pinned.stop()
        same.stop()


def _calibrate_module():
    return load_script("scripts/training/calibrate_restore.py")


def test_calibration_measures_no_shift_for_exact_keys_and_the_shift_of_wrong_ones(tmp_path):
    measure_cls = _calibrate_module().Measure
    m = verifier()
    history = ids(60, seed=3).tolist()
    no_bias = torch.zeros(m.spec.num_layers, m.spec.num_heads)
    exact = measure_cls(m, VerifierRestoreSource(m), 4, 16)(history, needle=(20, 24), bias=no_bias)
    assert float(exact["shift"].abs().max()) < 1e-4  # restored keys == true keys: nothing to calibrate
    share = exact["needle_share"]  # true / restored / restored + zero bias: all the same here
    torch.testing.assert_close(share[..., 1], share[..., 0], rtol=1e-4, atol=1e-5)

    class Scaled:  # keys restored 3x too long: every head's logit spread, so its log-sum-exp, grows
        def __init__(self, inner):
            self.inner = inner

        def open_step(self, history, evicted):
            step = self.inner.open_step(history, evicted)

            class Step:
                def kv_for_layer(self, layer):
                    k, v = step.kv_for_layer(layer)
                    return 3 * k, v

                def close(self):
                    step.close()

            return Step()

    wrong = measure_cls(m, Scaled(VerifierRestoreSource(m)), 4, 16)(history)["shift"]
    assert wrong.shape == (m.spec.num_layers, m.spec.num_heads) and float(wrong.mean()) > 0.1
    # shipped next to f_θ and read back
    d = tiny_drafter()
    ckpt = save_drafter(d.model, tmp_path / "tiny-dlm", {"name": "tiny-dlm"})
    save_projection(projection(m, d), ckpt, {"trained_for_drafter": "tiny-dlm"})
    save_calibration(-wrong, ckpt, {"objective": "test"})
    torch.testing.assert_close(load_calibration(str(ckpt)), -wrong.float())
    assert json.loads((ckpt / "manifest.json").read_text())["restore"]["calibration"]["shape"] == list(wrong.shape)
