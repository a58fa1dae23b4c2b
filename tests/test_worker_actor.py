"""The worker as a Ray actor: bytes in, bytes out; bad input gets clear errors and the
actor keeps serving with its batch intact."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import SEEDED, assert_greedy_equal, generate, prompts, run_alone_and_mixed
from sampler.params import SamplingParams
from worker.config import WorkerConfig
from worker.protocol import (
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    Int32Array,
    StepRequest,
)
from worker.transport.actor import create_worker, decode_info
from worker_driver import MiniDriver

TESTS_DIR = os.path.dirname(__file__)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def actor(ray_local, tiny_model_path):
    import ray

    # The exploding processor lives in tests/; the actor's process needs that on its path.
    handle = create_worker(runtime_env={"env_vars": {"PYTHONPATH": TESTS_DIR}})
    config = WorkerConfig(
        model=tiny_model_path, max_num_seqs=4, max_model_len=256,
        logits_processors=["procs_for_tests:ExplodingProc"],
    )
    info = decode_info(ray.get(handle.load.remote(msgspec.msgpack.encode(config))))
    assert info.max_num_seqs == 4 and info.vocab_size == 400
    yield handle
    ray.kill(handle)


def remote_step(actor):
    import ray

    return lambda data: ray.get(actor.step.remote(data))


def fresh(actor):
    import ray

    ray.get(actor.reset.remote())


def test_greedy_through_the_actor_matches_generate(actor, tiny_model_path):
    fresh(actor)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ps = prompts(400, [3, 50, 17, 40, 5, 90, 9, 33], seed=21)
    d = MiniDriver(remote_step(actor), max_rows=4, token_budget=40, chunk=16)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, GREEDY.clone(max_tokens=32 if i % 3 else 12), arrival_step=2 * i)
    done = d.run()
    assert d.num_moves > 0
    for i, p in enumerate(ps):
        out = done[f"r{i}"].output
        assert_greedy_equal(reference, p, out, generate(reference, p, len(out)))


def test_seeded_sampling_through_the_actor_does_not_depend_on_the_batch(actor):
    def new_step_fn():
        fresh(actor)
        return remote_step(actor)

    prompt = prompts(400, [7], seed=13)[0]
    alone, mixed = run_alone_and_mixed(new_step_fn, SEEDED, prompt)
    assert alone == mixed and len(alone) == SEEDED.max_tokens


def _add(rows_and_prompts, params=GREEDY, step_id=0, batch_size=None, sched=None):
    added = [
        AddedRequest(row=r, request_id=f"q{r}", params=params, prompt_token_ids=Int32Array.of(p))
        for r, p in rows_and_prompts
    ]
    n = batch_size if batch_size is not None else len(added)
    sched = sched if sched is not None else [len(p) for _, p in rows_and_prompts]
    return StepRequest(version=PROTOCOL_VERSION, step_id=step_id, batch_size=n, added=added,
                       num_scheduled_tokens=Int32Array.of(sched), **blocks_for([(r, len(p) + 1) for r, p in rows_and_prompts], n))


def blocks_for(rows_and_tokens, batch_size, block_size=16):
    """The step fields that give row r blocks r*8, r*8+1, ... covering its tokens."""
    counts, ids = [0] * batch_size, []
    for r, tokens in rows_and_tokens:
        counts[r] = -(-tokens // block_size)
        ids += [r * 8 + i for i in range(counts[r])]
    return dict(num_new_blocks=Int32Array.of(counts), new_block_ids=Int32Array.of(ids))


def test_bad_messages_get_clear_errors_and_the_actor_keeps_its_batch(actor):
    import ray

    fresh(actor)
    codec = Codec()
    step = lambda m: codec.decode_reply(ray.get(actor.step.remote(m if isinstance(m, bytes) else codec.encode(m))))
    p = prompts(400, [6], seed=1)[0]
    first = step(_add([(0, p)]))
    tok = first.sampled_token_ids.numpy().tolist()
    assert len(tok) == 1

    def rejected(message, *fragments):
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            step(message)
        text = str(info.value)
        assert "ProtocolError" in text
        for f in fragments:
            assert f in text, text

    rejected(b"\x00\x01garbage", "malformed step message")
    rejected(msgspec.msgpack.encode({"version": PROTOCOL_VERSION, "step_id": "x", "batch_size": 1}), "$.step_id")
    rejected(msgspec.msgpack.encode({"version": 99, "step_id": 1, "batch_size": 1}), "protocol version 99")
    rejected(StepRequest(version=PROTOCOL_VERSION, step_id=1, batch_size=1, removed=[3],
                         num_scheduled_tokens=Int32Array.of([1])), "removed[0]: row 3 holds no request")
    rejected(StepRequest(version=PROTOCOL_VERSION, step_id=1, batch_size=2,
                         num_scheduled_tokens=Int32Array.of([1, 1])), "rows [1] hold no request")
    rejected(StepRequest(version=PROTOCOL_VERSION, step_id=1, batch_size=1,
                         num_scheduled_tokens=Int32Array.of([5])), "num_scheduled_tokens[0] = 5")
    rejected(_add([(0, p), (1, p)], params=GREEDY.clone(logit_bias={400: 1.0}), step_id=1),
             "logit_bias", "[0, 400)")
    rejected(_add([(0, p), (1, p)], params=GREEDY.clone(allowed_token_ids=[1, 9999]), step_id=1),
             "allowed_token_ids", "9999")
    rejected(_add([(1, [5, 400])], step_id=1, batch_size=2, sched=[1, 2]), "outside [0, 400)")
    # Still serving, with row 0 intact: its next decode continues the same sequence.
    ok = step(StepRequest(version=PROTOCOL_VERSION, step_id=2, batch_size=1, num_scheduled_tokens=Int32Array.of([1])))
    assert ok.error is None and len(ok.sampled_token_ids) == 1
    health = ray.get(actor.health.remote())
    assert health["loaded"] and health["batch_size"] == 1


def test_processor_that_raises_fails_the_step_and_the_actor_survives(actor):
    import ray

    fresh(actor)
    codec = Codec()
    step = lambda m: codec.decode_reply(ray.get(actor.step.remote(codec.encode(m))))
    p = prompts(400, [6], seed=2)[0]
    reply = step(_add([(0, p), (1, p)], params=GREEDY.clone(extra_args={"explode": True})))
    assert reply.error is not None and "ExplodingProc" in reply.error and "boom" in reply.error
    assert {f.request_id for f in reply.failed} == {"q0", "q1"}
    # The driver removes the failed requests; the actor serves the next ones.
    nxt = StepRequest(
        version=PROTOCOL_VERSION, step_id=1, batch_size=1, removed=[1],
        added=[AddedRequest(row=0, request_id="fine", params=GREEDY, prompt_token_ids=Int32Array.of(p))],
        num_scheduled_tokens=Int32Array.of([len(p)]), **blocks_for([(0, len(p))], 1),
    )
    reply = step(nxt)
    assert reply.error is None and len(reply.sampled_token_ids) == 1


def test_health_memory_timings_reset(actor):
    import ray

    fresh(actor)
    d = MiniDriver(remote_step(actor), max_rows=4)
    for i, p in enumerate(prompts(400, [10, 20], seed=3)):
        d.submit(f"m{i}", p, GREEDY.clone(max_tokens=40))
    for _ in range(3):
        d.step()
    mem = ray.get(actor.memory.remote())
    assert mem["kv_cache_blocks"] == 4 * 256 // 16 and mem["kv_rows_in_use"] == 2
    # Row 0: prompt at step 0, decodes at steps 1-2; row 1: chunks of 16 + 4, one decode.
    assert mem["kv_tokens_in_use"] == (10 + 2) + (20 + 1)
    # Blocks held: what the driver gave (it keeps room for 8 more tokens per row).
    assert mem["kv_blocks_in_use"] == sum(len(r.blocks) for r in d.rows) == 4
    assert mem["process_rss_bytes"] > 0
    t = ray.get(actor.timings.remote())
    assert t["forward"] > 0
    ray.get(actor.reset.remote())
    assert ray.get(actor.health.remote())["batch_size"] == 0
    assert ray.get(actor.memory.remote())["kv_tokens_in_use"] == 0
