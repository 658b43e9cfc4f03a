"""The worker's engine loop: jobs in, one engine step at a time, events out.

Celery task threads hand jobs to `Runner.submit` and wait; a single loop thread owns the engine, routes each step's
outputs to the runs of their jobs (jobrun), which make the events, and writes them all in one Redis transaction per
step (publish). The loop only routes: what a job's state becomes is its run's to say.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from chatq.core.job import Event, Job
from chatq.core.model_info import ModelInfo
from chatq.core.settings import Settings
from chatq.worker.choice import Choice
from chatq.worker.detokenize import Decoder
from chatq.worker.device import DeviceLost
from chatq.worker.engine import Output, StepEngine
from chatq.worker.grammar import GrammarCompiler
from chatq.worker.jobrun import JobRun
from chatq.worker.lora import Library
from chatq.worker.publish import Outbox, Publisher, StepWrites, Written
from chatq.worker.timing import JobClock

log = logging.getLogger(__name__)


class Runner:
    def __init__(
        self,
        make_engine: Callable[[], StepEngine],
        model: ModelInfo,
        publisher: Publisher,
        *,
        settings: Settings,
        compiler: GrammarCompiler | None = None,
        library: Library | None = None,
    ):
        """`library`: the adapters its jobs run with, read as they come; None: it serves none."""
        self.make_engine = make_engine
        self.library = library
        self.engine: StepEngine
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self.model = model
        self.decoder = Decoder(model.tokenizer)
        self.publisher = publisher
        self.outbox: Outbox | None = None
        self.settings = settings
        self.compiler = compiler
        self._new: queue.SimpleQueue[JobRun] = queue.SimpleQueue()
        self._lost: queue.SimpleQueue[str] = queue.SimpleQueue()  # jobs another worker holds now
        self.runs: dict[str, JobRun] = {}
        self.by_seq: dict[str, tuple[JobRun, Choice]] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="chatq-engine", daemon=True)
        self.stepping_since: float | None = None  # time.monotonic() when the engine step under way began
        self.on_step: Callable[[float], None] | None = None  # given each step's seconds (the worker's metrics)
        self.lost: str | None = None  # why the engine's device was lost, once it was
        self.on_device_lost: Callable[[], None] | None = None  # then called on the engine thread, which ends

    def start(self) -> None:
        """Starts the engine thread and returns once the model is loaded in it."""
        self.thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise RuntimeError("the engine could not be built") from self._failed

    def stalled(self, limit: float) -> str | None:
        """Why this worker's engine cannot be counted on to make progress, or None while it can."""
        if self.lost is not None:
            return self.lost
        if not self.thread.is_alive():
            return "the engine thread has stopped"
        since = self.stepping_since
        if since is not None and (took := time.monotonic() - since) > limit:
            return f"an engine step has been running for {took:.0f} s"
        return None

    def stop(self) -> None:
        self._stop.set()
        self.engine.wakeup.set()
        self.thread.join(timeout=10)
        if self.outbox is not None:
            self.outbox.close()

    def submit(self, job: Job, log: list[Event] | None = None, clock: JobClock | None = None) -> JobRun:
        """Runs the job; with the log of an earlier attempt, from where that log stops. `clock`: its times so far
        (from its claimed record), for its metrics."""
        run = JobRun(
            job,
            self.model,
            self.decoder,
            settings=self.settings,
            compiler=self.compiler,
            clock=clock,
            library=self.library,
        )
        if log is not None and run.choices:
            run.resume(log)
        self._new.put(run)
        if not run.batch_line:
            self.engine.urgent.set()
        self.engine.wakeup.set()
        return run

    def _loop(self) -> None:
        # The model is loaded in the thread that runs it: torch keeps a compute-thread pool per calling thread, and
        # loading elsewhere leaves two pools fighting over the cores.
        try:
            self.engine = self.make_engine()
            on_gpu = str(getattr(self.engine, "device", "")).startswith("cuda")
            self.outbox = Outbox(self.publisher, threaded=on_gpu)
        except BaseException as e:
            self._failed = e
            raise
        finally:
            self._ready.set()
        while not self._stop.is_set():
            try:
                self._iterate()
            except DeviceLost as e:  # nothing runs on the GPU again in this process: its jobs must go elsewhere
                self.lost = str(e)
                log.critical("%s: the worker stops", e)
                if self.on_device_lost is not None:
                    self.on_device_lost()
                return
            except Exception:  # a Redis outage or a bug in the loop itself: keep serving once it passes
                log.exception("engine loop iteration failed")
                self._stop.wait(0.5)

    def holds(self, job_id: str) -> JobRun | None:
        return self.runs.get(job_id)

    def release(self, job_ids: list[str]) -> None:
        """Stops these jobs' runs without writing anything: they were handed to other workers."""
        for job_id in job_ids:
            self._lost.put(job_id)
        self.engine.wakeup.set()

    def _iterate(self) -> None:
        self._drop_lost()
        writes = StepWrites()
        # Cleared before the new jobs are taken: one submitted after that may still stop the coming step.
        self.engine.urgent.clear()
        touched = self._take_new(writes)
        if not writes and not touched and not self.engine.has_work():
            self.engine.wakeup.wait(0.5)
            self.engine.wakeup.clear()
            return
        outputs = self._step()
        now = time.time()
        for out in outputs:
            self._route(out, writes, touched, now)
        ended = self._close_or_progress(touched, writes)

        def written(said: Written) -> None:
            # May run in the outbox's thread: a run's choices are fixed once started, and engine.cancel acts at the
            # next step. Unstarted jobs stay in the cancel set until they start.
            for job_id in said.lost:
                self._lost.put(job_id)
            for job_id in said.cancelled:
                run = self.runs.get(job_id)
                for c in run.choices if run is not None else ():
                    self.engine.cancel(c.seq.id)
            # Only now may the Celery task return (and ack): the job's final record is in Redis.
            for run in ended:
                run.done.set()

        # A step with nothing to publish (a long prompt's prefill) still reads the cancels of the jobs running.
        if writes or self.runs:
            assert self.outbox is not None
            self.outbox.put(writes, written)

    def _take_new(self, writes: StepWrites) -> dict[str, JobRun]:
        """Starts the jobs submitted since the last step; those refused before generating anything, by id."""
        refused: dict[str, JobRun] = {}
        while True:
            try:
                run = self._new.get_nowait()
            except queue.Empty:
                return refused
            self.runs[run.job.id] = run
            writes.events.extend((run.job.id, e) for e in run.start())
            for c in run.choices:
                self.by_seq[c.seq.id] = (run, c)
                if c.finish_reason is None:  # a resumed job's choice may have finished in the earlier attempt
                    self.engine.add(c.seq)
            if run.finished:
                refused[run.job.id] = run

    def _drop_lost(self) -> None:
        """Stops, without a word to Redis, the runs of jobs that another worker holds now: the job goes on there."""
        while True:
            try:
                job_id = self._lost.get_nowait()
            except queue.Empty:
                return
            run = self.runs.pop(job_id, None)
            if run is None:
                continue
            log.warning(
                "job %s is held by another worker now: stopping this worker's run of it", job_id, extra=run.log_extra
            )
            for c in run.choices:
                self.by_seq.pop(c.seq.id, None)
                self.engine.cancel(c.seq.id)
            run.done.set()

    def _step(self) -> list[Output]:
        if not self.engine.has_work():
            return []
        self.stepping_since = start = time.monotonic()
        try:
            return self.engine.step()
        finally:
            self.stepping_since = None
            if self.on_step is not None:
                self.on_step(time.monotonic() - start)

    def _route(self, out: Output, writes: StepWrites, touched: dict[str, JobRun], now: float) -> None:
        """One engine output to the run of its job; its events into the step's writes, its drops to the engine."""
        entry = self.by_seq.get(out.seq.id)
        if entry is None:  # the engine confirming a drop we asked for after the job had ended
            return
        run, choice = entry
        touched[run.job.id] = run
        events, drop = run.handle(choice, out, now)
        for seq_id in drop:
            self.engine.cancel(seq_id)
        writes.events.extend((run.job.id, e) for e in events)

    def _close_or_progress(self, touched: dict[str, JobRun], writes: StepWrites) -> list[JobRun]:
        """Closes the jobs whose every choice finished, writes the progress of the others when due; the closed ones."""
        ended = []
        now = time.monotonic()
        for job_id, run in touched.items():
            if run.finished:
                events, end = run.end()
                writes.events.extend((job_id, e) for e in events)
                writes.ended.append(end)
                ended.append(run)
            elif (tokens := run.progress(now)) is not None:
                writes.progress[job_id] = tokens
        for run in ended:
            del self.runs[run.job.id]
            for c in run.choices:
                self.by_seq.pop(c.seq.id, None)
        return ended
