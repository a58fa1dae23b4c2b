"""``python -m sampler.demo``: the sampler on its own, on a toy next-token distribution.

It shows the sampler's public API end to end, without an engine or a model: per-request
params in one batch, logprobs, seeded reproducibility, a thinking budget and a
speculative-decoding verification step.
"""

from __future__ import annotations

import torch

from sampler.metadata import SamplingMetadata
from sampler.params import SamplingParams
from sampler.rejection_sampler import RejectionSampler
from sampler.sampler import Sampler
from sampler.thinking_budget import ReasoningConfig, ThinkingBudgetStateHolder

WORDS = ["<eos>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "<think>", "</think>", "."]
VOCAB = len(WORDS)


def toy_logits(rows: int) -> torch.Tensor:
    base = torch.tensor([0.5, 2.0, 1.6, 1.2, 1.0, 0.9, 0.8, 0.7, 0.6, -1.0, -1.0, 0.4])
    return base.repeat(rows, 1)


def main() -> None:
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=3, seed=7, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.6, min_p=0.1, seed=11),
        SamplingParams(temperature=0.0, logit_bias={6: 5.0}),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0),
    ]
    prompts = [[1, 2], [1, 7], [1, 2, 3], [4, 5], [1, 1]]
    outputs: list[list[int]] = [[] for _ in params]
    md = SamplingMetadata.from_requests(params, prompts, outputs, VOCAB)
    sampler = Sampler()
    for _ in range(4):
        out = sampler(toy_logits(len(params)), md)
        for row, tok in enumerate(out.sampled_token_ids.tolist()):
            outputs[row].append(tok)
    print("raydecode sampler demo (toy vocabulary of", VOCAB, "words)")
    labels = ["greedy", "top-k 3, seed 7", "top-p 0.6 + min-p, seed 11",
              "greedy + logit_bias 'mat'", "greedy + penalties"]
    for label, toks in zip(labels, outputs):
        print(f"  {label:<28} -> {' '.join(WORDS[t] for t in toks)}")
    lp = out.logprobs_tensors
    assert lp is not None
    top = ", ".join(f"{WORDS[t]}={v:.2f}" for t, v in zip(lp.token_ids[0, 1:].tolist(),
                                                          lp.logprobs[0, 1:].tolist()))
    print(f"  last greedy step: sampled rank {int(lp.ranks[0])}, top-3 logprobs: {top}")

    # Thinking budget: after 2 thinking tokens the end marker is forced.
    holder = ThinkingBudgetStateHolder(
        ReasoningConfig(reasoning_start_token_ids=[9], reasoning_end_token_ids=[10]),
        max_num_seqs=1, num_spec_tokens=0, device="cpu", is_pin_memory=False,
    )
    think_out: list[int] = []
    think_md = SamplingMetadata.from_requests(
        [SamplingParams(temperature=0.0, thinking_token_budget=2)], [[9]], [think_out], VOCAB,
        thinking_budget=holder,
    )
    for _ in range(4):
        think_out.append(int(sampler(toy_logits(1), think_md).sampled_token_ids[0]))
    print("  thinking budget 2 after '<think>' ->", " ".join(WORDS[t] for t in think_out))

    # Speculative decoding: verify 3 drafted tokens greedily.
    spec_md = SamplingMetadata.from_requests([SamplingParams(temperature=0.0)], [[1]], [[]], VOCAB)
    target = toy_logits(3)
    target[1, 3] = 5.0  # the target prefers "sat" at the second position
    emitted = RejectionSampler()([[1, 2, 4]], None, target, torch.tensor([5]), spec_md)
    shown = [WORDS[t] if t >= 0 else "-" for t in emitted[0].tolist()]
    print("  drafts 'the cat on' verified ->", " ".join(shown))


if __name__ == "__main__":
    main()
