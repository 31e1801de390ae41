"""SlotKVCache.delta_state(since): what a saver that holds `since` (a SaveMark) writes of each cache.

The cache says what changed; persistence (session_files.py) only writes it. For every strategy:
the rows of positions committed since the mark (read per slot), the rest of the state without
the store, and, for a cache with append-only tables (paged's archive), their rows since the mark.
A store that reads no rows per slot (int8 resident) hands its whole store in the state instead.
The cache keeps no record of saves: asking twice gives the same delta, and state() is unchanged.
"""
import numpy as np
import pytest
import torch

from inference_engine.kv.factory import make_cache
from inference_engine.kv.layout import CacheGeometry
from inference_engine.kv.registry import make_strategy
from inference_engine.kv.slot_cache import SaveMark
from inference_engine.kv.strategy import KVStrategy

GEOM = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=64, layer_windows=(None, None))
SINK, WINDOW = 4, 12

STRATEGIES = {
    "full": KVStrategy("full"),
    "sink_window": KVStrategy("sink_window", SINK, WINDOW),
    "dlm_restore": make_strategy("dlm_restore", SINK, WINDOW),  # a research strategy, found through the registry
    "paged": KVStrategy("paged", SINK, WINDOW, page_size=4, recall_pages=2),
    "paged_int8_pages": KVStrategy("paged", SINK, WINDOW, page_size=4, recall_pages=2, page_compressor="int8"),
    "paged_spilled": KVStrategy("paged", SINK, WINDOW, page_size=4, recall_pages=2, page_ram_mb=1e-9),  # one page in RAM
    "full_kakeya_d4": KVStrategy("full", compressor="kakeya_d4"),
    "sink_window_kakeya_d4": KVStrategy("sink_window", SINK, WINDOW, compressor="kakeya_d4"),
}


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """RowSpans read in pieces of two pages (page 4): a span's pieces cross page, piece and tier boundaries."""
    from inference_engine.kv import paged_store

    monkeypatch.setattr(paged_store, "PIECE_ROWS", 8)


def new_cache(st):
    return make_cache(st, GEOM, max_step=16, max_context=4096)


def step(cache, t, seed):
    """One committed step of t tokens with random K/V (no model)."""
    g = torch.Generator().manual_seed(seed)
    first = cache.next_position
    cache.prepare(torch.arange(first, first + t), torch.randint(3, 200, (t,), generator=g))
    for layer in range(GEOM.num_layers):
        k = torch.randn(GEOM.num_kv_heads, t, GEOM.head_dim, generator=g)
        cache.update_and_fetch(layer, k, torch.randn(k.shape, generator=g))
    cache.commit()


def store_rows(cache, slots):
    """The rows at `slots` out of the complete state() (what a delta's rows must equal)."""
    full = cache.state().tensors
    axes = cache.store.row_axes
    idx = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    return {n: full[f"store.{n}"].index_select(axis, idx) for n, axis in axes.items()}


def whole(x):
    """A delta's tensor; a RowSpan (paged's archive, read as a save writes it) read a piece at a time and whole, the
    two the same rows with the shape and dtype it declares."""
    if isinstance(x, torch.Tensor):
        return x
    pieces = torch.cat([p.reshape(-1) for p in x.pieces()] or [torch.empty(0, dtype=x.dtype)]).view(x.shape)
    assert pieces.dtype == x.dtype
    assert torch.equal(pieces, x.tensor())
    return pieces


def same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(whole(a[k]), whole(b[k])), k


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_delta_holds_what_was_committed_since_the_mark(name):
    st = STRATEGIES[name]
    if "kakeya" in st.compressor:
        pytest.importorskip("kakeyalattice")
    cache = new_cache(st)
    step(cache, 10, seed=0)

    # nothing saved yet: every resident row, the state without the store
    d0 = cache.delta_state()
    assert d0.row_axes == cache.store.row_axes and d0.row_axes is not None
    assert np.array_equal(d0.pos, cache.store.pos)
    assert np.array_equal(d0.new_slots, np.flatnonzero(cache.store.pos >= 0))
    same(d0.read_rows(d0.new_slots), store_rows(cache, d0.new_slots))
    assert not [k for k in d0.state.tensors if k.startswith("store.")]
    mark = d0.mark(cache.next_position)
    assert mark.rows_through == cache.next_position == 10

    for i in range(4):  # past the window: bounded caches evict, paged archives
        step(cache, 7, seed=i + 1)
    d1 = cache.delta_state(mark)
    pos = cache.store.pos
    assert np.array_equal(d1.new_slots, np.flatnonzero(pos >= mark.rows_through))
    assert sorted(pos[d1.new_slots].tolist()) == [p for p in range(10, cache.next_position) if p in set(pos.tolist())]
    same(d1.read_rows(d1.new_slots), store_rows(cache, d1.new_slots))

    # the rest of the state is state()'s, less the store (and less the append-only rows already saved)
    full = cache.state()
    assert d1.state.meta == full.meta
    rest = {k: v for k, v in full.tensors.items() if not k.startswith("store.")}
    grown = d1.appended
    if grown is None:
        assert type(cache).APPEND_ONLY is None
        same(d1.state.tensors, rest)
    else:
        assert grown.start == mark.appended_rows == 0 and grown.end == full.meta[grown.rows_key] > 0
        same(d1.state.tensors, rest)  # from row 0: every row
        later = d1.mark(cache.next_position)
        assert later.appended_rows == grown.end
        step(cache, 7, seed=9)
        d2 = cache.delta_state(later)
        full = cache.state()
        assert (d2.appended.start, d2.appended.end) == (later.appended_rows, full.meta[grown.rows_key])
        assert d2.appended.end > later.appended_rows
        for k, axis in d2.appended.axes.items():  # the rows archived since the mark only
            assert torch.equal(whole(d2.state.tensors[k]), full.tensors[k].narrow(axis, later.appended_rows,
                                                                            d2.appended.end - later.appended_rows))
        assert set(d2.appended.axes) == {k for k in full.tensors if k.startswith(("pages.", "keys."))}
        # a mark past the tables' rows (not expected: they only grow): every row again, from 0
        d3 = cache.delta_state(SaveMark(cache.next_position, d2.appended.end + 5))
        assert d3.appended.start == 0
        for k in d3.appended.axes:
            assert torch.equal(whole(d3.state.tensors[k]), full.tensors[k])

    # the cache keeps no record of saves
    before = cache.state()
    again = cache.delta_state(mark)
    assert np.array_equal(again.new_slots, cache.delta_state(mark).new_slots)
    same(cache.state().tensors, before.tensors)


def test_a_store_without_per_slot_reads_is_in_the_delta_whole():
    cache = new_cache(KVStrategy("sink_window", SINK, WINDOW, kv_dtype="int8"))
    step(cache, 10, seed=0)
    d = cache.delta_state(SaveMark(5, 0))
    assert d.row_axes is None and d.new_slots.size == 0 and d.appended is None
    same(d.state.tensors, cache.state().tensors)  # the store included


def test_only_the_paged_cache_declares_append_only_tables():
    kinds = {type(new_cache(st)).__name__: new_cache(st).delta_state().appended for st in STRATEGIES.values()
             if st.compressor == "identity"}
    assert kinds.pop("PagedCache").axes  # its archive: pages and compact keys, even before any row
    assert not [k for k, a in kinds.items() if a is not None]
