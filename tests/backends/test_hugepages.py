"""The native step's int4 blocks in a huge-page arena (backends/torch/hugepages.py): the same bytes, so the same bits."""
from __future__ import annotations

import pytest
import torch

from factories import require_native, tiny_model_dir
from inference_engine.backends.torch import hugepages, native
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine import steps
from inference_engine.engine.generate import Engine
from inference_engine.kv.strategy import KVStrategy


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (7, 3, 320), generator=g, dtype=torch.uint8),
            torch.randn(5, 33, generator=g),
            torch.randint(0, 256, (3 << 20,), generator=g, dtype=torch.uint8),  # past one huge page
            torch.randn(1, generator=g).half()]


@pytest.mark.parametrize("huge", [True, False], ids=["huge", "plain"])
def test_an_arena_holds_each_tensor_bit_for_bit_as_a_64_byte_aligned_view(huge):
    ts = _tensors()
    arena = hugepages.Arena(ts, huge=huge and hugepages.enabled())
    assert len(arena.views) == len(ts)
    for t, v in zip(ts, arena.views):
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert torch.equal(v.view(torch.uint8) if v.dtype != torch.uint8 else v, t.view(torch.uint8) if t.dtype != torch.uint8 else t)
        assert v.data_ptr() % 64 == 0
    # views live on their own: the arena's map stays alive through them
    views = arena.views
    del arena
    assert torch.equal(views[2], ts[2])


def test_kakeya_hugepages_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("KAKEYA_HUGEPAGES", "0")
    assert hugepages.enabled() is False
    assert hugepages.Arena(_tensors()).huge is False


def test_where_the_os_gives_huge_pages_the_arena_gets_them(monkeypatch):
    """On Linux with THP `always` or `madvise` the arena asks for huge pages over a 2 MB-aligned start, and
    huge_bytes reads its own map's AnonHugePages: whole huge pages, within the arena (the kernel may back fewer than
    asked under memory pressure, so no count is required), and with THP `madvise`, none for an arena that did not ask."""
    monkeypatch.delenv("KAKEYA_HUGEPAGES", raising=False)
    if not hugepages.enabled():
        pytest.skip("no transparent huge pages on this OS")
    arena = hugepages.Arena([torch.ones(6 << 20, dtype=torch.uint8)])
    assert arena.huge is True
    assert arena.base.data_ptr() % hugepages.HUGE == 0
    got = arena.huge_bytes()
    assert got % hugepages.HUGE == 0 and got <= 6 << 20
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        madvise_only = "[madvise]" in f.read()
    if madvise_only:  # (with THP `always` the kernel may give any large map huge pages, asked or not)
        assert hugepages.Arena([torch.ones(6 << 20, dtype=torch.uint8)], huge=False).huge_bytes() == 0


def test_the_native_step_computes_the_same_bits_from_its_arena_as_from_plain_pages(monkeypatch):
    """Two native steps over one model, one with its int4 blocks in a huge-page arena, one in plain pages: the same
    logits bit for bit on the same sessions (prefill, then decode)."""
    monkeypatch.delenv("KAKEYA_HUGEPAGES", raising=False)
    require_native()
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights="int4")
    assert m.use_native_step() is True
    huge = m.native_step
    if huge.arena is None:
        pytest.skip("no int4 kernel on this CPU (the blocks are torch's)")
    assert huge.arena.huge is hugepages.enabled()
    monkeypatch.setenv("KAKEYA_HUGEPAGES", "0")
    plain = native.NativeRowStep(m, huge.module)
    assert plain.arena.huge is False
    for a, b in zip(huge.arena.views, plain.arena.views):
        assert torch.equal(a, b)
    engine = Engine(m, KVStrategy("sink_window", 4, 12), prefill_chunk=16)
    kvs = [engine.new_session_kv() for _ in range(2)]
    prompt = torch.randint(3, 200, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    for kv, nat in zip(kvs, (huge, plain)):
        m.native_step = nat
        engine.prefill(kv, prompt)
    for tok in (5, 17, 99, 4, 23):
        for kv, nat in zip(kvs, (huge, plain)):
            m.native_step = nat
            steps.decode_step(m, kv, tok)
        assert torch.equal(kvs[0].last_logits, kvs[1].last_logits)
    m.native_step = huge
