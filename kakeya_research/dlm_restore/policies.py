"""Research policies of the dlm_restore cache: which evicted positions are restored when.

  RestoreEveryStep   every evicted position is restored at every step (the strategy itself)
  PinWorstRestored   P evicted positions the proposer restores worst stay resident (cross-model)
  HoldRestored       restored K/V are reused for up to N steps (the refresh option)

A policy is consulted by DLMRestoreCache at fixed points (prepare, eviction, commit) and
carries its own persistent state."""
from __future__ import annotations

import numpy as np
import torch

from kakeya_research.dlm_restore.seam import HeldRestore

_NO_POSITIONS = np.zeros(0, dtype=np.int64)


class RestoreEveryStep:
    name = "every_step"
    extra_resident = 0

    def cover_upto(self, cache) -> int:
        """Resident positions in [sink, cover_upto] are served restored this step."""
        return cache.next_position - cache.window

    def pinned(self) -> np.ndarray:
        return _NO_POSITIONS

    def held_and_record(self, cache, has_evicted: bool):
        return None, None

    def evict(self, cache) -> int:
        return cache._evict_through(cache.next_position - cache.window)

    def on_commit(self, cache, layout, n_keep: int) -> None:
        pass

    def on_abort(self) -> None:
        pass

    def settle_capacity(self, cache) -> int:
        return cache.base_capacity

    @property
    def nbytes(self) -> int:
        return 0

    def state(self) -> tuple[dict, dict]:
        return {}, {}

    def load_state(self, tensors: dict, meta: dict) -> None:
        pass


class PinWorstRestored(RestoreEveryStep):
    """As positions leave the window, the proposer restores them once and its V error against the
    resident rows is measured; the P worst-restored evicted positions so far stay resident
    ("pinned", attended exactly). Resident memory is sink + window + P rows, flat in the history."""

    name = "pin_worst"

    def __init__(self, pins: int, num_layers: int):
        self.extra_resident = pins
        self._pin_pos = _NO_POSITIONS
        self._pin_err = np.zeros(0, dtype=np.float32)
        self._v_energy = np.zeros(num_layers, dtype=np.float64)  # per layer: sum |v|^2, for the error scale
        self._v_rows = 0

    def pinned(self) -> np.ndarray:
        return self._pin_pos

    def evict(self, cache) -> int:
        upto = cache.next_position - cache.window
        pos = cache.store.pos
        slots = np.flatnonzero((pos >= cache.sink) & (pos <= upto) & ~np.isin(pos, self._pin_pos))
        if not slots.size:
            return 0
        slots = slots[np.argsort(pos[slots], kind="stable")]
        positions = pos[slots]
        err = self._restoration_error(cache, positions, slots)
        all_pos, all_err = np.concatenate([self._pin_pos, positions]), np.concatenate([self._pin_err, err])
        keep = torch.topk(torch.from_numpy(all_err), min(self.extra_resident, all_err.size)).indices.numpy()
        self._pin_pos, self._pin_err = all_pos[keep], all_err[keep]
        return cache._evict_through(upto, keep=self._pin_pos)

    def _restoration_error(self, cache, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Per position: sum over layers of |V_restored - V_resident|^2 / (the layer's mean |V|^2 per row).
        V crosses the restore seam exactly as the cache stores it (no norm or RoPE), so the store's
        rows are the reference; K would need the backend's RoPE."""
        if cache.restore_source is None:
            raise ValueError("restore_pin needs the cache's restore_source (the learned proposer)")
        n = int(positions[-1]) + 1
        step = cache.restore_source.open_step(cache.token_history(n), torch.from_numpy(positions))
        err = torch.zeros(positions.size, dtype=torch.float64)
        self._v_rows += positions.size
        slots_t = cache.store.slots_tensor(slots)
        try:
            for layer in range(cache.geometry.num_layers):
                _, v_hat = step.kv_for_layer(layer)
                _, v = cache.store.read(layer, slots_t)
                v = v.double()
                self._v_energy[layer] += float(v.pow(2).sum())
                scale = float(self._v_energy[layer]) / self._v_rows
                err += (v_hat.double().cpu() - v.cpu()).pow(2).sum((0, 2)) / max(scale, 1e-30)
        finally:
            step.close()
        return err.to(torch.float32).numpy()

    def state(self) -> tuple[dict, dict]:
        return ({"pin.positions": torch.from_numpy(self._pin_pos.copy()), "pin.errors": torch.from_numpy(self._pin_err.copy()),
                 "pin.v_energy": torch.from_numpy(self._v_energy.copy())}, {"pin.v_rows": self._v_rows})

    def load_state(self, tensors: dict, meta: dict) -> None:
        self._pin_pos = tensors["pin.positions"].numpy().astype(np.int64)
        self._pin_err = tensors["pin.errors"].numpy().astype(np.float32)
        self._v_energy = tensors["pin.v_energy"].numpy().astype(np.float64)
        self._v_rows = int(meta["pin.v_rows"])


class HoldRestored(RestoreEveryStep):
    """A refresh step records what its RestoreStep returns for every layer; the next N - 1 steps
    replay those tensors instead of running the proposer. Positions evicted since the refresh
    stay resident until the next one, so every position stays visible exactly once. The held
    tensors are live memory, counted in the cache's `nbytes`."""

    name = "hold"

    def __init__(self, refresh: int, num_layers: int, sink: int):
        self.refresh = refresh
        self.num_layers = num_layers
        self.held: HeldRestore | None = None
        self.held_upto = sink - 1  # restored K/V of [sink, held_upto] are held
        self.uses = 0
        self._recording: HeldRestore | None = None

    def _refreshing(self) -> bool:
        return self.held is None or self.uses >= self.refresh

    def cover_upto(self, cache) -> int:
        return cache.next_position - cache.window if self._refreshing() else self.held_upto

    def held_and_record(self, cache, has_evicted: bool):
        if not has_evicted:
            return None, None
        if self._refreshing():
            self._recording = HeldRestore(self.num_layers)
            return None, self._recording
        return self.held, None

    def evict(self, cache) -> int:
        # Only positions the held set covers may leave the resident store.
        return cache._evict_through(min(cache.next_position - cache.window, self.held_upto))

    def on_commit(self, cache, layout, n_keep: int) -> None:
        rec, self._recording = self._recording, None
        if layout.extra_keys is None:
            return
        if rec is not None and rec.complete and n_keep == layout.slots.numel():
            # A rolled-back step may have shown the proposer tokens that are gone: not adopted.
            # The old set and the new recording were both alive during the step.
            cache._peak_nbytes = max(cache._peak_nbytes, cache.nbytes + rec.nbytes)
            self.held, self.held_upto, self.uses = rec, cache._cover_upto, 1
        elif layout.extra_keys.held is not None:
            self.uses += 1

    def on_abort(self) -> None:
        self._recording = None

    def settle_capacity(self, cache) -> int:
        # Positions kept for the refresh option can outnumber sink + window: keep room for them.
        return max(cache.base_capacity, cache.resident_positions + min(cache.max_step, cache.STEP_ROOM))

    @property
    def nbytes(self) -> int:
        return self.held.nbytes if self.held is not None else 0

    def state(self) -> tuple[dict, dict]:
        tensors = {}
        if self.held is not None:
            for i, (k, v) in enumerate(self.held.layers):
                tensors[f"hold.k.{i}"], tensors[f"hold.v.{i}"] = k.cpu(), v.cpu()
        return tensors, {"hold.upto": self.held_upto, "hold.uses": self.uses, "hold.present": self.held is not None}

    def load_state(self, tensors: dict, meta: dict) -> None:
        self.held_upto, self.uses = int(meta["hold.upto"]), int(meta["hold.uses"])
        self.held = None
        if meta["hold.present"]:
            self.held = HeldRestore(self.num_layers)
            self.held.layers = [(tensors[f"hold.k.{i}"], tensors[f"hold.v.{i}"]) for i in range(self.num_layers)]


def make_policy(strategy, num_layers: int):
    if strategy.restore_pin:
        return PinWorstRestored(strategy.restore_pin, num_layers)
    if strategy.restore_refresh > 1:
        return HoldRestored(strategy.restore_refresh, num_layers, strategy.sink)
    return RestoreEveryStep()
