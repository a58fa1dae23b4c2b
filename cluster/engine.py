"""LLMEngine: the driver loop over N data-parallel Ray worker actors.

``add_request`` validates and queues; ``step`` sends each idle worker its next step (one
msgspec message), waits for the first reply, merges the replies that are in, sends those
workers their next steps at once (so the workers compute while the driver builds
outputs), and returns the ``RequestOutput``s that changed. Not thread-safe: ``AsyncLLM``
drives it from one thread (``make_request`` alone may run in another).

Async scheduling (``EngineConfig.async_scheduling``; by default on for GPU workers
without speculative decoding, off on CPU): each worker has up to two steps in flight. A
decode step (nobody waiting, no prefill chunk left) is planned behind the running one
before that one's reply is merged (the scheduler counts the tokens in flight, and the
tokens they will sample, per sequence), so it waits in the actor's queue and the worker
starts it the moment the running one ends, instead of idling through the reply's trip,
the merge, the next schedule and the next message's trip. The worker holds every
sampled token itself, so a planned step needs none of their values. A sequence whose
last token (``max_tokens``) is being sampled is not planned further; one that stops on
EOS or a stop string runs one token more, which is dropped. A sequence preempted while
its step is in flight keeps that step's token and waits for the reply before it is
placed again.

Faults: whatever keeps a step from coming back is a *failed step*; what follows from
one (its sequences re-queued, its requests charged, the worker reset or replaced), the
liveness probes and the engine's health are ``WorkerSupervisor``'s
(``cluster/supervision.py``). Requests are checked and built by ``InputProcessor``
(``cluster/input_processor.py``); what the engine records of its steps is in
``cluster/step_stats.py``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from cluster.block_manager import model_salt
from cluster.config import EngineConfig
from cluster.input_processor import InputProcessor
from cluster.inputs import PromptType
from cluster.lora import LoRARequest
from cluster.metrics import EngineMetrics, SchedulerStats
from cluster.output_processor import apply_reply
from cluster.outputs import RequestOutput
from cluster.pooling import PoolingParams
from cluster.ray_session import RaySession
from cluster.request import Request
from cluster.scheduler import ScheduledStep, WaitingQueue, WorkerScheduler
from cluster.sequence import Sequence
from cluster.step_stats import StepRecord, StepStats, step_record
from cluster.supervision import WorkerSupervisor
from cluster.worker_pool import SentStep, WorkerPool, WorkerSlot
from sampler.params import SamplingParams
from worker import Codec, StepTimings, check_model_parallel, load_tokenizer
from worker.transport import ChannelClosed, StepFailed, wait_ready

logger = logging.getLogger("raydecode")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        self.ray = RaySession.connect(config.address, config.ray_init_kwargs)
        try:
            self.tokenizer, self.model_name = load_tokenizer(config.model, config.trust_remote_code)
            #: steps a pipeline-parallel worker keeps in flight (vLLM's virtual engines:
            #: stage 1 runs one batch while stage 2 finishes the one before); 1 with
            #: speculative decoding (the next step's drafts need this one's tokens)
            self.pipeline_in_flight = config.pipeline_parallel_size if not config.spec_tokens else 1
            if config.group_size > 1:  # refused before any actor starts
                check_model_parallel(config.model, config.tensor_parallel_size, config.pipeline_parallel_size,
                                     config.pipeline_layer_partition, config.trust_remote_code, config.quantization,
                                     config.enable_expert_parallel)
            self._codec = Codec()
            self.pool = WorkerPool(config)
            for slot in self.pool.start():
                self._activate(slot)
        except BaseException:
            self.ray.close()
            raise
        infos = [w.info for w in self.workers]
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = infos[0].vocab_size
        self.eos_token_ids = list(infos[0].eos_token_ids)
        # Every worker must be able to hold any request alone (they share one queue).
        self.max_kv_tokens = min(w.scheduler.kv_blocks for w in self.workers) * config.kv_block_size
        #: checks and builds requests (``make_request``)
        #: a pooling model's pooler (None: a generative model)
        self.pooler = infos[0].pooler
        self.input_processor = InputProcessor(config, self.tokenizer, self.vocab_size, self.eos_token_ids,
                                              self.max_model_len, self.max_kv_tokens, infos[0].lora_targets,
                                              self.pooler)
        # The input processor's, which the deployment uses too (prompt sizes, constraints).
        self.prompt_budget = self.input_processor.prompt_budget
        self.grammar_compiler = self.input_processor.grammar_compiler
        self.waiting = WaitingQueue()
        self.requests: dict[str, Request] = {}
        self._pending_outputs: dict[str, Request] = {}
        self.stats = StepStats()
        #: steps a worker may have in flight: 2 under async scheduling (the next step
        #: waits in the worker's queue while this one runs and its reply is merged)
        self.steps_ahead = 2 if config.async_scheduling_on(infos[0].device) else 1
        if self.pipeline_in_flight > 1:  # a step per pipeline stage, each of other sequences
            self.steps_ahead = self.pipeline_in_flight
        #: counters for monitoring (``deploy/metrics.py`` exposes them as vLLM's metrics)
        self.metrics = EngineMetrics(self.max_model_len)
        #: liveness probes, failed steps, health
        self.supervisor = WorkerSupervisor(config, self.pool, self.waiting, self.requests, self.metrics, self._fail)
        #: called right before each scheduling pass (``AsyncLLM`` hands over the requests
        #: and aborts that arrived while a step ran, so the step dispatched the moment the
        #: reply lands already includes them)
        self.intake: Callable[[], None] | None = None
        #: called with each worker step's ``StepRecord`` as its reply is merged (a
        #: diagnostic: ``raydecode serve --request-timeline`` writes them); None: off
        self.on_step: Callable[[StepRecord], None] | None = None

    # -- workers ------------------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerSlot]:
        return self.pool.slots

    @property
    def num_worker_failures(self) -> int:
        return self.pool.num_failures

    def _activate(self, slot: WorkerSlot) -> None:
        c, info = self.config, slot.info
        pooler = info.pooler
        # An encoder runs each prompt whole in one step (the budget holds the longest); a
        # pooling request that pools more than its last token computes all of its prompt.
        whole = pooler is not None and pooler.bidirectional
        slot.scheduler = WorkerScheduler(
            max_rows=min(c.max_num_seqs, info.max_num_seqs),
            max_num_batched_tokens=max(c.max_num_batched_tokens, info.max_model_len) if whole else c.max_num_batched_tokens,
            whole_prompts=whole,
            kv_blocks=info.num_kv_blocks,
            kv_block_size=info.kv_block_size,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            num_spec_tokens=c.spec_tokens,
            decodes_first=c.decodes_first,
            enable_prefix_caching=c.enable_prefix_caching and not whole,
            exclude_in_flight=self.pipeline_in_flight > 1,
            max_loras=c.max_loras if c.enable_lora else None,
            # The same on every worker of the engine (one model, one dtype): a sequence's
            # keys are probed against every worker's cache (prefix routing).
            cache_salt=model_salt(info.model_name, info.dtype),
        )
        self.pool.activated(slot)

    def _maintain_workers(self) -> None:
        """Makes freshly loaded workers live, keeps replacements coming, and probes idle
        workers so that one that died while idle is replaced before anyone needs it."""
        for slot in self.pool.poll():
            self._activate(slot)
            logger.warning("worker %d is serving", slot.index)
        self.supervisor.probe()

    # -- requests -----------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validates and builds a request without queueing it (``InputProcessor``; safe
        from any thread: ``AsyncLLM`` runs it off the event loop, since it tokenizes)."""
        return self.input_processor.make_request(request_id, prompt, params, priority=priority,
                                                 arrival_time=arrival_time, lora_request=lora_request)

    def make_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams | None = None,
                             **kw: Any) -> Request:
        """A pooling model's request, checked and built (``InputProcessor``)."""
        return self.input_processor.make_pooling_request(request_id, prompt, params, **kw)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, **kw: Any) -> Request:
        return self.enqueue(self.make_request(request_id, prompt, params, **kw))

    def enqueue(self, request: Request) -> Request:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        request.enqueued_at = time.monotonic()
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

    def _fail(self, request: Request, message: str) -> None:
        """Finishes ``request`` with an error (its own, nobody else's)."""
        request.finish("error", message)
        self._release(request)
        self._pending_outputs[request.request_id] = request

    def _release(self, request: Request) -> None:
        """Frees the rows of finished sequences; forgets the request once all are done."""
        for seq in request.sequences:
            if seq.finished:
                self._free(seq)
        if request.finished and self.requests.pop(request.request_id, None) is not None:
            self.metrics.record_finished(request)

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
        self._maintain_workers()
        self._dispatch()
        busy = [w for w in self.workers if w.inflight is not None]
        if busy:
            t0 = time.perf_counter()
            # Wake up in time to notice a step that outlives step_timeout_s.
            now = time.monotonic()
            first_deadline = min(w.pending[0].sent_monotonic for w in busy) + self.config.step_timeout_s
            done = self._wait_replies(busy, max(0.0, min(timeout, first_deadline - now)))
            ready_at = time.perf_counter()
            self.stats.wait += ready_at - t0
            for slot in busy:
                if slot in done:
                    self._receive(slot, ready_at)
                elif time.monotonic() - slot.pending[0].sent_monotonic > self.config.step_timeout_s:
                    self.supervisor.step_failed(
                        slot, slot.step, f"worker {slot.index} hung: step {slot.step.message.step_id} "
                        f"took longer than step_timeout_s={self.config.step_timeout_s} s", lost=True,
                    )
            self._dispatch()  # the workers run the next step while outputs are built
        elif self.requests and not any(w.live for w in self.workers):
            self.supervisor.wait_for_workers(timeout)
        if not self.requests:
            self.supervisor.progressed()
        self.supervisor.expire_without_workers()
        t0 = time.perf_counter()
        changed, self._pending_outputs = self._pending_outputs, {}
        outputs = [o for o in (r.make_output() for r in changed.values()) if o is not None]
        self.stats.outputs += time.perf_counter() - t0
        self.stats.steps += 1
        return outputs

    @staticmethod
    def _wait_replies(busy: list[WorkerSlot], timeout: float) -> list[WorkerSlot]:
        """The busy workers whose oldest step has replied (or failed), waiting at most
        ``timeout`` seconds for the first: on their step channels, or on the Ray refs
        of those without one."""
        channels = {w.channel.connection: w for w in busy if w.channel is not None}
        refs = {w.pending[0].ref: w for w in busy if w.channel is None}
        if not refs:
            return [channels[c] for c in wait_ready(list(channels), timeout)]
        if not channels:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
            if ready:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            return [refs[r] for r in ready]
        # Both kinds (a worker whose channel could not be opened beside ones with a
        # channel): polled in 1 ms slices.
        deadline = time.monotonic() + timeout
        while True:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            left = max(0.0, deadline - time.monotonic())
            done = [refs[r] for r in ready]
            done += [channels[c] for c in wait_ready(list(channels), 0 if done else min(0.001, left))]
            if done or left <= 0:
                return done

    def _dispatch(self) -> None:
        live = [w for w in self.workers if w.live]
        if not live:
            return
        if self.intake is not None and any(len(w.pending) < self.steps_ahead for w in live):
            self.intake()
        held = sum(w.scheduler.num_running for w in live) + len(self.waiting)
        share = max(1, math.ceil(held / len(live)))
        for slot in live:
            while slot.live and len(slot.pending) < self.steps_ahead:
                if slot.pending and not self._plans_ahead(slot):
                    break
                if not self._send_next(slot, share):
                    break

    def _plans_ahead(self, slot: WorkerSlot) -> bool:
        """Whether to queue a step behind ``slot``'s running one: only a decode step
        with nobody waiting. A request that arrives later waits behind the queued step
        as well as the running one; a decode step is short, a prefill chunk is not (and
        its round trip matters little beside its length). A pipeline-parallel worker
        always does: its next step runs other sequences, on the stage the running one
        has left."""
        return self.pipeline_in_flight > 1 or (not self.waiting and slot.scheduler.decodes_only())

    def _send_next(self, slot: WorkerSlot, share: int) -> bool:
        """Schedules and sends ``slot``'s next step; False when there was nothing to
        send (or it could not be sent)."""
        t0 = time.perf_counter()
        step, preempted = slot.scheduler.schedule(self.waiting, share, self._routes_here)
        t1 = time.perf_counter()
        self.stats.schedule += t1 - t0
        for seq in preempted:
            seq.request.metrics.num_preemptions += 1
        if preempted:
            self.metrics.record_preemptions(len(preempted))
        if step is None:
            return False
        now = time.time()
        for seq in step.rows:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        ref = None
        try:
            message = self._codec.encode(step.message)
            if slot.channel is not None:
                for follower in slot.follower_channels:  # a group: every rank runs it
                    follower.send(message)
                slot.channel.send(message)
            else:
                ref = slot.actor.step.remote(message)
        except ChannelClosed as exc:  # the worker's end is gone: it died
            self.supervisor.step_failed(slot, step, f"worker {slot.index} lost: {exc}", lost=True)
            return False
        except Exception as exc:  # nothing was sent: the worker's batch is as it was
            logger.exception("step %d for worker %d could not be sent", step.message.step_id, slot.index)
            self.supervisor.step_failed(slot, step, f"the step could not be sent: {exc!r}", lost=False)
            return False
        sent_at = time.perf_counter()
        slot.pending.append(SentStep(ref, step, sent_at, time.monotonic()))
        self.stats.encode += sent_at - t1
        return True

    def _routes_here(self, seq: Sequence, scheduler: WorkerScheduler) -> bool:
        """Prefix-aware routing: whether ``scheduler``'s worker should take ``seq`` now.
        It goes to the worker holding the longest cached prefix of it, unless that
        worker holds at least ``prefix_routing_max_imbalance`` more sequences than
        this one (then the least loaded takes it, recomputing)."""
        live = [w.scheduler for w in self.workers if w.live]
        if len(live) < 2 or not self.config.enable_prefix_caching:
            return True
        keys = scheduler.reusable_prefix(seq)
        if not keys:
            return True
        hits = [s.blocks.cached_prefix(keys) for s in live]
        best = max(hits)
        if hits[live.index(scheduler)] == best:
            return True
        holder = min((s for s, h in zip(live, hits) if h == best), key=lambda s: s.num_running)
        return holder.num_running - scheduler.num_running >= self.config.prefix_routing_max_imbalance

    def prefix_cache_stats(self) -> list[dict[str, Any]]:
        """Per live worker: prompt tokens looked up in its prefix cache, the hits, and
        the hit rate (in tokens, vLLM's prefix_cache_queries / hits)."""
        return [
            {"worker": w.index, "queries": w.scheduler.blocks.num_queried_tokens,
             "hits": w.scheduler.blocks.num_hit_tokens, "hit_rate": w.scheduler.blocks.hit_rate}
            for w in self.workers if w.live
        ]

    def _receive(self, slot: WorkerSlot, ready_at: float) -> None:
        sent = slot.pending.pop(0)
        ref, step = sent.ref, sent.step
        if slot.pending:  # the next step starts now: its clocks (timeout, round trip) too
            nxt = slot.pending[0]
            nxt.sent_at, nxt.sent_monotonic = max(nxt.sent_at, ready_at), max(nxt.sent_monotonic, time.monotonic())
        t0 = time.perf_counter()
        try:  # counted as reply decode
            data = slot.channel.receive() if slot.channel is not None else ray.get(ref, timeout=self.config.ray_call_timeout_s)
        except (RayTaskError, StepFailed) as exc:
            # The worker raised (a bug, or a request that breaks the model); it is alive.
            cause = exc.cause if isinstance(exc, RayTaskError) else exc
            self.supervisor.step_failed(
                slot, step, f"worker {slot.index} raised on step {step.message.step_id}: {cause!r}", lost=False)
            return
        except (RayError, ChannelClosed) as exc:
            # It died, its node went, the reply object was lost, or it cannot be fetched.
            self.supervisor.step_failed(
                slot, step, f"worker {slot.index} lost on step {step.message.step_id} ({type(exc).__name__})", lost=True)
            return
        try:
            reply = self._codec.decode_reply(data)
            if reply.step_id != step.message.step_id:
                raise ValueError(f"it answers step {reply.step_id}")
            t1 = time.perf_counter()
            self.stats.add_worker_step(ready_at - sent.sent_at, reply.timings)
            record = self._step_record(slot, step, ready_at - sent.sent_at, reply.timings)
            before = self.metrics.before_reply(step.rows)
            changed = apply_reply(step, reply)
            slot.scheduler.register_computed(step.rows)  # before finished ones are freed
        except Exception as exc:  # a reply the driver cannot use: a bug on either side
            logger.exception("the reply of step %d from worker %d could not be merged", step.message.step_id, slot.index)
            self.supervisor.step_failed(
                slot, step, f"the reply of step {step.message.step_id} could not be merged: {exc!r}", lost=False)
            return
        self.supervisor.progressed()
        try:  # monitoring must never cost a step
            self.metrics.after_reply(step.rows, before, reply)
            if record is not None:
                self.on_step(record)
        except Exception:
            logger.exception("metrics of step %d could not be recorded", step.message.step_id)
        for request in changed:
            self._release(request)
            self._pending_outputs[request.request_id] = request
        self.stats.decode += t1 - t0
        self.stats.merge += time.perf_counter() - t1

    def _step_record(self, slot: WorkerSlot, step: ScheduledStep, round_trip_s: float,
                     timings: StepTimings | None) -> StepRecord | None:
        """The step's record for ``on_step`` (None when off; a diagnostic never fails a
        step)."""
        if self.on_step is None:
            return None
        try:
            return step_record(slot.index, step, time.time(), round_trip_s, timings)
        except Exception:
            logger.exception("the record of step %d could not be taken", step.message.step_id)
            return None

    # -- load and health ------------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        """Share of the live workers' KV blocks held by running sequences (vLLM's
        ``kv_cache_usage_perc``: 1.0 is full). Safe to call from another thread."""
        total = used = 0
        for slot in list(self.workers):
            s = slot.scheduler
            if s is not None:
                total += s.kv_blocks
                used += s.kv_blocks - s.free_blocks
        return used / total if total else 0.0

    def scheduler_stats(self) -> SchedulerStats:
        """Running and waiting sequences and KV usage now (safe from another thread)."""
        schedulers = [slot.scheduler for slot in list(self.workers)]
        running = sum(s.num_running for s in schedulers if s is not None)
        return SchedulerStats(num_running=running, num_waiting=len(self.waiting), kv_cache_usage=self.kv_cache_usage())

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The names of the LoRA adapters running sequences use, and those waiting ones
        use (vLLM's lora_requests_info; safe from another thread)."""
        running = {s.lora.name for slot in list(self.workers) if slot.scheduler is not None
                   for s in list(slot.scheduler.rows) if s is not None and s.lora is not None}
        waiting = {s.lora.name for s in list(self.waiting) if s.lora is not None}
        return sorted(running), sorted(waiting)

    @property
    def last_progress(self) -> float:
        """Monotonic time of the last completed (or failed) step, or of being idle."""
        return self.supervisor.last_progress

    def health(self) -> dict[str, Any]:
        """Whether the workers are alive and steps progressing, with the workers' counts
        (``WorkerSupervisor.health``). Safe to call from another thread."""
        return self.supervisor.health()

    def shutdown(self) -> None:
        """Stops the workers; if this engine started Ray, stops Ray and every process
        it started (nothing else)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown()
        ray_session = getattr(self, "ray", None)
        if ray_session is not None:
            ray_session.close()

    def __del__(self) -> None:  # best effort; shutdown() is the real way
        try:
            if ray.is_initialized():
                self.shutdown()
        except Exception:
            pass
