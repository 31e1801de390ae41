"""Same-model restoration (f_θ = identity): the verifier itself, run causally and without a
cache over the history up to the last evicted position, one layer per `kv_for_layer` call.
Causality makes its K/V at every evicted position the ones `full` would hold. Built from the
backend's public layer pieces (inference_engine/backends/protocol.py), passed in: nothing of the
engine is imported. A RestoreSource of dlm_restore (kakeya_research/dlm_restore/seam.py), and
the verifier's true K/V for f_θ's training data (training/restore_data.py: verifier_kv)."""
from __future__ import annotations

import torch


class VerifierRestoreSource:
    name = "verifier"

    def __init__(self, model):
        self.model = model

    def open_step(self, history: torch.Tensor, evicted: torch.Tensor) -> "VerifierRestoreStep":
        return VerifierRestoreStep(self.model, history, evicted)


class VerifierRestoreStep:
    """The proposer's residual stream over positions 0..last evicted, advanced one layer per call.

    `kv_for_layer(i)` returns the raw (pre-norm, pre-RoPE) K and V of layer i at the evicted
    positions, (Hkv, E, D) each."""

    def __init__(self, model, history: torch.Tensor, evicted: torch.Tensor):
        self.model = model
        n = int(evicted[-1]) + 1
        self.n = n
        self.evicted = evicted.to(model.device)
        self.x = model.embed_ids(history[:n].to(model.device))  # (n, hidden)
        self.rope = model.rope(torch.arange(n, device=model.device))
        self.local_masks = {}  # sliding window -> (n, n) causal band, built once per step
        self.next_layer = 0

    def kv_for_layer(self, layer: int):
        m = self.model
        if self.x is None or layer != self.next_layer:
            raise RuntimeError(f"restore step asked for layer {layer}, expected {self.next_layer} (layers run in order, once)")
        q, k, v = m.project(layer, self.x)
        k_out, v_out = k[:, self.evicted], v[:, self.evicted]
        self.next_layer += 1
        if self.next_layer == m.spec.num_layers:  # nothing reads the last layer's output
            self.close()
            return k_out, v_out
        self.x = causal_layer_output(m, layer, self.x, q, k, v, self.rope, self.local_masks)
        return k_out, v_out

    def close(self) -> None:
        self.x = None
        self.rope = None
        self.local_masks = {}


def causal_layer_output(model, layer: int, x, q, k, v, rope, local_masks: dict | None = None):
    """Finish layer `layer` over a whole sequence attended causally (with the layer's own window):
    raw q, k, v of x -> the next layer's input. local_masks caches the windowed masks by window."""
    q, _ = model.position_q(layer, q, rope)
    k = model.position_k(layer, k, rope)
    w = model.spec.layer_windows[layer]
    mask = None
    if w is not None:
        local_masks = {} if local_masks is None else local_masks
        if w not in local_masks:
            p = torch.arange(x.shape[0], device=x.device)
            local_masks[w] = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - w)  # (n, n)
        mask = local_masks[w]
    return model.finish(layer, x, model.attend(layer, q, k, v, mask))
