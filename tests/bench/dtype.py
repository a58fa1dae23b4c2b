"""bfloat16 against float32 on the same engine, same run: speed and greedy agreement.

Run: ``python tests/bench/dtype.py [--quick] [--requests 64]``.

The e2e greedy workload (``e2e.build_workload``: prompts of 16-512 tokens cut from the
stdlib-docstring corpus, outputs of 16-256, every request ``ignore_eos``) through
``LLM.generate`` with SmolLM2-135M-Instruct, once with ``dtype="float32"`` (the
default) and once with ``dtype="bfloat16"`` (one worker with every core, 64 rows,
512-token steps; warm-up untimed). Figures:

  speed      output tok/s of each, and the ratio bf16 / float32.
  agreement  (a) free-running: requests whose bf16 output equals float32's token for
             token, and the share of output tokens before the first difference
             (after it the two continue different texts, so later tokens say nothing);
             (b) teacher-forced: bf16 reads each float32 output as part of its prompt
             (``prompt_logprobs=0``) and reports, per position, the rank of float32's
             token among its own logits; rank 1 means bf16 would have chosen it too.
             The share of rank-1 positions over every output position is the per-step
             agreement, which does not compound after a first difference.

bf16 pays on CPUs where oneDNN runs it natively (AVX512-BF16 or AMX: the packed bf16
linears); elsewhere it is converted op by op and may be slower than float32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from _results import Row, cpu_model, emit  # noqa: E402
from e2e import build_workload, corpus_tokens  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from cluster import LLM  # noqa: E402
from sampler.params import SamplingParams  # noqa: E402
from worker.cpu.packed_linear import packable_dtypes  # noqa: E402
from worker.runner.model_loader import default_model_path  # noqa: E402

SETTINGS = {"num_workers": 1, "max_num_seqs": 64, "max_num_batched_tokens": 512, "max_model_len": 2048,
            "enable_prefix_caching": False}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> tuple[list[list[int]], float]:
    """(outputs, output tok/s) of one timed ``generate`` after an untimed warm-up."""
    llm.generate([prompts[0][:32]], [greedy(4)], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in tokens] == lengths, "every request makes exactly max_tokens (ignore_eos)"
    return tokens, sum(lengths) / wall


def teacher_forced_ranks(llm: LLM, prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
    """The rank, in ``llm``'s logits, of each token of ``outputs`` given its prompt and
    the tokens before it (1: its own greedy choice)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([p + o for p, o in zip(prompts, outputs)], [params] * len(prompts), use_tqdm=False)
    ranks = []
    for p, o, out in zip(prompts, outputs, outs):
        positions = out.prompt_logprobs  # position 0 has none
        for i, token in enumerate(o):
            ranks.append(positions[len(p) + i][token].rank)
    return ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, prompts 16-128, outputs 16-64")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.requests or (8 if args.quick else 64)
    prompt_len, out_len = ((16, 128), (16, 64)) if args.quick else ((16, 512), (16, 256))
    path = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    reqs, _ = build_workload(corpus_tokens(tok), n, prompt_len, out_len, 0.0, args.seed)
    prompts, lengths = [r.prompt for r in reqs], [r.max_tokens for r in reqs]
    native = torch.bfloat16 in packable_dtypes()
    print(f"dtype: {n} greedy requests; {cpu_model()}, {os.cpu_count()} CPUs; native bf16 matmul: {native}", flush=True)

    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, **SETTINGS)
        try:
            print(f"{dtype}: generating ...", flush=True)
            results[dtype] = run(llm, prompts, lengths)
            if dtype == "bfloat16":
                ranks = teacher_forced_ranks(llm, prompts, results["float32"][0])
        finally:
            llm.shutdown()

    (f32, f32_tps), (bf16, bf16_tps) = results["float32"], results["bfloat16"]
    identical = sum(a == b for a, b in zip(f32, bf16))
    before_first_diff = 0
    for a, b in zip(f32, bf16):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        before_first_diff += same
    total = sum(lengths)
    top1 = sum(r == 1 for r in ranks) / len(ranks)
    top2 = sum(r <= 2 for r in ranks) / len(ranks)
    rows = [
        Row("greedy output tok/s, bfloat16 vs float32", f"{bf16_tps:.1f}", f"{f32_tps:.1f}", f"{bf16_tps / f32_tps:.2f}x"),
        Row("requests with output identical to float32's", f"{identical}/{n}"),
        Row("output tokens before the first difference", f"{before_first_diff / total:.1%}"),
        Row("teacher-forced: float32's token is bf16's top-1 / top-2", f"{top1:.2%} / {top2:.2%}"),
    ]
    print(f"\n{'figure':<58} | {'bf16':>10} | {'float32':>8} | ratio")
    for r in rows:
        print(f"{r.figure:<58} | {r.ours:>10} | {r.peer:>8} | {r.ratio}")
    notes = [f"e2e greedy workload, {n} requests, prompts {prompt_len[0]}-{prompt_len[1]}, outputs "
             f"{out_len[0]}-{out_len[1]}, {total} output tokens; native bf16 matmul (packed): {native}"]
    emit("dtype", rows, notes=notes)


if __name__ == "__main__":
    main()
