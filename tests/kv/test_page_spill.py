"""paged's disk tier: past `page_ram_mb` the page store's oldest pages live in a memory-mapped spill file
(`SpillingRowTable`); every read gives the bytes the all-in-RAM table gives, so results are identical."""
import os

import pytest
import torch
from kv.test_paged import ids, model, new_cache, paged, short_context_model

from factories import feed
from inference_engine.kv import paged_store
from inference_engine.kv.byte_counts import kv_bytes
from inference_engine.kv.paged_store import RowTable, SpillingRowTable, make_row_codec, ram_rows_for

ONE_PAGE = 1e-9  # MB: ram_rows_for keeps at least one page in RAM, so this is a budget of one page


@pytest.mark.parametrize("at_once", [True, False], ids=["ring-at-once", "ring-grows"])
@pytest.mark.parametrize("codec_name", ["identity", "int8", "kakeya_d4"])
def test_a_spilling_table_reads_what_a_ram_table_reads(codec_name, at_once, monkeypatch):
    """Appends of every size (across page boundaries and the ring's wrap), then every read path and state():
    equal to a RowTable's, bit for bit; a table loaded under a smaller budget too. Both ways a ring is allocated:
    at its full size at once (the CPU's), and grown as rows come (elsewhere: a growth in the middle of an append
    keeps the append's pages written before it)."""
    monkeypatch.setattr(SpillingRowTable, "_ring_at_once", lambda self: at_once)
    codec = make_row_codec(codec_name, head_dim=8, dtype=torch.float32)
    kw = dict(num_layers=2, num_kv_heads=3, head_dim=8, stack=2, page=4, device="cpu")
    ram, spill = RowTable(codec, **kw), SpillingRowTable(codec, ram_rows=8, **kw)
    gen = torch.Generator().manual_seed(0)
    n = 0
    for size in (6, 1, 3, 5, 1, 1, 9, 2, 17, 1, 4):  # the first across two pages of an empty table
        x = torch.randn(2, 2, 3, size, 8, generator=gen)
        for t in (ram, spill):
            if t is ram or at_once:  # a ring that grows is left to reserve page by page inside the append
                t.reserve(t.rows + size)
            t.write_all(t.rows, x)
            t.rows += size
        n += size
        assert spill.nbytes <= codec.bytes_per_row * 8 * 2 * 2 * 3  # the ring: 8 rows of 2 layers, K and V, 3 heads
        for layer in range(2):
            assert torch.equal(ram.read(layer), spill.read(layer))
            idx = torch.randint(0, n, (3, 5), generator=gen)
            assert torch.equal(ram.gather(layer, idx), spill.gather(layer, idx))
            heads = torch.arange(3)[:, None]
            assert torch.equal(ram.gather_flat(layer, (idx + heads * ram.row_stride).flatten(), 3),
                               spill.gather_flat(layer, (idx + heads * spill.row_stride).flatten(), 3))
            whole = -(-n // 4) * 4
            assert torch.equal(ram.read_pages(layer, whole)[:, :, :n], spill.read_pages(layer, whole)[:, :, :n])
        for start in (0, n // 2, n):
            a, b = ram.state(start), spill.state(start)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert spill.cold_pages == (n - 8 + 3) // 4 and spill.cold_nbytes > 0  # whole pages spill; <= 8 rows stay in RAM
    again = SpillingRowTable(codec, ram_rows=4, **kw)
    again.load_state(ram.state(), ram.rows)
    assert again.cold_pages == (n - 1) // 4 and all(torch.equal(ram.read(i), again.read(i)) for i in range(2))
    with pytest.raises(ValueError, match="appends"):
        spill.write_all(3, torch.zeros(2, 2, 3, 1, 8))


def test_a_ring_sized_for_its_budget_at_once_holds_only_the_rows_written():
    """On the CPU the ring is allocated at its full RAM budget at the first write (never grown by copying), in
    memory taken as rows are written: a 1 GiB budget with one page written holds one page, in the process's RSS
    as in `nbytes`; the rows read back exactly and the rest read as zeros."""
    psutil = pytest.importorskip("psutil")
    codec = make_row_codec("identity", head_dim=64, dtype=torch.float32)
    kw = dict(num_layers=4, num_kv_heads=2, head_dim=64, stack=2, page=64, device="cpu")
    row_bytes = 4 * 2 * 2 * 64 * 4
    ram_rows = ram_rows_for(2 ** 30, row_bytes, 64)
    proc = psutil.Process()

    def anon() -> int:
        m = proc.memory_info()
        return m.rss - m.shared

    before = anon()
    table = SpillingRowTable(codec, ram_rows=ram_rows, **kw)
    x = torch.randn(4, 2, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    table.reserve(64)
    table.write_all(0, x)
    table.rows = 64
    assert table.capacity == ram_rows and table.wrapped and not table.spilled  # the whole ring, no spill
    assert table.nbytes == 64 * row_bytes  # one page written: 128 KiB of a 1 GiB ring
    assert anon() - before < 64 * 2 ** 20  # what the process holds follows the rows, not the capacity
    assert torch.equal(table.read(1), x[1])
    assert not table.whole_pages(0, 128)["rows"][:, :, 64:].any()  # spare rows: zeros, untouched


def test_archiving_in_slices_gives_the_same_session(monkeypatch):
    """A prefill chunk's evicted rows are archived ARCHIVE_ROWS at a time, and far_keys catch up FAR_CATCH_UP_ROWS at
    a time (their copies and codes a slice's): the same logits and the same saved state (far_keys included) as doing
    either in one go."""
    from inference_engine.kv.paged import PagedCache

    m = model()
    history = ids(150, seed=5)
    monkeypatch.setattr(PagedCache, "ARCHIVE_ROWS", 10 ** 9)
    monkeypatch.setattr(PagedCache, "FAR_CATCH_UP_ROWS", 10 ** 9)
    whole = new_cache(m, paged(page_ram_mb=ONE_PAGE))
    want = feed(m, whole, history, 32)
    monkeypatch.setattr(PagedCache, "ARCHIVE_ROWS", 3)
    monkeypatch.setattr(PagedCache, "FAR_CATCH_UP_ROWS", 5)
    sliced = new_cache(m, paged(page_ram_mb=ONE_PAGE))
    got = feed(m, sliced, history, 32)
    assert torch.equal(got, want)
    a, b = whole.state(), sliced.state()
    assert any(k.startswith("far_keys.") for k in a.tensors)  # caught up and saved
    assert a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_the_budget_is_whole_pages_of_rows():
    row = 2 * 2 * 3 * 8 * 4  # bytes a position: layers x (K, V) x heads x head_dim x fp32
    assert ram_rows_for(0, row, 4) is None  # no limit
    assert ram_rows_for(10 * 4 * row + 5, row, 4) == 40
    assert ram_rows_for(1, row, 4) == 4  # at least one page


def test_a_table_limited_later_spills_its_oldest_pages_then():
    """The compact keys' tables have no limit until the shortlist applies; `limit` then spills and lays the ring out
    again: every read is unchanged, and appends go on."""
    codec = make_row_codec("int4", head_dim=8, dtype=torch.float32)
    kw = dict(num_layers=2, num_kv_heads=3, head_dim=8, stack=1, page=4, device="cpu")
    ram, spill = RowTable(codec, **kw), SpillingRowTable(codec, ram_rows=None, **kw)
    gen = torch.Generator().manual_seed(1)
    for size in (7, 30, 1, 1, 6, 9):
        x = torch.randn(2, 1, 3, size, 8, generator=gen)
        for t in (ram, spill):
            t.reserve(t.rows + size)
            t.write_all(t.rows, x)
            t.rows += size
        if spill.ram_rows is None and spill.rows > 30:
            assert spill.cold_pages == 0
            spill.limit(8)
            assert spill.cold_pages == (spill.rows - 8 + 3) // 4 and spill.spilled
            with pytest.raises(ValueError, match="by rows"):
                spill.whole_pages(0, 8)
        idx = torch.randint(0, ram.rows, (3, 6), generator=gen)
        for layer in range(2):
            assert torch.equal(ram.read(layer), spill.read(layer))
            a, b = ram.take(layer, idx), spill.take(layer, idx)
            assert all(torch.equal(a[k], b[k]) for k in a)
            a, b = ram.span(3, ram.rows), spill.span(3, spill.rows)
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_spill_files_go_to_the_spill_dir_and_leave_nothing_behind(tmp_path):
    paged_store.set_spill_dir(str(tmp_path / "spill"))
    try:
        codec = make_row_codec("identity", head_dim=8, dtype=torch.float32)
        t = SpillingRowTable(codec, ram_rows=4, num_layers=1, num_kv_heads=1, head_dim=8, stack=2, page=4, device="cpu")
        t.reserve(12)
        t.write_all(0, torch.ones(1, 2, 1, 12, 8))
        t.rows = 12
        assert t.cold_pages == 2 and os.listdir(tmp_path / "spill") == []  # unlinked as made: the map holds it
        fds = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")}
        assert any(str(tmp_path / "spill") in f and "(deleted)" in f for f in fds)
    finally:
        paged_store.set_spill_dir(None)


@pytest.mark.parametrize("chunk,row_exact", [(16, False), (1, True), (5, True)])
def test_spilled_pages_give_the_same_logits(chunk, row_exact):
    """A paged session with one page of RAM reads most recalled pages from the spill file: logits equal the
    all-in-RAM session's bit for bit, the RAM tier stays at one page and the rest is cold."""
    m = model()
    history = ids(150, seed=11)
    want = feed(m, new_cache(m, paged(page_ram_mb=0)), history, chunk, row_exact)
    cache = new_cache(m, paged(page_ram_mb=ONE_PAGE))
    got = feed(m, cache, history, chunk, row_exact)
    assert torch.equal(got, want)
    pages = cache.pages
    assert pages.cold_pages == (pages.rows - 1) // 8  # every complete page but the newest
    far = cache.far_keys  # idle below the context (made a page at a time; a save brings them up): one page in RAM too
    assert 0 <= pages.rows - far.rows < cache.page_size
    assert cache._far_current() and far.rows == pages.rows and far.cold_pages == pages.cold_pages
    tiers = kv_bytes(cache)
    assert pages.nbytes <= pages.ram_rows * pages.num_layers * 2 * pages.num_kv_heads * pages.codec.bytes_per_row
    assert tiers.stored == pages.nbytes + far.nbytes
    assert far.nbytes <= far.ram_rows * far.num_layers * far.num_kv_heads * far.codec.bytes_per_row
    assert tiers.cold == cache.cold_nbytes == pages.cold_pages * 8 * pages.num_layers * pages.num_kv_heads * (
        2 * pages.codec.bytes_per_row + far.codec.bytes_per_row)


@pytest.mark.parametrize("chunk,row_exact", [(16, False), (5, True)])
def test_spilled_pages_past_the_trained_context(chunk, row_exact):
    """Past the trained context (far chunks, far_keys kept from the page store's exact keys, rows moved into
    InfLLM's layout) a spilled session gives the all-in-RAM session's logits bit for bit."""
    m = short_context_model("int4")
    history = ids(160, seed=12)
    want = feed(m, new_cache(m, paged(page_ram_mb=0), max_step=16), history, chunk, row_exact)
    cache = new_cache(m, paged(page_ram_mb=ONE_PAGE), max_step=16)
    assert torch.equal(feed(m, cache, history, chunk, row_exact), want)
    assert cache.far_active and cache.pages.cold_pages > 0
    assert cache.keys.cold_pages > 0  # the true-position keys: not read past the context, kept for the saved state


def test_a_full_spill_disk_is_an_error_not_a_crash(monkeypatch, tmp_path):
    """The spill file's blocks are allocated as it grows: no room is an OSError naming the directory and the flag."""
    import errno

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    paged_store.set_spill_dir(str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    try:
        codec = make_row_codec("identity", head_dim=8, dtype=torch.float32)
        t = SpillingRowTable(codec, ram_rows=4, num_layers=1, num_kv_heads=1, head_dim=8, stack=2, page=4, device="cpu")
        t.reserve(8)
        with pytest.raises(OSError, match="no room.*--page-spill-dir") as e:
            t.write_all(0, torch.ones(1, 2, 1, 8, 8))
        assert e.value.errno == errno.ENOSPC and str(tmp_path) in str(e.value)
    finally:
        paged_store.set_spill_dir(None)


def test_a_spilled_session_saves_and_resumes_under_any_budget(monkeypatch):
    """state() reads both tiers in RowTable's format: a session saved spilled continues token for token when
    rebuilt with its pages all in RAM, and one saved in RAM when rebuilt spilled."""
    m = model()
    history, more = ids(120, seed=13), ids(20, seed=14)
    spilled = new_cache(m, paged(page_ram_mb=ONE_PAGE))
    in_ram = new_cache(m, paged(page_ram_mb=0))
    for c in (spilled, in_ram):
        feed(m, c, history, 16)
    states = {0: spilled.state(), ONE_PAGE: in_ram.state()}  # each rebuilt under the other budget
    want = feed(m, in_ram, more, 1, row_exact=True)
    held = []  # the rows axis of every slab the page store (stack K, V) sets: a load streams through the ring
    real_set = SpillingRowTable._set
    monkeypatch.setattr(SpillingRowTable, "_set", lambda self, data: (self.stack == 2 and held.append(
        next(iter(data.values())).shape[3])) or real_set(self, data))
    for budget, state in states.items():
        again = new_cache(m, paged(page_ram_mb=budget))
        held.clear()
        again.load_state(state)
        if budget:
            assert max(held) <= again.pages.ram_rows < again.pages.rows
        assert torch.equal(feed(m, again, more, 1, row_exact=True), want)
        assert (again.pages.cold_nbytes > 0) == (budget > 0)


@pytest.mark.parametrize("past_context,chunk", [(False, 5), (True, 5), (True, 1)])
def test_spilled_compact_keys_give_the_same_shortlisted_choice(past_context, chunk):
    """Once the shortlist applies the compact keys (and past the context far_keys) keep one page in RAM too and are
    read by rows from either tier: the same logits as the all-in-RAM session, bit for bit."""
    m = short_context_model("int4") if past_context else model()
    history = ids(200, seed=15)
    st = dict(shortlist_pages=3, shortlist_from=4)
    want = feed(m, new_cache(m, paged(page_ram_mb=0, **st), max_step=16), history, chunk, True)
    cache = new_cache(m, paged(page_ram_mb=ONE_PAGE, **st), max_step=16)
    assert torch.equal(feed(m, cache, history, chunk, True), want)  # one-token steps: the keys read as page blocks
    keys = cache.choice_keys
    assert cache.shortlisting and keys.cold_pages > 0 and keys.ram_rows == cache.pages.ram_rows == 8
    assert cache.far_active == past_context
    # idle (a page at a time below the context) or choice (every step past it): spilled
    assert cache.far_keys.rows == cache.pages.rows or (not past_context and cache.pages.rows - cache.far_keys.rows < cache.page_size)
    assert cache._far_current() and cache.far_keys.rows == cache.pages.rows and cache.far_keys.cold_pages > 0
    assert cache.cold_nbytes > cache.pages.cold_nbytes > 0  # the keys' spilled pages count as cold too
    assert cache.stored_nbytes <= 4 * 8 * m.spec.num_layers * m.spec.num_kv_heads * (2 * cache.pages.codec.bytes_per_row + 2 * 34)


def test_page_ram_mb_is_validated_and_described():
    for bad in (-1, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="page_ram_mb"):
            paged(page_ram_mb=bad)
    assert paged().page_ram_mb == 128 and paged().describe()["page_ram_mb"] == "128"
    assert paged(page_ram_mb=0.5).describe()["page_ram_mb"] == "0.5"
