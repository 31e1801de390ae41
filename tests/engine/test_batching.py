"""Continuous batching (engine/loop.py, steps.forward_batch): the engine loop advances every live
session to its next step and runs them as one forward; each session's output is bit for bit what it
is alone (int8/int4: row-independent kernels); a failing step fails only its own session;
cancellation and admission between forwards."""
import threading
import pytest
import torch

from drafters import HashDrafter
from factories import SlowModel, tiny_model_dir
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.engine.loop import EngineLoop, _Task
from inference_engine.engine.model_thread import ModelThread
from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import GenerateParams, SamplingParams
from inference_engine.engine.steps import StepInput, forward, forward_batch
from inference_engine.errors import CacheInvariantError
from inference_engine.kv.strategy import KVStrategy


def ids(n, seed):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def int4_model():
    return TorchCausalLM.load(str(tiny_model_dir("llama")), weights="int4")


def test_forward_batch_gives_each_session_its_solo_result():
    model = int4_model()
    strategies = [KVStrategy("full"), KVStrategy("sink_window", 4, 24), KVStrategy("full", kv_dtype="int8")]
    engine_of = [Engine(model, s, prefill_chunk=64) for s in strategies]
    solo, batched = [e.new_session_kv() for e in engine_of], [e.new_session_kv() for e in engine_of]
    for i, kv in enumerate(solo + batched):
        hist = ids(30 + 11 * (i % 3), i % 3)
        forward(model, model.tensor(hist), range(len(hist)), kv.cache)
        kv.cache.commit()
    steps = [[5], [7, 8, 9], [11]]  # a decode step, a verify-shaped block, a decode step
    want = []
    for kv, toks in zip(solo, steps):
        start = kv.cache.next_position
        want.append(forward(model, model.tensor(toks), range(start, start + len(toks)), kv.cache, row_exact=True))
        kv.cache.commit()
    inputs = [StepInput(model.tensor(t), range(kv.cache.next_position, kv.cache.next_position + len(t)), kv.cache, row_exact=True)
              for kv, t in zip(batched, steps)]
    got = forward_batch(model, inputs)
    for (gl, gh), (wl, wh) in zip(got, want):
        assert torch.equal(gl, wl) and torch.equal(gh, wh)


def run_concurrently(engine, jobs, started=None):
    """jobs: (history, params) per session, each generated on its own thread; returns token lists.
    started(): called once every thread is running, before they are joined."""
    out = [None] * len(jobs)

    def work(i, hist, params):
        kv = engine.new_session_kv()
        out[i] = [e.token_id for e in engine.generate(kv, hist, params) if isinstance(e, TokenGenerated)]

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    if started is not None:
        started()
    for t in threads:
        t.join()
    return out


def all_at_once(make_engine, jobs):
    """run_concurrently on an engine whose loop runs on a ModelThread held busy until every session's
    task is submitted: the first iteration then sees them all (no timing involved)."""
    mt, gate = ModelThread(name="test-batching"), threading.Event()
    try:
        engine = make_engine(mt)
        mt.post(gate.wait)  # the model thread waits here; iterations queue behind it

        def open_gate():
            while len(engine.loop._tasks) < len(jobs):  # every task submitted (none can finish while the gate is shut)
                threading.Event().wait(0.001)
            gate.set()

        return engine, run_concurrently(engine, jobs, open_gate)
    finally:
        gate.set()
        mt.close()


@pytest.mark.parametrize("drafter", [None, "hash"])
def test_concurrent_sessions_batched_equal_their_solo_runs(drafter):
    model = int4_model()
    kw = dict(drafter=HashDrafter(256), spec_k=3) if drafter else {}
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    jobs = [(ids(40 + 9 * i, i), GenerateParams(max_tokens=20, sampling=sampled if i % 2 else SamplingParams())) for i in range(5)]
    solo = Engine(model, KVStrategy("sink_window", 4, 24), prefill_chunk=16, batching="off", **kw)
    want = [run_concurrently(solo, [job])[0] for job in jobs]
    batched, got = all_at_once(lambda mt: Engine(model, KVStrategy("sink_window", 4, 24), prefill_chunk=16, batching="on",
                                                 model_thread=mt, prefill_chunk_shared=0, **kw), jobs)  # whole chunks
    assert got == want
    sizes = batched.loop.stats.batch_sizes
    assert max(sizes) == 5, sizes  # every live session rode the same forward


def test_every_live_session_rides_every_forward():
    """The loop advances every live session before each forward, so the schedule is exact: 4 sessions
    with 20-token prompts (prefill budget 32: one chunk per forward) start one forward apart, each
    rides every forward from its prefill to its last decode step, and nothing waits otherwise."""
    model = int4_model()
    jobs = [(ids(20, i), GenerateParams(max_tokens=12)) for i in range(4)]
    engine, _ = all_at_once(lambda mt: Engine(model, KVStrategy("full"), prefill_chunk=32, batching="on", model_thread=mt,
                                                prefill_chunk_shared=0), jobs)  # whole chunks: one per forward
    s = engine.loop.stats
    # forward k (1..4) prefills session k-1 beside the decode rows of those before it; each session then
    # decodes 11 steps (12 tokens, the first sampled from its prefill), so forwards 5..12 carry all 4.
    assert s.batch_sizes == {1: 2, 2: 2, 3: 2, 4: 9}, s.batch_sizes
    assert s.forwards == 15 and s.steps == 4 + 4 * 11


def test_auto_batching_is_on_only_where_exact():
    assert Engine(int4_model(), KVStrategy("full")).loop.batching
    assert not Engine(TorchCausalLM.load(str(tiny_model_dir("llama"))), KVStrategy("full")).loop.batching


def one_step(inp):
    """A task of a single forward: returns its result."""
    return (yield inp)


def test_a_failing_step_fails_only_its_session():
    """One session's cache breaks its invariant mid-batch: that session gets the error, the
    others' steps in the same forward complete with their solo results."""
    model = int4_model()
    engine = Engine(model, KVStrategy("full"), prefill_chunk=32, batching="on")
    kvs = [engine.new_session_kv() for _ in range(3)]
    for i, kv in enumerate(kvs):
        hist = ids(20, i)
        forward(model, model.tensor(hist), range(len(hist)), kv.cache)
        kv.cache.commit()
    good = [StepInput(model.tensor([4]), range(20, 21), kvs[i].cache, row_exact=True) for i in (0, 2)]
    bad = StepInput(model.tensor([4]), range(25, 26), kvs[1].cache, row_exact=True)  # positions skip ahead: INV-2
    loop = EngineLoop(model, 64)
    tasks = {name: loop.submit(one_step(inp)) for name, inp in (("a", good[0]), ("bad", bad), ("c", good[1]))}
    loop.iterate()  # all three post their step and share one (failing) forward, then run alone
    assert loop.stats.batch_sizes == {3: 1} and loop.stats.forwards == 1
    loop.iterate()  # each task gets its own result or error back, and ends
    assert all(t.done for t in tasks.values()) and not loop._tasks
    with pytest.raises(CacheInvariantError):
        list(loop.follow(tasks["bad"]))
    for name, i in (("a", 0), ("c", 2)):
        ref = engine.new_session_kv()
        hist = ids(20, i)
        forward(model, model.tensor(hist), range(20), ref.cache)
        ref.cache.commit()
        want, _ = forward(model, model.tensor([4]), range(20, 21), ref.cache, row_exact=True)
        assert torch.equal(tasks[name].value[0], want)
    assert kvs[1].cache.next_position == 20  # the bad session's cache is as before


def test_a_cancelled_session_leaves_the_others_unchanged():
    model = int4_model()
    jobs = [(ids(30, i), GenerateParams(max_tokens=16)) for i in range(3)]
    want = run_concurrently(Engine(model, KVStrategy("full"), batching="off"), jobs)
    engine = Engine(SlowModel(model), KVStrategy("full"), batching="on")
    out, stop = [None] * 3, threading.Event()

    def work(i):
        kv = engine.new_session_kv()
        got = []
        for e in engine.generate(kv, jobs[i][0], jobs[i][1], should_stop=stop.is_set if i == 1 else (lambda: False)):
            if isinstance(e, TokenGenerated):
                got.append(e.token_id)
                if i == 1 and len(got) == 4:
                    stop.set()
        out[i] = got

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == want[0] and out[2] == want[2]
    assert out[1] == want[1][: len(out[1])] and len(out[1]) < 16


def test_a_task_that_pauses_lets_the_others_go_on_between_its_pieces():
    """PAUSE: the task is advanced again by the next iteration, after the others (their forwards), so long host work
    done in pieces (a re-encode's copy) interleaves with them; it is no event for the caller."""
    from inference_engine.engine.loop import PAUSE

    lp = EngineLoop(None, 8)  # type: ignore[arg-type]  (these tasks post no forward)
    order = []

    def task(name, n):
        for i in range(n):
            order.append((name, i))
            yield PAUSE
        return name

    b = lp.submit(task("b", 3))
    assert list(lp.stream(task("a", 3))) == []  # no event
    assert lp.run(task("c", 0)) == "c" and b.done and b.value == "b"
    assert order == [("b", 0), ("a", 0), ("b", 1), ("a", 1), ("b", 2), ("a", 2)]


def test_take_fills_two_budgets_in_order_and_keeps_the_rest_queued():
    """The batch takes waiting steps in order: prefill chunks within the prefill budget, decode/
    verify steps within the row budget, the oldest always; a step that does not fit stays queued
    for the next forward (steps hold tensors: the queue must not compare them). "r" marks decode/verify
    rows (row-exact steps), "p" prefill chunks."""
    def waiting(loop, steps):
        tasks = [_Task(one_step(None), tokens=int(s[:-1]), rows=s[-1] == "r") for s in steps.split()]
        loop._waiting.extend(tasks)
        return tasks

    b = EngineLoop(None, 10, row_budget=3)
    first, big, d1, mid, d2, v3 = waiting(b, "4p 9p 1r 3p 1r 2r")
    assert b._take() == [first, d1, mid, d2]  # prefill 4+3 (9 does not fit), rows 1+1 (2 more would be 4 > 3)
    assert list(b._waiting) == [big, v3] and b.stats.queue_depth == 2
    assert b._take() == [big, v3]
    off = EngineLoop(None, 10, batching=False)
    first, d1 = waiting(off, "4p 1r")
    assert off._take() == [first] and off._take() == [d1]  # batching off: one step per forward
    shared = EngineLoop(None, 64, shared_prefill=8)
    a, b, c, d = waiting(shared, "8p 8p 1r 8p")
    assert shared._take() == [a, c]  # a decode row waits: prefill gets 8 tokens of this forward, not 64
    assert shared._take() == [b, d]  # no row waits: chunks up to the prefill budget


def test_a_short_prefill_chunk_counts_against_the_prefill_budget_not_the_rows():
    """Chunks of a few tokens (--prefill-chunk-shared 8, an append's last piece) are prefill whatever their size:
    with decode rows waiting, a forward takes one 8-token chunk, not every session's (counted as decode rows,
    eight sessions' short chunks rode one forward: 64 prefill rows at the decode rows' latency)."""
    shared = EngineLoop(None, 256, shared_prefill=8)
    chunks = [_Task(one_step(None), tokens=8) for _ in range(4)]
    rows = [_Task(one_step(None), tokens=1, rows=True) for _ in range(4)]
    shared._waiting.extend([x for pair in zip(chunks, rows) for x in pair])
    assert shared._take() == [chunks[0], *rows]
    assert list(shared._waiting) == chunks[1:]
    assert shared._take() == chunks[1:]  # no rows wait: up to the whole prefill budget


@pytest.mark.parametrize("threaded", [False, True])
def test_closing_a_turn_early_keeps_history_and_cache_in_step(threaded):
    """The caller stops reading after 3 tokens. On a model thread the loop may have run ahead of it;
    either way on_token recorded every token the turn emitted, the cache holds all of them but the
    last (sampled, not fed), and the task is gone."""
    model = int4_model()
    mt = ModelThread(name="test-close") if threaded else None
    try:
        engine = Engine(model, KVStrategy("full"), batching="on", model_thread=mt)
        kv, prompt = engine.new_session_kv(), ids(20, 0)
        history = list(prompt)
        it = engine.generate(kv, history, GenerateParams(max_tokens=50), on_token=history.append)
        got = [next(it).token_id for _ in range(3)]
        it.close()
        assert not engine.loop._tasks
        assert history[:20] == prompt and history[20:23] == got and len(history) < 20 + 50
        assert kv.next_position == len(history) - 1
        # the session goes on from there: the next turn prefills the last emitted token
        more = [e.token_id for e in engine.generate(kv, history, GenerateParams(max_tokens=2), on_token=history.append)
                if isinstance(e, TokenGenerated)]
        assert history[-2:] == more and kv.next_position == len(history) - 1
    finally:
        if mt is not None:
            mt.close()
