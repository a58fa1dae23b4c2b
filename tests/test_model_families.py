"""The model-family registry (``worker/runner/families.py``) held to its claims.

- Every decoder-only type of transformers' causal-LM registry has an entry, and
  ``docs/usage.md``'s table is the registry's own.
- The sweep (slow tier): a tiny random model of every family the registry serves, built
  from transformers' config, through an in-process worker (chunked prefill, batched
  decodes, three requests arriving at different steps), greedy tokens equal to
  transformers' ``generate`` (near-ties allowed).
- Every family it refuses is refused from its config alone, before weights load, with
  the missing feature named; a hybrid's non-attention layers are found from any
  config's ``layer_types``; a model whose layers attend by their own code is refused at
  the load's probe.
- Multi-head latent attention against transformers' DeepSeek-V3 attention module,
  hypothesis over cached lengths, chunk lengths and block sizes; its pool holds the
  latent and rotary key, one row a token.
- On-the-fly int8 on the fused families (a mixture of experts' experts included)
  against transformers with every weight replaced by its int8 dequantization.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from helpers import generate, make_worker, prompts
from hypothesis_budget import examples
from sampler.params import SamplingParams
from tiny_model import build_tiny_model, save_random_model
from worker.cpu.fused_decoder import FAMILIES as FUSED
from worker.parallel.sharded_loader import SHARDABLE
from worker.runner.attention_plan import AttentionPlan
from worker.runner.families import (
    FAMILIES,
    FAST,
    REFUSED,
    UnsupportedModel,
    check_family,
    fast_families,
    parallel_families,
    support_table,
)
from worker.runner.kv_pool import PagedKVCache, kv_layout
from worker.runner.latent_attention import install_latent_attention
from worker.runner.model_loader import ModelLoadError
from worker_driver import MiniDriver, greedy_divergence

DOCS = Path(__file__).resolve().parent.parent / "docs" / "usage.md"

#: the size every family's tiny model shrinks to (where its config has the attribute)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            head_dim=16, max_position_embeddings=512, moe_intermediate_size=32, num_experts=4, n_routed_experts=4,
            num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1,
            sliding_window=24, shared_expert_intermediate_size=32, rotary_dim=8)


def tiny_config(model_type: str, tok) -> object:
    base = AutoConfig.for_model(model_type)
    kw = {k: v for k, v in TINY.items()
          if hasattr(base, k) and not isinstance(getattr(type(base), k, None), property)}
    if "kv_lora_rank" in kw:  # MLA: the rotary part is the head size; a KV head per query head
        kw["num_key_value_heads"] = kw["num_attention_heads"]
        if "head_dim" in kw:
            kw["head_dim"] = kw["qk_rope_head_dim"]
    kw.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
              pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **kw)


def build_family(folder: Path, model_type: str) -> Path:
    """A tiny random model of ``model_type`` with the tiny tokenizer, saved once."""
    if (folder / "config.json").exists():
        return folder
    tok = AutoTokenizer.from_pretrained(build_tiny_model(folder.parent / "tokenizer"))
    return save_random_model(folder, tiny_config(model_type, tok), tok)


def test_every_decoder_type_of_transformers_has_an_entry():
    missing = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(FAMILIES))
    assert not missing, f"model types without a registry entry (run the sweep, then add them): {missing}"
    assert fast_families() == set(FUSED)
    assert parallel_families() == set(SHARDABLE)


def test_the_usage_table_is_the_registry():
    text = DOCS.read_text()
    found = re.search(r"<!-- families:begin -->\n(.*?)\n<!-- families:end -->", text, re.S)
    assert found, "docs/usage.md lost its families table markers"
    assert found.group(1) == support_table(), "regenerate it: python -m worker.runner.families --write docs/usage.md"


SERVED = sorted(name for name, fam in FAMILIES.items() if fam.path != REFUSED)
REFUSED_TYPES = sorted(name for name, fam in FAMILIES.items() if fam.path == REFUSED)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SERVED)
def test_served_families_give_transformers_greedy_tokens(tmp_path_factory, model_type):
    folder = build_family(tmp_path_factory.getbasetemp() / "families" / model_type, model_type)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    worker = make_worker(str(folder))
    # the registry's path is the one taken: fast families on the fused decoder
    assert (worker._runner.backend.decoder is not None) == (FAMILIES[model_type].path == FAST), model_type
    driver = MiniDriver(worker.step, max_rows=4, chunk=16)
    ps = prompts(ref.config.vocab_size, [30, 7, 45], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(ps):
        driver.submit(f"r{i}", p, params, arrival_step=i)
    out = driver.run()
    for i, p in enumerate(ps):
        div = greedy_divergence(ref, p, out[f"r{i}"].output, generate(ref, p, 8))
        assert div is None or div[1] < 1e-4, f"{model_type}: request {i} diverged at token {div[0]} (gap {div[1]:.3g})"


@pytest.mark.parametrize("model_type", REFUSED_TYPES)
def test_refused_families_are_refused_from_their_config(model_type):
    try:
        config = AutoConfig.for_model(model_type)
    except Exception as exc:  # a config transformers itself cannot build bare
        pytest.skip(f"transformers cannot build a default {model_type} config: {type(exc).__name__}")
    with pytest.raises(UnsupportedModel, match=re.escape(FAMILIES[model_type].note)) as info:
        check_family(config)
    assert repr(model_type) in str(info.value)


def test_a_hybrid_unknown_to_the_registry_is_refused_naming_its_layer_types():
    config = AutoConfig.for_model("llama")
    config.model_type = "someones_hybrid"
    config.layer_types = ["full_attention", "mamba", "full_attention", "conv"]
    with pytest.raises(UnsupportedModel, match=r"'someones_hybrid'.*\(conv, mamba\)"):
        check_family(config)


def test_refusals_come_at_load_before_any_request(tmp_path):
    """The registry's refusal through the worker's load (Falcon, whose attention is its
    own), and the probe's: a layer that attends by its own code (here a Llama whose
    attention module skips the attention interface)."""
    folder = build_family(tmp_path / "falcon", "falcon")
    with pytest.raises(ModelLoadError, match="'falcon' is not supported: attention that does not go through"):
        make_worker(str(folder))
    path = str(build_tiny_model(tmp_path / "llama"))
    from transformers.models.llama import modeling_llama

    def own_attention(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return self.o_proj(self.v_proj(hidden_states).repeat(1, 1, 2)), None

    saved = modeling_llama.LlamaAttention.forward
    modeling_llama.LlamaAttention.forward = own_attention
    try:
        with pytest.raises(ModelLoadError, match=r"2 of 2 layers do not attend through the paged attention"):
            make_worker(path, cpu_fused_decoder=False)
    finally:
        modeling_llama.LlamaAttention.forward = saved


# -- multi-head latent attention ------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    folder = build_family(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@settings(max_examples=examples(25), deadline=None)
@given(cached=st.integers(0, 40), n=st.integers(1, 20), block=st.sampled_from([4, 16]), seed=st.integers(0, 2**16))
def test_latent_attention_equals_transformers_deepseek_v3_attention(deepseek, cached, n, block, seed):
    """One layer's attention module: transformers' own over the row's whole hidden
    states (it expands the latent into full keys and values), against ours storing the
    latent in shuffled blocks: the first ``cached`` tokens as one chunk, then ``n``
    more as the next."""
    import copy

    ref_module = deepseek.model.layers[0].self_attn
    ours = copy.deepcopy(ref_module)
    holder = torch.nn.Module()
    holder.attn = ours
    assert install_latent_attention(holder) == 1
    total = cached + n
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, total, deepseek.config.hidden_size, generator=g)
    positions = torch.arange(total).unsqueeze(0)
    rope = deepseek.model.rotary_emb(hidden, positions)
    mask = torch.full((total, total), float("-inf")).triu(1).view(1, 1, total, total)
    with torch.no_grad():
        want = ref_module(hidden, position_embeddings=rope, attention_mask=mask)[0][0, cached:]

    layout = kv_layout(deepseek.config, torch.float32)
    assert layout.num_kv_heads == 1 and layout.shared_values
    assert layout.head_dim == deepseek.config.kv_lora_rank + deepseek.config.qk_rope_head_dim
    need = -(-total // block)
    cache = PagedKVCache.for_layout(layout, need + 3, block, torch.device("cpu"))
    assert cache.values[0] is cache.keys[0]
    table = np.random.default_rng(seed).permutation(need + 3)[: need + 1].astype(np.int32).reshape(1, -1)
    with torch.no_grad():
        if cached:
            plan = AttentionPlan.build(cache, np.array([0]), np.array([0]), np.array([cached]), table,
                                       torch.device("cpu"))
            ours(hidden[:, :cached], position_embeddings=tuple(t[:, :cached] for t in rope), attention_plan=plan)
        plan = AttentionPlan.build(cache, np.array([0]), np.array([cached]), np.array([n]), table, torch.device("cpu"))
        got = ours(hidden[:, cached:], position_embeddings=tuple(t[:, cached:] for t in rope), attention_plan=plan)[0]
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3_text", "qwen3_moe"])
def test_on_the_fly_int8_runs_the_families_quantized(tmp_path, arch):
    """``quantization: int8`` on the fused families (Phi-3's fused projections, Gemma's
    norms, a mixture of experts, whose every expert runs quantized on the kernel): the
    greedy tokens are transformers' own with each weight replaced by its int8
    dequantization (the LM head stays float)."""
    from tiny_model import build_tiny_model
    from worker.quant.on_the_fly import quantize_int8

    path = str(build_tiny_model(tmp_path / arch, arch=arch))
    worker = make_worker(path, quantization="int8")
    assert worker._runner.backend.decoder is not None, "the fused decoder should run the quantized layers"
    if arch == "qwen3_moe":
        experts = worker._runner.model.model.layers[0].mlp.experts
        assert {type(m).__name__ for m in (*experts.expert_up, *experts.expert_down)} == {"QuantPanelLinear"}
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head = ref.get_output_embeddings()
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.copy_(quantize_int8(module.weight).dequantize())
            if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
                for stacked in (module.gate_up_proj, module.down_proj):
                    for e in range(stacked.shape[0]):
                        stacked[e].copy_(quantize_int8(stacked[e]).dequantize())
    driver = MiniDriver(worker.step, max_rows=4, chunk=16)
    ps = prompts(ref.config.vocab_size, [30, 9], seed=5)
    for i, p in enumerate(ps):
        driver.submit(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    out = driver.run()
    for i, p in enumerate(ps):
        div = greedy_divergence(ref, p, out[f"r{i}"].output, generate(ref, p, 10))
        assert div is None or div[1] < 1e-3, f"{arch}: request {i} diverged at token {div[0]} (gap {div[1]:.3g})"


def test_gpt_oss_mxfp4_experts_are_refused_by_name(tmp_path):
    """gpt-oss ships its experts in MXFP4: refused naming the format, before any weight
    loads (the float or int8 forms of the model run)."""
    import json

    folder = build_tiny_model(tmp_path / "gpt_oss", arch="gpt_oss")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized with 'mxfp4', which raydecode does not run"):
        make_worker(str(folder))
