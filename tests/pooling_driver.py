"""Pooling requests through the driver's own scheduler and reply merging against an
in-process worker runner (no Ray): what the engine does per step, for the tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from cluster.output_processor import apply_reply
from cluster.pooling import PoolingParams
from cluster.request import Request
from cluster.scheduler import WaitingQueue, WorkerScheduler
from sampler.params import SamplingParams
from worker.protocol import Codec


def pool_through_scheduler(runner: Any, prompts: list[list[int]], *, token_types: list[list[int] | None] | None = None,
                           budget: int = 64, rows: int = 8, prefix_caching: bool = False,
                           params: PoolingParams | None = None, max_steps: int = 1000) -> tuple[list[Any], int]:
    """Each prompt's output (``Request.make_output()``) and the steps it took; the
    runner starts empty."""
    runner.reset()  # (rows a previous call left finished are never removed by this scheduler)
    info, codec = runner.info, Codec()
    pooler = info.pooler
    whole = pooler.bidirectional
    sched = WorkerScheduler(max_rows=rows, max_num_batched_tokens=max(budget, info.max_model_len) if whole else budget,
                            kv_blocks=info.num_kv_blocks, kv_block_size=info.kv_block_size,
                            enable_prefix_caching=prefix_caching and not whole, whole_prompts=whole)
    waiting = WaitingQueue()
    requests = []
    for i, ids in enumerate(prompts):
        r = Request(f"r{i}", None, list(ids), SamplingParams(max_tokens=1, temperature=0.0, eos_token_ids=[]),
                    runner.loaded.tokenizer, info.max_model_len + 1, i, pooling=params or PoolingParams(),
                    pooler=pooler, token_type_ids=token_types[i] if token_types else None)
        requests.append(r)
        for s in r.sequences:
            waiting.push(s)
    steps = 0
    while not all(r.finished for r in requests):
        step, _ = sched.schedule(waiting, rows)
        assert step is not None, "nothing scheduled while requests wait"
        reply = codec.decode_reply(codec.encode(runner.execute(codec.decode_step(codec.encode(step.message)))))
        changed = apply_reply(step, reply)
        sched.register_computed(step.rows)
        for r in changed:
            for s in r.sequences:
                if s.finished and s.row is not None:
                    sched.free(s)
        steps += 1
        assert steps < max_steps
    return [r.make_output() for r in requests], steps


def raw_vectors(outputs: list[Any]) -> np.ndarray:
    return np.stack([o.outputs.data.numpy() for o in outputs])
