"""One sampler step at batch 64, against the floor of log_softmax + argmax.

Run: ``python tests/bench/sampler_step.py``. Prints, per vocabulary size, the median time
of (a) an all-greedy batch and (b) a realistic mix, and each one's ratio to the floor
measured in the same run on the same logits. Targets (CPU): greedy <= 1.5x, mix <= 8x.

The logits are N(0, 2^2) noise; in 7 of 8 rows, 8 tokens are boosted by U(12, 24), which
gives peaked distributions like a language model's usual step (the top-p nucleus is a
few tokens), and every 8th row is flat noise with top_p=0.9 (its nucleus is a large part
of the vocabulary: the worst case for top-p). The script prints the median nucleus size at p = 0.9.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import time_side_by_side  # noqa: E402

from sampler.config import SamplerConfig  # noqa: E402
from sampler.metadata import SamplingMetadata  # noqa: E402
from sampler.params import SamplingParams  # noqa: E402
from sampler.sampler import Sampler  # noqa: E402

BATCH = 64


def make_logits(vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(BATCH, vocab, generator=gen) * 2.0
    boosted = torch.randint(0, vocab, (BATCH, 8), generator=gen)
    boost = 12.0 + torch.rand(BATCH, 8, generator=gen) * 12.0
    boost[6::8] = 0.0  # every 8th row (a top-p row in the mix) stays flat
    logits.scatter_add_(1, boosted, boost)
    return logits


def nucleus_sizes(logits: torch.Tensor, p: float = 0.9) -> list[int]:
    probs = logits.softmax(dim=-1).sort(dim=-1, descending=True).values
    return ((probs.cumsum(dim=-1) - probs) < p).sum(dim=-1).tolist()


def mix_params(vocab: int, gen: torch.Generator) -> list[SamplingParams]:
    params = []
    for i in range(BATCH):
        kind = i % 8
        params.append(
            SamplingParams(
                temperature=0.0 if kind == 0 else (0.7 if i % 2 else 1.0),
                top_k=50 if kind in (1, 4) else 0,
                top_p=0.9 if kind in (2, 4, 6) else (0.95 if kind == 5 else 1.0),
                min_p=0.05 if kind in (3, 5) else 0.0,
                repetition_penalty=1.1 if i % 3 == 0 else 1.0,
                frequency_penalty=0.2 if i % 3 == 1 else 0.0,
                presence_penalty=0.2 if i % 3 == 1 else 0.0,
                logit_bias={int(t): 2.0 for t in torch.randint(0, vocab, (10,), generator=gen)}
                if i % 4 == 0 else None,
                logprobs=5,
                seed=1000 + i if i % 4 == 1 else None,
            )
        )
    return params


def histories(vocab: int, length: int, gen: torch.Generator) -> list[list[int]]:
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(BATCH)]


def bench(vocab: int) -> list[tuple[str, float, float]]:
    gen = torch.Generator().manual_seed(vocab)
    logits = make_logits(vocab, gen)
    config = SamplerConfig(vocab_size=vocab, max_num_seqs=BATCH)
    sampler = Sampler(config, in_place=True)  # the worker's setting
    prompts = histories(vocab, 256, gen)
    outputs = histories(vocab, 128, gen)
    greedy_md = SamplingMetadata.from_requests(
        [SamplingParams(temperature=0.0)] * BATCH, prompts, outputs, vocab, config=config
    )
    mix_md = SamplingMetadata.from_requests(
        mix_params(vocab, gen), prompts, outputs, vocab, config=config
    )
    # The sampler edits its logits in place (as in the worker): each call gets a copy.
    times = time_side_by_side({
        "floor (log_softmax+argmax)": (lambda: logits.log_softmax(dim=-1).argmax(dim=-1), None),
        "greedy": (lambda x: sampler(x, greedy_md), logits.clone),
        "mix": (lambda x: sampler(x, mix_md), logits.clone),
    })
    floor = times["floor (log_softmax+argmax)"]
    return [(name, t, t / floor) for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=[49152, 151936])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="the smaller vocabulary only (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.vocab = args.vocab[:1]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"sampler step, batch {BATCH}, torch threads {torch.get_num_threads()}")
    print(f"{'vocab':>7} | {'case':<27} | {'ms/step':>8} | {'x floor':>7} | target")
    for vocab in args.vocab:
        sizes = sorted(nucleus_sizes(make_logits(vocab, torch.Generator().manual_seed(vocab))))
        print(f"{vocab:>7} | nucleus at p=0.9: median {sizes[len(sizes) // 2]} tokens, "
              f"max {sizes[-1]}")
        for name, seconds, ratio in bench(vocab):
            target = {"greedy": "<= 1.5x", "mix": "<= 8x"}.get(name, "")
            print(f"{vocab:>7} | {name:<27} | {seconds * 1e3:8.2f} | {ratio:7.2f} | {target}")


if __name__ == "__main__":
    main()
