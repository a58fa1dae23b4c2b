"""The KV pool's memory: committed as blocks are first used, or all at load
(``kv_cache_prefault``)."""

from __future__ import annotations

import msgspec
import psutil
import torch

from cluster.config import EngineConfig
from worker.config import WorkerConfig
from worker.runner.kv_pool import PagedKVCache

MIB = 2**20


def resident_growth(make) -> tuple[int, object]:
    proc = psutil.Process()
    before = proc.memory_info().rss
    made = make()
    return proc.memory_info().rss - before, made


def pool(prefault: bool) -> PagedKVCache:
    # 2 layers x (keys, values) x 2048 blocks x 2 heads x 16 x 64 float32 = 64 MiB
    return PagedKVCache(2, 2048, 16, 2, 64, torch.float32, torch.device("cpu"), prefault=prefault)


def test_a_lazy_pool_commits_only_what_is_written():
    def make_and_write() -> PagedKVCache:
        cache = pool(False)
        cache.keys[0][:8].fill_(1.0)  # 8 blocks of one layer: 64 KiB (one huge page at most)
        return cache

    grown, cache = resident_growth(make_and_write)
    assert grown < 8 * MIB, f"{grown / MIB:.1f} MiB resident after writing 64 KiB of a 64 MiB lazy pool"
    assert float(cache.keys[0][:8].sum()) == 8 * 2 * 16 * 64


def test_a_prefaulted_pool_is_resident_at_once_and_zero():
    grown, cache = resident_growth(lambda: pool(True))
    assert grown >= 60 * MIB, f"only {grown / MIB:.1f} MiB resident after prefaulting a 64 MiB pool"
    assert all(float(t.abs().sum()) == 0.0 for t in (*cache.keys, *cache.values))
    assert cache.num_bytes == 64 * MIB


def test_the_option_reaches_the_worker_over_the_wire():
    assert EngineConfig().worker_config().kv_cache_prefault is False
    config = EngineConfig(kv_cache_prefault=True).worker_config()
    wire = msgspec.msgpack.encode(config)
    assert msgspec.msgpack.decode(wire, type=WorkerConfig).kv_cache_prefault is True
