"""LLMEngine: the driver loop over N data-parallel Ray worker actors.

``add_request`` validates and queues; ``step`` sends each idle worker its next step (one
msgspec message), waits for the first reply, merges the replies that are in, sends those
workers their next steps at once (so the workers compute while the driver builds
outputs), and returns the ``RequestOutput``s that changed. Not thread-safe: ``AsyncLLM``
drives it from one thread.

A worker that dies (killed, node lost) shows up as ``RayActorError`` on its step call:
everything it held goes back to the waiting queue with its tokens so far, the remaining
workers take it, and a replacement actor is started; if the replacement cannot be placed
within ``worker_start_timeout_s`` the engine serves on without it.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.config import EngineConfig
from cluster.inputs import PromptType, tokenize_prompt
from cluster.output_processor import apply_reply
from cluster.outputs import RequestOutput
from cluster.request import Request
from cluster.scheduler import ScheduledStep, WaitingQueue, WorkerScheduler
from cluster.sequence import Sequence
from sampler.params import SamplingParams
from worker.actor import create_worker, decode_info
from worker.model_loader import ModelLoadError, load_tokenizer
from worker.protocol import Codec, StepTimings, WorkerInfo

logger = logging.getLogger("raydecode")


@dataclass
class WorkerSlot:
    """One worker actor and the driver's view of it."""

    index: int
    actor: Any
    load_ref: Any = None  # while the model loads
    started_at: float = field(default_factory=time.monotonic)
    info: WorkerInfo | None = None
    scheduler: WorkerScheduler | None = None
    inflight: Any = None  # ObjectRef of the running step
    step: ScheduledStep | None = None
    sent_at: float = 0.0  # perf_counter time the running step was handed to Ray

    @property
    def live(self) -> bool:
        return self.scheduler is not None


@dataclass
class StepStats:
    """Where a step's time went (seconds, summed over steps).

    The driver's own parts: ``schedule``, ``encode`` (the step message), ``decode``
    (the reply), ``merge`` (the reply into the sequences: tokens, detokenization, stop
    checks, logprobs) and ``outputs`` (``RequestOutput``s, built while the workers run
    the next step). ``wait`` is the time blocked in ``ray.wait``.
    Per worker step: ``round_trip`` is from handing the message to Ray to seeing the
    reply ready; the worker's own parts (from its reply's ``timings``) are ``prepare``,
    ``forward``, ``sample`` and ``bookkeeping``; what is left of the round trip is the
    Ray call (``ray_call``: task submission, transfer, scheduling on the actor).
    """

    steps: int = 0
    schedule: float = 0.0
    encode: float = 0.0
    wait: float = 0.0
    decode: float = 0.0
    merge: float = 0.0
    outputs: float = 0.0
    worker_steps: int = 0
    round_trip: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    bookkeeping: float = 0.0

    @property
    def driver(self) -> float:
        return self.schedule + self.encode + self.decode + self.merge + self.outputs

    @property
    def worker(self) -> float:
        return self.prepare + self.forward + self.sample + self.bookkeeping

    @property
    def ray_call(self) -> float:
        return self.round_trip - self.worker

    def add_worker_step(self, round_trip: float, timings: StepTimings | None) -> None:
        self.worker_steps += 1
        self.round_trip += round_trip
        if timings is not None:
            self.prepare += timings.prepare
            self.forward += timings.forward
            self.sample += timings.sample
            self.bookkeeping += timings.bookkeeping


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        self._connect_ray()
        self.tokenizer, self.model_name = load_tokenizer(config.model, config.trust_remote_code)
        self._codec = Codec()
        self._worker_config = msgspec.msgpack.encode(config.worker_config())
        self._worker_ids = itertools.count()
        self.workers = [self._start_worker() for _ in range(config.num_workers)]
        for slot in self.workers:
            try:
                info = decode_info(ray.get(slot.load_ref, timeout=config.worker_start_timeout_s))
            except RayTaskError as exc:
                self.shutdown()
                raise ModelLoadError(f"a worker could not load the model: {exc.cause}") from None
            except GetTimeoutError:
                self.shutdown()
                raise RuntimeError(
                    f"worker actors were not ready within {config.worker_start_timeout_s} s: each "
                    f"needs {self._worker_resources()} and the cluster has "
                    f"{ray.available_resources()} available"
                ) from None
            self._activate(slot, info)
        infos = [w.info for w in self.workers]
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = infos[0].vocab_size
        self.eos_token_ids = list(infos[0].eos_token_ids)
        # Every worker must be able to hold any request alone (they share one queue).
        self.max_kv_tokens = min(w.scheduler.kv_blocks for w in self.workers) * config.kv_block_size
        self.waiting = WaitingQueue()
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        self._pending_outputs: dict[str, Request] = {}
        self.stats = StepStats()
        self.num_worker_failures = 0

    # -- workers ------------------------------------------------------------------------

    def _connect_ray(self) -> None:
        if ray.is_initialized():
            return
        kwargs = {"include_dashboard": False, "log_to_driver": False, **self.config.ray_init_kwargs}
        ray.init(address=self.config.address, **kwargs)

    def _worker_resources(self) -> dict[str, Any]:
        c = self.config
        gpus = c.worker_num_gpus
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        cpus = c.worker_num_cpus
        if cpus is None:
            free = ray.available_resources().get("CPU", 1)
            cpus = 1 if gpus else max(1, int(free // c.num_workers))
        return {"num_gpus": gpus, "num_cpus": cpus, "resources": dict(c.worker_resources)}

    def _start_worker(self) -> WorkerSlot:
        actor = create_worker(**self._worker_resources())
        return WorkerSlot(next(self._worker_ids), actor, load_ref=actor.load.remote(self._worker_config))

    def _activate(self, slot: WorkerSlot, info: WorkerInfo) -> None:
        c = self.config
        rows = min(c.max_num_seqs, info.max_num_seqs)
        kv_tokens = c.kv_cache_tokens or rows * info.max_model_len
        slot.info, slot.load_ref = info, None
        slot.scheduler = WorkerScheduler(
            max_rows=rows,
            max_num_batched_tokens=c.max_num_batched_tokens,
            kv_blocks=max(1, kv_tokens // c.kv_block_size),
            kv_block_size=c.kv_block_size,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            num_spec_tokens=c.num_spec_tokens,
            decodes_first=c.decodes_first,
        )

    def _poll_starting(self) -> None:
        """Activates replacements whose model has loaded; gives up on stuck ones."""
        for slot in [w for w in self.workers if w.load_ref is not None]:
            ready, _ = ray.wait([slot.load_ref], timeout=0)
            if ready:
                try:
                    self._activate(slot, decode_info(ray.get(slot.load_ref)))
                    logger.warning("replacement worker %d is serving", slot.index)
                except (RayActorError, RayTaskError) as exc:
                    logger.warning("replacement worker %d failed to load: %s", slot.index, exc)
                    self.workers.remove(slot)
            elif time.monotonic() - slot.started_at > self.config.worker_start_timeout_s:
                logger.warning("replacement worker %d could not be placed; serving without it", slot.index)
                ray.kill(slot.actor, no_restart=True)
                self.workers.remove(slot)

    def _worker_died(self, slot: WorkerSlot, exc: Exception) -> None:
        self.num_worker_failures += 1
        requeued = self._requeue(slot)
        logger.warning("worker %d died (%s); re-queued %d sequences", slot.index, type(exc).__name__, requeued)
        self.workers.remove(slot)
        self.workers.append(self._start_worker())

    def _requeue(self, slot: WorkerSlot) -> int:
        """Puts every unfinished sequence the worker held back on the waiting queue (with
        its tokens so far); returns how many."""
        seqs = [s for s in (slot.scheduler.release_all() if slot.scheduler else []) if not s.finished]
        for seq in seqs:
            self.waiting.push(seq)
        return len(seqs)

    # -- requests -----------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Validates and builds a request without queueing it (safe from any thread)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError("priority needs scheduling_policy='priority'")
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        params.verify(self.vocab_size, self.config.max_logprobs)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is too long: max_model_len is {limit}, "
                "which must also leave room for one generated token"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens and "
                f"max_model_len is {limit} (at most {limit - len(ids)} new tokens)"
            )
        if len(ids) + max_tokens + self.config.num_spec_tokens > self.max_kv_tokens:
            raise ValueError(
                f"the request needs {len(ids) + max_tokens} KV tokens; a worker holds at most "
                f"{self.max_kv_tokens} (kv_cache_tokens)"
            )
        changes: dict[str, Any] = {"max_tokens": max_tokens}
        if params.eos_token_ids is None:
            changes["eos_token_ids"] = self.eos_token_ids
        params = params.clone(**changes)
        params.tokenize_bad_words(self.tokenizer)
        return Request(
            str(request_id), text, ids, params, self.tokenizer, limit, next(self._order),
            priority=priority, arrival_time=arrival_time,
        )

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, **kw: Any) -> Request:
        return self.enqueue(self.make_request(request_id, prompt, params, **kw))

    def enqueue(self, request: Request) -> Request:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        for seq in request.sequences:
            self.waiting.push(seq)
        return request

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Ends the requests now ("abort"), frees their rows and KV blocks; their final
        outputs come with the next ``step``. Unknown or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            request.finish("abort")
            self._release(request)
            self._pending_outputs[rid] = request

    def _release(self, request: Request) -> None:
        """Frees the rows of finished sequences; forgets the request once all are done."""
        for seq in request.sequences:
            if seq.finished:
                self._free(seq)
        if request.finished:
            self.requests.pop(request.request_id, None)

    def _free(self, seq: Sequence) -> None:
        if seq.row is None:
            self.waiting.remove(seq)
            return
        for slot in self.workers:
            s = slot.scheduler
            if s is not None and seq.row < len(s.rows) and s.rows[seq.row] is seq:
                s.free(seq)
                return

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the loop -----------------------------------------------------------------------

    def step(self, timeout: float = 1.0) -> list[RequestOutput]:
        """Runs until at least one worker replied (or ``timeout`` passed) and returns the
        outputs of the requests that changed."""
        self._poll_starting()
        self._dispatch()
        changed: dict[str, Request] = dict(self._pending_outputs)
        self._pending_outputs.clear()
        busy = [w for w in self.workers if w.inflight is not None]
        if busy:
            t0 = time.perf_counter()
            ready, _ = ray.wait([w.inflight for w in busy], num_returns=1, timeout=timeout)
            if ready:
                ready, _ = ray.wait([w.inflight for w in busy], num_returns=len(busy), timeout=0)
            ready_at = time.perf_counter()
            self.stats.wait += ready_at - t0
            done = {r for r in ready}
            for slot in [w for w in busy if w.inflight in done]:
                for request in self._receive(slot, ready_at):
                    changed[request.request_id] = request
            self._dispatch()  # the workers run the next step while outputs are built
        elif self.requests and not any(w.live for w in self.workers):
            self._wait_for_workers(timeout, changed)
        t0 = time.perf_counter()
        outputs = [o for o in (r.make_output() for r in changed.values()) if o is not None]
        self.stats.outputs += time.perf_counter() - t0
        self.stats.steps += 1
        return outputs

    def _dispatch(self) -> None:
        live = [w for w in self.workers if w.live]
        if not live:
            return
        held = sum(w.scheduler.num_running for w in live) + len(self.waiting)
        share = max(1, math.ceil(held / len(live)))
        for slot in live:
            if slot.inflight is not None:
                continue
            t0 = time.perf_counter()
            step, preempted = slot.scheduler.schedule(self.waiting, share)
            t1 = time.perf_counter()
            self.stats.schedule += t1 - t0
            for seq in preempted:
                seq.request.metrics.num_preemptions += 1
            if step is None:
                continue
            now = time.time()
            for seq in step.rows:
                if seq.request.metrics.first_scheduled_time is None:
                    seq.request.metrics.first_scheduled_time = now
            message = self._codec.encode(step.message)
            slot.step = step
            slot.sent_at = time.perf_counter()
            self.stats.encode += slot.sent_at - t1
            slot.inflight = slot.actor.step.remote(message)

    def _receive(self, slot: WorkerSlot, ready_at: float) -> list[Request]:
        ref, step = slot.inflight, slot.step
        slot.inflight, slot.step = None, None
        t0 = time.perf_counter()
        try:
            data = ray.get(ref)  # counted as reply decode
        except RayActorError as exc:
            self._worker_died(slot, exc)
            return []
        except RayTaskError as exc:
            # The worker refused the step (a driver bug): its batch is intact but no
            # longer matches ours, so start it afresh and re-place its sequences.
            logger.error("worker %d refused step %d: %s", slot.index, step.message.step_id, exc.cause)
            ray.get(slot.actor.reset.remote())
            self._requeue(slot)
            return []
        reply = self._codec.decode_reply(data)
        t1 = time.perf_counter()
        self.stats.add_worker_step(ready_at - slot.sent_at, reply.timings)
        changed = apply_reply(step, reply)
        for request in changed:
            self._release(request)
        self.stats.decode += t1 - t0
        self.stats.merge += time.perf_counter() - t1
        return changed

    def _wait_for_workers(self, timeout: float, changed: dict[str, Request]) -> None:
        starting = [w.load_ref for w in self.workers if w.load_ref is not None]
        if starting:
            ray.wait(starting, num_returns=1, timeout=timeout)
            return
        # No worker left and none coming: nothing can run what is queued.
        for request in list(self.requests.values()):
            request.finish("error", "no live workers: every worker died and none could be started")
            self._release(request)
            changed[request.request_id] = request

    def shutdown(self) -> None:
        for slot in self.workers:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.workers = []

    def __del__(self) -> None:  # best effort; shutdown() is the real way
        try:
            if ray.is_initialized():
                self.shutdown()
        except Exception:
            pass
