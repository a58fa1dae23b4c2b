"""Which model families a worker serves, and how: the one registry.

Every decoder-only ``model_type`` in transformers' causal-LM registry has an entry
(``FAMILIES``): the path it runs on and, for a refused one, the feature it misses.

- ``fast``: the CPU fused decoder (``worker/cpu/fused_decoder.py``: one description
  of a layer's parts that each family fills in), every other path too; with
  ``parallel``, tensor and pipeline parallelism (``worker/parallel/``).
- ``generic``: transformers' own decoder layers with the paged attention (its KV pool,
  kernel and FlexAttention), packed linears and quantized weights; one worker a model.
- ``refused``: refused at load, before any weights load, naming the model type and the
  missing feature (``check_family``).

A model type not in the table (a ``trust_remote_code`` model, a family newer than this
table) loads on the generic path behind the load-time guards: a hybrid's non-attention
layer types in its config (``check_family``), and the one-token probe that every layer's
attention ran through the paged attention (``check_attention_coverage``). The sweep
test (``tests/test_model_families.py``) holds every entry to its claim against
transformers' greedy tokens, and ``docs/usage.md``'s table is generated from here
(``python -m worker.runner.families``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

logger = logging.getLogger("raydecode")

FAST, GENERIC, REFUSED = "fast", "generic", "refused"


@dataclass(frozen=True)
class Family:
    path: str
    #: refused: the missing feature (said at load); else what is special, if anything
    note: str = ""
    #: tensor and pipeline parallelism (``worker/parallel/``)
    parallel: bool = False


class UnsupportedModel(ValueError):
    """The model's family or layers are not ones the worker serves: the message names
    the model type and the missing feature."""


def _refused(feature: str) -> Family:
    return Family(REFUSED, feature)


HYBRID = "a hybrid model with layers that are not attention"
ENCODER = "an encoder (or encoder-decoder) model; raydecode generates with decoder-only models"
#: the encoders raydecode serves as pooling models (``worker/pooling.py``)
POOLING_ENCODER = ENCODER + " (it serves this one as a pooling model: embeddings, scores, classification)"
MULTIMODAL = "a multimodal (or audio) model; raydecode serves text decoders"
NO_INTERFACE = "attention that does not go through transformers' attention interface"
UNVERIFIED = "not verified against transformers (the registry's sweep cannot build a tiny one of it)"
MLA = "multi-head latent attention (the pool holds the latent)"

#: model_type -> how it runs: every decoder-only model type of transformers' causal-LM
#: registry (the sweep test fails on one missing).
FAMILIES: dict[str, Family] = {
    "afmoe": Family(GENERIC),
    "apertus": Family(GENERIC),
    "apertus1p5_text": Family(GENERIC),
    "arcee": Family(GENERIC),
    "aria_text": Family(GENERIC),
    "axk1": Family(GENERIC, MLA),
    "axk2": _refused("sparse attention with an indexer (DeepSeek Sparse Attention)"),
    "bailing_hybrid": _refused(HYBRID + " (linear-attention layers)"),
    "bamba": _refused(HYBRID + " (Mamba 2 layers)"),
    "bart": _refused(ENCODER),
    "beam": Family(GENERIC),
    "bert": _refused(POOLING_ENCODER),
    "bert-generation": _refused(ENCODER),
    "big_bird": _refused(ENCODER),
    "bigbird_pegasus": _refused(ENCODER),
    "biogpt": Family(GENERIC),
    "bitnet": Family(GENERIC),
    "blenderbot": _refused(ENCODER),
    "blenderbot-small": _refused(ENCODER),
    "bloom": _refused("ALiBi position biases"),
    "blt": _refused(MULTIMODAL),
    "camembert": _refused(ENCODER),
    "codegen": Family(GENERIC),
    "cohere": Family(GENERIC),
    "cohere2": Family(GENERIC),
    "cohere2_moe": Family(GENERIC),
    "cohere_compass_text": _refused(UNVERIFIED),
    "cpmant": _refused(NO_INTERFACE),
    "ctrl": Family(GENERIC),
    "cwm": Family(GENERIC),
    "data2vec-text": _refused(ENCODER),
    "dbrx": _refused(UNVERIFIED),
    "deepseek_v2": Family(GENERIC, MLA),
    "deepseek_v3": Family(GENERIC, MLA),
    "deepseek_v32": _refused("sparse attention with an indexer (DeepSeek Sparse Attention)"),
    "deepseek_v4": _refused("hybrid attention layers (compressed and sparse) the paged pool does not hold"),
    "diffllama": _refused("differential attention"),
    "doge": _refused("dynamic mask attention"),
    "dory": _refused(UNVERIFIED),
    "dots1": Family(GENERIC),
    "dots3_note": _refused(MULTIMODAL + " (serve its text tower, model_type dots3_note_text)"),
    "dots3_note_text": _refused("layers of different head counts"),
    "electra": _refused(ENCODER),
    "emu3": _refused(MULTIMODAL),
    "ernie": _refused(ENCODER),
    "ernie4_5": Family(GENERIC),
    "ernie4_5_moe": Family(GENERIC),
    "exaone": Family(GENERIC),
    "exaone4": Family(GENERIC),
    "exaone_moe": Family(GENERIC),
    "falcon": _refused(NO_INTERFACE),
    "falcon_h1": _refused(HYBRID + " (Mamba 2 heads beside attention)"),
    "falcon_mamba": _refused(HYBRID + " (Mamba layers)"),
    "flex_olmo": Family(GENERIC),
    "flint": Family(GENERIC),
    "fuyu": _refused(MULTIMODAL),
    "gemma": Family(FAST, "GeGLU, (1 + weight) norms", parallel=True),
    "gemma2": Family(FAST, "sandwich norms, soft-capped logits, sliding and full layers", parallel=True),
    "gemma3": _refused(MULTIMODAL + " (serve its text tower, model_type gemma3_text)"),
    "gemma3_text": Family(FAST, "sandwich and q/k norms, a rotary base per layer type, sliding and full layers", parallel=True),
    "gemma3n": _refused(MULTIMODAL),
    "gemma3n_text": _refused("keys and values shared across layers (KV sharing)"),
    "gemma4": _refused(MULTIMODAL),
    "gemma4_assistant": _refused(MULTIMODAL),
    "gemma4_text": _refused("layers of different head sizes"),
    "gemma4_unified": _refused(MULTIMODAL),
    "gemma4_unified_assistant": _refused(MULTIMODAL),
    "gemma4_unified_text": _refused("layers of different head sizes"),
    "git": _refused(MULTIMODAL),
    "glm": Family(GENERIC),
    "glm4": Family(GENERIC),
    "glm4_moe": Family(GENERIC),
    "glm4_moe_lite": Family(GENERIC, MLA),
    "glm_moe_dsa": _refused("sparse attention with an indexer (DeepSeek Sparse Attention)"),
    "got_ocr2": _refused(MULTIMODAL),
    "gpt-sw3": Family(GENERIC),
    "gpt2": Family(GENERIC),
    "gpt_bigcode": Family(GENERIC, "multi-query attention"),
    "gpt_neo": _refused(UNVERIFIED),
    "gpt_neox": Family(GENERIC),
    "gpt_neox_japanese": _refused(NO_INTERFACE),
    "gpt_oss": Family(FAST, "attention sinks, sliding and full layers; its MXFP4 checkpoints refused (float, int8 run)",
                      parallel=True),
    "gptj": Family(GENERIC),
    "granite": Family(GENERIC),
    "granite_swa": Family(GENERIC),
    "granitemoe": Family(GENERIC),
    "granitemoe_swa": Family(GENERIC),
    "granitemoehybrid": _refused(HYBRID + " (Mamba 2 layers)"),
    "granitemoeshared": Family(GENERIC),
    "helium": Family(GENERIC),
    "hrm_text": _refused(HYBRID + " (recurrent reasoning modules)"),
    "hunyuan_v1_dense": Family(GENERIC),
    "hunyuan_v1_moe": Family(GENERIC),
    "hy_v3": Family(GENERIC),
    "hy_v4": _refused("sparse attention with an indexer"),
    "hyperclovax": Family(GENERIC),
    "inkling2_loop_text": _refused(HYBRID + " (linear-attention layers)"),
    "inkling2_text": _refused(HYBRID + " (linear-attention layers)"),
    "inkling_text": _refused(HYBRID + " (linear-attention layers)"),
    "internlm3": Family(GENERIC),
    "iquestcoder": Family(GENERIC),
    "jais2": Family(GENERIC),
    "jamba": _refused(HYBRID + " (Mamba layers)"),
    "jetmoe": _refused("mixture-of-attention-heads (keys and values of other head counts than the queries')"),
    "kimi_linear": _refused(HYBRID + " (Kimi Delta Attention (linear) layers)"),
    "kolibri1": Family(GENERIC),
    "laguna": Family(GENERIC),
    "lara_mini": _refused(HYBRID + " (linear-attention layers)"),
    "lfm2": _refused(HYBRID + " (short-convolution layers)"),
    "lfm2_moe": _refused(HYBRID + " (short-convolution layers)"),
    "lfm3": _refused(HYBRID + " (short-convolution layers)"),
    "llama": Family(FAST, "", parallel=True),
    "llama4": _refused(MULTIMODAL + " (serve its text tower, model_type llama4_text)"),
    "llama4_text": _refused("chunked local attention (attention_chunk_size)"),
    "longcat_flash": _refused(UNVERIFIED),
    "mamba": _refused(HYBRID + " (Mamba layers)"),
    "mamba2": _refused(HYBRID + " (Mamba 2 layers)"),
    "marian": _refused(ENCODER),
    "mbart": _refused(ENCODER),
    "megatron-bert": _refused(ENCODER),
    "mellum": Family(GENERIC),
    "mimo_v2_flash": _refused("value heads of another size than the keys' (v_head_dim)"),
    "minicpm3": Family(GENERIC, MLA),
    "minimax": _refused(HYBRID + " (lightning (linear) attention layers)"),
    "minimax_m2": Family(GENERIC),
    "minimax_m3_vl_text": Family(GENERIC),
    "ministral": Family(GENERIC),
    "ministral3": Family(GENERIC),
    "mistral": Family(FAST, "sliding window", parallel=True),
    "mixtral": Family(FAST, "experts packed per expert (worker/runner/experts.py)", parallel=True),
    "mllama": _refused(MULTIMODAL),
    "modernbert-decoder": Family(GENERIC),
    "moshi": _refused(MULTIMODAL),
    "moss_transcribe_diarize": _refused(MULTIMODAL),
    "mpt": _refused("ALiBi position biases"),
    "musicgen": _refused(MULTIMODAL),
    "musicgen_melody": _refused(MULTIMODAL),
    "mvp": _refused(ENCODER),
    "nanochat": Family(GENERIC),
    "nemotron": Family(GENERIC),
    "nemotron_h": _refused(HYBRID + " (Mamba 2 layers)"),
    "olmo": Family(GENERIC),
    "olmo2": Family(GENERIC),
    "olmo3": Family(GENERIC),
    "olmo_hybrid": _refused(HYBRID + " (linear-attention layers)"),
    "olmoe": Family(GENERIC),
    "openai-gpt": _refused(NO_INTERFACE),
    "opt": Family(GENERIC),
    "pegasus": _refused(ENCODER),
    "persimmon": Family(GENERIC),
    "phi": Family(GENERIC),
    "phi3": Family(FAST, "fused qkv_proj and gate_up_proj (partial rotary, Phi-4-mini: the generic path)", parallel=True),
    "phi4_multimodal": _refused(MULTIMODAL),
    "phimoe": Family(GENERIC, "its sliding window applied from its config (transformers applies it in the mask only)"),
    "plbart": _refused(ENCODER),
    "prophetnet": _refused(ENCODER),
    "qwen2": Family(FAST, "q/k/v biases", parallel=True),
    "qwen2_moe": Family(GENERIC),
    "qwen3": Family(FAST, "q/k norms", parallel=True),
    "qwen3_5": _refused(MULTIMODAL + " (serve its text tower, model_type qwen3_5_text)"),
    "qwen3_5_moe": _refused(MULTIMODAL + " (serve its text tower, model_type qwen3_5_moe_text)"),
    "qwen3_5_moe_text": _refused(HYBRID + " (Gated DeltaNet (linear attention) layers)"),
    "qwen3_5_text": _refused(HYBRID + " (Gated DeltaNet (linear attention) layers)"),
    "qwen3_moe": Family(FAST, "experts packed per expert (worker/runner/experts.py)", parallel=True),
    "qwen3_next": _refused(HYBRID + " (Gated DeltaNet (linear attention) layers)"),
    "qwen4_exp": _refused(MULTIMODAL + " (serve its text tower, model_type qwen4_exp_text)"),
    "qwen4_exp_text": _refused(HYBRID + " (linear-attention layers)"),
    "recurrent_gemma": _refused(HYBRID + " (recurrent (RG-LRU) layers)"),
    "reformer": _refused(ENCODER),
    "rembert": _refused(ENCODER),
    "roberta": _refused(POOLING_ENCODER),
    "roberta-prelayernorm": _refused(ENCODER),
    "roc_bert": _refused(ENCODER),
    "roformer": _refused(ENCODER),
    "rwkv": _refused(HYBRID + " (RWKV recurrent layers)"),
    "sarvam_mla": Family(GENERIC, MLA),
    "sarvam_moe": Family(GENERIC),
    "seed_oss": Family(GENERIC),
    "smollm3": Family(GENERIC),
    "solar_open": Family(GENERIC),
    "stablelm": Family(GENERIC, "partial rotary"),
    "starcoder2": Family(GENERIC),
    "trocr": _refused(ENCODER),
    "vaultgemma": Family(GENERIC),
    "whisper": _refused(ENCODER),
    "xglm": _refused(NO_INTERFACE),
    "xlm": _refused(ENCODER),
    "xlm-roberta": _refused(POOLING_ENCODER),
    "xlm-roberta-xl": _refused(ENCODER),
    "xlnet": _refused(ENCODER),
    "xlstm": _refused(HYBRID + " (xLSTM recurrent layers)"),
    "xmod": _refused(ENCODER),
    "youtu": Family(GENERIC, MLA),
    "zamba": _refused(HYBRID + " (Mamba layers)"),
    "zamba2": _refused(HYBRID + " (Mamba 2 layers)"),
    "zaya": _refused(UNVERIFIED),
}

#: config ``layer_types`` entries that are attention layers the paged pool serves
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "global", "local",
                         "chunked_attention"}


def model_type(config: Any) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


def fast_families() -> set[str]:
    """The model types the fused decoder covers."""
    return {name for name, fam in FAMILIES.items() if fam.path == FAST}


def parallel_families() -> set[str]:
    """The model types tensor and pipeline parallelism cover."""
    return {name for name, fam in FAMILIES.items() if fam.parallel}


def causal_lm_class(kind: str) -> str:
    """The name of transformers' causal-LM class for model type ``kind``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])


def check_family(config: Any) -> None:
    """Refuses, before the weights load, a model the registry refuses or whose config
    declares layers that are not attention (``UnsupportedModel`` naming both)."""
    kind = model_type(config)
    fam = FAMILIES.get(kind)
    if fam is not None and fam.path == REFUSED:
        raise UnsupportedModel(f"model_type {kind!r} is not supported: {fam.note}")
    if fam is None:
        logger.warning("model_type %r is not in raydecode's table of tested families: it runs on the generic path "
                       "behind the load-time checks, its outputs not checked against transformers'", kind)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"model_type {kind!r} is not supported: {ENCODER}")
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or []
        other = sorted({str(t) for t in types if isinstance(t, str)} - ATTENTION_LAYER_TYPES)
        if other:
            raise UnsupportedModel(
                f"model_type {kind!r} is not supported: a hybrid model with {HYBRID} ({', '.join(other)}); "
                "the paged KV cache serves attention layers only")


def check_attention_coverage(model: nn.Module, seen: set[int]) -> None:
    """After the load's one-token probe: every decoder layer's attention must have run
    through the paged attention (``seen``: the layers that did). A layer that attends by
    its own code would ignore the KV cache and answer wrongly: refused, naming its
    modules."""
    config = model.config
    cfg = getattr(config, "text_config", None) or config
    expected = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    missing = [i for i in range(expected) if i not in seen]
    if not missing:
        return
    layers = _decoder_layers(model)
    where = []
    for i in missing[:3]:
        layer = layers[i] if layers is not None and i < len(layers) else None
        parts = [f"{name}: {type(child).__name__}" for name, child in layer.named_children()] if layer is not None else []
        where.append(f"layer {i} ({', '.join(parts) or '?'})")
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    raise UnsupportedModel(
        f"model_type {model_type(config)!r} is not supported: {len(missing)} of {expected} layers do not attend "
        f"through the paged attention ({'; '.join(where)}{more}), so they would ignore the KV cache")


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers"):
            return module
    return None


def support_table() -> str:
    """The registry as ``docs/usage.md``'s markdown table."""
    lines = ["| model_type | path | TP/PP | notes |", "|---|---|---|---|"]
    for name in sorted(FAMILIES):
        fam = FAMILIES[name]
        lines.append(f"| `{name}` | {fam.path} | {'yes' if fam.parallel else ''} | {fam.note} |")
    return "\n".join(lines)


BEGIN, END = "<!-- families:begin -->\n", "\n<!-- families:end -->"


def write_table(path: str) -> None:
    """Replaces the table between ``path``'s family markers with the registry's."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + support_table() + END + tail)


if __name__ == "__main__":
    # python -m worker.runner.families [--write docs/usage.md]
    if sys.argv[1:2] == ["--write"]:
        write_table(sys.argv[2])
    else:
        sys.stdout.write(support_table() + "\n")
