"""A tiny random Llama and a byte-level BPE tokenizer, built in code (deterministic),
saved to a folder and then loaded through the real loading path."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine and the early bird catches the worm",
    "ray schedules actors and tasks across a cluster of nodes",
    "tokens flow through the sampler one step at a time",
    "<think> reasoning goes here </think> then the answer",
    "héllo wörld ünïcode — 日本語 テキスト 🙂",
] * 20
SPECIAL = ["<|endoftext|>", "<think>", "</think>"]


def build_tiny_model(folder: Path, *, seed: int = 0, num_kv_heads: int = 2, arch: str = "llama", **overrides) -> Path:
    """Writes model + tokenizer into ``folder`` (once) and returns it. ``arch`` picks
    the architecture: "llama" (the default), "qwen2" (projection biases), "mistral" (a
    sliding window), "gemma2" (soft-capped attention logits, sliding and global layers),
    "gpt_oss" (attention sinks), "qwen3" (q/k norms), "phi3" (fused projections),
    "gemma" or "gemma3_text" (sandwich norms, q/k norms, a rotary base per layer type),
    "qwen3_moe" or "mixtral" (mixtures of experts);
    ``overrides`` go to its config."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoConfig, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=SPECIAL, show_progress=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    common = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    extra = {
        "llama": {},
        "qwen2": {},  # biases on the q, k and v projections
        "mistral": {"sliding_window": 24, "head_dim": 16},
        "gemma2": {"head_dim": 16, "sliding_window": 24, "attn_logit_softcapping": 5.0,
                   "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16,
                   "layer_types": ["sliding_attention", "full_attention"]},
        "gpt_oss": {"head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
                    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 24},
        "qwen3": {"head_dim": 16, "use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
        "phi3": {"sliding_window": 24},  # fused qkv_proj and gate_up_proj
        "gemma": {"head_dim": 16},
        "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 24},
        "gemma3_text": {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 16,
                        "layer_types": ["sliding_attention", "full_attention"]},
    }[arch]
    return save_random_model(folder, AutoConfig.for_model(arch, **{**common, **extra, **overrides}), tok, seed)


def save_random_model(folder: Path, config, tok, seed: int = 0, auto_class=None) -> Path:
    """A model of ``config`` (built by ``auto_class``: default a causal LM) with seeded
    random weights, saved with ``tok`` into ``folder``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = (auto_class or AutoModelForCausalLM).from_config(config)
    # Larger weights than the default init: sharper logits, fewer near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


#: A Llama of about 1B parameters (TinyLlama's shape, 20 layers): the GPU tests' and
#: benchmark's model, random weights.
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096)


def build_random_llama(folder: Path, *, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                       **overrides) -> Path:
    """A random-weight Llama (``LLAMA_1B`` unless ``overrides`` say otherwise) with a
    byte-level tokenizer padded to its vocabulary, written into ``folder`` once. Weights
    are drawn on ``device`` (a GPU does it in a second) and saved in ``dtype``."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = build_tiny_model(folder / "tokenizer-source")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = {**LLAMA_1B, **overrides}
    tok.add_tokens([f"<t{i}>" for i in range(shape["vocab_size"] - len(tok))])
    config = AutoConfig.for_model(
        "llama", **shape, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.03, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    return folder
