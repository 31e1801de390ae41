"""Drafters for speculative decoding (and v1's evicted-KV restoration).

Two kinds, picked by the checkpoint manifest's format when `load_drafter` loads one:
- v2 (`kakeya-drafter/2`, dflash_model.py / dflash_drafter.py, shipped smollm2-135m-dflash): a block
  [last token, MASK x 4] drafted in one pass whose layer attends to the verifier's hidden states of 5
  layers, captured by the engine during the steps it runs, through the drafter's own per-session K/V
  cache. Design, training and measured figures: docs/drafters.md.
- v1 (`kakeya-drafter/1`, below; shipped smollm2-135m-dlm): cache-free block diffusion from token
  embeddings and the verifier's final hidden; it stays for dlm_restore (its f_θ is trained for it).

v1 in detail:

Contract: `load_drafter(name_or_path, verifier_embed=..., verifier_lm_head=...) -> Drafter`;
`Drafter.draft(context_ids, k, context_hidden=None, steps=None, threshold=None) -> DraftResult(ids, probs,
kv, hidden)`. Cache-free: every call re-encodes its bounded context plus k mask slots with
bidirectional attention; nothing is kept between calls.

Design (chosen by measurement on the 2-core CPU, see the checkpoint manifest for the figures):
- Shares the verifier's token embedding and LM head, frozen and passed in at load (never stored).
- Conditions on the verifier's final hidden states (EAGLE/DFlash style): the input at context position
  i fuses embed(x_i) with h_{i-1}, the verifier hidden that predicted x_i. The engine already has these
  for every verified token, they carry the whole history, so a short window (32 tokens) suffices and
  the drafter's cost stays flat however long the session grows.
- Output at position i predicts token i+1 through a learned projection into the verifier's hidden
  space (the hidden-alignment target) and the shared head: the last context token predicts block slot
  0 from local inputs, slot j predicts slot j+1; masked slots are refined by confidence over
  `steps` passes (threshold commits every slot above it; otherwise ceil(remaining/steps_left)).
- Body: 1 bidirectional Llama-style layer, width 576 (the verifier's), 9 heads, SwiGLU 1536:
  a few % of the verifier. A second layer cost ~1.8x per training step and per draft call.
- FR-Spec draft vocabulary: the drafter scores only the 8,192 most frequent tokens (rows of the shared
  head). On this CPU one (k x 576) @ (576 x 49,152) head product costs ~14 ms single-threaded (memory
  bound), more than the whole body; the subset cuts it ~6x and speeds training the same way. It covers
  96-97% of the verifier's greedy tokens on the held-out prompts (an upper bound on per-token acceptance).
- Default drafting: one denoising pass (all k slots in parallel). Committing one slot per pass (steps=k)
  raised held-out α a little (chat α4 0.18 -> 0.22) but costs k passes, which lost on tokens per second
  at the measured ~7 ms/pass vs ~39 ms per verifier decode step; callers can still pass steps/threshold.

Shipped smollm2-135m-dlm (manifest.json has every figure): 4.98 M trainable params (3.7% of the
verifier), 10 MB fp16; held-out greedy α = 0.28 / 0.16 / 0.08 at k = 2 / 4 / 8 (chat 0.32, code 0.24 at
k = 2): below ADR 0001's 0.40 gate after ~47 CPU-minutes of training on 117 k teacher tokens.
"""
from kv_cache_proposer.drafter import (
    CHECKPOINTS_DIR,
    Drafter,
    DrafterInputError,
    DraftResult,
    load_drafter,
    resolve_checkpoint,
    save_drafter,
)
from kv_cache_proposer.dflash_drafter import DFlashDrafter
from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel
from kv_cache_proposer.model import DrafterConfig, DrafterModel

__all__ = [
    "CHECKPOINTS_DIR",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashModel",
    "Drafter",
    "DrafterConfig",
    "DrafterInputError",
    "DrafterModel",
    "DraftResult",
    "load_drafter",
    "resolve_checkpoint",
    "save_drafter",
]
