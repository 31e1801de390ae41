"""The drafter body is bidirectional; the shared embedding/head are frozen and never saved."""
import pytest
import torch

from proposer_factories import tiny_drafter, tiny_verifier

from kv_cache_proposer import load_drafter, save_drafter

torch.set_num_threads(1)


def test_body_is_bidirectional():
    m = tiny_drafter().model
    ids = torch.randint(3, 256, (1, 12))
    masked = torch.zeros(1, 12, dtype=torch.bool)
    h1, _ = m.encode(ids, masked)
    ids2 = ids.clone()
    ids2[0, 9] = (ids[0, 9] + 7) % 256
    h2, _ = m.encode(ids2, masked)
    # an earlier position sees a later token: non-causal attention
    assert not torch.allclose(h1[0, :9], h2[0, :9])


def test_shared_embedding_and_head_are_frozen_and_not_stored(tmp_path):
    d = tiny_drafter(draft_vocab=64)
    m = d.model
    names = {n for n, _ in m.named_parameters()}
    assert not any("embed_weight" in n or "head_weight" in n for n in names)
    sd = m.state_dict()
    assert "embed_weight" not in sd and "head_weight" not in sd and "draft_head" not in sd
    assert all(p.requires_grad for p in m.parameters())  # every parameter is the drafter's own
    save_drafter(m, tmp_path / "ck")
    from safetensors.torch import load_file

    assert_no_shared_tensors(load_file(str(tmp_path / "ck" / "drafter.safetensors")), m)


def assert_no_shared_tensors(saved: dict, m) -> None:
    """The checkpoint holds the drafter's own tensors: none of the verifier's vocabulary size, nothing beyond its own."""
    vocab = m.embed_weight.shape[0]
    assert vocab == m.head_weight.shape[0] and vocab != m.draft_vocab.numel()  # the tiny config tells them apart
    shared = {k: tuple(v.shape) for k, v in saved.items() if vocab in v.shape}
    assert not shared, f"the checkpoint stores the verifier's embedding/head (vocabulary-sized tensors): {shared}"
    own = {n for n, p in m.named_parameters()} | {n for n, b in m.named_buffers() if n in saved}
    assert set(saved) == own and "draft_vocab" in saved
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in m.parameters()) + sum(
        b.numel() for n, b in m.named_buffers() if n in saved)


def test_the_no_shared_tensors_check_catches_a_saved_embedding():
    m = tiny_drafter(draft_vocab=64).model
    state = {k: v.detach() for k, v in m.state_dict().items()}
    for extra in ({"embed_weight": m.embed_weight}, {"head_weight": m.head_weight}, {"tok": m.embed_weight.clone()}):
        with pytest.raises(AssertionError):
            assert_no_shared_tensors(state | extra, m)


def test_save_load_roundtrip_and_frozen_on_load(tmp_path):
    d = tiny_drafter(draft_vocab=64)
    save_drafter(d.model, tmp_path / "ck")
    _, v = tiny_verifier()
    emb, head = v.get_input_embeddings().weight, v.get_output_embeddings().weight
    a = load_drafter(str(tmp_path / "ck"), verifier_embed=emb, verifier_lm_head=head)
    b = load_drafter(str(tmp_path / "ck"), verifier_embed=emb, verifier_lm_head=head)
    assert not any(p.requires_grad for p in a.model.parameters())
    assert torch.equal(a.model.draft_vocab, d.model.draft_vocab)
    ctx = torch.randint(3, 256, (10,))
    assert torch.equal(a.draft(ctx, 4).ids, b.draft(ctx, 4).ids)
    # the shared tensors are the verifier's, not copies baked into the checkpoint
    assert torch.equal(a.model.embed_weight, emb.detach())


def test_training_updates_only_drafter_params():
    d = tiny_drafter()
    m = d.model.train()
    emb0 = m.embed_weight.clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    h, _ = m.encode(torch.randint(3, 256, (2, 8)), torch.zeros(2, 8, dtype=torch.bool))
    m.logits(h).logsumexp(-1).mean().backward()
    opt.step()
    assert torch.equal(m.embed_weight, emb0)
    assert m.embed_weight.grad is None if hasattr(m.embed_weight, "grad") else True
