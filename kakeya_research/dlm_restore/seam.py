"""dLM K/V restoration (ADR 0008 §11.5): the seam between a proposer and the verifier's attention.

At every verifier step of a `dlm_restore` cache, the positions that left the resident
sink+window are restored for that step only. The cache's layout carries a RestorePlan as its
extra keys (inference_engine/kv/layout.py: ExtraKeySource); the forward opens it, which asks a
RestoreSource for one `RestoreStep`, then, layer by layer and just before that layer's attention,
asks the step for the layer's K/V at the evicted positions; the verifier attends over restored ⊕
resident and drops the restored tensors before the next layer, so at most one layer's restored
K/V is alive at a time. The step is closed (its proposer state freed) when the forward ends.

K/V crossing the seam are in the verifier's *pre-norm, pre-RoPE* space: K as the verifier's
k_proj would emit it, V as its v_proj would. The verifier applies its own k_norm and RoPE at
the true positions. So a proposer of another shape plugs in as
    proposer hidden / K/V  --f_θ(layer)-->  verifier-shaped pre-RoPE K, V
and the same-model proposer (the verifier run causally without cache, f_θ = identity)
returns its own projections unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from inference_engine.kv.layout import ExtraKeys


@runtime_checkable
class RestoreStep(Protocol):
    """One verifier step's restoration; `kv_for_layer` is called for layers 0, 1, ... in order."""

    def kv_for_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each (Hkv, E, D): pre-norm, pre-RoPE K and V at the step's evicted positions."""
        ...

    def close(self) -> None:
        """Free everything the step holds; called once, also when the forward fails."""
        ...


@runtime_checkable
class RestoreSource(Protocol):
    """Opens a RestoreStep per verifier step. Holds no per-session state between steps."""

    name: str

    def open_step(self, history: torch.Tensor, evicted: torch.Tensor) -> RestoreStep:
        """history: (n,) token ids of every position before and in this step (the proposer
        may read all of it); evicted: (E,) ascending positions whose K/V the step must restore."""
        ...


@dataclass
class RestorePlan:
    """Evicted positions a dlm_restore step attends to besides the resident keys: the layout's extra keys."""

    history: torch.Tensor  # (n,) token ids of positions 0 .. last position of the step
    positions: torch.Tensor  # (E,) evicted positions, ascending
    masks: dict  # layer window -> (T, E) bool
    source: RestoreSource | None = None  # the cache's proposer; None = the verifier itself (same-model)
    held: HeldRestore | None = None  # to replay instead of running the proposer
    record: HeldRestore | None = None  # keeps what the proposer returns

    def open(self, backend) -> RestoredKeys | None:
        if not self.positions.numel():
            return None
        return RestoredKeys(backend, self.open_step(backend), self.positions, self.masks)

    def open_step(self, backend) -> RestoreStep:
        """The RestoreStep for this plan: a replay of held K/V, or the source's (recorded if asked)."""
        if self.held is not None:
            return self.held.replay()
        source = self.source if self.source is not None else verifier_source(backend)
        step = source.open_step(self.history, self.positions)
        return self.record.recording(step) if self.record is not None else step


def verifier_source(backend) -> RestoreSource:
    """The model as its own proposer (same-model restoration, f_θ = identity): torch backend only."""
    if getattr(backend, "backend_name", "torch") != "torch":
        raise NotImplementedError("dlm_restore runs on the torch backend only; use --backend torch for --kv-strategy dlm_restore")
    from kv_cache_proposer.same_model import VerifierRestoreSource

    return VerifierRestoreSource(backend)


class RestoredKeys:
    """A step's restored K/V as the verifier's attention takes them: positioned (the backend's k_norm and
    RoPE at the evicted positions), the positions no query of the layer may see left out, with the step's
    attention-mass calibration (`logit_bias`, (num_layers, num_heads)) if its proposer ships one."""

    def __init__(self, backend, step: RestoreStep, positions: torch.Tensor, masks: dict):
        self.backend, self.step, self.masks = backend, step, masks
        self.rope = backend.rope(positions)
        self.bias = getattr(step, "logit_bias", None)

    def for_layer(self, layer: int) -> ExtraKeys:
        k, v = self.step.kv_for_layer(layer)  # (Hkv, E, D) raw
        mask = self.masks[self.backend.spec.layer_windows[layer]]
        visible = mask.any(0)
        if not bool(visible.any()):  # a local layer whose window lies inside the resident keys
            return ExtraKeys(k[:, :0], v[:, :0], mask[:, :0])
        rope = self.rope
        if not bool(visible.all()):
            idx = visible.nonzero().flatten()
            k, v, mask, rope = k[:, idx], v[:, idx], mask[:, idx], rope.select(idx)
        return ExtraKeys(self.backend.position_k(layer, k, rope), v, mask,
                         self.bias[layer] if self.bias is not None else None)

    def close(self) -> None:
        self.step.close()


class HeldRestore:
    """Restored K/V kept across steps: the `dlm_restore` refresh option (`restore_refresh` N > 1).

    A refresh step records what its RestoreStep returns for every layer (`recording`); the
    next N - 1 steps replay those tensors (`replay`) instead of running the proposer. The cache
    keeps positions evicted since the refresh resident until the next one, so every position
    stays visible exactly once. The held tensors are live memory: `nbytes` counts them and the
    cache adds them to its `nbytes` / `peak_nbytes`. N = 1 (the default) never holds anything.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def complete(self) -> bool:
        return len(self.layers) == self.num_layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers for t in kv)

    def recording(self, step: RestoreStep) -> RestoreStep:
        """Wrap a fresh step so each layer's K/V are also kept here."""
        return _RecordingStep(self, step)

    def replay(self) -> RestoreStep:
        if not self.complete:
            raise RuntimeError("replaying an incomplete restore recording")
        return _ReplayStep(self)


class _RecordingStep:
    def __init__(self, held: HeldRestore, inner: RestoreStep):
        self.held, self.inner = held, inner

    def kv_for_layer(self, layer: int):
        k, v = self.inner.kv_for_layer(layer)
        if layer != len(self.held.layers):
            raise RuntimeError(f"restore recording got layer {layer}, expected {len(self.held.layers)}")
        self.held.layers.append((k.contiguous(), v.contiguous()))
        return k, v

    def close(self) -> None:
        self.inner.close()


class _ReplayStep:
    def __init__(self, held: HeldRestore):
        self.held, self.next_layer = held, 0

    def kv_for_layer(self, layer: int):
        if layer != self.next_layer:
            raise RuntimeError(f"restore replay asked for layer {layer}, expected {self.next_layer} (layers run in order, once)")
        self.next_layer += 1
        return self.held.layers[layer]

    def close(self) -> None:
        pass
