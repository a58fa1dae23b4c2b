"""Output throughput against batch size: ours and the two transformers peers, one run.

Run: ``python tests/bench/throughput.py [--quick] [--batches 1 4 16 64] [--tokens 64]``.

For each batch size B: B greedy requests (prompts of 32-96 tokens cut from the e2e
corpus, ``--tokens`` output tokens each, EOS ignored) all arriving at once, through

  ours      ``LLM.generate`` (one worker with every CPU, max_num_seqs 64)
  static    ``model.generate`` on the one left-padded batch of B
  cb        transformers' continuous batching (the engine behind ``generate_batch``,
            driven through its manager as in e2e.py) with B rows and ours' token budget

SmolLM2-135M float32 everywhere. Output tokens / wall seconds; the series go to the
plot ``raydecode bench`` draws (throughput.png).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ray  # noqa: E402
import torch  # noqa: E402
from _results import Row, emit  # noqa: E402
from e2e import Req, Result, corpus_tokens, generate_padded, guarded, run_cb, run_ours  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from cluster.llm import LLM  # noqa: E402
from worker.runner.model_loader import default_model_path  # noqa: E402

SYSTEMS = ("ours (LLM.generate)", "model.generate (static batch)", "generate_batch CB manager")


def requests(stream: list[int], batch: int, tokens: int) -> list[Req]:
    rng = random.Random(batch)
    out = []
    for i in range(batch):
        length = rng.randint(32, 96)
        start = rng.randrange(0, len(stream) - length)
        out.append(Req(stream[start:start + length], tokens, True, i))
    return out


def run_static_one_batch(model, pad: int, reqs: list[Req]) -> Result:
    start = time.perf_counter()
    generate_padded(model, pad, reqs)
    return Result(time.perf_counter() - start, sum(r.max_tokens for r in reqs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, 16 tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.quick:
        args.batches, args.tokens = [1, 4], 16
    torch.set_num_threads(os.cpu_count() or 1)
    path = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    stream = corpus_tokens(tok)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    llm = LLM(model=None, quantization="none", num_workers=1, max_num_seqs=max(64, *args.batches), max_model_len=256)
    budget = llm.engine.config.max_num_batched_tokens
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config = copy.deepcopy(model.generation_config)
    model.generation_config.eos_token_id = None
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    warm = requests(stream, 2, 4)
    run_ours(llm, warm)
    generate_padded(model, pad, warm)

    series: dict[str, dict[int, float]] = {s: {} for s in SYSTEMS}
    rows: list[Row] = []
    print(f"output tok/s vs batch size, {args.tokens} greedy tokens per request, SmolLM2-135M float32")
    print(f"{'batch':>5} | " + " | ".join(f"{s:>30}" for s in SYSTEMS) + " | ours/static | ours/CB")
    for batch in args.batches:
        reqs = requests(stream, batch, args.tokens)
        results = [
            run_ours(llm, reqs),
            guarded(lambda: run_static_one_batch(model, pad, reqs)),  # noqa: B023 (called here)
            guarded(lambda: run_cb(model, reqs, "manager", batch, budget)),  # noqa: B023
        ]
        for system, res in zip(SYSTEMS, results):
            if not res.error:
                series[system][batch] = res.tps
        ours = results[0].tps
        ratios = [ours / r.tps if not r.error else float("nan") for r in results[1:]]
        print(f"{batch:>5} | " + " | ".join(f"{r.tps:>30.1f}" if not r.error else f"{'n/a':>30}" for r in results)
              + f" | {ratios[0]:>10.2f}x | {ratios[1]:>6.2f}x")
        for label, res, ratio in zip(("model.generate static batch", "generate_batch CB"), results[1:], ratios):
            rows.append(Row(f"output tok/s at batch {batch} vs {label}", f"{ours:.1f}",
                            f"{res.tps:.1f}" if not res.error else "could not run",
                            f"{ratio:.2f}x" if not res.error else "-"))
    emit("throughput", rows, series=series,
         series_label=f"SmolLM2-135M float32, greedy, {args.tokens} output tokens per request, CPU")
    llm.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
