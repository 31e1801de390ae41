"""EngineLoop: the one scheduler loop every forward of an Engine goes through (continuous batching).

A session's work (a Generate turn, a prefill) is a *task*: a generator the loop advances. It
yields a `StepInput` when it needs a forward (the loop sends the forward's result back, or throws
its error in), `PAUSE` to let one iteration go by (long host work in pieces), and any other object as an
event for its caller (a token, a truncation, Done).
Everything a turn does between forwards - committing, sampling, drafting, stop checks - runs in
the task, on the thread that runs the loop, so the task's locals are the session's step state.

Each iteration:
  1. advance every task that is not waiting on a forward, up to its next StepInput (tasks that
     finished leave; their callers get their last events and the return value or error);
  2. take the waiting steps in posting order (the oldest always goes, so nothing starves) within a
     two-part budget: decode and verify steps (`StepInput.row_exact`) up to `row_budget` rows, prefill
     chunks up to `prefill_budget` tokens, a chunk of any size - so while long appends land chunk by chunk,
     every decoding session still advances one token per forward. While rows wait, `shared_prefill` is the
     forward's token budget: the rows first, prefill what they leave, at least half of it (vLLM's token
     budget, with a floor so prefill never starves): a forward's size, hence the rows' inter-token latency,
     stays about `shared_prefill` rows' however many sessions decode or prefill;
  3. run them as one forward (`steps.forward_batch`). A batch whose forward fails is run again one
     step at a time, so a bad step fails only its own session.

Because the loop advances every live task before it picks a batch, every session that is
generating has its next step in the batch: no leader election, no waiting to gather a batch.
New tasks join between iterations; a task that ends simply leaves.

Where it runs: on the daemon's ModelThread (engine/model_thread.py; an iteration is one job, and
other jobs - session loads, saves - run between iterations), or, in-process without one, on the
callers' threads: a caller whose task has no event ready runs an iteration itself (one at a time).

Exactness: forward_batch runs the linear layers on every session's rows at once and attention per
session; with row-independent kernels (int8/int4 weights) each session's logits are bit for bit
those of running alone, so batching is on by default only for those formats.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inference_engine.engine.steps import StepInput, forward_batch

if TYPE_CHECKING:
    from inference_engine.backends.protocol import Backend
    from inference_engine.engine.model_thread import ModelThread

log = logging.getLogger("kakeya")

Task = Generator[Any, Any, Any]  # yields StepInput (a forward to run), PAUSE or an event; returns the work's value


@dataclass
class BatchStats:
    """Counters the runtime exports as metrics (read without a lock: ints are atomic enough)."""

    forwards: int = 0
    steps: int = 0
    last_batch_size: int = 0
    queue_depth: int = 0  # steps waiting for a forward after the last batch was taken
    batch_sizes: dict = field(default_factory=dict)  # size -> forwards
    forward_seconds: float = 0.0  # wall time inside forwards (over the daemon's wall time: the model thread's busy share)
    row_tokens: int = 0  # decode/verify rows run
    prefill_tokens: int = 0  # prefill chunks' tokens run


_DONE = object()  # the last item of a task's event queue


class Pause:
    def __repr__(self) -> str:
        return "PAUSE"


# what a task yields to let one iteration go by (the other tasks' forward runs) before it goes on: long host work
# between its forwards (a re-encode's copy of a session's rows) done in pieces, so the others do not wait for all of it
PAUSE = Pause()


@dataclass(eq=False)
class _Task:
    co: Task
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    step: StepInput | None = None  # posted, waiting for a forward
    tokens: int = 0
    rows: bool = False  # the posted step is decode/verify rows (row-exact), not a prefill chunk
    result: Any = None  # the forward's result, sent at the next advance
    error: BaseException | None = None  # thrown in at the next advance
    abandoned: bool = False  # the caller went away: closed at the next advance
    value: Any = None  # what the task returned
    failure: BaseException | None = None  # what the task raised
    done: bool = False


class EngineLoop:
    def __init__(self, backend: Backend, prefill_budget: int, *, row_budget: int = 64, batching: bool = True,
                 shared_prefill: int = 0, model_thread: ModelThread | None = None):
        """backend: the model every forward runs; prefill_budget: prefill tokens per forward; row_budget:
        decode/verify rows per forward (the tokens of row-exact steps: decode steps and verify blocks).
        shared_prefill: while other tasks are live, a forward's tokens (decode/verify rows first, prefill chunks
        the rest, at least half of it; `prefill_share`); 0 = whole chunks, up to prefill_budget, always.
        model_thread: a ModelThread that runs the loop (the daemon's), or None to run it on the callers' threads."""
        self.backend = backend
        self.prefill_budget, self.row_budget = prefill_budget, row_budget
        self.batching = batching
        self.shared_prefill = shared_prefill
        self.model_thread = model_thread
        self.stats = BatchStats()
        self._lock = threading.Lock()  # guards _tasks, _scheduled and each task's abandoned flag
        self._drive = threading.RLock()  # one iteration at a time (re-entrant: a task may run a nested one)
        self._tasks: list[_Task] = []  # live, in arrival order
        self._waiting: deque[_Task] = deque()  # tasks with a posted step, in posting order
        self._scheduled = False  # an iteration job is queued on the model thread
        # called on the model thread each time the loop runs out of tasks (the daemon: freed heap back to the OS)
        self.on_idle: Callable[[], object] | None = None

    # -- callers ---------------------------------------------------------------------------
    def submit(self, co: Task) -> _Task:
        """Start `co` as a task (it is advanced by the next iteration); `follow` reads what it says."""
        t = _Task(co)
        with self._lock:
            self._tasks.append(t)
            mt = self.model_thread
            if mt is not None and not self._inline() and not self._scheduled:  # (not inline: there is a model thread)
                self._scheduled = True
                mt.post(self._job)
        return t

    def stream(self, co: Task) -> Iterator:
        """Run `co` as a task: its events as they come, then its return value (or what it raised)."""
        return self.follow(self.submit(co))

    def follow(self, t: _Task) -> Iterator:
        """A task's events as they come; returns its value (raising what it raised). Closing this iterator
        early closes the task at its next step boundary (its open step is aborted, so its cache is as
        before that step) and waits for that."""
        try:
            while True:
                ev = self._next_event(t)
                if ev is _DONE:
                    break
                yield ev
        finally:
            if not t.done:
                with self._lock:
                    t.abandoned = True
                while self._next_event(t) is not _DONE:
                    pass
        if t.failure is not None:
            raise t.failure
        return t.value

    def run(self, co: Task) -> Any:
        """Run `co` to its end, dropping its events; returns its value."""
        it = self.stream(co)
        while True:
            try:
                next(it)
            except StopIteration as stop:
                return stop.value

    def prefill_tokens(self, full: int) -> int:
        """Tokens a prefill chunk may take now: `full`, or while other tasks are live the prefill share of a
        forward next to the rows the decoding tasks post (each decoding task's last step: a row, or a verify
        block), so a long append costs them about one `shared_prefill`-token forward per token."""
        if self.batching and self.shared_prefill and len(self._tasks) > 1:
            return min(full, self.prefill_share(sum(t.tokens for t in list(self._tasks) if t.rows)))
        return full

    def prefill_share(self, rows: int) -> int:
        """Prefill tokens of a forward that carries `rows` decode/verify rows: what they leave of
        `shared_prefill`, at least half of it (never more than the prefill budget)."""
        return min(max(self.shared_prefill - rows, (self.shared_prefill + 1) // 2), self.prefill_budget)

    def _inline(self) -> bool:
        mt = self.model_thread
        return mt is None or threading.get_ident() == mt.ident

    def _next_event(self, t: _Task) -> Any:
        if self._inline():  # drive the loop until this task has something to say
            while True:
                try:
                    return t.events.get_nowait()
                except queue.Empty:
                    self.iterate()
        return t.events.get()

    def _job(self) -> None:
        """One iteration on the model thread; queued again while tasks are live."""
        try:
            self.iterate()
        except BaseException as e:  # a bug in the loop itself: fail every task rather than strand its caller
            log.exception("engine loop iteration failed")
            for t in list(self._tasks):
                self._finish(t, failure=e)
        with self._lock:
            idle = not self._tasks
            if not idle:
                mt = self.model_thread
                assert mt is not None  # _job is posted to the model thread only
                mt.post(self._job)
            else:
                self._scheduled = False
        if idle and self.on_idle is not None:  # a task submitted meanwhile waits for it: a few ms
            try:
                self.on_idle()
            except Exception:
                log.exception("the engine loop's idle hook failed")

    # -- the loop ----------------------------------------------------------------------------
    def iterate(self) -> None:
        """One iteration: advance every task not waiting on a forward, then run one forward."""
        with self._drive:
            for t in list(self._tasks):
                if t.step is None and not t.done:
                    self._advance(t)
            batch = self._take()
            if batch:
                self._execute(batch)

    def _advance(self, t: _Task) -> None:
        send, err = t.result, t.error
        t.result = t.error = None
        while True:
            try:
                if t.abandoned:
                    t.co.close()  # GeneratorExit at its yield: an open step is aborted
                    return self._finish(t)
                y = t.co.throw(err) if err is not None else t.co.send(send)
            except StopIteration as stop:
                return self._finish(t, value=stop.value)
            except BaseException as e:  # the task's own error: its caller gets it
                return self._finish(t, failure=e)
            send = err = None
            if y is PAUSE:  # advanced again by the next iteration, after the others' forward
                return None
            if isinstance(y, StepInput):
                t.step, t.tokens, t.rows = y, len(y.positions), y.row_exact
                self._waiting.append(t)
                return None
            t.events.put(y)

    def _finish(self, t: _Task, *, value: Any = None, failure: BaseException | None = None) -> None:
        t.value, t.failure, t.done = value, failure, True
        with self._lock:
            if t in self._tasks:
                self._tasks.remove(t)
        if t in self._waiting:
            self._waiting.remove(t)
        t.events.put(_DONE)

    def _take(self) -> list:
        """Waiting steps in posting order within the two budgets (the oldest always). While decode or verify
        rows wait, prefill chunks get what those rows leave of `shared_prefill` (when set; `prefill_share`),
        not the whole prefill budget: those rows' inter-token latency is one short forward's however many
        sessions are prefilling at once; a forward with no such rows packs chunks up to the prefill budget."""
        batch: list = []
        rows = prefill = 0
        rows_wait = sum(t.tokens for t in self._waiting if t.rows)
        prefill_budget = self.prefill_share(rows_wait) if rows_wait and self.shared_prefill else self.prefill_budget
        for t in list(self._waiting):
            if batch:
                if not self.batching:
                    break
                if t.rows and rows + t.tokens > self.row_budget or not t.rows and prefill + t.tokens > prefill_budget:
                    continue
            batch.append(t)
            rows, prefill = (rows + t.tokens, prefill) if t.rows else (rows, prefill + t.tokens)
            self._waiting.remove(t)
        self.stats.queue_depth = len(self._waiting)
        return batch

    def _execute(self, batch: list) -> None:
        s = self.stats
        s.forwards, s.steps, s.last_batch_size = s.forwards + 1, s.steps + len(batch), len(batch)
        s.batch_sizes[len(batch)] = s.batch_sizes.get(len(batch), 0) + 1
        rows = sum(t.tokens for t in batch if t.rows)
        s.row_tokens, s.prefill_tokens = s.row_tokens + rows, s.prefill_tokens + sum(t.tokens for t in batch) - rows
        t0 = time.perf_counter()
        try:
            for t, res in zip(batch, forward_batch(self.backend, [t.step for t in batch])):
                t.result = res
        except BaseException as e:
            if len(batch) == 1:
                batch[0].error = e
            else:  # each cache was rolled back: find the step that failed by running them one by one
                for t in batch:
                    try:
                        t.result = forward_batch(self.backend, [t.step])[0]
                    except BaseException as e1:
                        t.error = e1
        s.forward_seconds += time.perf_counter() - t0
        for t in batch:
            t.step = None
