"""Attention of one layer over what a resident cache returned for a step's layout (MLX).

The cache builds its layout on the host (numpy bookkeeping, CPU torch tensors); `StepLayout`
turns the parts attention reads into MLX arrays once per step, not once per layer.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np


class StepLayout:
    """A cache layout's masks and sink-shift selection as MLX arrays."""

    def __init__(self, layout):
        self.source = layout
        self.masks = {w: mx.array(_host(m)) for w, m in layout.masks.items()}  # (T, N) bool, True = attend
        self.sink_shifted = None  # (T, N) bool: keys scored from the virtual query position
        shift = layout.sink_shift
        if shift is not None and layout.sink_shift_active:
            qp, kp = _host(layout.positions)[:, None], _host(layout.key_positions)[None, :]
            self.sink_shifted = mx.array((qp >= shift.from_position) & (kp >= 0) & (kp < shift.sink))


def _host(t) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()


def attend_layout(model, layer: int, q, q_normed, k_all, v_all, step: StepLayout, restored=None, sink_rope=None) -> mx.array:
    """q (H, T, D) over k_all, v_all (Hkv, N, D) with the layout's mask for this layer's window."""
    s = model.spec
    if restored is not None:
        raise NotImplementedError("dlm_restore (restored K/V) runs on the torch backend only")
    w = s.layer_windows[layer]
    mask = step.masks[w]
    if sink_rope is not None and w is None and step.sink_shifted is not None:
        return _attend_with_sink_shift(model, layer, q, q_normed, k_all, v_all, mask, step.sink_shifted, sink_rope)
    return mx.fast.scaled_dot_product_attention(q[None], k_all[None], v_all[None], scale=s.attn_scale, mask=mask)[0]


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
