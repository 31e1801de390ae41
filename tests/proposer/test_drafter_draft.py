"""Block-diffusion drafting: shapes, stateless calls, steps/threshold semantics, bounded context."""
import pytest
import torch

from proposer_factories import tiny_drafter

from kv_cache_proposer import DrafterInputError

torch.set_num_threads(1)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_draft_shapes_vocab_and_probs(k, draft_vocab):
    d = tiny_drafter(draft_vocab=draft_vocab)
    T, H = 10, d.config.verifier_hidden_size
    r = d.draft(torch.randint(3, 256, (T,)), k, context_hidden=torch.randn(T - 1, H))
    assert r.ids.shape == (k,) and r.ids.dtype == torch.long
    assert int(r.ids.min()) >= 0 and int(r.ids.max()) < d.config.vocab_size
    if draft_vocab:
        assert torch.isin(r.ids, d.model.draft_vocab).all()
    assert r.probs.shape == (k, d.config.vocab_size)
    assert torch.allclose(r.probs.sum(-1), torch.ones(k), atol=1e-5)
    assert r.hidden.shape == (T + k, d.config.hidden_size)
    assert len(r.kv) == d.config.num_layers
    for K, V in r.kv:
        assert K.shape[-2] == T + k and V.shape[-2] == T + k  # every encoded position (context + block)


def test_same_inputs_same_outputs_no_state_between_calls():
    d = tiny_drafter()
    ctx, hid = torch.randint(3, 256, (12,)), torch.randn(11, d.config.verifier_hidden_size)
    a = d.draft(ctx, 4, context_hidden=hid)
    d.draft(torch.randint(3, 256, (7,)), 8)  # an unrelated call in between
    b = d.draft(ctx, 4, context_hidden=hid)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs)
    for (k1, v1), (k2, v2) in zip(a.kv, b.kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_hidden_conditioning_changes_the_draft_distribution():
    d = tiny_drafter()
    ctx = torch.randint(3, 256, (12,))
    a = d.draft(ctx, 4, context_hidden=torch.randn(11, d.config.verifier_hidden_size))
    b = d.draft(ctx, 4, context_hidden=None)
    assert not torch.allclose(a.probs, b.probs)


def test_steps_bound_the_denoising_passes():
    d = tiny_drafter()
    ctx = torch.randint(3, 256, (8,))
    assert d.draft(ctx, 8, steps=1).steps_used == 1
    assert d.draft(ctx, 8, steps=8, threshold=0.0).steps_used == 8  # one commit per pass
    assert d.draft(ctx, 8, steps=3, threshold=0.0).steps_used == 3
    # a threshold every slot clears commits the whole block in the first pass
    assert d.draft(ctx, 8, steps=8, threshold=1e-9).steps_used == 1
    # a threshold nothing clears falls back to the steps schedule
    assert d.draft(ctx, 8, steps=4, threshold=1.01).steps_used == 4


def test_one_commit_per_step_is_left_to_right_consistent():
    """With one commit per pass, every committed token is the argmax given the slots committed before it."""
    d = tiny_drafter()
    ctx = torch.randint(3, 256, (8,))
    r = d.draft(ctx, 4, steps=4, threshold=0.0)
    assert torch.allclose(r.probs.max(-1).values, r.probs.gather(1, r.ids[:, None]).squeeze(1))


def test_context_is_bounded_by_the_window():
    d = tiny_drafter(context_window=16)
    H = d.config.verifier_hidden_size
    ctx, hid = torch.randint(3, 256, (40,)), torch.randn(39, H)
    long = d.draft(ctx, 4, context_hidden=hid)
    short = d.draft(ctx[-16:], 4, context_hidden=hid[-15:])
    assert torch.equal(long.ids, short.ids) and long.hidden.shape[0] == 16 + 4


def test_caller_mistakes_raise_typed_errors():
    d = tiny_drafter()
    with pytest.raises(DrafterInputError, match="k >= 1"):
        d.draft(torch.tensor([5, 6]), 0)
    with pytest.raises(DrafterInputError, match="context_hidden"):
        d.draft(torch.tensor([5, 6]), 2, context_hidden=torch.randn(3, d.config.verifier_hidden_size))
    with pytest.raises(DrafterInputError, match="empty"):
        d.draft(torch.tensor([], dtype=torch.long), 2)
