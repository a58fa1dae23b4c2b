"""SmolLM2-135M-Instruct end to end: ``LLM.chat``/``LLM.generate`` with 32 prompts over
two Ray workers, token for token against transformers ``generate``. The engine serves
the embedded Q4_1 file with its weights kept quantized; transformers runs the same
file dequantized (the cached float conversion)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM
from helpers import QUESTIONS, assert_greedy_equal, generate
from sampler.params import SamplingParams
from worker.runner.model_loader import default_model_path

pytestmark = pytest.mark.smollm2

TOPICS = ["the moon", "tea", "a river", "prime numbers"]
MAX_TOKENS = 16


def test_32_chat_prompts_over_two_workers_match_generate(ray_local):
    questions = QUESTIONS + [f"Tell me one fact about {t}." for t in TOPICS] * 6
    assert len(questions) == 32
    llm = LLM(num_workers=2, worker_num_cpus=1, max_num_seqs=16, max_model_len=512, max_num_batched_tokens=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
        assert llm.engine.model_name == "SmolLM2-135M-Instruct"
        assert all(w.scheduler.step_id > 0 for w in llm.engine.workers)
        for w in llm.engine.workers:  # quantized as the file is: 210 Q4_1 layers, the Q8_0 embedding
            assert w.info.quantized == {"gguf Q4_1": 210, "gguf Q8_0": 1}, w.info.quantized
    finally:
        llm.shutdown()
    reference = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    expected: dict[tuple[int, ...], list[int]] = {}  # 12 distinct prompts, repeats share
    for out in outs:
        ids, prompt = out.outputs[0].token_ids, out.prompt_token_ids
        assert len(ids) == MAX_TOKENS and out.outputs[0].finish_reason == "length"
        if tuple(prompt) not in expected:
            expected[tuple(prompt)] = generate(reference, prompt, MAX_TOKENS)
        assert_greedy_equal(reference, prompt, ids, expected[tuple(prompt)])
    assert "Paris" in outs[0].outputs[0].text
