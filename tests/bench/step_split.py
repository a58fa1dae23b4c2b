"""Where a decode step's time goes, driver to worker and back, SmolLM2 on one worker.

Run: ``python tests/bench/step_split.py [--quick] [--batches 1 8 64]``.

For each batch size B: B requests (prompts of 32-96 tokens cut from the e2e corpus, 64
greedy tokens each, EOS ignored) through ``LLM.generate`` on one worker that has every
CPU, once with the steps on the step channel (the default) and once as Ray task calls
(``step_channel=False``), the two engines one after the other. The engine's
``StepStats`` split each worker step into

  schedule, encode          the driver builds and encodes the step message
  transport                 round trip (sending the message -> the reply seen ready)
                            minus the worker's own time: on the channel a socket write
                            and read each way; as a Ray call task submission, transfer,
                            scheduling on the actor, reply return
  prepare                   worker: message decode, batch changes, attention plan, inputs
  forward, sample           worker: the model, the sampler
  bookkeeping               worker: the rows' new tokens, the reply arrays
  reply decode, merge       the driver reads the reply and merges it into the sequences
                            (tokens, detokenization, stop checks, logprobs)
  outputs                   RequestOutputs, built while the worker runs the next step

and the figure the issue sets a target on: the share of wall time outside the worker's
forward + sample (<= 5% at batch 64 on CPU).

Then the transports alone: the same step-sized message (and reply) sent to an echo
actor through a Ray task call, through a step channel
(``worker/transport/step_channel.py``, the actor's compute thread answering) and
through a Ray Compiled Graph: the median round trip of each, and the CPU the two
processes use while the echo is called 20 times a second (a decode step's pace at one
stream), less what they use idle. The compiled graph's reader spins on its
shared-memory channel: a core's worth, on a machine whose two cores the worker's
forward needs.
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
from _results import Row, emit  # noqa: E402
from e2e import corpus_tokens  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from cluster.engine import StepStats  # noqa: E402
from cluster.llm import LLM  # noqa: E402
from sampler.params import SamplingParams  # noqa: E402
from worker.runner.model_loader import default_model_path  # noqa: E402

TARGET = 0.05
PARTS = [  # (label, StepStats attribute)
    ("schedule", "schedule"), ("encode", "encode"), ("transport", "ray_call"),
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


class Echo:
    """Answers a step with a fixed reply, as a Ray call or on a step channel."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.compute = None
        self.server = None

    def step(self, message: bytes) -> bytes:
        return self.reply

    def open_channel(self):
        from worker.transport.compute_thread import ComputeThread
        from worker.transport.step_channel import StepChannelServer

        self.compute = ComputeThread()
        self.server = StepChannelServer(lambda conn: self.compute.attach(conn, self.step), "127.0.0.1")
        return self.server.address

    def pid(self) -> int:
        return os.getpid()


def transports(message: bytes, reply: bytes, calls: int) -> dict[str, tuple[float, float]]:
    """Per transport: (median seconds per round trip, CPU share of a core that caller
    and actor use above idle while it is called every 50 ms)."""
    import psutil

    from worker.transport.step_channel import StepChannel, wait_ready

    actor = ray.remote(num_cpus=0)(Echo).remote(reply)
    processes = [psutil.Process(), psutil.Process(ray.get(actor.pid.remote()))]
    channel = StepChannel(ray.get(actor.open_channel.remote()))

    def on_channel() -> bytes:
        channel.send(message)
        wait_ready([channel.connection], 10)
        return channel.receive()

    def cpu_over(seconds: float, call=None) -> float:
        before = sum(sum(p.cpu_times()[:2]) for p in processes)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            if call is not None:
                call()
            time.sleep(0.05)
        return (sum(sum(p.cpu_times()[:2]) for p in processes) - before) / (time.monotonic() - t0)

    def measure(call) -> tuple[float, float]:
        for _ in range(20):
            call()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), cpu_over(5, call) - idle

    idle = cpu_over(5)
    out = {"Ray task call": measure(lambda: ray.get(actor.step.remote(message))),
           "step channel": measure(on_channel)}
    channel.close()
    try:
        from ray.dag import InputNode

        with InputNode() as inp:
            dag = actor.step.bind(inp)
        compiled = dag.experimental_compile()
        try:
            out["Compiled Graph"] = measure(lambda: ray.get(compiled.execute(message)))
        finally:
            compiled.teardown()
    except Exception as exc:  # noqa: BLE001
        print(f"compiled graph could not run here: {type(exc).__name__}: {exc}")
    ray.kill(actor)
    return out


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
    rows: list[Row] = []
    notes: list[str] = []
    step_bytes = 0
    walls: dict[tuple[str, int], float] = {}
    for transport, on in (("step channel", True), ("Ray task calls", False)):
        llm = LLM(model=None, quantization="none", num_workers=1, max_num_seqs=max(args.batches), max_model_len=256, step_channel=on)
        split(llm, *workload(stream, 2, 4, 99))  # warm-up
        print(f"step split, SmolLM2-135M float32, one worker with {os.cpu_count()} CPUs, steps on the "
              f"{transport}, {args.tokens} greedy tokens per request; ms per worker step")
        head = f"{'batch':>5} | {'steps':>5} | " + " | ".join(f"{label:>12}" for label, _ in PARTS)
        print(head + f" | {'wall/step':>9} | outside fwd+sample")
        for batch in args.batches:
            stats, wall = split(llm, *workload(stream, batch, args.tokens, batch))
            n = stats.worker_steps
            walls[transport, batch] = wall / n
            per = {attr: getattr(stats, attr) / n * 1e3 for _, attr in PARTS}
            outside = 1 - (stats.forward + stats.sample) / wall
            print(f"{batch:>5} | {n:>5} | " + " | ".join(f"{per[attr]:>12.3f}" for _, attr in PARTS)
                  + f" | {wall / n * 1e3:>9.2f} | {outside:.1%}")
            target = f"<= {TARGET:.0%}" if batch == 64 and on else ""
            rows.append(Row(f"{transport}: share of wall time outside worker forward+sample, batch {batch}",
                            f"{outside:.1%}", target=target, met=outside <= TARGET if target else None))
            rows.append(Row(f"{transport}: ms per step, batch {batch}: " + " / ".join(label for label, _ in PARTS),
                            " / ".join(f"{per[attr]:.2f}" for _, attr in PARTS)))
            notes.append(f"{transport}, batch {batch}: {n} worker steps, {wall / n * 1e3:.1f} ms each on average; "
                         f"transport {per['ray_call'] / (wall / n * 1e3):.1%} of it; driver parts (schedule, "
                         f"encode, decode, merge) {(stats.schedule + stats.encode + stats.decode + stats.merge) / wall:.1%} of wall")
            step_bytes = max(step_bytes, 40 * batch)  # a decode step: a few int32s per row
        llm.shutdown()
    for batch in args.batches:
        chan, calls = walls["step channel", batch], walls["Ray task calls", batch]
        rows.append(Row(f"ms per step, batch {batch}: step channel vs Ray task calls",
                        f"{chan * 1e3:.1f}", f"{calls * 1e3:.1f}", f"{calls / chan:.2f}x"))

    measured = transports(b"\0" * step_bytes, b"\0" * (step_bytes * 2), 300)
    for name, (trip, cpu) in measured.items():
        print(f"{name}: round trip of a {step_bytes}-byte message {trip * 1e3:.3f} ms, "
              f"CPU at 20 calls/s {cpu:.1%} of a core above idle")
    base_trip, base_cpu = measured["Ray task call"]
    for name, (trip, cpu) in measured.items():
        if name != "Ray task call":
            rows.append(Row(f"round trip ms of a step-sized message: {name} vs Ray task call",
                            f"{trip * 1e3:.3f}", f"{base_trip * 1e3:.3f}", f"{base_trip / trip:.1f}x faster"))
            rows.append(Row(f"CPU of caller + actor at 20 round trips/s, share of a core: {name} vs Ray task call",
                            f"{cpu:.1%}", f"{base_cpu:.1%}"))
    emit("step_split", rows, notes=notes)
    ray.shutdown()


if __name__ == "__main__":
    main()
