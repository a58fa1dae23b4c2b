"""Worker faults end to end (issue "Hardening"): whatever keeps a step from coming back
(a worker process SIGKILLed, its node removed, the reply object lost, a step that hangs,
a worker that raises, a step that cannot be sent) loses no request: every sequence the
worker held is re-queued with its tokens so far and the outputs equal an undisturbed run
token for token (greedy and seeded random rows, prompt logprobs too). A request that
breaks every worker it runs on ends alone with an error after ``max_request_failures``;
without any live worker requests fail after ``no_worker_timeout_s`` and the health check
says so.

``LLMEngine`` is driven directly (``add_request`` + ``step``) under an overall deadline,
so a hang fails the test instead of blocking; nothing asserts on timing beyond generous
bounds. Starting workers is what costs time here, so the tests share engines: one with
two workers (and the poison / hang processors of procs_for_tests loaded) and one with a
lone worker and a tight KV budget, each for one class (class scope: the multi-node tests
at the end restart Ray, and no engine of the shared local Ray may outlive it). A fixture
puts the fields a test changes back and waits for live workers before each test. Each
prompt set's undisturbed ``LLM.generate`` run is made once per engine, on that engine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
import psutil
import pytest
import ray
import torch
from ray.exceptions import ObjectReconstructionFailedError

import cluster.engine as engine_module
import cluster.worker_pool as worker_pool
from cluster import LLM, RequestOutput
from cluster.engine import LLMEngine
from cluster.output_processor import apply_reply
from conftest import own_ray
from helpers import prompts
from sampler.params import SamplingParams
from worker.transport.step_channel import shutdown_connection

VOCAB = 400
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
#: an overall bound on every loop: a hang fails the test (the machine may be busy)
DEADLINE_S = 120.0
COMMON = dict(max_model_len=512, worker_num_cpus=1)
PROCS = ["procs_for_tests:PoisonProc", "procs_for_tests:HangProc"]


def _mixed(n: int, max_tokens: int, **extra: Any) -> list[SamplingParams]:
    """Odd rows greedy, even rows seeded random; row 4 (when there) asks for n=2."""
    out = []
    for i in range(n):
        if i % 2:
            out.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra))
        else:
            out.append(SamplingParams(temperature=0.9, seed=100 + i, max_tokens=max_tokens, ignore_eos=True,
                                      n=2 if i == 4 else 1, **extra))
    return out


PROMPT_SETS: dict[str, tuple[list[list[int]], list[SamplingParams]]] = {
    "mixed": (prompts(VOCAB, [5, 23, 9, 40, 14, 31, 7, 18], seed=31), _mixed(8, 24)),
    # Long prompts: with max_num_batched_tokens=32 their prefill spans several steps.
    "prompt_logprobs": (prompts(VOCAB, [150, 110, 130, 90], seed=41), _mixed(4, 8, logprobs=2, prompt_logprobs=2)),
    # As test_llm's preemption test: six requests outgrow 320 KV tokens.
    "preempt": (prompts(VOCAB, [40, 60, 30, 70, 50, 20], seed=8), _mixed(6, 40)),
    # Repetition gives the n-gram proposer drafts that the model accepts.
    "spec": ([b * 6 for b in prompts(VOCAB, [6, 4, 9, 5], seed=11)] + prompts(VOCAB, [30, 12], seed=12), _mixed(6, 24)),
}


# -- helpers --------------------------------------------------------------------------

#: id(reference output) -> its SamplingParams (for messages)
PARAMS_OF: dict[int, SamplingParams] = {}


class References:
    """Undisturbed ``LLM.generate`` outputs per prompt set, made once on ``llm``."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._cache: dict[str, list[RequestOutput]] = {}

    def __call__(self, name: str) -> list[RequestOutput]:
        if name not in self._cache:
            ps, params = PROMPT_SETS[name]
            outs = self.llm.generate(ps, params, use_tqdm=False)
            for out, sp in zip(outs, params):
                assert out.error is None and all(c.finish_reason == "length" for c in out.outputs)
                PARAMS_OF[id(out)] = sp
            self._cache[name] = outs
        return self._cache[name]


def requests_of(name: str, prefix: str) -> list[tuple[str, list[int], SamplingParams]]:
    ps, params = PROMPT_SETS[name]
    return [(f"{prefix}{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]


def drive(
    engine: LLMEngine,
    requests: list[tuple[str, Any, SamplingParams]],
    on_step: Callable[[], None] | None = None,
    until: Callable[[], bool] | None = None,
    deadline_s: float = DEADLINE_S,
) -> tuple[dict[str, RequestOutput], dict[str, Any]]:
    """Adds ``requests`` and steps until all have finished (and ``until()`` holds),
    calling ``on_step`` after every step. Returns the final outputs and the engine's
    ``Request`` objects, by request id."""
    handles = {rid: engine.add_request(rid, prompt, params) for rid, prompt, params in requests}
    finals: dict[str, RequestOutput] = {}
    end = time.monotonic() + deadline_s
    while engine.has_unfinished_requests() or (until is not None and not until()):
        if time.monotonic() > end:
            pytest.fail(f"not done within {deadline_s} s: {len(finals)}/{len(handles)} finished; "
                        f"health {engine.health()}")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if on_step is not None:
            on_step()
        if not engine.has_unfinished_requests():
            time.sleep(0.02)  # idle: leave the cores to the loading workers
    return finals, handles


def settle(engine: LLMEngine, min_live: int | None = None, deadline_s: float = DEADLINE_S) -> None:
    """Drops leftovers of an earlier test and steps until ``min_live`` workers (all by
    default) are live; replacements still loading carry on loading."""
    want = engine.config.num_workers if min_live is None else min_live
    if engine.requests:
        engine.abort_request(list(engine.requests))
    end = time.monotonic() + deadline_s
    while True:
        engine.step(timeout=0.2)
        if sum(w.live for w in engine.workers) >= want and not engine.has_unfinished_requests():
            return
        assert time.monotonic() < end, f"the pool did not get back to {want} live workers: {engine.health()}"
        time.sleep(0.05)


def busy_worker(engine: LLMEngine, min_seqs: int) -> Any:
    """A live worker with a step in flight that holds at least ``min_seqs`` unfinished
    sequences which already have output tokens."""
    for slot in engine.workers:
        if slot.live and slot.inflight is not None and slot.pid is not None:
            started = sum(len(s.output_token_ids) > 0 and not s.finished for s in slot.scheduler.running)
            if started >= min_seqs:
                return slot
    return None


def sigkill(slot: Any) -> None:
    assert slot.pid is not None and slot.pid != os.getpid()
    os.kill(slot.pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fault_counters(engine: LLMEngine) -> dict[str, float]:
    """The fault counters as ``/metrics`` exposes them (``deploy/metrics.py``)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from deploy.metrics import metrics_registry

    text = generate_latest(metrics_registry(engine, "tiny")).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("raydecode:worker_failures_total", "raydecode:worker_restarts_total"):
                out[s.name.removeprefix("raydecode:").removesuffix("_total")] = s.value
            elif s.name == "raydecode:requests_requeued_total":
                out[f"requeued_{s.labels['cause']}"] = s.value
    return out


def token_ids(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def assert_logprobs_equal(got: Any, want: Any, what: str) -> None:
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert got.start_indices == want.start_indices and got.end_indices == want.end_indices, what
    assert got.token_ids == want.token_ids, what
    assert got.ranks == want.ranks, what
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5), what


_REFERENCE_MODEL: list[Any] = []
TINY_PATH: list[str] = []


@pytest.fixture(autouse=True, scope="module")
def _remember_the_tiny_model(tiny_model_path):
    TINY_PATH[:] = [tiny_model_path]


def float_noise_flip(prompt: list[int], prefix: list[int], seed: int, temperature: float, got: int, want: int) -> bool:
    """Whether a seeded row that picked ``got`` where the undisturbed run picked
    ``want`` did so only because float rounding moved a CDF boundary across its uniform:
    recomputing KV in other chunks (after a failover, or from the prefix cache) changes
    logits by ~1e-6, and on the tiny random model's near-flat distributions a uniform
    that close to a boundary selects the neighbouring token. True only if the two tokens
    are neighbours in the sampler's (vocabulary-order) CDF and the row's own uniform for
    this position lies within 1e-4 of the boundary between them; a wrong random stream
    (a generator at the wrong position) is never excused."""
    from transformers import AutoModelForCausalLM

    from sampler.metadata import seeded_generator

    if abs(got - want) != 1:
        return False
    if not _REFERENCE_MODEL:
        _REFERENCE_MODEL.append(AutoModelForCausalLM.from_pretrained(TINY_PATH[0], dtype=torch.float32).eval())
    with torch.inference_mode():
        logits = _REFERENCE_MODEL[0](torch.tensor([list(prompt) + list(prefix)])).logits[0, -1].float()
    cdf = torch.softmax(logits / temperature, dim=-1).double().cumsum(0)
    u = float(torch.rand(1, generator=seeded_generator(seed, torch.device("cpu"), len(prefix)))[0])
    return abs(u - float(cdf[min(got, want)])) < 1e-4


def assert_like_reference(finals: dict[str, RequestOutput], prefix: str, reference: list[RequestOutput],
                          logprobs: bool = False, context: str = "") -> None:
    """Every request finished without error, with the undisturbed run's tokens (and
    logprobs); a failure names every request that differs and where."""
    problems = []
    for i, ref in enumerate(reference):
        out = finals.get(f"{prefix}{i}")
        if out is None or out.error is not None:
            problems.append(f"request {i}: {'never finished' if out is None else out.error}")
            continue
        for j, (c, rc) in enumerate(zip(out.outputs, ref.outputs)):
            if c.token_ids != rc.token_ids:
                at = next((k for k, (a, b) in enumerate(zip(c.token_ids, rc.token_ids)) if a != b),
                          min(len(c.token_ids), len(rc.token_ids)))
                sp = PARAMS_OF.get(id(ref))
                kind = "greedy" if sp is not None and sp.temperature == 0 else "seeded random"
                if kind == "seeded random" and at < min(len(c.token_ids), len(rc.token_ids)) and float_noise_flip(
                    ref.prompt_token_ids, rc.token_ids[:at], sp.seed + j, sp.temperature, c.token_ids[at], rc.token_ids[at]
                ):
                    continue
                problems.append(f"request {i} sample {j} ({kind}) differs from token {at} on: "
                                f"{c.token_ids[at:at + 4]}... vs undisturbed {rc.token_ids[at:at + 4]}...")
            if c.finish_reason != rc.finish_reason:
                problems.append(f"request {i} sample {j}: finish_reason {c.finish_reason!r} vs {rc.finish_reason!r}")
        if len(out.outputs) != len(ref.outputs):
            problems.append(f"request {i}: {len(out.outputs)} samples vs {len(ref.outputs)}")
    assert not problems, "differs from the undisturbed run:\n" + "\n".join(problems) + (f"\n{context}" if context else "")
    if logprobs:
        for i, ref in enumerate(reference):
            out = finals[f"{prefix}{i}"]
            assert_logprobs_equal(out.prompt_logprobs, ref.prompt_logprobs, f"prompt logprobs of request {i}")
            for c, rc in zip(out.outputs, ref.outputs):
                assert_logprobs_equal(c.logprobs, rc.logprobs, f"logprobs of request {i}")
                assert c.cumulative_logprob == pytest.approx(rc.cumulative_logprob, abs=1e-4)


@contextlib.contextmanager
def worker_path_with_tests_dir():
    """Worker actors import the test processors (procs_for_tests) from tests/: they get
    it on their PYTHONPATH (the engine has no runtime_env setting of its own)."""
    original = worker_pool.create_worker
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)

    def create(*args: Any, **kwargs: Any) -> Any:
        return original(*args, runtime_env={"env_vars": {"PYTHONPATH": path}}, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_pool, "create_worker", create)
        yield


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="class")
def shared_two(ray_local, tiny_model_path):
    """Two workers, a small step budget, the poison and hang processors loaded (no-ops
    for rows without their flag)."""
    with worker_path_with_tests_dir():
        llm = LLM(tiny_model_path, num_workers=2, max_num_seqs=8, max_num_batched_tokens=32,
                  logits_processors=PROCS, worker_restart_backoff_max_s=2, no_worker_timeout_s=100,
                  step_timeout_s=60, **COMMON)
        try:
            yield llm, References(llm)
        finally:
            llm.shutdown()


@contextlib.contextmanager
def restored_config(engine: LLMEngine):
    """Tests may change the fields the engine reads as it runs; they come back."""
    c = engine.config
    saved = (c.max_request_failures, c.step_timeout_s, c.no_worker_timeout_s, c.placement_report_s)
    try:
        yield
    finally:
        c.max_request_failures, c.step_timeout_s, c.no_worker_timeout_s, c.placement_report_s = saved


@pytest.fixture
def two(shared_two):
    """The shared two-worker engine with at least one live worker (a replacement from
    the test before may still be loading: it joins mid-test, as it would in service)."""
    llm, refs = shared_two
    settle(llm.engine, min_live=1)
    with restored_config(llm.engine):
        yield llm, llm.engine, refs


@pytest.fixture(scope="class")
def shared_one(ray_local, tiny_model_path):
    """A lone worker (while it is replaced, no worker is alive and requests wait) with
    a KV budget (320 tokens) that the prompt sets outgrow, so sequences are preempted
    and resumed: every fault on it meets that path too."""
    llm = LLM(tiny_model_path, num_workers=1, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_tokens=320,
              worker_restart_backoff_max_s=2, no_worker_timeout_s=100, **COMMON)
    try:
        yield llm, References(llm)
    finally:
        llm.shutdown()


@pytest.fixture
def one(shared_one):
    llm, refs = shared_one
    settle(llm.engine)
    with restored_config(llm.engine):
        yield llm, llm.engine, refs


# -- two workers ----------------------------------------------------------------------


class TestTwoWorkers:
    def test_sigkill_mid_generation_loses_nothing(self, two):
        llm, engine, refs = two
        settle(engine)  # both workers live: the other one serves on alone
        reference = refs("mixed")
        failures = engine.num_worker_failures
        counted = fault_counters(engine)
        killed = []

        def on_step():
            if not killed and (slot := busy_worker(engine, 3)) is not None:
                killed.append(slot)
                sigkill(slot)

        finals, handles = drive(engine, requests_of("mixed", "k"), on_step)
        assert killed, "no worker was killed"
        assert engine.num_worker_failures - failures == 1
        assert killed[0] not in engine.workers
        assert_like_reference(finals, "k", reference)
        charges = [r.num_failures for r in handles.values()]
        assert max(charges) == 1 and sum(charges) >= 2  # the killed worker's requests, once each
        # /metrics: a replacement started, and every request the killed worker held went
        # back to the queue once (at least those its failed step charged)
        grew = {k: v - counted[k] for k, v in fault_counters(engine).items()}
        assert grew["worker_failures"] == grew["worker_restarts"] == 1, grew
        assert sum(charges) <= grew["requeued_worker_lost"] <= len(handles) and grew["requeued_worker_reset"] == 0, grew

    def test_sigkill_mid_prefill_keeps_prompt_logprobs(self, two):
        llm, engine, refs = two
        reference = refs("prompt_logprobs")
        failures = engine.num_worker_failures
        killed = []

        def on_step():
            if killed:
                return
            for slot in engine.workers:
                if not (slot.live and slot.inflight is not None):
                    continue
                for s in slot.scheduler.running:
                    plp = s.request.prompt_logprobs
                    if (0 < s.num_computed_tokens < len(s.prompt_token_ids) - 1
                            and plp is not None and 1 < len(plp) < len(s.prompt_token_ids)):
                        killed.append((slot, len(plp), len(s.prompt_token_ids)))
                        sigkill(slot)
                        return

        finals, _ = drive(engine, requests_of("prompt_logprobs", "p"), on_step)
        assert killed, "no worker was killed mid-prefill"
        assert engine.num_worker_failures - failures == 1
        assert_like_reference(finals, "p", reference, logprobs=True)
        for i, ps in enumerate(PROMPT_SETS["prompt_logprobs"][0]):
            assert len(finals[f"p{i}"].prompt_logprobs) == len(ps)

    def test_repeated_kills_lose_nothing(self, two):
        llm, engine, refs = two
        engine.config.max_request_failures = 10
        reference = refs("mixed")
        failures = engine.num_worker_failures
        kills: list[tuple[Any, int]] = []
        tracked: list[Any] = []

        def produced() -> int:
            return sum(len(s.output_token_ids) for r in tracked for s in r.sequences)

        def on_step():
            if not tracked:
                tracked.extend(engine.requests.values())
            if not kills:
                if (slot := busy_worker(engine, 3)) is not None:
                    kills.append((slot, produced()))
                    sigkill(slot)
            elif len(kills) == 1 and produced() >= kills[0][1] + 30:
                if (slot := busy_worker(engine, 1)) is not None and slot is not kills[0][0]:
                    kills.append((slot, produced()))
                    sigkill(slot)

        finals, handles = drive(engine, requests_of("mixed", "r"), on_step)
        assert len(kills) == 2, f"killed {len(kills)} workers"
        assert engine.num_worker_failures - failures == 2
        assert_like_reference(finals, "r", reference)
        assert max(r.num_failures for r in handles.values()) <= 2

    def test_a_poison_request_fails_alone(self, two):
        llm, engine, refs = two
        reference = refs("mixed")
        limit = engine.config.max_request_failures
        assert limit == 3
        failures = engine.num_worker_failures
        poison = ("poison", prompts(VOCAB, [12], seed=51)[0],
                  SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args={"poison": True}))
        reqs = requests_of("mixed", "n")
        reqs.insert(3, poison)
        finals, handles = drive(engine, reqs)
        bad = finals["poison"]
        assert bad.finished and [c.finish_reason for c in bad.outputs] == ["error"]
        assert bad.outputs[0].token_ids == []
        assert bad.error and "max_request_failures" in bad.error and "lost" in bad.error
        assert handles["poison"].num_failures == limit
        # Each failure was a dead worker (the poison ran alone after its first).
        assert engine.num_worker_failures - failures == limit
        assert_like_reference(finals, "n", reference)
        assert all(handles[f"n{i}"].num_failures <= 1 for i in range(len(reference)))
        # The engine serves on.
        ps, params = PROMPT_SETS["mixed"]
        (again,) = llm.generate([ps[1]], [params[1]], use_tqdm=False)
        assert again.error is None and token_ids(again) == token_ids(reference[1])

    def test_a_hanging_step_is_timed_out(self, two):
        llm, engine, refs = two
        reference = refs("mixed")
        engine.config.step_timeout_s = 5
        engine.config.max_request_failures = 2
        failures = engine.num_worker_failures
        hang = ("hang", prompts(VOCAB, [10], seed=52)[0],
                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args={"hang": True}))
        reqs = requests_of("mixed", "h")
        reqs.insert(2, hang)
        hung_pids: set[int] = set()

        def on_step():
            for slot in engine.workers:
                if slot.live and slot.inflight is not None and any(s.request.request_id == "hang" for s in slot.step.rows):
                    hung_pids.add(slot.pid)

        finals, handles = drive(engine, reqs, on_step)
        bad = finals["hang"]
        assert [c.finish_reason for c in bad.outputs] == ["error"]
        assert bad.error and "step_timeout_s" in bad.error and "max_request_failures" in bad.error
        assert handles["hang"].num_failures == 2
        assert engine.num_worker_failures - failures == 2  # both hung workers were replaced
        assert_like_reference(finals, "h", reference)
        # The hung processes were stopped, not left sleeping.
        assert len(hung_pids) == 2
        end = time.monotonic() + 30
        while any(_running(pid) for pid in hung_pids):
            assert time.monotonic() < end, "a hung worker process is still running"
            time.sleep(0.2)

    def test_a_lost_reply_replaces_the_worker(self, two):
        """A step's reply is lost although the worker's process still runs: its step
        channel breaks, or (steps as Ray calls) fetching the reply raises
        ObjectReconstructionFailedError (what Ray raises for a lost object that cannot
        be rebuilt: worker tasks never retry). The worker is treated as lost."""
        llm, engine, refs = two
        reference = refs("mixed")
        failures = engine.num_worker_failures
        receive = engine._receive
        victims: list[Any] = []

        def lost_get(ref: Any, *args: Any, **kwargs: Any) -> Any:
            raise ObjectReconstructionFailedError(ref.hex())

        def flaky_receive(slot: Any, ready_at: float) -> None:
            rows = slot.step.rows if slot.step is not None else []
            if victims or sum(len(s.output_token_ids) > 0 for s in rows) < 3:
                return receive(slot, ready_at)
            victims.append((slot, slot.pid))
            if slot.channel is not None:
                shutdown_connection(slot.channel.connection)
                return receive(slot, ready_at)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(ray, "get", lost_get)  # only this reply's fetch
                return receive(slot, ready_at)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine, "_receive", flaky_receive)
            finals, handles = drive(engine, requests_of("mixed", "l"))
        assert victims, "no reply was lost"
        slot, pid = victims[0]
        assert engine.num_worker_failures - failures == 1
        assert slot not in engine.workers  # dropped and killed; a replacement starts
        assert pid not in {w.pid for w in engine.workers}
        assert_like_reference(finals, "l", reference)
        assert max(r.num_failures for r in handles.values()) == 1

    @pytest.mark.parametrize("fault", ["send", "worker_raises", "merge"])
    def test_a_failed_step_on_a_live_worker_resets_it(self, two, fault, caplog):
        """Once, mid-generation: the step cannot be encoded (``send``), the worker
        rejects it and raises (a RayTaskError; ``worker_raises``: a message of another
        protocol version), or its reply cannot be decoded (``merge``). The worker is
        reset, not replaced."""
        llm, engine, refs = two
        reference = refs("mixed")
        failures = engine.num_worker_failures
        counted = fault_counters(engine)
        live = {id(s): s.pid for s in engine.workers if s.live}
        codec = engine._codec
        encode, decode_reply = codec.encode, codec.decode_reply
        state = {"armed": False, "fired": 0}

        def due() -> bool:
            if state["armed"] and not state["fired"]:
                state["fired"] += 1
                return True
            return False

        def faulty_encode(message: Any) -> bytes:
            if fault == "send" and due():
                raise RuntimeError("injected: cannot encode the step")
            if fault == "worker_raises" and due():
                return encode(msgspec.structs.replace(message, version=message.version + 100))
            return encode(message)

        def faulty_decode_reply(data: bytes) -> Any:
            if fault == "merge" and due():
                raise ValueError("injected: cannot decode the reply")
            return decode_reply(data)

        def on_step():
            if busy_worker(engine, 3) is not None:
                state["armed"] = True

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(codec, "encode", faulty_encode)
            mp.setattr(codec, "decode_reply", faulty_decode_reply)
            finals, handles = drive(engine, requests_of("mixed", "e"), on_step)
        assert state["fired"] == 1
        reason = {"send": "could not be sent", "worker_raises": "raised on step", "merge": "could not be merged"}[fault]
        assert any(reason in r.getMessage() and "re-queued" in r.getMessage() for r in caplog.records)
        assert engine.num_worker_failures == failures  # reset, not replaced
        grew = {k: v - counted[k] for k, v in fault_counters(engine).items()}
        assert grew["worker_restarts"] == grew["requeued_worker_lost"] == 0 and grew["requeued_worker_reset"] >= 1, grew
        assert all(s.live for s in engine.workers if id(s) in live)
        assert {id(s): s.pid for s in engine.workers if id(s) in live} == live  # the same processes
        assert_like_reference(finals, "e", reference)
        assert max(r.num_failures for r in handles.values()) == 1


@pytest.fixture(scope="class")
def shared_two_ray_calls(ray_local, tiny_model_path):
    with worker_path_with_tests_dir():
        llm = LLM(tiny_model_path, num_workers=2, max_num_seqs=8, max_num_batched_tokens=32,
                  logits_processors=PROCS, worker_restart_backoff_max_s=2, no_worker_timeout_s=100,
                  step_timeout_s=60, step_channel=False, **COMMON)
        try:
            yield llm, References(llm)
        finally:
            llm.shutdown()


class TestTwoWorkersRayCalls:
    """Steps as Ray task calls (``step_channel=False``, the path of a worker whose
    channel cannot be opened): the faults whose detection differs from the channel's."""

    @pytest.fixture
    def two(self, shared_two_ray_calls):
        llm, refs = shared_two_ray_calls
        settle(llm.engine, min_live=1)
        assert all(w.channel is None for w in llm.engine.workers)
        with restored_config(llm.engine):
            yield llm, llm.engine, refs

    test_sigkill_mid_generation_loses_nothing = TestTwoWorkers.test_sigkill_mid_generation_loses_nothing
    test_a_hanging_step_is_timed_out = TestTwoWorkers.test_a_hanging_step_is_timed_out
    test_a_lost_reply_replaces_the_worker = TestTwoWorkers.test_a_lost_reply_replaces_the_worker
    test_a_failed_step_on_a_live_worker_resets_it = TestTwoWorkers.test_a_failed_step_on_a_live_worker_resets_it


# -- one worker -----------------------------------------------------------------------


class TestOneWorker:
    def test_sigkill_of_the_lone_worker_loses_nothing(self, one):
        llm, engine, refs = one
        reference = refs("mixed")
        failures = engine.num_worker_failures
        killed = []

        def on_step():
            if not killed and (slot := busy_worker(engine, 3)) is not None:
                killed.append(slot)
                sigkill(slot)

        finals, _ = drive(engine, requests_of("mixed", "k"), on_step)
        assert killed
        assert engine.num_worker_failures - failures == 1
        assert killed[0] not in engine.workers and engine.workers[0].live
        assert_like_reference(finals, "k", reference)

    def test_a_worker_that_dies_while_idle_is_replaced_before_it_is_needed(self, one):
        """No step in flight: the idle probe notices the death, the pool replaces the
        worker, and the next requests are charged nothing."""
        llm, engine, refs = one
        reference = refs("mixed")
        failures = engine.num_worker_failures
        (idle,) = [w for w in engine.workers if w.live]
        assert idle.inflight is None
        sigkill(idle)
        end = time.monotonic() + DEADLINE_S
        while idle in engine.workers or not any(w.live for w in engine.workers):
            assert time.monotonic() < end, engine.health()
            engine.step(timeout=0.2)
            time.sleep(0.05)
        assert engine.num_worker_failures - failures == 1
        finals, handles = drive(engine, requests_of("mixed", "i"), lambda: None)
        assert all(r.num_failures == 0 for r in handles.values())
        assert_like_reference(finals, "i", reference)

    def test_sigkill_under_kv_preemption(self, one):
        llm, engine, refs = one
        reference = refs("preempt")
        assert sum(o.metrics.num_preemptions for o in reference) > 0
        failures = engine.num_worker_failures
        before = engine.workers[0].scheduler.num_preemptions
        killed = []

        def on_step():
            live = [w for w in engine.workers if w.live]
            if killed or not live or live[0].scheduler.num_preemptions == before:
                return
            preempted = [s for s in engine.waiting if s.output_token_ids]  # waiting with tokens so far
            if preempted and (slot := busy_worker(engine, 2)) is not None:
                killed.append(slot)
                sigkill(slot)

        finals, handles = drive(engine, requests_of("preempt", "q"), on_step)
        assert killed, "no kill while sequences were preempted"
        assert engine.num_worker_failures - failures == 1
        assert_like_reference(finals, "q", reference)

    def test_killing_the_replacement_while_it_loads(self, one):
        llm, engine, refs = one
        reference = refs("mixed")
        failures = engine.num_worker_failures
        killed: list[Any] = []

        def on_step():
            if not killed:
                if (slot := busy_worker(engine, 3)) is not None:
                    killed.append(slot)
                    sigkill(slot)
            elif len(killed) == 1:
                loading = [s for s in engine.workers if s.placed and not s.live]
                if loading:
                    killed.append(loading[0])
                    sigkill(loading[0])

        finals, _ = drive(engine, requests_of("mixed", "z"), on_step, until=lambda: len(killed) == 2)
        assert len(killed) == 2, "the loading replacement was never seen"
        assert engine.num_worker_failures - failures == 2
        assert not any(s in engine.workers for s in killed)
        assert_like_reference(finals, "z", reference)

    def test_without_any_live_worker_requests_fail_in_time(self, one):
        llm, engine, refs = one
        c, pool = engine.config, engine.pool
        c.no_worker_timeout_s = 3
        c.placement_report_s = 1
        failures = engine.num_worker_failures
        unplaceable = {**pool._resources, "resources": {"no_such_resource": 1}}
        killed: list[float] = []

        def on_step():
            if not killed and (slot := busy_worker(engine, 2)) is not None:
                killed.append(time.monotonic())
                sigkill(slot)

        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(pool, "_resources", unplaceable)  # no replacement can be placed
                finals, handles = drive(engine, requests_of("mixed", "w"), on_step, deadline_s=60)
                assert killed
                waited = time.monotonic() - killed[0]
                assert waited < 30, f"requests failed only after {waited:.0f} s"
                assert engine.num_worker_failures - failures == 1
                errors = [o for o in finals.values() if o.error is not None]
                assert errors, "no request failed"
                for out in finals.values():
                    if out.error is not None:
                        assert "no live worker" in out.error and "no_worker_timeout_s" in out.error
                        assert all(co.finish_reason == "error" for co in out.outputs)
                    else:  # finished before the worker died
                        assert all(co.finish_reason == "length" for co in out.outputs)
                health = engine.health()
                assert health["healthy"] is False and health["live_workers"] == 0
                assert health["starting_workers"] >= 1
                assert any("no live worker" in p for p in health["problems"])
                assert any("has not been placed" in w and "no_such_resource" in w for w in health["warnings"])

                # A request added now fails too, within the deadline.
                start = time.monotonic()
                late, _ = drive(engine, [("late", "the quick brown fox", SamplingParams(max_tokens=4))], deadline_s=30)
                assert time.monotonic() - start < 30
                assert late["late"].outputs[0].finish_reason == "error" and "no live worker" in late["late"].error
                assert engine.health()["healthy"] is False
        finally:
            for slot in list(pool.slots):  # the unplaceable replacements go; real ones follow
                if not slot.placed:
                    pool.lost(slot, "test cleanup")


SPEC_CONFIGS = {
    "ngram": {"num_spec_tokens": 3},
    # the target's own int8 copy on its KV, drafting at every batch size
    "self-draft": {"speculative_config": {"method": "draft_model", "model": "self", "quantization": "int8",
                                          "num_speculative_tokens": 3, "disable_by_batch_size": 99}},
}


@pytest.mark.parametrize("spec", list(SPEC_CONFIGS))
def test_sigkill_with_speculative_decoding(ray_local, tiny_model_path, spec):
    """Drafts on (n-gram, or a draft model): the kill comes once drafts were accepted and
    a seeded random row has had drafts verified (each verification draws from the row's
    generator)."""
    llm = LLM(tiny_model_path, num_workers=1, max_num_seqs=8, max_num_batched_tokens=64,
              no_worker_timeout_s=100, **SPEC_CONFIGS[spec], **COMMON)
    engine = llm.engine
    try:
        reference = References(llm)("spec")
        failures = engine.num_worker_failures
        drafts: dict[int, int] = {}  # id(sequence) -> draft tokens verified
        accepted = [0]

        def counting_apply(step: Any, reply: Any) -> Any:
            nd, na = reply.num_draft_tokens.numpy(), reply.num_accepted_tokens.numpy()
            for row, seq in enumerate(step.rows):
                if row < len(nd):
                    drafts[id(seq)] = drafts.get(id(seq), 0) + int(nd[row])
                    accepted[0] += int(na[row])
            return apply_reply(step, reply)

        killed = []

        def on_step():
            if killed or not accepted[0] or (slot := busy_worker(engine, 3)) is None:
                return
            seeded = [s for s in slot.scheduler.running
                      if s.params.seed is not None and drafts.get(id(s)) and s.output_token_ids and not s.finished]
            if seeded:
                killed.append(", ".join(f"{s.request.request_id} sample {s.index}: {len(s.output_token_ids)} tokens, "
                                        f"{drafts[id(s)]} draft tokens verified" for s in seeded))
                sigkill(slot)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine_module, "apply_reply", counting_apply)
            finals, _ = drive(engine, requests_of("spec", "s"), on_step)
        assert killed, "no kill after drafts were accepted and a seeded row had drafts"
        assert engine.num_worker_failures - failures == 1
        assert_like_reference(finals, "s", reference, context=f"seeded rows at the kill: {killed[0]}")
    finally:
        llm.shutdown()


# -- several nodes --------------------------------------------------------------------


@pytest.fixture(scope="class")
def nodes_and_llm(tiny_model_path):
    """A head that runs no worker (0 CPUs) and two nodes of one CPU, one worker each;
    the shared local Ray comes back afterwards."""
    from ray.cluster_utils import Cluster

    # Notice a lost node in about a second rather than the default ~15 s.
    health = {"health_check_period_ms": 300, "health_check_failure_threshold": 3}
    with own_ray():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": health})
        llm = None
        try:
            for _ in range(2):
                cluster.add_node(wait=False, num_cpus=1)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            llm = LLM(tiny_model_path, num_workers=2, max_num_seqs=8, max_num_batched_tokens=32,
                      worker_start_timeout_s=120, no_worker_timeout_s=3, placement_report_s=2, **COMMON)
            yield cluster, llm, References(llm)
        finally:
            if llm is not None:
                llm.shutdown()
            ray.shutdown()
            cluster.shutdown()


@pytest.mark.multinode
class TestNodes:
    def test_removing_the_node_of_a_worker_loses_nothing(self, nodes_and_llm):
        cluster, llm, refs = nodes_and_llm
        engine = llm.engine
        settle(engine)
        reference = refs("mixed")
        assert len({w.node_id for w in engine.workers}) == 2, "one worker per node"
        nodes = {n.node_id: n for n in cluster.worker_nodes}
        failures = engine.num_worker_failures
        removed = []

        def on_step():
            if not removed and (slot := busy_worker(engine, 3)) is not None:
                removed.append(slot)
                cluster.remove_node(nodes[slot.node_id])

        finals, _ = drive(engine, requests_of("mixed", "m"), on_step)
        assert removed
        assert engine.num_worker_failures - failures == 1
        assert_like_reference(finals, "m", reference)

    def test_losing_every_node_fails_requests_clearly(self, nodes_and_llm):
        cluster, llm, refs = nodes_and_llm
        engine = llm.engine
        assert any(w.live for w in engine.workers)
        removed: list[float] = []

        def on_step():
            if not removed and busy_worker(engine, 2) is not None:
                removed.append(time.monotonic())
                for node in list(cluster.worker_nodes):
                    cluster.remove_node(node)

        finals, _ = drive(engine, requests_of("mixed", "x"), on_step, deadline_s=90)
        assert removed
        assert time.monotonic() - removed[0] < 60
        failed = [o for o in finals.values() if o.error is not None]
        assert failed, "no request failed"
        for out in finals.values():
            if out.error is not None:
                assert "no live worker" in out.error
                assert all(c.finish_reason == "error" for c in out.outputs)
            else:
                assert all(c.finish_reason == "length" for c in out.outputs)
        health = engine.health()
        assert health["healthy"] is False and health["live_workers"] == 0
        assert any("no live worker" in p for p in health["problems"])
