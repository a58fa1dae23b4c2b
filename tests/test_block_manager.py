"""BlockManager against a plain reference: hypothesis drives sequences that arrive
(taking their cached prefix, then fresh blocks), grow, compute, register their full
blocks, finish or are preempted, while the reference records what every block really
holds. After every step: no block leaked or held twice by one sequence, reference counts
equal the holders, the free list is exactly the unheld blocks, and every block taken
from the prefix cache holds exactly the tokens the taker asked for (equal prefixes have
equal keys; different ones never share)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.block_manager import BlockManager

BS = 4
NB = 24

# A few shared "system prompts" so prefixes repeat, plus random tails.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]
tails = st.lists(st.integers(0, 9), min_size=0, max_size=10)


class Seq:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.blocks: list[int] = []
        self.computed = 0
        self.registered = 0
        self.keys: list[tuple] = []


class BlockMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans())
    def setup(self, caching):
        self.bm = BlockManager(NB, BS, enable_prefix_caching=caching, salt="m")
        self.live: list[Seq] = []
        #: what the reference knows each block holds: tokens written at computed positions
        self.content: dict[int, list] = {b: [None] * BS for b in range(NB)}

    # -- the scheduler's moves -------------------------------------------------------

    def keys(self, seq: Seq, n_blocks: int) -> list[tuple]:
        if len(seq.keys) < n_blocks:
            parent = seq.keys[-1] if seq.keys else None
            seq.keys.extend(self.bm.chain(parent, seq.tokens[len(seq.keys) * BS : n_blocks * BS]))
        return seq.keys[:n_blocks]

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=tails, first_chunk=st.integers(1, 12))
    def arrive(self, prefix, tail, first_chunk):
        seq = Seq(PREFIXES[prefix] + tail + [7])  # at least one token past the prefix
        keys = self.keys(seq, (len(seq.tokens) - 1) // BS)
        hit = self.bm.cached_prefix(keys)
        computed = hit * BS
        n = min(first_chunk, len(seq.tokens) - computed)
        need = -(-(computed + n) // BS) - hit
        idle = sum(self.bm.ref_count[self.bm.cached[k]] == 0 for k in keys[:hit])
        if not self.bm.can_allocate(need + idle):
            return
        taken = self.bm.take_cached(keys[:hit])
        for i, block in enumerate(taken):  # what a cache hit serves must be what was asked
            assert self.content[block] == seq.tokens[i * BS : (i + 1) * BS], (block, self.content[block])
        seq.blocks = taken + self.bm.allocate(need)
        seq.computed = seq.registered = computed
        seq.registered = hit
        self.live.append(seq)
        self.compute(seq, n)

    def compute(self, seq: Seq, n: int) -> None:
        """The worker writes positions computed..computed+n into the seq's blocks; then
        the driver registers the blocks that became full."""
        for pos in range(seq.computed, seq.computed + n):
            block = seq.blocks[pos // BS]
            assert self.bm.ref_count[block] >= 1
            self.content[block][pos % BS] = seq.tokens[pos]
        seq.computed += n
        full = min(seq.computed // BS, len(seq.blocks))
        if full > seq.registered:
            self.bm.register(seq.blocks[seq.registered : full], self.keys(seq, full)[seq.registered : full])
            seq.registered = full

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 8), new_tokens=st.lists(st.integers(0, 9), max_size=3))
    def step(self, data, n, new_tokens):
        seq = data.draw(st.sampled_from(self.live))
        seq.tokens.extend(new_tokens)  # the output grows
        n = min(n, len(seq.tokens) - seq.computed)
        if n <= 0:
            return
        need = max(0, -(-(seq.computed + n) // BS) - len(seq.blocks))
        if not self.bm.can_allocate(need):
            return
        seq.blocks += self.bm.allocate(need)
        self.compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def leave(self, data, preempt):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.release(seq.blocks)
        seq.blocks = []

    @rule()
    def reset(self):
        if not self.live:
            self.bm.reset()
            self.content = {b: [None] * BS for b in range(NB)}

    # -- what must always hold -------------------------------------------------------

    @invariant()
    def counts_match_holders(self):
        if not hasattr(self, "bm"):
            return
        holders = [0] * NB
        for seq in self.live:
            assert len(set(seq.blocks)) == len(seq.blocks), "a sequence holds a block twice"
            for b in seq.blocks:
                holders[b] += 1
        assert holders == self.bm.ref_count
        free = set(self.bm.free)
        assert free == {b for b in range(NB) if holders[b] == 0}, "free list != unheld blocks"
        assert self.bm.num_free == len(free)

    @invariant()
    def the_cache_is_true(self):
        if not hasattr(self, "bm"):
            return
        for key, block in self.bm.cached.items():
            assert self.bm.block_key[block] == key
            # the key's last tokens are the block's content
            assert tuple(self.content[block]) == key[1], (key, self.content[block])


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_equal_prefixes_have_equal_keys_and_different_ones_never_meet():
    bm = BlockManager(8, 2, salt="model-a")
    a = bm.chain(None, [1, 2, 3, 4])
    assert a == bm.chain(None, [1, 2, 3, 4]) and len(a) == 2
    b = bm.chain(None, [1, 2, 3, 5])
    assert a[0] == b[0] and a[1] != b[1]
    # the same tokens after a different first block are a different block
    assert bm.chain(None, [9, 9, 3, 4])[1] != a[1]
    # another salt (another model) never shares
    assert BlockManager(8, 2, salt="model-b").chain(None, [1, 2, 3, 4])[0] != a[0]
    # a chain continued from a key equals the chain from the start
    assert bm.chain(a[0], [3, 4]) == a[1:]


def test_freed_cached_blocks_are_reused_least_recent_first_and_lose_their_key():
    bm = BlockManager(3, 2)
    keys = bm.chain(None, [1, 2, 3, 4])
    blocks = bm.allocate(2)
    bm.register(blocks, keys)
    bm.release(blocks)  # tail first: blocks[1] then blocks[0] join the free list
    assert bm.cached_prefix(keys) == 2 and bm.num_free == 3
    assert bm.take_cached(keys[:1]) == [blocks[0]] and bm.num_free == 2
    fresh = bm.allocate(2)  # the never-used block, then the oldest freed (blocks[1]) is evicted
    assert blocks[1] in fresh and bm.cached_prefix(keys) == 1 and bm.num_evicted == 1
    with pytest.raises(ValueError, match="blocks asked"):
        bm.allocate(1)
    with pytest.raises(ValueError, match="released more often"):
        bm.release([blocks[1], blocks[1], blocks[1]])
