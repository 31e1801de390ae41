"""Cross-model K/V restoration (ADR 0008 §11.5-§11.6): the shipped dLM drafter as the proposer and a
learned projection f_θ from its representation to the verifier's pre-norm, pre-RoPE K and V.

Proposer features (cache-free, recomputed at every verifier step): the history is cut into blocks of
`block` tokens aligned at absolute position 0; the drafter encodes each block bidirectionally (no
verifier hidden states: a cache-free proposer cannot have them, so its learned `missing_hidden` is
used). A position's feature is [norm(embed(x_p)), norm(embed(x_{p-1})), drafter_hidden_p]; the
previous token is there explicitly because block starts have no left context in the drafter.

f_θ: a shared SiLU trunk over the features, then one linear head per verifier layer producing that
layer's K and V (Hkv × D each). The trunk runs once per step over the evicted positions; a layer's
head runs just before that layer's attention, so restored K/V are alive one layer at a time (the
trunk activations, E × trunk_dim, are the step's proposer state and are freed at close()).

Shipped with its drafter: `<drafter checkpoint>/restore_ftheta.safetensors` plus a `restore` section in
the drafter's manifest.json (config, training data, per-layer rel-MSE on held-out documents).

Attention-mass calibration (optional, `restore_calibration.safetensors`, `restore.calibration` in the
manifest): f_θ's keys mis-state how much attention the evicted positions draw as a whole; measured
against the true keys, the log-sum-exp of a layer's attention logits over the restored positions is
off by a roughly constant amount per (layer, query head). The calibration is that amount, negated: a
logit bias (num_layers, num_heads) the verifier adds to the restored columns of its attention
(`scripts/training/calibrate_restore.py` measures it on documents disjoint from the ladder).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from kv_cache_proposer.drafter import MANIFEST_FILE, Drafter, resolve_checkpoint
from kv_cache_proposer.model import DrafterModel

FTHETA_FILE = "restore_ftheta.safetensors"
CALIBRATION_FILE = "restore_calibration.safetensors"


@dataclasses.dataclass
class ProjectionConfig:
    feature_dim: int  # 2 * verifier hidden + drafter hidden
    num_layers: int  # verifier layers
    kv_dim: int  # verifier num_kv_heads * head_dim
    num_kv_heads: int
    head_dim: int
    trunk_dim: int = 1024
    trunk_out: int = 512
    block: int = 64  # proposer block length (absolute alignment)
    features: str = "hidden"  # drafter representation: "hidden" (last-layer output) or "kv" (its last layer's K, V)
    verifier: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProjectionConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RestoreProjection(nn.Module):
    """f_θ: proposer features (E, F) -> per verifier layer (K, V), each (Hkv, E, D)."""

    def __init__(self, cfg: ProjectionConfig):
        super().__init__()
        self.cfg = cfg
        self.in_norm = nn.LayerNorm(cfg.feature_dim)
        self.trunk_in = nn.Linear(cfg.feature_dim, cfg.trunk_dim)
        self.trunk_out = nn.Linear(cfg.trunk_dim, cfg.trunk_out)
        self.head_w = nn.Parameter(torch.randn(cfg.num_layers, 2 * cfg.kv_dim, cfg.trunk_out) / cfg.trunk_out ** 0.5)
        self.head_b = nn.Parameter(torch.zeros(cfg.num_layers, 2 * cfg.kv_dim))

    def trunk(self, feats: torch.Tensor) -> torch.Tensor:
        return F.silu(self.trunk_out(F.silu(self.trunk_in(self.in_norm(feats)))))

    def layer_kv(self, z: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk output z (E, trunk_out) -> layer's (K, V), each (Hkv, E, D)."""
        c = self.cfg
        kv = F.linear(z, self.head_w[layer], self.head_b[layer])  # (E, 2 * kv_dim)
        k = kv[:, : c.kv_dim].reshape(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = kv[:, c.kv_dim :].reshape(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return k, v

    def all_layers(self, z: torch.Tensor) -> torch.Tensor:
        """(E, trunk_out) -> (L, E, 2 * kv_dim): every layer at once (training)."""
        return torch.einsum("et,lot->leo", z, self.head_w) + self.head_b[:, None]


def feature_dim(drafter: DrafterModel, features: str) -> int:
    return 2 * drafter.cfg.verifier_hidden_size + (2 if features == "kv" else 1) * drafter.cfg.hidden_size


def proposer_features(drafter: DrafterModel, ids: torch.Tensor, n: int, block: int, features: str = "hidden",
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """Features of positions 0..n-1 of `ids` (1-D, at least n long): (n, feature_dim); or, with
    `positions` (ascending, all < n), of those positions only: (len(positions), feature_dim), encoding
    only the blocks that hold them.

    Blocks are aligned at absolute multiples of `block`, so a position's feature depends only on
    the tokens of its own block (and its previous token), never on where the step starts; the
    history is cut at n (a block holding n - 1 sees nothing after it)."""
    dev = drafter.embed_weight.device
    ids = ids[:n].to(dev).long()
    nb = -(-n // block)
    which = torch.arange(nb, device=dev) if positions is None else torch.unique(positions.to(dev) // block)
    padded = torch.zeros(nb * block, dtype=torch.long, device=dev)
    padded[:n] = ids
    blocks = padded.view(nb, block)[which]
    masked = torch.zeros_like(blocks, dtype=torch.bool)
    pad_mask = None
    if nb * block != n and int(which[-1]) == nb - 1:  # the last block is partial: its padding must not be attended to
        valid = (which[:, None] * block + torch.arange(block, device=dev)[None, :]) < n
        pad_mask = valid[:, None, None, :]
    m = which.numel()
    h, kv = drafter.encode(blocks, masked, pad_mask=pad_mask)  # (m, block, d)
    if features == "kv":  # last layer's K, V: (m, H, block, D) each -> (m, block, 2d)
        k, v = kv[-1]
        h = torch.cat([k.transpose(1, 2).reshape(m, block, -1), v.transpose(1, 2).reshape(m, block, -1)], dim=-1)
    elif features != "hidden":
        raise ValueError(f"unknown proposer features {features!r}; use 'hidden' or 'kv'")
    h = h.reshape(m * block, -1)
    if positions is None:
        pos = torch.arange(n, device=dev)
        h = h[:n]
    else:
        pos = positions.to(dev).long()
        slot = torch.searchsorted(which, pos // block) * block + pos % block  # row of each position in h
        h = h[slot]
    emb = F.embedding(ids[pos], drafter.embed_weight)
    prev = F.embedding(ids[(pos - 1).clamp(min=0)], drafter.embed_weight) * (pos > 0)[:, None].to(emb.dtype)
    norm = drafter.emb_norm
    return torch.cat([norm(emb), norm(prev), h.to(emb.dtype)], dim=-1)


class DrafterRestoreSource:
    """RestoreSource (kakeya_research/dlm_restore/seam.py) backed by a drafter and its f_θ."""

    name = "drafter"

    def __init__(self, drafter: Drafter, projection: RestoreProjection, drafter_name: str = "",
                 logit_bias: torch.Tensor | None = None):
        self.drafter = drafter
        self.projection = projection.eval()
        self.drafter_name = drafter_name
        # (num_layers, num_heads) added to the attention logits of restored positions; None = no calibration
        self.logit_bias = logit_bias

    @torch.inference_mode()
    def open_step(self, history: torch.Tensor, evicted: torch.Tensor) -> "_DrafterRestoreStep":
        n = int(evicted[-1]) + 1
        c = self.projection.cfg
        feats = proposer_features(self.drafter.model, history, n, c.block, c.features, positions=evicted)
        z = self.projection.trunk(feats.to(self.projection.trunk_in.weight.dtype))
        return _DrafterRestoreStep(self.projection, z, self.logit_bias)


class _DrafterRestoreStep:
    def __init__(self, projection: RestoreProjection, z: torch.Tensor, logit_bias: torch.Tensor | None = None):
        self.projection = projection
        self.z = z
        self.next_layer = 0
        self.logit_bias = logit_bias  # read by the verifier's attention (backends/torch/model.py)

    @torch.inference_mode()
    def kv_for_layer(self, layer: int):
        if self.z is None or layer != self.next_layer:
            raise RuntimeError(f"restore step asked for layer {layer}, expected {self.next_layer} (layers run in order, once)")
        k, v = self.projection.layer_kv(self.z, layer)
        self.next_layer += 1
        if self.next_layer == self.projection.cfg.num_layers:
            self.close()
        return k, v

    def close(self) -> None:
        self.z = None


def save_projection(projection: RestoreProjection, drafter_dir: str | pathlib.Path, manifest_section: dict,
                    dtype: torch.dtype = torch.float16) -> pathlib.Path:
    """Write f_θ next to its drafter and record it under `restore` in the drafter's manifest."""
    from safetensors.torch import save_file

    out = pathlib.Path(drafter_dir)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in projection.state_dict().items()}
    save_file(state, str(out / FTHETA_FILE))
    (out / FTHETA_FILE).chmod(0o644)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["restore"] = {"format": "kakeya-restore-ftheta/1", "weights": FTHETA_FILE, "weights_dtype": str(dtype).replace("torch.", ""),
                           "config": projection.cfg.to_dict(),
                           "params": int(sum(v.numel() for v in state.values()))} | manifest_section
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return out / FTHETA_FILE


def load_projection(drafter_name_or_path: str, *, device="cpu", dtype: torch.dtype = torch.float32) -> RestoreProjection:
    from safetensors.torch import load_file

    path = resolve_checkpoint(drafter_name_or_path)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    section = manifest.get("restore")
    if not section or not (path / section.get("weights", FTHETA_FILE)).exists():
        raise FileNotFoundError(
            f"drafter {str(drafter_name_or_path)!r} ships no restoration projection f_θ ({path / FTHETA_FILE}); "
            "train one with scripts/training/train_restore.py or use --restore-from verifier"
        )
    proj = RestoreProjection(ProjectionConfig.from_dict(section["config"]))
    state = {k: v.to(dtype) for k, v in load_file(str(path / section["weights"])).items()}
    proj.load_state_dict(state)
    proj.to(device)
    for p in proj.parameters():
        p.requires_grad_(False)
    return proj


def save_calibration(logit_bias: torch.Tensor, drafter_dir: str | pathlib.Path, manifest_section: dict) -> pathlib.Path:
    """Write the attention-mass calibration (num_layers, num_heads) next to f_θ; record it under
    `restore.calibration` in the drafter's manifest."""
    from safetensors.torch import save_file

    out = pathlib.Path(drafter_dir)
    save_file({"logit_bias": logit_bias.detach().to("cpu", torch.float32).contiguous()}, str(out / CALIBRATION_FILE))
    (out / CALIBRATION_FILE).chmod(0o644)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["restore"]["calibration"] = {"format": "kakeya-restore-calibration/1", "weights": CALIBRATION_FILE,
                                          "shape": list(logit_bias.shape)} | manifest_section
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return out / CALIBRATION_FILE


def load_calibration(drafter_name_or_path: str, *, device="cpu") -> torch.Tensor:
    """The shipped attention-mass calibration of a drafter's f_θ: (num_layers, num_heads) float32."""
    from safetensors.torch import load_file

    path = resolve_checkpoint(drafter_name_or_path)
    section = json.loads((path / MANIFEST_FILE).read_text()).get("restore", {}).get("calibration")
    if not section or not (path / section["weights"]).exists():
        raise FileNotFoundError(
            f"drafter {str(drafter_name_or_path)!r} ships no attention-mass calibration for its f_θ ({path / CALIBRATION_FILE}); "
            "make one with scripts/training/calibrate_restore.py or use --restore-bias none"
        )
    return load_file(str(path / section["weights"]))["logit_bias"].to(device)


def check_compatible(projection: RestoreProjection, *, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int,
                     drafter: Drafter) -> None:
    c = projection.cfg
    want = feature_dim(drafter.model, c.features)
    if (c.num_layers, c.num_kv_heads, c.head_dim, c.feature_dim) != (num_layers, num_kv_heads, head_dim, want) \
            or drafter.config.verifier_hidden_size != hidden:
        raise ValueError(
            f"f_θ was trained for {c.num_layers} layers x {c.num_kv_heads} KV heads x {c.head_dim} dims from {c.feature_dim} "
            f"features, but this verifier has {num_layers} x {num_kv_heads} x {head_dim} and the drafter gives {want}; "
            "use the verifier the drafter was trained for"
        )


def drafter_restore_source_for(name: str, verifier, drafter: Drafter, *, calibrated: bool = False,
                               device: str = "cpu") -> "DrafterRestoreSource":
    """Cross-model restoration for `verifier` (a backend): the drafter `name` plus the f_θ shipped
    with it (and its attention-mass calibration if `calibrated`), checked against the verifier."""
    s = verifier.spec
    proj = load_projection(name, device=device)
    check_compatible(proj, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                     hidden=s.hidden_size, drafter=drafter)
    bias = None
    if calibrated:
        bias = load_calibration(name, device=device)
        if tuple(bias.shape) != (s.num_layers, s.num_heads):
            raise ValueError(f"the calibration of {name!r} is for {tuple(bias.shape)} (layers, heads); "
                             f"this verifier has ({s.num_layers}, {s.num_heads})")
    return DrafterRestoreSource(drafter, proj, name, logit_bias=bias)
