"""LoRA adapters: a batch spread over distinct adapters against the same batch on the
base model, in one in-process worker (no Ray), rounds alternated.

    .venv/bin/python tests/bench/lora.py [--model PATH] [--rows 32] [--rounds 3]

The model defaults to the embedded SmolLM2-135M-Instruct (its Q4_1 file, weights kept
quantized: the adapters run in float beside them); adapters are random PEFT-format
folders of the model's shapes (rank 16 on q_proj and v_proj, or on all seven linears).
Prints output tok/s per configuration and the ratio to the base model, round by round
(median and spread), and an adapter's load time from disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_worker, prompts  # noqa: E402
from sampler.params import SamplingParams  # noqa: E402
from worker import LoRAAdapter  # noqa: E402
from worker_driver import MiniDriver  # noqa: E402

ATTENTION = ("q_proj", "v_proj")
ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, targets: dict[str, list[int]], modules: tuple[str, ...], rank: int, seed: int) -> str:
    """A random adapter in PEFT's format over ``targets`` (name -> [in, out])."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (n_in, n_out) in targets.items():
        if name.rsplit(".", 1)[-1] in modules:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}))
    return str(folder)


def run(worker, ps: list[list[int]], loras: list[LoRAAdapter | None], max_tokens: int, rows: int) -> float:
    driver = MiniDriver(worker.step, max_rows=rows, token_budget=512, chunk=512)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (p, lora) in enumerate(zip(ps, loras)):
        driver.submit(f"r{i}", p, params, lora=lora)
    t0 = time.perf_counter()
    done = driver.run()
    took = time.perf_counter() - t0
    return sum(len(r.output) for r in done.values()) / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = args.model  # None: the embedded model
    worker = make_worker(model, enable_lora=True, max_loras=32, max_cpu_loras=48, max_lora_rank=16,
                         max_num_seqs=args.rows, max_model_len=512)
    targets = worker._runner.lora.targets
    vocab = worker._runner.loaded.vocab_size
    ps = prompts(vocab, [args.prompt_tokens] * args.rows, seed=1)
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    qv = [write_adapter(root / f"qv{i}", targets, ATTENTION, 16, i) for i in range(32)]
    seven = [write_adapter(root / f"all{i}", targets, ALL_SEVEN, 16, 100 + i) for i in range(8)]

    def spread(paths: list[str], first_id: int) -> list[LoRAAdapter]:
        specs = [LoRAAdapter(id=first_id + i, name=f"a{first_id + i}", path=p) for i, p in enumerate(paths)]
        return [specs[i % len(specs)] for i in range(args.rows)]

    configs = {"8 adapters, q/v r16": spread(qv[:8], 1), "32 adapters, q/v r16": spread(qv, 1),
               "8 adapters, all seven r16": spread(seven, 100)}
    base = [None] * args.rows
    t0 = time.perf_counter()
    worker._runner.lora.adapter(configs["8 adapters, q/v r16"][0], set())
    load_ms = (time.perf_counter() - t0) * 1e3
    run(worker, ps, base, 4, args.rows)  # warm-up: every adapter loaded before the timed runs
    for loras in configs.values():
        run(worker, ps, loras, 4, args.rows)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, loras in configs.items():
            b = run(worker, ps, base, args.max_tokens, args.rows)
            a = run(worker, ps, loras, args.max_tokens, args.rows)
            results[name].append((a, b))
    print(f"model {model or 'SmolLM2-135M-Instruct (Q4_1, kept quantized)'}, {args.rows} rows x {args.prompt_tokens} prompt + {args.max_tokens} output tokens, "
          f"greedy, {args.rounds} rounds (base and adapters alternated)")
    print(f"{'configuration':30} {'adapters tok/s':>15} {'base tok/s':>11} {'ratio (min-max)':>20}")
    for name, pairs in results.items():
        ratios = [a / b for a, b in pairs]
        print(f"{name:30} {statistics.median(a for a, _ in pairs):15.1f} {statistics.median(b for _, b in pairs):11.1f} "
              f"{statistics.median(ratios):8.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"one adapter (q/v r16) read from disk and checked: {load_ms:.1f} ms")
    # The first request's time to first token (one row, one token out): on the base model,
    # with an adapter the worker holds, with one it reads now (each fresh one once).
    fresh = [write_adapter(root / f"fresh{i}", targets, ATTENTION, 16, 500 + i) for i in range(args.rounds)]
    ttft: dict[str, list[float]] = {"base model": [], "adapter loaded": [], "adapter not loaded yet": []}
    held = configs["8 adapters, q/v r16"][0]
    for i in range(args.rounds):
        for name, lora in (("base model", None), ("adapter loaded", held),
                           ("adapter not loaded yet", LoRAAdapter(id=900 + i, name=f"f{i}", path=fresh[i]))):
            ttft[name].append(1e3 / run(worker, ps[i + 1 : i + 2], [lora], 1, args.rows))
    print("first request's TTFT, one row (median ms): " + ", ".join(
        f"{name} {statistics.median(v):.1f}" for name, v in ttft.items()))


if __name__ == "__main__":
    main()
