"""BlockManager: one worker's KV memory, as the scheduler sees it.

The worker's KV pool is ``num_blocks`` blocks of ``block_size`` token slots. Here, per
block: who holds it (a reference count), and, once it is full of computed tokens, what
it holds (its *content key*). A sequence holds a list of blocks (its block table) that
covers its computed tokens and the ones about to be computed.

Automatic prefix caching: a full block's content key is (the key of the block before it,
its tokens), so equal keys mean equal prefixes up to and including that block, and the
KV in the block is the same (one model per engine, so nothing else changes it; ``salt``
separates what else might). Keys are exact (tuples compared by value, never a hash that
two different prefixes could share), so no request can read another's KV by collision.
A block whose last holder leaves keeps its key and stays findable until its memory is
needed: free blocks are reused least recently freed first, and a block that is reused
loses its key (eviction). A new sequence first takes the longest run of cached blocks
matching its tokens (bumping their counts), then fresh blocks.

Freed blocks go back to the free list tail-first (a sequence's last blocks are the
least likely to be shared), as vLLM does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: The key of "no block before this one".
ROOT = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, salt: object = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.ref_count = [0] * num_blocks
        #: content key of each block (None: not full, or not cached)
        self.block_key: list[tuple | None] = [None] * num_blocks
        #: content key -> the block that holds it
        self.cached: dict[tuple, int] = {}
        #: blocks with no holder, least recently freed first (cached ones stay findable)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Counters (prefix cache queries and hits, in tokens; evictions in blocks).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted = 0

    # -- views ----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free ones, cached or not)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """The share of blocks held by sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- keys -----------------------------------------------------------------------

    def chain(self, parent: tuple | None, tokens: Sequence[int]) -> list[tuple]:
        """Content keys of the full blocks in ``tokens`` (a whole number of blocks),
        which follow the block whose key is ``parent`` (ROOT: the first block)."""
        bs = self.block_size
        keys = []
        key = (self.salt,) if parent is ROOT else parent
        for i in range(len(tokens) // bs):
            key = (key, tuple(tokens[i * bs : (i + 1) * bs]))
            keys.append(key)
        return keys

    def cached_prefix(self, keys: Sequence[tuple]) -> int:
        """How many of ``keys`` (a chain from the first block) are cached, in blocks."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for key in keys:
            if key not in self.cached:
                break
            n += 1
        return n

    # -- allocation -----------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def take_cached(self, keys: Sequence[tuple]) -> list[int]:
        """Holds the cached blocks of the longest cached run of ``keys``; returns them."""
        blocks = []
        for key in keys[: self.cached_prefix(keys)]:
            block = self.cached[key]
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
            blocks.append(block)
        return blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks (evicting the least recently freed cached ones);
        ``ValueError`` when not that many are free (check ``can_allocate`` first)."""
        if num_blocks > len(self.free):
            raise ValueError(f"{num_blocks} blocks asked, {len(self.free)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self.free.popitem(last=False)
            key = self.block_key[block]
            if key is not None:
                self.block_key[block] = None
                if self.cached.get(key) == block:
                    del self.cached[key]
                self.num_evicted += 1
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """The holder of ``blocks`` leaves: each count drops; blocks nobody holds go to
        the free list, last block first (cached ones stay findable until reused)."""
        for block in reversed(blocks):
            count = self.ref_count[block] - 1
            if count < 0:
                raise ValueError(f"block {block} released more often than held")
            self.ref_count[block] = count
            if count == 0:
                self.free[block] = None

    def register(self, blocks: Sequence[int], keys: Sequence[tuple]) -> None:
        """``blocks[i]`` now holds computed content ``keys[i]``: findable by later
        sequences. A key already cached in another block keeps that block (this one
        stays private to its holder)."""
        if not self.enable_prefix_caching:
            return
        for block, key in zip(blocks, keys):
            if self.block_key[block] is not None:
                continue
            if key in self.cached:
                continue
            self.block_key[block] = key
            self.cached[key] = block

    def note_query(self, num_tokens: int, num_hit: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def reset(self) -> None:
        """Forgets every holder and every cached key (the worker's KV can no longer be
        trusted); the counters stay."""
        self.ref_count = [0] * self.num_blocks
        self.block_key = [None] * self.num_blocks
        self.cached = {}
        self.free = OrderedDict((b, None) for b in range(self.num_blocks))
