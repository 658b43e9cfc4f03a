"""The worker's engine loop: jobs in, one engine step at a time, events out.

Celery task threads hand jobs to `Runner.submit` and wait; a single loop thread owns the engine, turns each
step's tokens into text, deltas and chunks for every job (detokenize -> parse -> chunks) and writes them all
with one Redis pipeline per step (publish).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer

from chatq.core import chunks
from chatq.core.chunks import TokenInfo
from chatq.core.delta import Delta
from chatq.core.protocol import ChatCompletionRequest, Event, EventKind, Job, JobStatus, RequestError, error_body
from chatq.core.settings import Settings
from chatq.worker.detokenize import TextStream
from chatq.worker.engine import Engine, Finish, Output, Sequence
from chatq.worker.grammar import Grammar, GrammarCompiler, GrammarState
from chatq.worker.parse import Message, Parser
from chatq.worker.plan import plan
from chatq.worker.publish import JobEnd, Outbox, Publisher, StepWrites

log = logging.getLogger(__name__)

PROGRESS_EVERY = 0.25  # seconds between progress writes of one job


@dataclass
class Choice:
    index: int
    seq: Sequence
    text: TextStream
    parser: Parser
    message: Message = field(default_factory=Message)
    logprobs: list[TokenInfo] = field(default_factory=list)
    unsent_logprobs: list[TokenInfo] = field(default_factory=list)
    reasoning_tokens: int = 0
    grammar: Grammar | None = None  # constrains the output once the reasoning ends
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Decoder:
    """Token ids -> strings for logprob entries, cached: the same few thousand ids come back all the time."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token = lru_cache(maxsize=65536)(self._token)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def info(self, token_id: int, logprob, top, offset: int) -> TokenInfo:
        return TokenInfo(self.token(token_id), logprob, [(self.token(t), lp) for t, lp in top], offset)


class JobRun:
    """One job's state inside the worker: its choices (engine sequences) and its event numbering."""

    def __init__(
        self,
        job: Job,
        decoder: Decoder,
        eos_ids: list[int],
        max_model_len: int,
        *,
        settings: Settings,
        defaults: dict | None = None,
        compiler: GrammarCompiler | None = None,
    ):
        self.job = job
        self.decoder = decoder
        self.done = threading.Event()
        self.status: JobStatus | None = None
        self.error: str | None = None
        self.rejected: dict[str, Any] | None = None
        self.last_seq = 0
        self.progress_at = 0.0
        self.eos_ids = frozenset(eos_ids)
        self.continuous_usage = False
        self.choices: list[Choice] = []
        try:
            self._prepare(max_model_len, settings, defaults or {}, compiler)
        except RequestError as e:  # e.g. a schema the grammar engine cannot compile: the request's fault
            self.rejected = error_body(e.message, "BadRequestError", 400, e.param)["error"]
            self.choices = []
        except Exception as e:  # a job that cannot start must end failed, not stay in progress with no one on it
            log.exception("job %s could not be prepared", job.id)
            self.error = f"preparing the job failed ({type(e).__name__})"
            self.choices = []

    def _prepare(
        self, max_model_len: int, settings: Settings, defaults: dict, compiler: GrammarCompiler | None
    ) -> None:
        job, decoder, req = self.job, self.decoder, self.job.request
        if isinstance(req, ChatCompletionRequest):
            self.chunks: chunks.ChatChunks = chunks.ChatChunks(job.id, job.created, job.model, req.response_role)
            last = req.messages[-1]
            self.echo = (last.text() or "") if req.echo and last.role == req.response_role else ""
            self.include_reasoning = req.include_reasoning
        else:
            self.chunks = chunks.TextChunks(job.id, job.created, job.model)
            # The prompt as sent, as vLLM echoes it; decoded only when it came as ids or was truncated.
            if not req.echo:
                self.echo = ""
            elif isinstance(req.prompt, str) and req.truncate_prompt_tokens is None:
                self.echo = req.prompt
            else:
                self.echo = decoder.tokenizer.decode(job.prompt_ids, skip_special_tokens=False)
            self.include_reasoning = True
        opts = req.stream_options
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        prompt = job.prompt_ids
        room = max_model_len - len(prompt)
        max_tokens = min(req.max_new_tokens or room, room)
        self.plan = plan(req, max_tokens, self.eos_ids, defaults, compiler, settings)
        # Hidden reasoning stays hidden: its tokens would show in logprobs (vLLM nulls them too).
        self.hide_logprobs = self.plan.reasoning and not self.include_reasoning
        # Tool-call markup may be special tokens (hermes' <tool_call> in Qwen): keep them for the parser to see.
        skip_special = req.skip_special_tokens and not (self.plan.tools_parsed and not self.plan.grammar)
        for i, params in enumerate(self.plan.params):
            seq = Sequence(f"{job.id}/{i}", prompt, params, priority=req.priority)
            parser = self.plan.make_parser()
            thinking = _thinking(parser)
            if self.plan.grammar is not None and not thinking:
                seq.grammar = GrammarState(self.plan.grammar)
            text = TextStream(
                decoder.tokenizer,
                req.stop,
                prompt_ids=prompt,
                skip_special_tokens=skip_special,
                include_stop=req.include_stop_str_in_output,
            )
            self.choices.append(Choice(i, seq, text, parser, grammar=self.plan.grammar if thinking else None))

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.seq.output_ids) for c in self.choices)

    def usage(self, choices: list[Choice] | None = None) -> dict[str, Any]:
        """Of all choices (the final usage), or of those given (a chunk's running usage: vLLM counts its choice)."""
        choices = self.choices if choices is None else choices
        completion = sum(len(c.seq.output_ids) for c in choices)
        reasoning = sum(c.reasoning_tokens for c in choices) if self.plan.reasoning else None
        return chunks.usage(len(self.job.prompt_ids), completion, reasoning)

    def _event(self, kind: EventKind, data: dict[str, Any] | None = None) -> Event:
        self.last_seq += 1
        if self.continuous_usage and data is not None and data.get("choices"):
            data["usage"] = self.usage([self.choices[c["index"]] for c in data["choices"]])
        event = Event(seq=self.last_seq, event=kind, data=data)
        # Encoded now, where a failure is this job's alone: in the step's writes, a value orjson refuses (a string
        # no UTF-8 encoder takes) would fail the writes of every job in the step.
        event.to_json()
        return event

    def start(self) -> list[Event]:
        events = []
        for c in self.choices:
            first = self.chunks.start(c.index)
            if first is not None:
                events.append(self._event(EventKind.chunk, first))
            if self.echo:
                echo = Delta(content=self.echo)
                c.message.add(echo)
                events.append(
                    self._event(EventKind.chunk, self.chunks.chunk(c.index, self.chunks.delta(c.index, echo)))
                )
        return events

    def on_output(self, choice: Choice, out: Output) -> tuple[list[Event], bool]:
        """Returns the events for one engine output and whether the engine must drop the sequence (a stop string)."""
        if choice.finish_reason is not None:  # already ended by a stop string
            return [], False
        delta = Delta()
        stop_now = False
        seq = out.seq
        # The token that ended the sequence (EOS, a stop token id) is not part of the text, unless the request asks
        # for its stops in the output (a special token such as EOS still shows only with skip_special_tokens off).
        req = self.job.request
        ended_by_token = (
            out.finish is Finish.stop and out.token in seq.params.stop_token_ids and not req.include_stop_str_in_output
        )
        if out.token is not None and not ended_by_token:
            if out.logprob is not None and not self.hide_logprobs:
                # Where the token's text begins: after the echo and all text decoded so far, held back or not.
                offset = len(self.echo) + choice.text.decoded
                lp = self.decoder.info(out.token, out.logprob.logprob, out.logprob.top, offset)
                choice.unsent_logprobs.append(lp)
            # min_tokens holds off stop strings as well as stop tokens.
            piece = choice.text.add(out.token, check_stops=len(seq.output_ids) > seq.params.min_tokens)
            thinking = _thinking(choice.parser)
            delta = choice.parser.feed(piece.text)
            # A token of the thought, not of its tags; one with no text yet (part of a character) counts too.
            if thinking and (delta.reasoning or not piece.text):
                choice.reasoning_tokens += 1
            if choice.grammar is not None and not _thinking(choice.parser):
                seq.grammar, choice.grammar = GrammarState(choice.grammar), None  # from the next token on
            if piece.stop is not None:
                choice.finish_reason, choice.stop_reason = "stop", piece.stop
                stop_now = out.finish is None
        if out.finish is Finish.error:
            self.error = seq.error or "generation failed"
            choice.finish_reason = "error"
        elif out.finish is Finish.cancelled:
            choice.finish_reason = "abort"
        elif out.finish is not None and choice.finish_reason is None:
            choice.finish_reason = out.finish.value
            last = seq.output_ids[-1] if seq.output_ids else None
            # A requested stop token id is named, even one that is also EOS when EOS is ignored (as vLLM names it).
            requested = last in seq.params.stop_token_ids and (req.ignore_eos or last not in self.eos_ids)
            if out.finish is Finish.stop and requested:
                choice.stop_reason = last
        ending = choice.finish_reason in ("stop", "length")
        if ending:
            if not isinstance(choice.stop_reason, str):  # no stop string: what was held back is plain text
                delta = _merge(delta, choice.parser.feed(choice.text.flush()))
            delta = _merge(delta, choice.parser.finish())
            made_calls = bool(choice.message.tool_calls or delta.tool_calls)
            if choice.finish_reason == "stop" and made_calls and not self.plan.named_tool:
                choice.finish_reason = "tool_calls"
        if not self.include_reasoning:
            delta.reasoning = ""
        choice.message.add(delta)
        events = []
        if delta:
            events.append(
                self._event(
                    EventKind.chunk,
                    self.chunks.chunk(
                        choice.index, self.chunks.delta(choice.index, delta), self._take_logprobs(choice)
                    ),
                )
            )
        # A cancelled choice ends its stream with `abort` too, as one cancelled while queued does (and vLLM ends an
        # aborted one): a stream reader learns what a poller of the job sees.
        if ending or choice.finish_reason == "abort":
            events.append(
                self._event(
                    EventKind.chunk,
                    self.chunks.chunk(
                        choice.index, {}, self._take_logprobs(choice), choice.finish_reason, choice.stop_reason
                    ),
                )
            )
        return events, stop_now

    def _take_logprobs(self, choice: Choice) -> dict[str, Any] | None:
        if choice.seq.params.logprobs is None or not choice.unsent_logprobs:
            return None
        tokens, choice.unsent_logprobs = choice.unsent_logprobs, []
        choice.logprobs.extend(tokens)
        return self.chunks.logprobs(tokens)

    def end(self) -> tuple[list[Event], JobEnd]:
        """The job's closing events and final record, once every choice finished."""
        seq = self.last_seq
        try:
            return self._end()
        except Exception as e:  # this job fails alone; the step's other writes must still go out
            log.exception("job %s failed while building its result", self.job.id)
            self.last_seq, self.rejected = seq, None  # no gap in the event numbers
            self.error = f"building the result failed ({type(e).__name__})"
            return self._end()

    def _end(self) -> tuple[list[Event], JobEnd]:
        completion_tokens = self.completion_tokens
        if self.rejected is not None:
            events = [self._event(EventKind.error, {"error": self.rejected}), self._event(EventKind.done)]
            return events, JobEnd(self.job.id, JobStatus.failed, 0, error=self.rejected)
        if self.error is not None:
            body = error_body(self.error, "InternalServerError", 500)
            events = [self._event(EventKind.error, body), self._event(EventKind.done)]
            return events, JobEnd(self.job.id, JobStatus.failed, completion_tokens, error=body["error"])
        final = []
        for c in self.choices:
            content, reasoning, tool_calls = c.message.result()
            if self.plan.reasoning and not content:
                content = None  # vLLM's reasoning parsers answer "no content after the reasoning" with null
            if self.plan.forced_tools:
                content = content or ""  # vLLM's shape when the calls are the answer: empty rather than null
            logprobs = None
            if c.seq.params.logprobs is not None and not self.hide_logprobs:
                logprobs = self.chunks.logprobs(c.logprobs + c.unsent_logprobs)
            final.append(
                self.chunks.final_choice(
                    c.index, content, reasoning, tool_calls, logprobs, c.finish_reason, c.stop_reason
                )
            )
        result = self.chunks.final(final, self.usage())
        status = JobStatus.cancelled if any(c.finish_reason == "abort" for c in self.choices) else JobStatus.completed
        events = []
        req = self.job.request
        opts = req.stream_options
        if status is JobStatus.completed and opts is not None and opts.include_usage:
            events.append(self._event(EventKind.chunk, self.chunks.usage(self.usage())))
        # A client waiting for the whole answer gets it with `done`, saving the API a read of the record.
        waited = status is JobStatus.completed and not req.stream and not req.background
        events.append(self._event(EventKind.done, result if waited else None))
        return events, JobEnd(self.job.id, status, completion_tokens, result=result)


def _thinking(parser: Parser) -> bool:
    """Whether a reasoning parser has yet to see the thought end; other parsers never think."""
    return getattr(parser, "state", "content") != "content"


def _merge(a: Delta, b: Delta) -> Delta:
    return Delta(a.content + b.content, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls)


class Runner:
    def __init__(
        self,
        make_engine: Callable[[], Engine],
        tokenizer: Tokenizer,
        eos_ids: list[int],
        publisher: Publisher,
        max_model_len: int,
        *,
        settings: Settings,
        compiler: GrammarCompiler | None = None,
        defaults: dict | None = None,
    ):
        self.make_engine = make_engine
        self.engine: Engine
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self.decoder = Decoder(tokenizer)
        self.eos_ids = eos_ids
        self.publisher = publisher
        self.outbox: Outbox | None = None
        self.max_model_len = max_model_len
        self.settings = settings
        self.compiler = compiler
        self.defaults = defaults or {}
        self._new: queue.SimpleQueue[JobRun] = queue.SimpleQueue()
        self.runs: dict[str, JobRun] = {}
        self.by_seq: dict[str, tuple[JobRun, Choice]] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="chatq-engine", daemon=True)
        self.stepping_since: float | None = None  # time.monotonic() when the engine step under way began

    def start(self) -> None:
        """Starts the engine thread and returns once the model is loaded in it."""
        self.thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise RuntimeError("the engine could not be built") from self._failed

    def stalled(self, limit: float) -> str | None:
        """Why this worker's engine cannot be counted on to make progress, or None while it can."""
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

    def submit(self, job: Job) -> JobRun:
        run = JobRun(
            job,
            self.decoder,
            self.eos_ids,
            self.max_model_len,
            defaults=self.defaults,
            compiler=self.compiler,
            settings=self.settings,
        )
        self._new.put(run)
        self.engine.wakeup.set()
        return run

    def _loop(self) -> None:
        # The model is loaded in the thread that runs it: torch keeps a pool of compute threads per calling thread,
        # and a model loaded in another thread leaves two pools fighting over the cores (decode ran 2.4x slower).
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
            except Exception:  # a Redis outage or a bug in the loop itself: keep serving once it passes
                log.exception("engine loop iteration failed")
                self._stop.wait(0.5)

    def _iterate(self) -> None:
        writes = StepWrites()
        touched: dict[str, JobRun] = {}
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
            if run.finished:  # refused before generating anything
                touched[run.job.id] = run
        if not writes and not touched and not self.engine.has_work():
            self.engine.wakeup.wait(0.5)
            self.engine.wakeup.clear()
            return
        outputs = []
        if self.engine.has_work():
            self.stepping_since = time.monotonic()
            try:
                outputs = self.engine.step()
            finally:
                self.stepping_since = None
        for out in outputs:
            entry = self.by_seq.get(out.seq.id)
            if entry is None:  # the engine confirming a drop we asked for after the job had ended
                continue
            run, choice = entry
            touched[run.job.id] = run
            numbered = run.last_seq
            try:
                events, stop_now = run.on_output(choice, out)
            except Exception as e:  # one job's text handling must not sink the others
                log.exception("job %s failed while handling its output", run.job.id)
                run.error = f"output processing failed ({type(e).__name__})"
                run.last_seq = numbered  # events it numbered are dropped: the error takes the next number
                events, stop_now = [], False
            if stop_now:
                self.engine.cancel(out.seq.id)
            if run.error:  # one failed choice fails the job: stop its siblings too
                for c in run.choices:
                    if c.finish_reason is None:
                        c.finish_reason = "error"
                    # Also a choice a stop string ended whose drop was never asked for, as its handling failed.
                    if c.seq.finish is None:
                        self.engine.cancel(c.seq.id)
            writes.events.extend((run.job.id, e) for e in events)
        ended = []
        now = time.monotonic()
        for job_id, run in touched.items():
            if run.finished:
                events, end = run.end()
                writes.events.extend((job_id, e) for e in events)
                writes.ended.append(end)
                run.status = end.status
                ended.append(run)
            elif now - run.progress_at >= PROGRESS_EVERY:
                run.progress_at = now
                writes.progress[job_id] = run.completion_tokens
        for run in ended:
            del self.runs[run.job.id]
            for c in run.choices:
                self.by_seq.pop(c.seq.id, None)

        def written(cancelled: set[str]) -> None:
            # May run in the outbox's thread: a run's choices never change once it started, and engine.cancel
            # takes effect at the engine's next step. A job not started yet stays in the set until it is.
            for job_id in cancelled:
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
