"""The v2 trainer's data, memory-mapped: load_chunks(mapped=True) keeps feats and final as maps of the chunk files
(ChunkRows) and gives the trainer the same rows as the concatenated tensors, so the sampler's batches are the same."""
import torch
from safetensors.torch import save_file

from kv_cache_proposer.dflash_model import DFlashConfig
from kv_cache_proposer.training import dflash_data
from kv_cache_proposer.training.dflash_trainer import AnchorSampler

H, LAYERS = 16, 2


def write_chunks(tmp_path, seq_lens_per_chunk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for c, lens in enumerate(seq_lens_per_chunk):
        n = sum(lens)
        tokens = torch.randint(3, 40, (n,), generator=gen, dtype=torch.int32)
        other = torch.randint(3, 40, (n,), generator=gen, dtype=torch.int32)
        argmax = torch.where(torch.rand(n, generator=gen) < 0.7, torch.roll(tokens, -1), other)  # the text agrees 70 %
        offs = torch.tensor([0] + lens).cumsum(0)
        p = tmp_path / f"part-{c:03d}.safetensors"
        save_file({"tokens": tokens, "feats": torch.randn(n, LAYERS * H, generator=gen).half(),
                   "final": torch.randn(n, H, generator=gen).half(), "argmax": argmax.int(),
                   "seq_offsets": offs.long(), "gen_start": torch.tensor([x // 2 for x in lens]).long(),
                   "style": torch.tensor([i % 3 for i in range(len(lens))]).long()}, str(p))
        paths.append(p)
    return paths


def test_mapped_chunks_read_what_the_concatenated_ones_hold(tmp_path):
    paths = write_chunks(tmp_path, [[30, 50, 20], [41], [17, 60]])
    ram, mapped = dflash_data.load_chunks(paths), dflash_data.load_chunks(paths, mapped=True)
    assert isinstance(mapped["feats"], dflash_data.ChunkRows) and mapped["feats"].shape == ram["feats"].shape
    assert mapped["sha256"] == ram["sha256"]
    for k in ("tokens", "argmax", "seq_offsets", "gen_start", "style"):
        assert torch.equal(mapped[k], ram[k])
    for a, b in ((0, 30), (25, 35), (95, 140), (99, 101), (0, 218), (141, 141)):  # inside a chunk, across, all, none
        assert torch.equal(mapped["feats"][a:b], ram["feats"][a:b]) and torch.equal(mapped["final"][a:b], ram["final"][a:b])
    idx = torch.tensor([[0, 99, 100], [217, 141, 5]])
    assert torch.equal(mapped["final"][idx], ram["final"][idx])


def test_the_sampler_draws_the_same_batches_from_mapped_chunks(tmp_path):
    paths = write_chunks(tmp_path, [[30, 50, 20], [41], [17, 60]], seed=1)
    cfg = DFlashConfig(vocab_size=40, verifier_hidden_size=H, capture_layers=(0, 1), hidden_size=H, num_layers=1,
                       num_heads=2, num_kv_heads=1, intermediate_size=32, context_window=24, block_size=5)
    batches = []
    for mapped in (False, True):
        s = AnchorSampler(dflash_data.load_chunks(paths, mapped=mapped), cfg, torch.Generator().manual_seed(3))
        batches.append([s.batch(4, 6) for _ in range(5)])
    for a, b in zip(*batches):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_validation_holds_out_every_style_not_a_period():
    """The trainer's held-out sequences: 1 in n of each style, at random, even when styles repeat with a period that
    divides n (every n-th sequence would then be one style only)."""
    from kv_cache_proposer.training.dflash_trainer import validation_split

    style = torch.tensor([0, 0, 1, 2, 1] * 100)  # period 5 divides n = 50: s % 50 == 49 would hold out style 1 only
    held = validation_split(style, 50)
    assert {int(style[i]) for i in held.nonzero().flatten()} == {0, 1, 2}
    for st in (0, 1, 2):
        assert int(held[style == st].sum()) == max(1, int((style == st).sum()) // 50)
    assert torch.equal(held, validation_split(style, 50))  # the same split every run (resume, re-export)
    assert validation_split(torch.tensor([3]), 50).tolist() == [True]
