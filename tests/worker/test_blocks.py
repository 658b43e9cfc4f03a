"""The KV block manager alone: sharing full prompt blocks, and which cached ones go first when the pool runs short."""

from __future__ import annotations

from dataclasses import dataclass, field

from chatq.worker.blocks import BlockManager


@dataclass
class Seq:
    prompt_ids: list[int]
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached: int = 0
    cache_salt: bytes = b""


def computed(manager: BlockManager, prompt: list[int], salt: bytes = b"") -> Seq:
    """A sequence whose prompt went through a forward pass, its full blocks registered for sharing."""
    seq = Seq(prompt, cache_salt=salt)
    manager.reuse_prefix(seq)
    assert manager.grow(seq, len(prompt))
    seq.num_cached = len(prompt)
    manager.register(seq)
    return seq


def test_a_cached_prefix_loses_its_end_first_when_the_pool_runs_short():
    manager = BlockManager(num_blocks=4, block_size=4)
    system = list(range(100, 108))  # two blocks every request starts with
    manager.release(computed(manager, [*system, 1, 2, 3, 4, 5]))  # three full blocks cached, then idle
    for filler in ([9] * 4, [8] * 4):  # two unrelated requests: the second takes a cached block
        assert manager.grow(Seq(filler), 4)
    again = Seq([*system, 1, 2, 3, 4, 7])
    manager.reuse_prefix(again)
    # The block evicted was the prefix's last: its first two are still found, not left cached but unreachable.
    assert again.num_cached == 8


def test_a_prefix_cached_under_one_salt_is_found_only_under_that_salt():
    manager = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))
    computed(manager, [*system, 1], salt=b"key a")
    for salt, found in ((b"key a", 12), (b"key b", 0), (b"", 0)):
        seq = Seq([*system, 2], cache_salt=salt)
        manager.reuse_prefix(seq)
        assert seq.num_cached == found, salt
        manager.release(seq)
