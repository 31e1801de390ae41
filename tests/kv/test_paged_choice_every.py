"""choice_every (`--page-choice-every N`, docs/paged.md "Choosing every N positions"): from the trained context on, only
a query at context + k * N chooses its pages; the others attend to the pages the last of those chose, each with its own
window and its own view of them. A function of the position, so verify blocks (with drafts rejected), one-token steps
and a saved-and-loaded session give the same bits; below the context nothing changes.

A model trained to 64 positions (kv.test_paged.short_context_model), int4 weights (row-independent linears), the
Python path (the native recall's tests: tests/backends/test_native_step.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from factories import feed
from inference_engine.engine.steps import forward

from kv.test_paged import ids, new_cache, paged, short_context_model

CONTEXT = 64


@pytest.fixture(scope="module")
def m():
    return short_context_model("int4")


def test_the_option_is_checked_and_described():
    with pytest.raises(ValueError, match="choice_every must be an int >= 1"):
        paged(choice_every=0)
    with pytest.raises(ValueError, match="choice_every applies to the paged strategy only"):
        from inference_engine.kv.strategy import KVStrategy
        KVStrategy("sink_window", 4, 12, choice_every=2)
    assert paged(choice_every=3).describe()["choice_every"] == "3" and "choice_every" not in paged().describe()


def test_the_source_position_follows_the_context():
    c = new_cache(short_context_model("int4"), paged(choice_every=3), max_step=16)
    assert c._choice_source(np.array([0, 63, 64, 65, 66, 67, 70])).tolist() == [0, 63, 64, 64, 64, 67, 70]


def test_steps_and_verify_blocks_agree_and_rows_take_their_sources_pages(m):
    """One-token steps and verify blocks of 5 give the same logits bit for bit; after each step the kept choice is the
    one its last row's source made; the same history with every query choosing differs past the context only."""
    history = ids(150, seed=11)
    runs, kept = {}, []
    for name, every, chunk in (("steps", 3, 1), ("verify", 3, 5), ("every-query", 1, 1)):
        cache = new_cache(m, paged(choice_every=every), max_step=16)
        out = []
        for i in range(0, len(history), chunk):
            out.append(feed(m, cache, history[i:i + chunk], chunk, row_exact=True))
            if name == "steps" and cache.next_position > CONTEXT:
                kept.append((cache.next_position - 1, cache._choice_pos))
        runs[name] = torch.cat(out)
    assert torch.equal(runs["steps"], runs["verify"])
    assert kept and all(src == p - (p - CONTEXT) % 3 for p, src in kept)
    assert torch.equal(runs["steps"][:CONTEXT], runs["every-query"][:CONTEXT])
    assert not torch.equal(runs["steps"][CONTEXT:], runs["every-query"][CONTEXT:])


def test_a_prefill_chunk_takes_the_choices_its_rows_would(m):
    """A chunk past the context (the Python path attends its rows batched: close, not bit-equal, as without the
    option) takes the pages each of its rows would: the kept choice after it is the one-token steps'."""
    history = ids(140, seed=12)
    a, b = (new_cache(m, paged(choice_every=4), max_step=16) for _ in range(2))
    ra, rb = feed(m, a, history, 16), feed(m, b, history, 1, row_exact=True)
    torch.testing.assert_close(ra, rb, rtol=0.05, atol=0.05)
    assert a._choice_pos == b._choice_pos == 140 - 1 - (140 - 1 - CONTEXT) % 4
    assert torch.equal(a._choice, b._choice)


def test_rejected_drafts_leave_the_choice_of_the_last_kept_row(m):
    """A verify block whose later rows (a choice row among them) are rejected keeps the choice its last kept row took;
    the session then goes on as one that never saw the drafts."""
    history, tail = ids(96, seed=13), ids(20, seed=14)
    a, b = (new_cache(m, paged(choice_every=3), max_step=16) for _ in range(2))
    feed(m, a, history, 1, row_exact=True)
    feed(m, b, history, 1, row_exact=True)
    for keep in (1, 3, 0, 2):
        drafts = ids(5, seed=20 + keep)
        at = a.next_position
        forward(m, m.tensor(drafts), range(at, at + 5), a, row_exact=True)
        a.commit(keep)
        if keep:
            feed(m, b, drafts[:keep], 1, row_exact=True)
        assert a._choice_pos == b._choice_pos and torch.equal(a._choice, b._choice)
    assert torch.equal(feed(m, a, tail, 5, row_exact=True), feed(m, b, tail, 1, row_exact=True))


def test_a_session_saved_between_choices_goes_on_as_one_that_never_left(m):
    """The kept choice is saved with the session: loaded between two choice positions, the next rows take it."""
    history, more = ids(103, seed=15), ids(12, seed=16)  # the last row (102) takes the pages 100 chose
    a = new_cache(m, paged(choice_every=4), max_step=16)
    feed(m, a, history, 1, row_exact=True)
    assert a._choice_pos == 100
    st, bare = a.state(), a.state()  # a state is loaded once (a cache may keep views of it)
    assert "choice.pages" in st.tensors and st.meta["choice_pos"] == a._choice_pos
    b = new_cache(m, paged(choice_every=4), max_step=16)
    b.load_state(st)
    assert torch.equal(feed(m, b, more, 1, row_exact=True), feed(m, a, more, 1, row_exact=True))
    # a state without it (not one this code writes past the context): its rows choose themselves until the next
    # choice position, and from there it keeps what the session that never left keeps
    c = new_cache(m, paged(choice_every=4), max_step=16)
    bare.tensors.pop("choice.pages")
    bare.meta.pop("choice_pos")
    c.load_state(bare)
    feed(m, c, more, 1, row_exact=True)
    assert c._choice_pos == a._choice_pos == 112 and torch.equal(c._choice, a._choice)


@pytest.fixture(scope="module")
def mn():
    """The same model on the native CPU row step (the recall in C++, csrc/paged_rows.h)."""
    from factories import require_native

    require_native()
    model = short_context_model("int4")
    assert model.use_native_step()
    return model


@pytest.mark.parametrize("path", ["python", "native"])
def test_a_history_written_without_attention_chooses_at_its_next_rows(m, mn, path):
    """A cache filled through its API without attention (bench_common.fill_with_random_kv) holds no choice: its next
    rows choose themselves, until the next choice position, whose choice later rows take."""
    m = mn if path == "native" else m
    import sys
    sys.path.insert(0, str(__import__("factories").ROOT / "scripts"))
    from bench_common import fill_with_random_kv

    c = new_cache(m, paged(choice_every=4), max_step=16)
    fill_with_random_kv(c, 90, 16, torch.Generator().manual_seed(0))
    assert c._choice is None and c.next_position == 90
    kept = []
    for t in ids(8, seed=17):
        feed(m, c, [t], 1, row_exact=True)
        kept.append(c._choice_pos)
    assert kept == [90, 91, 92, 92, 92, 92, 96, 96]  # 90, 91 choose (92's and 88's periods); 92 on by the schedule
