"""The worker's engine loop: jobs in, one engine step at a time, events out.

Celery task threads hand jobs to `Runner.submit` and wait; a single loop thread owns the engine, turns each
step's tokens into text, deltas and chunks for every job (detokenize -> parse -> chunks) and writes them all
with one Redis pipeline per step (publish).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from shared.protocol import Event, EventKind, Job, JobStatus, error_body
from worker import chunks
from worker.detokenize import TextStream
from worker.engine import Engine, Finish, Output, Sequence
from worker.parse import ContentParser, Delta, Parser
from worker.publish import JobEnd, Publisher, StepWrites
from worker.sampler import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Choice:
    index: int
    seq: Sequence
    text: TextStream
    parser: Parser
    content: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class JobRun:
    """One job's state inside the worker: its choices (engine sequences) and its event numbering."""

    def __init__(self, job: Job, tokenizer: Tokenizer, eos_ids: list[int], max_model_len: int):
        self.job = job
        self.done = threading.Event()
        self.status: JobStatus | None = None
        self.error: str | None = None
        self.last_seq = 0
        self.chunks = chunks.ChunkMaker(job.id, job.created, job.model)
        req = job.request
        prompt = job.prompt_ids
        self.eos_ids = frozenset(eos_ids)
        room = max_model_len - len(prompt)
        max_tokens = min(req.max_new_tokens or room, room)
        self.choices = []
        for i in range(req.n):
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                # Choices of one request must differ, yet stay reproducible under one seed.
                seed=None if req.seed is None else req.seed + i,
                stop_token_ids=self.eos_ids,
            )
            seq = Sequence(f"{job.id}/{i}", prompt, params, priority=req.priority)
            text = TextStream(tokenizer, req.stop, skip_special_tokens=req.skip_special_tokens)
            self.choices.append(Choice(i, seq, text, ContentParser()))

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.seq.output_ids) for c in self.choices)

    def _event(self, kind: EventKind, data: dict[str, Any] | None = None) -> Event:
        self.last_seq += 1
        return Event(seq=self.last_seq, event=kind, data=data)

    def start(self) -> list[Event]:
        return [
            self._event(EventKind.chunk, self.chunks.choice(c.index, {"role": "assistant", "content": ""}))
            for c in self.choices
        ]

    def on_output(self, choice: Choice, out: Output) -> tuple[list[Event], bool]:
        """Returns the events for one engine output and whether the engine must drop the sequence (a stop string)."""
        if choice.finish_reason is not None:  # already ended by a stop string
            return [], False
        delta = Delta()
        stop_now = False
        if out.token is not None:
            piece = choice.text.add(out.token)
            delta = _merge(delta, choice.parser.feed(piece.text))
            if piece.stop is not None:
                choice.finish_reason, choice.stop_reason = "stop", piece.stop
                stop_now = out.finish is None
        if out.finish is Finish.error:
            self.error = out.seq.error or "generation failed"
            choice.finish_reason = "error"
        elif out.finish is Finish.cancelled:
            choice.finish_reason = "abort"
        elif out.finish is not None and choice.finish_reason is None:
            choice.finish_reason = out.finish.value
            last = out.seq.output_ids[-1] if out.seq.output_ids else None
            if out.finish is Finish.stop and last not in self.eos_ids:
                choice.stop_reason = last
        if choice.finish_reason is not None and choice.finish_reason not in ("error", "abort"):
            if choice.stop_reason is None or isinstance(choice.stop_reason, int):
                delta = _merge(delta, choice.parser.feed(choice.text.flush()))
            delta = _merge(delta, choice.parser.finish())
        choice.content.append(delta.content)
        events = []
        if delta:
            events.append(self._event(EventKind.chunk, self.chunks.choice(choice.index, chunks.delta_json(delta))))
        if choice.finish_reason in ("stop", "length"):
            events.append(
                self._event(
                    EventKind.chunk,
                    self.chunks.choice(choice.index, {}, choice.finish_reason, choice.stop_reason),
                )
            )
        return events, stop_now

    def end(self) -> tuple[list[Event], JobEnd]:
        """The job's closing events and final record, once every choice finished."""
        prompt_tokens, completion_tokens = len(self.job.prompt_ids), self.completion_tokens
        if self.error is not None:
            body = error_body(self.error, "InternalServerError", 500)
            events = [self._event(EventKind.error, body), self._event(EventKind.done)]
            return events, JobEnd(self.job.id, JobStatus.failed, completion_tokens, error=body["error"])
        result = chunks.completion(
            self.job.id,
            self.job.created,
            self.job.model,
            [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": "".join(c.content)},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in self.choices
            ],
            prompt_tokens,
            completion_tokens,
        )
        status = JobStatus.cancelled if any(c.finish_reason == "abort" for c in self.choices) else JobStatus.completed
        events = []
        opts = self.job.request.stream_options
        if status is JobStatus.completed and opts is not None and opts.include_usage:
            events.append(self._event(EventKind.chunk, self.chunks.usage(prompt_tokens, completion_tokens)))
        events.append(self._event(EventKind.done))
        return events, JobEnd(self.job.id, status, completion_tokens, result=result)


def _merge(a: Delta, b: Delta) -> Delta:
    return Delta(a.content + b.content, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls)


class Runner:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        eos_ids: list[int],
        publisher: Publisher,
        max_model_len: int,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.publisher = publisher
        self.max_model_len = max_model_len
        self._new: queue.SimpleQueue[JobRun] = queue.SimpleQueue()
        self.runs: dict[str, JobRun] = {}
        self.by_seq: dict[str, tuple[JobRun, Choice]] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="chatq-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.engine.wakeup.set()
        self.thread.join(timeout=10)

    def submit(self, job: Job) -> JobRun:
        run = JobRun(job, self.tokenizer, self.eos_ids, self.max_model_len)
        self._new.put(run)
        self.engine.wakeup.set()
        return run

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception:  # a Redis outage or a bug in the loop itself: keep serving once it passes
                log.exception("engine loop iteration failed")
                self._stop.wait(0.5)

    def _iterate(self) -> None:
        writes = StepWrites()
        while True:
            try:
                run = self._new.get_nowait()
            except queue.Empty:
                break
            self.runs[run.job.id] = run
            writes.events.extend((run.job.id, e) for e in run.start())
            for c in run.choices:
                self.by_seq[c.seq.id] = (run, c)
                self.engine.add(c.seq)
        if not writes and not self.engine.has_work():
            self.engine.wakeup.wait(0.5)
            self.engine.wakeup.clear()
            return
        touched: dict[str, JobRun] = {}
        for out in self.engine.step():
            entry = self.by_seq.get(out.seq.id)
            if entry is None:  # the engine confirming a drop we asked for after the job had ended
                continue
            run, choice = entry
            touched[run.job.id] = run
            try:
                events, stop_now = run.on_output(choice, out)
            except Exception as e:  # one job's text handling must not sink the others
                log.exception("job %s failed while handling its output", run.job.id)
                run.error = f"output processing failed: {e}"
                events, stop_now = [], False
            if stop_now:
                self.engine.cancel(out.seq.id)
            if run.error:  # one failed choice fails the job: stop its siblings too
                for c in run.choices:
                    if c.finish_reason is None:
                        c.finish_reason = "error"
                        self.engine.cancel(c.seq.id)
            writes.events.extend((run.job.id, e) for e in events)
        ended = []
        for job_id, run in touched.items():
            if run.finished:
                events, end = run.end()
                writes.events.extend((job_id, e) for e in events)
                writes.ended.append(end)
                ended.append(run)
            else:
                writes.progress[job_id] = run.completion_tokens
        running = [job_id for job_id in self.runs if job_id not in {r.job.id for r in ended}]
        for job_id in self.publisher.flush(writes, running):
            for c in self.runs[job_id].choices:
                self.engine.cancel(c.seq.id)
        for run in ended:
            del self.runs[run.job.id]
            for c in run.choices:
                self.by_seq.pop(c.seq.id, None)
            run.status = JobStatus.failed if run.error else JobStatus.completed
            run.done.set()
