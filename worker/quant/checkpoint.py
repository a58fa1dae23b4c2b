"""Which format a checkpoint's weights are in, and how a worker loads them for a
``quantization`` setting (vLLM's option, with raydecode's on-the-fly schemes).

``checkpoint_format`` reads it off the checkpoint: a ``.gguf`` file is "gguf"; a folder
whose ``config.json`` carries a ``quantization_config`` is its ``quant_method``
("compressed-tensors", "awq", "gptq", "fp8", "bitsandbytes", ...); else "float".
``load_plan`` decides what ``quantization`` means for it, refusing (``ValueError``
naming both) a setting that does not fit the checkpoint:

============================  ==========  =====================  ==================
checkpoint                     None        its own name           "none"
============================  ==========  =====================  ==================
gguf                           kept        kept                   dequantized
compressed-tensors             kept        kept                   dequantized
awq, gptq (native folders)     refused     refused                refused
float                          float       (mismatch)             float
============================  ==========  =====================  ==================

and "int8" / "int4" quantize a float checkpoint at load (a quantized one is refused:
set "none" first, or serve it as it is).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: what a worker does with the weights
KEEP_GGUF, KEEP_COMPRESSED, DEQUANTIZE, FLOAT, ON_THE_FLY = "keep-gguf", "keep-compressed", "dequantize", "float", "on-the-fly"
#: quant methods of HF checkpoints whose native folders raydecode does not read
NATIVE_REFUSED = {
    "awq": "AutoAWQ's folder format (convert it to compressed-tensors with llmcompressor, or serve a GGUF)",
    "gptq": "AutoGPTQ's folder format (convert it to compressed-tensors with llmcompressor, or serve a GGUF)",
}


@dataclass(frozen=True)
class LoadPlan:
    action: str  # one of the constants above
    checkpoint: str  # the checkpoint's format
    scheme: str | None = None  # the on-the-fly scheme (int8, int4)


def checkpoint_format(path: str, gguf_file: str | None = None) -> str:
    """The format of the checkpoint in folder ``path`` (or the GGUF file ``gguf_file``
    in it)."""
    if gguf_file is not None or str(path).endswith(".gguf"):
        return "gguf"
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return "float"  # a hub id transformers resolves: its config is read there
    try:
        with open(config) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return "float"
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    if quant is None:
        return "float"
    if not isinstance(quant, dict):
        raise ValueError(f"{os.path.basename(path)}: config.json's quantization_config must be a mapping, got "
                         f"{type(quant).__name__}")
    method = quant.get("quant_method")
    return str(method) if method else "unknown"


def load_plan(checkpoint: str, quantization: str | None, name: str) -> LoadPlan:
    """How to load a ``checkpoint``-format model named ``name`` for ``quantization``."""
    if checkpoint in NATIVE_REFUSED:
        raise ValueError(f"{name} is a {checkpoint} checkpoint in {NATIVE_REFUSED[checkpoint]}, which raydecode "
                         "does not read")
    if checkpoint not in ("gguf", "compressed-tensors", "float"):
        raise ValueError(f"{name} is quantized with {checkpoint!r}, which raydecode does not run (it runs GGUF, "
                         "compressed-tensors and float checkpoints)")
    if quantization in ("int8", "int4"):
        if checkpoint != "float":
            raise ValueError(f"quantization {quantization} quantizes a float checkpoint at load; {name} is already "
                             f"{checkpoint} (serve it as it is, or with quantization none)")
        return LoadPlan(ON_THE_FLY, checkpoint, quantization)
    if quantization == "none":
        return LoadPlan(FLOAT if checkpoint == "float" else DEQUANTIZE, checkpoint)
    if quantization is not None and quantization != checkpoint:
        raise ValueError(f"quantization {quantization} does not match {name}, a {checkpoint} checkpoint")
    if checkpoint == "gguf":
        return LoadPlan(KEEP_GGUF, checkpoint)
    if checkpoint == "compressed-tensors":
        return LoadPlan(KEEP_COMPRESSED, checkpoint)
    return LoadPlan(FLOAT, checkpoint)
