"""gguf_blocks reads a GGUF's tensor table from its header, skipping the metadata (gguf.GGUFReader parses all of
it, the tokenizer's strings included: ~3 s of every int4 daemon start); what it reads is what GGUFReader reads."""
import numpy as np
import pytest
import torch

from inference_engine.model_store import gguf_blocks


def write_gguf(path, alignment=None):
    """A small Llama-shaped GGUF: metadata of every value kind (string and number arrays, as a tokenizer's), Q4_1
    blocks of two layers' projections and an F32 tensor between them."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_name("tiny-q4_1")
    w.add_float32("test.scale", 0.5)
    w.add_bool("test.flag", True)
    w.add_uint64("test.big", 2**40)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 7 + 1) for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    w.add_array("tokenizer.ggml.token_type", [i % 5 for i in range(3000)])
    w.add_array("test.bools", [True, False, True])
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "ffn_down": (64, 96)}  # (N, K)
    for layer in range(2):
        for kind, (n, k) in shapes.items():
            raw = rng.integers(0, 256, (n, k // 32 * 20), dtype=np.uint8)
            raw.reshape(n, -1, 20)[..., :4] = np.frombuffer(rng.uniform(-1, 1, (n, k // 32, 2)).astype(np.float16).tobytes(),
                                                             np.uint8).reshape(n, k // 32, 4)  # finite d and m
            w.add_tensor(f"blk.{layer}.{kind}.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        w.add_tensor(f"blk.{layer}.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_tensor_table_and_blocks_are_what_ggufreader_reads(tmp_path, monkeypatch, alignment):
    from gguf import GGUFReader

    path = write_gguf(tmp_path / "m.gguf", alignment)
    reader = GGUFReader(str(path))
    table = gguf_blocks._tensor_table(path)
    assert table == [(t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    assert sum(t == gguf_blocks._Q4_1 for _, _, t, _ in table) == 8
    fast = gguf_blocks.q4_1_blocks(path, num_heads=4, num_kv_heads=2)
    monkeypatch.setattr(gguf_blocks, "_tensor_table", lambda p: None)  # GGUFReader's path
    slow = gguf_blocks.q4_1_blocks(path, num_heads=4, num_kv_heads=2)
    assert len(fast) == 8 and fast.keys() == slow.keys()
    for name in fast:
        assert all(torch.equal(a, b) for a, b in zip(fast[name], slow[name], strict=True)), name
    q, d, m = fast["model.layers.1.mlp.down_proj.weight"]
    assert q.shape == (64, 96) and d.shape == m.shape == (64, 3) and int(q.max()) <= 15


def test_a_file_it_does_not_read_goes_to_ggufreader(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))  # version 1: not read here
    assert gguf_blocks._tensor_table(path) is None
    path.write_bytes(b"NOPE" + bytes(20))
    assert gguf_blocks._tensor_table(path) is None
