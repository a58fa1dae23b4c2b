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


def build_tiny_model(folder: Path, *, seed: int = 0, num_kv_heads: int = 2) -> Path:
    """Writes model + tokenizer into ``folder`` (once) and returns it."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=SPECIAL, show_progress=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger weights than the default init: sharper logits, fewer near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
