"""Attention of one layer over what a resident cache returned for a step's layout (MLX).

The cache builds its layout on the host (numpy bookkeeping, CPU torch tensors); `StepLayout`
turns the parts attention reads into MLX arrays once per step, not once per layer. Row-exact
steps (decode, speculative verify) attend row by row over the key columns a one-token step at
that position reads (layout.row_keys), as backends/torch/attention.py does; MLX's CPU linears
are row-independent, so a verified block then equals sequential decode steps bit for bit.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np


class StepLayout:
    """A cache layout's masks, positions and row keys as MLX / numpy arrays."""

    def __init__(self, layout):
        self.source = layout
        self.masks = {w: mx.array(_host(m)) for w, m in layout.masks.items()}  # (T, N) bool, True = attend
        self.positions = _host(layout.positions)
        self.key_positions = _host(layout.key_positions)
        self.shift = layout.sink_shift if layout.sink_shift_active else None
        self.row_exact = bool(getattr(layout, "row_exact", False))
        self._rows: dict = {}

    def shifted(self, qpos: np.ndarray, kpos: np.ndarray) -> mx.array:
        """(T, N) bool: sink keys a query past the trained context scores from the virtual position."""
        s = self.shift
        return mx.array((qpos[:, None] >= s.from_position) & (kpos[None, :] >= 0) & (kpos[None, :] < s.sink))

    def row_keys(self, window) -> list:
        """layout.row_keys(window) with index rows as (mx index, numpy index)."""
        if window not in self._rows:
            self._rows[window] = [c if isinstance(c, int) else (mx.array(_host(c).astype(np.int32)), _host(c))
                                  for c in self.source.row_keys(window)]
        return self._rows[window]


def _host(t) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()


def attend_layout(model, layer: int, q, q_normed, k_all, v_all, step: StepLayout, extra=None, sink_rope=None) -> mx.array:
    """q (H, T, D) over k_all, v_all (Hkv, N, D) with the layout's mask for this layer's window."""
    s = model.spec
    if extra is not None:
        raise NotImplementedError("a layout's extra keys (kv/layout.py ExtraKeys) are attended on the torch backend only")
    w = s.layer_windows[layer]
    mask = step.masks[w]
    if step.row_exact:
        return _attend_rows(model, layer, q, q_normed, k_all, v_all, step, w, sink_rope)
    if sink_rope is not None and w is None and step.shift is not None:
        shifted = step.shifted(step.positions, step.key_positions)
        return _attend_with_sink_shift(model, layer, q, q_normed, k_all, v_all, mask, shifted, sink_rope)
    return mx.fast.scaled_dot_product_attention(q[None], k_all[None], v_all[None], scale=s.attn_scale, mask=mask)[0]


def _attend_rows(model, layer, q, q_normed, k_all, v_all, step: StepLayout, w, sink_rope):
    s = model.spec
    mask, out = step.masks[w], []
    for j, keys in enumerate(step.row_keys(w)):
        if isinstance(keys, int):
            k, v, m, kp = k_all[:, :keys], v_all[:, :keys], mask[j:j + 1, :keys], step.key_positions[:keys]
        else:
            idx, host_idx = keys
            k, v, m, kp = k_all[:, idx], v_all[:, idx], mask[j:j + 1][:, idx], step.key_positions[host_idx]
        qj = q[:, j:j + 1]  # (H, 1, D)
        qpos = step.positions[j:j + 1]
        if sink_rope is not None and w is None and step.shift is not None and qpos[0] >= step.shift.from_position:
            out.append(_attend_with_sink_shift(model, layer, qj, q_normed[:, j:j + 1], k, v, m, step.shifted(qpos, kp),
                                               sink_rope.select(slice(j, j + 1))))
        else:
            out.append(mx.fast.scaled_dot_product_attention(qj[None], k[None], v[None], scale=s.attn_scale, mask=m)[0])
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=1)


def _attend_with_sink_shift(model, layer, q, q_normed, k_all, v_all, mask, shifted, sink_rope):
    # Past the trained context the sink keys are scored from a virtual query position
    # (kv/sink_window.py): two score matrices, the shifted columns taken from the second.
    s = model.spec
    groups = s.num_heads // s.num_kv_heads
    kx = mx.repeat(k_all, groups, axis=0)  # (H, N, D), head h reads kv head h // groups
    vx = mx.repeat(v_all, groups, axis=0)
    scores = (q @ kx.transpose(0, 2, 1)) * s.attn_scale  # (H, T, N)
    q_virt = model.rotate(q_normed, *sink_rope.for_layer(s, layer))
    sink_scores = (q_virt @ kx.transpose(0, 2, 1)) * s.attn_scale
    scores = mx.where(shifted, sink_scores, scores)
    scores = mx.where(mask, scores, mx.array(-float("inf"), dtype=scores.dtype))
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(v_all.dtype) @ vx
