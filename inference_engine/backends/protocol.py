"""Backend: what the engine's steps need from a model, framework-neutral.

A backend holds one model's weights and exposes the pieces of one decoder layer; the layer
loop itself is written once, in `inference_engine/engine/steps.py`. Arrays are the backend's
own (torch tensors, mlx arrays); the engine only passes them between these calls and the
cache. Shapes: x (T, hidden); q (H, T, D); k, v (Hkv, T, D); o (H, T, D).

Keys and values come in two forms: *raw* (pre-norm, pre-RoPE, as the k/v projections emit
them) and *positioned* (the layer's k_norm and RoPE applied: `position_k`; what the cache
stores and attention reads).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from inference_engine.backends.spec import ModelSpec


@runtime_checkable
class Backend(Protocol):
    spec: ModelSpec
    model_id: str
    backend_name: str  # "torch" | "mlx"
    device: Any

    @property
    def weights_format(self) -> str: ...

    def geometry(self) -> Any:
        """The CacheGeometry caches for this model are built with."""

    def tensor(self, values, dtype: str = "long") -> Any:
        """A backend array on the model's device from a Python list / range."""

    def cat(self, arrays, dim: int) -> Any:
        """Concatenate backend arrays (and layout position tensors) along `dim`; needed only to
        batch several sessions' steps in one forward (engine/loop.py)."""

    def embed_ids(self, ids) -> Any:
        """ids (T,) -> x (T, hidden)."""

    def rope(self, positions) -> Any:
        """RoPE tables for positions (T,), for every rope kind the layers use."""

    def project(self, layer: int, x) -> tuple:
        """x -> raw (q, k, v): the layer's input norm and q/k/v projections, pre-norm, pre-RoPE."""

    def position_q(self, layer: int, q, rope) -> tuple:
        """raw q -> (q positioned, q after q_norm only); the second serves sink re-anchoring."""

    def position_k(self, layer: int, k, rope) -> Any:
        """raw k -> positioned k (k_norm, then RoPE at the rope's positions)."""

    def attend(self, layer: int, q, k, v, mask) -> Any:
        """Plain masked attention: mask (T, N) bool (True = attend) or None = causal (T == N)."""

    def attend_layout(self, layer: int, q, q_normed, k_all, v_all, layout, extra=None, sink_rope=None) -> Any:
        """Attention over what the cache returned for a layout; `extra`: this layer's ExtraKeys of the
        layout's extra keys (kv/layout.py: positioned k, v, their mask, a per-head logit offset or None),
        prepended to the cache's keys. sink_rope: RoPE at the virtual query position of sink keys."""

    batches_decode_attention: bool  # attend_decode_batch is used for several sessions' decode rows

    def attend_decode_batch(self, layer: int, q, kvs, layouts, scratch: dict) -> Any:
        """Several sessions' one-token decode rows (q (H, B, D)) over their own (k_all, v_all) in one call."""

    def step_runner(self, rows: int) -> Any:
        """A runner of a step's dense pieces (everything but attention) for `rows` rows as captured
        graphs (backends/torch/graphs.py: start(ids, rope), advance(layer, o)), or None: the engine
        calls embed_ids / project / position_* / finish / final_norm one by one."""

    def finish(self, layer: int, x, o) -> Any:
        """Attention output o -> residual stream after the output projection and the MLP."""

    def final_norm(self, x) -> Any: ...

    def logits(self, hidden, greedy: bool = False) -> Any:
        """Normed hidden (T, hidden) -> float32 logits (T, V). greedy: the caller takes only each
        row's argmax, so a backend may compute the logits outside its best candidates more
        cheaply (the argmax must still be the exact head's)."""

    def inference(self) -> Any:
        """Context manager under which steps run (no autograd)."""

    def to_host(self, logits) -> Any:
        """Logits -> float32 torch CPU tensor: sampling runs on the host with seeded torch generators,
        so every backend samples identically."""
