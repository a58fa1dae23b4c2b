"""The CUDA path, on a GPU (``pytest -m cuda``; ``tests/gpu_check.py`` runs these on the
GPU machine; elsewhere they are collected and skipped with the reason).

- the sampler on CUDA against the independent one-row reference (processed logprobs,
  support, greedy tokens, the empirical distribution of random rows);
- FlexAttention compiled for CUDA against the torch path, over shapes that change from
  call to call (decodes, drafts, prefill chunks, shared prefixes, grouped heads, bf16);
- the model runner on CUDA against transformers' greedy ``generate`` on the same GPU:
  exactly in float32 (the tiny model and a random-weight Llama of about 1B parameters,
  up to a near-tie), and in bfloat16 as close to the float32 model as transformers'
  own bf16 forward is (log-probabilities of each position's top 5, teacher forced);
- CUDA graphs for decode steps against the eager forward;
- ``LLM`` end to end with the worker actor on the GPU (one GPU through Ray): prefix
  caching, n > 1, logprobs, a JSON-schema constraint; a killed GPU worker replaced on the
  same GPU with nothing lost.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sampler.params import SamplingParams

pytestmark = pytest.mark.cuda

VOCAB_TINY = 400
#: how much further from float32 ours in bf16 may be than transformers' own bf16 forward
BF16_NOISE_FACTOR = 2.0


@pytest.fixture(scope="module")
def llama_1b() -> str:
    """The random ~1B Llama, built once per machine (the benchmark reads the same folder)."""
    from tiny_model import build_random_llama

    folder = os.environ.get("RAYDECODE_GPU_MODEL_DIR", "/tmp/raydecode-llama-1b")
    return str(build_random_llama(folder))


def _hf(path: str, dtype: torch.dtype, device: str = "cuda"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens (EOS neither stops nor is banned)."""
    ids = torch.tensor([prompt], device="cuda")
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids), return_dict_in_generate=True)
    finally:
        model.generation_config = saved
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == n
    return tokens


def _logprobs_along(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The model's log-softmax at every position of ``continuation`` (teacher forced)."""
    ids = torch.tensor([prompt + continuation], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1)


def _run_worker(path: str, prompts: list[list[int]], n: int, logprobs: int | None = None, device: str = "cuda",
                graphs_expected: bool | None = None,
                **config) -> dict[str, list[int]] | dict[str, tuple[list[int], list]]:
    """Greedy tokens of each prompt from the in-process worker on CUDA (with
    ``logprobs``: (tokens, per token (top ids, their logprobs, rank)));
    ``graphs_expected``: whether its decode steps must replay CUDA graphs."""
    from helpers import make_worker
    from worker_driver import MiniDriver

    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_model_len", 512)
    w = make_worker(path, device=device, **config)
    assert w._runner.device.type == device
    if graphs_expected is not None:
        assert (w._runner.graphs is not None) == graphs_expected
    d = MiniDriver(w.step, max_rows=8, token_budget=256, chunk=64, num_blocks=w._runner.kv.num_blocks)
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    for i, p in enumerate(prompts):
        d.submit(f"r{i}", p, greedy, arrival_step=i)
    done = d.run()
    if graphs_expected:  # they stayed on and replayed
        assert w._runner.graphs.unusable is None and w._runner.graphs.graphs
    if logprobs is None:
        return {rid: r.output for rid, r in done.items()}
    return {rid: (r.output, r.logprobs) for rid, r in done.items()}


def _random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# -- the sampler --------------------------------------------------------------------------


def test_the_sampler_on_cuda_equals_the_reference():
    from reference_sampler import reference_row, tv_distance
    from sampler.config import SamplerConfig
    from sampler.metadata import SamplingMetadata
    from sampler.sampler import Sampler

    vocab = 1000
    g = torch.Generator().manual_seed(3)
    knobs = [
        dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.7),
        dict(temperature=0.7, min_p=0.05), dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4),
        dict(temperature=0.0, presence_penalty=1.5, logit_bias={5: 3.0}), dict(temperature=1.2, top_k=50, top_p=0.9),
        dict(temperature=0.0, bad_words_token_ids=[[7], [3, 9]], allowed_token_ids=list(range(0, 500))),
    ]
    params = [SamplingParams(**k, logprobs=-1) for k in knobs]
    prompts = [torch.randint(0, vocab, (12,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(0, vocab, (6,), generator=g).tolist() + [3] for _ in params]
    logits = torch.randn(len(params), vocab, generator=g) * 3
    config = SamplerConfig(vocab_size=vocab, max_num_seqs=len(params), max_logprobs=-1)
    md = SamplingMetadata.from_requests(params, prompts, [list(o) for o in outputs], vocab, "cuda", config=config)
    out = Sampler(None, logprobs_mode="processed_logprobs")(logits.cuda(), md)
    lt = out.logprobs_tensors
    for i in range(len(params)):
        ref = reference_row(logits[i], params[i], prompts[i], outputs[i])
        got = torch.full((vocab,), float("-inf"))
        got[lt.token_ids[i, 1:].cpu()] = lt.logprobs[i, 1:].float().cpu()
        want = torch.tensor(ref.processed_logprobs, dtype=torch.float32)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), f"row {i}: a different support"
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4, msg=f"row {i}")
        token = out.sampled_token_ids[i].item()
        if ref.is_greedy:
            assert token == ref.greedy_token, f"greedy row {i}"
        else:
            assert token in ref.support, f"random row {i}"
    # The sampling distribution itself: 20,000 draws of two random rows.
    draws = 10_000
    rows = [1, 6]
    many = [params[r] for r in rows for _ in range(draws)]
    big = logits[rows].repeat_interleave(draws, 0).cuda()
    md = SamplingMetadata.from_requests(
        [SamplingParams(**{k: v for k, v in knobs[r].items()}) for r in rows for _ in range(draws)],
        [prompts[r] for r in rows for _ in range(draws)], [list(outputs[r]) for r in rows for _ in range(draws)],
        vocab, "cuda", config=SamplerConfig(vocab_size=vocab, max_num_seqs=len(many)))
    tokens = Sampler(None)(big, md).sampled_token_ids.cpu().view(len(rows), draws)
    for j, r in enumerate(rows):
        ref = reference_row(logits[r], params[r], prompts[r], outputs[r])
        counts = torch.bincount(tokens[j], minlength=vocab).double() / draws
        assert tv_distance(counts.tolist(), ref.probs) < 0.05, f"row {r}: the draws do not follow the reference"


# -- FlexAttention --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_on_cuda_equals_the_torch_path(dtype):
    """Shapes that change from call to call, as steps do: one compile (dynamic shapes)
    per window must serve them all, each equal to the gather + SDPA path (sliding
    windows of 40 and 64 among them)."""
    from helpers import random_paged_case
    from worker.gpu.flex_attention import FlexPagedAttention
    from worker.runner.attention import attend_cached
    from worker.runner.attention_plan import AttentionPlan

    shapes = [([1] * 7, 60, 0, None), ([1, 3, 1, 40], 50, 2, None), ([90, 17], 9, 0, None), ([1] * 33, 300, 1, None),
              ([16, 1, 200], 0, 3, None), ([1] * 9, 120, 1, 40), ([1, 200, 3], 30, 2, 64)]
    for seed, (q_lens, depth, shared, window) in enumerate(shapes):
        cache, rows, cached, lens, table, q = random_paged_case(seed, q_lens, depth, 2, 4, 64, 16, dtype, shared)
        cache.keys[0] = cache.keys[0].cuda()
        cache.values[0] = cache.values[0].cuda()
        q = q.cuda()
        device = torch.device("cuda")
        flex = FlexPagedAttention(8, 2)
        flex.windows.add(window)
        plan = AttentionPlan.build(cache, rows, cached, lens, table, device, flex)
        got = attend_cached(q, plan, 0, 0.125, window, None)
        assert flex.declined == 0
        want = attend_cached(q.float(), AttentionPlan.build(_float(cache), rows, cached, lens, table, device),
                             0, 0.125, window, None)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=f"shape {seed}: {q_lens}")


def test_a_plan_built_on_the_host_equals_one_built_on_the_gpu():
    """A CUDA graph's refill builds each decode step's plan on the host (``on_host``),
    shaped for CUDA, and copies it in: tensor for tensor it equals the plan built on the
    GPU, and the block positions the mask function reads arrive on the GPU."""
    from helpers import random_paged_case
    from worker.gpu.cuda_graphs import _plan_tensors
    from worker.gpu.flex_attention import FlexPagedAttention
    from worker.runner.attention_plan import AttentionPlan

    cache, rows, cached, lens, table, _ = random_paged_case(3, [1] * 9, 70, 2, 4, 64, 16, torch.bfloat16, 2)
    device = torch.device("cuda")
    on_gpu, on_host = FlexPagedAttention(8, 2), FlexPagedAttention(8, 2)
    want = AttentionPlan.build(cache, rows, cached, lens, table, device, on_gpu, static=True)
    got = AttentionPlan.build(cache, rows, cached, lens, table, device, on_host, static=True, on_host=True)
    assert got.device == device and got.token_positions.device.type == "cpu"
    pairs = list(zip(_plan_tensors(got), _plan_tensors(want), strict=True))
    for i, (g, w) in enumerate(pairs):
        assert g.shape == w.shape and g.dtype == w.dtype, f"tensor {i}"
        assert torch.equal(g, w.cpu()), f"tensor {i}"
    torch.cuda.synchronize()
    assert on_host._block_logical.device.type == "cuda"
    torch.testing.assert_close(on_host._block_logical, on_gpu._block_logical)


def _float(cache):
    from worker.runner.kv_pool import PagedKVCache

    exact = PagedKVCache(1, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.keys[0].shape[-1],
                         torch.float32, torch.device("cuda"))
    exact.keys[0].copy_(cache.keys[0].float())
    exact.values[0].copy_(cache.values[0].float())
    return exact


# -- the model runner against transformers ------------------------------------------------------


def _assert_greedy_equal_fp32(model, prompts: list[list[int]], ours: dict[str, list[int]], n: int) -> int:
    """Ours equals transformers token for token, up to a near-tie (a top-2 gap under 1e-4
    in the reference's logits at the first difference). Returns near-ties seen."""
    near = 0
    for i, p in enumerate(prompts):
        ref = _hf_greedy(model, p, n)
        at = _first_difference(ours[f"r{i}"], ref)
        if at is None:
            continue
        lp = _logprobs_along(model, p, ref[: at + 1])[at]
        top2 = torch.topk(lp, 2).values
        gap = float(top2[0] - top2[1])
        assert gap < 1e-4, f"prompt {i}: ours differs from transformers at token {at} (top-2 gap {gap:.3g})"
        near += 1
    return near


def test_the_runner_on_cuda_gives_transformers_greedy_tokens_tiny_float32(tiny_model_path):
    prompts = _random_prompts(VOCAB_TINY, [5, 37, 80, 130, 9, 64], seed=1)
    ours = _run_worker(tiny_model_path, prompts, 24, dtype="float32")
    _assert_greedy_equal_fp32(_hf(tiny_model_path, torch.float32), prompts, ours, 24)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_a_sliding_window_model_on_cuda_gives_transformers_greedy_tokens(tmp_path, arch):
    """Sliding windows through FlexAttention, decode steps on CUDA graphs (Mistral: every
    layer windowed; Gemma 2: windowed and global layers, soft-capped logits)."""
    from tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path / arch, arch=arch))
    prompts = _random_prompts(VOCAB_TINY, [5, 37, 80, 9], seed=3)
    ours = _run_worker(path, prompts, 24, dtype="float32", graphs_expected=True)
    _assert_greedy_equal_fp32(_hf(path, torch.float32), prompts, ours, 24)


def test_the_runner_on_cuda_gives_transformers_greedy_tokens_1b_float32(llama_1b):
    prompts = _random_prompts(32000, [7, 100, 260, 33], seed=2)
    ours = _run_worker(llama_1b, prompts, 20, dtype="float32")
    near = _assert_greedy_equal_fp32(_hf(llama_1b, torch.float32), prompts, ours, 20)
    print(f"[1B float32] near-ties: {near} of {len(prompts)} prompts")


def test_the_runner_in_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16(llama_1b):
    """bf16 differs from float32 by its rounding, whoever computes it: ours in bf16 must
    stay as close to the float32 truth as transformers' own bf16 forward does."""
    prompts = _random_prompts(32000, [7, 100, 260, 33, 150, 12], seed=4)
    ours = _run_worker(llama_1b, prompts, 20, logprobs=5, dtype="bfloat16")
    errors = bf16_errors(llama_1b, prompts, ours, "cuda")
    print(f"[1B bfloat16] {errors}")
    errors.check()


@dataclass
class Bf16Errors:
    """Log-probability errors against the float32 model, over every generated position
    and its top 5 tokens in ours (teacher forced along our tokens, so each position has
    the context ours had): ours in bf16, and transformers' bf16 forward (the baseline:
    the rounding bf16 brings on its own). ``regret``: how far below float32's best our
    greedy token is, at most."""

    ours: list[float]
    theirs: list[float]
    regret: float

    def check(self) -> None:
        ours, theirs = np.array(self.ours), np.array(self.theirs)
        assert np.median(ours) <= BF16_NOISE_FACTOR * np.median(theirs), self
        assert ours.max() <= BF16_NOISE_FACTOR * theirs.max(), self
        assert self.regret <= BF16_NOISE_FACTOR * theirs.max(), self

    def __str__(self) -> str:
        ours, theirs = np.array(self.ours), np.array(self.theirs)
        return (f"|logprob - float32| median / p99 / max: ours {np.median(ours):.4f} / {np.quantile(ours, 0.99):.4f} / "
                f"{ours.max():.4f}, transformers bf16 {np.median(theirs):.4f} / {np.quantile(theirs, 0.99):.4f} / "
                f"{theirs.max():.4f}; our greedy token at most {self.regret:.4f} below float32's best")


def bf16_errors(path: str, prompts: list[list[int]], ours: dict, device: str) -> Bf16Errors:
    exact, rounded = _hf(path, torch.float32, device), _hf(path, torch.bfloat16, device)
    mine, theirs, regret = [], [], 0.0
    for i, p in enumerate(prompts):
        tokens, logprobs = ours[f"r{i}"]
        lp32, lp16 = _logprobs_along(exact, p, tokens).cpu(), _logprobs_along(rounded, p, tokens).cpu()
        for j, (ids, vals, _) in enumerate(logprobs):
            top = torch.tensor(ids[1:])  # ours: the sampled token first, then the top 5
            mine += (torch.tensor(vals[1:]) - lp32[j, top]).abs().tolist()
            theirs += (lp16[j, top] - lp32[j, top]).abs().tolist()
            regret = max(regret, float(lp32[j].max() - lp32[j, tokens[j]]))
    return Bf16Errors(mine, theirs, regret)


def test_cuda_graphs_equal_the_eager_forward(llama_1b):
    """Decode steps replayed from CUDA graphs (buckets 1-8 as rows join and leave; the
    default on CUDA) give the eager forward's tokens."""
    prompts = _random_prompts(32000, [7, 100, 33, 12, 60], seed=5)
    eager = _run_worker(llama_1b, prompts, 24, dtype="bfloat16", cuda_graphs=False, graphs_expected=False)
    # transformers' norms on both sides: compiled ones round bf16 differently (their
    # accuracy is the bf16 test's, which runs with them)
    graphs = _run_worker(llama_1b, prompts, 24, dtype="bfloat16", graphs_expected=True, compiled_norms=False)
    assert graphs == eager


# -- LLM with the worker actor on the GPU -----------------------------------------------------


@pytest.fixture(scope="module")
def gpu_llm(tiny_model_path, ray_local):
    from cluster import LLM

    assert ray_local.cluster_resources().get("GPU", 0) >= 1, "Ray sees no GPU"
    llm = LLM(tiny_model_path, num_workers=1, dtype="float32", max_model_len=512, max_num_seqs=16)
    yield llm
    llm.shutdown()


def test_llm_runs_its_worker_on_the_gpu(gpu_llm, tiny_model_path):
    import jsonschema

    engine = gpu_llm.engine
    assert all(slot.info.device.startswith("cuda") for slot in engine.workers if slot.live)
    prompts = _random_prompts(VOCAB_TINY, [40, 70, 18], seed=7)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    first = gpu_llm.generate(prompts, greedy, use_tqdm=False)
    again = gpu_llm.generate(prompts, greedy, use_tqdm=False)  # the prompts' blocks are cached now
    model = _hf(tiny_model_path, torch.float32)
    for i, (a, b) in enumerate(zip(first, again)):
        assert b.num_cached_tokens >= 16 * ((len(prompts[i]) - 1) // 16), f"prompt {i}: no prefix-cache hit"
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = a.outputs[0].logprobs
        assert len(lp) == 16
    _assert_greedy_equal_fp32(model, prompts, {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(first)}, 16)
    sampled = gpu_llm.generate(prompts[:1], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12,
                                                           ignore_eos=True), use_tqdm=False)[0]
    assert len(sampled.outputs) == 3 and len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    constrained = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={
        "json": schema, "disable_any_whitespace": True})
    out = gpu_llm.generate(["hello"], constrained, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), schema)


def test_a_killed_gpu_worker_is_replaced_on_the_same_gpu_and_nothing_is_lost(gpu_llm):
    engine = gpu_llm.engine
    prompts = _random_prompts(VOCAB_TINY, [30, 50, 12, 80, 25, 44], seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, seed=100 + i, max_tokens=64, ignore_eos=True) for i in range(len(prompts))]
    reference = [o.outputs[0].token_ids for o in gpu_llm.generate(prompts, params, use_tqdm=False)]
    killed = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"k{i}", p, sp)
    finals = {}
    end = time.monotonic() + 300
    while engine.has_unfinished_requests():
        assert time.monotonic() < end, f"not done: {len(finals)} finished; {engine.health()}"
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not killed:
            for slot in engine.workers:
                started = [s for s in (slot.scheduler.running if slot.scheduler else []) if s.output_token_ids]
                if slot.live and slot.pid and len(started) >= 3:
                    killed.append(slot.pid)
                    os.kill(slot.pid, signal.SIGKILL)
                    break
    assert killed, "no worker was killed"
    assert [finals[f"k{i}"].outputs[0].token_ids for i in range(len(prompts))] == reference
    live = [slot for slot in engine.workers if slot.live]
    assert live and live[0].pid not in killed and live[0].info.device.startswith("cuda")
