"""One job inside the worker: its choices (engine sequences), each engine output taken through detokenize -> parse
-> chunks, the job's events, numbered 1, 2, 3, ..., and its end: its final record, its metrics, its status.

A JobRun is the only writer of its fields and of its choices; the engine loop (runner) only routes outputs to it. Its
methods run on the engine loop thread, between steps, except the constructor and `resume` (the submitting thread,
before the loop takes it)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from chatq.core import chunks, logs, sampling
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.delta import Delta
from chatq.core.errors import BadRequest, ChatqError, InternalError
from chatq.core.job import Event, EventKind, Job, JobStatus
from chatq.core.model_info import ModelInfo
from chatq.core.priority import is_batch_line
from chatq.core.render import bad_words_ids
from chatq.core.settings import Settings
from chatq.worker.choice import Choice, add_ids, call_id, echo_text, echo_with_logprobs, prompt_logprobs
from chatq.worker.deferred import beam_group, rank
from chatq.worker.detokenize import Decoder, TextStream
from chatq.worker.engine import Finish, Output, Sequence
from chatq.worker.grammar import GrammarCompiler
from chatq.worker.lora import Library, Weights
from chatq.worker.plan import plan
from chatq.worker.publish import JobEnd
from chatq.worker.sampler import SamplingParams
from chatq.worker.timing import JobClock

log = logging.getLogger(__name__)

PROGRESS_EVERY = 0.25  # seconds between progress writes of one job
# How a logged finish_reason ends a replayed sequence; any other ends it as a stop.
_FINISHES = {"length": Finish.length, "repetition": Finish.repetition}


class JobRun:
    def __init__(
        self,
        job: Job,
        model: ModelInfo,
        decoder: Decoder,
        *,
        settings: Settings,
        compiler: GrammarCompiler | None = None,
        clock: JobClock | None = None,
        library: Library | None = None,
    ):
        """`clock`: the job's times so far (from its claimed record), for its metrics. `library`: where its adapter,
        if it has one, is read from; None: the worker serves none."""
        self.job = job
        self.model = model
        self.decoder = decoder
        self.done = threading.Event()
        self.status: JobStatus | None = None
        self.error: ChatqError | None = None  # set, the job fails with it
        self.last_seq = 0
        self.progress_at = 0.0  # time.monotonic() of its last progress write
        self.eos_ids = frozenset(model.eos_token_ids)
        self.continuous_usage = False
        self.return_ids = False  # return_token_ids, where the job shows its tokens
        self.deferred = False  # it answers at its end (beam search, best_of)
        self.resumed = False
        self.clock = clock or JobClock.starting()
        self.choices: list[Choice] = []
        # The job's fields on the lines the engine loop logs about it (chatq.core.logs): those of the task thread
        # that submits it.
        self.log_extra = logs.current() or logs.job_extra(job.id)
        self.library = library
        try:
            self._prepare(settings, compiler)
        except BadRequest as e:  # e.g. a schema the grammar engine cannot compile: the request's fault
            self.error, self.choices = e, []
        except Exception as e:  # a job that cannot start must end failed, not stay in progress with no one on it
            log.exception("job %s could not be prepared", job.id, extra=self.log_extra)
            self.error, self.choices = InternalError(f"preparing the job failed ({type(e).__name__})"), []

    def _prepare(self, settings: Settings, compiler: GrammarCompiler | None) -> None:
        job, req = self.job, self.job.request
        self.lora = self._adapter()
        self.chunks = chunks.formatter_for(job)
        self.include_reasoning = req.include_reasoning if isinstance(req, ChatCompletionRequest) else True
        opts = req.stream_options
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        bad_words = bad_words_ids(self.decoder.tokenizer, req.bad_words)
        defaults = self.model.sampling_defaults
        self.plan = plan(req, 1, self.eos_ids, defaults, compiler, settings, self.model.tokenizer, bad_words)
        # Hidden reasoning stays hidden: its tokens would show in logprobs and token ids (vLLM nulls them too).
        self.hide_logprobs = self.plan.reasoning and not self.include_reasoning
        self.return_ids = bool(req.return_token_ids) and not self.hide_logprobs
        self.as_ids = bool(req.return_tokens_as_token_ids)
        # A legacy echo's logprobs are the prompt's, made with its first token: the echo goes out then.
        self.echo_logprobs = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
        # vLLM samples one token to score a prompt, and shows none.
        self.silent = req.scores_only
        # Beam search and best_of answer once every candidate has ended: the choices stream whole, at the end.
        self.deferred = req.use_beam_search or req.candidates > req.n
        if req.use_beam_search and settings.engine != "native":
            raise BadRequest("Beam search runs on chatq's own engine only (CHATQ_ENGINE=native).", "use_beam_search")
        for p, prompt_ids in enumerate(job.prompts):
            room = self.model.max_model_len - len(prompt_ids)
            max_tokens = (
                1 if self.silent else sampling.max_tokens(req.max_new_tokens, self.model.sampling_defaults, room)
            )
            echo = echo_text(req, p, prompt_ids, self.decoder)
            beams = beam_group(req, self.plan.params[0].stop_token_ids, max_tokens) if req.use_beam_search else None
            for i, params in enumerate(self.plan.params):
                params = dataclasses.replace(params, max_tokens=max_tokens)
                choice = self._choice(p * req.candidates + i, p, prompt_ids, params, echo, settings)
                if beams is not None:
                    choice.seq.beams = beams
                    beams.seqs.append(choice.seq)
                self.choices.append(choice)

    def _adapter(self) -> Weights | None:
        """The weights of the job's adapter, read on this worker if it has not read them yet."""
        adapter = self.job.adapter
        if adapter is None:
            return None
        if self.library is None:
            raise BadRequest(f"The workers of {self.job.model} serve no LoRA adapters.", "model")
        return self.library.get(adapter)

    def _choice(
        self, index: int, p: int, prompt_ids: list[int], params: SamplingParams, echo: str, settings: Settings
    ) -> Choice:
        """Choice `index`, which answers prompt `p`."""
        req = self.job.request
        seq = Sequence(
            f"{self.job.id}/{index}",
            prompt_ids,
            params,
            priority=req.priority,
            format=self.plan.grammar,
            cache_salt=bytes.fromhex(self.job.cache_partition),
            lora=self.lora,
        )
        # Tool-call markup may be special tokens (hermes' <tool_call> in Qwen): keep them for the parser to see.
        skip_special = req.skip_special_tokens and not (self.plan.tools_parsed and not self.plan.grammar)
        text = TextStream(
            self.decoder.tokenizer,
            req.stop,
            prompt_ids=prompt_ids,
            skip_special_tokens=skip_special,
            include_stop=req.include_stop_str_in_output,
        )
        # vLLM's engine holds the answer to its format (seq.format) by itself.
        grammar = self.plan.grammar if settings.engine == "native" else None
        choice = Choice(index, seq, text, self.plan.make_parser(), p, echo, self.echo_logprobs, grammar=grammar)
        self._constrain(choice)
        return choice

    @property
    def batch_line(self) -> bool:
        return is_batch_line(self.job.request.priority)

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
        prompts = self.job.prompts
        answered = sorted({c.prompt for c in choices})
        prompt = sum(len(prompts[p]) for p in answered)
        # One count per prompt, as vLLM reports one per request: its first choice's.
        firsts = [next(c for c in self.choices if c.prompt == p).seq.cached_prompt_tokens for p in answered]
        cached = None if None in firsts or not firsts else sum(c or 0 for c in firsts)
        return chunks.usage(prompt, completion, reasoning, cached)

    def progress(self, now: float) -> int | None:
        """The completion tokens to write as the job's progress, when a write is due at `now` (time.monotonic())."""
        if now - self.progress_at < PROGRESS_EVERY:
            return None
        self.progress_at = now
        return self.completion_tokens

    def _metrics(self, end: JobEnd, now: float) -> dict[str, float]:
        """What the ended job adds to its model's metrics: its times, its usage's token counts, how it finished."""
        # A request refused here never generated: its usage counts nothing.
        prompt = 0 if isinstance(self.error, BadRequest) else self.job.prompt_tokens
        reason = {JobStatus.failed: "error", JobStatus.cancelled: "abort"}.get(end.status)
        reason = reason or next((c.finish_reason for c in self.choices if c.finish_reason), None) or "stop"
        try:
            return self.clock.facts(now, prompt, end.completion_tokens, reason).increments()
        except Exception:  # the job's end must still go out with the step's other writes, uncounted
            log.exception("job %s: its metrics could not be made", self.job.id)
            return {}

    def _event(self, kind: EventKind, data: dict[str, Any] | None = None, choice: Choice | None = None) -> Event:
        self.last_seq += 1
        if self.continuous_usage and data is not None and data.get("choices"):
            data["usage"] = self.chunks.running_usage(self.usage([self.choices[c["index"]] for c in data["choices"]]))
        ids = None
        if choice is not None and choice.unlogged:
            ids, choice.unlogged = choice.unlogged, []
        if self.return_ids and choice is not None and data is not None:
            add_ids(self.job, choice, data["choices"][0], ids or [])
        event = Event(seq=self.last_seq, event=kind, data=data, ids=ids)
        # Encoded now, where a failure is this job's alone: in the step's writes, a value orjson refuses (a string
        # no UTF-8 encoder takes) would fail every job's writes.
        event.to_json()
        return event

    def _chunk(self, choice: Choice, delta: Delta, carries_ids: bool = True) -> Event:
        logprobs = self._take_logprobs(choice)
        data = self.chunks.chunk(choice.index, chunks.delta_json(delta), logprobs)
        return self._event(EventKind.chunk, data, choice if carries_ids else None)

    def start(self) -> list[Event]:
        if self.resumed:  # the first attempt sent these
            return []
        if self.deferred:
            for c in self.choices:
                if c.echo and not c.echo_pending:
                    c.held = Delta(content=c.echo)
                    c.message.add(c.held)
            return []
        events = []
        for c in self.choices:
            first = self.chunks.start(c.index)
            if first is not None:
                if self.return_ids:
                    first["prompt_token_ids"] = self.job.prompts[c.prompt]
                events.append(self._event(EventKind.chunk, first))
            if c.echo and not c.echo_pending:
                echo = Delta(content=c.echo)
                c.message.add(echo)
                events.append(self._chunk(c, echo))
        return events

    def handle(self, choice: Choice, out: Output, now: float) -> tuple[list[Event], list[str]]:
        """One engine output of the step that ended at `now`: its events, and the ids of the sequences the engine
        must drop. A failure here fails this job alone; its unfinished choices end with it."""
        if out.token is not None:
            self.clock.token(choice.index, now)
        numbered = self.last_seq
        try:
            events, stop_now = self.on_output(choice, out)
        except Exception as e:  # one job's text handling must not sink the others
            log.exception("job %s failed while handling its output", self.job.id, extra=self.log_extra)
            self.error = InternalError(f"output processing failed ({type(e).__name__})")
            self.last_seq = numbered  # events it numbered are dropped: the error takes the next number
            events, stop_now = [], False
        drop = [out.seq.id] if stop_now else []
        if self.error is not None:
            drop += self._fail_choices()
        return events, drop

    def _fail_choices(self) -> list[str]:
        """Ends the failed job's choices that had not ended; the ids of its sequences still generating. Those include
        one a stop string ended whose drop was never asked for, as its handling failed."""
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "error"
        return [c.seq.id for c in self.choices if c.seq.finish is None]

    def on_output(self, choice: Choice, out: Output) -> tuple[list[Event], bool]:
        """The events for one engine output, and whether the engine must drop the sequence (a stop string)."""
        if choice.finish_reason is not None:  # already ended by a stop string
            return [], False
        events = []
        if choice.echo_pending and out.token is not None:
            echo = echo_with_logprobs(choice, self.decoder)
            if self.deferred:
                choice.held += echo
            else:
                events.append(self._chunk(choice, echo, carries_ids=False))
        if out.token is not None:
            choice.unlogged.append(out.token)
        if out.logprob is not None:
            choice.score += out.logprob.logprob
        if self.silent:
            delta, stop_now = Delta(), False
        elif out.token is None and out.seq.beams is not None and out.finish in (Finish.stop, Finish.length):
            delta, stop_now = self._take_beam(choice, out), False
        else:
            delta, stop_now = self._take_token(choice, out)
        self._note_finish(choice, out)
        ending = choice.finish_reason in ("stop", "length", "repetition")
        if ending:
            delta = self._closing(choice, delta)
        if not self.include_reasoning:
            delta.reasoning = ""
        for call in delta.tool_calls:
            if call.id is not None:
                call.id = call_id(self.job.id, choice, call.index)
        choice.message.add(delta)
        if self.deferred:
            choice.held += delta
            return events, stop_now
        # A cancelled choice ends its stream with `abort`, as a job cancelled while queued does (and as vLLM does):
        # a stream reader learns what a poller sees. That chunk, the last, carries the token ids with the finish.
        closes = ending or choice.finish_reason == "abort"
        if delta:
            events.append(self._chunk(choice, delta, carries_ids=not closes))
        if closes:
            finish = self.chunks.chunk(
                choice.index, {}, self._take_logprobs(choice), choice.finish_reason, choice.stop_reason
            )
            events.append(self._event(EventKind.chunk, finish, choice))
        return events, stop_now

    def resume(self, log: list[Event]) -> None:
        """Takes the job up where an earlier attempt's log stops. The tokens its events carried go again, silently,
        through each choice's grammar, stop strings, detokenizer and parser, which leaves every choice as it stood
        after its last logged event; the next event continues the stream with the next number."""
        self.resumed = True
        for c in self.choices:
            if c.echo and not c.echo_pending:
                c.message.add(Delta(content=c.echo))
        for event in log:
            if event.event is not EventKind.chunk or not event.data or not event.data.get("choices"):
                continue
            logged = event.data["choices"][0]
            choice = self.choices[logged["index"]]
            if choice.echo_pending:  # a choice's first chunk is its echo
                choice.echo_pending = False
                choice.message.add(Delta(content=choice.echo))
            choice.logprobs.extend(self.chunks.read_logprobs(logged.get("logprobs")))
            if event.ids:
                self._replay(choice, event.ids, logged.get("finish_reason"))
        self.last_seq = log[-1].seq if log else 0

    def _replay(self, choice: Choice, ids: list[int], finish_reason: str | None) -> None:
        seq = choice.seq
        for i, token in enumerate(ids):
            # Taken in as the engine took it. How the choice ended is the log's to say, not the sequence's: a stop
            # string ends one the sequence would not have. The last token of a finished choice came with its finish.
            seq.take(token, self.model.max_model_len)
            ended = finish_reason is not None and i == len(ids) - 1
            finish = _FINISHES.get(finish_reason or "", Finish.stop) if ended else None
            self.on_output(choice, Output(seq, token, finish))
        choice.unlogged, choice.unsent_logprobs = [], []

    def _take_token(self, choice: Choice, out: Output) -> tuple[Delta, bool]:
        """The new token's text through stop strings and the parser; whether a stop string ended it early."""
        seq, req = out.seq, self.job.request
        # The token that ended the sequence (EOS, a stop token id) is text only if the request wants stops in the
        # output, and a special one only with skip_special_tokens off.
        ended_by_token = (
            out.finish is Finish.stop and out.token in seq.params.stop_token_ids and not req.include_stop_str_in_output
        )
        if out.token is None or ended_by_token:
            return Delta(), False
        if out.logprob is not None and not self.hide_logprobs:
            # Where the token's text begins: after the echo and all text decoded so far, held back or not.
            offset = len(choice.echo) + choice.text.decoded
            info = self.decoder.info(out.token, out.logprob.logprob, out.logprob.top, offset, self.as_ids)
            choice.unsent_logprobs.append(info)
        # min_tokens holds off stop strings as well as stop tokens.
        piece = choice.text.add(out.token, check_stops=seq.past_min_tokens)
        thinking = choice.parser.thinking
        delta = choice.parser.feed(piece.text)
        # A token of the thought, not of its tags; one with no text yet (part of a character) counts too.
        if thinking and (delta.reasoning or not piece.text):
            choice.reasoning_tokens += 1
        self._constrain(choice)
        if piece.stop is None:
            return delta, False
        choice.finish_reason, choice.stop_reason = "stop", piece.stop
        return delta, out.finish is None

    def _take_beam(self, choice: Choice, out: Output) -> Delta:
        """A beam search's answer for the choice, its tokens set on the sequence at the end, as one delta."""
        delta, tokens = Delta(), out.seq.output_ids
        choice.unlogged.extend(tokens)
        for i, token in enumerate(tokens):
            finish = out.finish if i == len(tokens) - 1 else None
            delta += self._take_token(choice, Output(out.seq, token, finish))[0]
        return delta

    def _constrain(self, choice: Choice) -> None:
        """Holds the choice's output to its format, from its next token on, once it is not in a thought: the thought
        is free, as in vLLM."""
        if choice.grammar is not None and not choice.parser.thinking:
            choice.seq.constrain(choice.grammar)
            choice.grammar = None

    def _note_finish(self, choice: Choice, out: Output) -> None:
        seq, req = out.seq, self.job.request
        if out.finish is Finish.error:
            self.error = InternalError(seq.error or "generation failed")
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
            elif out.finish is Finish.repetition:
                choice.stop_reason = "repetition_detected"  # vLLM's

    def _closing(self, choice: Choice, delta: Delta) -> Delta:
        """What the choice's last output adds once it ends: text held back, and what the parser held."""
        if not isinstance(choice.stop_reason, str):  # no stop string: what was held back is plain text
            delta += choice.parser.feed(choice.text.flush())
        delta += choice.parser.finish()
        made_calls = bool(choice.message.tool_calls or delta.tool_calls)
        if choice.finish_reason == "stop" and made_calls and not self.plan.named_tool:
            choice.finish_reason = "tool_calls"
        return delta

    @property
    def reports_logprobs(self) -> bool:
        """Whether the answer shows logprobs; best_of takes them to rank its candidates, asked for or not."""
        return self.job.request.num_logprobs is not None and not self.hide_logprobs

    def _take_logprobs(self, choice: Choice) -> dict[str, Any] | None:
        if not self.reports_logprobs or not choice.unsent_logprobs:
            return None
        tokens, choice.unsent_logprobs = choice.unsent_logprobs, []
        choice.logprobs.extend(tokens)
        return self.chunks.logprobs(tokens)

    def end(self) -> tuple[list[Event], JobEnd]:
        """The job's closing events and final record with what it adds to its model's metrics, once every choice
        finished; its status is the record's from then on."""
        seq = self.last_seq
        try:
            events, end = self._end()
        except Exception as e:  # this job fails alone; the step's other writes must still go out
            log.exception("job %s failed while building its result", self.job.id, extra=self.log_extra)
            self.last_seq = seq  # no gap in the event numbers
            self.error = InternalError(f"building the result failed ({type(e).__name__})")
            events, end = self._end()
        end.metrics = self._metrics(end, time.time())
        self.status = end.status
        return events, end

    def _end(self) -> tuple[list[Event], JobEnd]:
        if self.error is not None:
            body = self.error.body()
            # A request refused here never generated: its usage counts nothing.
            tokens = 0 if isinstance(self.error, BadRequest) else self.completion_tokens
            events = [self._event(EventKind.error, body), self._event(EventKind.done)]
            return events, JobEnd(self.job.id, JobStatus.failed, tokens, error=body["error"])
        status = JobStatus.cancelled if any(c.finish_reason == "abort" for c in self.choices) else JobStatus.completed
        events = []
        if self.deferred:
            self.choices = rank(self.choices, self.job)
            events = self._answer() if status is JobStatus.completed else []
        answered = self.choices[: len(self.job.prompts) * self.job.request.n]
        result = self.chunks.final([self._final_choice(c) for c in answered], self.usage())
        if (
            isinstance(self.job.request, ChatCompletionRequest)
            and self.choices[0].seq.params.prompt_logprobs is not None
        ):
            # vLLM's place for them in chat.
            result["prompt_logprobs"] = prompt_logprobs(self.choices[0].seq, self.decoder)
        if self.return_ids and self.job.kind != "text":
            result["prompt_token_ids"] = self.job.prompt_ids
        req = self.job.request
        opts = req.stream_options
        if status is JobStatus.completed and opts is not None and opts.include_usage:
            events.append(self._event(EventKind.chunk, self.chunks.usage(self.usage())))
        # A client waiting for the whole answer gets it with `done`, saving the API a read of the record.
        waited = status is JobStatus.completed and not req.stream and not req.background
        events.append(self._event(EventKind.done, result if waited else None))
        return events, JobEnd(self.job.id, status, self.completion_tokens, result=result)

    def _answer(self) -> list[Event]:
        """The answered choices of a job that answers at its end, each streamed whole in one chunk."""
        events = []
        for c in self.choices[: len(self.job.prompts) * self.job.request.n]:
            first = self.chunks.start(c.index)
            if first is not None:
                if self.return_ids:
                    first["prompt_token_ids"] = self.job.prompts[c.prompt]
                events.append(self._event(EventKind.chunk, first))
            if c.held:
                events.append(self._chunk(c, c.held, carries_ids=False))
            finish = self.chunks.chunk(c.index, {}, self._take_logprobs(c), c.finish_reason, c.stop_reason)
            events.append(self._event(EventKind.chunk, finish, c))
        return events

    def _final_choice(self, c: Choice) -> dict[str, Any]:
        content, reasoning, tool_calls = c.message.result()
        if self.plan.reasoning and not content:
            content = None  # vLLM's reasoning parsers answer "no content after the reasoning" with null
        if self.plan.forced_tools:
            content = content or ""  # vLLM's shape when the calls are the answer: empty rather than null
        logprobs = None
        if self.reports_logprobs:
            logprobs = self.chunks.logprobs(c.logprobs + c.unsent_logprobs)
        final = self.chunks.final_choice(
            c.index, content, reasoning, tool_calls, logprobs, c.finish_reason, c.stop_reason
        )
        if isinstance(self.job.request, CompletionRequest) and c.seq.params.prompt_logprobs is not None:
            final["prompt_logprobs"] = prompt_logprobs(c.seq, self.decoder)
        if self.return_ids:
            # Where vLLM puts them: a legacy choice holds its prompt's ids, a chat completion's object holds them.
            if self.job.kind == "text":
                final["prompt_token_ids"] = self.job.prompts[c.prompt]
            final["token_ids"] = [] if self.silent else list(c.seq.output_ids)
        return final
