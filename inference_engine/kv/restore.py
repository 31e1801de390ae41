"""dLM K/V restoration (ADR 0008 §11.5): the seam between a proposer and the verifier's attention.

At every verifier step of a `dlm_restore` cache, the positions that left the resident
sink+window are restored for that step only. The verifier's forward asks a RestoreSource for
one `RestoreStep`, then, layer by layer and just before that layer's attention, asks the step
for the layer's K/V at the evicted positions; the verifier attends over resident ⊕ restored
and drops the restored tensors before the next layer, so at most one layer's restored K/V is
alive at a time. The step is closed (its proposer state freed) when the forward ends.

K/V crossing the seam are in the verifier's *pre-norm, pre-RoPE* space: K as the verifier's
k_proj would emit it, V as its v_proj would. The verifier applies its own k_norm and RoPE at
the true positions. So a proposer of another shape plugs in as
    proposer hidden / K/V  --f_θ(layer)-->  verifier-shaped pre-RoPE K, V
and the same-model proposer (the verifier run causally without cache, f_θ = identity)
returns its own projections unchanged.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


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
