"""CUDA graphs of the decode step, one per batch-size bucket.

A small model's decode step is many short kernels that take longer to launch from Python than to run; a captured
graph replays them in one launch. A step of n sequences fills the first n rows of fixed buffers and replays the
smallest bucket holding them; padding rows use the cache's spare block. With adapters (chatq.worker.lora) each bucket
has a second graph, whose rows are gathered by adapter through buffers too, so steps of the base model alone pay
nothing for them. Steps with prompt chunks or beyond the largest bucket run eagerly. Off CUDA the buffers run
uncaptured, so tests check the padding.
"""

from __future__ import annotations

import bisect

import torch

from chatq.worker.forward import Batch, PagedForward
from chatq.worker.lora import Rows


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 (as vLLM captures): a step pads at most 7 rows."""
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, forward: PagedForward, max_batch: int, max_blocks: int):
        self.forward = forward
        cache = forward.cache
        dev = cache.k[0].device
        self.capture = dev.type == "cuda"
        if self.capture and not forward.paged:
            # Decode attention without the kernel reads the step's context width on the host, which no graph holds.
            raise RuntimeError("the paged decode kernel is off, so the decode step cannot be captured")
        self.spare_block = cache.spare_block
        self.spare_slot = cache.spare_block * cache.block_size
        self.sizes = buckets(max_batch)
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.spare_slot, dtype=torch.long, device=dev)
        self.table = torch.full((n, max_blocks), self.spare_block, dtype=torch.int32, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        # With adapters: each token's place in the gathering by slot, and its inverse (chatq.worker.lora.Rows).
        self.lora = forward.lora
        stack = 1 + (self.lora.slots if self.lora is not None else 0)
        self.lora_take = torch.zeros(stack * n, dtype=torch.long, device=dev)
        self.lora_back = torch.zeros(n, dtype=torch.long, device=dev)
        self.variants = (False, True) if forward.lora is not None else (False,)  # without adapters, with
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        if self.capture:
            # One output shared by every bucket: one per graph would hold an [n, V] float32 block per bucket, memory
            # the KV-cache sizing never accounted for.
            self.out = torch.empty(n, forward.head.out_features, dtype=torch.float32, device=dev)
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _static(self, n: int, lora: bool, rows: Rows | None = None) -> Batch:
        """The buffers' first n rows as a batch; `lora`: with the adapters' gathering, its buffers' or `rows`."""
        if lora and rows is None:
            stack = self.lora_take.shape[0] // self.max_batch
            rows = Rows(self.lora_take[: stack * n], self.lora_back[:n], 0, stack, n, [], torch.zeros(0, 3))
        return Batch(
            lora_rows=rows,
            input_ids=self.ids[:n],
            positions=self.positions[:n],
            slots=self.slots[:n],
            num_decode=n,
            dec_table=self.table[:n],
            dec_lens=self.lens[:n],
            prefills=[],
            logits_at=None,
        )

    def _capture_all(self) -> None:
        # Largest first, all in one memory pool: smaller graphs reuse the larger ones' scratch memory.
        pool = None
        side = torch.cuda.Stream()
        for n in reversed(self.sizes):
            for lora in self.variants:
                batch = self._static(n, lora)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up outside capture: Triton compiles, cuBLAS picks its kernels
                    self.forward(batch)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.forward(batch, self.out[:n])
                pool = graph.pool()
                self.graphs[(n, lora)] = graph
        for graph in self.graphs.values():  # a graph's first replay uploads it: here, not in a request's step
            graph.replay()
        torch.cuda.synchronize()

    def __call__(self, b: Batch) -> torch.Tensor:
        """Logits [n, V] of a decode-only batch of n <= max_batch sequences."""
        assert b.dec_table is not None and b.dec_lens is not None
        n = b.num_decode
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = b.dec_table.shape[1]
        self.ids[:n].copy_(b.input_ids)
        self.positions[:n].copy_(b.positions)
        self.slots[:n].copy_(b.slots)
        self.table[:n, :width].copy_(b.dec_table)
        self.lens[:n].copy_(b.dec_lens)
        lora, fixed = b.lora_rows is not None, None
        if b.lora_rows is not None:
            assert self.lora is not None
            fixed = self.lora.fixed_rows(b.lora_rows, size)
            self.lora_take[: fixed.take.shape[0]].copy_(fixed.take)
            self.lora_back[:size].copy_(fixed.back)
        if size > n:  # rows a previous step filled now pad: point them back at the spare block
            self.slots[n:size].fill_(self.spare_slot)
            self.table[n:size, 0].fill_(self.spare_block)
            self.lens[n:size].fill_(1)
        if not self.capture:
            return self.forward(self._static(size, lora, fixed))[:n]
        self.graphs[(size, lora)].replay()
        return self.out[:n]
