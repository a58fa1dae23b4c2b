"""Where a decode step's time goes, driver to worker and back, SmolLM2 on one worker.

Run: ``python tests/bench/step_split.py [--quick] [--batches 1 8 64]``.

For each batch size B: B requests (prompts of 32-96 tokens cut from the e2e corpus, 64
greedy tokens each, EOS ignored) through ``LLM.generate`` on one worker that has every
CPU. The engine's ``StepStats`` split each worker step into

  schedule, encode          the driver builds and encodes the step message
  Ray call                  round trip (handing the message to Ray -> the reply seen
                            ready) minus the worker's own time: task submission,
                            transfer, scheduling on the actor, reply return
  prepare                   worker: message decode, batch changes, attention plan, inputs
  forward, sample           worker: the model, the sampler
  bookkeeping               worker: the rows' new tokens, the reply arrays
  reply decode, merge       the driver reads the reply and merges it into the sequences
                            (tokens, detokenization, stop checks, logprobs)
  outputs                   RequestOutputs, built while the worker runs the next step

and the figure the issue sets a target on: the share of wall time outside the worker's
forward + sample (<= 5% at batch 64 on CPU).

Then the channel question: the same step-sized message (and reply) sent to an echo
actor through a Ray task call and through a Ray Compiled Graph channel, median round
trip of each; the difference per step is what moving the engine onto a channel could
save at most.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ray  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from _results import Row, emit  # noqa: E402
from cluster.engine import StepStats  # noqa: E402
from cluster.llm import LLM  # noqa: E402
from e2e import corpus_tokens  # noqa: E402
from sampler.params import SamplingParams  # noqa: E402
from worker.model_loader import default_model_path  # noqa: E402

TARGET = 0.05
PARTS = [  # (label, StepStats attribute)
    ("schedule", "schedule"), ("encode", "encode"), ("Ray call", "ray_call"),
    ("prepare", "prepare"), ("forward", "forward"), ("sample", "sample"),
    ("bookkeeping", "bookkeeping"), ("reply decode", "decode"), ("merge", "merge"),
    ("outputs", "outputs"),
]


def workload(stream: list[int], batch: int, out_len: int, seed: int) -> tuple[list[list[int]], SamplingParams]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        length = rng.randint(32, 96)
        start = rng.randrange(0, len(stream) - length)
        prompts.append(stream[start:start + length])
    return prompts, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)


def split(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[StepStats, float]:
    llm.engine.stats = StepStats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return llm.engine.stats, time.perf_counter() - start


def channel_round_trips(message: bytes, reply: bytes, calls: int) -> tuple[float, float | None]:
    """Median seconds per round trip: task call, and Compiled Graph channel (None if
    compiled graphs cannot run here)."""

    @ray.remote(num_cpus=0)
    class Echo:
        def __init__(self, reply: bytes) -> None:
            self.reply = reply

        def step(self, message: bytes) -> bytes:
            return self.reply

    actor = Echo.remote(reply)

    def median_of(call) -> float:
        for _ in range(20):
            call()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    task = median_of(lambda: ray.get(actor.step.remote(message)))
    graph = None
    try:
        from ray.dag import InputNode

        with InputNode() as inp:
            dag = actor.step.bind(inp)
        compiled = dag.experimental_compile()
        try:
            graph = median_of(lambda: ray.get(compiled.execute(message)))
        finally:
            compiled.teardown()
    except Exception as exc:  # noqa: BLE001
        print(f"compiled graph could not run here: {type(exc).__name__}: {exc}")
    ray.kill(actor)
    return task, graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8 only, 16 tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.quick:
        args.batches, args.tokens = [8], 16
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    stream = corpus_tokens(tok)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    llm = LLM(model=None, num_workers=1, max_num_seqs=max(args.batches), max_model_len=256)
    split(llm, *workload(stream, 2, 4, 99))  # warm-up

    rows: list[Row] = []
    notes: list[str] = []
    print(f"step split, SmolLM2-135M float32, one worker with {os.cpu_count()} CPUs, "
          f"{args.tokens} greedy tokens per request; ms per worker step")
    head = f"{'batch':>5} | {'steps':>5} | " + " | ".join(f"{label:>12}" for label, _ in PARTS)
    print(head + f" | {'wall/step':>9} | outside fwd+sample")
    step_bytes = 0
    for batch in args.batches:
        stats, wall = split(llm, *workload(stream, batch, args.tokens, batch))
        n = stats.worker_steps
        per = {attr: getattr(stats, attr) / n * 1e3 for _, attr in PARTS}
        outside = 1 - (stats.forward + stats.sample) / wall
        print(f"{batch:>5} | {n:>5} | " + " | ".join(f"{per[attr]:>12.3f}" for _, attr in PARTS)
              + f" | {wall / n * 1e3:>9.2f} | {outside:.1%}")
        target = f"<= {TARGET:.0%}" if batch == 64 else ""
        rows.append(Row(f"share of wall time outside worker forward+sample, batch {batch}", f"{outside:.1%}",
                        target=target, met=outside <= TARGET if target else None))
        rows.append(Row(f"ms per step, batch {batch}: " + " / ".join(label for label, _ in PARTS),
                        " / ".join(f"{per[attr]:.2f}" for _, attr in PARTS)))
        notes.append(f"batch {batch}: {n} worker steps, {wall / n * 1e3:.1f} ms each on average; Ray call "
                     f"{per['ray_call'] / (wall / n * 1e3):.1%} of it; driver parts (schedule, encode, decode, "
                     f"merge) {(stats.schedule + stats.encode + stats.decode + stats.merge) / wall:.1%} of wall")
        step_bytes = max(step_bytes, 40 * batch)  # a decode step: a few int32s per row
    llm.shutdown()

    task, graph = channel_round_trips(b"\0" * step_bytes, b"\0" * (step_bytes * 2), 300)
    print(f"round trip of a {step_bytes}-byte message: task call {task * 1e3:.3f} ms, compiled graph "
          + (f"{graph * 1e3:.3f} ms" if graph is not None else "n/a"))
    if graph is not None:
        rows.append(Row("round trip ms of a step-sized message: task call vs Compiled Graph channel",
                        f"{task * 1e3:.3f}", f"{graph * 1e3:.3f}", f"{task / graph:.1f}x slower"))
    emit("step_split", rows, notes=notes)
    ray.shutdown()


if __name__ == "__main__":
    main()
