"""Draft-model speculative decoding on this CPU: SmolLM2-135M in float32 (the target)
with drafts of its own weights quantized, against the same target without drafts.

Run: ``python tests/bench/draft_model.py [--quick] [--rows 1 4] [--rounds 3]
[--temperature 0 0.7] [--drafts self-int8-3 self-int4-3 ...]``.

The in-process worker (no Ray, no HTTP) answers SmolLM2's chat questions (its own real
text, ``--max-tokens`` each, EOS ignored), ``rows`` at a time; each configuration in
turn, rounds alternating. Per configuration and row count: output tokens per second,
its ratio to no drafting (median over rounds, with the spread), the acceptance rate
(accepted / proposed draft tokens) and the tokens each target step emits. Drafts:

- ``self-int8-K`` / ``self-int4-K``: ``model: "self"`` quantized at load, K tokens (int4
  at its default, groups of 96-128 symmetric);
- ``self-int4g32a-K``: int4 in groups of 32, asymmetric, the shape of the Q4_1 file the
  float weights were dequantized from: it reproduces those blocks (an artefact: nearly
  every draft is accepted);
- ``q41-K``: the shipped Q4_1 GGUF file itself as the draft (the same artefact);
- ``ngram-K``: prompt lookup, for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _results import Row, emit, machine  # noqa: E402


def draft_configs(names: list[str]) -> dict[str, dict]:
    from worker.runner.model_loader import default_model_file

    configs: dict[str, dict] = {"none": {}}
    for name in names:
        kind, k = name.rsplit("-", 1)
        spec: dict = {"num_speculative_tokens": int(k), "disable_by_batch_size": 1_000}
        if kind == "ngram":
            spec["method"] = "ngram"
        elif kind == "q41":
            spec.update(method="draft_model", model=str(default_model_file()))
        else:
            scheme = kind.removeprefix("self-")
            spec.update(method="draft_model", model="self", quantization=scheme[:4])
            if scheme == "int4g32a":
                spec["quantization_config"] = {"group_size": 32, "symmetric": False}
        configs[name] = {"speculative_config": spec}
    return configs


def chat_prompts(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from helpers import QUESTIONS
    from worker.runner.model_loader import default_model_path

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def run_once(worker, ps: list[list[int]], rows: int, temperature: float, max_tokens: int) -> tuple[float, int, int, int]:
    """(seconds, target steps, drafts proposed, drafts accepted) answering ``ps``."""
    from sampler.params import SamplingParams
    from worker_driver import MiniDriver

    worker.reset()  # the last run's rows go
    d = MiniDriver(worker.step, max_rows=rows, token_budget=512, chunk=512)
    for i, p in enumerate(ps):
        d.submit(f"q{i}", p, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                            seed=i if temperature else None))
    t0 = time.perf_counter()
    done = d.run()
    return (time.perf_counter() - t0, d.step_id, sum(r.num_drafts for r in done.values()),
            sum(r.num_accepted for r in done.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round, 1 row, fewer tokens")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--drafts", nargs="+", default=["self-int8-3", "self-int4-3", "self-int4g32a-4", "q41-4"])
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.rows, args.max_tokens = 1, [1], 32
    from helpers import make_worker

    configs = draft_configs(args.drafts)
    workers = {name: make_worker(None, quantization="none", max_num_seqs=max(args.rows), max_model_len=1024, **c)
               for name, c in configs.items()}
    print(f"# {machine()}")
    rows_out: list[Row] = []
    for rows in args.rows:
        ps = chat_prompts(max(rows, 3) if rows == 1 else 2 * rows)
        for temperature in args.temperature:
            results: dict[str, list[tuple[float, int, int, int]]] = {name: [] for name in configs}
            for w in workers.values():  # warm up
                run_once(w, ps[:1], 1, temperature, 8)
            for _ in range(args.rounds):
                for name, w in workers.items():
                    results[name].append(run_once(w, ps, rows, temperature, args.max_tokens))
            tokens = len(ps) * args.max_tokens
            base = [tokens / r[0] for r in results["none"]]
            print(f"\n{rows} row(s), temperature {temperature}: {len(ps)} answers of {args.max_tokens} tokens")
            print(f"{'config':18s} {'tok/s':>7s} {'vs none':>16s} {'accepted':>9s} {'tok/step':>8s}")
            for name, runs in results.items():
                rate = [tokens / r[0] for r in runs]
                ratios = sorted(a / b for a, b in zip(rate, base))
                drafted, accepted = sum(r[2] for r in runs), sum(r[3] for r in runs)
                per_step = statistics.median(tokens / r[1] for r in runs)
                acc = f"{accepted / drafted:.0%}" if drafted else "-"
                spread = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
                print(f"{name:18s} {statistics.median(rate):7.1f} {spread:>16s} {acc:>9s} {per_step:8.2f}")
                if name != "none":
                    rows_out.append(Row(f"draft {name}, {rows} row(s), T={temperature}: tok/s",
                                        f"{statistics.median(rate):.1f}", f"{statistics.median(base):.1f}",
                                        f"{statistics.median(ratios):.2f}x"))
    emit("draft_model", rows_out)


if __name__ == "__main__":
    main()
