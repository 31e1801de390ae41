"""KVCodec (inference_engine/kv/compressors.py): kakeyalattice D4/E8 codecs, and the stores that
hold their payload (kv/stores.py: CompressedStore; identity = SlabStore)."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from inference_engine.kv.compressor_lattice_codes import LatticeCodePacker
from inference_engine.kv.compressors import (
    CompressorInputError,
    KakeyaLatticeUnavailable,
    KVCodec,
    bf16_reference_bytes,
    make_codec,
)
from inference_engine.kv.stores import CompressedStore, SlabStore, make_store

kakeyalattice = pytest.importorskip("kakeyalattice")

LATTICES = ["kakeya_d4", "kakeya_e8"]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny tensors gain nothing from a second thread and stall on a busy 2-core box.
    # Codes do not depend on it (test_codes_do_not_depend_on_the_thread_count).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_codec(name: str, head_dim: int, q_range: int):
    cls = kakeyalattice.V14KakeyaZamirLatticeGPU if name == "kakeya_d4" else kakeyalattice.V15KakeyaZamirE8GPU
    return cls(D=head_dim, q_range=q_range, device="cpu")


def reference_roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    """codec.roundtrip(x); with fewer than 16 rows, as part of a batch (MKL rounds tiny GEMMs differently)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] >= 16:
        return codec.roundtrip(x)
    filler = torch.randn(16, x.shape[-1], generator=torch.Generator().manual_seed(99))
    return codec.roundtrip(torch.cat([rows.float(), filler]))[: rows.shape[0]].reshape(x.shape)


def random_kv(hkv: int, t: int, d: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, t, d, generator=g) * 2.5
    v = torch.randn(hkv, t, d, generator=g)
    return k.to(dtype), v.to(dtype)


def roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x.reshape(-1, x.shape[-1]))).reshape(x.shape)


def new_store(name, *, head_dim=64, num_kv_heads=2, capacity=10, q_range=38, dtype=torch.float32, num_layers=1):
    return make_store(name, q_range, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      capacity=capacity, dtype=dtype, device="cpu")


def put(store, slots, k, v, layer=0):
    """Write k, v at `slots` and mark them occupied, as a cache step does."""
    slots = np.asarray(slots, dtype=np.int64)
    store.occupy(slots, slots)
    store.write(layer, store.slots_tensor(slots), k, v)


def get(store, slots, layer=0):
    return store.read(layer, store.slots_tensor(np.asarray(slots, dtype=np.int64)))


def expected_bits_per_block(name: str, q: int) -> int:
    # Pre-clamp lattice points, parity of the last coordinate implied (layout in compressor_lattice_codes.py).
    if name == "kakeya_d4":
        count = (2 * q + 3) ** 3 * (q + 2)
    else:
        count = 2 * (2 * q + 4) ** 7 * (q + 2)
    assert count <= 1 << 62, "one int64 group per block; larger q splits blocks into groups"
    return (count - 1).bit_length()


# -- the codec ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LATTICES)
@pytest.mark.parametrize(
    "hkv,t,d,q",
    [(1, 1, 64, 38), (3, 5, 64, 38), (3, 40, 64, 38), (2, 17, 128, 38), (4, 33, 256, 38), (2, 64, 64, 2),
     (2, 24, 128, 152), (1, 50, 32, 76)],
)
def test_decode_equals_kakeyalattice_roundtrip(name, hkv, t, d, q):
    codec = make_codec(name, q_range=q, head_dim=d)
    assert isinstance(codec, KVCodec)
    k, v = random_kv(hkv, t, d, seed=t)
    ref = reference_codec(name, d, q)
    for x in (k, v):
        x_hat = roundtrip(codec, x)
        assert x_hat.dtype == torch.float32 and x_hat.shape == (hkv, t, d)
        assert torch.equal(x_hat, reference_roundtrip(ref, x))


@pytest.mark.parametrize("name", LATTICES)
def test_bf16_input_matches_roundtrip_of_bf16(name):
    codec = make_codec(name, head_dim=64)
    k, v = random_kv(3, 32, 64, dtype=torch.bfloat16)
    ref = reference_codec(name, 64, 38)
    assert torch.equal(roundtrip(codec, k), ref.roundtrip(k)) and torch.equal(roundtrip(codec, v), ref.roundtrip(v))


@pytest.mark.parametrize("name", LATTICES)
def test_zero_vectors_and_the_fp16_norm_limit(name):
    codec = make_codec(name, head_dim=64)
    k, v = random_kv(2, 20, 64)
    k[:, 3] = 0.0
    v[1, 7] = 1e-30
    ref = reference_codec(name, 64, 38)
    k_hat, v_hat = roundtrip(codec, k), roundtrip(codec, v)
    assert torch.equal(k_hat, ref.roundtrip(k)) and torch.equal(v_hat, ref.roundtrip(v))
    assert not k_hat[:, 3].any()
    huge = k.clone()
    huge[0, 0] = 1e4  # norm 8e4 > fp16 max
    with pytest.raises(CompressorInputError, match="float16 range"):
        codec.encode(huge.reshape(-1, 64))


@pytest.mark.parametrize("name", LATTICES)
def test_codes_do_not_depend_on_how_rows_were_batched(name):
    # Chunked prefill and one-token decode steps must store what one big prefill stores.
    codec = make_codec(name, head_dim=128)
    rows = random_kv(1, 40, 128)[0][0]
    whole = codec.encode(rows)
    pieces = [codec.encode(rows[a:b]) for a, b in [(0, 1), (1, 2), (2, 9), (9, 30), (30, 40)]]
    for name_ in whole:
        assert torch.equal(whole[name_], torch.cat([p[name_] for p in pieces]))
    assert torch.equal(codec.decode(whole), torch.cat([codec.decode(p) for p in pieces]))


@pytest.mark.parametrize("name", LATTICES)
def test_codes_do_not_depend_on_the_thread_count(name):
    rows = random_kv(1, 20, 128)[0][0]
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        codec = make_codec(name, head_dim=128)
        payload = codec.encode(rows)
        runs.append((payload["codes"], payload["scalars"], codec.decode(payload)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("name", LATTICES)
@pytest.mark.parametrize("d,q", [(64, 38), (128, 38), (64, 76)])
def test_payload_is_the_documented_packed_layout(name, d, q):
    codec = make_codec(name, q_range=q, head_dim=d)
    block_dim = 4 if name == "kakeya_d4" else 8
    code_bytes = math.ceil(d // block_dim * expected_bits_per_block(name, q) / 8)
    assert codec.payload_layout() == {"codes": ((code_bytes,), torch.uint8), "scalars": ((2,), torch.float16)}
    assert codec.bytes_per_row == code_bytes + 2 * 2  # packed point + fp16 norm + fp16 qmax
    payload = codec.encode(torch.randn(5, d, generator=torch.Generator().manual_seed(0)))
    # Real packed tensors, not a float copy of the reconstruction.
    assert {k: (tuple(t.shape), t.dtype) for k, t in payload.items()} == {
        "codes": ((5, code_bytes), torch.uint8), "scalars": ((5, 2), torch.float16)}


def test_q38_bits_match_kakeyalattice_accounting():
    # 25 / 51 lattice bits per block at Q=38: kakeyalattice's own bits_per_token_per_head, minus its 32 bits of scalars.
    for name, block_bits in (("kakeya_d4", 25), ("kakeya_e8", 51)):
        codec = make_codec(name, q_range=38, head_dim=128)
        assert codec.packer.bits_per_block == block_bits
        assert codec.packer.bits_per_vector + 32 == reference_codec(name, 128, 38).bits_per_token_per_head
        assert codec.bytes_per_row * 8 >= reference_codec(name, 128, 38).bits_per_token_per_head


@pytest.mark.parametrize("name", LATTICES)
def test_codec_rejects_bad_rows_with_clear_errors(name):
    codec = make_codec(name, head_dim=64)
    with pytest.raises(CompressorInputError, match="head_dim=64"):
        codec.encode(torch.randn(3, 32))
    with pytest.raises(CompressorInputError, match=r"\(N, head_dim=64\)"):
        codec.encode(torch.randn(2, 3, 64))
    with pytest.raises(CompressorInputError, match="float tensor"):
        codec.encode(torch.zeros(3, 64, dtype=torch.int64))
    with pytest.raises(CompressorInputError, match="list"):
        codec.encode([[0.0] * 64])
    rows = torch.randn(2, 64)
    rows[1, 5] = float("nan")
    with pytest.raises(CompressorInputError, match="NaN"):
        codec.encode(rows)
    rows[1, 5] = float("inf")
    with pytest.raises(CompressorInputError, match="inf"):
        codec.encode(rows)
    empty = codec.encode(torch.zeros(0, 64))
    assert empty["codes"].shape == (0, codec.packer.code_bytes) and codec.decode(empty).shape == (0, 64)


@pytest.mark.parametrize("name", LATTICES)
def test_kakeya_rejects_what_its_codes_cannot_hold(name):
    with pytest.raises(CompressorInputError, match="power of two"):
        make_codec(name, head_dim=96)
    with pytest.raises(CompressorInputError, match="q_range"):
        make_codec(name, q_range=0, head_dim=64)
    with pytest.raises(CompressorInputError, match="q_range"):
        make_codec(name, q_range=1001, head_dim=64)
    with pytest.raises(CompressorInputError, match="power of two"):  # and through the store a cache builds
        new_store(name, head_dim=48)


def test_unknown_name_lists_the_choices_and_identity_is_no_codec():
    with pytest.raises(CompressorInputError, match="identity, kakeya_d4, kakeya_e8"):
        make_codec("kakeya_a2", head_dim=64)
    with pytest.raises(CompressorInputError, match="SlabStore"):
        make_codec("identity", head_dim=64)
    with pytest.raises(CompressorInputError, match="identity, kakeya_d4, kakeya_e8"):
        new_store("zstd")


def test_e8_needs_head_dim_multiple_of_8():
    with pytest.raises(CompressorInputError, match="multiple of 8"):
        make_codec("kakeya_e8", head_dim=4)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "kakeyalattice", None)  # makes `import kakeyalattice` fail
    with pytest.raises(KakeyaLatticeUnavailable, match="pip install kakeyalattice"):
        make_codec("kakeya_d4", head_dim=64)
    with pytest.raises(KakeyaLatticeUnavailable, match="pip install kakeyalattice"):
        new_store("kakeya_e8")
    assert new_store("identity").nbytes > 0


def test_bf16_reference_bytes():
    assert bf16_reference_bytes(num_slots=10, num_kv_heads=3, head_dim=64) == 10 * 3 * 64 * 2 * 2


# -- the compressed store: the only owner of payload bytes and occupancy ------------------


@pytest.mark.parametrize("name", LATTICES)
def test_store_reads_any_subset_in_any_order(name):
    store = new_store(name, head_dim=128, capacity=64)
    k, v = random_kv(2, 50, 128)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:50].numpy()
    put(store, slots, k, v)
    ref = reference_codec(name, 128, 38)
    pick = torch.tensor([42, 3, 17, 3, 0])
    k_hat, v_hat = get(store, slots[pick.numpy()])
    assert k_hat.dtype == torch.float32 and k_hat.shape == (2, 5, 128)
    assert torch.equal(k_hat, ref.roundtrip(k)[:, pick]) and torch.equal(v_hat, ref.roundtrip(v)[:, pick])


@pytest.mark.parametrize("name", LATTICES)
def test_reading_one_slot_equals_reading_it_among_many(name):
    store = new_store(name, head_dim=128, num_kv_heads=1, capacity=30)
    k, v = random_kv(1, 30, 128)
    put(store, np.arange(30), k, v)
    k_all, v_all = get(store, np.arange(30))
    for i in range(30):
        k_i, v_i = get(store, [i])
        assert torch.equal(k_i[:, 0], k_all[:, i]) and torch.equal(v_i[:, 0], v_all[:, i])
    k_none, v_none = get(store, [])
    assert k_none.shape == v_none.shape == (1, 0, 128)


@pytest.mark.parametrize("name", LATTICES)
def test_store_reads_in_its_dtype_what_the_codec_decodes(name):
    store = new_store(name, dtype=torch.bfloat16, num_kv_heads=3, capacity=16)
    k, v = random_kv(3, 12, 64, dtype=torch.bfloat16)
    put(store, np.arange(15, 3, -1), k, v)
    k_hat, v_hat = get(store, np.arange(15, 3, -1))
    assert k_hat.dtype == torch.bfloat16
    assert torch.equal(k_hat, roundtrip(store.codec, k).bfloat16()) and torch.equal(v_hat, roundtrip(store.codec, v).bfloat16())


@pytest.mark.parametrize("name", LATTICES)
@pytest.mark.parametrize("hkv,d,q", [(3, 64, 38), (1, 128, 38), (2, 64, 76)])
def test_store_bytes_are_the_packed_payload(name, hkv, d, q):
    capacity, layers = 48, 2
    store = new_store(name, q_range=q, head_dim=d, num_kv_heads=hkv, capacity=capacity, num_layers=layers)
    assert isinstance(store, CompressedStore)
    per_row = store.codec.bytes_per_row
    assert store.nbytes == layers * capacity * 2 * hkv * per_row
    for slabs in store.slabs:  # K and V stacked, one slab per payload name
        for pname, (shape, dtype) in store.codec.payload_layout().items():
            assert slabs[pname].shape == (2, hkv, capacity, *shape) and slabs[pname].dtype == dtype


@pytest.mark.parametrize("name", LATTICES)
def test_q38_head_dim_64_is_at_least_2_3x_smaller_than_bf16(name):
    capacity, hkv, d = 256, 3, 64
    store = new_store(name, q_range=38, head_dim=d, num_kv_heads=hkv, capacity=capacity)
    ratio = bf16_reference_bytes(capacity, hkv, d) / store.nbytes
    assert store.nbytes * 2.3 <= bf16_reference_bytes(capacity, hkv, d)
    # 128 bf16 bytes per vector vs 50 + 4 (D4) / 51 + 4 (E8)
    assert ratio == pytest.approx(128 / (54 if name == "kakeya_d4" else 55))


@pytest.mark.parametrize("name", ["identity"] + LATTICES)
def test_release_frees_slots_for_reuse_without_changing_bytes(name):
    store = new_store(name, capacity=10)
    held = store.nbytes
    k, v = random_kv(2, 10, 64)
    put(store, np.arange(10), k, v)
    assert store.nbytes == held  # preallocated: writing does not grow the store
    k_before, _ = get(store, np.arange(10))

    store.release(np.array([3, 4, 5]))
    assert store.occupied().tolist() == [0, 1, 2, 6, 7, 8, 9] and store.free_slots(5).tolist() == [3, 4, 5]
    store.release(np.array([4]))  # already free: no-op
    assert store.nbytes == held and store.resident == 7

    k2, v2 = random_kv(2, 3, 64, seed=5)
    put(store, [4, 3, 5], k2, v2)  # reuse freed slots, out of order
    assert store.nbytes == held and store.resident == 10
    k_after, v_after = get(store, [4, 3, 5, 0])
    fresh = new_store(name, capacity=3)
    put(fresh, np.arange(3), k2, v2)
    k_fresh, v_fresh = get(fresh, np.arange(3))
    assert torch.equal(k_after[:, :3], k_fresh) and torch.equal(v_after[:, :3], v_fresh)
    assert torch.equal(k_after[:, 3], k_before[:, 0])


@pytest.mark.parametrize("name", ["identity"] + LATTICES)
def test_resize_grows_by_whole_slots_and_compacts_bit_for_bit(name):
    store = new_store(name, capacity=4, num_layers=2)
    per_slot = store.nbytes // 4
    k, v = random_kv(2, 4, 64)
    for layer in (0, 1):
        put(store, np.arange(4), k, v, layer)
    before = get(store, np.arange(4), layer=1)
    store.resize(9)
    assert store.capacity == 9 and store.nbytes == 9 * per_slot
    assert all(torch.equal(a, b) for a, b in zip(before, get(store, np.arange(4), layer=1)))
    for layer in (0, 1):
        put(store, [8], k[:, :1], v[:, :1], layer)
    assert store.occupied().tolist() == [0, 1, 2, 3, 8]

    store.release(np.array([0, 2]))
    store.resize(5)  # resident rows move to the front, in slot order; bytes moved, not re-encoded
    assert store.capacity == 5 and store.nbytes == 5 * per_slot and store.pos.tolist() == [1, 3, 8, -1, -1]
    moved = get(store, np.arange(3), layer=1)
    assert torch.equal(moved[0][:, :2], before[0][:, [1, 3]]) and torch.equal(moved[1][:, :2], before[1][:, [1, 3]])
    assert torch.equal(moved[0][:, 2], before[0][:, 0])  # slot 8 held row 0 again


@pytest.mark.parametrize("name", ["identity"] + LATTICES)
def test_state_round_trips_the_stored_bytes(name):
    store = new_store(name, capacity=12, num_layers=2)
    k, v = random_kv(2, 7, 64)
    for layer in (0, 1):
        put(store, [9, 1, 4, 0, 11, 2, 6], k, v, layer)
    store.release(np.array([4]))
    state = store.state()
    assert all(t.device.type == "cpu" for t in state.values())
    again = new_store(name, capacity=3, num_layers=2)
    again.load_state(state)
    assert again.capacity == 12 and again.nbytes == store.nbytes and np.array_equal(again.pos, store.pos)
    for layer in (0, 1):
        want, got = get(store, store.occupied(), layer), get(again, again.occupied(), layer)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    if name != "identity":
        foreign = {"pos": state["pos"], "codes": state["codes"]}  # a payload name missing
        with pytest.raises(ValueError, match="does not fit"):
            new_store(name, capacity=3, num_layers=2).load_state(foreign)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_is_a_slab_store_that_round_trips_exactly(dtype):
    store = new_store("identity", num_kv_heads=3, capacity=16, dtype=dtype)
    assert isinstance(store, SlabStore)
    k, v = random_kv(3, 12, 64, dtype=dtype)
    slots = np.arange(15, 3, -1)
    put(store, slots, k, v)
    k_hat, v_hat = get(store, slots)
    assert k_hat.dtype == dtype and torch.equal(k_hat, k) and torch.equal(v_hat, v)
    assert store.nbytes == 2 * 3 * 16 * 64 * torch.tensor([], dtype=dtype).element_size()


@pytest.mark.parametrize("name", LATTICES)
def test_store_write_rejects_bad_shapes_and_bad_rows_writing_nothing(name):
    store = new_store(name, capacity=8)
    put(store, np.arange(3), *random_kv(2, 3, 64, seed=1))
    before = [{n: t.clone() for n, t in slabs.items()} for slabs in store.slabs]
    k, v = random_kv(2, 3, 64)
    slots = store.slots_tensor(np.arange(3, 6))
    with pytest.raises(CompressorInputError, match="head_dim"):
        store.write(0, slots, k[..., :32], v[..., :32])
    with pytest.raises(CompressorInputError, match=r"\(2, 3, 64\)"):
        store.write(0, slots, k[:1], v[:1])
    with pytest.raises(CompressorInputError, match="must both be"):
        store.write(0, slots, k, v[:, :2])
    with pytest.raises(CompressorInputError, match="len\\(slots\\)"):
        store.write(0, slots[:2], k, v)
    k[1, 2, 7] = float("nan")
    with pytest.raises(CompressorInputError, match="NaN"):
        store.write(0, slots, k, v)
    huge = v.clone()
    huge[0, 0] = 1e4
    with pytest.raises(CompressorInputError, match="float16 range"):
        store.write(0, slots, v, huge)
    for b, slabs in zip(before, store.slabs):  # nothing half-written
        assert all(torch.equal(b[n], slabs[n]) for n in slabs)


@pytest.mark.parametrize("name", LATTICES)
def test_a_cache_write_syncs_once_and_a_read_never(name):
    """A decode step writes one token and reads the live slots per layer; on an accelerator every
    host sync drains the launch queue, so the store makes one of its own (the codec's checks;
    the codec's nearest-point step has its own `if mask.all()`) and none on a read or a release."""
    store = new_store(name, num_kv_heads=3, capacity=80)
    put(store, np.arange(68), torch.randn(3, 68, 64), torch.randn(3, 68, 64))
    k1, v1, slot = torch.randn(3, 1, 64), torch.randn(3, 1, 64), store.slots_tensor(np.array([68]))
    live = store.slots_tensor(np.arange(69))
    store.occupy(np.array([68]), np.array([68]))

    def syncs(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.name in ("aten::_local_scalar_dense", "aten::nonzero") for e in prof.events())

    packer = store.codec.packer
    codec_own = syncs(lambda: store.codec.kakeya._closest_lattice_point(torch.randn(6, packer.blocks, packer.block_dim)))
    assert syncs(lambda: store.write(0, slot, k1, v1)) == codec_own + 1
    assert syncs(lambda: store.read(0, live)) == 0
    assert syncs(lambda: store.release(np.array([3]))) == 0
    assert store.occupied().tolist() == [s for s in range(69) if s != 3]


# -- the packer -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_dim,half", [(4, False), (8, True)])
@pytest.mark.parametrize("q", [1, 2, 38, 152])
def test_packer_round_trips_every_corner_of_the_point_box(block_dim, half, q):
    packer = LatticeCodePacker(head_dim=64, block_dim=block_dim, q_range=q, half_integer_coset=half)
    g = torch.Generator().manual_seed(q)
    n = 300
    lo, hi = -q - 1, q + 1  # integer coordinates (D4, E8 integer coset), in twice units below
    ints = torch.randint(lo, hi + 1, (n, packer.blocks, block_dim), generator=g)
    ints[:20] = hi  # box corners
    ints[20:40] = lo
    odd = (ints.sum(-1) & 1) == 1  # make sums even by moving the last coordinate inside the box
    ints[..., -1] += torch.where(odd, torch.where(ints[..., -1] < hi, 1, -1), 0)
    twice = 2 * ints
    if half:  # half-integer coset h + 1/2, h in [-q-2, q+1], sum(h) even
        h = torch.randint(-q - 2, q + 2, (n, packer.blocks, block_dim), generator=g)
        h[40:60] = q + 1
        h[60:80] = -q - 2
        odd = (h.sum(-1) & 1) == 1
        h[..., -1] += torch.where(odd, torch.where(h[..., -1] < q + 1, 1, -1), 0)
        use_half = torch.rand(n, packer.blocks, 1, generator=g) < 0.5
        use_half[40:80] = True
        twice = torch.where(use_half, 2 * h + 1, twice)
    packed = packer.pack(twice)
    assert packed.dtype == torch.uint8 and packed.shape == (n, packer.code_bytes)
    assert torch.equal(packer.unpack(packed), twice)
    assert torch.equal(packer.unpack_points(packed), twice.float() / 2)  # the cache's decode path


def test_packer_refuses_a_point_off_the_lattice():
    packer = LatticeCodePacker(head_dim=8, block_dim=4, q_range=38, half_integer_coset=False)
    odd_sum = torch.tensor([[[2, 0, 0, 0], [0, 0, 0, 0]]])  # twice-coords: (1, 0, 0, 0) has an odd sum
    with pytest.raises(RuntimeError, match="packable"):
        packer.pack(odd_sum)


def test_unpack_points_across_decode_chunks():
    """E8 decodes in column chunks of _UNPACK_CHUNK blocks; a read longer than one chunk (a `full`
    cache a few thousand tokens long) must decode every chunk, boundaries included."""
    from inference_engine.kv import compressor_lattice_codes as codes

    packer = LatticeCodePacker(head_dim=64, block_dim=8, q_range=38, half_integer_coset=True)
    n = codes._UNPACK_CHUNK // packer.blocks * 2 + 3  # two whole chunks and a short third
    g = torch.Generator().manual_seed(11)
    h = torch.randint(-39, 39, (n, packer.blocks, 8), generator=g)
    h[..., -1] += h.sum(-1) & 1  # even coordinate sum
    half = torch.rand(n, packer.blocks, 1, generator=g) < 0.5
    twice = torch.where(half, 2 * h + 1, 2 * h)
    packed = packer.pack(twice)
    assert torch.equal(packer.unpack_points(packed), twice.float() / 2)
