"""LoRA adapters in PEFT's format, read and checked.

A folder holds ``adapter_config.json`` (PEFT's ``LoraConfig``) and
``adapter_model.safetensors``, whose tensors are named
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``. An adapted linear computes ``W x + scale * B (A x)``, with ``scale =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA), ``rank_pattern`` and
``alpha_pattern`` overriding them per module as PEFT resolves them.

Both sides use this module: the driver checks a folder against the served model's
linears (``inspect_adapter``: the config and the safetensors header, no tensor read)
before a request naming it is accepted, and a worker reads the tensors
(``read_adapter``). What raydecode does not run is refused by name: DoRA, trained
biases, ``modules_to_save``, adapters on the embedding or the LM head, on a module the
model lacks, and ranks over ``max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import msgspec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: the prefix PEFT puts before a module's name in the saved tensors
PREFIX = "base_model.model."
#: the biggest adapter_config.json read (a real one is a few KiB)
MAX_CONFIG_BYTES = 1 << 20
#: the modules an adapter may attach to: a decoder layer's projections (their last name)
ATTACHABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")
#: names PEFT targets that raydecode refuses, and why
REFUSED = {"embed_tokens": "the token embedding", "lm_head": "the LM head", "wte": "the token embedding"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")


class LoRAAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """An adapter as it crosses the wire with an added request: the worker loads
    ``path`` on first use and keeps it by ``id``."""

    id: int
    name: str
    path: str


class LoRAAdapterError(ValueError):
    """A folder that is not an adapter raydecode can serve on this model."""


@dataclass(frozen=True)
class ModuleAdapter:
    """One adapted module: its rank, scale, and shapes (in, out)."""

    rank: int
    scale: float
    in_features: int
    out_features: int


def check_adapter_name(name: object) -> str:
    """An adapter's name: letters, digits, ``._-``, no path separators (it becomes a
    ``model`` id and, with a loading path, a folder name)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise LoRAAdapterError(
            f"lora_name must be 1-128 letters, digits, '.', '_' or '-' (no path separators, no '..'), got {name!r}")
    return name


def _read_config(path: str) -> dict[str, Any]:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise LoRAAdapterError(f"lora_path must be a folder path, got {path!r}")
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"lora_path {path!r} is not a folder")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"lora_path {path!r} has no {CONFIG_FILE} (not a PEFT adapter)")
    if os.path.getsize(file) > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(f"{file}: over {MAX_CONFIG_BYTES} bytes")
    try:
        with open(file, "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{file}: not a JSON object")
    return config


def _check_config(config: dict[str, Any], where: str) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {peft_type!r}; only LORA adapters are served")
    refused = [
        (config.get("use_dora"), "use_dora (DoRA)"), (config.get("bias", "none") not in ("none", None), "bias"),
        (config.get("lora_bias"), "lora_bias"), (config.get("modules_to_save"), "modules_to_save"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D layers)"),
        (config.get("target_parameters"), "target_parameters (expert parameters)"),
        (config.get("trainable_token_indices"), "trainable_token_indices"),
    ]
    for present, what in refused:
        if present:
            raise LoRAAdapterError(f"{where}: {what} is not supported")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise LoRAAdapterError(f"{where}: {field} must be a positive number, got {value!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        value = config.get(field) or {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise LoRAAdapterError(f"{where}: {field} must map module patterns to numbers")
        for key, number in value.items():
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
                raise LoRAAdapterError(f"{where}: {field}[{key!r}] must be a positive number")
            try:
                re.compile(key)
            except re.error:
                raise LoRAAdapterError(f"{where}: {field} key {key!r} is not a pattern") from None


def _pattern_value(patterns: dict[str, Any], module: str, default: float) -> float:
    """PEFT's resolution of ``rank_pattern`` / ``alpha_pattern``: the first key that
    matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def _header(path: str) -> dict[str, list[int]]:
    """The tensor names and shapes in the adapter's safetensors file (header only)."""
    from safetensors import safe_open

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = [n for n in ("adapter_model.bin", "adapter_model.pt") if os.path.isfile(os.path.join(path, n))]
        hint = f" ({other[0]} is there: save with safe_serialization=True)" if other else ""
        raise LoRAAdapterError(f"lora_path {path!r} has no {WEIGHTS_FILE}{hint}")
    try:
        with safe_open(file, framework="pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise LoRAAdapterError(f"{file}: not a safetensors file ({type(exc).__name__}: {exc})") from None


def inspect_adapter(path: str, max_rank: int, targets: dict[str, list[int]]) -> dict[str, ModuleAdapter]:
    """The modules an adapter folder adapts, checked against the served model's
    ``targets`` (module name -> [in, out]) and ``max_rank``, without reading tensors.
    Raises ``LoRAAdapterError`` naming what is wrong."""
    config = _read_config(path)
    where = os.path.join(path, CONFIG_FILE)
    _check_config(config, where)
    shapes = _header(path)
    modules: dict[str, dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        body = key.removeprefix(PREFIX)
        refused = next((part for part in body.split(".") if part in REFUSED), None)
        if refused is not None:
            raise LoRAAdapterError(f"{key}: adapters on {REFUSED[refused]} are not supported")
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.[^.]+)?\.weight", body)
        if match is None:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA weight (lora_A / lora_B)")
        module, kind = match.group(1), match.group(2)
        _check_module(module, kind, targets)
        modules.setdefault(module, {})[kind] = shape
    if not modules:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} in {path!r} holds no LoRA weights")
    out: dict[str, ModuleAdapter] = {}
    rank_default, alpha_default = float(config["r"]), float(config["lora_alpha"])
    for module, pair in modules.items():
        a, b = pair.get("lora_A"), pair.get("lora_B")
        if a is None or b is None:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: {module} has {'lora_A' if a else 'lora_B'} but not the other")
        in_features, out_features = targets[module]
        rank = a[0] if len(a) == 2 else -1
        if len(a) != 2 or len(b) != 2 or a[1] != in_features or b[0] != out_features or b[1] != rank:
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: {module}'s lora_A {a} / lora_B {b} do not fit the model's [{out_features}, "
                f"{in_features}] linear (lora_A must be [r, {in_features}], lora_B [{out_features}, r])")
        if not 1 <= rank <= max_rank:
            raise LoRAAdapterError(f"{module}: rank {rank} is over max_lora_rank {max_rank}"
                                   if rank > max_rank else f"{module}: rank {rank} is empty")
        declared = _pattern_value(config.get("rank_pattern") or {}, module, rank_default)
        if int(declared) != rank:
            raise LoRAAdapterError(f"{module}: its tensors have rank {rank}, the config says {int(declared)}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha_default)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        out[module] = ModuleAdapter(rank, scale, in_features, out_features)
    return out


def _check_module(module: str, kind: str, targets: dict[str, list[int]]) -> None:
    last = module.rsplit(".", 1)[-1]
    if last in REFUSED or kind.startswith("lora_embedding"):
        raise LoRAAdapterError(f"{module}: adapters on {REFUSED.get(last, 'an embedding')} are not supported")
    if ".experts." in f".{module}.":
        raise LoRAAdapterError(f"{module}: adapters on mixture-of-experts experts are not supported")
    if module not in targets:
        if last in ATTACHABLE:
            raise LoRAAdapterError(f"{module}: the model has no such module")
        raise LoRAAdapterError(f"{module}: raydecode attaches adapters to a layer's projections "
                               f"({', '.join(ATTACHABLE)}), not to {last!r}")


def read_adapter(path: str, max_rank: int, targets: dict[str, list[int]], dtype: Any, device: Any = "cpu"
                 ) -> dict[str, tuple[Any, Any]]:
    """module name -> (A ``[r, in]``, scale * B ``[out, r]``) in ``dtype`` on ``device``,
    checked as ``inspect_adapter`` checks."""
    from safetensors import safe_open

    modules = inspect_adapter(path, max_rank, targets)
    weights: dict[str, tuple[Any, Any]] = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        names = {k.removeprefix(PREFIX): k for k in f.keys()}  # noqa: SIM118
        for module, info in modules.items():
            a = f.get_tensor(_weight_key(names, module, "lora_A")).float()
            b = f.get_tensor(_weight_key(names, module, "lora_B")).float() * info.scale
            if not (a.isfinite().all() and b.isfinite().all()):
                raise LoRAAdapterError(f"{module}: its weights hold NaN or infinity")
            weights[module] = (a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous())
    return weights


def _weight_key(names: dict[str, str], module: str, kind: str) -> str:
    for body, key in names.items():
        if body.startswith(f"{module}.{kind}.") and body.endswith(".weight") or body == f"{module}.{kind}.weight":
            return key
    raise LoRAAdapterError(f"{module}: no {kind} weight")  # (inspect_adapter found one: a file changed under us)
