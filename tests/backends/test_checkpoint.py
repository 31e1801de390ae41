"""The weights read with safetensors alone (backends/torch/checkpoint.py, `--loader auto`) against transformers'
loader (`--loader transformers`, the oracle): for every family the fast path takes, the same spec, the same tensors,
the same rotary tables and the same logits, bit for bit; every config it does not read completely goes to
transformers; and a daemon start on the default path imports neither transformers nor torch._dynamo."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from factories import ROOT, feed, require_smollm2, tiny_model_dir
from inference_engine.backends.torch.checkpoint import config_namespace, read_checkpoint
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.kv.factory import make_cache
from inference_engine.kv.strategy import KVStrategy


def logits_of(m, tokens, chunk):
    return feed(m, make_cache(KVStrategy(name="full"), m.geometry(), max_step=64, max_context=m.spec.max_context), tokens, chunk)


def both(path, **kw):
    fast = TorchCausalLM.load(path, loader="auto", **kw)
    slow = TorchCausalLM.load(path, loader="transformers", **kw)
    return fast, slow


def rope_tables(m, positions):
    return m.rope(torch.tensor(positions)).tables


def assert_same_tables(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(a[k], b[k]):
            assert x.dtype == y.dtype and torch.equal(x, y), k


def linear_weights(m):
    """Every tensor a layer piece reads, by name (fp32 weights: the dense matrices themselves)."""
    out = {"embed": m.embed, "head": m.lm_head, "norm": m.final_norm_weight}
    for i, L in enumerate(m.layers):
        for name in L.__slots__:
            v = getattr(L, name)
            if v is not None:
                out[f"{i}.{name}"] = v if isinstance(v, torch.Tensor) else v.w
                if getattr(v, "b", None) is not None:
                    out[f"{i}.{name}.bias"] = v.b
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_fast_loader_reads_what_transformers_reads(arch):
    path = tiny_model_dir(arch)
    fast, slow = both(path)
    assert (fast.loader, slow.loader) == ("safetensors", "transformers")
    assert fast.spec == slow.spec and fast.dtype == slow.dtype and fast.device == slow.device
    wf, ws = linear_weights(fast), linear_weights(slow)
    assert wf.keys() == ws.keys()
    if arch == "qwen2":
        assert any(k.endswith(".bias") for k in wf)  # Qwen2's q/k/v biases are read too
    for k in wf:
        assert wf[k].dtype == ws[k].dtype and torch.equal(wf[k], ws[k]), k
    # the rotary tables at positions far past the trained context (paged sessions reach them)
    assert_same_tables(rope_tables(fast, list(range(0, 40000, 7))), rope_tables(slow, list(range(0, 40000, 7))))
    assert torch.equal(fast.rotary.inv_freq, slow.rotary.inv_freq.float())
    assert type(fast.act).__name__ in ("SiLU", "SiLUActivation") and type(slow.act).__name__ in ("SiLU", "SiLUActivation")
    tokens = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(logits_of(fast, tokens, 16), logits_of(slow, tokens, 16))


def test_quantized_weights_are_the_same_through_either_loader():
    path = tiny_model_dir("llama")
    fast, slow = both(path, weights="int8")
    tokens = list(range(3, 40))
    assert torch.equal(logits_of(fast, tokens, 8), logits_of(slow, tokens, 8))


def test_gemma3_goes_through_transformers():
    m = TorchCausalLM.load(tiny_model_dir("gemma3"), loader="auto")
    assert m.loader == "transformers"  # per-layer rope kinds and Gemma's norms: not read by checkpoint.py


def edited(tmp_path, arch, **changes):
    src = tiny_model_dir(arch)
    dst = tmp_path / f"{arch}-edited"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("arch,changes", [
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    ("llama", {"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"hidden_act": "gelu"}),
    ("llama", {"rms_norm_eps": None}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}),
    ("llama", {"model_type": "phi3"}),
])
def test_a_config_it_does_not_read_completely_goes_to_transformers(tmp_path, arch, changes):
    path = edited(tmp_path, arch, **changes)
    assert config_namespace(path) is None and read_checkpoint(path) is None


def test_a_legacy_rope_theta_and_a_missing_file_are_handled(tmp_path):
    path = edited(tmp_path, "llama", rope_parameters=None, rope_theta=5000.0)
    cfg = config_namespace(path)
    assert cfg is not None and cfg.rope_theta == 5000.0
    fast, slow = both(path)
    assert fast.loader == "safetensors"
    assert_same_tables(rope_tables(fast, list(range(0, 9000, 5))), rope_tables(slow, list(range(0, 9000, 5))))
    (path / "model.safetensors").unlink()  # weights in another format: transformers' to read (here: nothing to read)
    assert read_checkpoint(path) is None


def test_a_damaged_weights_file_is_named_in_a_clear_error(tmp_path):
    path = edited(tmp_path, "llama")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="could not read the weights in .*model.safetensors"):
        TorchCausalLM.load(path)


def test_a_load_from_packed_weights_reads_no_linear_from_the_checkpoint(tmp_path, monkeypatch):
    """LazyTensors reads a weight when asked: the second int8 load takes every linear from the packed file, so only
    the embedding (the tied head) and the norms are read from model.safetensors."""
    from inference_engine.backends.torch import checkpoint

    path = edited(tmp_path, "llama")
    first = TorchCausalLM.load(path, weights="int8")
    read: list[str] = []
    get = checkpoint.LazyTensors.__getitem__
    monkeypatch.setattr(checkpoint.LazyTensors, "__getitem__", lambda self, n: read.append(n) or get(self, n))
    second = TorchCausalLM.load(path, weights="int8")
    assert read and not any(n.endswith("_proj.weight") for n in read), read
    tokens = list(range(3, 30))
    assert torch.equal(logits_of(first, tokens, 8), logits_of(second, tokens, 8))


def test_a_tied_head_is_the_embedding():
    path = tiny_model_dir("llama")  # tie_word_embeddings: the file has no lm_head.weight
    _, tensors, _, _ = read_checkpoint(path)
    assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]


def test_smollm2_reads_the_same_through_either_loader():
    path = require_smollm2()
    fast, slow = both(path)
    assert (fast.loader, slow.loader) == ("safetensors", "transformers") and fast.spec == slow.spec
    for name in ("embed", "head", "norm", "0.wqkv", "29.w_down", "17.ln_post_attn"):
        assert torch.equal(linear_weights(fast)[name], linear_weights(slow)[name]), name
    positions = list(range(0, 100000, 11))  # rope_theta 1e5, past the trained 8,192
    assert_same_tables(rope_tables(fast, positions), rope_tables(slow, positions))


def test_a_daemon_start_imports_neither_transformers_nor_dynamo(tmp_path):
    """The start the fast path is for: the model loaded and the engine built as `kakeya serve` does with its defaults
    (a tiny model; int4 and the native step where it builds), then which heavy modules are in the process."""
    path = tiny_model_dir("llama")
    code = (
        "import sys\n"
        "from inference_engine.server.config import ServeConfig\n"
        "from inference_engine.server.app import _load_model, build_engine\n"
        f"cfg = ServeConfig(model={str(path)!r}, persist='off')\n"
        "build_engine(cfg, _load_model(cfg))\n"
        "print(sorted(m for m in ('transformers', 'torch._dynamo', 'torch.distributed.tensor') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
