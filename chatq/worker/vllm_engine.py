"""The generate stage on vLLM's engine (CHATQ_ENGINE=vllm): the surface the engine loop drives (StepEngine: add /
step / cancel) over vLLM's LLMEngine, stepped in the loop's thread. chatq renders, detokenizes, parses, publishes and
recovers as with its own engine; vLLM schedules, samples, and holds an answer to its grammar. See
docs/vllm-engine.md.

vLLM's engine is not thread-safe: `add` and `cancel`, called from any thread, queue their work under a lock, and
`step` hands it over on the thread that steps. Each sequence is one vLLM request under the sequence's id, whose steps
return its new token ids only (DELTA, no text): chatq's own stages make the text. vLLM is imported when an engine is
built, after `environment()`, so that this module loads where vLLM is not installed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from chatq.worker import device
from chatq.worker.device import DeviceLost
from chatq.worker.engine import EngineStats, Finish, Occupancy, Output, Sequence, job_of
from chatq.worker.sampler import TokenLogprob
from chatq.worker.selfcheck import Check

log = logging.getLogger(__name__)

# How the endings vLLM reports finish a sequence; any other (an abort or an error of vLLM's own) fails it. vLLM sees
# no stop strings (chatq's detokenizer finds those, and cancels) and reports no cancel (chatq's own).
FINISHES = {"stop": Finish.stop, "length": Finish.length}
LOGPROB_FLOOR = -9999.0  # a token the grammar forbids, as chatq's sampler reports it: JSON has no -inf
IDLE_STEP = 0.001  # seconds a step that ran nothing waits (a grammar still compiling), so the loop does not spin


def environment() -> None:
    """vLLM's process-wide switches, set before it is first imported (the environment wins where it sets them): its
    engine core runs in this process, stepped by the calling thread; it reports no usage; and its loggers, left
    unconfigured, hand their lines to the worker's handlers, in CHATQ_LOG_FORMAT."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # Its throughput lines every few seconds say what the worker's metrics count.
    logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)


class VllmEngine:
    """vLLM's LLMEngine as a StepEngine. `args`: vLLM's engine arguments (build.vllm_args)."""

    mode = "vllm"  # as the registry entry and the engine_mode gauge say it

    def __init__(self, args: Mapping[str, Any], *, eos_token_ids: Iterable[int], max_model_len: int):
        environment()
        try:
            from vllm import EngineArgs, LLMEngine
            from vllm.platforms import current_platform
        except ImportError as e:
            raise RuntimeError(
                "CHATQ_ENGINE=vllm needs vLLM where the worker runs: `make setup-vllm`, or the worker-vllm image"
            ) from e

        self.device = torch.device(current_platform.device_type)
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.wakeup = threading.Event()
        self.urgent = threading.Event()  # vLLM's steps run whole
        self.stats = EngineStats()
        self.checks: list[Check] = []  # the start checks are chatq's engine's
        self.held: Occupancy  # from vLLM's scheduler, after each step
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self._live: dict[str, Sequence] = {}  # by id, the sequences vLLM holds; the stepping thread's alone
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(**args), stat_loggers=[lambda config, _index: StatsRecorder(self, config)]
        )
        self.held = Occupancy(0, 0, 0, self.engine.vllm_config.cache_config.num_gpu_blocks or 0)

    # --- public surface --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        with self._lock:
            self._inbox.append(seq)
        self.wakeup.set()

    def cancel(self, seq_id: str) -> None:
        with self._lock:
            self._cancels.add(seq_id)
        self.wakeup.set()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._cancels or self._live)

    def occupancy(self) -> Occupancy:
        return self.held

    def step(self) -> list[Output]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        # A cancel holds for a sequence added in the same step, as in chatq's engine.
        outputs = [self._end(seq, Finish.cancelled) for seq in inbox if seq.id in cancels]
        outputs += [out for seq in inbox if seq.id not in cancels and (out := self._admit(seq)) is not None]
        outputs += self._abort(cancels)
        if not self._live:
            return outputs
        try:
            done = self.engine.step()
        except Exception as e:
            return outputs + self._fail_everything(e)
        if not done and not outputs:
            time.sleep(IDLE_STEP)
        for request in done:
            outputs += self._outputs(request)
        return outputs

    # --- requests in and out ---------------------------------------------------------------------------

    def _admit(self, seq: Sequence) -> Output | None:
        """Hands the sequence to vLLM; its ending if vLLM refuses it. A sequence taken up with output already (a job
        continued from another worker's) goes on from there: its output joins its prompt."""
        from vllm import TokensPrompt

        try:
            params = self._params(seq)
            tokens = TokensPrompt(prompt_token_ids=seq.prompt_ids + seq.output_ids)
            if seq.cache_salt:
                tokens["cache_salt"] = seq.cache_salt.hex()  # vLLM's own partition of its prefix cache
            (prompt,) = self.engine.renderer.render_cmpl([tokens])
            self.engine.add_request(seq.id, prompt, params, priority=seq.priority)
        except Exception as e:  # vLLM's checks of one request: that request fails, not the worker
            log.warning("vLLM refused sequence %s: %s", seq.id, e, extra=job_of(seq))
            return self._end(seq, Finish.error, f"vLLM refused the request: {e}")
        self._live[seq.id] = seq
        return None

    def _params(self, seq: Sequence) -> Any:
        """vLLM's SamplingParams for the sequence's, less what it made already."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        p, made = seq.params, len(seq.output_ids)
        stops = set(p.stop_token_ids)
        grammar = None
        if seq.format is not None:
            grammar = StructuredOutputsParams(grammar=str(seq.format.grammar))
            # A complete grammar allows only EOS, which ends the sequence even where the request ignores EOS, as
            # chatq's engine ends it.
            stops |= self.eos_token_ids
        params = SamplingParams(
            temperature=0.0 if p.greedy else p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=p.logit_bias or None,
            min_tokens=max(0, p.min_tokens - made),
            max_tokens=p.max_tokens - made,
            # chatq's stop ids hold EOS unless the request ignores it: vLLM's own EOS rule would end it regardless.
            stop_token_ids=sorted(stops),
            ignore_eos=True,
            logprobs=None if p.logprob_ids else p.logprobs,
            logprob_token_ids=list(p.logprob_ids) or None,
            allowed_token_ids=list(p.allowed_ids) or None,
            # Of the prompt vLLM is given, which holds the output so far of a sequence taken up with some.
            prompt_logprobs=p.prompt_logprobs if seq.scoring else None,
            structured_outputs=grammar,
            thinking_token_budget=p.thinking.tokens if p.thinking is not None else None,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
        # chatq tokenized the bad words as vLLM would; vLLM takes them as text only, tokenizing them itself.
        params._bad_words_token_ids = [list(w) for w in p.bad_words] or None
        return params

    def _outputs(self, request: Any) -> list[Output]:
        """One chatq output per new token of a vLLM RequestOutput (speculative decoding makes several a step), the
        ending on the last. Each token goes in through Sequence.take, which decides the ending as in chatq's engine;
        vLLM's ends it where that does not."""
        seq = self._live.get(request.request_id)
        if seq is None:  # ended here already
            return []
        done = request.outputs[0]
        if seq.scoring and request.prompt_logprobs:
            k = seq.params.prompt_logprobs or 0
            # The first token has none; the first prompt's positions are the sequence's prompt.
            entries = list(request.prompt_logprobs)[1 : len(seq.prompt_ids)]
            seq.prompt_logprobs = [
                token_logprob(t, e, k, ranked=True) for t, e in zip(seq.prompt_ids[1:], entries, strict=True)
            ]
        if seq.cached_prompt_tokens is None and request.num_cached_tokens is not None:
            seq.cached_prompt_tokens = request.num_cached_tokens
        outputs = []
        for i, token in enumerate(done.token_ids):
            finish = seq.take(token, self.max_model_len)
            if finish is None and request.finished and i == len(done.token_ids) - 1:
                finish = FINISHES.get(done.finish_reason)
            logprob = None
            if done.logprobs and seq.params.logprobs is not None:
                logprob = token_logprob(token, done.logprobs[i], seq.params.logprobs, named=seq.params.logprob_ids)
            outputs.append(Output(seq, token, finish, logprob))
            if finish is not None:
                self._close(seq, finish, stop_vllm=not request.finished)
                return outputs
        if request.finished:
            ending = f"vLLM ended the request ({done.finish_reason})"
            log.error("%s: %s", seq.id, ending, extra=job_of(seq))
            outputs.append(self._close(seq, Finish.error, ending))
        return outputs

    def _close(self, seq: Sequence, finish: Finish, error: str | None = None, stop_vllm: bool = False) -> Output:
        del self._live[seq.id]
        if stop_vllm:
            self.engine.abort_request([seq.id])
        return self._end(seq, finish, error)

    def _abort(self, seq_ids: set[str]) -> list[Output]:
        """Ends the cancelled sequences vLLM holds; vLLM's own engine says nothing of a request it aborts."""
        return [self._close(self._live[i], Finish.cancelled, stop_vllm=True) for i in seq_ids if i in self._live]

    def _fail_everything(self, e: Exception) -> list[Output]:
        """A step that raised: every sequence fails, as vLLM's state is unknown; a lost GPU or engine ends the
        worker (DeviceLost)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(e, EngineDeadError) or device.lost(self.device):
            raise DeviceLost(f"vLLM's engine on {self.device} was lost: {type(e).__name__}: {e}") from e
        log.exception("vLLM's engine step failed")
        seqs = list(self._live.values())
        self._live.clear()
        try:
            self.engine.abort_request([s.id for s in seqs])
        except Exception:
            log.exception("aborting the failed step's requests failed")
        return [self._end(s, Finish.error, f"generation failed ({type(e).__name__})") for s in seqs]

    def _end(self, seq: Sequence, finish: Finish, error: str | None = None) -> Output:
        seq.finish, seq.error = finish, error
        return Output(seq, None, finish)


class StatsRecorder:
    """A vLLM stat logger (StatLoggerBase's surface): each step's scheduler and iteration stats into the engine's
    EngineStats and occupancy, on the stepping thread."""

    def __init__(self, engine: VllmEngine, config: Any):
        self.engine = engine
        self.cache = config.cache_config  # its block count is known once the engine has sized its KV cache

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        if scheduler_stats is None:  # vLLM's engine records none without them
            return
        stats = self.engine.stats
        running = scheduler_stats.num_running_reqs  # those left running after the step
        batch = running + (len(iteration_stats.finished_requests) if iteration_stats is not None else 0)
        if batch:
            stats.steps += 1
            stats.batch_size = batch
        prefix = scheduler_stats.prefix_cache_stats
        stats.prefix_queries += prefix.queries + prefix.preempted_queries
        stats.prefix_hits += prefix.hits + prefix.preempted_hits
        if iteration_stats is not None:
            stats.generation_tokens += iteration_stats.num_generation_tokens
            stats.prefill_tokens += iteration_stats.prompt_token_stats.computed
            stats.preemptions += iteration_stats.num_preempted_reqs
        waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
        blocks = self.cache.num_gpu_blocks or 0
        self.engine.held = Occupancy(running, waiting, round(scheduler_stats.kv_cache_usage * blocks), blocks)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


def token_logprob(
    token: int, entries: Mapping[int, Any], k: int, ranked: bool = False, named: tuple[int, ...] = ()
) -> TokenLogprob:
    """vLLM's logprobs at one position (the sampled or prompt token's and the k most likely, each with its rank; or,
    for `named` ids, the sampled token's and theirs) as chatq's; `ranked`: with the token's rank, as a prompt token's
    entry has it."""
    mine = entries[token]
    rank = mine.rank if ranked else None
    if named:
        listed = [(t, max(e.logprob, LOGPROB_FLOOR)) for t, e in entries.items()]
        return TokenLogprob(max(mine.logprob, LOGPROB_FLOOR), listed, rank)
    by_rank = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank <= k)
    top = [(t, max(lp, LOGPROB_FLOOR)) for _, t, lp in by_rank[:k]]
    return TokenLogprob(max(mine.logprob, LOGPROB_FLOOR), top, rank)
