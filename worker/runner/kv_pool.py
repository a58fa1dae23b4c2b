"""The paged KV pool: the worker's key/value storage.

Per layer, keys and values for ``num_blocks`` blocks of ``block_size`` token slots,
``[num_blocks, kv_heads, block_size, head_dim]``. The driver's ``BlockManager`` decides
which blocks a sequence holds; the worker keeps each row's block table
(``InputBatch.block_table``) and reads the pool through it. A token at position ``p`` of
a row lives in slot ``p % block_size`` of the row's block ``table[p // block_size]``.
Blocks are shared between rows (a cached prefix) and never copied: a row only writes
positions past what it found cached, which start a block of its own.
"""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import numpy as np
import psutil
import torch


class KVLayout(NamedTuple):
    """What a model's KV pool is shaped by."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    #: the values are the keys (multi-head latent attention stores one row a token)
    shared_values: bool = False


def kv_layout(hf_config: Any, dtype: torch.dtype) -> KVLayout:
    """A model's pool layout from its config: its KV heads and head size, or, for
    multi-head latent attention, one head of latent + rotary key with no separate values
    (``worker/runner/latent_attention.py``)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    if getattr(cfg, "kv_lora_rank", None) is not None and getattr(cfg, "qk_rope_head_dim", None) is not None:
        return KVLayout(cfg.num_hidden_layers, 1, int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim), dtype, True)
    heads = cfg.num_attention_heads
    kv_heads = 1 if getattr(cfg, "multi_query", False) else getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVLayout(cfg.num_hidden_layers, kv_heads, head_dim, dtype)


class PagedKVCache:
    """Key/value storage: ``num_blocks`` blocks of ``block_size`` slots per layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        prefault: bool = False,
        scratch_blocks: int = 0,
        shared_values: bool = False,
    ) -> None:
        """``scratch_blocks`` more blocks follow the ``num_blocks`` the driver allocates:
        the worker's own (padding rows of a CUDA-graph step write there).
        ``shared_values``: ``values`` are ``keys`` (no memory of their own)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        #: the first block past the driver's (None: no scratch blocks)
        self.scratch_block = num_blocks if scratch_blocks else None
        shape = (num_blocks + scratch_blocks, num_kv_heads, block_size, head_dim)
        self.keys = [_lazy_zeros(shape, dtype, device, prefault) for _ in range(num_layers)]
        self.values = list(self.keys) if shared_values else [
            _lazy_zeros(shape, dtype, device, prefault) for _ in range(num_layers)]
        self.shared_values = shared_values

    @classmethod
    def for_layout(cls, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device,
                   prefault: bool = False, scratch_blocks: int = 0) -> PagedKVCache:
        return cls(layout.num_layers, num_blocks, block_size, layout.num_kv_heads, layout.head_dim, layout.dtype,
                   device, prefault=prefault, scratch_blocks=scratch_blocks, shared_values=layout.shared_values)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                        shared_values: bool = False) -> int:
        tensors = 1 if shared_values else 2
        return tensors * num_layers * num_kv_heads * head_dim * block_size * torch.empty(0, dtype=dtype).element_size()

    @staticmethod
    def layout_bytes_per_block(layout: KVLayout, block_size: int) -> int:
        return PagedKVCache.bytes_per_block(layout.num_layers, layout.num_kv_heads, layout.head_dim, block_size,
                                            layout.dtype, layout.shared_values)

    @property
    def num_bytes(self) -> int:
        tensors = self.keys if self.shared_values else (*self.keys, *self.values)
        return sum(t.numel() * t.element_size() for t in tensors)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                prefault: bool = False) -> torch.Tensor:
    """Zeros; on CPU an anonymous mapping, so the OS commits pages only as blocks are
    first used (a pool sized for long requests costs what the requests touch), asked
    for transparent huge pages: a prefill writes its keys and values into fresh blocks,
    and with 4 KB pages the page faults alone are a visible share of each layer's time
    (2 MB pages: 512x fewer faults). ``prefault``: every page committed now, by writing
    the zeros (after the huge-page advice, so the pages are huge ones): a first touch
    costs time in proportion to the memory touched, which the first requests would
    otherwise pay."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size = int(np.prod(shape)) * itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # no THP on this kernel: 4 KB pages
            pass
    raw = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive
    pool = torch.from_numpy(raw)
    if prefault:
        pool.zero_()  # torch's fill: over its threads
    return pool.view(dtype).view(shape)


def default_kv_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """CUDA: what ``gpu_memory_utilization`` of the GPU leaves after the model (and a
    reserve for activations); CPU: a quarter of RAM (the driver normally sends each
    worker its share of its node instead)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        reserve = min(2 * 2**30, int(total * 0.05))
        return max(0, int(total * gpu_memory_utilization) - used - reserve)
    return int(psutil.virtual_memory().total * 0.25)
