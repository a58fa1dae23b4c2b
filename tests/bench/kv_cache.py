"""What the paged KV cache buys: concurrent sequences per pool, and prefill skipped by
prefix caching.

Run: ``python tests/bench/kv_cache.py [--quick]``.

- capacity: the e2e workload's shape (prompts 16-512 tokens, outputs 16-256,
  ``max_model_len`` 2048) through the real engine with a KV pool of 32768 tokens, on a
  tiny random Llama (the count depends on the pool and the workload, not on the model;
  the tiny one keeps it fast). The dense per-row cache this replaced reserved
  ``max_model_len`` positions per row: the same memory held 32768 / 2048 = 16 rows. The
  figure is the peak number of sequences holding KV at once (sampled from
  ``scheduler_stats`` every few ms), with ``max_num_seqs`` high enough not to bind.
- prefix reuse: SmolLM2 (the default model), 64 requests that share one ~400-token
  system prompt (each with its own ~20-token question, 16 tokens out), all arriving at
  once, prefix caching on against off in the same run: TTFT p50 / p90 and wall time.
  With caching the system prompt's full blocks are prefilled once (by the first
  request) and taken from the cache by the other 63.
- prefix lookup: the driver's full-hit lookup of one cached prompt (``chain`` its
  blocks' keys, ``cached_prefix``, ``take_cached``, then ``release``) at 1k, 4k, 16k and
  64k tokens (16-token blocks), best of several rounds, in time per block. Content keys
  are digests (O(block_size) each at any depth), so the time per block should not grow
  with the prompt; keys that nested every earlier key grew O(depth) per block and
  overflowed the recursion limit near 16k tokens.
Targets: capacity >= 4x the dense rows; TTFT p50 with caching >= 3x better; lookup time
per block at 64k tokens <= 1.5x that at 1k.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _results import Row, emit  # noqa: E402

from cluster import LLM  # noqa: E402
from cluster.block_manager import ROOT, BlockManager, model_salt  # noqa: E402
from sampler.params import SamplingParams  # noqa: E402

POOL_TOKENS = 32768
MAX_MODEL_LEN = 2048
LOOKUP_SIZES = (1024, 4096, 16384, 65536)
LOOKUP_BLOCK = 16


class PeakRunning:
    """Samples the engine's running-sequence count in a thread; ``peak`` is the max."""

    def __init__(self, llm: LLM, every_s: float = 0.002) -> None:
        self.llm, self.every_s, self.peak = llm, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.llm.engine.scheduler_stats().num_running)
            time.sleep(self.every_s)

    def __enter__(self) -> PeakRunning:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def capacity(quick: bool) -> tuple[int, int, float]:
    from tiny_model import build_tiny_model

    folder = build_tiny_model(Path(tempfile.gettempdir()) / "raydecode-bench-tiny-2k", max_position_embeddings=MAX_MODEL_LEN)
    rng = random.Random(0)
    n = 96 if quick else 256
    prompts = [[rng.randrange(10, 390) for _ in range(rng.randint(16, 512))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 256), ignore_eos=True) for _ in range(n)]
    llm = LLM(str(folder), max_num_seqs=256, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
              kv_cache_tokens=POOL_TOKENS, enable_prefix_caching=False)
    try:
        t0 = time.perf_counter()
        with PeakRunning(llm) as peak:
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return peak.peak, POOL_TOKENS // MAX_MODEL_LEN, wall


def prefix_reuse(quick: bool) -> dict[str, dict[str, float]]:
    rng = random.Random(1)
    vocab_lo, vocab_hi = 1000, 40000  # plain-word ids of SmolLM2's vocabulary
    system = [rng.randrange(vocab_lo, vocab_hi) for _ in range(400)]
    n = 16 if quick else 64
    prompts = [{"prompt_token_ids": system + [rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(15, 25))]}
               for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for name, caching in (("off", False), ("on", True)):
        llm = LLM(None, quantization="none", max_num_seqs=64, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512,
                  enable_prefix_caching=caching)
        try:
            llm.generate([{"prompt_token_ids": [rng.randrange(vocab_lo, vocab_hi) for _ in range(40)]}], params,
                         use_tqdm=False)  # warm-up, a prompt unrelated to the system prompt
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        finally:
            llm.shutdown()
        ttft = sorted(o.metrics.time_to_first_token for o in outs)
        results[name] = {
            "ttft_p50": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))], "wall": wall,
            "cached": sum(o.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs),
        }
    return results


def lookup(quick: bool) -> dict[int, float]:
    """Seconds per block of a full-hit prefix lookup, per prompt length in tokens."""
    rng = random.Random(2)
    rounds = 3 if quick else 10
    per_block = {}
    for size in LOOKUP_SIZES:
        n = size // LOOKUP_BLOCK
        tokens = [rng.randrange(100, 50_000) for _ in range(size)]
        bm = BlockManager(n, LOOKUP_BLOCK, salt=model_salt("bench", "float32"))
        blocks = bm.allocate(n)
        bm.register(blocks, bm.chain(ROOT, tokens))
        bm.release(blocks)
        best = float("inf")
        for _ in range(rounds):
            # at least ~64k tokens' worth of lookups per round, so small sizes time well
            reps = max(1, 65536 // size)
            t0 = time.perf_counter()
            for _ in range(reps):
                keys = bm.chain(ROOT, tokens)
                hit = bm.cached_prefix(keys)
                taken = bm.take_cached(keys[:hit])
                bm.release(taken)
            best = min(best, (time.perf_counter() - t0) / reps)
            assert hit == n and taken == blocks, "a full hit expected"
        per_block[size] = best / n
    return per_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--only", choices=("capacity", "prefix", "lookup"), default=None)
    args = ap.parse_args()
    rows: list[Row] = []
    if args.only in (None, "capacity"):
        peak, dense, wall = capacity(args.quick)
        print(f"capacity: pool {POOL_TOKENS} tokens, max_model_len {MAX_MODEL_LEN}: peak {peak} sequences "
              f"holding KV at once (paged) vs {dense} rows (dense): {peak / dense:.1f}x ({wall:.1f} s)")
        rows.append(Row(f"concurrent sequences in a {POOL_TOKENS}-token pool (e2e shapes), paged vs dense rows",
                        str(peak), str(dense), f"{peak / dense:.1f}x", ">= 4x", peak >= 4 * dense))
    if args.only in (None, "prefix"):
        r = prefix_reuse(args.quick)
        on, off = r["on"], r["off"]
        for name, v in r.items():
            print(f"prefix caching {name:>3}: TTFT p50 {v['ttft_p50'] * 1e3:7.0f} ms, p90 {v['ttft_p90'] * 1e3:7.0f} ms, "
                  f"wall {v['wall']:.2f} s, prompt tokens from cache {v['cached']:.0%}")
        ratio = off["ttft_p50"] / on["ttft_p50"]
        rows.append(Row("shared 400-token system prompt x64: TTFT p50, caching on vs off",
                        f"{on['ttft_p50'] * 1e3:.0f} ms", f"{off['ttft_p50'] * 1e3:.0f} ms", f"{ratio:.1f}x",
                        ">= 3x", ratio >= 3))
        rows.append(Row("shared 400-token system prompt x64: wall, caching on vs off",
                        f"{on['wall']:.2f} s", f"{off['wall']:.2f} s", f"{off['wall'] / on['wall']:.1f}x"))
    if args.only in (None, "lookup"):
        per_block = lookup(args.quick)
        for size, t in per_block.items():
            print(f"prefix lookup, full hit: {size:>6} tokens ({size // LOOKUP_BLOCK:>5} blocks): "
                  f"{t * 1e6:6.2f} us per block, {t * size / LOOKUP_BLOCK * 1e3:8.3f} ms in all")
        small, large = per_block[LOOKUP_SIZES[0]], per_block[LOOKUP_SIZES[-1]]
        ratio = large / small
        for size, t in per_block.items():
            rows.append(Row(f"full-hit prefix lookup (chain, cached_prefix, take_cached, release), "
                            f"{size // 1024}k tokens: per block", f"{t * 1e6:.2f} us"))
        rows.append(Row(f"full-hit prefix lookup per block, {LOOKUP_SIZES[-1] // 1024}k vs "
                        f"{LOOKUP_SIZES[0] // 1024}k tokens", f"{large * 1e6:.2f} us", f"{small * 1e6:.2f} us",
                        f"{ratio:.2f}x", "<= 1.5x", ratio <= 1.5))
    emit("kv_cache", rows, notes=["peer column: the dense per-row cache's rows (capacity) / prefix caching off (TTFT) / "
                                "the 1k-token lookup (prefix lookup)"])


if __name__ == "__main__":
    main()
