"""Step statistics: what the engine records about its steps.

``StepRecord`` is one worker step as the driver merged it (what ``LLMEngine.on_step``
receives), built by ``step_record`` before its reply is merged. ``StepStats`` sums over
steps where their time went, the driver's parts and each worker step's
(``LLMEngine.stats``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.scheduler import ScheduledStep
from worker import StepTimings


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
