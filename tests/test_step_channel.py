"""The step channel (worker/transport/step_channel.py) and the worker's compute thread
(worker/transport/compute_thread.py): frames in order, errors that leave the channel
serving, a worker end that goes away seen as such (never a hang), strangers refused,
every torch call on one thread, and a worker actor driven over its channel matching
transformers' greedy ``generate``."""

from __future__ import annotations

import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import assert_greedy_equal, generate, prompts
from sampler.params import SamplingParams
from worker.config import WorkerConfig
from worker.transport.actor import StaleStep, Worker, create_worker, decode_info
from worker.transport.compute_thread import ComputeThread
from worker.transport.step_channel import ChannelClosed, StepChannel, StepChannelServer, StepFailed, wait_ready
from worker_driver import MiniDriver


def served(handle) -> tuple[ComputeThread, StepChannelServer, StepChannel]:
    compute = ComputeThread()
    server = StepChannelServer(lambda conn: compute.attach(conn, handle), "127.0.0.1")
    return compute, server, StepChannel(server.address)


def test_frames_are_answered_in_order_on_the_compute_thread():
    seen: list[int] = []

    def handle(frame: bytes) -> bytes:
        seen.append(threading.get_ident())
        return frame[::-1]

    compute, server, channel = served(handle)
    frames = [bytes([i]) * (1 + 1000 * i) for i in range(5)]
    for f in frames:  # queued before any is read, as a second step under async scheduling
        channel.send(f)
    assert [channel.receive() for _ in frames] == [f[::-1] for f in frames]
    # Ray calls' work (submit) runs on the very thread that answers the channel.
    assert set(seen) == {compute.run(threading.get_ident)}
    assert threading.get_ident() not in seen
    server.close()
    channel.close()


def test_a_step_that_raises_is_reported_and_the_channel_serves_on():
    def handle(frame: bytes) -> bytes:
        if frame == b"bad":
            raise ValueError("this step breaks the batch")
        return b"ok:" + frame

    _, server, channel = served(handle)
    channel.send(b"bad")
    with pytest.raises(StepFailed, match="this step breaks the batch"):
        channel.receive()
    channel.send(b"next")
    assert channel.receive() == b"ok:next"
    server.close()


def test_a_closed_worker_end_is_seen_at_once_not_waited_for():
    release = threading.Event()

    def handle(frame: bytes) -> bytes:
        release.wait(10)
        return frame

    _, server, channel = served(handle)
    channel.send(b"x")
    assert wait_ready([channel.connection], 0.05) == []  # the step runs
    server.close()  # the worker's end goes away mid-step (a reset, a dying worker)
    assert wait_ready([channel.connection], 5) == [channel.connection]
    with pytest.raises(ChannelClosed):
        channel.receive()
    release.set()


def test_a_client_without_the_key_is_refused_and_the_engine_still_connects():
    _, server, _unused = served(lambda f: f)  # the engine's own client took the connection
    server.close()
    compute = ComputeThread()
    server = StepChannelServer(lambda conn: compute.attach(conn, lambda f: b"hi " + f), "127.0.0.1")
    (host, port), key = server.address
    with pytest.raises(AuthenticationError):
        Client((host, port), family="AF_INET", authkey=b"x" * 32)
    channel = StepChannel(server.address)
    channel.send(b"engine")
    assert channel.receive() == b"hi engine"
    server.close()


def test_compute_thread_reraises_what_a_task_raised():
    compute = ComputeThread()
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda a, b: a + b, 2, 3) == 5


def test_a_step_read_before_a_reset_does_not_run_after_it(tiny_model_path):
    """A reset closes the channel; a frame its thread had already read carries the old
    generation and is refused instead of running on the reset batch."""
    w = Worker()
    w.load(msgspec.msgpack.encode(WorkerConfig(model=tiny_model_path, max_num_seqs=2, max_model_len=128)))
    w.open_channel()
    w.reset()
    with pytest.raises(StaleStep):
        w._run(w._channel_step, b"", 0)
    assert w._generation == 1


def test_an_actor_over_its_channel_matches_generate(ray_local, tiny_model_path):
    import ray

    actor = create_worker()
    config = WorkerConfig(model=tiny_model_path, max_num_seqs=4, max_model_len=256)
    decode_info(ray.get(actor.load.remote(msgspec.msgpack.encode(config))))
    channel = StepChannel(ray.get(actor.open_channel.remote()))

    def step(data: bytes) -> bytes:
        channel.send(data)
        assert wait_ready([channel.connection], 60), "no reply within 60 s"
        return channel.receive()

    try:
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        ps = prompts(400, [3, 50, 17, 40, 5, 90], seed=23)
        d = MiniDriver(step, max_rows=4, token_budget=40, chunk=16)
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for i, p in enumerate(ps):
            d.submit(f"r{i}", p, greedy, arrival_step=2 * i)
        done = d.run()
        assert d.num_moves > 0
        for i, p in enumerate(ps):
            out = done[f"r{i}"].output
            assert_greedy_equal(reference, p, out, generate(reference, p, len(out)))
        # A Ray call still reaches the actor while the channel is open, and a reset
        # closes the channel: the engine's end sees EOF.
        ray.get(actor.reset.remote(), timeout=60)
        assert wait_ready([channel.connection], 10)
        with pytest.raises(ChannelClosed):
            channel.receive()
    finally:
        channel.close()
        ray.kill(actor)


def test_a_worker_without_a_channel_beside_one_with_it(ray_local, tiny_model_path):
    """Two workers, one of which lost its channel (as one whose port cannot be reached
    never gets one): its steps go as Ray calls, both kinds are waited on together, and
    every request still matches transformers' greedy ``generate``."""
    from cluster import LLM
    from cluster.worker_pool import close_channel

    llm = LLM(tiny_model_path, num_workers=2, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
              worker_num_cpus=1)
    try:
        engine = llm.engine
        assert all(w.channel is not None for w in engine.workers)
        close_channel(engine.workers[0])
        ps = prompts(400, [9, 31, 4, 60, 22, 15, 40, 7], seed=5)
        greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy, use_tqdm=False)
        import ray

        steps = [ray.get(w.actor.health.remote(), timeout=60)["steps"] for w in engine.workers]
        assert min(steps) > 0, f"both workers should have run steps (fair share): {steps}"
        assert engine.workers[0].channel is None and engine.num_worker_failures == 0
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        for p, out in zip(ps, outs):
            got = out.outputs[0].token_ids
            assert_greedy_equal(reference, p, got, generate(reference, p, len(got)))
    finally:
        llm.shutdown()
