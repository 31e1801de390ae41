"""The quantized linears' packed tensors are kept next to the model (backends/torch/packed.py): a second load
reads them instead of packing again and computes the same logits bit for bit; a file made for other model
files is packed again; a directory that cannot be written costs only the packing."""
import os
import shutil

import pytest
import torch

from factories import tiny_model_dir
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.backends.torch.packed import PackedWeights


def logits(m):
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    cache = make_cache(KVStrategy("full"), m.geometry(), max_step=16, max_context=m.spec.max_context)
    ids = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(0))
    out, _ = forward(m, ids, range(12), cache)
    return m.to_host(out)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_second_load_reads_the_packed_weights_and_computes_the_same(tmp_path, weights, monkeypatch):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-packed-*"))
    first = TorchCausalLM.load(d, weights=weights)
    files = list(d.glob(".kakeya-packed-*.safetensors"))
    assert [f.name for f in files] == [f".kakeya-packed-{weights}.safetensors"]
    packed = PackedWeights(d, weights)
    assert packed.loaded  # its key matches this torch, CPU and model files

    built = []
    real = PackedWeights.store
    monkeypatch.setattr(PackedWeights, "store", lambda self, name, st: built.append(name) or real(self, name, st))
    second = TorchCausalLM.load(d, weights=weights)
    assert built == []  # nothing packed: every linear (and the head's quantized copies) came from the file
    assert torch.equal(logits(second), logits(first))

    st = d / "model.safetensors"
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))  # the model file changed
    assert not PackedWeights(d, weights).loaded
    third = TorchCausalLM.load(d, weights=weights)
    assert built and torch.equal(logits(third), logits(first))  # packed again, and written for the new key
    assert PackedWeights(d, weights).loaded


def test_a_read_only_model_directory_only_costs_the_packing(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-packed-*"))
    d.chmod(0o555)
    try:
        m = TorchCausalLM.load(d, weights="int4")
        assert not list(d.glob(".kakeya-packed-*")) and torch.isfinite(logits(m)).all()
    finally:
        d.chmod(0o755)


def test_the_file_is_read_as_safetensors_reads_it_aligned_and_a_truncated_one_is_packed_again(tmp_path):
    from safetensors import safe_open

    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-packed-*"))
    TorchCausalLM.load(d, weights="int4")
    path = d / ".kakeya-packed-int4.safetensors"
    packed = PackedWeights(d, "int4")
    with safe_open(str(path), framework="pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    assert packed.loaded.keys() == want.keys()
    for k, v in want.items():
        got = packed.loaded[k]
        assert got.dtype == v.dtype and torch.equal(got, v) and got.data_ptr() % 64 == 0, k
    path.write_bytes(path.read_bytes()[:-100])  # cut inside the last tensor
    assert not PackedWeights(d, "int4").loaded  # unreadable: logged, packed again
    m = TorchCausalLM.load(d, weights="int4")
    assert torch.isfinite(logits(m)).all() and PackedWeights(d, "int4").loaded  # and written anew


def test_the_native_heads_blocks_are_kept_and_read_back_the_same(tmp_path, monkeypatch):
    """native.head_blocks: the head's 4-bit blocks and their residual are written next to the model on the first
    native step and read (not made) on the next, the same bytes; another extension build (its key) makes them again."""
    from factories import require_native
    from inference_engine.backends.torch import native

    mod = require_native()
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-*"))
    m = TorchCausalLM.load(d, weights="int4")
    made = []
    real = native.q4_pack_residual
    monkeypatch.setattr(native, "q4_pack_residual", lambda *a: made.append(1) or real(*a))
    (d / ".kakeya-native-head-int4.safetensors").write_bytes(b"from before the tags")  # removed by the first write
    first = native.head_blocks(mod, m, m.head)
    ours = [f.name for f in d.glob(".kakeya-native-head-*")]
    assert made == [1] and len(ours) == 1 and ours[0].startswith(".kakeya-native-head-int4-")
    second = native.head_blocks(mod, m, m.head)
    assert made == [1] and torch.equal(second, first)  # read, not made
    fresh = torch.cat([native.q4_pack(mod, m.head.greedy_approx), real(mod, m.head.w, m.head.greedy_approx)])
    assert torch.equal(second, fresh)
    builds = [native.build_dir(), tmp_path / "row_step-another-build", tmp_path / "row_step-a-third-build"]
    monkeypatch.setattr(native, "build_dir", lambda: builds[1])
    assert torch.equal(native.head_blocks(mod, m, m.head), first) and made == [1, 1]  # another key: made again, beside
    theirs = sorted(set(f.name for f in d.glob(".kakeya-native-head-*")) - set(ours))
    assert len(theirs) == 1
    f = d / theirs[0]
    f.write_bytes(f.read_bytes()[:-100])  # cut inside the tensor: unreadable, logged, made again and written anew
    assert torch.equal(native.head_blocks(mod, m, m.head), first) and made == [1, 1, 1]
    assert torch.equal(native.head_blocks(mod, m, m.head), first) and made == [1, 1, 1]
    monkeypatch.setattr(native, "build_dir", lambda: builds[0])  # the first build again (a second checkout): still read
    assert torch.equal(native.head_blocks(mod, m, m.head), first) and made == [1, 1, 1]
    monkeypatch.setattr(native, "build_dir", lambda: builds[2])  # a third: made; the least recently used one removed
    assert torch.equal(native.head_blocks(mod, m, m.head), first) and made == [1, 1, 1, 1]
    kept = {f.name for f in d.glob(".kakeya-native-head-*")}
    assert len(kept) == 2 and ours[0] in kept and theirs[0] not in kept
    assert m.use_native_step() and (m.native_step.head_arena is not None) == (mod.q4_isa() > 0)


def test_the_native_layer_blocks_are_kept_and_read_back_the_same(tmp_path, monkeypatch):
    """native.layer_blocks: the layers' int4 linears packed as the kernel's blocks are written next to the model on
    the first native step and read (not packed) on the next, the same bytes as packing them; another extension build
    (its key) packs them again; a native step built from the file gives the same logits as one that packed them."""
    from factories import require_native
    from inference_engine.backends.torch import native
    from inference_engine.backends.torch.linear import Int4Linear

    mod = require_native()
    if not mod.q4_isa():
        pytest.skip("no int4 kernel on this CPU: the native step keeps torch's")
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-*"))
    m = TorchCausalLM.load(d, weights="int4")
    packs = []
    real = native.q4_pack
    lins = {(i, kind): lin for i, L in enumerate(m.layers) for kind, lin in zip(native.LINEAR_KINDS, (L.wqkv, L.wo, L.w_gate_up, L.w_down))
            if isinstance(lin, Int4Linear)}
    layer_ids = {id(lin) for lin in lins.values()}
    monkeypatch.setattr(native, "q4_pack", lambda mod_, lin: packs.append(id(lin) in layer_ids) or real(mod_, lin))
    first = native.layer_blocks(mod, m)
    assert set(first) == set(lins) and sum(packs) == len(lins) > 0
    assert [f.name[:len(".kakeya-native-layers-int4-")] for f in d.glob(".kakeya-native-layers-*")] == [".kakeya-native-layers-int4-"]
    second = native.layer_blocks(mod, m)
    assert sum(packs) == len(lins)  # read, not packed
    assert all(torch.equal(second[k], real(mod, lin)) for k, lin in lins.items())
    from_file = logits_of_native(m)
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path / "row_step-another-build")
    assert sum(packs) == len(lins)  # the native step above read them too
    assert all(torch.equal(native.layer_blocks(mod, m)[k], first[k]) for k in lins) and sum(packs) == 2 * len(lins)
    assert torch.equal(from_file, logits_of_native(m))  # packed again under the other key: the same logits


def logits_of_native(m) -> torch.Tensor:
    """A prefill's logits through a native step built now (from the blocks file, or packing where it has another key)."""
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    m.native_step = None
    assert m.use_native_step()
    cache = make_cache(KVStrategy("full"), m.geometry(), max_step=16, max_context=m.spec.max_context)
    logits, _ = forward(m, m.tensor(list(range(3, 15))), range(12), cache, logits="all", row_exact=True)
    cache.commit()
    return logits


def test_a_derived_file_removed_by_another_process_mid_save_is_skipped(tmp_path, monkeypatch):
    """Two daemons starting beside each other on one model directory each write their derived tensors and prune old
    versions: a version the other process removes between this one's listing and its look at the file's time is
    skipped (before, the FileNotFoundError ended the start), and the rest of the pruning still runs."""
    import pathlib

    from inference_engine.backends.torch import packed

    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d, ignore=shutil.ignore_patterns(".kakeya-*"))
    for tag in ("a", "b"):
        packed.save_derived_tensor(d, "probe", "int4", tag, torch.zeros(3))
    real_glob = pathlib.Path.glob

    def listing_with_a_vanished_file(self, pattern):
        found = list(real_glob(self, pattern))
        return found + [self / ".kakeya-probe-int4-000000000000.safetensors"] if "probe" in pattern else found

    monkeypatch.setattr(pathlib.Path, "glob", listing_with_a_vanished_file)
    packed.save_derived_tensor(d, "probe", "int4", "c", torch.ones(3))
    monkeypatch.undo()
    kept = sorted(f.name for f in d.glob(".kakeya-probe-int4-*"))
    assert len(kept) == packed.DERIVED_KEPT  # c and the most recently used other one
    assert torch.equal(packed.load_derived_tensor(d, "probe", "int4", "c"), torch.ones(3))
    assert packed.load_derived_tensor(d, "probe", "int4", "a") is None  # the oldest, pruned
