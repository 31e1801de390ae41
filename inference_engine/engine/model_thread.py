"""ModelThread: one OS thread that loads the model and runs every forward.

Why (measured, `results/research/model_thread.json`): torch's CPU build parallelises with GNU
OpenMP, which keeps one worker pool per OS thread that ever entered a parallel region. Once the
pools hold more threads than there are cores, libgomp stops spin-waiting between regions
(its "throttled" spin count, about 100 spins) and every one of the ~hundreds of parallel regions in
a decode step pays a futex wake-up. On this 2-core box the same int4 decode ran at ~75 tok/s on the
thread that loaded the model and at ~45 tok/s on a second thread; on a ModelThread at ~76.

So the daemon keeps exactly one multi-threaded pool: this thread sets torch's intra-op thread
count, loads the model and runs the EngineLoop (every forward); `isolate_other_threads()` then sets
the process default to one thread, so the gRPC workers (sampling, drafting, saving: small work)
run their torch ops inline and never create a pool of their own. torch's thread count is per OS
thread once a thread has run an op, so the model thread keeps its own.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("kakeya")


class ModelThread:
    def __init__(self, name: str = "kakeya-model"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if fut is None:  # posted: nobody waits on it
                try:
                    fn()
                except BaseException:  # noqa: BLE001 - logged; the thread goes on with the next job
                    log.exception("a job posted to the model thread failed")
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, who re-raises it
                fut.set_exception(e)

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the model thread and return its result (re-raising what it raised).
        Called on the model thread itself (a job submitting more work), fn runs inline."""
        if threading.current_thread() is self._thread:
            return fn()
        if not self._thread.is_alive():
            raise RuntimeError("the model thread has stopped")
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def post(self, fn: Callable[[], object]) -> None:
        """Queue fn to run on the model thread and return at once (the EngineLoop's iterations)."""
        self._jobs.put((fn, None))

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


def set_threads(n: int) -> None:
    """Intra-op threads for the calling thread (and the default for threads that start later)."""
    import torch

    torch.set_num_threads(n)
    # Run one parallel op so this thread's pool exists at n now (torch sizes a thread's pool lazily).
    torch.ones(1 << 16).sum()


def isolate_other_threads() -> None:
    """Call on a thread other than the model thread, after the model thread ran its first op:
    every thread that runs torch from now on (except those that already did) runs single-threaded."""
    set_threads(1)
