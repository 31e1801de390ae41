"""far_after "context" (docs/paged.md, "far_from once past the context"): a paged session runs as the default (far_from
= the trained context) until it would pass the trained context, and from then on as one that ran far_from from its
start: switched when it holds no position past far_from, else re-encoded once from its tokens (Engine._switch_far).

A model trained to C = 64 positions; far_from F = 40 (sink 4 + window 12 + 2 pages of 8 = 32 <= 40); int4 weights
(row-independent linears), prefill chunks of 16."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from factories import feed, require_native
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams
from inference_engine.kv.factory import make_cache
from inference_engine.engine.session_kv import SessionKV

from kv.test_paged import ids, paged, short_context_model

F = 40


@pytest.fixture(scope="module")
def m():
    """int4 through the Python pieces (the native step off): rows of a prefill chunk spanning F attend batched below it."""
    return short_context_model("int4")


@pytest.fixture(scope="module")
def mn():
    """int4 through the native CPU row step (the daemon's CPU path): every row of a prefill chunk is the one-token step at
    its position, so a position's K/V do not depend on the chunking (Engine._chunk_invariant)."""
    require_native()
    model = short_context_model("int4")
    assert model.use_native_step()
    return model


def late(**kw):
    return paged(far_from=F, far_after="context", **kw)


def run(engine, kv, history, n):
    return [e.token_id for e in engine.generate(kv, history, GenerateParams(max_tokens=n)) if isinstance(e, TokenGenerated)]


def before_crossing(m, n, seed):
    """A far_after "context" engine and a session after a first turn of n tokens and one generated token (fed by the
    next turn), and the history of a next turn that crosses the context (30 more tokens)."""
    e = Engine(m, late(), prefill_chunk=16)
    kv = e.new_session_kv()
    first = ids(n, seed=seed)
    return e, kv, first + run(e, kv, first, 1) + ids(30, seed=seed + 1)


def copy_prefix(old, other, chunk) -> int:
    """What Engine._switch_far copies: `copyable_prefix`, then `copy_rows` `chunk` positions at a time."""
    upto = old.copyable_prefix(other)
    for a in range(0, upto, chunk):
        old.copy_rows(other, a, min(upto, a + chunk))
    return upto


def same_state(a, b) -> bool:
    """The two caches' whole saved state (slab, page store, compact keys, far_keys, slot map) bit for bit."""
    x, y = a.state(), b.state()
    return x.tensors.keys() == y.tensors.keys() and all(torch.equal(x.tensors[k], y.tensors[k]) for k in x.tensors)


def test_the_option_is_checked():
    with pytest.raises(ValueError, match=r"far_after 'context' \(--page-far-after\) needs a far_from"):
        paged(far_after="context")
    with pytest.raises(ValueError, match="unknown far_after 'later'"):
        paged(far_from=F, far_after="later")
    assert late().describe()["far_after"] == "context" and "far_after" not in paged().describe()


def test_below_the_context_it_is_the_default_bit_for_bit(m):
    """Up to the trained context nothing differs from far_from 0; a step past it is refused until the session is
    switched (the engine does it: nothing reaches past the context at true positions by mistake)."""
    history = ids(60, seed=1)
    cache = make_cache(late(), m.geometry(), max_step=16, max_context=64)
    got = feed(m, cache, history, 16)
    want = feed(m, make_cache(paged(), m.geometry(), max_step=16, max_context=64), history, 16)
    assert torch.equal(got, want) and cache.far_from == 64
    with pytest.raises(ValueError, match="switch it first"):
        feed(m, cache, ids(8, seed=2), 8)
    with pytest.raises(ValueError, match="must be re-encoded"):
        cache.switch_far()
    e_late, e_default = Engine(m, late(), prefill_chunk=16), Engine(m, paged(), prefill_chunk=16)
    a, b = e_late.new_session_kv(), e_default.new_session_kv()
    assert run(e_late, a, ids(30, seed=3), 30) == run(e_default, b, ids(30, seed=3), 30)  # positions up to 59
    assert torch.equal(a.last_logits, b.last_logits) and a.cache.far_from == 64 and a.epoch == 0


def test_one_append_across_the_context_runs_far_from_from_the_start(m):
    """An append that takes a session holding no position past F across the context switches it first: the session
    is, bit for bit, one that ran far_from F from its start (the ladder's far4k arm measures this case)."""
    history = ids(100, seed=4)
    e_late, e_far = Engine(m, late(), prefill_chunk=16), Engine(m, paged(far_from=F), prefill_chunk=16)
    a, b = e_late.new_session_kv(), e_far.new_session_kv()
    assert run(e_late, a, history, 12) == run(e_far, b, history, 12)
    assert torch.equal(a.last_logits, b.last_logits)
    assert a.cache.far_from == F and a.epoch == 0  # switched, not re-encoded


@pytest.mark.parametrize("path,seed", [("native", 5), ("native", 1002), ("python", 5), ("python", 1002)])
def test_a_session_past_far_from_is_re_encoded_once_when_it_crosses(m, mn, path, seed):
    """Turn 1 leaves 53 positions in the cache (past F, under C; its last token is fed by the next turn); turn 2's
    append crosses C: the session is re-encoded into a far_from F cache first, then goes on. On the native step its K/V
    of positions under F are copied (the same bits either way: every row is its one-token step) and positions 40 .. 52
    prefilled from their tokens; on the Python pieces every position is encoded again (there the chunk 32 .. 47
    attends its rows under F batched in the default's layout and row by row in far_from's: seed 1002 gives other
    bits for positions 34 .. 38, so a copy would differ, as a review found). Either way it equals, bit for bit, a
    far_from F session that prefilled those 53 tokens and then the append; before the crossing it was the default's,
    bit for bit. The turn reports the re-encoded positions apart from its prefill."""
    m = mn if path == "native" else m
    e_late, e_default, e_far = (Engine(m, st, prefill_chunk=16) for st in (late(), paged(), paged(far_from=F)))
    a, d = e_late.new_session_kv(), e_default.new_session_kv()
    first = ids(50, seed=seed)
    out = run(e_late, a, first, 4)
    assert out == run(e_default, d, first, 4) and a.epoch == 0 and a.cache.far_from == 64
    history = first + out + ids(30, seed=seed + 1)
    evs = list(e_late.generate(a, history, GenerateParams(max_tokens=6)))
    later = [e.token_id for e in evs if isinstance(e, TokenGenerated)]
    assert a.epoch == 1 and a.cache.far_from == F
    # counted apart from the turn's prefill: positions 40 .. 52 (native: those under F copied), or all 53
    assert evs[-1].reencoded_tokens == (53 - F if path == "native" else 53) and evs[-1].prefill_tokens == 31
    assert evs[-1].reencode_decode_seconds == 0  # before the first token: in its time, as the prefill
    ref = e_far.new_session_kv()
    e_far.prefill(ref, history[:53])  # what the re-encode ran
    assert run(e_far, ref, history, 6) == later
    assert torch.equal(a.last_logits, ref.last_logits)
    assert same_state(a.cache, ref.cache)


def test_a_turn_that_crosses_while_decoding_is_re_encoded_at_that_step(m):
    """A turn whose prefill ends under C but whose decoding crosses it: at the step that would write position 64 the
    session is re-encoded from its 64 tokens (the emitted ones included) and decodes on. Its K/V then equal a far_from
    F session's that prefilled those tokens in chunks of 16 and stepped the rest one token at a time."""
    e_late, e_default = Engine(m, late(), prefill_chunk=16), Engine(m, paged(), prefill_chunk=16)
    a, d = e_late.new_session_kv(), e_default.new_session_kv()
    history = ids(58, seed=7)
    evs = list(e_late.generate(a, history, GenerateParams(max_tokens=12)))  # positions 58 .. 69: fed up to 68
    out = [e.token_id for e in evs if isinstance(e, TokenGenerated)]
    # the re-encode's seconds, apart: a decode-rate sample leaves them out (the runtime's decode_tokens_per_second)
    assert evs[-1].reencoded_tokens == 64 and 0 < evs[-1].reencode_decode_seconds < evs[-1].total_seconds
    assert out[:7] == run(e_default, d, history, 7)  # up to the crossing: the default's tokens
    assert a.epoch == 1 and a.cache.far_from == F and a.next_position == 58 + 11
    tokens = history + out
    ref = make_cache(paged(far_from=F), m.geometry(), max_step=16, max_context=64)
    feed(m, ref, tokens[:64], 16)
    feed(m, ref, tokens[64:69], 1, row_exact=True)
    assert same_state(a.cache, ref)


@pytest.mark.parametrize("kw", [{}, {"page_ram_mb": 1e-9}, {"kv_dtype": "fp16"}],
                         ids=["ram", "spilled", "fp16"])
def test_the_positions_under_far_from_are_copied_not_encoded_again(mn, kw):
    """copyable_prefix + copy_rows: a session holding positions past F hands its K/V of positions under F to the far_from cache (from
    the page store, in RAM or spilled, and the sink from the slab), through that cache's own API; then prefilling the
    rest gives, bit for bit, the cache of a far_from F session that prefilled every token (positions under F are the
    same bits under both layouts, on the native step)."""
    m = mn
    history = ids(58, seed=12)
    old = make_cache(late(**kw), m.geometry(), max_step=16, max_context=64)
    feed(m, old, history, 16)
    fresh = make_cache(late(**kw), m.geometry(), max_step=16, max_context=64)
    fresh.switch_far()
    assert copy_prefix(old, fresh, 16) == F and fresh.next_position == F
    feed(m, fresh, history[F:], 16)
    ref = make_cache(paged(far_from=F, **kw), m.geometry(), max_step=16, max_context=64)
    feed(m, ref, history, 16)
    assert same_state(fresh, ref)


def test_the_copy_is_refused_where_it_would_not_be_exact(m):
    """0 (then the whole session is encoded again): a lossy page codec or resident store (the rows read back are not
    the K/V written, and writing them again would code them again), a position under F
    still in the window (not archived yet), or a target cache that is not empty or not switched."""
    def filled(n, **kw):
        c = make_cache(late(**kw), m.geometry(), max_step=16, max_context=64)
        feed(m, c, ids(n, seed=13), 16)
        return c

    def target(**kw):
        c = make_cache(late(**kw), m.geometry(), max_step=16, max_context=64)
        c.switch_far()
        return c

    assert copy_prefix(filled(58, page_compressor="int8"), target(page_compressor="int8"), 16) == 0
    if importlib.util.find_spec("kakeyalattice") is not None:  # a lossy resident store: its rows read back are decoded
        assert copy_prefix(filled(58, compressor="kakeya_e8"), target(compressor="kakeya_e8"), 16) == 0
    assert copy_prefix(filled(48), target(), 16) == 0  # positions 36 .. 47 in the window: 36 .. 39 not archived
    unswitched = make_cache(late(), m.geometry(), max_step=16, max_context=64)
    assert copy_prefix(filled(58), unswitched, 16) == 0
    used = target()
    feed(m, used, ids(4, seed=14), 4)
    assert copy_prefix(filled(58), used, 16) == 0
    assert copy_prefix(filled(58), target(), 16) == F


def test_a_session_with_a_lossy_resident_store_is_encoded_again_whole(m):
    """A resident compressor (its rows read back decoded): no copy; the crossing turn's tokens and logits are those of
    a far_from F session that prefilled the same tokens, as without one."""
    pytest.importorskip("kakeyalattice")
    e_late = Engine(m, late(compressor="kakeya_e8"), prefill_chunk=16)
    e_far = Engine(m, paged(far_from=F, compressor="kakeya_e8"), prefill_chunk=16)
    a = e_late.new_session_kv()
    first = ids(50, seed=5)
    history = first + run(e_late, a, first, 4) + ids(30, seed=6)
    evs = list(e_late.generate(a, history, GenerateParams(max_tokens=12)))
    later = [e.token_id for e in evs if isinstance(e, TokenGenerated)]
    assert a.epoch == 1 and evs[-1].reencoded_tokens == 53  # every position encoded again
    ref = e_far.new_session_kv()
    e_far.prefill(ref, history[:53])
    assert run(e_far, ref, history, 12) == later and torch.equal(a.last_logits, ref.last_logits)


def test_a_re_encode_ends_with_the_turn_when_it_is_cancelled(m):
    """should_stop during the re-encode: the turn ends cancelled and the session is as it was (not switched, nothing of
    the append run)."""
    e_late, a, history = before_crossing(m, 50, seed=8)
    before = a.cache
    calls = []
    evs = list(e_late.generate(a, history, GenerateParams(max_tokens=4),
                               should_stop=lambda: calls.append(1) or len(calls) > 2))
    assert evs[-1].stop_reason == "cancelled" and a.cache is before and a.epoch == 0 and a.cache.far_from == 64
    assert a.next_position == 50 and len(calls) == 3  # stopped inside the re-encode (its third chunk), the append not run


def test_a_session_being_re_encoded_counts_both_caches(m):
    """While the re-encode runs, the session holds its old cache and the new one: its bytes (`nbytes`, what
    kv_live_bytes sums, and kv_bytes' tiers, what GetSessionInfo and /metrics report) are both caches'; after it
    adopts the new cache, that cache's alone. Read from should_stop, which the re-encode's prefill asks each chunk."""
    from inference_engine.kv.byte_counts import kv_bytes

    e_late, a, history = before_crossing(m, 50, seed=10)
    old = a.cache
    seen = []

    def should_stop():
        if a.reencoding is not None:
            seen.append((a.nbytes, a.reencoding.nbytes, kv_bytes(a), kv_bytes(a.reencoding)))
        return False

    list(e_late.generate(a, history, GenerateParams(max_tokens=2), should_stop=should_stop))
    assert a.epoch == 1 and a.reencoding is None and len(seen) >= 3
    for total, fresh, tiers, fresh_tiers in seen:
        assert fresh > 0 and total == old.nbytes + fresh
        assert tiers == kv_bytes(old) + fresh_tiers
    assert seen[-1][1] > seen[0][1]  # the new cache grew as it was filled
    assert a.nbytes == a.cache.nbytes and kv_bytes(a) == kv_bytes(a.cache)


def test_a_fault_in_the_new_cache_fails_the_turn_not_the_session(mn, monkeypatch):
    """A cache invariant broken while the new cache is filled is that cache's: the turn fails with an internal error
    (a CacheInvariantError would fail the session and set its files aside), the session stays as it was, and its next
    turn crosses."""
    from inference_engine.errors import CacheInvariantError, KakeyaError
    from inference_engine.kv.paged import PagedCache

    e_late, a, history = before_crossing(mn, 56, seed=15)  # positions under F archived at the crossing: copied
    before = a.cache

    def broken(self, other, a, b):
        raise CacheInvariantError("inv1", "made up for the test")

    monkeypatch.setattr(PagedCache, "copy_rows", broken)
    with pytest.raises(KakeyaError, match="re-encoding the session .* failed .*the session keeps the cache it had") as e:
        run(e_late, a, history, 2)
    assert not isinstance(e.value, CacheInvariantError) and e.value.code == "INTERNAL"
    assert a.cache is before and a.epoch == 0 and a.reencoding is None and a.next_position == 56
    monkeypatch.undo()
    assert len(run(e_late, a, history, 2)) == 2 and a.epoch == 1


def test_a_re_encode_cancelled_during_its_copy_leaves_the_session_as_it_was(mn):
    """The copy goes a chunk at a time (the engine loop's other sessions run between): a stop asked after its first
    chunk ends the turn cancelled with the session as it was, and the next turn crosses from the start."""
    e_late, a, history = before_crossing(mn, 56, seed=17)
    before = a.cache
    held = []

    def should_stop():
        if a.reencoding is not None:
            held.append(a.reencoding.next_position)
        return bool(held) and held[-1] > 0

    evs = list(e_late.generate(a, history, GenerateParams(max_tokens=2), should_stop=should_stop))
    assert evs[-1].stop_reason == "cancelled" and held == [0, 16]  # the first 16 positions copied, then stopped
    assert a.cache is before and a.epoch == 0 and a.reencoding is None and a.next_position == 56
    assert len(run(e_late, a, history, 2)) == 2 and a.epoch == 1


def test_drafts_do_not_move_the_crossing(m):
    """A verify block that would reach past the context from under it is cut there (its drafts are not the output's
    to decide): with prompt-lookup drafts on every step the session crosses at the step that feeds position C, as it
    does decoding plainly, and emits the same tokens. (Here a block of 4 drafts at position 63 crossed early,
    re-encoding 63 tokens instead of 64, and changed the 7th token on.)"""
    from inference_engine.engine.prompt_lookup import PromptLookupDrafter

    history = (ids(7, seed=3) * 9)[:58]  # repetitive: prompt lookup drafts
    plain = Engine(m, late(), prefill_chunk=16)
    spec = Engine(m, late(), prefill_chunk=16, drafter=PromptLookupDrafter(k_by_match=(4, 4)), spec_k=4)
    spec.gate_drafts = False
    a, b = plain.new_session_kv(), spec.new_session_kv()
    re_encoded_at = []
    real = SessionKV.adopt

    def spy(kv, other):
        re_encoded_at.append(kv.next_position)
        return real(kv, other)

    SessionKV.adopt = spy
    try:
        want = run(plain, a, history, 16)
        got = run(spec, b, history, 16)
    finally:
        SessionKV.adopt = real
    assert got == want and torch.equal(a.last_logits, b.last_logits)
    assert re_encoded_at == [64, 64]  # each session re-encoded its 64 tokens, at the step that feeds position 64
