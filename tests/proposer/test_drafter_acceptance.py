"""The offline acceptance harness: α = expected accepted prefix / k, computed position by position."""
import types

import torch

from kv_cache_proposer.training.acceptance import acceptance


class ScriptedDrafter:
    """Drafts the true continuation, corrupting the slot `wrong_at` (None = never)."""

    def __init__(self, seq, wrong_at=None):
        self.seq, self.wrong_at = seq, wrong_at
        self.context_window, self.uses_verifier_hidden = 8, True
        self.seen_hidden = []

    def draft(self, ctx, k, context_hidden=None, steps=None, threshold=None):
        # recover t from the context: the scripted sequence has distinct tokens
        t = self.seq.index(int(ctx[-1])) + 1
        self.seen_hidden.append((len(ctx), None if context_hidden is None else context_hidden.shape[0]))
        ids = torch.tensor(self.seq[t : t + k])
        if self.wrong_at is not None and self.wrong_at < k:
            ids[self.wrong_at] = -1
        return types.SimpleNamespace(ids=ids)


def test_oracle_drafter_has_alpha_one_and_hidden_lags_one_token():
    seq = list(range(100, 140))
    hid = torch.randn(len(seq), 4)
    d = ScriptedDrafter(seq)
    r = acceptance(d, [seq], [hid], [10], ks=(2, 4), stride=1)
    assert r["alpha_k2"] == 1.0 and r["alpha_k4"] == 1.0 and r["accepted_per_step_k4"] == 5.0
    assert all(h == n - 1 for n, h in d.seen_hidden)  # the newest context token has no verifier hidden yet


def test_prefix_semantics():
    seq = list(range(100, 140))
    hid = torch.randn(len(seq), 4)
    r = acceptance(ScriptedDrafter(seq, wrong_at=1), [seq], [hid], [10], ks=(2, 4), stride=1)
    assert r["alpha_k2"] == 0.5 and r["alpha_k4"] == 0.25  # only the first slot is ever accepted
    r = acceptance(ScriptedDrafter(seq, wrong_at=0), [seq], [hid], [10], ks=(2,), stride=1)
    assert r["alpha_k2"] == 0.0
