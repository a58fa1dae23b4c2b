"""What one layer's attention costs through the paged KV cache: decode, then prefill.

Run: ``python tests/bench/paged_attention.py [--quick]``. SmolLM2-135M's attention
shape (9 query heads, 3 KV heads, head dim 64, float32), a decode batch of 64 rows, each
row ``L`` tokens deep, blocks of 16 scattered over the pool:

- kernel: the compiled CPU kernel (``worker/cpu/csrc/paged_attention.cpp``) reading the
  blocks in place;
- gather: the torch path (``worker/runner/attention._batched_by_gathering``: copy each row's
  blocks out of the pool, then one SDPA call), the reference and the fallback;
- dense: SDPA over keys already contiguous per row (``[B, kv_heads, L, D]``), which is
  what the pre-paged cache gave the attention; the floor of the layout we left.

Then one prefill chunk of 512 tokens (fresh, and after 512 cached), cut into kernel
rows as the engine does (``KernelRows``), against SDPA with the causal mask over the
same keys laid out contiguously (the best the torch path could do without a gather).

Medians of interleaved rounds on torch's default threads.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _results import Row, emit  # noqa: E402
from _timing import time_side_by_side  # noqa: E402

from worker.cpu.kernels import load  # noqa: E402
from worker.cpu.paged_attention import PREFILL_QUERIES as KERNEL_PREFILL_QUERIES  # noqa: E402
from worker.cpu.paged_attention import CpuPagedKernel, KernelRows
from worker.runner.attention import _batched_by_gathering  # noqa: E402
from worker.runner.attention_plan import AttentionPlan  # noqa: E402
from worker.runner.kv_pool import PagedKVCache  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def cases(batch: int, depth: int, kernel: CpuPagedKernel) -> dict:
    rng = np.random.default_rng(0)
    blocks_per_row = -(-depth // BLOCK)
    num_blocks = batch * blocks_per_row + 8
    cache = PagedKVCache(1, num_blocks, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    # Scattered blocks, as a pool that has served a while hands them out.
    table = rng.permutation(num_blocks)[: batch * blocks_per_row].astype(np.int32).reshape(batch, blocks_per_row)
    lens = np.full(batch, depth)
    plan = AttentionPlan.build(cache, np.arange(batch), lens - 1, np.ones(batch, np.int64), table, torch.device("cpu"))
    q = torch.randn(batch, HEADS, DIM)
    scale = DIM**-0.5
    k_dense = torch.randn(batch, KV_HEADS, depth, DIM)
    v_dense = torch.randn(batch, KV_HEADS, depth, DIM)
    q_dense = q.view(batch, HEADS, 1, DIM)
    k_pool, v_pool = cache.keys[0], cache.values[0]
    out = {
        "gather": (lambda: _batched_by_gathering(q, k_pool, v_pool, plan, scale, None, None), None),
        "dense": (lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale, enable_gqa=True), None),
    }
    if kernel is not None:
        def run_kernel() -> torch.Tensor:
            return kernel.run(q, k_pool, v_pool, plan.batched_block_table, plan.batched_kv_lens,
                              plan.batched_query_lens, scale, None, None)

        out["kernel"] = (run_kernel, None)
        # The kernel and the torch path agree before anything is timed.
        ref = _batched_by_gathering(q, k_pool, v_pool, plan, scale, None, None)
        got = run_kernel()
        assert torch.allclose(ref, got, atol=1e-4, rtol=1e-4), (ref - got).abs().max()
    return out


def prefill_cases(chunk: int, cached: int, kernel: CpuPagedKernel) -> dict:
    rng = np.random.default_rng(1)
    total = chunk + cached
    blocks = -(-total // BLOCK)
    cache = PagedKVCache(1, blocks * 2 + 8, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    table = rng.permutation(blocks * 2 + 8)[:blocks].astype(np.int32)[None, :]
    runs = KernelRows.build(np.array([0]), np.array([0]), np.array([chunk]), np.array([total]), table, BLOCK,
                            KERNEL_PREFILL_QUERIES, torch.device("cpu"))
    q = torch.randn(chunk, HEADS, DIM)
    scale = DIM**-0.5
    ids = torch.from_numpy(table[0]).long()
    k = cache.keys[0][ids].transpose(0, 1).reshape(KV_HEADS, -1, DIM)[:, :total].unsqueeze(0).contiguous()
    v = cache.values[0][ids].transpose(0, 1).reshape(KV_HEADS, -1, DIM)[:, :total].unsqueeze(0).contiguous()
    mask = torch.arange(total)[None, :] <= (torch.arange(chunk) + cached)[:, None]
    q_dense = q.transpose(0, 1).unsqueeze(0)

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)

    out = {"dense": (dense, None)}
    if kernel is not None:
        def run_kernel() -> torch.Tensor:
            return kernel.run_packed(q, cache.keys[0], cache.values[0], runs.block_table, runs.kv_lens,
                                     runs.query_lens, runs.starts, scale, None, None)

        out["kernel"] = (run_kernel, None)
        got, ref = run_kernel(), dense()
        assert torch.allclose(ref, got, atol=1e-4, rtol=1e-4), (ref - got).abs().max()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, fewer depths")
    args = ap.parse_args()
    module = load()
    kernel = CpuPagedKernel(module) if module is not None else None
    depths = (128, 512) if args.quick else (128, 512, 2048)
    batch = 64
    rows: list[Row] = []
    print(f"decode attention, one layer, batch {batch}, {HEADS}/{KV_HEADS} heads, dim {DIM}, "
          f"{torch.get_num_threads()} threads (median ms)")
    print(f"{'depth':>6} {'kernel':>8} {'gather':>8} {'dense':>8}  kernel vs gather  kernel vs dense")
    for depth in depths:
        t = time_side_by_side(cases(batch, depth, kernel), warmup=3, repeat=7 if args.quick else 21)
        k = t.get("kernel")
        ks = f"{k * 1e3:8.2f}" if k else "     n/a"
        print(f"{depth:>6} {ks} {t['gather'] * 1e3:8.2f} {t['dense'] * 1e3:8.2f}  "
              + (f"{t['gather'] / k:15.1f}x {t['dense'] / k:15.1f}x" if k else ""))
        if k:
            rows.append(Row(f"decode attention b{batch} depth {depth}, kernel vs gather+SDPA",
                            f"{k * 1e3:.2f} ms", f"{t['gather'] * 1e3:.2f} ms", f"{t['gather'] / k:.1f}x"))
            rows.append(Row(f"decode attention b{batch} depth {depth}, kernel vs dense SDPA",
                            f"{k * 1e3:.2f} ms", f"{t['dense'] * 1e3:.2f} ms", f"{t['dense'] / k:.1f}x",
                            "paged no slower than dense", k <= t["dense"] * 1.1))
    print(f"\nprefill attention, one layer, a 512-token chunk in kernel rows of {KERNEL_PREFILL_QUERIES} (median ms)")
    print(f"{'cached':>6} {'kernel':>8} {'dense':>8}  kernel vs dense  kernel GFLOPS")
    for cached in (0, 512):
        t = time_side_by_side(prefill_cases(512, cached, kernel), warmup=3, repeat=7 if args.quick else 21)
        k = t.get("kernel")
        # the products a causal chunk needs: 4 * heads * dim per (query, visible key)
        flops = 4 * HEADS * DIM * sum(cached + i + 1 for i in range(512))
        if k:
            print(f"{cached:>6} {k * 1e3:8.2f} {t['dense'] * 1e3:8.2f}  {t['dense'] / k:14.1f}x  {flops / k / 1e9:12.0f}")
            rows.append(Row(f"prefill attention, 512-token chunk after {cached} cached, kernel vs dense causal SDPA",
                            f"{k * 1e3:.2f} ms ({flops / k / 1e9:.0f} GFLOPS)", f"{t['dense'] * 1e3:.2f} ms",
                            f"{t['dense'] / k:.1f}x"))
        else:
            print(f"{cached:>6} {'n/a':>8} {t['dense'] * 1e3:8.2f}")
    emit("paged_attention", rows, notes=[] if kernel else ["the kernel could not be built: only the torch path ran"])


if __name__ == "__main__":
    main()
