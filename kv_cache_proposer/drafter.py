"""Block-diffusion drafting with no cache: every `draft` call re-encodes (context ⊕ k mask slots)
with bidirectional attention and unmasks the block by confidence over a few denoising steps.

Contract: `draft(context_ids, k, context_hidden=...) -> DraftResult(ids, probs, kv, hidden)`; the
drafter keeps no state between calls, and its K/V and hidden states are transient outputs.
"""
from __future__ import annotations

import json
import math
import pathlib

import torch

from kv_cache_proposer.draft_result import DrafterInputError, DraftResult  # noqa: F401 (re-exported)
from kv_cache_proposer.model import DrafterConfig, DrafterModel

CHECKPOINTS_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints"
WEIGHTS_FILE = "drafter.safetensors"
MANIFEST_FILE = "manifest.json"
FORMAT_V2 = "kakeya-drafter/2"




class Drafter:
    def __init__(self, model: DrafterModel):
        self.model = model.eval()
        self.config: DrafterConfig = model.cfg

    @property
    def context_window(self) -> int:
        return self.config.context_window

    @property
    def uses_verifier_hidden(self) -> bool:
        return self.config.uses_verifier_hidden

    @torch.inference_mode()
    def draft(
        self,
        context_ids: torch.Tensor,
        k: int,
        *,
        context_hidden: torch.Tensor | None = None,
        steps: int | None = None,
        threshold: float | None = None,
    ) -> DraftResult:
        cfg = self.config
        context_ids = torch.as_tensor(context_ids).reshape(-1).long()
        T = context_ids.numel()
        if T < 1:
            raise DrafterInputError("draft() needs at least one context token; got an empty context_ids")
        if k < 1:
            raise DrafterInputError(f"draft() needs k >= 1 block slots; got k={k}")
        if context_hidden is not None and context_hidden.shape[0] > T:
            raise DrafterInputError(
                f"context_hidden covers {context_hidden.shape[0]} tokens but context_ids has only {T}; "
                "pass the verifier hidden states of the first T_h <= T context tokens"
            )
        if T > cfg.context_window:  # keep the most recent window (and the hidden states that fall inside it)
            cut = T - cfg.context_window
            context_ids = context_ids[cut:]
            if context_hidden is not None:
                context_hidden = context_hidden[cut:]
            T = cfg.context_window
        steps = max(1, min(k, steps if steps is not None else cfg.denoise_steps))
        threshold = cfg.confidence_threshold if threshold is None else float(threshold)
        dev = self.model.embed_weight.device
        dtype = self.model.fuse.weight.dtype

        n = T + k
        ids = torch.zeros(1, n, dtype=torch.long, device=dev)
        ids[0, :T] = context_ids.to(dev)
        masked = torch.zeros(1, n, dtype=torch.bool, device=dev)
        masked[0, T:] = True
        in_hidden = has_hidden = None
        if cfg.uses_verifier_hidden and context_hidden is not None and context_hidden.shape[0] > 0:
            # position i gets the verifier hidden of token i-1 (the one that predicted token i)
            Th = context_hidden.shape[0]
            in_hidden = torch.zeros(1, n, cfg.verifier_hidden_size, dtype=dtype, device=dev)
            in_hidden[0, 1 : Th + 1] = context_hidden.to(dev, dtype)[: n - 1]
            has_hidden = torch.zeros(1, n, dtype=torch.bool, device=dev)
            has_hidden[0, 1 : Th + 1] = True

        out_ids = torch.zeros(k, dtype=torch.long, device=dev)
        out_probs = torch.zeros(k, cfg.vocab_size, dtype=torch.float32, device=dev)
        pending = torch.ones(k, dtype=torch.bool, device=dev)
        step = 0
        while bool(pending.any()):
            h, kv = self.model.encode(ids, masked, in_hidden, has_hidden)  # (1, n, d)
            slots = pending.nonzero().squeeze(1)  # block slots still masked
            # slot j is predicted by position T-1+j (the token before it)
            probs = torch.softmax(self.model.logits(h[0, T - 1 + slots]).float(), dim=-1)  # (m, N draft vocab)
            conf, col = probs.max(dim=-1)
            tok = self.model.draft_vocab[col]
            steps_left = steps - step
            n_min = math.ceil(slots.numel() / steps_left)
            order = torch.argsort(conf, descending=True)
            take = torch.zeros_like(conf, dtype=torch.bool)
            take[order[:n_min]] = True
            take |= conf >= threshold if threshold > 0 else torch.zeros_like(take)
            for idx in take.nonzero().squeeze(1).tolist():
                j = int(slots[idx])
                out_ids[j] = tok[idx]
                out_probs[j, self.model.draft_vocab] = probs[idx]
                pending[j] = False
                ids[0, T + j] = tok[idx]
                masked[0, T + j] = False
            step += 1
        kv_out = [(kk[0], vv[0]) for kk, vv in kv]
        return DraftResult(ids=out_ids, probs=out_probs, kv=kv_out, hidden=h[0], steps_used=step)


def resolve_checkpoint(name_or_path: str | pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(name_or_path).expanduser()
    if (p / MANIFEST_FILE).exists():
        return p
    q = CHECKPOINTS_DIR / str(name_or_path)
    if (q / MANIFEST_FILE).exists():
        return q
    known = sorted(d.name for d in CHECKPOINTS_DIR.glob("*") if (d / MANIFEST_FILE).exists()) if CHECKPOINTS_DIR.exists() else []
    raise FileNotFoundError(
        f"no drafter checkpoint {str(name_or_path)!r}: not a directory with {MANIFEST_FILE} and not a shipped name; "
        f"shipped drafters: {', '.join(known) or 'none'}"
    )


def save_drafter(model: DrafterModel, out_dir: str | pathlib.Path, manifest_extra: dict | None = None,
                 dtype: torch.dtype = torch.float16) -> pathlib.Path:
    """Write the trainable weights (never the shared embedding/head) + manifest.json."""
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu().to(torch.int32)).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    (out / WEIGHTS_FILE).chmod(0o644)  # safetensors writes 0600; the checkpoint ships as package data
    fmt = FORMAT_V2 if hasattr(model.cfg, "capture_layers") else "kakeya-drafter/1"
    manifest = {"format": fmt, "config": model.cfg.to_dict(), "weights": WEIGHTS_FILE,
                "weights_dtype": str(dtype).replace("torch.", ""),
                "trainable_params": int(sum(v.numel() for v in state.values() if v.is_floating_point()))}
    old = out / MANIFEST_FILE
    if old.exists():
        prev = json.loads(old.read_text())
        prev.update(manifest)
        manifest = prev
    manifest.update(manifest_extra or {})
    old.write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def load_drafter(name_or_path: str, *, verifier_embed: torch.Tensor, verifier_lm_head: torch.Tensor,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, weights: str = "fp32"):
    """Load a drafter by shipped name (kv_cache_proposer/checkpoints/<name>/) or directory, sharing the
    verifier's frozen token embedding (V, H) and LM head weight (V, H). The manifest's format picks the
    kind: kakeya-drafter/1 -> Drafter (v1, cache-free), kakeya-drafter/2 -> DFlashDrafter (v2).
    weights: "fp32" (as trained), "int8" (a v2 drafter's linears and head as per-row int8 for inference:
    DFlashModel.int8_weights) or "auto" (int8 for a v2 drafter on the CPU, where it measured faster at the same
    acceptance: docs/drafters.md; fp32 otherwise): what the daemon runs."""
    if weights not in ("fp32", "int8", "auto"):
        raise ValueError(f"drafter weights must be fp32, int8 or auto, got {weights!r}")
    from safetensors.torch import load_file

    path = resolve_checkpoint(name_or_path)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    fmt = manifest.get("format", "kakeya-drafter/1")
    if fmt == FORMAT_V2:  # the DFlash-style drafter conditioned on several verifier layers (dflash_model.py)
        from kv_cache_proposer.dflash_drafter import DFlashDrafter
        from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel

        cfg, make_model, wrap = DFlashConfig.from_dict(manifest["config"]), DFlashModel, DFlashDrafter
    elif fmt == "kakeya-drafter/1":
        cfg, make_model, wrap = DrafterConfig.from_dict(manifest["config"]), DrafterModel, Drafter
    else:
        raise ValueError(f"drafter checkpoint {path} has format {fmt!r}; this runtime reads kakeya-drafter/1 and {FORMAT_V2}")
    model = make_model(cfg, verifier_embed.detach().to(device, dtype), verifier_lm_head.detach().to(device, dtype))
    state = load_file(str(path / manifest.get("weights", WEIGHTS_FILE)))
    state = {k: (v.to(dtype) if v.is_floating_point() else v.long()) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    if weights == "int8" or (weights == "auto" and fmt == FORMAT_V2 and torch.device(device).type == "cpu"):
        if fmt != FORMAT_V2:
            raise ValueError(f"drafter {path}: int8 weights are for v2 (kakeya-drafter/2) drafters; this one is {fmt}")
        model.int8_weights()
    return wrap(model)
