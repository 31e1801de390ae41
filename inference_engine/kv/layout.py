"""What one forward step needs from a resident cache: where the new tokens go and who sees whom.

The cache builds these from host-side bookkeeping (numpy / Python ints); the tensors here are
the only things the device sees per step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from inference_engine.backends.protocol import Backend


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple  # per layer: model sliding window or None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # The backend's store constructor (same signature as stores.make_store); None = torch's.
    # The MLX backend passes its own, so every cache strategy runs unchanged over MLX arrays.
    make_store: Callable[..., Any] | None = None


@dataclass(frozen=True)
class SinkShift:
    from_position: int  # queries at or past this position use the virtual query position for sink keys
    sink: int  # keys at positions < sink are the sink
    virtual_query_position: int


@dataclass
class ExtraKeys:
    """Keys one layer of a step attends to besides those the cache returns, prepended to them:
    k positioned (Hkv, E, D), v (Hkv, E, D), mask (T, E) bool (True = attend), logit_bias None or
    (H,): an offset added to each query head's attention logits on these E columns."""

    k: Any
    v: Any
    mask: Any
    logit_bias: Any = None


class ExtraKeyStep(Protocol):
    """One forward's extra keys, layer by layer."""

    def for_layer(self, layer: int) -> ExtraKeys:
        """Layer `layer`'s extra keys (maybe none of its E columns visible); asked for layers 0, 1, ... in order, once each."""
        ...

    def close(self) -> None:
        """Free what the step holds; called once when the forward ends, also when it fails."""
        ...


class ExtraKeySource(Protocol):
    """A cache's extra keys for one step (AttentionLayout.extra_keys): keys the strategy supplies itself
    (e.g. positions it recomputes) rather than reads from its store. The forward opens it once with the
    backend, before layer 0."""

    def open(self, backend: Backend) -> ExtraKeyStep | None:
        """The step's extra keys, or None: none this step."""
        ...


@dataclass
class AttentionLayout:
    positions: torch.Tensor  # (T,) positions of the new tokens
    first_position: int
    slots: torch.Tensor  # (T,) cache slots they are written to
    key_positions: torch.Tensor  # (N,) position of each key update_and_fetch returns, -1 = empty
    masks: dict  # layer window (int | None) -> (T, N) bool, True = attend
    # Past the trained context, sink keys are scored as if the query stood at a fixed
    # virtual position (see SinkWindowCache); None = never.
    sink_shift: SinkShift | None = None
    key_slots: torch.Tensor | None = None  # (N,) slots the keys come from; None = slots 0..N-1
    # Keys the step attends to besides the cache's (a strategy's own, e.g. positions it recomputes); None = none.
    # A step with extra keys attends batched: its rows are not row-exact.
    extra_keys: ExtraKeySource | None = None
    # Host copies of `masks`: the per-row key selection of a row-exact step is built from them
    # without a device sync.
    host_masks: dict | None = None
    # Row-exact step (decode, speculative verify): each query row attends alone over exactly the
    # keys a one-token step at its position would see, so a verified block's rows are bit-equal
    # to sequential decode steps (see backends/torch/attention.py). Set by engine.steps.forward.
    row_exact: bool = False
    whole_rows: bool = False  # the store reads whole slabs: every row reads all N columns, masked
    host_slots: np.ndarray | None = None  # host copy of `slots` (a backend's fused step writes there itself)
    # A paged step a backend's fused row step may take whole (kv/paged.py `recall_hook`): its tables and rows as the
    # backend's recall reads them; None = none (a step that recalls nothing, or one the kv layer attends itself).
    recall: dict | None = None
    _row_keys: dict = field(default_factory=dict, repr=False)

    @property
    def last_position(self) -> int:
        return self.first_position + self.positions.numel() - 1

    def row_keys(self, window: int | None) -> list[int | torch.Tensor]:
        """Per query row, the key columns it attends to in a row-exact step: an int c (the prefix
        0..c-1, masked columns inside it included; for prefix-addressed stores, whose column of a
        position does not depend on the step) or a (n,) index of exactly its visible columns."""
        if window not in self._row_keys:
            if self.host_masks is None:
                raise ValueError("row_keys() needs host_masks (engine.steps.forward sets them for a row-exact step)")
            m = self.host_masks[window]
            if self.whole_rows:
                keys = [m.shape[1]] * m.shape[0]
            elif self.key_slots is None:
                last = m.shape[1] - np.argmax(m[:, ::-1], 1)
                keys = [int(c) if m[j].any() else 0 for j, c in enumerate(last)]
            else:
                dev = self.positions.device
                keys = [torch.from_numpy(np.flatnonzero(r)).to(dev) for r in m]
            self._row_keys[window] = keys
        return self._row_keys[window]

    @property
    def sink_shift_active(self) -> bool:
        return self.sink_shift is not None and self.last_position >= self.sink_shift.from_position
