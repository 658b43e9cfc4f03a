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


def fork(manager: BlockManager, parent: Seq) -> Seq:
    """A beam continuing `parent`: its blocks shared, as the engine forks them."""
    manager.share(parent.blocks)
    return Seq(parent.prompt_ids, list(parent.blocks), list(parent.block_hashes), parent.num_cached)


def test_forked_beams_share_full_blocks_and_copy_a_shared_last_one():
    manager = BlockManager(num_blocks=6, block_size=4)
    parent = computed(manager, list(range(6)))  # a full block and a half-filled one
    a, b = fork(manager, parent), fork(manager, parent)
    manager.release(parent)
    copied = manager.own_last(a)
    assert copied == b.blocks[-1], "the K/V to copy are the shared block's"
    assert a.blocks[0] == b.blocks[0] and a.blocks[-1] != b.blocks[-1]
    assert manager.own_last(b) is None, "the last holder writes into the block it has"
    manager.release(a)
    manager.release(b)
    assert manager.available() == 6


def test_a_forked_beam_without_a_free_block_computes_its_last_one_again():
    manager = BlockManager(num_blocks=2, block_size=4)
    parent = computed(manager, list(range(6)))
    a, b = fork(manager, parent), fork(manager, parent)
    manager.release(parent)
    assert manager.own_last(a) is None
    assert a.blocks == b.blocks[:1] and a.num_cached == 4
    assert manager.own_last(b) is None and b.num_cached == 6


def test_a_prefix_cached_under_one_salt_is_found_only_under_that_salt():
    manager = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))
    computed(manager, [*system, 1], salt=b"key a")
    for salt, found in ((b"key a", 12), (b"key b", 0), (b"", 0)):
        seq = Seq([*system, 2], cache_salt=salt)
        manager.reuse_prefix(seq)
        assert seq.num_cached == found, salt
        manager.release(seq)
