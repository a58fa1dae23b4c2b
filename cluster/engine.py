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

Faults, one mechanism for all of them: whatever keeps a step from coming back (the worker
died, its node or its reply object was lost, the step hung past ``step_timeout_s``, the
worker raised, the step could not be sent or its reply not merged) is a *failed step*.
Every sequence the worker held goes back to the waiting queue with its tokens so far, and
each request that was in the failed step is charged one failure. A charged sequence
runs alone on a worker until it gets past the point where it failed, so a request that
crashes workers is found out exactly and, after ``max_request_failures``, finishes with
an error by itself while the others carry on. A worker that died or hung is replaced
(``WorkerPool``: a loop with backoff); one that raised is reset. While no worker is
alive, requests wait at most ``no_worker_timeout_s`` and then fail with the reason.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from cluster.block_manager import model_salt
from cluster.config import EngineConfig
from cluster.inputs import PromptBudget, PromptType, tokenize_prompt
from cluster.metrics import EngineMetrics, SchedulerStats
from cluster.output_processor import apply_reply
from cluster.outputs import RequestOutput
from cluster.ray_session import RaySession
from cluster.request import Request
from cluster.scheduler import ScheduledStep, WaitingQueue, WorkerScheduler
from cluster.sequence import Sequence
from cluster.worker_pool import SentStep, WorkerPool, WorkerSlot
from sampler.params import SamplingParams, check_text
from worker import Codec, GrammarCompiler, StepTimings, check_model_parallel, load_tokenizer
from worker.transport import ChannelClosed, StepFailed, wait_ready

logger = logging.getLogger("raydecode")

#: Seconds between liveness probes of a worker with no step in flight (or with one on
#: its step channel).
IDLE_PROBE_S = 5.0


@dataclass(frozen=True)
class StepRecord:
    """One worker step as the driver merged it (``LLMEngine.on_step``; what vLLM's
    ``--enable-logging-iteration-details`` logs per iteration). A row is a prefill row
    when its tokens start inside its prompt (vLLM's context requests), else a decode
    row."""

    worker: int
    step_id: int
    #: ``time.time()`` when its reply was in
    replied_at: float
    #: from the step handed to the worker (the send returned; for a step queued behind
    #: another, the moment that one ended) to its reply seen: on a tiny step the worker
    #: may be done before the send returns, so this can be shorter than ``worker_s``
    round_trip_s: float
    prefill_rows: int
    prefill_tokens: int
    decode_rows: int
    decode_tokens: int
    #: the worker's own parts (``StepTimings``), None where the reply carried none
    timings: StepTimings | None

    @property
    def worker_s(self) -> float | None:
        """The worker's time on the step (what vLLM's iteration elapsed time covers:
        the model and the sampler), its transport left out."""
        t = self.timings
        return None if t is None else t.prepare + t.forward + t.sample + t.bookkeeping


def step_record(worker: int, step: ScheduledStep, replied_at: float, round_trip_s: float,
                timings: StepTimings | None) -> StepRecord:
    """``step``'s record, taken before its reply is merged (the rows' computed counts
    are still those it started from)."""
    prefill_rows = prefill_tokens = decode_rows = decode_tokens = 0
    for seq, n in zip(step.rows, step.num_tokens):
        if n <= 0:
            continue
        if seq.num_computed_tokens < len(seq.prompt_token_ids):
            prefill_rows += 1
            prefill_tokens += n
        else:
            decode_rows += 1
            decode_tokens += n
    return StepRecord(worker, step.message.step_id, replied_at, round_trip_s, prefill_rows, prefill_tokens,
                      decode_rows, decode_tokens, timings)


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
    collective: float = 0.0  # of forward + sample: a group's collectives (its leader's)

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
            self.collective += timings.collective


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        self.ray = RaySession.connect(config.address, config.ray_init_kwargs)
        try:
            self.tokenizer, self.model_name = load_tokenizer(config.model, config.trust_remote_code)
            #: steps a pipeline-parallel worker keeps in flight (vLLM's virtual engines:
            #: stage 1 runs one batch while stage 2 finishes the one before); 1 with
            #: speculative decoding (the next step's drafts need this one's tokens)
            self.pipeline_in_flight = config.pipeline_parallel_size if not config.num_spec_tokens else 1
            if config.group_size > 1:  # refused before any actor starts
                check_model_parallel(config.model, config.tensor_parallel_size, config.pipeline_parallel_size,
                                     config.pipeline_layer_partition, config.trust_remote_code)
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
        self.prompt_budget = PromptBudget.for_tokenizer(self.tokenizer, self.max_model_len - 1)
        # Structured outputs: each constraint compiles once here (LRU), checked on entry.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.waiting = WaitingQueue()
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        self._pending_outputs: dict[str, Request] = {}
        self.stats = StepStats()
        #: steps a worker may have in flight: 2 under async scheduling (the next step
        #: waits in the worker's queue while this one runs and its reply is merged)
        self.steps_ahead = 2 if config.async_scheduling_on(infos[0].device) else 1
        if self.pipeline_in_flight > 1:  # a step per pipeline stage, each of other sequences
            self.steps_ahead = self.pipeline_in_flight
        #: counters for monitoring (``deploy/metrics.py`` exposes them as vLLM's metrics)
        self.metrics = EngineMetrics(self.max_model_len)
        #: monotonic time of the last completed (or failed) step, or of being idle
        self.last_progress = time.monotonic()
        self._no_worker_since: float | None = None
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
        slot.scheduler = WorkerScheduler(
            max_rows=min(c.max_num_seqs, info.max_num_seqs),
            max_num_batched_tokens=c.max_num_batched_tokens,
            kv_blocks=info.num_kv_blocks,
            kv_block_size=info.kv_block_size,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            num_spec_tokens=c.num_spec_tokens,
            decodes_first=c.decodes_first,
            enable_prefix_caching=c.enable_prefix_caching,
            exclude_in_flight=self.pipeline_in_flight > 1,
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
        now = time.monotonic()
        for slot in [w for w in self.workers if w.live]:
            # A step on the channel does not tell of a node that vanished without
            # closing its sockets (a Ray call would), so busy channel workers are probed too.
            probe = slot.inflight is None or slot.channel is not None
            if not slot.probe_refs:
                if probe and now - slot.probed_at > IDLE_PROBE_S:
                    # Every rank of a group: one that died takes the group down.
                    slot.probe_refs, slot.probed_at = [r.actor.health.remote() for r in slot.ranks], now
                continue
            refs = slot.probe_refs
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs) and now - slot.probed_at < self.config.ray_call_timeout_s:
                continue
            slot.probe_refs = []
            try:
                ray.get(refs, timeout=0 if len(ready) < len(refs) else self.config.ray_call_timeout_s)
            except RayError as exc:
                if probe:  # else the step in flight reports it
                    state = "idle" if slot.inflight is None else "running a step"
                    self._step_failed(slot, slot.step, f"worker {slot.index} was lost while {state} ({type(exc).__name__})", lost=True)

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
        """Validates and builds a request without queueing it (safe from any thread:
        ``AsyncLLM`` runs it off the event loop, since it tokenizes)."""
        c = self.config
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        check_text("request_id", request_id)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and c.scheduling_policy != "priority":
            raise ValueError("priority needs scheduling_policy='priority'")
        if params.thinking_token_budget is not None and not (c.reasoning_start and c.reasoning_end):
            raise ValueError(
                "thinking_token_budget needs a server started with reasoning markers "
                "(reasoning_start and reasoning_end)"
            )
        if params.n > c.max_n:
            raise ValueError(f"n must be at most {c.max_n} (the server's max_n), got {params.n}")
        for name in ("stop", "bad_words"):
            entries = getattr(params, name) or ()
            if len(entries) > c.max_stop_strings:
                raise ValueError(
                    f"{name} may hold at most {c.max_stop_strings} entries (the server's "
                    f"max_stop_strings), got {len(entries)}"
                )
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size, self.prompt_budget)
        params.verify(self.vocab_size, c.max_logprobs)
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
        if len(ids) + max_tokens + c.num_spec_tokens > self.max_kv_tokens:
            raise ValueError(
                f"the request needs {len(ids) + max_tokens} KV tokens; a worker holds at most "
                f"{self.max_kv_tokens} (kv_cache_tokens)"
            )
        if params.structured_outputs is not None:  # compiled (and cached) here: a bad one is a ValueError
            self.grammar_compiler.validate(params.structured_outputs)
        changes: dict[str, Any] = {"max_tokens": max_tokens}
        if params.eos_token_ids is None:
            changes["eos_token_ids"] = self.eos_token_ids
        params = params.clone(**changes)
        params.tokenize_bad_words(self.tokenizer)
        return Request(
            request_id, text, ids, params, self.tokenizer, limit, next(self._order),
            priority=priority, arrival_time=arrival_time,
        )

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
                    self._step_failed(
                        slot, slot.step, f"worker {slot.index} hung: step {slot.step.message.step_id} "
                        f"took longer than step_timeout_s={self.config.step_timeout_s} s", lost=True,
                    )
            self._dispatch()  # the workers run the next step while outputs are built
        elif self.requests and not any(w.live for w in self.workers):
            self._wait_for_workers(timeout)
        if not self.requests:
            self.last_progress = time.monotonic()
        self._expire_without_workers()
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
            self._step_failed(slot, step, f"worker {slot.index} lost: {exc}", lost=True)
            return False
        except Exception as exc:  # nothing was sent: the worker's batch is as it was
            logger.exception("step %d for worker %d could not be sent", step.message.step_id, slot.index)
            self._step_failed(slot, step, f"the step could not be sent: {exc!r}", lost=False)
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
            self._step_failed(slot, step, f"worker {slot.index} raised on step {step.message.step_id}: {cause!r}", lost=False)
            return
        except (RayError, ChannelClosed) as exc:
            # It died, its node went, the reply object was lost, or it cannot be fetched.
            self._step_failed(slot, step, f"worker {slot.index} lost on step {step.message.step_id} ({type(exc).__name__})", lost=True)
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
            self._step_failed(slot, step, f"the reply of step {step.message.step_id} could not be merged: {exc!r}", lost=False)
            return
        self.last_progress = time.monotonic()
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

    def _step_failed(self, slot: WorkerSlot, step: ScheduledStep | None, reason: str, lost: bool) -> None:
        """A step that will not come back (see the module docstring). ``lost``: the
        worker died or hung and is replaced; otherwise it is reset and serves on. Steps
        sent after it (async scheduling) are dropped with it, uncharged."""
        dropped = [sent.step for sent in slot.pending]
        if step is not None and all(s is not step for s in dropped):
            dropped.append(step)  # already taken off ``pending`` (or never on it)
        for s in dropped:
            s.settle()
        slot.pending = []
        in_step = {id(s) for s in step.rows} if step is not None else set()
        charged: set[int] = set()
        requeued: set[int] = set()
        for seq in slot.scheduler.release_all():
            if seq.finished:
                continue
            request = seq.request
            if id(seq) in in_step:
                seq.suspect_until = len(seq.output_token_ids)
                if id(request) not in charged:
                    charged.add(id(request))
                    request.num_failures += 1
            if request.num_failures >= self.config.max_request_failures:
                if not request.finished:
                    self._fail(request, f"the request failed {request.num_failures} times "
                                        f"(max_request_failures): {reason}")
            else:
                self.waiting.push(seq)
                requeued.add(id(request))
        logger.warning("%s; %d requests charged a failure, their sequences re-queued", reason, len(charged))
        self.last_progress = time.monotonic()
        if len(slot.ranks) > 1:
            # A group's ranks may have parted in the middle of their collectives: it is
            # replaced whole rather than reset.
            lost = True
        if not lost:
            # The reset closes the worker's step channel first (a step queued behind the
            # failed one must not run after it), so a new one is opened.
            had_channel = slot.channel is not None
            try:
                ray.get(slot.actor.reset.remote(), timeout=self.config.ray_call_timeout_s)
                if had_channel:
                    self.pool.open_channel(slot)
                self.metrics.record_requeued(len(requeued), "worker_reset")
                return
            except RayError as exc:
                reason = f"{reason}; then its reset failed ({type(exc).__name__})"
        self.metrics.record_requeued(len(requeued), "worker_lost")
        self.pool.lost(slot, reason)

    def _wait_for_workers(self, timeout: float) -> None:
        """No live worker: wait (bounded) for a starting one."""
        starting = [ref for w in self.workers if not w.live for ref in w.waiting_refs()]
        if starting:
            ray.wait(starting, num_returns=1, timeout=min(timeout, 0.5))
        else:
            time.sleep(min(timeout, 0.1))

    def _expire_without_workers(self) -> None:
        """While no worker is alive, a request waits at most ``no_worker_timeout_s``."""
        if any(w.live for w in self.workers):
            self._no_worker_since = None
            return
        now = time.monotonic()
        if self._no_worker_since is None:
            self._no_worker_since = now
        limit = self.config.no_worker_timeout_s
        for request in list(self.requests.values()):
            if now - max(request.enqueued_at, self._no_worker_since) > limit:
                self._fail(request, f"no live worker for {limit:.0f} s (no_worker_timeout_s); "
                                    f"last worker error: {self.pool.last_error}")

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

    def health(self) -> dict[str, Any]:
        """``healthy`` is False (with ``problems`` saying why) when no worker has been
        alive for ``no_worker_timeout_s``, or no step completed for longer than a step
        may take while requests wait. ``warnings`` name workers that cannot be placed.
        Safe to call from another thread."""
        c, now = self.config, time.monotonic()
        problems = []
        since = self._no_worker_since
        if since is not None and now - since > c.no_worker_timeout_s:
            problems.append(f"no live worker for {now - since:.0f} s; last worker error: {self.pool.last_error}")
        stalled = now - self.last_progress
        if self.requests and stalled > c.step_timeout_s + c.ray_call_timeout_s:
            problems.append(f"no step completed for {stalled:.0f} s while {len(self.requests)} requests wait")
        workers = list(self.workers)
        return {
            "healthy": not problems,
            "problems": problems,
            "warnings": self.pool.problems(),
            "live_workers": sum(w.live for w in workers),
            "ranks_per_worker": self.pool.group_size,
            # what each live worker's KV pool holds (a group: its smallest rank's pool)
            "kv_tokens_per_worker": [w.scheduler.kv_blocks * c.kv_block_size for w in workers if w.live],
            # a worker short of num_workers (a lost one, or a group that lost a rank, is
            # being replaced): serving, at less than full strength
            "degraded": sum(w.live for w in workers) < c.num_workers,
            "starting_workers": sum(not w.live for w in workers),
            "worker_failures": self.pool.num_failures,
            "worker_restarts": self.pool.num_restarts,
            "running_requests": len(self.requests),
            "waiting_sequences": len(self.waiting),
        }

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
