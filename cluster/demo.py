"""``python -m cluster.demo`` (``make run``): the embedded SmolLM2-135M-Instruct served by
``LLM`` on a local Ray, answering a few chat prompts, with the top logprobs of the
first answer's opening tokens."""

from __future__ import annotations

import argparse
import os

from cluster import LLM
from sampler.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Name three colours of the rainbow.",
    "In one sentence, what is a GPU?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="path, hub id or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-spec-tokens", type=int, default=0)
    ap.add_argument("--address", default=None, help="Ray address (default: a local Ray)")
    args = ap.parse_args()
    if args.address is None:
        # A private local Ray for the demo; a shared cluster keeps its own auth settings.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    llm = LLM(args.model, num_workers=args.num_workers, address=args.address, max_model_len=1024,
              max_num_seqs=16, num_spec_tokens=args.num_spec_tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=3)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, [greedy if i % 2 == 0 else sampled for i in range(len(QUESTIONS))])
    print(f"\n{llm.engine.model_name} on {llm.engine.workers[0].info.device}, {args.num_workers} worker(s)\n")
    for q, out in zip(QUESTIONS, outputs):
        c = out.outputs[0]
        ttft = out.metrics.time_to_first_token
        print(f"Q: {q}\nA: {c.text.strip()}\n   [{len(c.token_ids)} tokens, {c.finish_reason}, first token after {ttft:.2f} s]\n")
    first = outputs[0].outputs[0]
    print("Top logprobs of the first answer's opening tokens:")
    for tok, position in zip(first.token_ids[:5], first.logprobs[:5]):
        alternatives = ", ".join(
            f"{lp.decoded_token!r} {lp.logprob:.2f}" for t, lp in sorted(position.items(), key=lambda kv: -kv[1].logprob)
        )
        print(f"  {position[tok].decoded_token!r:>12} (rank {position[tok].rank}): {alternatives}")
    print(f"cumulative logprob of the first answer: {first.cumulative_logprob:.2f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
