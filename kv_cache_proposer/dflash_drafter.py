"""The v2 drafter at inference: `draft(last_token, k, context_hidden=..., state=..., position=...)` drafts up
to block_size - 1 tokens in one pass over [last token, MASK...], attending to the per-layer K/V of the
verifier's captured hidden states of the positions before the last token.

`new_state()` makes a session's `DraftCache`: the per-layer context K/V of the last context_window
verifier positions. Each call projects only the positions added since the previous call (usually the
1 + accepted tokens of the last verify step); it resets itself when the session jumped (a new turn
longer than its window, a rewind, a restore). Without a state every call projects the whole window;
both give the same drafts (tests/proposer/test_dflash_drafter.py).
"""
from __future__ import annotations

import torch

from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel
from kv_cache_proposer.draft_result import DrafterInputError, DraftResult


class DraftCache:
    """Per-layer context K/V, each (1, Hkv, T, D), of verifier positions [start, end)."""

    def __init__(self):
        self.start = self.end = 0
        self.kv: list | None = None

    def reset(self, at: int) -> None:
        self.start = self.end = at
        self.kv = None

    @property
    def positions(self) -> int:
        return self.end - self.start


class DFlashDrafter:
    def __init__(self, model: DFlashModel):
        self.model = model.eval()
        self.config: DFlashConfig = model.cfg

    @property
    def context_window(self) -> int:
        return self.config.context_window

    @property
    def uses_verifier_hidden(self) -> bool:
        return True

    @property
    def capture_layers(self) -> tuple:
        return tuple(self.config.capture_layers)

    @property
    def max_drafts(self) -> int:
        return self.config.block_size - 1

    def new_state(self) -> DraftCache:
        return DraftCache()

    def _extend(self, state: DraftCache, feats: torch.Tensor | None, position: int) -> None:
        """Bring `state` to cover the window ending at `position` from `feats` (positions [position - n, position))."""
        W, m = self.config.context_window, self.model
        n = 0 if feats is None else feats.shape[0]
        if state.end > position or state.end < position - n or state.kv is None:
            state.reset(position - min(n, W))
        lo = state.end
        if lo < position:
            new = feats[n - (position - lo) :]
            c = m.context_features(new.to(m.fc.weight.device)[None])  # (1, t, d)
            pos = torch.arange(lo, position, device=c.device)[None]
            kv = m.context_kv(c, pos)
            if state.kv is not None:
                kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(state.kv, kv)]
            state.kv, state.end = kv, position
        if state.kv is None:  # nothing to attend to: an empty context
            dt, dev = m.fc.weight.dtype, m.fc.weight.device
            hkv, D = self.config.num_kv_heads, self.config.head_dim
            state.kv = [(torch.zeros(1, hkv, 0, D, dtype=dt, device=dev),) * 2 for _ in m.layers]
        if state.positions > W:
            cut = state.positions - W
            state.kv = [(k[:, :, cut:], v[:, :, cut:]) for k, v in state.kv]
            state.start += cut

    @torch.inference_mode()
    def draft(self, context_ids, k: int, *, context_hidden: torch.Tensor | None = None, state: DraftCache | None = None,
              position: int | None = None) -> DraftResult:
        """context_ids: its last token is the block's first (the token about to be fed, at `position`);
        context_hidden (n, L*H): the captured verifier features of positions [position - n, position).
        Returns min(k, block_size - 1) drafts."""
        cfg, m = self.config, self.model
        ids = torch.as_tensor(context_ids).reshape(-1).long()
        if ids.numel() < 1:
            raise DrafterInputError("draft() needs the last token; got an empty context_ids")
        if k < 1:
            raise DrafterInputError(f"draft() needs k >= 1 block slots; got k={k}")
        if context_hidden is not None and context_hidden.shape[-1] != cfg.feature_size:
            raise DrafterInputError(
                f"context_hidden has {context_hidden.shape[-1]} features per position; this drafter reads the outputs of "
                f"verifier layers {list(cfg.capture_layers)} concatenated ({cfg.feature_size}); capture those layers")
        n = 0 if context_hidden is None else context_hidden.shape[0]
        position = n if position is None else int(position)
        if state is None:
            state = DraftCache()
        self._extend(state, context_hidden, position)
        kk = min(k, self.max_drafts)
        dev = m.fc.weight.device
        bs = cfg.block_size
        block_pos = torch.arange(position, position + bs, device=dev)[None]
        h = m.run_blocks(ids[-1:].to(dev)[None], block_pos, state.kv, None)  # (1, bs, d)
        probs = torch.softmax(m.logits(h[0, 1 : 1 + kk]).float(), dim=-1)  # (kk, N draft vocab)
        col = probs.argmax(-1)
        out_probs = torch.zeros(kk, cfg.vocab_size, dtype=torch.float32, device=dev)
        out_probs[:, m.draft_vocab] = probs
        return DraftResult(ids=m.draft_vocab[col], probs=out_probs, kv=list(state.kv), hidden=h[0], steps_used=1)
