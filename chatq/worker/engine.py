"""The batched generation engine: add / step / cancel.

Continuous batching over a paged KV cache: each step is one forward pass over a token of every running sequence
plus at most `prefill_chunk` prompt tokens of newcomers, so streams keep flowing during a long prompt. When blocks
run out the newest sequence is preempted and recomputed later, so memory bounds the batch and a sequence without
room waits rather than fails. See docs/engine.md.

`add` and `cancel` may be called from any thread; `step` from one thread only. A Sequence's generation state is
written here alone: `Sequence.take` takes each token in (the step's, and a resumed job's replay of those it had), and
`Sequence.constrain` holds its output to a grammar, between steps on the thread that steps.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import torch

from chatq.core import logs
from chatq.core.lora_format import LoraSpec
from chatq.core.priority import is_batch_line
from chatq.worker import device, selfcheck
from chatq.worker.batching import Scored, build_batch, score
from chatq.worker.blocks import BlockManager
from chatq.worker.device import DeviceLost
from chatq.worker.forward import Batch, Interrupted, KVCache, PagedForward
from chatq.worker.graphs import DecodeGraphs
from chatq.worker.lora import Resident, Weights
from chatq.worker.sampler import History, Row, SamplingParams, TokenLogprob, sample, skip_draws

if TYPE_CHECKING:  # xgrammar is imported by a sequence's first grammar: the engine alone runs without it
    from chatq.worker.beam import BeamGroup
    from chatq.worker.grammar import Grammar, GrammarState

log = logging.getLogger(__name__)


class Finish(StrEnum):
    stop = "stop"  # EOS or a stop token id
    length = "length"  # max_tokens or the model's context
    repetition = "repetition"  # the output repeats a pattern (repetition_detection)
    cancelled = "cancelled"
    error = "error"


# eq=False: a sequence is itself, not its fields, which keeps the scheduler's membership tests cheap
# (docs/performance.md, "Host time per step").
@dataclass(eq=False)
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival: int = -1  # its place in the engine's first-come order, set by the engine when it takes it in
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V is in the cache
    # Prompt tokens the prefix cache served when it was first admitted (usage's cached_tokens); None until then.
    cached_prompt_tokens: int | None = None
    # Where its prompt's blocks are looked up and registered in the prefix cache: sequences share cached blocks only
    # within one partition (an API key's, a cache_salt's, an adapter's).
    cache_salt: bytes = b""
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # constrained decoding: what the output may be
    # The grammar its answer follows, after its reasoning if it reasons: constrain() applies it here when the
    # reasoning ends; an engine that constrains by itself (vLLM's) takes it whole when the sequence is added.
    format: Grammar | None = None
    history: History = field(default_factory=History)  # the sampler's record of it, for penalties
    beams: BeamGroup | None = None  # the beam search it is a beam of, which picks its tokens instead of the sampler
    lora: Weights | None = None  # the adapter it runs with; None: the base model
    lora_slot: int = -1  # where the forward pass holds that adapter, set each time the sequence is admitted
    # What the CPU context rows know its K/V by, if not its id: a beam's changes as it takes another beam's context.
    context: str | None = None
    # With params.prompt_logprobs: the entries of prompt tokens 1, 2, ... (the first has none), as prefill makes them.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.lora is not None:  # an adapter's K/V is its own: its prompts share cached blocks with no other's
            self.cache_salt += self.lora.id.encode()

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scoring(self) -> bool:
        """Whether its prompt's logprobs are still to be made: every prompt position's logits are needed, so no
        prefix-cache hit may skip one."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    def scored_positions(self, first: int, n: int) -> range:
        """Of the positions first..first+n-1 fed in a step, those whose logits give a prompt token's logprob not
        made yet (position p gives token p + 1's)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(first, len(self.prompt_logprobs)), min(first + n, len(self.prompt_ids) - 1))

    @property
    def past_min_tokens(self) -> bool:
        """Whether stops count yet: min_tokens holds off stop tokens and stop strings alike."""
        return len(self.output_ids) > self.params.min_tokens

    def take(self, token: int, max_len: int) -> Finish | None:
        """Takes a sampled token in, through the grammar; how the sequence ends with it, if it does (`max_len`: the
        model's context). Finish.error, the token left out, if the grammar rejects it."""
        if self.grammar is not None and not self.grammar.accept(token):
            return Finish.error
        self.output_ids.append(token)
        stop_token = token in self.params.stop_token_ids and self.past_min_tokens
        if stop_token or (self.grammar is not None and self.grammar.is_terminated()):
            return Finish.stop
        if len(self.output_ids) >= self.params.max_tokens or len(self) >= max_len:
            return Finish.length
        rep = self.params.repetition
        if rep is not None and len(self.output_ids) >= self.params.min_tokens and repeats(self.output_ids, *rep):
            return Finish.repetition
        return None

    def constrain(self, grammar: Grammar) -> None:
        """Holds the output to `grammar` from the next token on: before the sequence is added, or between steps on
        the thread that steps, as a step masks its logits with it."""
        from chatq.worker.grammar import GrammarState

        self.grammar = GrammarState(grammar)


@dataclass
class EngineStats:
    """Running totals the engine keeps for the worker's metrics, updated once per step; read from another thread
    (whole ints, so a reader sees each one before or after a step's update)."""

    steps: int = 0
    batch_size: int = 0  # sequences in the last step's forward pass
    prefill_tokens: int = 0  # tokens prefilled: prompts, and preempted sequences recomputed (cache hits not)
    generation_tokens: int = 0  # tokens sampled
    preemptions: int = 0
    interrupted: int = 0  # steps of batch lines alone given up part way for a sequence that could not wait
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hits: int = 0  # of those, tokens found cached


@dataclass
class Occupancy:
    """How full the engine is, for the worker's gauges: read at a scrape, from another thread."""

    running: int  # sequences holding cache
    waiting: int  # sequences waiting for cache room
    used_blocks: int  # KV-cache blocks held by sequences
    num_blocks: int  # KV-cache blocks in all


class StepEngine(Protocol):
    """What the worker uses of an engine: the loop (runner) its intake, steps and wake-up, the metrics its totals and
    occupancy, the registry entry its device, mode and start checks. chatq's Engine, or vLLM's (vllm_engine)."""

    device: torch.device
    wakeup: threading.Event
    # Set when a sequence that is not a batch line is on its way: a step of batch lines alone may stop for it.
    urgent: threading.Event
    stats: EngineStats
    checks: list[selfcheck.Check]

    @property
    def mode(self) -> str: ...

    def add(self, seq: Sequence) -> None: ...

    def cancel(self, seq_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[Output]: ...

    def occupancy(self) -> Occupancy: ...


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival


@dataclass
class Output:
    """What one step produced for one sequence: a new token, a finish, or both."""

    seq: Sequence
    token: int | None
    finish: Finish | None
    logprob: TokenLogprob | None = None


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        kv_tokens: int,
        block_size: int,
        prefill_chunk: int,
        max_model_len: int,
        graph_batch: int = 0,
        fast_path: bool = True,
        lora: LoraSpec | None = None,
    ):
        """graph_batch: decode steps of up to this many sequences replay fixed-size buffers (CUDA graphs on CUDA;
        see graphs.py); 0 runs every step eagerly. fast_path: on CUDA, the Triton decode kernel and the graphs, each
        kept only where the start check (selfcheck) finds it agrees with the plain path; False: neither. lora: the
        adapters it takes, if any (chatq.worker.lora)."""
        config: Any = model.config
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)  # one full-length sequence
        num_blocks = max(kv_tokens // block_size, self.max_blocks)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.cache = KVCache(config.num_hidden_layers, num_blocks, block_size, kv_heads, head_dim, dtype, self.device)
        self.forward = PagedForward(model, self.cache)
        self.forward.paged = self.forward.paged and fast_path
        if lora is not None:
            self.forward.lora = Resident(lora, dtype, self.device, self.forward.kernels)
        self.graphs: DecodeGraphs | None = None
        self.blocks = BlockManager(num_blocks, block_size)
        self.prefill_chunk = prefill_chunk
        # On CPU a step's cost grows with its rows, so batch lines sit out the steps that prefill other prompts, whose
        # first tokens someone waits for; on a GPU their rows cost next to nothing there.
        self.lines_yield = self.device.type == "cpu"
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size

        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self._order = itertools.count()
        self._contexts = itertools.count()  # names of the contexts beams fork
        self.waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, arrival, seq): lower goes first
        self.running: list[Sequence] = []  # in admission order; preemption takes from the end
        self.parked: list[Sequence] = []  # beams waiting for their search's first step to fork them
        self.wakeup = threading.Event()
        self.urgent = threading.Event()
        self.stats = EngineStats()
        self.checks: list[selfcheck.Check] = []  # the start check's, on CUDA
        if self.device.type == "cuda":
            self.checks = selfcheck.start(self, model, graph_batch if fast_path else 0)
        elif graph_batch > 0:
            self.graphs = self.capture_graphs(graph_batch)

    @property
    def mode(self) -> str:
        """How decode steps run: "graphs" (the Triton kernel, replayed as CUDA graphs), "kernel" (the kernel, eager)
        or "plain" (the context gathered into SDPA on CUDA; on CPU, the context rows and chatq's CPU kernels)."""
        return "graphs" if self.graphs is not None else "kernel" if self.forward.paged else "plain"

    def capture_graphs(self, graph_batch: int) -> DecodeGraphs | None:
        try:
            return DecodeGraphs(self.forward, graph_batch, self.max_blocks)
        except Exception:  # a model or driver the capture cannot handle still serves, only slower
            log.exception("capturing CUDA graphs failed; every step runs eagerly")
            return None

    def degrade(self, reason: str, fast_path: str | None = None) -> bool:
        """Turns a fast path off for every later step: `fast_path` ("graphs"; "kernel", which the graphs need too),
        by default the fastest one on. False when it was off already."""
        fast_path = fast_path or self.mode
        if fast_path == "graphs" and self.graphs is not None:
            self.graphs = None
        elif fast_path == "kernel" and self.forward.paged:
            self.forward.paged, self.graphs = False, None
        else:
            return False
        log.error("the engine runs in mode %s from now on: %s", self.mode, reason)
        return True

    def reset(self) -> None:
        """An empty cache and fresh counts, once nothing runs (after the start check)."""
        self.blocks = BlockManager(self.blocks.num_blocks, self.block_size)
        self.stats = EngineStats()

    # --- public surface --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            if not seq.params.greedy:
                skip_draws(seq.generator, len(seq.output_ids), self.vocab_size)
        with self._lock:
            self._inbox.append(seq)
        self.wakeup.set()

    def cancel(self, seq_id: str) -> None:
        with self._lock:
            self._cancels.add(seq_id)
        self.wakeup.set()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.running or self.parked or self._inbox or self._cancels)

    def occupancy(self) -> Occupancy:
        # Blocks nobody holds but that keep a cached prefix count as free, as in vLLM: the pool takes them when needed.
        blocks = self.blocks
        used = blocks.num_blocks - blocks.available()
        return Occupancy(len(self.running), len(self.waiting), used, blocks.num_blocks)

    def step(self) -> list[Output]:
        outputs: list[Output] = []
        try:
            self._step(outputs)
        except DeviceLost:
            raise
        except Exception as e:
            if device.lost(self.device):
                raise DeviceLost(f"{self.device} was lost: {type(e).__name__}: {e}") from e
            # A fault outside any one sequence leaves the state unknown: fail every sequence, so jobs end rather than
            # await a step that keeps raising, and restart with an empty cache.
            log.exception("engine step failed")
            outputs.extend(self._fail_everything(f"generation failed ({type(e).__name__})"))
        return outputs

    def _step(self, outputs: list[Output]) -> None:
        outputs.extend(self._take_inbox())
        scheduled = self._yield_to_prompts(self._schedule())
        if not scheduled:
            return
        try:
            passed = self._forward_or_fail(scheduled, outputs)
        except Interrupted:
            # Its sequences keep their places and blocks: the next step, the urgent one's too, feeds them again.
            self.stats.interrupted += 1
            return
        if passed is None:
            return
        logits, emitting, scored, scheduled = passed
        self.stats.prefill_tokens += sum(n for seq, n in scheduled if len(seq) - seq.num_cached != 1)
        for seq, n in scheduled:
            seq.num_cached += n
            self.blocks.register(seq)
        self.stats.steps += 1
        self.stats.batch_size = len(scheduled)
        self.stats.generation_tokens += len(emitting)
        if scored:
            score(scored, logits[len(emitting) :])
        if emitting:
            outputs.extend(self._sample_or_search(emitting, logits[: len(emitting)]))

    def _forward_or_fail(
        self, scheduled: list[tuple[Sequence, int]], outputs: list[Output]
    ) -> tuple[torch.Tensor, list[Sequence], list[Scored], list[tuple[Sequence, int]]] | None:
        """The step's logits, the sequences they sample for, the prompt tokens they score (their rows after those),
        and the sequences the pass fed. A pass that fails
        on a fast path runs again without it, which stays off, down to the plain path if need be; one that fails on
        the plain path fails its prompt chunks, the likely cause (a long chunk's memory), and runs the decodes again
        alone (the rest fail with them into `outputs`). A lost device raises DeviceLost; a pass of batch lines alone
        raises Interrupted once `urgent` is set."""
        batch, emitting, scored = build_batch(scheduled, self.block_size, self.device, self.forward.lora)
        lines_only = all(is_batch_line(seq.priority) for seq, _ in scheduled)
        while True:
            path = self._path(batch)
            try:
                return self._run(batch, path, self.urgent if lines_only else None), emitting, scored, scheduled
            except Interrupted:
                raise
            except Exception as e:
                error = self._failure(e, path)
            if path == "plain" or not self.degrade(f"a step failed on it: {error}", path):
                break
        decodes = [(seq, n) for seq, n in scheduled if len(seq) - seq.num_cached == 1]
        prefills = [seq for seq, n in scheduled if len(seq) - seq.num_cached != 1]
        outputs.extend(self._fail(prefills or [seq for seq, _ in scheduled], f"generation failed ({error})"))
        if not prefills or not decodes:
            return None
        batch, emitting, scored = build_batch(decodes, self.block_size, self.device, self.forward.lora)
        try:
            return self._run(batch, self._path(batch)), emitting, scored, decodes
        except Exception as e:
            error = self._failure(e, "without the prompt chunks")
            outputs.extend(self._fail([seq for seq, _ in decodes], f"generation failed ({error})"))
            return None

    def _failure(self, e: Exception, path: str) -> str:
        """Logs a failed forward pass; the error's type. Raises DeviceLost if the device went with it."""
        if device.lost(self.device):
            raise DeviceLost(f"{self.device} was lost: {type(e).__name__}: {e}") from e
        log.exception("forward pass failed (%s)", path)
        return type(e).__name__

    def _path(self, batch: Batch) -> str:
        """The way a pass over `batch` goes: "graphs", "kernel" (its decodes through the Triton kernel) or "plain"."""
        if self.graphs is not None and not batch.prefills and batch.num_decode <= self.graphs.max_batch:
            return "graphs"
        return "kernel" if self.forward.paged and batch.num_decode else "plain"

    def _run(self, batch: Batch, path: str, stop: threading.Event | None = None) -> torch.Tensor:
        """The pass's logits; an eager pass gives up between layers once `stop` is set (a graph's replay cannot)."""
        if path == "graphs":
            assert self.graphs is not None
            return self.graphs(batch)
        return self.forward(batch, stop=stop)

    def _fail(self, seqs: list[Sequence], error: str) -> list[Output]:
        for seq in seqs:
            self.running.remove(seq)
        return [self._finish(seq, Finish.error, error) for seq in seqs]

    def _fail_everything(self, error: str) -> list[Output]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        seqs = [s for s in self.running + [w[2] for w in self.waiting] + self.parked + inbox if s.finish is None]
        self.running, self.waiting, self.parked = [], [], []
        # Blocks are not handed back one by one: the bookkeeping that failed may be what is wrong.
        self.blocks = BlockManager(self.blocks.num_blocks, self.block_size)
        for seq in seqs:
            seq.blocks = []  # they belonged to the pool just dropped
        return [self._finish(seq, Finish.error, error) for seq in seqs]

    # --- scheduling ------------------------------------------------------------------------------------

    def _take_inbox(self) -> list[Output]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        outputs = []
        for seq in inbox:
            if seq.beams is not None and seq is not seq.beams.seqs[0]:
                self.parked.append(seq)
                continue
            width = len(seq.beams.seqs) if seq.beams is not None else 1
            if self.blocks.blocks_for(len(seq) + 1) * width > self.blocks.num_blocks:
                # It would wait at the head of the queue for ever, and everything behind it with it.
                outputs.append(self._finish(seq, Finish.error, "the prompt does not fit in this worker's KV cache"))
                continue
            seq.arrival = next(self._order)
            heapq.heappush(self.waiting, (seq.priority, seq.arrival, seq))
        if cancels:
            for seq in [s for s in self.running if s.id in cancels]:
                self.running.remove(seq)
                outputs.append(self._finish(seq, Finish.cancelled))
            for seq in [s for s in self.parked if s.id in cancels]:
                self.parked.remove(seq)
                outputs.append(self._finish(seq, Finish.cancelled))
            kept = [w for w in self.waiting if w[2].id not in cancels]
            for _, _, seq in self.waiting:
                if seq.id in cancels:
                    outputs.append(self._finish(seq, Finish.cancelled))
            if len(kept) != len(self.waiting):
                self.waiting = kept
                heapq.heapify(self.waiting)
        return outputs

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.stats.preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        if seq.beams is not None:  # its step is computed again once it is back
            seq.beams.rows.pop(seq.id, None)
        # Back in its old place, ahead of later arrivals: queued behind them, a preempted sequence could starve under
        # steady load.
        heapq.heappush(self.waiting, (seq.priority, seq.arrival, seq))

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Picks (sequence, number of new tokens to feed) for this step, taking cache blocks as needed."""
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        budget = self.prefill_chunk
        preempted: set[str] = set()
        for seq in list(self.running):
            if seq.id in preempted:  # by an older sequence, below
                continue
            todo = len(seq) - seq.num_cached
            n = 1 if todo == 1 else min(todo, budget)
            if n == 0:
                continue
            while not self.blocks.grow(seq, seq.num_cached + n):
                victim = self.running[-1]  # the least urgent, of those not scheduled yet in this step
                self._preempt(victim)
                preempted.add(victim.id)
                if victim is seq:
                    break
            if seq.id in preempted:
                continue
            if todo == 1:
                decodes.append((seq, 1))
            else:
                prefills.append((seq, n))
                budget -= n
        self._admit(prefills, budget)
        if not decodes and not prefills and self.waiting:
            self._unblock()
        if self.forward.lora is not None:  # one adapter's rows side by side: its products take them together
            decodes.sort(key=lambda entry: entry[0].lora_slot)
        return decodes + prefills

    def _admit(self, prefills: list[tuple[Sequence, int]], budget: int) -> None:
        """Newcomers join (into `prefills`) while prompt budget and cache room last; the rest wait in the worker's
        own queue, as do those whose adapter has no slot this step."""
        held: list[tuple[int, int, Sequence]] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0][2]
            if seq.lora is not None and not self._slot(seq):
                held.append(heapq.heappop(self.waiting))
                continue
            if not seq.blocks and not seq.scoring:
                self.blocks.reuse_prefix(seq)
            todo = len(seq) - seq.num_cached
            n = min(todo, budget)
            # Keep a block per running sequence in reserve so admitting one does not preempt another next step.
            needed = self.blocks.blocks_for(seq.num_cached + n) - len(seq.blocks) + len(self.running)
            if needed > self.blocks.available():
                self.blocks.release(seq)  # hand back shared blocks it took; it tries again next step
                break
            heapq.heappop(self.waiting)
            self.blocks.hits += seq.num_cached  # counted once it is in, not at every refused try
            if seq.cached_prompt_tokens is None:
                seq.cached_prompt_tokens = seq.num_cached
            self.stats.prefix_queries += len(seq)
            self.stats.prefix_hits += seq.num_cached
            self.blocks.grow(seq, seq.num_cached + n)
            # In (priority, arrival) order: steps schedule from the front and preemption takes from the back, so the
            # most urgent run first and the least urgent, newest gives way first.
            bisect.insort(self.running, seq, key=_rank)
            prefills.append((seq, n))
            budget -= n
        for entry in held:
            heapq.heappush(self.waiting, entry)

    def _slot(self, seq: Sequence) -> bool:
        """Gives the sequence its adapter's slot, swapping the adapter in if need be; False while every slot holds
        an adapter of a running sequence."""
        assert seq.lora is not None and self.forward.lora is not None
        busy = {s.lora_slot for s in self.running if s.lora is not None}
        slot = self.forward.lora.slot_for(seq.lora, busy)
        seq.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _yield_to_prompts(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The step without its batch lines when it prefills another prompt and lines yield (`lines_yield`); they
        keep their places and blocks for the next step."""
        if not self.lines_yield or all(is_batch_line(s.priority) or len(s) - s.num_cached == 1 for s, _ in scheduled):
            return scheduled
        return [(s, n) for s, n in scheduled if not is_batch_line(s.priority)]

    def _unblock(self) -> None:
        """Nothing ran while sequences wait for room: beams that only wait for their siblings give their blocks up
        (they are computed again), or beams of searches waiting on each other would wait for ever."""
        for seq in self.running[::-1]:
            if seq.beams is not None and seq.id in seq.beams.rows:
                self._preempt(seq)

    # --- sampling and finishing ------------------------------------------------------------------------

    def _sample_or_search(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Output]:
        """Samples the next token of each sequence, but for beams, whose rows go to their beam search."""
        beams = [i for i, s in enumerate(seqs) if s.beams is not None]
        if not beams:
            return self._sample(seqs, logits)
        from chatq.worker.beam_step import advance_beams  # which imports the engine's types

        rows = torch.log_softmax(logits[beams].float(), dim=-1)
        outputs = []
        for i, row in zip(beams, rows, strict=True):
            group = seqs[i].beams
            assert group is not None
            group.rows[seqs[i].id] = row
            if group.ready():
                outputs.extend(advance_beams(self, group))
        rest = [i for i in range(len(seqs)) if seqs[i].beams is None]
        if rest:
            outputs.extend(self._sample([seqs[i] for i in rest], logits[rest]))
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Output]:
        rows = [Row(s.params, s.generator, s.prompt_ids, s.output_ids, s.grammar, s.history) for s in seqs]
        try:
            with torch.inference_mode():  # the logits are inference tensors; shaping them in place needs this
                tokens, logprobs = sample(logits, rows)
        except Exception:
            # One sequence's parameters must not sink the batch: sample row by row to find the culprit.
            tokens, logprobs = [], []
            for i, s in enumerate(seqs):
                try:
                    with torch.inference_mode():
                        t, lp = sample(logits[i : i + 1], rows[i : i + 1])
                    tokens.append(t[0])
                    logprobs.append(lp[0])
                except Exception as e:
                    log.exception("sampling failed for %s", s.id, extra=job_of(s))
                    s.error = f"sampling failed ({type(e).__name__})"
                    tokens.append(-1)
                    logprobs.append(None)
        outputs = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            try:
                finish, error = self._advance(seq, token)
            except Exception as e:  # one sequence's grammar must not stop the others' step
                log.exception("advancing %s failed", seq.id, extra=job_of(seq))
                finish, error = Finish.error, f"generation failed ({type(e).__name__})"
            if finish is Finish.error:
                outputs.extend(self._fail([seq], error or "generation failed"))
                continue
            if finish:
                self.running.remove(seq)
                self._finish(seq, finish)
            outputs.append(Output(seq, token, finish, logprob))
        return outputs

    def _advance(self, seq: Sequence, token: int) -> tuple[Finish | None, str | None]:
        """Takes a sampled token into the sequence; returns how it ends, if it does, and why if it failed."""
        if token < 0:  # its sampling failed
            return Finish.error, seq.error
        finish = seq.take(token, self.max_model_len)
        return finish, "the grammar rejected a sampled token" if finish is Finish.error else None

    def _finish(self, seq: Sequence, finish: Finish, error: str | None = None) -> Output:
        self._release(seq)
        seq.finish = finish
        seq.error = error
        return Output(seq, None, finish)


def repeats(output: list[int], smallest: int, largest: int, count: int) -> bool:
    """Whether the output ends in a pattern of `smallest`..`largest` tokens repeated `count` times: vLLM's check,
    which tries the sizes upward and stops at the first the output is too short for."""
    for size in range(max(smallest, 1), largest + 1):
        if size * count > len(output):
            return False
        tail = output[-size:]
        if all(output[len(output) - size * (m + 1) : len(output) - size * m] == tail for m in range(1, count)):
            return True
    return False


def job_of(seq: Sequence) -> dict[str, str]:
    """The log fields naming the sequence's job: its id is the job's id, "/", the choice's index (see jobrun)."""
    return logs.job_extra(seq.id.rpartition("/")[0])
