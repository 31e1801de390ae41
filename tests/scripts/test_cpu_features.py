"""scripts/training/cpu_features.py, the v2 drafter's CPU data stage, end to end on a tiny int4 verifier with a
tiny corpus: the chunks have dflash_data's keys, shapes and dtypes; their features, final hidden and argmax are
what a direct engine forward with StepInput.capture gives for the same ids; a rerun resumes (present chunks
untouched, a missing one rebuilt bit for bit); and the v2 trainer's loader and anchor sampler take them as they are."""
import hashlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from factories import main_in_process, tiny_model_dir
from kv_cache_proposer.dflash_model import DFlashConfig
from kv_cache_proposer.training import dflash_data
from kv_cache_proposer.training.dflash_trainer import AnchorSampler

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "training" / "cpu_features.py"
LAYERS = (2, 0)  # not in layer order: the chunk keeps the order asked for
H = 64  # the tiny verifier's hidden size


def tiny_dir():
    return tiny_model_dir("llama", num_hidden_layers=3)


def run(out, *extra):
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_dir()), "--weights", "int4", "--layers", ",".join(map(str, LAYERS)),
           "--out", str(out), "--seq-len", "48", "--max-tokens", "2500", "--threads", "1", "--corpus-files", "30",
           "--corpus-seconds", "3", "--man-pages", "0", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def sha(p: pathlib.Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu_features")
    run(out)
    return out


def test_chunks_have_the_trainers_format_and_the_engines_features(built):
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import StepInput, forward_batch
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    spec = json.loads((built / "jobs.json").read_text())
    assert spec["layers"] == list(LAYERS) and spec["max_new"] == 0
    jobs = spec["jobs"]
    assert sum(len(j["ids"]) for j in jobs) == 2500 and all(2 <= len(j["ids"]) <= 48 for j in jobs)
    parts = sorted(built.glob("part-*.safetensors"))
    assert [p.name for p in parts] == [dflash_data.chunk_path(built, c).name for c in range(len(dflash_data.chunk_jobs(jobs)))]
    man = json.loads((built / "manifest.json").read_text())
    assert man["planned"]["tokens"] == 2500 and man["sources"]["per_source"]["stdlib"]["files"] > 0
    assert man["engine"]["weights"] == "int4"

    model = TorchCausalLM.load(tiny_dir(), weights="int4")
    model.use_native_step()  # the script's --step auto: the native step where it builds (its captured layers)
    checked = 0
    for c, items in enumerate(dflash_data.chunk_jobs(jobs)):
        d = load_file(str(parts[c]))
        seqs = [j["ids"] for j in items]
        n = sum(map(len, seqs))
        assert set(d) == {"tokens", "feats", "final", "argmax", "seq_offsets", "gen_start", "style"}
        assert d["tokens"].dtype == torch.int32 and d["tokens"].tolist() == [t for s in seqs for t in s]
        assert d["feats"].dtype == torch.float16 and d["feats"].shape == (n, len(LAYERS) * H)
        assert d["final"].dtype == torch.float16 and d["final"].shape == (n, H)
        assert d["argmax"].dtype == torch.int32 and d["argmax"].shape == (n,)
        offs = d["seq_offsets"].tolist()
        assert d["seq_offsets"].dtype == torch.int64 and offs[0] == 0 and [b - a for a, b in zip(offs, offs[1:])] == list(map(len, seqs))
        assert d["gen_start"].tolist() == list(map(len, seqs))  # nothing generated: every token is corpus text
        assert d["style"].tolist() == [dflash_data.STYLES[j["kind"]] for j in items]
        for s in (0, len(seqs) - 1):  # the first and last sequence of each chunk against a direct engine forward
            ids = seqs[s]
            cache = make_cache(KVStrategy("full"), model.geometry(), max_step=len(ids), max_context=model.spec.max_context)
            inp = StepInput(torch.tensor(ids), range(len(ids)), cache, "all", capture=LAYERS, greedy=True)
            logits, hidden = forward_batch(model, [inp])[0]
            cache.abort()
            a, b = offs[s], offs[s + 1]
            torch.testing.assert_close(d["feats"][a:b].float(), inp.captured.half().float(), rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(d["final"][a:b].float(), hidden.half().float(), rtol=1e-3, atol=1e-3)
            assert d["argmax"][a:b].tolist() == logits.argmax(-1).tolist()
            # layer order: the first H columns are layer 2's output, not layer 0's
            assert not torch.allclose(d["feats"][a:b, :H].float(), d["feats"][a:b, H:].float(), atol=1e-2)
            checked += 1
    assert checked == 2 * len(parts) and len(parts) >= 2
    prog = json.loads((built / "progress.json").read_text())
    assert prog["tokens_present"] == 2500 and prog["chunks_present"] == len(parts)
    assert prog["runs"][0]["tokens"] == 2500 and prog["runs"][0]["tokens_per_s"] > 0
    assert prog["bytes_per_token"] == pytest.approx(sum(p.stat().st_size for p in parts) / 2500, abs=0.1)
    assert prog["bytes_per_token"] > len(LAYERS) * H * 2 + H * 2 + 8  # fp16 features + final + tokens + argmax (+ headers)


def test_trainer_loads_the_chunks_unchanged(built):
    data = dflash_data.load_chunks(sorted(built.glob("part-*.safetensors")))
    assert data["tokens"].numel() == 2500 and data["feats"].shape == (2500, len(LAYERS) * H)
    cfg = DFlashConfig(vocab_size=256, verifier_hidden_size=H, capture_layers=LAYERS, hidden_size=32, num_layers=1, num_heads=4,
                       num_kv_heads=2, intermediate_size=64, draft_vocab_size=64, context_window=8, block_size=5)
    sampler = AnchorSampler(data, cfg, torch.Generator().manual_seed(0))
    toks, am, offs = data["tokens"].long(), data["argmax"].long(), data["seq_offsets"].tolist()
    # an anchor: a position past its sequence's first whose argmax is the text's next token (slot 1 is supervised)
    want = sum(int((am[lo + 1 : hi - 1] == toks[lo + 2 : hi]).sum()) for lo, hi in zip(offs, offs[1:]))
    assert sampler.n_anchors == want
    if want:
        b = sampler.batch(2, 3)
        assert b["feats"].shape[0] == 2 and b["feats"].shape[2] == len(LAYERS) * H and b["tgt"].shape == (2, 3, 4)


def test_a_rerun_resumes(built, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for p in built.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    parts = sorted(out.glob("part-*.safetensors"))
    before = {p.name: sha(p) for p in parts}
    parts[-1].unlink()
    r = run(out, "--corpus-files", "1")  # the plan comes from jobs.json, not from a new corpus
    assert "resuming" in r.stdout
    assert {p.name: sha(p) for p in sorted(out.glob("part-*.safetensors"))} == before  # rebuilt bit for bit, the rest kept
    prog = json.loads((out / "progress.json").read_text())
    assert len(prog["runs"]) == 2 and prog["runs"][1]["chunks"] == 1 and prog["tokens_present"] == 2500


def test_generate_continues_each_prompt_as_the_engine_decodes(tmp_path):
    """--generate: each sequence is its planned prompt, then the engine's own greedy continuation (what
    Engine.generate emits for that prompt), every row's features those of a direct forward over the whole sequence
    (up to the float rounding that separates decode rows from a prefill), argmax at each generated position the next
    token; and a teacher-forcing plan is not resumed as a generating one."""
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams
    from inference_engine.engine.steps import StepInput, forward_batch
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    out = tmp_path / "gen"
    r = run(out, "--generate", "12", "--gen-batch", "5", "--max-tokens", "1200")
    spec = json.loads((out / "jobs.json").read_text())
    assert spec["max_new"] == 12 and all(2 <= len(j["ids"]) <= 48 - 12 for j in spec["jobs"])
    assert "generated" in r.stdout
    model = TorchCausalLM.load(tiny_dir(), weights="int4")
    model.use_native_step()
    engine = Engine(model, KVStrategy("full"), prefill_chunk=256)
    eos = set(model.spec.eos_token_ids)
    checked = generated = 0
    for c, items in enumerate(dflash_data.chunk_jobs(spec["jobs"])):
        d = load_file(str(dflash_data.chunk_path(out, c)))
        offs = d["seq_offsets"].tolist()
        for s, job in enumerate(items):
            a, b = offs[s], offs[s + 1]
            ids, start = d["tokens"][a:b].tolist(), int(d["gen_start"][s])
            assert start == len(job["ids"]) and ids[:start] == job["ids"]
            cont = ids[start:]
            assert 1 <= len(cont) <= 12 and (len(cont) == 12 or cont[-1] in eos)
            assert d["argmax"][a + start - 1 : b - 1].tolist() == cont  # each generated token is the argmax before it
            generated += len(cont)
            if s not in (0, len(items) - 1):
                continue
            want = [e.token_id for e in engine.generate(engine.new_session_kv(), job["ids"], GenerateParams(max_tokens=12))
                    if isinstance(e, TokenGenerated)]
            assert cont == want
            cache = make_cache(KVStrategy("full"), model.geometry(), max_step=len(ids), max_context=model.spec.max_context)
            inp = StepInput(torch.tensor(ids), range(len(ids)), cache, "all", capture=LAYERS, greedy=True)
            logits, hidden = forward_batch(model, [inp])[0]
            cache.abort()
            torch.testing.assert_close(d["feats"][a:b].float(), inp.captured.half().float(), rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(d["final"][a:b].float(), hidden.half().float(), rtol=2e-3, atol=2e-3)
            checked += 1
    assert checked >= 2 and generated == json.loads((out / "progress.json").read_text())["runs"][0]["generated"]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_dir()), "--layers", "2,0", "--out", str(out),
                          "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert bad.returncode != 0 and "--generate 12, not 0" in bad.stderr + bad.stdout


def test_supervised_slots_count_agreement_runs_up_to_a_block():
    from importlib import util

    spec = util.spec_from_file_location("cpu_features", SCRIPT)
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ok = torch.tensor([True, True, True, True, True, False, True, True, False])
    # runs from each position: 5 4 3 2 1 0 2 1 0 -> capped at 4: 4 4 3 2 1 0 2 1 0
    assert mod.supervised_slots(ok) == 17 and mod.supervised_slots(ok, block=2) == 2 + 2 + 2 + 2 + 1 + 0 + 2 + 1


def test_merged_rates_weigh_generated_data_against_teacher_forcing(tmp_path, monkeypatch):
    """--merge-rates reads JSON only: run in this process."""
    def part(name, gen, tok_s, slots_s):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({
            "config": {"step": "auto", "generate": gen}, "commit": "abc", "machine": {"cpu": "test cpu"},
            "tokens_per_s": tok_s, "tokens_per_cpu_second": tok_s / 2, "step": "native",
            "run": {"tokens": 1000, "generated": 400 if gen else 0, "load_average_start_end": [[0, 0, 0], [0, 0, 0]]},
            "projection_4M_tokens": {"hours": 1.0}, "bytes_per_token_on_disk": 6920.0,
            "supervised_slots_per_s": slots_s, "supervised_slots_per_token": slots_s / tok_s}))
        return str(p)

    out = tmp_path / "merged.json"
    assert main_in_process(str(SCRIPT.relative_to(ROOT)), ["--merge-rates", part("tf", 0, 340.0, 318.0),
                                                           part("gen", 64, 290.0, 600.0), "--rate-json", out], monkeypatch) == 0
    d = json.loads(out.read_text())
    assert set(d["runs"]) == {"auto", "auto/generate64"} and d["runs"]["auto/generate64"]["generated"] == 400
    assert d["supervised_slots_per_s_vs_teacher_forcing"] == {"auto": 1.0, "auto/generate64": round(600 / 318, 3)}
