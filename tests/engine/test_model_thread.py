"""ModelThread (engine/model_thread.py): the daemon loads the model and runs every forward on one
OS thread, whichever thread a session's generate loop runs on; results and errors come back to
the caller; a daemon built by build_runtime routes its forwards there."""
import threading

import pytest

from factories import tiny_model_dir
from inference_engine.engine import loop
from inference_engine.engine.model_thread import ModelThread


def test_call_returns_raises_and_runs_inline_when_nested():
    mt = ModelThread(name="test-model-thread")
    try:
        assert mt.call(lambda: threading.get_ident()) == mt.ident != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            mt.call(lambda: 1 / 0)
        assert mt.call(lambda: 7) == 7  # still serving after a failed job
        assert mt.call(lambda: mt.call(lambda: threading.get_ident())) == mt.ident  # nested: inline, no deadlock
    finally:
        mt.close()
    with pytest.raises(RuntimeError, match="stopped"):
        mt.call(lambda: 1)


def test_daemon_forwards_run_on_the_model_thread(monkeypatch):
    from inference_engine.server.app import build_runtime, model_thread
    from inference_engine.server.config import ServeConfig

    seen = []
    real = loop.forward_batch

    def recording(backend, inputs):
        seen.append(threading.get_ident())
        return real(backend, inputs)

    monkeypatch.setattr(loop, "forward_batch", recording)
    cfg = ServeConfig(model=str(tiny_model_dir("llama")), persist="off", threads=1)
    runtime = build_runtime(cfg)
    assert runtime.engine.loop.model_thread is model_thread()
    sid = runtime.create_session([5, 6, 7]).id
    from inference_engine.engine.requests import SamplingParams

    out = []
    th = threading.Thread(target=lambda: out.extend(runtime.generate(sid, 4, SamplingParams())))
    th.start()
    th.join()
    assert len(out) == 5  # 4 tokens + done
    assert seen and set(seen) == {model_thread().ident}


def test_the_loop_calls_its_idle_hook_on_the_model_thread_when_work_runs_out():
    """EngineLoop.on_idle (the daemon's malloc_trim): called on the model thread once the last task has ended,
    after its value reached the caller; a hook that raises is logged and the loop keeps serving."""
    mt = ModelThread(name="test-idle-hook")
    try:
        lp = loop.EngineLoop(None, 8, model_thread=mt)  # type: ignore[arg-type]  (these tasks post no forward)
        called, where = threading.Event(), []

        def hook():
            where.append(threading.get_ident())
            called.set()
            raise RuntimeError("a failing hook")

        lp.on_idle = hook

        def task(v):
            return v
            yield  # a task: a generator that here posts no step

        assert lp.run(task(41)) == 41
        assert called.wait(60) and where == [mt.ident]
        called.clear()
        assert lp.run(task(42)) == 42  # still serving after the hook raised
        assert called.wait(60) and where == [mt.ident, mt.ident]
    finally:
        mt.close()
