"""BlockManager against a plain reference: hypothesis drives sequences that arrive
(taking their cached prefix, then fresh blocks), grow, compute, register their full
blocks, finish or are preempted, while the reference records what every block really
holds. After every step: no block leaked or held twice by one sequence, reference counts
equal the holders, the free list is exactly the unheld blocks, and every block taken
from the prefix cache holds exactly the tokens the taker asked for (equal prefixes have
equal keys; different ones never share)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.block_manager import KEY_BYTES, ROOT, BlockManager, model_salt
from hypothesis_budget import examples

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
        self.keys: list[bytes] = []


class BlockMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans())
    def setup(self, caching):
        self.bm = BlockManager(NB, BS, enable_prefix_caching=caching, salt="m")
        self.live: list[Seq] = []
        #: what the reference knows each block holds: tokens written at computed positions
        self.content: dict[int, list] = {b: [None] * BS for b in range(NB)}
        #: every key made so far -> the prefix it stands for (the whole token run up to
        #: and including its block); no two prefixes may share a key
        self.prefix_of: dict[bytes, tuple] = {}

    # -- the scheduler's moves -------------------------------------------------------

    def keys(self, seq: Seq, n_blocks: int) -> list[bytes]:
        if len(seq.keys) < n_blocks:
            parent = seq.keys[-1] if seq.keys else None
            seq.keys.extend(self.bm.chain(parent, seq.tokens[len(seq.keys) * BS : n_blocks * BS]))
            for i, key in enumerate(seq.keys):
                prefix = tuple(seq.tokens[: (i + 1) * BS])
                assert self.prefix_of.setdefault(key, prefix) == prefix, "two prefixes share a key"
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
            # the key's last block of tokens is the block's content
            assert tuple(self.content[block]) == self.prefix_of[key][-BS:], (key.hex(), self.content[block])


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)


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


# -- keys: digests that cost the same at any depth and mean the same everywhere ---------


def test_keys_are_digests_of_the_documented_size_equal_for_equal_prefixes_and_salts():
    keys = BlockManager(8, 2, salt="model-a").chain(ROOT, [1, 2, 3, 4, 5, 6])
    assert len(keys) == 3 and all(type(k) is bytes and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 3
    # another manager, same salt and block size: the same keys (nothing per instance)
    assert BlockManager(99, 2, salt="model-a").chain(ROOT, [1, 2, 3, 4, 5, 6]) == keys
    assert BlockManager(8, 2, salt=b"model-a").chain(ROOT, [1, 2, 3, 4, 5, 6]) == keys  # str is its utf-8
    # a different salt, or none, changes every key
    for other in ("model-b", None, model_salt("model-a", "float32")):
        assert not set(BlockManager(8, 2, salt=other).chain(ROOT, [1, 2, 3, 4, 5, 6])) & set(keys)
    # the model's dtype is part of the salt
    assert model_salt("m", "float32") != model_salt("m", "bfloat16")
    # a partial last block has no key
    assert BlockManager(8, 2, salt="model-a").chain(ROOT, [1, 2, 3, 4, 5]) == keys[:2]
    # the block size is folded in: [1, 2, 3, 4] as one block is not two blocks of 2
    assert BlockManager(8, 4, salt="model-a").chain(ROOT, [1, 2, 3, 4])[0] not in keys
    with pytest.raises(TypeError, match="salt"):
        BlockManager(8, 2, salt=("model-a",))


def test_a_16k_token_shared_prefix_is_found_block_for_block():
    """The reported case: at 16 tokens a block, two equal 16,384-token prompts. Nested
    tuple keys raised RecursionError comparing the second chain's keys."""
    bm = BlockManager(1100, 16, salt="m")
    tokens = [(i * 7919) % 50_000 for i in range(16_384)]
    a, b = bm.chain(ROOT, tokens), bm.chain(ROOT, list(tokens))
    assert len(a) == 1024 and a == b
    blocks = bm.allocate(1024)
    bm.register(blocks, a)
    assert bm.cached_prefix(b) == 1024
    assert bm.take_cached(b) == blocks
    assert all(bm.cached[k] == blk for k, blk in zip(b, blocks))
    # built in pieces (as a sequence's tokens arrive), the chain is the same
    assert bm.chain(ROOT, tokens[:160]) + bm.chain(a[9], tokens[160:]) == a
    # one token changed in block 3: blocks 0-2 still hit, none after
    changed = list(tokens)
    changed[3 * 16 + 5] += 1
    assert bm.cached_prefix(bm.chain(ROOT, changed)) == 3


KEYS_SCRIPT = """
from cluster.block_manager import BlockManager, model_salt
bm = BlockManager(4, 16, salt=model_salt("some/model", "bfloat16"))
print(",".join(k.hex() for k in bm.chain(None, list(range(100, 164)))))
"""


@pytest.mark.slow  # a second interpreter
def test_keys_are_the_same_in_another_process():
    """No per-process randomness (``hash()`` is seeded per process; these are not)."""
    root = Path(__file__).resolve().parent.parent
    want = BlockManager(4, 16, salt=model_salt("some/model", "bfloat16")).chain(ROOT, list(range(100, 164)))
    outs = set()
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", KEYS_SCRIPT], cwd=root, capture_output=True, text=True,
                              timeout=120, env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        outs.add(done.stdout.strip())
    assert outs == {",".join(k.hex() for k in want)}
