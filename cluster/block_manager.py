"""BlockManager: one worker's KV memory, as the scheduler sees it.

The worker's KV pool is ``num_blocks`` blocks of ``block_size`` token slots. Here, per
block: who holds it (a reference count), and, once it is full of computed tokens, what
it holds (its *content key*). A sequence holds a list of blocks (its block table) that
covers its computed tokens and the ones about to be computed.

Automatic prefix caching: a full block's content key is a SHA-256 digest (``bytes``,
``KEY_BYTES`` = 32 of them) of the key of the block before it followed by the block's
tokens (little-endian int32). Before the first block stands the digest of the ``salt``
and the block size: the salt names what, besides the tokens, makes a block's KV (the
model and its dtype, ``model_salt``). So equal keys mean equal prefixes up to and
including that block under the same model, and the KV in the block is the same. This
is vLLM's scheme (sha256 of the parent hash, the token ids and the extra keys).

A key costs O(block_size) to build, hash and compare however deep its block is, and
``bytes`` cache their hash. (Keys were tuples nesting every key before them: O(depth)
per lookup, O(depth^2) for a prefix, and a RecursionError past ~1,000 blocks.) Keys
mean the same thing in every block manager with the same salt and block size, in every
process (nothing per-process like ``hash()``'s seed), so one sequence's keys can be
probed against any worker's cache (prefix routing).

A digest could in principle be shared by two different prefixes, and a request would
then read another's KV. It is no practical risk: two given different prefixes share a
SHA-256 key with probability 2^-256 (a 128-bit digest would already make it 2^-128);
among 2^64 keys, the chance that any two are equal is about 2^-129; and building a
colliding pair on purpose takes about 2^128 SHA-256 evaluations.

A block whose last holder leaves keeps its key and stays findable until its memory is
needed: free blocks are reused least recently freed first, and a block that is reused
loses its key (eviction). A new sequence first takes the longest run of cached blocks
matching its tokens (bumping their counts), then fresh blocks.

Freed blocks go back to the free list tail-first (a sequence's last blocks are the
least likely to be shared), as vLLM does.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import sha256

#: The key of "no block before this one" (the chain then starts from the salt's digest).
ROOT = None
#: The size of a content key (a SHA-256 digest), in bytes.
KEY_BYTES = 32
#: Token ids go in as 4-byte ints, little-endian on every host, so a key is the same
#: everywhere ("i" is a C int: 4 bytes wherever CPython runs on Linux, macOS, Windows).
_I32 = "i"
assert array(_I32).itemsize == 4
_SWAP = sys.byteorder == "big"


def model_salt(model: str, dtype: str) -> str:
    """The salt of a worker's block manager: what, besides the tokens, makes its KV."""
    return f"model={model}\x00dtype={dtype}"


def root_key(salt: str | bytes | None, block_size: int) -> bytes:
    """The key that stands before a chain's first block: the digest of ``salt`` (a
    string, bytes or None) and the block size."""
    if salt is None:
        salt = b""
    elif isinstance(salt, str):
        salt = salt.encode()
    elif not isinstance(salt, bytes):
        raise TypeError(f"the salt is a str or bytes, got {type(salt).__name__}")
    return sha256(b"raydecode-kv-root\x00%d\x00" % block_size + salt).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 salt: str | bytes | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.root = root_key(salt, block_size)
        self.ref_count = [0] * num_blocks
        #: content key of each block (None: not full, or not cached)
        self.block_key: list[bytes | None] = [None] * num_blocks
        #: content key -> the block that holds it
        self.cached: dict[bytes, int] = {}
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

    def chain(self, parent: bytes | None, tokens: Sequence[int]) -> list[bytes]:
        """Content keys of the full blocks in ``tokens`` (a whole number of blocks; a
        partial last block is left out), which follow the block whose key is ``parent``
        (ROOT: the first block). O(block_size) per block."""
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            return []
        ids = array(_I32, tokens[: n * bs] if len(tokens) != n * bs else tokens)
        if _SWAP:
            ids.byteswap()
        data = ids.tobytes()
        key = self.root if parent is ROOT else parent
        keys = []
        width = 4 * bs
        for start in range(0, n * width, width):
            key = sha256(key + data[start : start + width]).digest()
            keys.append(key)
        return keys

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
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

    def take_cached(self, keys: Sequence[bytes]) -> list[int]:
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

    def register(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
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
