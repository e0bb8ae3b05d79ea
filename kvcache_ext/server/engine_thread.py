"""The one thread that owns the :class:`~kvcache_ext.Engine`: every change of Engine state happens on it.

HTTP handlers (on asyncio) hand it :class:`Job` s and cancellations through a thread-safe inbox; it
drains the inbox between steps (admitting and cancelling), steps, and hands each job's events back to
the job's event loop with ``loop.call_soon_threadsafe`` onto the job's asyncio queue:

- ``Accepted()``: the engine took the request (it raised nothing), sent before any token;
- ``Token(token_id)``: one generated token;
- ``Finished(result)``: the request's :class:`~kvcache_ext.engine.RequestResult`, the last event;
- ``Failed(status, message)``: refused (400: the engine's check of it failed) or failed in a step (500),
  or dropped at shutdown (503); the last event.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..engine import Engine, RequestResult, StepFailedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    pass


@dataclass(frozen=True)
class Token:
    token_id: int


@dataclass(frozen=True)
class Finished:
    result: RequestResult


@dataclass(frozen=True)
class Failed:
    status: int
    message: str


@dataclass(eq=False)
class Job:
    """One generation request (one choice of an HTTP request) on its way to the engine, and where its
    events go: ``queue`` (an ``asyncio.Queue`` of ``(index, event)``) on ``loop``."""

    prompt: list[int]
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0  # the choice this job is, within its HTTP request
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    request_id: int | None = field(default=None, init=False)  # the engine's id, once added

    def send(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, event))
        except RuntimeError:  # the loop is closed: nobody is left to read it
            pass


class QueueFullError(RuntimeError):
    """More requests wait than ``max_queued`` allows."""


@dataclass(frozen=True)
class _Cancel:
    job: Job


class EngineThread:
    """Runs ``engine`` on a thread of its own (``start``/``stop``). ``submit`` and ``cancel`` may be
    called from any thread. ``max_queued``: the most jobs waiting for the engine (in the inbox or
    the engine's queue) before ``submit`` refuses more. ``snapshot`` is the engine's state after its
    latest step, for metrics and health (a dict replaced whole, never changed in place)."""

    def __init__(self, engine: Engine, max_queued: int = 64, idle_wait: float = 0.05):
        if not isinstance(max_queued, int) or isinstance(max_queued, bool) or max_queued < 1:
            raise ValueError(f"max_queued must be a positive int, got {max_queued!r}")
        self.engine, self.max_queued, self.idle_wait = engine, max_queued, idle_wait
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox_size = 0  # jobs submitted and not drained yet
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}  # by engine request id, while unfinished
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-engine", daemon=True)
        self.steps_failed = 0
        self.tokens_generated = 0
        self.snapshot = self._engine_state()

    # -- any thread ------------------------------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (all or none): raises :class:`QueueFullError` if they would take the
        waiting requests past ``max_queued``, RuntimeError if the thread is not running."""
        if not self.is_alive():
            raise RuntimeError("the engine thread is not running")
        with self._lock:
            waiting = self._inbox_size + self.snapshot["requests_waiting"]
            if waiting + len(jobs) > self.max_queued:
                raise QueueFullError(f"{waiting} requests wait already (at most {self.max_queued})")
            self._inbox_size += len(jobs)
        for job in jobs:
            self._inbox.put(job)

    def cancel(self, job: Job) -> None:
        """Stop ``job`` at the next step (freeing its blocks); a finished job is left as it is."""
        self._inbox.put(_Cancel(job))

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread: jobs still running or queued fail with 503; a disk tier is written back."""
        self._stopping.set()
        self._inbox.put(None)  # wakes an idle thread
        if self._thread.is_alive():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    # -- the engine's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished:
                    self._step()
            except Exception as error:  # a bug of ours: fail what is in flight, keep serving
                log.exception("the engine thread failed; failing every request in flight")
                self._fail_all(500, f"the server failed: {type(error).__name__}: {error}")
            self.snapshot = self._engine_state()
        self._shut_down()

    def _drain(self, block: bool) -> None:
        """Admit and cancel whatever the inbox holds; wait a little for something if ``block``."""
        try:
            message = self._inbox.get(timeout=self.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while message is not None:  # None: stop() woke the thread
            if isinstance(message, Job):
                with self._lock:
                    self._inbox_size -= 1
                self._add(message)
            else:
                self._cancel(message.job)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break

    def _add(self, job: Job) -> None:
        if self._stopping.is_set():
            job.send(Failed(503, "the server is shutting down"))
            return
        generator = None if job.seed is None else torch.Generator().manual_seed(job.seed)
        try:
            job.request_id = self.engine.add_request(
                job.prompt,
                job.max_new_tokens,
                temperature=job.temperature,
                top_k=job.top_k,
                top_p=job.top_p,
                generator=generator,
                stop_ids=job.stop_ids,
            )
        except (ValueError, TypeError) as error:  # the engine's checks: the request's fault
            job.send(Failed(400, str(error)))
            return
        self._jobs[job.request_id] = job
        job.send(Accepted())
        self._finish_done()  # max_new_tokens=0 is done at once

    def _cancel(self, job: Job) -> None:
        if job.request_id in self._jobs:
            self.engine.cancel(job.request_id)
            self._finish_done()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except StepFailedError as failure:
            self.steps_failed += 1
            log.error("a step failed: %s", failure)
            events = failure.events
            for request_id in failure.failed:
                self._jobs.pop(request_id).send(Failed(500, f"generation failed: {failure.__cause__}"))
        self.tokens_generated += len(events)
        for request_id, token in events:
            job = self._jobs.get(request_id)
            if job is not None:
                job.send(Token(token))
        self._finish_done()

    def _finish_done(self) -> None:
        """Hand each finished job its result; the engine forgets them."""
        for request_id in [i for i in self._jobs if self.engine.is_finished(i)]:
            self._jobs.pop(request_id).send(Finished(self.engine.result(request_id)))
        self.engine.pop_finished()

    def _fail_all(self, status: int, message: str) -> None:
        for request_id, job in list(self._jobs.items()):
            try:
                self.engine.cancel(request_id)
            except Exception:  # the engine is in a state we do not know: the job fails all the same
                log.exception("cancelling request %s failed", request_id)
            job.send(Failed(status, message))
        self._jobs.clear()
        try:
            self.engine.pop_finished()
        except Exception:
            log.exception("collecting the failed requests failed")

    def _shut_down(self) -> None:
        self._drain(block=False)  # jobs still in the inbox are refused with 503
        self._fail_all(503, "the server is shutting down")
        if self.engine.cache.disk_tier is not None:
            self.engine.cache.write_back()
        self.snapshot = self._engine_state()

    def _engine_state(self) -> dict:
        engine, pool = self.engine, self.engine.cache.pool
        return {
            "time": time.time(),
            "requests_running": engine.num_running,
            "requests_waiting": engine.num_waiting,
            "blocks_free": pool.num_free_blocks,
            "blocks_used": pool.num_blocks - pool.num_free_blocks,
            "prefix": engine.prefix_stats(),
            "prompt_tokens_computed": engine.prompt_tokens_computed,
            "prompt_tokens_reused": engine.reused_tokens,
            "preemptions": engine.preemptions,
            "steps_failed": self.steps_failed,
            "tokens_generated": self.tokens_generated,
        }
