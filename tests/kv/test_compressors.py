"""KVCompressor: identity and kakeyalattice D4/E8 stores (inference_engine/kv/compressors.py)."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from inference_engine.kv.compressor_lattice_codes import LatticeCodePacker
from inference_engine.kv.compressors import (
    CompressorInputError,
    EmptySlotError,
    KakeyaLatticeUnavailable,
    KVCompressor,
    bf16_reference_bytes,
    make_compressor,
)

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


def expected_bits_per_block(name: str, q: int) -> int:
    # Pre-clamp lattice points, parity of the last coordinate implied (layout in compressor_lattice_codes.py).
    if name == "kakeya_d4":
        count = (2 * q + 3) ** 3 * (q + 2)
    else:
        count = 2 * (2 * q + 4) ** 7 * (q + 2)
    assert count <= 1 << 62, "one int64 group per block; larger q splits blocks into groups"
    return (count - 1).bit_length()


@pytest.mark.parametrize("name", LATTICES)
@pytest.mark.parametrize(
    "hkv,t,d,q",
    [(1, 1, 64, 38), (3, 5, 64, 38), (3, 40, 64, 38), (2, 17, 128, 38), (4, 33, 256, 38), (2, 64, 64, 2),
     (2, 24, 128, 152), (1, 50, 32, 76)],
)
def test_decompress_equals_kakeyalattice_roundtrip(name, hkv, t, d, q):
    comp = make_compressor(name, q_range=q, head_dim=d, num_kv_heads=hkv, capacity=t + 7)
    k, v = random_kv(hkv, t, d, seed=t)
    slots = torch.randperm(t + 7, generator=torch.Generator().manual_seed(1))[:t]
    comp.compress(k, v, slots)
    k_hat, v_hat = comp.decompress(slots)
    codec = reference_codec(name, d, q)
    assert k_hat.dtype == torch.float32 and k_hat.shape == (hkv, t, d)
    assert torch.equal(k_hat, reference_roundtrip(codec, k))
    assert torch.equal(v_hat, reference_roundtrip(codec, v))


@pytest.mark.parametrize("name", LATTICES)
def test_bf16_input_matches_roundtrip_of_bf16(name):
    comp = make_compressor(name, head_dim=64, num_kv_heads=3, capacity=32)
    k, v = random_kv(3, 32, 64, dtype=torch.bfloat16)
    comp.compress(k, v, torch.arange(32))
    k_hat, v_hat = comp.decompress()
    codec = reference_codec(name, 64, 38)
    assert torch.equal(k_hat, codec.roundtrip(k)) and torch.equal(v_hat, codec.roundtrip(v))


@pytest.mark.parametrize("name", LATTICES)
def test_zero_vectors_and_the_fp16_norm_limit(name):
    comp = make_compressor(name, head_dim=64, num_kv_heads=2, capacity=20)
    k, v = random_kv(2, 20, 64)
    k[:, 3] = 0.0
    v[1, 7] = 1e-30
    comp.compress(k, v, torch.arange(20))
    codec = reference_codec(name, 64, 38)
    k_hat, v_hat = comp.decompress()
    assert torch.equal(k_hat, codec.roundtrip(k)) and torch.equal(v_hat, codec.roundtrip(v))
    assert not k_hat[:, 3].any()
    huge = k.clone()
    huge[0, 0] = 1e4  # norm 8e4 > fp16 max
    with pytest.raises(CompressorInputError, match="float16 range"):
        comp.compress(huge, v, torch.arange(20))


@pytest.mark.parametrize("name", LATTICES)
def test_decompress_any_subset_in_any_order(name):
    comp = make_compressor(name, head_dim=128, num_kv_heads=2, capacity=64)
    k, v = random_kv(2, 50, 128)
    comp.compress(k, v, torch.arange(50))
    pick = torch.tensor([42, 3, 17, 3, 0])
    k_hat, v_hat = comp.decompress(pick)
    codec = reference_codec(name, 128, 38)
    assert torch.equal(k_hat, codec.roundtrip(k)[:, pick]) and torch.equal(v_hat, codec.roundtrip(v)[:, pick])


@pytest.mark.parametrize("name", LATTICES)
def test_codes_do_not_depend_on_how_tokens_were_batched(name):
    # Chunked prefill and one-token decode steps must store what one big prefill stores.
    k, v = random_kv(3, 40, 128)
    whole = make_compressor(name, head_dim=128, num_kv_heads=3, capacity=40)
    whole.compress(k, v, torch.arange(40))
    pieces = make_compressor(name, head_dim=128, num_kv_heads=3, capacity=40)
    for a, b in [(0, 1), (1, 2), (2, 9), (9, 30), (30, 40)]:
        pieces.compress(k[:, a:b], v[:, a:b], torch.arange(a, b))
    assert torch.equal(whole._codes, pieces._codes) and torch.equal(whole._scalars, pieces._scalars)
    assert all(torch.equal(x, y) for x, y in zip(whole.decompress(), pieces.decompress()))


@pytest.mark.parametrize("name", LATTICES)
def test_codes_do_not_depend_on_the_thread_count(name):
    k, v = random_kv(1, 20, 128)
    stores = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        comp = make_compressor(name, head_dim=128, num_kv_heads=1, capacity=20)
        comp.compress(k, v, torch.arange(20))
        stores.append((comp._codes, comp._scalars, comp.decompress()[0]))
    assert all(torch.equal(a, b) for a, b in zip(*stores))


@pytest.mark.parametrize("name", LATTICES)
def test_reading_one_slot_equals_reading_it_among_many(name):
    comp = make_compressor(name, head_dim=128, num_kv_heads=1, capacity=30)
    k, v = random_kv(1, 30, 128)
    comp.compress(k, v, torch.arange(30))
    k_all, v_all = comp.decompress()
    for i in range(30):
        k_i, v_i = comp.decompress(torch.tensor([i]))
        assert torch.equal(k_i[:, 0], k_all[:, i]) and torch.equal(v_i[:, 0], v_all[:, i])


@pytest.mark.parametrize("name", LATTICES)
@pytest.mark.parametrize("hkv,d,q", [(3, 64, 38), (1, 128, 38), (2, 64, 76)])
def test_memory_bytes_is_the_documented_packed_layout(name, hkv, d, q):
    capacity = 48
    comp = make_compressor(name, q_range=q, head_dim=d, num_kv_heads=hkv, capacity=capacity)
    block_dim = 4 if name == "kakeya_d4" else 8
    code_bytes = math.ceil(d // block_dim * expected_bits_per_block(name, q) / 8)
    per_vector = code_bytes + 2 * 2  # packed point + fp16 norm + fp16 qmax
    assert comp.memory_bytes() == capacity * 2 * hkv * per_vector
    assert comp.bytes_per_slot == 2 * hkv * per_vector
    # Real packed tensors, not a float copy of the reconstruction.
    assert comp._codes.dtype == torch.uint8 and comp._codes.shape == (2, hkv, capacity, code_bytes)
    assert comp._scalars.dtype == torch.float16 and comp._scalars.shape == (2, hkv, capacity, 2)


def test_q38_bits_match_kakeyalattice_accounting():
    # 25 / 51 lattice bits per block at Q=38: kakeyalattice's own bits_per_token_per_head, minus its 32 bits of scalars.
    for name, block_bits in (("kakeya_d4", 25), ("kakeya_e8", 51)):
        comp = make_compressor(name, q_range=38, head_dim=128, num_kv_heads=1, capacity=1)
        assert comp.packer.bits_per_block == block_bits
        assert comp.packer.bits_per_vector + 32 == reference_codec(name, 128, 38).bits_per_token_per_head


@pytest.mark.parametrize("name", LATTICES)
def test_q38_head_dim_64_is_at_least_2_3x_smaller_than_bf16(name):
    capacity, hkv, d = 256, 3, 64
    comp = make_compressor(name, q_range=38, head_dim=d, num_kv_heads=hkv, capacity=capacity)
    ratio = bf16_reference_bytes(capacity, hkv, d) / comp.memory_bytes()
    assert comp.memory_bytes() * 2.3 <= bf16_reference_bytes(capacity, hkv, d)
    # 128 bf16 bytes per vector vs 50 + 4 (D4) / 51 + 4 (E8)
    assert ratio == pytest.approx(128 / (54 if name == "kakeya_d4" else 55))


@pytest.mark.parametrize("name", ["identity"] + LATTICES)
def test_evict_frees_slots_for_reuse_without_changing_bytes(name):
    comp = make_compressor(name, head_dim=64, num_kv_heads=2, capacity=10)
    held = comp.memory_bytes()
    k, v = random_kv(2, 10, 64)
    comp.compress(k, v, torch.arange(10))
    assert comp.memory_bytes() == held  # preallocated: writing does not grow the store
    k_before, _ = comp.decompress(torch.arange(10))

    comp.evict(torch.tensor([3, 4, 5]))
    assert comp.slots_in_use().tolist() == [0, 1, 2, 6, 7, 8, 9]
    assert comp.decompress()[0].shape == (2, 7, 64)
    with pytest.raises(EmptySlotError, match=r"\[4\]"):
        comp.decompress(torch.tensor([2, 4]))
    comp.evict(torch.tensor([4]))  # already free: no-op
    assert comp.memory_bytes() == held

    k2, v2 = random_kv(2, 3, 64, seed=5)
    comp.compress(k2, v2, torch.tensor([4, 3, 5]))  # reuse freed slots, out of order
    assert comp.memory_bytes() == held
    k_after, v_after = comp.decompress(torch.tensor([4, 3, 5, 0]))
    fresh = make_compressor(name, head_dim=64, num_kv_heads=2, capacity=3)
    fresh.compress(k2, v2, torch.arange(3))
    assert torch.equal(k_after[:, :3], fresh.decompress()[0]) and torch.equal(v_after[:, :3], fresh.decompress()[1])
    assert torch.equal(k_after[:, 3], k_before[:, 0])


@pytest.mark.parametrize("name", ["identity"] + LATTICES)
def test_ensure_capacity_grows_by_whole_slots_and_keeps_contents(name):
    comp = make_compressor(name, head_dim=64, num_kv_heads=2, capacity=4)
    k, v = random_kv(2, 4, 64)
    comp.compress(k, v, torch.arange(4))
    before = comp.decompress()
    per_slot = comp.bytes_per_slot
    comp.ensure_capacity(9)
    assert comp.capacity == 9 and comp.memory_bytes() == 9 * per_slot
    assert all(torch.equal(a, b) for a, b in zip(before, comp.decompress()))
    comp.compress(k[:, :1], v[:, :1], torch.tensor([8]))
    assert comp.slots_in_use().tolist() == [0, 1, 2, 3, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_round_trips_exactly(dtype):
    comp = make_compressor("identity", head_dim=64, num_kv_heads=3, capacity=16, dtype=dtype)
    assert isinstance(comp, KVCompressor)
    k, v = random_kv(3, 12, 64, dtype=dtype)
    slots = torch.arange(15, 3, -1)
    comp.compress(k, v, slots)
    k_hat, v_hat = comp.decompress(slots)
    assert k_hat.dtype == torch.float32
    assert torch.equal(k_hat, k.float()) and torch.equal(v_hat, v.float())
    assert comp.memory_bytes() == 2 * 3 * 16 * 64 * torch.tensor([], dtype=dtype).element_size()


def test_bf16_reference_bytes():
    assert bf16_reference_bytes(num_slots=10, num_kv_heads=3, head_dim=64) == 10 * 3 * 64 * 2 * 2


@pytest.mark.parametrize("name", ["identity"] + LATTICES)
def test_bad_inputs_raise_clear_errors(name):
    comp = make_compressor(name, head_dim=64, num_kv_heads=2, capacity=8)
    k, v = random_kv(2, 3, 64)
    with pytest.raises(CompressorInputError, match="head_dim=64"):
        comp.compress(k[..., :32], v[..., :32], torch.arange(3))
    with pytest.raises(CompressorInputError, match="num_kv_heads=2"):
        comp.compress(k[:1], v[:1], torch.arange(3))
    with pytest.raises(CompressorInputError, match="same shape"):
        comp.compress(k, v[:, :2], torch.arange(3))
    with pytest.raises(CompressorInputError, match="one slot per row"):
        comp.compress(k, v, torch.arange(2))
    with pytest.raises(CompressorInputError, match="repeat"):
        comp.compress(k, v, torch.tensor([1, 1, 2]))
    with pytest.raises(CompressorInputError, match=r"\[8\] outside \[0, 8\)"):
        comp.compress(k, v, torch.tensor([6, 7, 8]))
    with pytest.raises(CompressorInputError, match="integer"):
        comp.decompress(torch.tensor([0.0]))
    assert comp.slots_in_use().numel() == 0  # nothing half-written


@pytest.mark.parametrize("name", LATTICES)
def test_kakeya_rejects_what_its_codes_cannot_hold(name):
    with pytest.raises(CompressorInputError, match="power of two"):
        make_compressor(name, head_dim=96, num_kv_heads=1, capacity=4)
    with pytest.raises(CompressorInputError, match="q_range"):
        make_compressor(name, q_range=0, head_dim=64, num_kv_heads=1, capacity=4)
    comp = make_compressor(name, head_dim=64, num_kv_heads=1, capacity=4)
    k, v = random_kv(1, 2, 64)
    k[0, 1, 5] = float("nan")
    with pytest.raises(CompressorInputError, match="NaN"):
        comp.compress(k, v, torch.arange(2))


def test_unknown_name_lists_the_choices():
    with pytest.raises(CompressorInputError, match="identity, kakeya_d4, kakeya_e8"):
        make_compressor("kakeya_a2", head_dim=64, num_kv_heads=1, capacity=4)


def test_e8_needs_head_dim_multiple_of_8():
    with pytest.raises(CompressorInputError, match="multiple of 8"):
        make_compressor("kakeya_e8", head_dim=4, num_kv_heads=1, capacity=4)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "kakeyalattice", None)  # makes `import kakeyalattice` fail
    with pytest.raises(KakeyaLatticeUnavailable, match="pip install kakeyalattice"):
        make_compressor("kakeya_d4", head_dim=64, num_kv_heads=1, capacity=4)
    assert make_compressor("identity", head_dim=64, num_kv_heads=1, capacity=4).memory_bytes() > 0


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


@pytest.mark.parametrize("name", ["kakeya_d4", "kakeya_e8"])
def test_unchecked_row_paths_store_and_read_the_same_bits(name):
    checked = make_compressor(name, head_dim=64, num_kv_heads=3, capacity=40)
    unchecked = make_compressor(name, head_dim=64, num_kv_heads=3, capacity=40)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, 24, 64, generator=g), torch.randn(3, 24, 64, generator=g)
    slots = torch.randperm(40, generator=g)[:24]
    checked.compress(k, v, slots)
    unchecked.write_rows(k, v, slots)
    assert torch.equal(checked._codes, unchecked._codes) and torch.equal(checked._scalars, unchecked._scalars)
    ck, cv = checked.decompress(slots.flip(0))
    assert torch.equal(unchecked.read_rows(slots.flip(0)), torch.stack([ck, cv]))
    assert torch.equal(unchecked.slots_in_use(), checked.slots_in_use())


@pytest.mark.parametrize("name", ["kakeya_d4", "kakeya_e8"])
def test_a_cache_write_syncs_once_and_a_read_never(name):
    """A decode step writes one token and reads the live slots per layer; on an accelerator every
    host sync drains the launch queue, so the cache paths make one of their own (the write's checks;
    the codec's nearest-point step has its own `if mask.all()`) and none."""
    c = make_compressor(name, head_dim=64, num_kv_heads=3, capacity=80)
    c.write_rows(torch.randn(3, 68, 64), torch.randn(3, 68, 64), torch.arange(68))
    k1, v1, slot = torch.randn(3, 1, 64), torch.randn(3, 1, 64), torch.tensor([68])
    live = torch.arange(69)

    def syncs(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.name in ("aten::_local_scalar_dense", "aten::nonzero") for e in prof.events())

    codec_own = syncs(lambda: c.codec._closest_lattice_point(torch.randn(6, 64 // c.packer.block_dim, c.packer.block_dim)))
    assert syncs(lambda: c.write_rows(k1, v1, slot)) == codec_own + 1
    assert syncs(lambda: c.read_rows(live)) == 0
    assert syncs(lambda: c.free_rows(torch.tensor([3]))) == 0
    assert c.slots_in_use().tolist() == [s for s in range(69) if s != 3]
    with pytest.raises(CompressorInputError, match="inf or NaN"):  # the one sync still guards the store
        c.write_rows(torch.full((3, 1, 64), float("nan")), v1, torch.tensor([70]))
    assert not c._in_use[70]


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
