"""Reading an HF checkpoint's weights with safetensors alone, where its config.json says everything (the daemon's start).

transformers' loader costs ~5 s of a 10.5 s daemon start on a 2-core CPU, nearly all of it imports: its config
classes pull `torch.distributed.tensor`, its model classes `torch._dynamo` (scripts/research/daemon_start.py
measures it). The layer pieces (model.py) read nothing of transformers' modules but the weights, the rotary tables
and the activation, so for the configs this module reads completely it gives those three from the checkpoint's own
files; for every other config it returns None and transformers loads the model, as it always did. Which configs:
Llama, Mistral, Qwen2 and Qwen3 with the default RoPE (no scaling), SiLU, every field the spec reads written in
config.json, and the weights in safetensors files holding every tensor the pieces need. transformers stays the
oracle: tests/backends/test_checkpoint.py loads each family both ways and compares the spec, every tensor, the
rotary tables and the logits, bit for bit.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator, Mapping
from types import SimpleNamespace

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# fields the spec (backends/spec.py) reads that config.json must hold for the fast path: transformers' defaults for
# a missing one differ by family and version, so a config without them goes to transformers
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "rms_norm_eps", "hidden_act")


class DefaultRotary:
    """RoPE's cos/sin tables for the default rotary type: inv_freq = 1 / theta^(2i / D), the angles position x
    inv_freq in fp32, duplicated over the two halves (rotate-half), cast to the probe's dtype. The same operations as
    transformers' default rotary embedding for these families, so the same bits (the test compares them)."""

    rope_type = "default"
    attention_scaling = 1.0

    def __init__(self, theta: float, dim: int, device: torch.device | str = "cpu"):
        self.inv_freq = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(device)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def config_namespace(path: pathlib.Path) -> SimpleNamespace | None:
    """config.json as the attributes backends/spec.py reads, or None when this module does not read it completely."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in FAMILIES or any(raw.get(k) is None for k in REQUIRED):
        return None
    if raw["hidden_act"] != "silu" or raw.get("partial_rotary_factor", 1.0) != 1.0 or raw.get("rope_scaling"):
        return None
    rope = raw.get("rope_parameters") or {"rope_type": "default", "rope_theta": raw.get("rope_theta")}
    if not isinstance(rope, dict) or set(rope) - {"rope_type", "rope_theta"} or rope.get("rope_type", "default") != "default" \
            or not isinstance(rope.get("rope_theta"), (int, float)):
        return None
    mt, n = raw["model_type"], raw["num_hidden_layers"]
    if mt == "mistral" and "sliding_window" not in raw:  # transformers' default window for Mistral is not None
        return None
    if mt in ("qwen2", "qwen3") and raw.get("use_sliding_window"):  # its layers' windows follow max_window_layers
        return None
    layer_types = raw.get("layer_types") or ["full_attention"] * n
    if len(layer_types) != n or any(t != "full_attention" for t in layer_types) and mt != "mistral":
        return None
    eos = raw.get("eos_token_id")
    return SimpleNamespace(
        model_type=mt, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=n,
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        max_position_embeddings=raw["max_position_embeddings"], rms_norm_eps=raw["rms_norm_eps"],
        layer_types=layer_types, sliding_window=raw.get("sliding_window"), eos_token_id=eos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), rope_theta=float(rope["rope_theta"]),
    )


def needed_names(cfg: SimpleNamespace) -> list[str]:
    """The tensors the layer pieces read (HF names), lm_head.weight included."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.model_type == "qwen3":
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def unreadable(file: pathlib.Path, e: Exception) -> ValueError:
    return ValueError(f"could not read the weights in {file} ({type(e).__name__}: {e}); pull the model again "
                      "(`kakeya models pull NAME`) or check the file")


class LazyTensors(Mapping):
    """The checkpoint's tensors by HF name, each read from its file (in `dtype`, on `device`) when first asked for and
    kept while this mapping lives: a load whose linears all come from the packed file (packed.py) never reads their
    fp32 weights (SmolLM2 int4: ~420 MB not read). A tied name is the same tensor as the one it is tied to."""

    def __init__(self, files: dict[str, pathlib.Path], aliases: dict[str, str], dtype: torch.dtype,
                 device: str | torch.device):
        self._files, self._aliases, self._dtype, self._device = files, aliases, dtype, device
        self._read: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        name = self._aliases.get(name, name)
        if name not in self._read:
            if name not in self._files:
                raise KeyError(name)
            try:
                with safe_open(str(self._files[name]), framework="pt") as st:
                    self._read[name] = st.get_tensor(name).to(dtype=self._dtype).to(self._device)
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged or truncated file
                raise unreadable(self._files[name], e) from e
        return self._read[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def read_checkpoint(path: str | pathlib.Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(config namespace, LazyTensors {HF name: tensor in `dtype` on `device`}, DefaultRotary, SiLU) with safetensors, or
    None where transformers must load the model (a config or a file layout this module does not read completely).
    A weights file safetensors cannot read raises ValueError naming it (the daemon says so at start)."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    cfg = config_namespace(path)
    if cfg is None:
        return None
    index = path / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all((path / f).is_file() for f in files):
        return None
    where: dict[str, pathlib.Path] = {}  # each tensor's file, from the headers alone
    for f in files:
        try:
            with safe_open(str(path / f), framework="pt") as st:
                where |= dict.fromkeys(st.keys(), path / f)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged or truncated file
            raise unreadable(path / f, e) from e
    aliases = {}
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in where:  # transformers ties the head to the embedding
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    names = needed_names(cfg)
    if any(n not in where and n not in aliases for n in names):
        return None
    biases = [f"model.layers.{i}.self_attn.{n}_proj.bias" for i in range(cfg.num_hidden_layers) for n in "qkv"]
    if any(b in where for b in biases) and not all(b in where for b in biases):
        return None
    names += [b for b in biases if b in where]
    tensors = LazyTensors({n: where[aliases.get(n, n)] for n in names}, aliases, dtype, device)
    return cfg, tensors, DefaultRotary(cfg.rope_theta, cfg.head_dim, device), torch.nn.SiLU()
