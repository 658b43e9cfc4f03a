"""KV cache blocks: who holds which, and which full prompt blocks can be shared (prefix caching).

A full prompt block is registered under a SHA-256 digest of the prefix up to its end, so later prompts starting the
same way (a system prompt, a template header) reuse it. Not hash(): forged collisions would hand one client's
prompt another's cached K/V. Registered blocks nobody holds stay reusable until the pool needs them, least recently
released first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Protocol


class HoldsBlocks(Protocol):
    prompt_ids: list[int]
    blocks: list[int]
    block_hashes: list[bytes]  # digests of the full prompt blocks registered so far
    num_cached: int
    cache_salt: bytes  # begins its chain of digests: blocks are shared only between sequences of one salt


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self.idle: OrderedDict[int, None] = OrderedDict()  # held by nobody, content still registered
        self.refs = [0] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.hits = 0  # prompt tokens whose computation a shared block saved

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.idle.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
        self.refs[block] = 1
        return block

    def grow(self, seq: HoldsBlocks, num_tokens: int) -> bool:
        """Gives `seq` blocks for its first `num_tokens` tokens; False (and nothing taken) if the pool is short."""
        need = self.blocks_for(num_tokens) - len(seq.blocks)
        if need > self.available():
            return False
        seq.blocks.extend(self._take() for _ in range(max(need, 0)))
        return True

    def release(self, seq: HoldsBlocks) -> None:
        # Last block first into the idle list (oldest out first): a cached prefix is matched from its first block, so
        # that block must be evicted last.
        for block in reversed(seq.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)
        seq.blocks, seq.block_hashes, seq.num_cached = [], [], 0

    def share(self, blocks: list[int]) -> None:
        """One more holder of these held blocks: a beam forked from the sequence holding them."""
        for block in blocks:
            self.refs[block] += 1

    def own_last(self, seq: HoldsBlocks) -> int | None:
        """Before a forked sequence writes into its last block, partly filled and shared with a sibling: a block of
        its own in its place, and the shared one returned for the caller to copy the K/V from. Without a free block
        it lets the shared one go and computes its tokens there again. None when there is nothing to copy."""
        bs = self.block_size
        if seq.num_cached % bs == 0 or not seq.blocks or self.refs[seq.blocks[-1]] == 1:
            return None
        shared = seq.blocks[-1]
        self.refs[shared] -= 1
        if self.available():
            seq.blocks[-1] = self._take()
            return shared
        seq.blocks.pop()
        seq.num_cached = len(seq.blocks) * bs
        del seq.block_hashes[len(seq.blocks) :]
        return None

    def reuse_prefix(self, seq: HoldsBlocks) -> None:
        """Before a sequence's first prefill: take every registered block its prompt starts with."""
        bs, prompt = self.block_size, seq.prompt_ids
        h = seq.cache_salt
        # At least the last prompt token is computed again: its logits give the first output token.
        for i in range((len(prompt) - 1) // bs):
            h = _digest(h, prompt[i * bs : (i + 1) * bs])
            block = self.by_hash.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.idle[block]
            self.refs[block] += 1
            seq.blocks.append(block)
            seq.block_hashes.append(h)
        seq.num_cached = len(seq.blocks) * bs

    def register(self, seq: HoldsBlocks) -> None:
        """After a forward pass: make the sequence's newly completed full prompt blocks shareable."""
        bs, prompt = self.block_size, seq.prompt_ids
        for i in range(len(seq.block_hashes), min(seq.num_cached, len(prompt)) // bs):
            prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            h = _digest(prev, prompt[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.blocks[i]
            if h not in self.by_hash and block not in self.hash_of:
                self.by_hash[h] = block
                self.hash_of[block] = h


def _digest(prefix: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(prefix + array("q", tokens).tobytes()).digest()
