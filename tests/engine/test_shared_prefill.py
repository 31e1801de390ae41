"""While another session generates, a prefill takes short chunks (--prefill-chunk-shared), so the
other session's decode rows wait one short chunk's forward; with row-independent int4 kernels the
prefilled session's tokens are bit for bit those of a full-chunk prefill."""
import contextlib

import pytest
import torch

from factories import tiny_model_dir
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine import steps
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.loop import EngineLoop, _Task
from inference_engine.engine.requests import GenerateParams
from inference_engine.kv.strategy import KVStrategy


def _prompt(n, seed=0):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("weights", ["int4", "int8"])  # the formats batching is on for (--batching auto)
def test_prefill_takes_short_chunks_while_another_session_is_engaged(monkeypatch, weights):
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights=weights)
    history = _prompt(70)
    chunks = []
    real = steps.prefill_chunk_task
    monkeypatch.setattr(steps, "prefill_chunk_task", lambda model, kv, ids: chunks.append(len(ids)) or real(model, kv, ids))

    def tokens(engine):
        kv = engine.new_session_kv()
        toks = [e.token_id for e in engine.generate(kv, history, GenerateParams(max_tokens=8)) if isinstance(e, TokenGenerated)]
        return toks, kv.last_logits

    strategy = KVStrategy("sink_window", 4, 24)
    alone = Engine(m, strategy, prefill_chunk=32, prefill_chunk_shared=8, batching="on")
    want = tokens(alone)
    assert chunks == [32, 32, 6]  # no other session engaged: whole chunks
    chunks.clear()
    shared = Engine(m, strategy, prefill_chunk=32, prefill_chunk_shared=8, batching="on")
    with generating(shared):  # another session generating (its decode rows ride along)
        chunks.clear()
        got = tokens(shared)
    assert chunks == [7] * 10  # the other session's decode row takes 1 of the forward's 8 tokens
    assert got[0] == want[0] and torch.equal(got[1], want[1])  # int4/int8 kernels are row-independent: bit for bit


@contextlib.contextmanager
def generating(engine):
    """Another session in the middle of a long generation (in-process, the loop runs on the caller's thread:
    it advances when someone waits on a task)."""
    other = engine.generate(engine.new_session_kv(), _prompt(5, seed=1), GenerateParams(max_tokens=500))
    next(other)  # its prompt prefilled, its first token out: a live task from here on
    try:
        yield
    finally:
        other.close()


def test_shared_chunks_only_with_batching_on():
    m = TorchCausalLM.load(tiny_model_dir("llama"), weights="int4")
    off = Engine(m, KVStrategy("full"), prefill_chunk=32, prefill_chunk_shared=8, batching="off")
    with generating(off):
        assert off.loop.prefill_tokens(32) == 32
    on = Engine(m, KVStrategy("full"), prefill_chunk=32, prefill_chunk_shared=0, batching="on")
    with generating(on):
        assert on.loop.prefill_tokens(32) == 32  # 0 = always the full chunk
    on8 = Engine(m, KVStrategy("full"), prefill_chunk=32, prefill_chunk_shared=8, batching="on")
    assert on8.loop.prefill_tokens(32) == 32  # alone
    with generating(on8):
        assert on8.loop.prefill_tokens(32) == 32  # the live task is the only one: still alone


def test_the_prefill_share_is_what_the_decode_rows_leave_of_the_forward_at_least_half():
    """--prefill-chunk-shared is a forward's token budget while others generate: their rows first (each decoding
    task's last step: a row, or a verify block of k + 1), prefill the rest, never under half the budget."""
    loop = EngineLoop(None, 256, shared_prefill=16)
    assert [loop.prefill_share(r) for r in (0, 1, 4, 8, 9, 64)] == [16, 15, 12, 8, 8, 8]
    assert EngineLoop(None, 256, shared_prefill=7).prefill_share(7) == 4  # half, rounded up
    assert EngineLoop(None, 32, shared_prefill=64).prefill_share(1) == 32  # never past the prefill budget
    me = _Task(iter(()))
    loop._tasks.append(me)
    assert loop.prefill_tokens(256) == 256  # alone: the whole chunk
    decoding = [_Task(iter(()), tokens=1, rows=True) for _ in range(3)] + [_Task(iter(()), tokens=5, rows=True)]
    prefilling = _Task(iter(()), tokens=32)  # another session's prefill: no rows of its own
    loop._tasks.extend([*decoding, prefilling])
    assert loop.prefill_tokens(256) == 16 - 3 - 5 and loop.prefill_tokens(6) == 6
    # at take time the budget follows the rows that wait: 4 rows leave 12 tokens; a chunk that does not fit waits
    waiting = [_Task(iter(()), tokens=12), _Task(iter(()), tokens=13), *[_Task(iter(()), tokens=1, rows=True) for _ in range(4)]]
    late = _Task(iter(()), tokens=12)
    loop._waiting.extend([*waiting, late])
    assert loop._take() == [waiting[0], *waiting[2:]] and list(loop._waiting) == [waiting[1], late]
