"""paged: sink + window resident, evicted positions archived exactly in pages, recalled per query."""
import dataclasses

import pytest
import torch

from factories import feed, load_model, tiny_model_dir
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams
from inference_engine.engine.steps import forward
from inference_engine.kv.factory import make_cache
from inference_engine.kv.paged_store import RowQuant, RowTable, SpillingRowTable, make_row_codec
from inference_engine.kv.strategy import KVStrategy



def model(arch="llama", **kw):
    return load_model(str(tiny_model_dir(arch, **kw)))


def ids(n, seed=0):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_cache(m, strategy, max_step=64):
    return make_cache(strategy, m.geometry(), max_step=max_step, max_context=m.spec.max_context)


def paged(sink=4, window=12, page=8, pages=2, **kw):
    return KVStrategy("paged", sink, window, page_size=page, recall_pages=pages, **kw)


def test_paged_equals_full_while_everything_fits_in_the_window():
    m = model()
    history = ids(50)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    got = feed(m, new_cache(m, paged(window=100)), history, 16)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_recalling_every_page_equals_full(arch):
    """recall_pages >= pages: every query attends to its whole history, partly from the page store."""
    m = model(arch)
    history = ids(120)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    for chunk, row_exact in ((16, False), (1, False)) + ((1, True), (5, True)):
        cache = new_cache(m, paged(window=12, page=8, pages=100))
        got = feed(m, cache, history, chunk, row_exact=row_exact)
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
        assert cache.pages.rows == 120 - 12 + 1 - 4 and cache.dropped_total == 0


def test_few_recalled_pages_differ_from_full_and_from_sink_window():
    m = model()
    history = ids(150)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)[-1]
    sw = feed(m, new_cache(m, KVStrategy("sink_window", 4, 12)), history, 16)[-1]
    pg = feed(m, new_cache(m, paged(pages=2)), history, 16)[-1]
    assert not torch.allclose(pg, full, atol=1e-4) and not torch.allclose(pg, sw, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_paged_result_does_not_depend_on_chunking(arch):
    """INV-3: selection is per query and by position (one append == one-token appends)."""
    m = model(arch)
    history = ids(140)
    ref = feed(m, new_cache(m, paged()), history, 64)
    for chunk in (1, 7, 30):
        torch.testing.assert_close(feed(m, new_cache(m, paged()), history, chunk), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_row_exact_steps_equal_batched_steps(arch):
    m = model(arch)
    history = ids(100)
    ref = feed(m, new_cache(m, paged()), history, 5)
    torch.testing.assert_close(feed(m, new_cache(m, paged()), history, 5, row_exact=True), ref, rtol=1e-5, atol=1e-5)


def test_archived_rows_are_the_exact_kv_the_window_held():
    """Layer 0's K/V depend on the token alone: archived rows equal full's bit for bit. Deeper layers
    equal full's to float tolerance when every page is recalled (same attention as full)."""
    m = model()
    history = ids(90)
    full = new_cache(m, KVStrategy("full"))
    feed(m, full, history, 16)
    for pages, layers, tol in ((2, [0], 0.0), (100, range(m.spec.num_layers), 1e-5)):
        cache = new_cache(m, paged(pages=pages))
        feed(m, cache, history, 16)
        n = cache.pages.rows
        assert n == 90 - 12 + 1 - 4 and cache.archived_end == 4 + n
        for layer in layers:
            kv = cache.pages.read(layer)
            torch.testing.assert_close(kv[0], full.store.k[layer][:, 4 : 4 + n], rtol=tol, atol=tol)
            torch.testing.assert_close(kv[1], full.store.v[layer][:, 4 : 4 + n], rtol=tol, atol=tol)


def test_the_needle_page_is_recalled():
    """A query equal to one archived key picks that key's page for every KV head."""
    m = model()
    cache = new_cache(m, paged(pages=1))
    feed(m, cache, ids(80), 16)
    layer = 0
    needle = 30  # position; page (30 - 4) // 8 = 3
    k = cache.pages.read(layer)[0][:, needle - 4]  # (Hkv, D)
    g = m.spec.num_heads // m.spec.num_kv_heads
    q = (k * 50).repeat_interleave(g, 0)[:, None]  # (H, 1, D): a query that aligns with the needle key
    cache.prepare(range(80, 81))
    sel = cache._choose(layer, q, cache.store.k[layer])
    cache.abort()
    chosen = sorted(set((sel[0, 0].nonzero().flatten() + 4).tolist()))
    assert chosen == list(range(28, 36)) and bool(sel[:, 0].any(-1).all())


def test_resident_bytes_are_flat_and_store_bytes_grow_by_pages():
    m = model()
    g = m.geometry()
    cache = new_cache(m, paged(window=16, page=8), max_step=16)
    feed(m, cache, ids(40), 16)
    resident, store = cache.resident_nbytes, cache.stored_nbytes
    feed(m, cache, ids(200, seed=3), 16)
    assert cache.resident_nbytes == resident and cache.resident_positions == 4 + 16 - 1
    rows = cache.pages.rows
    held = -(-rows // 8) * 8  # the written rows' whole pages: what the tables hold, whatever their capacity
    # the page store, a spilling ring on the CPU, is sized for its RAM budget at once (its memory taken as rows are
    # written); the keys (no RAM limit yet) grow by at least a quarter at a time, in whole pages
    assert cache.pages.capacity == cache.pages.ram_rows and cache.pages.ram_rows > rows
    cap = cache.keys.capacity
    assert cap % 8 == 0 and rows <= cap <= -(-rows * 5 // 4 // 8) * 8 + 8
    code_bytes = held * g.num_layers * g.num_kv_heads * (g.head_dim // 2 + 2)  # int4 + fp16 scale
    assert cache.keys.nbytes == cache.far_keys.nbytes == code_bytes  # far_keys: kept, idle below the context
    assert cache.stored_nbytes == held * g.num_layers * 2 * g.num_kv_heads * g.head_dim * 4 + code_bytes > store
    assert not cache.shortlisting and cache.bounds.nbytes == 0  # bounds are made once the shortlist applies
    assert cache.selection_nbytes == cache.keys.nbytes  # until then every compact key is read each step
    assert cache.nbytes == cache.resident_nbytes + cache.selection_nbytes
    again = new_cache(m, paged(window=16, page=8))
    again.load_state(cache.state())
    assert again.pages.nbytes == cache.pages.nbytes and again.keys.capacity == held  # rebuilt: its rows' pages exactly


@pytest.mark.parametrize("codec", ["int8", "int4", "kakeya_e8"])
def test_row_codecs_round_trip_per_row(codec):
    if codec.startswith("kakeya"):
        pytest.importorskip("kakeyalattice")
    c = make_row_codec(codec, head_dim=64, dtype=torch.float32)
    x = torch.randn(40, 64) * 3
    y = c.decode(c.encode(x))
    assert y.shape == x.shape
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < {"int8": 0.01, "int4": 0.15, "kakeya_e8": 0.05}[codec]
    one = c.decode(c.encode(x[:1]))  # a row's code does not depend on its batch
    torch.testing.assert_close(one, y[:1], rtol=0, atol=0)


def _with_native_kernel():
    from inference_engine.kv import paged_store

    if paged_store._score_kernel is None:
        from inference_engine.backends.torch import native

        mod = native.load()
        if mod is None:
            pytest.skip("no native extension here")
        paged_store.set_score_kernel(mod.group_max_scores, mod.score_q8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_native_row_quant_writes_encodes_bits_in_place(dtype):
    """The native in-place RowQuant(8) encode (row_quant8_into: a decode step's archived key row, one call) writes the
    codes and scales torch's RowQuant.encode makes, bit for bit, into strided views of a table: random rows, an all-zero
    row, rows under fp16's smallest normal, huge rows and rows whose x / s falls on halves (round half to even); and a
    table's write_all takes it for one run of rows and torch's path otherwise, the same payload either way."""
    from inference_engine.backends.torch import native
    from inference_engine.kv import paged_store

    mod = native.load()
    if mod is None:
        pytest.skip("no native extension here")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 4, 5, 64, generator=g) * torch.logspace(-6, 3, 5)[:, None]
    x[0, 0, 0, 0] = 0
    # s = 127 * 2^-4 / 127 = 2^-4 exactly, and x / s = -9.5 .. 9.5 in halves: rounded half to even
    x[0, 0, 0, 1] = torch.tensor([127.0] + [k % 20 - 9.5 for k in range(63)]) * 2.0 ** -4
    x = x.to(dtype)
    rows = x[:, :1]  # a strided view, as paged archives keys: kv[:, :1]
    codec = RowQuant(8, 64)
    want = codec.encode(rows.reshape(-1, 64))
    codes = torch.full((3, 1, 4, 9, 64), 99, dtype=torch.int8)[:, :, :, 2:7]  # strided views into a bigger table
    scale = torch.zeros(3, 1, 4, 9, 1, dtype=torch.float16)[:, :, :, 2:7]
    mod.row_quant8_into(rows, codes, scale)
    assert torch.equal(codes.reshape(-1, 64), want["codes"]) and torch.equal(scale.reshape(-1, 1), want["scale"])
    saved = paged_store._quant8_kernel
    tables = {}
    try:
        for name, kernel in (("native", mod.row_quant8_into), ("torch", None)):
            paged_store.set_row_quant_kernel(kernel)
            # a ring of 16 rows in pages of 8: runs in one page (in place), runs across pages (torch's pieces), and
            # runs past the ring (its oldest page spilled to the file first)
            t = tables[name] = SpillingRowTable(codec, ram_rows=16, num_layers=3, num_kv_heads=4, head_dim=64,
                                                stack=1, page=8, device="cpu")
            src = torch.cat([x[:, :1]] * 3, 3)  # (3, 1, 4, 15, 64)
            for start, n in ((0, 5), (5, 1), (6, 7), (13, 3), (16, 4), (20, 1), (21, 11)):
                t.reserve(start + n)
                t.write_all(start, src[:, :, :, :n])
                t.rows = start + n
    finally:
        paged_store.set_row_quant_kernel(saved)
    assert tables["native"].cold_pages == tables["torch"].cold_pages > 0
    assert all(torch.equal(tables["native"].span(0, 32)[k], tables["torch"].span(0, 32)[k]) for k in ("codes", "scale"))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("queries", [1, 4, 40])  # few queries may score in integers, many in float
@pytest.mark.parametrize("path", [None, "int", "float", "native"])
def test_scores_over_codes_are_the_int8_querys_exact_dots_on_every_path(bits, queries, path):
    """With the int8 query (the default), every scoring path (whichever this CPU measured fastest, and each forced)
    gives the same bits: float(max_g a . codes) * s * scale, a and s as quantize_query makes them, the integer dots
    taken here in float64 (exact)."""
    from inference_engine.kv import paged_store

    if path == "native":
        _with_native_kernel()
    assert paged_store.query_int8()
    rq = RowQuant(bits, 64)
    keys = torch.randn(3 * 50, 64) * torch.rand(3 * 50, 1) * 4
    pay = rq.encode(keys)
    q = torch.randn(3, 3, queries, 64) * 2  # (Hkv, G, T, D)
    got = rq.group_max_scores(q, pay["codes"].reshape(3, 50, -1), pay["scale"].reshape(3, 50, 1), path=path)
    a, s = paged_store.quantize_query(q)
    assert a.abs().max() == 127 and torch.equal(a, a.round())
    ints = (rq.decode(pay) / pay["scale"].float()).round().reshape(3, 1, 50, 64)  # the codes' integers
    raw = (a.double() @ ints.double().transpose(-1, -2)).amax(1).float()  # (Hkv, T, 50), exact
    want = raw * s * pay["scale"].reshape(3, 1, 50).float()
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("queries", [1, 40])
def test_the_int8_query_scores_keys_about_as_the_fp32_query_does(bits, queries):
    """The int8 query's rounding is small against the codes' own: its scores stay within a few % of the scores' spread
    of the fp32 query's (every path of which gives the decoded keys' scores), and move them by under a quarter of what
    the 4-bit codes do."""
    from inference_engine.kv import paged_store

    rq = RowQuant(bits, 64)
    keys = torch.randn(3 * 200, 64)
    pay = rq.encode(keys)
    codes, scale = pay["codes"].reshape(3, 200, -1), pay["scale"].reshape(3, 200, 1)
    q = torch.randn(3, 3, queries, 64)
    q8 = rq.group_max_scores(q, codes, scale, path="float")
    was = paged_store.query_int8(False)
    try:
        for path in ("int", "float"):
            fp = rq.group_max_scores(q, codes, scale, path=path)
            want = (q @ rq.decode(pay).reshape(3, 1, 200, 64).transpose(-1, -2)).amax(1)
            torch.testing.assert_close(fp, want, rtol=1e-4, atol=1e-3)
    finally:
        paged_store.query_int8(was)
    spread = fp.std()
    # measured: max 0.24, mean 0.043 on scores of spread ~6, where the 4-bit codes move them by 0.66 on average
    assert (q8 - fp).abs().max() < 0.06 * spread and (q8 - fp).abs().mean() < 0.012 * spread
    exact = (q @ keys.reshape(3, 1, 200, 64).transpose(-1, -2)).amax(1)
    if bits == 4:  # the codes' own error dwarfs the query's rounding
        assert (q8 - fp).abs().mean() * 4 < (fp - exact).abs().mean()


def test_the_native_kernel_follows_the_query_switch():
    """query_int8(False) turns the native kernels to the fp32 query too (KAKEYA_PAGE_QUERY=fp32 at start): the
    native path then scores as the float path within float rounding, and as before bit for bit when switched back."""
    from inference_engine.kv import paged_store

    _with_native_kernel()
    rq = RowQuant(4, 64)
    pay = rq.encode(torch.randn(3 * 64, 64))
    codes, scale = pay["codes"].reshape(3, 64, -1), pay["scale"].reshape(3, 64, 1)
    q = torch.randn(3, 3, 1, 64)
    q8 = rq.group_max_scores(q, codes, scale, path="native")
    was = paged_store.query_int8(False)
    try:
        fp = rq.group_max_scores(q, codes, scale, path="native")
        torch.testing.assert_close(fp, rq.group_max_scores(q, codes, scale, path="float"), rtol=1e-5, atol=1e-5)
        assert not torch.equal(fp, q8)
    finally:
        paged_store.query_int8(was)
    assert torch.equal(rq.group_max_scores(q, codes, scale, path="native"), q8)


def test_the_scoring_path_is_measured_once_or_set_by_the_environment(monkeypatch):
    from inference_engine.kv import paged_store

    for value in ("int", "float"):
        monkeypatch.setattr(paged_store, "_scoring", None)
        monkeypatch.setenv("KAKEYA_PAGE_SCORING", value)
        assert paged_store.scoring_path() == value
    monkeypatch.setattr(paged_store, "_scoring", None)
    monkeypatch.delenv("KAKEYA_PAGE_SCORING")
    measured = paged_store.scoring_path()
    assert measured in ("int", "float", "native") and paged_store.scoring_path() == measured  # kept for the process
    monkeypatch.setattr(paged_store, "_score_kernel", paged_store._score_kernel)
    paged_store.set_score_kernel(None)  # a kernel that comes or goes: measured again, without it
    assert paged_store._scoring is None and paged_store.scoring_path() in ("int", "float")


def test_int4_codes_take_half_a_byte():
    q = RowQuant(4, 64)
    payload = q.encode(torch.randn(3, 64))
    assert payload["codes"].shape == (3, 32) and q.bytes_per_row == 34


def test_row_table_reads_rows_back_and_survives_state():
    t = RowTable(make_row_codec("identity", head_dim=8, dtype=torch.float32), num_layers=2, num_kv_heads=3, head_dim=8,
                 stack=2, page=4, device="cpu")
    rows = torch.randn(2, 2, 3, 6, 8)  # (layers, K/V, heads, rows, dim)
    t.reserve(6)
    t.write_all(0, rows)
    t.rows = 6
    assert t.capacity == 8
    torch.testing.assert_close(t.read(1, torch.tensor([5, 2])), rows[1][:, :, [5, 2]], rtol=0, atol=0)
    torch.testing.assert_close(t.read(0), rows[0], rtol=0, atol=0)
    u = RowTable(t.codec, num_layers=2, num_kv_heads=3, head_dim=8, stack=2, page=4, device="cpu")
    u.load_state(t.state(), 6)
    assert u.nbytes == t.nbytes
    torch.testing.assert_close(u.read(1), rows[1], rtol=0, atol=0)


@pytest.mark.parametrize("compressor", ["int8", "kakeya_d4"])
def test_compressed_pages_stay_close_to_full(compressor):
    if compressor.startswith("kakeya"):
        pytest.importorskip("kakeyalattice")
    m = model()
    history = ids(100)
    full = feed(m, new_cache(m, KVStrategy("full")), history, 16)
    exact = feed(m, new_cache(m, paged(pages=100)), history, 16)
    cache = new_cache(m, paged(pages=100, page_compressor=compressor))
    got = feed(m, cache, history, 16)
    torch.testing.assert_close(exact, full, rtol=1e-4, atol=1e-4)
    assert (got - full).abs().mean() < 0.05 * full.abs().mean()
    assert cache.stored_nbytes < new_cache(m, paged()).stored_nbytes + 4 * cache.pages.rows * 2 * 64 * 4


def test_speculative_rollback_is_exact():
    m = model()
    s = paged()
    history, extra = ids(60), ids(6, seed=1)
    a = new_cache(m, s)
    feed(m, a, history, 16)
    forward(m, torch.tensor(extra), range(a.next_position, a.next_position + 6), a, row_exact=True)
    a.commit(2)
    b = new_cache(m, s)
    feed(m, b, history + extra[:2], 16)
    tail = ids(20, seed=2)
    torch.testing.assert_close(feed(m, a, tail, 5), feed(m, b, tail, 5), rtol=1e-5, atol=1e-5)
    assert a.pages.rows == b.pages.rows and a.nbytes == b.nbytes


def short_context_model(weights="fp32"):
    from inference_engine.backends.torch.model import TorchCausalLM

    path = str(tiny_model_dir("llama", max_position_embeddings=64))
    return load_model(path) if weights == "fp32" else TorchCausalLM.load(path, weights=weights)


def test_paged_goes_past_the_trained_context_row_by_row():
    """Past max_context (64 here) a session goes on in InfLLM's layout: verify blocks of 5 and one-token steps
    give the same logits bit for bit (row by row; int4: row-independent linears); a prefill chunk's rows
    attend batched (_attend_far_chunk), close to the one-token ones, as below the context."""
    m = short_context_model("int4")
    history = ids(160, seed=3)
    runs = {}
    for name, chunk, row_exact in (("chunks", 16, False), ("verify", 5, True), ("steps", 1, True)):
        cache = new_cache(m, paged(), max_step=16)
        runs[name] = feed(m, cache, history, chunk, row_exact)
        assert cache.next_position == 160 and bool(torch.isfinite(runs[name]).all())
    assert torch.equal(runs["verify"], runs["steps"])
    torch.testing.assert_close(runs["chunks"], runs["steps"], rtol=0.05, atol=0.05)  # bf16 activations


@pytest.mark.parametrize("layout", ["packed", "spread"])
def test_a_prefill_chunk_past_the_context_attends_as_its_rows_would_alone(monkeypatch, layout):
    """fp32: the batched far chunk (two calls per layer: each row's rotated pages + moved sink, then the slab under
    each row's mask, merged by log-sum-exp) computes what row-by-row attention in the same layout computes."""
    from inference_engine.kv.paged import PagedCache

    m = short_context_model()
    history = ids(150, seed=4)
    calls = []
    real = PagedCache._attend_far_chunk
    monkeypatch.setattr(PagedCache, "_attend_far_chunk", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    batched = feed(m, new_cache(m, paged(far_layout=layout), max_step=16), history, 16)
    assert calls  # chunks at 64 and past went through it
    monkeypatch.setattr(PagedCache, "_attend_far_chunk", lambda self, *a, **k: None)  # row by row
    rows = feed(m, new_cache(m, paged(far_layout=layout), max_step=16), history, 16)
    torch.testing.assert_close(batched, rows, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("chunk, row_exact", [(16, False), (1, True)])
def test_far_from_starts_infllms_layout_below_the_trained_context(chunk, row_exact):
    """far_from F < the trained context C: from F on a session attends (and chooses pages) as a session on a model
    trained to F would, bit for bit (prefill chunks and one-token steps, the native recall where it is built); before
    F as the default one does; and from F on it differs from the default, which keeps true positions up to C."""
    m = short_context_model("int4")  # C = 64
    history, f = ids(120, seed=7), 40  # sink 4 + window 12 + 2 pages of 8 = 32 <= 40
    early = feed(m, make_cache(paged(far_from=f), m.geometry(), max_step=16, max_context=64), history, chunk, row_exact)
    as_trained = feed(m, make_cache(paged(), m.geometry(), max_step=16, max_context=f), history, chunk, row_exact)
    default = feed(m, new_cache(m, paged(), max_step=16), history, chunk, row_exact)
    assert torch.equal(early, as_trained)
    assert torch.equal(early[:f], default[:f])
    assert not torch.allclose(early[f:64], default[f:64], rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="far_from must be 0 .* = 32"):
        paged(far_from=31)


def test_past_the_context_page_choice_scores_every_candidate_at_one_distance():
    """Below max_context page choice scores keys at their true positions (far_keys are kept, idle). Past it,
    far_keys holds each archived key rotated back to position 0 (as the exact page store holds it), queries are rotated
    to far_distance, and so a page's score does not depend on how far back it is: the top pages are those of
    the keys as they would score at that one distance."""
    from inference_engine.kv.paged import PagedCache

    m = short_context_model()
    g = m.geometry()
    cache = new_cache(m, paged(), max_step=16)
    feed(m, cache, ids(60, seed=5), 16)
    assert not cache.far_active and cache.choice_keys is cache.keys  # nothing past the context yet
    assert cache.far_keys.rows == cache.pages.rows > 0  # kept as positions are archived
    feed(m, cache, ids(60, seed=6), 16)
    far = cache.far_keys
    assert cache.far_active and cache.choice_keys is far and far.rows == cache.keys.rows == cache.pages.rows
    n = cache.pages.rows
    back = -torch.arange(cache.sink, cache.sink + n).expand(g.num_kv_heads, -1)
    for layer in range(g.num_layers):
        want = far.codec.encode(m.rotate_keys(layer, cache.pages.read(layer)[0], back).reshape(-1, g.head_dim))
        got = far.payload(layer)
        assert torch.equal(got["codes"][0, :, :n].reshape(want["codes"].shape), want["codes"])
    # a decode step's choice: each page's best key at far_distance from the query
    seen = {}
    real = PagedCache._choose_pages

    def spy(self, layer, q, k_all, plan, w):
        return seen.setdefault(layer, (q.clone(), real(self, layer, q, k_all, plan, w)))[1]

    PagedCache._choose_pages = spy
    try:
        feed(m, cache, ids(1, seed=7), 1, row_exact=True)
    finally:
        PagedCache._choose_pages = real
    p = cache.next_position - 1
    hkv, grp = g.num_kv_heads, m.spec.num_heads // g.num_kv_heads
    for layer, (q, (idx, _ok)) in seen.items():
        c = p - cache.window + 1 - cache.sink  # candidates [sink, p - window]
        keys = far.read(layer)[0][:, :c]  # decoded far codes (Hkv, c, D)
        qv = m.rotate_keys(layer, q.reshape(hkv, grp, g.head_dim), torch.full((hkv, grp), cache.far_distance - p))
        scores = (qv @ keys.transpose(1, 2)).amax(1)  # (Hkv, c): max over the group's query heads
        pages = torch.nn.functional.pad(scores, (0, -c % cache.page_size), value=float("-inf")).view(hkv, -1, cache.page_size).amax(-1)
        want = pages.topk(cache.recall_pages, -1).indices.sort(-1).values
        assert torch.equal(idx[:, 0].sort(-1).values, want), (layer, idx[:, 0], want)


@pytest.mark.parametrize("pages_codec", ["identity", "int8"])
def test_past_the_context_a_resumed_session_chooses_as_one_that_never_left(pages_codec):
    """far_keys are saved with the page store: a loaded session holds them (nothing rebuilt), and makes the same
    choices, so the logits are the same bit for bit. A state saved without them (an older file) makes them again
    from the page store at its first step: the same rows, the same logits, with a lossy page codec too (far_keys
    are made from the keys as the page store returns them on every path)."""
    from inference_engine.kv.paged import PagedCache

    m = short_context_model("int4")
    history, more = ids(120, seed=8), ids(24, seed=9)
    a = new_cache(m, paged(page_compressor=pages_codec), max_step=16)
    feed(m, a, history, 8)
    assert a.far_active and a.far_keys.rows == a.pages.rows
    b = new_cache(m, paged(page_compressor=pages_codec), max_step=16)
    b.load_state(a.state())
    assert not b.far_active and b.far_keys.rows == a.far_keys.rows
    built = []
    real = PagedCache._catch_up_far_keys
    PagedCache._catch_up_far_keys = lambda self: built.append(self.pages.rows - self.far_keys.rows) or real(self)
    try:
        c = new_cache(m, paged(page_compressor=pages_codec), max_step=16)
        st = a.state()  # a state is loaded once (a cache may keep views of it)
        st.tensors = {k: v for k, v in st.tensors.items() if not k.startswith("far_keys.")}
        c.load_state(st)
        assert c.far_keys.rows == 0 and c.pages.rows > 0
        rows = c.pages.rows
        want = feed(m, a, more, 1, row_exact=True)
        assert torch.equal(feed(m, b, more, 1, row_exact=True), want)
        assert set(built) == {0}  # b: nothing to make
        built.clear()
        assert torch.equal(feed(m, c, more, 1, row_exact=True), want)
        assert built[0] == rows and c.far_keys.rows == rows + 24  # c: the whole store at its first step
    finally:
        PagedCache._catch_up_far_keys = real
    for x in (b, c):
        n = x.far_keys.rows
        assert n == a.far_keys.rows and torch.equal(x.far_keys.payload(0)["codes"][..., :n, :], a.far_keys.payload(0)["codes"][..., :n, :])


def test_past_the_context_the_layout_must_fit_inside_it():
    m = short_context_model()
    cache = new_cache(m, paged(window=40, page=8, pages=4), max_step=16)  # reaches 4 + 40 + 32 = 76 >= 64
    feed(m, cache, ids(64), 16)
    with pytest.raises(ValueError, match="must stay under 64"):
        cache.prepare(range(64, 65))
    assert cache.next_position == 64


def test_the_packed_layout_puts_the_pages_in_order_before_the_window():
    m = short_context_model()
    cache = new_cache(m, paged(sink=4, window=12, page=8, pages=2))
    pages = torch.tensor([[1, 5], [0, 6]])  # per KV head, in position order
    d, sink_start = cache._far_slots(pages, torch.tensor(100))
    # slots: [100 - 12 - 16 + 1, ...] = 73..80 and 81..88; page j starts at 4 + 8 j; the sink right before: 69..72
    assert torch.equal(d, torch.tensor([[73 - 12, 81 - 44], [73 - 4, 81 - 52]]))
    assert torch.equal(sink_start, torch.tensor([69, 69]))


def test_the_spread_layout_keeps_order_and_spacing_within_far_from():
    """"spread": the chosen pages in position order, none overlapping another or the window, the gaps between them
    (and to the sink and the window) scaled down together so the query sees at most far_from positions; where the
    gaps fit (a query below far_from) every page and the sink sit at their true positions."""
    m = short_context_model()
    sink, window, size, f = 4, 12, 8, 48
    cache = new_cache(m, paged(sink=sink, window=window, page=size, pages=3, far_from=f, far_layout="spread"))
    g = torch.Generator().manual_seed(0)
    for p in (48, 49, 100, 1000, 100_000):
        n_pages = (p - window + 1 - sink) // size
        pages = torch.stack([torch.randperm(n_pages, generator=g)[:3].sort().values for _ in range(4)])  # 4 "heads"
        moves, sink_start = cache._far_slots(pages, torch.tensor(p))
        slots = sink + pages * size + moves
        assert bool((slots[:, 1:] - slots[:, :-1] >= size).all())  # order kept, no overlap
        assert bool((slots[:, -1] + size <= p - window + 1).all())  # before the window
        assert bool((sink_start + sink <= slots[:, 0]).all()) and bool((p - sink_start <= f - 1).all())  # within far_from
        starts = sink + pages * size
        true_gaps = starts - torch.cat([torch.full((4, 1), sink), starts[:, :-1] + size], 1)
        seen_gaps = slots - torch.cat([(sink_start + sink)[:, None], slots[:, :-1] + size], 1)
        assert bool((seen_gaps <= true_gaps).all()) and bool((seen_gaps >= 0).all())  # scaled down, never up
    pages = torch.tensor([[0, 2, 3]])
    moves, sink_start = cache._far_slots(pages, torch.tensor(47))  # below far_from: the gaps fit
    assert torch.equal(moves, torch.zeros_like(moves)) and int(sink_start) == 0
    packed = new_cache(m, paged(sink=sink, window=window, page=size, pages=3, far_from=f))
    for c in (cache, packed):  # a row that recalls nothing sees the sink next to its window in either layout
        assert int(c._far_slots(torch.empty(1, 0, dtype=torch.long), torch.tensor(500))[1]) == 500 - window + 1 - sink
    with pytest.raises(ValueError, match="unknown far layout 'near'"):
        paged(far_layout="near")


@pytest.mark.parametrize("chunk, row_exact", [(16, False), (1, True)])
def test_the_spread_layout_changes_nothing_below_far_from_and_differs_from_packed_past_it(chunk, row_exact):
    m = short_context_model("int4")  # trained context 64
    history, f = ids(120, seed=7), 40
    spread = feed(m, make_cache(paged(far_from=f, far_layout="spread"), m.geometry(), max_step=16, max_context=64),
                  history, chunk, row_exact)
    packed = feed(m, make_cache(paged(far_from=f), m.geometry(), max_step=16, max_context=64), history, chunk, row_exact)
    assert torch.equal(spread[:f], packed[:f]) and bool(torch.isfinite(spread).all())
    assert not torch.allclose(spread[f:], packed[f:], rtol=1e-3, atol=1e-3)


def test_rotate_keys_moves_a_positioned_key():
    """RoPE composes: a key positioned at p and rotated by d is the key positioned at p + d."""
    m = short_context_model()
    g = m.geometry()
    raw = torch.randn(g.num_kv_heads, 3, g.head_dim, generator=torch.Generator().manual_seed(0))
    at = {p: m.position_k(0, raw, m.rope(torch.tensor(p))) for p in ((5, 9, 30), (70, 200, 31))}
    moved = m.rotate_keys(0, at[(5, 9, 30)], torch.tensor([[65, 191, 1]]).expand(g.num_kv_heads, -1))
    torch.testing.assert_close(moved, at[(70, 200, 31)], rtol=1e-4, atol=1e-4)


def test_rotate_keys_moves_each_key_by_its_own_delta_in_any_order():
    """Distinct deltas out of order (unique() sorts them; one KV head, or a head's positions counting down) and
    every layer at once (layer None) move each key as a rotation of that key alone does."""
    m = short_context_model()
    g = m.geometry()
    k = torch.randn(g.num_layers, 1, 3, g.head_dim, generator=torch.Generator().manual_seed(2))
    deltas = torch.tensor([[-10, -12, -11]])
    for layer in range(g.num_layers):
        got = m.rotate_keys(layer, k[layer], deltas)
        for j in range(3):
            torch.testing.assert_close(got[:, j], m.rotate_keys(layer, k[layer][:, j:j + 1], deltas[:, j:j + 1])[:, 0])
    everyone = m.rotate_keys(None, k, deltas)
    assert torch.equal(everyone, torch.stack([m.rotate_keys(i, k[i], deltas) for i in range(g.num_layers)]))


def test_a_moved_row_attends_as_one_softmax_over_its_keys_rotated():
    """attend_moved_row counter-rotates the query per group of keys (q . R(d) k = R(-d) q . k): the same as one
    softmax over the keys rotated by their moves, the window's keys as they are."""
    from inference_engine.backends.torch.attention import attend_moved_row

    m = short_context_model()
    hkv, d = m.geometry().num_kv_heads, m.geometry().head_dim
    gen = torch.Generator().manual_seed(1)
    qj = torch.randn(1, hkv, 3, d, generator=gen)
    kp, vp = torch.randn(hkv, 2 * 4, d, generator=gen), torch.randn(hkv, 2 * 4, d, generator=gen)  # 2 pages of 4
    ks, vs = torch.randn(hkv, 2, d, generator=gen), torch.randn(hkv, 2, d, generator=gen)  # a sink of 2
    kw, vw = torch.randn(hkv, 5, d, generator=gen), torch.randn(hkv, 5, d, generator=gen)  # the window
    moves = torch.tensor([[-40, -9], [-33, -20]])[:hkv]  # per head and page
    hide = torch.zeros(5)
    hide[1] = float("-inf")  # a window column the row may not see
    page_bias = torch.zeros(hkv, 1, 8)
    page_bias[..., 7] = float("-inf")  # the last page's last row: past the row's candidates
    q = qj[0]
    q_pages = m.rotate_keys(0, q[:, None].expand(hkv, 2, 3, d).reshape(hkv, 6, d),
                            (-moves)[..., None].expand(hkv, 2, 3).reshape(hkv, 6)).view(hkv, 2, 3, d)
    q_sink = m.rotate_keys(0, q, torch.full((hkv, 3), 25))
    got = attend_moved_row(qj, [(q_pages, kp, vp, page_bias), (q_sink[:, None], ks, vs, None)], kw, vw, hide, 0.25)
    k = torch.cat([m.rotate_keys(0, kp, moves.repeat_interleave(4, 1)), m.rotate_keys(0, ks, torch.full((hkv, 2), -25)), kw], 1)
    v = torch.cat([vp, vs, vw], 1)
    bias = torch.cat([page_bias[:, 0], torch.zeros(hkv, 2), hide.expand(hkv, -1)], 1)[None, :, None]
    want = torch.softmax(qj @ k[None].transpose(-1, -2) * 0.25 + bias, -1) @ v[None]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_engine_generates_past_the_trained_context_with_paged():
    m = short_context_model()
    engine = Engine(m, paged(), prefill_chunk=32)
    assert engine.history_limit() is None
    kv = engine.new_session_kv()
    events = list(engine.generate(kv, ids(90), GenerateParams(max_tokens=20)))
    assert sum(isinstance(e, TokenGenerated) for e in events) == 20 and kv.next_position == 90 + 19


def test_engine_greedy_one_append_equals_token_by_token_appends():
    m = model()
    engine = Engine(m, paged(), prefill_chunk=32)
    history = ids(90)
    one = engine.new_session_kv()
    a = [e.token_id for e in engine.generate(one, history, GenerateParams(max_tokens=12)) if isinstance(e, TokenGenerated)]
    many = engine.new_session_kv()
    for t in history[:-1]:
        engine.prefill(many, [t])
    b = [e.token_id for e in engine.generate(many, history, GenerateParams(max_tokens=12)) if isinstance(e, TokenGenerated)]
    assert a == b


def test_strategy_validates_and_describes_paging():
    with pytest.raises(ValueError, match="page compressor"):
        KVStrategy("paged", page_compressor="zip")
    with pytest.raises(ValueError, match="recall_pages"):
        KVStrategy("paged", recall_pages=-1)
    d = KVStrategy("paged", 4, 508).describe()
    assert d["page_size"] == "64" and d["recall_pages"] == "8" and d["page_compressor"] == "identity"
    assert KVStrategy("paged").bounded and not KVStrategy("paged").forgets
    assert dataclasses.replace(KVStrategy("paged"), page_key_bits=8).page_key_bits == 8
    with pytest.raises(ValueError, match="shortlist_pages"):
        KVStrategy("paged", shortlist_pages=-1)
    assert KVStrategy("paged", shortlist_pages=32).describe()["shortlist_pages"] == "32"
    assert KVStrategy("paged").describe()["shortlist_from"] == "256"
    assert "shortlist_pages" not in KVStrategy("sink_window").describe()


def test_kakeya_serve_builds_a_paged_engine():
    from inference_engine.server.app import build_engine
    from inference_engine.server.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", "--kv-strategy", "paged", "--sink", "4", "--window", "60", "--page-size", "32",
                                      "--recall-pages", "4", "--page-compressor", "int8"])
    engine = build_engine(serve_config(args), model())
    # paged's default far_from: 4096 once past the trained context (docs/paged.md, "far_from once past the context"),
    # and past it a choice at every 4th position ("Choosing every N positions past the context")
    assert engine.strategy == KVStrategy("paged", 4, 60, page_size=32, recall_pages=4, page_compressor="int8",
                                         far_from=4096, far_after="context", choice_every=4)
    assert engine.strategy_info().name == "paged" and dict(engine.strategy_info().params)["recall_pages"] == "4"
    assert type(engine.new_session_kv().cache).__name__ == "PagedCache"
    for given, want in ((["--page-far-from", "0"], (0, "start")), (["--page-far-from", "2048"], (2048, "start")),
                        (["--page-far-from", "2048", "--page-far-after", "context"], (2048, "context")),
                        (["--window", "4000"], (0, "start"))):  # a layout reaching past 4096: the trained context
        st = serve_config(build_parser().parse_args(["serve", "--kv-strategy", "paged", *given])).strategy()[0]
        assert (st.far_from, st.far_after) == want, given
    assert serve_config(build_parser().parse_args(["serve"])).strategy()[0].far_from == 0  # sink_window: none


def test_merged_two_part_attention_portable_path_equals_the_cpu_kernel(monkeypatch):
    """Long steps attend resident and recalled keys in separate calls merged by log-sum-exp: through
    torch's CPU flash kernel here, through the portable fp32 path on other devices (CUDA). Same logits."""
    from inference_engine.backends.torch import attention as attention_module

    m = model()
    history = ids(120)
    merged = feed(m, new_cache(m, paged()), history, 32)
    monkeypatch.setattr(attention_module, "_FLASH_CPU", None)
    one_call = feed(m, new_cache(m, paged()), history, 32)
    torch.testing.assert_close(merged, one_call, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pages", [2, 100])  # some pages chosen (gathered rows) / every page (the table's views)
def test_row_exact_two_part_attention_portable_path_equals_the_cpu_kernel(monkeypatch, pages):
    """Row-exact steps attend the recalled rows and the resident slab in two calls merged by
    log-sum-exp; the portable path (CUDA's) gives the CPU flash kernel's logits."""
    from inference_engine.backends.torch import attention as attention_module

    m = model()
    history = ids(110)
    two_part = feed(m, new_cache(m, paged(pages=pages)), history, 3, row_exact=True)
    monkeypatch.setattr(attention_module, "_FLASH_CPU", None)
    one_call = feed(m, new_cache(m, paged(pages=pages)), history, 3, row_exact=True)
    torch.testing.assert_close(two_part, one_call, rtol=1e-5, atol=1e-5)


# -- a page shortlist (shortlist_pages): pages ranked by their key bounds, the best ones scored exactly -----------

def test_page_bounds_bound_every_key_of_their_page_and_survive_state():
    """The bound of a page, sum max(q * hi, q * lo), is >= q . k for each of its compact keys k; the bounds are
    kept for every complete page, count as the selection bytes (the compact keys move to the stored tier) and
    are rebuilt from the keys when a state is loaded."""
    m = model()
    g = m.geometry()
    cache = new_cache(m, paged(shortlist_pages=3, shortlist_from=0))
    feed(m, cache, ids(200), 16)
    p = cache.page_size
    assert cache.shortlisting
    assert cache.bounds.rows == cache.keys.rows // p > 3
    assert cache.selection_nbytes == cache.bounds.nbytes == cache.bounds.capacity * g.num_layers * 2 * g.num_kv_heads * g.head_dim * 2
    assert cache.stored_nbytes == cache.pages.nbytes + cache.keys.nbytes + cache.far_keys.nbytes  # far_keys idle
    q = torch.randn(g.num_kv_heads, 5, g.head_dim, generator=torch.Generator().manual_seed(1))
    for layer in range(g.num_layers):
        hi, lo = cache.bounds.read(layer).float()  # (Hkv, pages, D)
        keys = cache.keys.read(layer)[0][:, : cache.bounds.rows * p].view(g.num_kv_heads, -1, p, g.head_dim)
        exact = torch.einsum("hqd,hnpd->hqnp", q, keys).amax(-1)  # (Hkv, 5, pages): each page's best key
        bound = q.clamp(min=0) @ hi.transpose(1, 2) + q.clamp(max=0) @ lo.transpose(1, 2)
        assert bool((bound >= exact - 1e-4).all())
    again = new_cache(m, paged(shortlist_pages=3, shortlist_from=0))
    again.load_state(cache.state())
    assert again.bounds.rows == cache.bounds.rows
    assert torch.equal(again.bounds.data["rows"][:, :, :, : cache.bounds.rows], cache.bounds.data["rows"][:, :, :, : cache.bounds.rows])


def test_shortlisted_choice_does_not_depend_on_chunking():
    """INV-3 with a shortlist: a page's bound is a function of its codes only (stored, or made from a prefill
    chunk's still-resident keys), and a query ranks only the pages it sees whole."""
    m = model()
    history = ids(150)
    ref = feed(m, new_cache(m, paged(shortlist_pages=3, shortlist_from=0)), history, 64)
    for chunk, row_exact in ((1, False), (7, False), (5, True)):
        got = feed(m, new_cache(m, paged(shortlist_pages=3, shortlist_from=0)), history, chunk, row_exact=row_exact)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_the_needle_page_is_recalled_through_the_shortlist():
    m = model()
    cache = new_cache(m, paged(pages=1, shortlist_pages=2, shortlist_from=6))
    feed(m, cache, ids(120), 16)
    layer, needle = 0, 30  # page (30 - 4) // 8 = 3 of 13
    k = cache.pages.read(layer)[0][:, needle - 4]
    g = m.spec.num_heads // m.spec.num_kv_heads
    q = (k * 50).repeat_interleave(g, 0)[:, None]
    cache.prepare(range(120, 121))
    assert cache._step["n_pages"] > cache.shortlist_from
    sel = cache._choose(layer, q, cache.store.k[layer])
    cache.abort()
    assert sorted(set((sel[0, 0].nonzero().flatten() + 4).tolist())) == list(range(28, 36))


def test_up_to_shortlist_from_pages_the_choice_is_exact():
    m = model()
    history = ids(150)  # 17 candidate pages at most
    exact = feed(m, new_cache(m, paged(shortlist_pages=0)), history, 16)
    torch.testing.assert_close(feed(m, new_cache(m, paged(shortlist_pages=3, shortlist_from=17)), history, 16), exact, rtol=0, atol=0)
    assert not torch.equal(feed(m, new_cache(m, paged(shortlist_pages=3, shortlist_from=0)), history, 16), exact)


@pytest.mark.parametrize("arch, context, shortlist_pages, shortlist_from", [
    ("llama", None, 3, 6), ("llama", None, 3, 9), ("llama", 64, 3, 6), ("llama", 64, 3, 4), ("llama", 64, 1, 3),
    ("gemma3", None, 1, 5), ("gemma3", 64, 3, 6)])
def test_verify_blocks_across_shortlist_from_equal_one_token_steps(arch, context, shortlist_pages, shortlist_from):
    """A row chooses through the shortlist iff its own candidates span more than shortlist_from pages, as its one-token
    step does (and the native recall's tasks do), also in a block across that bound or across the trained context
    (64: both at once; shortlist_from <= 5: rows under the context shortlisted too, their page bounds made from their
    own keys' codes, not from the far-choice bounds table); on local-window layers (gemma3) too, where a row may see
    fewer pages than it recalls (the empty slots say page 0, as a one-token step's padding does). Verify blocks of 5
    and 7 give one-token steps' logits bit for bit (int4: row-independent linears; the Python path). Before, a block's
    rows all followed its last row."""
    from inference_engine.backends.torch.model import TorchCausalLM

    m = TorchCausalLM.load(str(tiny_model_dir(arch, **({"max_position_embeddings": context} if context else {}))),
                           weights="int4")
    assert m.native_step is None
    history = ids(150, seed=5)
    runs = {}
    for chunk in (1, 5, 7):
        cache = new_cache(m, paged(shortlist_pages=shortlist_pages, shortlist_from=shortlist_from), max_step=16)
        runs[chunk] = feed(m, cache, history, chunk, row_exact=True)
        assert cache.shortlisting
    assert torch.equal(runs[1], runs[5]) and torch.equal(runs[1], runs[7])


def test_page_bounds_round_outward_to_float16():
    m = model()
    cache = new_cache(m, paged(shortlist_pages=3, shortlist_from=0))
    codec = cache.keys.codec
    d = cache.geometry.head_dim
    x = torch.randn(4, 8, d, generator=torch.Generator().manual_seed(2)) * torch.tensor([1e-6, 1.0, 30.0, 300.0])[:, None, None]
    enc = codec.encode(x.reshape(-1, d))  # 4 pages of 8 keys, each at another scale
    hi, lo = cache._page_bounds(enc["codes"].view(4, 8, -1), enc["scale"].view(4, 8, 1)).float()  # (4, 1, D) each
    keys = codec.decode(enc).view(4, 8, d)
    assert bool((hi[:, 0] >= keys.amax(1)).all()) and bool((lo[:, 0] <= keys.amin(1)).all())
