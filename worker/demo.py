"""``python -m worker.demo``: the embedded SmolLM2-135M-Instruct in one Ray worker actor
on a local Ray, answering a few chat prompts (a bare static-batch loop; the scheduling
driver lives in ``cluster``)."""

from __future__ import annotations

import argparse
import os
import time

import msgspec
import ray

from sampler.params import SamplingParams
from worker.actor import create_worker, decode_info
from worker.protocol import PROTOCOL_VERSION, AddedRequest, Codec, Int32Array, StepRequest, WorkerConfig

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Name three colours of the rainbow.",
    "In one sentence, what is a GPU?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="path, hub id or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-spec-tokens", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=False)
    from transformers import AutoTokenizer

    from worker.model_loader import default_model_path

    actor = create_worker(num_cpus=ray.available_resources().get("CPU", 1))
    config = WorkerConfig(model=args.model, max_num_seqs=8, max_model_len=1024, num_spec_tokens=args.num_spec_tokens)
    info = decode_info(ray.get(actor.load.remote(msgspec.msgpack.encode(config))))
    tok = AutoTokenizer.from_pretrained(args.model or str(default_model_path()))
    print(f"loaded {info.model_name} on {info.device} ({info.dtype}), vocab {info.vocab_size}")

    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)["input_ids"])
        for q in QUESTIONS
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens, eos_token_ids=info.eos_token_ids),
        SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=args.max_tokens, eos_token_ids=info.eos_token_ids),
    ]
    codec = Codec()
    rows = [(q, p, params[i % 2]) for i, (q, p) in enumerate(zip(QUESTIONS, prompts))]
    outputs: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    step = StepRequest(
        version=PROTOCOL_VERSION, step_id=0, batch_size=len(rows),
        added=[AddedRequest(row=i, request_id=f"q{i}", params=sp, prompt_token_ids=Int32Array.of(p))
               for i, (_, p, sp) in enumerate(rows)],
        num_scheduled_tokens=Int32Array.of([len(p) for _, p, _ in rows]),
    )
    start, steps = time.perf_counter(), 0
    while True:
        reply = codec.decode_reply(ray.get(actor.step.remote(codec.encode(step))))
        steps += 1
        counts, tokens, k = reply.num_sampled.numpy(), reply.sampled_token_ids.numpy().tolist(), 0
        for i, (_, _, sp) in enumerate(rows):
            for t in tokens[k : k + counts[i]]:
                if not done[i]:
                    outputs[i].append(t)
                    done[i] = t in sp.all_stop_token_ids or len(outputs[i]) >= sp.max_tokens
            k += counts[i]
        if all(done):
            break
        # Finished rows idle (0 tokens) until every row is done: a static batch.
        step = StepRequest(version=PROTOCOL_VERSION, step_id=steps, batch_size=len(rows),
                           num_scheduled_tokens=Int32Array.of([0 if d else 1 for d in done]))
    elapsed = time.perf_counter() - start
    for (q, _, sp), out in zip(rows, outputs):
        kind = "greedy" if sp.temperature == 0 else f"T={sp.temperature} seed={sp.seed}"
        print(f"\n> {q}  [{kind}]\n{tok.decode(out, skip_special_tokens=True).strip()}")
    total = sum(len(o) for o in outputs)
    print(f"\n{total} tokens in {steps} steps, {elapsed:.2f} s ({total / elapsed:.1f} tok/s)")
    ray.shutdown()


if __name__ == "__main__":
    main()
