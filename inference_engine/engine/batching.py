"""StepBatcher: concurrent sessions' steps run as one batched forward (continuous batching).

Each session's generate loop stays a plain generator on its own thread; when it needs a
forward it calls `run(backend, [StepInput])` and blocks. Whichever waiting thread finds the
model idle becomes the leader: it takes the queued steps in arrival order (the oldest always
goes, so nothing starves) within a two-part token budget — decode and verify steps (at most
`small_step` rows each) up to `row_budget` rows, prefill chunks up to `prefill_budget` tokens
(one chunk: a large append lands one chunk per forward while every decoding session still
advances one token per forward, so inter-token latency is bounded by one chunk's forward) —
runs them through `steps.forward_batch` (on the model thread when there is one), hands each
thread its result, and the next leader takes what queued meanwhile. New sessions join between
forwards; a session that stops simply stops submitting.

Exactness: forward_batch runs the linear layers on every session's rows at once and attention
per session; with row-independent kernels (int8/int4 weights) each session's logits are bit for
bit those of running alone, so batching is on by default only for those formats. A batch whose
forward fails is retried one step at a time, so a session's bad step fails only that session.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from inference_engine.engine.steps import StepInput, forward_batch


@dataclass(eq=False)  # identity: the queue removes *this* step (field equality would compare tensors)
class _Pending:
    inp: StepInput
    tokens: int
    result: object = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    """Counters the runtime exports as metrics (read without the lock: ints are atomic enough)."""

    forwards: int = 0
    steps: int = 0
    last_batch_size: int = 0
    queue_depth: int = 0
    batch_sizes: dict = field(default_factory=dict)  # size -> forwards


class StepBatcher:
    def __init__(self, prefill_budget: int, *, row_budget: int = 64, small_step: int = 16, batching: bool = True,
                 model_thread=None, gather_s: float = 0.002, shared_prefill: int = 0):
        """prefill_budget: prefill tokens per forward; row_budget: decode/verify rows per forward
        (a step of at most `small_step` tokens counts as one of those). model_thread: a ModelThread
        that runs every forward (the daemon's; see model_thread.py), or None to run them on the
        leader's own thread (in-process use, tests)."""
        self.prefill_budget, self.row_budget, self.small_step = prefill_budget, row_budget, small_step
        self.batching = batching
        self.model_thread = model_thread
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._busy = False
        self._active = 0  # sessions inside a generate/prefill loop (engaged): a leader waits for their steps
        self.gather_s = gather_s
        self.shared_prefill = shared_prefill

    def prefill_tokens(self, full: int) -> int:
        """Tokens a session's next prefill chunk may take: `full`, or `shared_prefill` while another session
        is engaged (its decode rows ride in the same forwards, so a long append costs them one short chunk's
        forward per token, not a full chunk's)."""
        if self.batching and self.shared_prefill and self._active > 1:
            return min(full, self.shared_prefill)
        return full

    @contextlib.contextmanager
    def engaged(self):
        """A session's generate (or prefill) loop: while engaged it submits step after step, so a leader
        holds the forward until every engaged session's next step is queued, or `gather_s` has passed
        (a session busy elsewhere, e.g. drafting, delays the others by at most that). Without it,
        whichever session returns first leads with a batch of one while the others are still sampling."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def run(self, backend, inputs: list) -> list:
        """steps.forward_batch's signature for one session's step: blocks until it has run."""
        (inp,) = inputs
        me = _Pending(inp, len(inp.positions))
        with self._cond:
            self._queue.append(me)
            self.stats.queue_depth = len(self._queue)
            self._cond.notify_all()  # a leader gathering steps counts this one
            while not me.done:
                if self._busy:
                    self._cond.wait()
                    continue
                if self.batching and len(self._queue) < self._active:
                    deadline = time.monotonic() + self.gather_s
                    while len(self._queue) < self._active and not self._busy and (left := deadline - time.monotonic()) > 0:
                        self._cond.wait(left)
                    if self._busy or me.done:  # another thread led meanwhile
                        continue
                batch = self._take()
                self._busy = True
                self._cond.release()
                try:
                    self._execute(backend, batch)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self.stats.queue_depth = len(self._queue)
                    self._cond.notify_all()
        if me.error is not None:
            raise me.error
        return [me.result]

    def _take(self) -> list:
        """Queued steps in arrival order within the two budgets (the oldest always)."""
        batch: list = []
        rows = prefill = 0
        for p in list(self._queue):
            small = p.tokens <= self.small_step
            if batch:
                if not self.batching:
                    break
                if small and rows + p.tokens > self.row_budget or not small and prefill + p.tokens > self.prefill_budget:
                    continue
            batch.append(p)
            rows, prefill = (rows + p.tokens, prefill) if small else (rows, prefill + p.tokens)
            self._queue.remove(p)
        return batch

    def on_model(self, fn):
        """Run fn where forwards run: on the model thread when there is one, else right here."""
        return fn() if self.model_thread is None else self.model_thread.call(fn)

    def _forward(self, backend, inputs: list) -> list:
        return self.on_model(lambda: forward_batch(backend, inputs))

    def _execute(self, backend, batch: list) -> None:
        s = self.stats
        s.forwards, s.steps, s.last_batch_size = s.forwards + 1, s.steps + len(batch), len(batch)
        s.batch_sizes[len(batch)] = s.batch_sizes.get(len(batch), 0) + 1
        try:
            for p, res in zip(batch, self._forward(backend, [p.inp for p in batch])):
                p.result = res
        except BaseException as e:
            if len(batch) == 1:
                batch[0].error = e
            else:  # each cache was rolled back: find the step that failed by running them one by one
                for p in batch:
                    try:
                        p.result = self._forward(backend, [p.inp])[0]
                    except BaseException as e1:
                        p.error = e1
        for p in batch:
            p.done = True
