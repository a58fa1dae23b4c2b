"""Decode throughput of the worker actor alone vs ``model.generate``, same run.

Run: ``python tests/bench/worker_step.py [--quick] [--batches 1 8 32 64]``.

For each batch size B, B chat prompts of different lengths (SmolLM2-135M-Instruct, the
embedded default) generate N = 32 greedy tokens:
  ours   the Ray worker actor, driven by a bare loop in this script (one step message per
         step: all prompts prefilled in the first step, then one decode token per row);
         decode tokens/s = B * (N - 1) / (time of the decode steps, Ray calls included)
  peer   ``model.generate`` on the left-padded batch (stock transformers attention, no
         EOS stop); decode time = time(N tokens) - time(1 token)
Rounds alternate ours and the peer; medians are printed with the ratio.
Targets (CPU): >= 1.0x at batch 1, >= 1.5x at batch 32.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import msgspec  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from _results import Row, emit  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from sampler.params import SamplingParams  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402
from worker.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    Int32Array,
    StepRequest,
)
from worker.runner.model_loader import default_model_path  # noqa: E402
from worker.transport.actor import create_worker, decode_info  # noqa: E402

N = 32
TARGETS = {1: 1.0, 32: 1.5}
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a five year old in two sentences.",
    "List three prime numbers.",
    "Hi!",
    "Translate 'good morning' into Spanish and German.",
    "What does a Ray actor do? Answer briefly, like a teacher speaking to a new student.",
    "Give me a short recipe for pancakes with only four ingredients and no eggs at all.",
]


def chat_prompts(tok, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        q = QUESTIONS[i % len(QUESTIONS)] + (" Please." * (i // len(QUESTIONS)))
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def run_ours(actor, codec: Codec, prompts: list[list[int]]) -> tuple[float, float]:
    """(decode seconds, total seconds) for N tokens per prompt."""
    ray.get(actor.reset.remote())
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    b = len(prompts)
    added = [
        AddedRequest(row=i, request_id=f"r{i}", params=params, prompt_token_ids=Int32Array.of(p))
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    first = StepRequest(version=PROTOCOL_VERSION, step_id=0, batch_size=b, added=added,
                        num_scheduled_tokens=Int32Array.of([len(p) for p in prompts]))
    codec.decode_reply(ray.get(actor.step.remote(codec.encode(first))))
    decode_start = time.perf_counter()
    ones = Int32Array.of([1] * b)
    for s in range(1, N):
        step = StepRequest(version=PROTOCOL_VERSION, step_id=s, batch_size=b, num_scheduled_tokens=ones)
        reply = codec.decode_reply(ray.get(actor.step.remote(codec.encode(step))))
        assert len(reply.sampled_token_ids) == b
    end = time.perf_counter()
    return end - decode_start, end - start


def run_generate(model, tok, prompts: list[list[int]], n: int) -> float:
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad)
    assert out.shape[1] == width + n
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round per batch size")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds

    path = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config = copy.deepcopy(model.generation_config)
    model.generation_config.eos_token_id = None  # like ignore_eos: always N tokens

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = create_worker(num_cpus=2)  # the whole machine: generate gets both cores too
    config = WorkerConfig(max_num_seqs=max(args.batches), max_model_len=512)
    info = decode_info(ray.get(actor.load.remote(msgspec.msgpack.encode(config))))
    codec = Codec()
    print(f"worker decode throughput, {info.model_name} ({info.dtype}, {info.device}), "
          f"{N} greedy tokens per prompt; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'batch':>5} | {'ours tok/s':>10} | {'generate tok/s':>14} | {'ratio':>6} | {'target':>7} "
          f"| {'e2e ours s':>10} | {'e2e generate s':>14} | {'e2e ratio':>9}")
    rows: list[Row] = []
    for b in args.batches:
        prompts = chat_prompts(tok, b)
        run_ours(actor, codec, prompts)  # warm-up
        run_generate(model, tok, prompts, 2)
        ours_dec, ours_all, gen_dec, gen_all = [], [], [], []
        for _ in range(rounds):
            d, a = run_ours(actor, codec, prompts)
            ours_dec.append(d)
            ours_all.append(a)
            full = run_generate(model, tok, prompts, N)
            one = run_generate(model, tok, prompts, 1)
            gen_dec.append(full - one)
            gen_all.append(full)
        tokens = b * (N - 1)
        ours_tps = tokens / statistics.median(ours_dec)
        gen_tps = tokens / statistics.median(gen_dec)
        e2e_ours, e2e_gen = statistics.median(ours_all), statistics.median(gen_all)
        target = f">= {TARGETS[b]}x" if b in TARGETS else ""
        print(f"{b:>5} | {ours_tps:>10.1f} | {gen_tps:>14.1f} | {ours_tps / gen_tps:>5.2f}x | {target:>7} "
              f"| {e2e_ours:>10.2f} | {e2e_gen:>14.2f} | {e2e_gen / e2e_ours:>8.2f}x")
        ratio = ours_tps / gen_tps
        rows.append(Row(f"worker decode tok/s vs model.generate, batch {b}", f"{ours_tps:.1f}",
                        f"{gen_tps:.1f}", f"{ratio:.2f}x", target, ratio >= TARGETS[b] if b in TARGETS else None))
    emit("worker_step", rows, notes=[
        f"worker actor alone (bare driver loop, Ray calls included), SmolLM2-135M float32, {N} greedy tokens, "
        f"median of {rounds} interleaved rounds; decode time of generate = time({N}) - time(1)"])
    ray.shutdown()


if __name__ == "__main__":
    main()
