"""A compressed-tensors checkpoint (what llmcompressor writes: GPTQ, AWQ and RTN results
alike) loaded with its quantized weights kept quantized.

The checkpoint's ``quantization_config`` is read by the ``compressed-tensors`` package
itself (``QuantizationConfig``: a malformed or unknown scheme is an error naming it),
and its targets and ignore list matched to the model's modules by the package's own
matcher. Weight-only integer schemes run: ``W4A16`` / ``W8A16``, per group or per output
channel (or one scale for the tensor), symmetric or with zero points, in the
``pack-quantized`` (codes packed into int32, unpacked by the package's
``unpack_from_int32``) or ``naive-quantized`` (int8 codes) formats. A quantized layer's
values are ``(code - zero_point) * scale``, the package's own dequantization; in
``QuantizedWeight``'s form the codes are shifted to unsigned and the zero point goes into
the offset. Anything else (float formats such as FP8 or NVFP4, quantized activations) is
refused by name.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from worker.quant.linear import QuantizedLinear
from worker.quant.weight import QuantizedWeight

#: formats whose weights this module reads
FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")


def load_compressed_model(path: str, dtype: torch.dtype, attn_implementation: str | None,
                          trust_remote_code: bool) -> tuple[nn.Module, Any, dict[str, int]]:
    """(the model with its quantized layers kept quantized, its config, layers by
    format); ``ValueError`` saying what the checkpoint asks for that is not run."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_named_modules
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f).get("quantization_config") or {}
    try:
        qconfig = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k != "version"})
    except Exception as exc:  # pydantic's error names the field
        raise ValueError(f"its quantization_config is not a compressed-tensors config: {exc}") from None
    if qconfig.format not in FORMATS:
        raise ValueError(f"compressed-tensors format {qconfig.format!r} is not run (raydecode runs {', '.join(FORMATS)}: "
                         "integer weights, float activations)")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    tensors = _Checkpoint(path)
    schemes: dict[str, Any] = {}
    for group_name, scheme in qconfig.config_groups.items():
        _check_scheme(group_name, scheme)
        for name, module in match_named_modules(model, scheme.targets, qconfig.ignore):
            if isinstance(module, nn.Linear):
                schemes[name] = scheme
    modules = dict(model.named_modules())
    formats: dict[str, int] = {}
    for name, scheme in schemes.items():
        linear = modules[name]
        weight = _quantized_weight(tensors, name, scheme.weights, qconfig.format, (linear.out_features, linear.in_features))
        bias = tensors.get(f"{name}.bias")
        if linear.bias is not None and bias is None:
            raise ValueError(f"the checkpoint lacks {name}.bias")
        if bias is not None and (linear.bias is None or tuple(bias.shape) != (linear.out_features,)):
            raise ValueError(f"{name}.bias is {list(bias.shape)} in the checkpoint, the model expects "
                             f"{[linear.out_features] if linear.bias is not None else 'none'}")
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, QuantizedLinear(weight, bias))
        formats[weight.format] = formats.get(weight.format, 0) + 1
    quantized = set(schemes)
    for key, param in list(model.named_parameters()):
        owner = key.rpartition(".")[0]
        if owner in quantized:
            continue
        value = tensors.get(key)
        if value is None:
            if key == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise ValueError(f"the checkpoint lacks {key}")
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{key} is {list(value.shape)} in the checkpoint, the model expects {list(param.shape)}")
        param.data = value.to(dtype)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model, config, formats


def _check_scheme(group_name: str, scheme: Any) -> None:
    w = scheme.weights
    where = f"config_groups.{group_name}"
    if w is None:
        raise ValueError(f"{where} quantizes no weights")
    if scheme.input_activations is not None or scheme.output_activations is not None:
        raise ValueError(f"{where} quantizes activations, which raydecode does not run (weight-only schemes: W4A16, "
                         "W8A16)")
    if str(w.type) not in ("int", "QuantizationType.INT") or w.num_bits not in (4, 8):
        raise ValueError(f"{where}: {w.num_bits}-bit {w.type} weights are not run (int4 and int8 are)")
    strategy = str(getattr(w.strategy, "value", w.strategy))
    if strategy not in ("group", "channel", "tensor"):
        raise ValueError(f"{where}: the {strategy} strategy is not run (group, channel and tensor are)")
    if w.dynamic:
        raise ValueError(f"{where}: dynamic weight scales are not run")


def _quantized_weight(tensors: _Checkpoint, name: str, args: Any, fmt: str, shape: tuple[int, int]) -> QuantizedWeight:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = shape
    bits = int(args.num_bits)
    if fmt == "pack-quantized":
        packed = tensors.need(f"{name}.weight_packed")
        words = -(-k * bits // 32)
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, words):
            raise ValueError(f"{name}.weight_packed is {packed.dtype} {list(packed.shape)}, a {n}x{k} layer of "
                             f"int{bits} packs into int32 {[n, words]}")
        q = unpack_from_int32(packed, bits, torch.Size(shape))
    else:
        q = tensors.need(f"{name}.weight")
        if q.dtype != torch.int8:
            raise ValueError(f"{name}.weight is {q.dtype}, not int8 codes")
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        if q.numel() and (int(q.min()) < low or int(q.max()) > high):
            raise ValueError(f"{name}.weight holds codes outside the {bits}-bit range [{low}, {high}]")
    if tuple(q.shape) != shape:
        raise ValueError(f"{name}'s codes are {list(q.shape)}, the layer is {list(shape)}")
    scale = tensors.need(f"{name}.weight_scale").float()
    if scale.dim() > 2 or scale.numel() == 0:
        raise ValueError(f"{name}.weight_scale is {list(scale.shape)}, which does not fit a {n}x{k} layer")
    groups = scale.shape[1] if scale.dim() == 2 else 1
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
        groups = 1
    if scale.shape[0] != n or groups < 1 or k % groups:
        raise ValueError(f"{name}.weight_scale is {list(scale.shape)}, which does not fit a {n}x{k} layer")
    group = k // groups
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "group" and args.group_size is not None and int(args.group_size) != group:
        raise ValueError(f"{name}: the config says groups of {args.group_size}, its scales hold groups of {group}")
    if strategy in ("channel", "tensor") and groups != 1:
        raise ValueError(f"{name}: the {strategy} strategy has one scale per row, its scales hold {groups}")
    if args.symmetric:
        zero = torch.zeros(n, groups)
    else:
        zero = tensors.need(f"{name}.weight_zero_point")
        if zero.dtype == torch.int32:  # packed along the outputs
            rows_packed = -(-n * bits // 32)
            if tuple(zero.shape) != (rows_packed, groups):
                raise ValueError(f"{name}.weight_zero_point is {list(zero.shape)} packed, a {n}x{k} layer in "
                                 f"{groups} groups needs {[rows_packed, groups]}")
            zero = unpack_from_int32(zero, bits, torch.Size((n, groups)), packed_dim=0).float()
        elif zero.numel() == 1:
            zero = zero.float().reshape(1, 1).expand(n, groups)
        elif zero.numel() == n * groups and zero.dim() <= 2 and zero.shape[0] == n:
            zero = zero.float().reshape(n, groups)
        else:
            raise ValueError(f"{name}.weight_zero_point is {list(zero.shape)}, the scales are {[n, groups]}")
    shift = 2 ** (bits - 1)
    codes = (q.to(torch.int16) + shift).to(torch.uint8)
    scale = scale.reshape(n, groups).contiguous()
    offsets = -(zero + shift) * scale
    kind = "sym" if args.symmetric else "asym"
    label = f"compressed-tensors int{bits} {'g' + str(group) if strategy == 'group' else strategy} {kind}"
    return QuantizedWeight.from_codes(codes, scale, offsets, bits, group, label)


class _Checkpoint:
    """The tensors of a checkpoint folder's safetensors files, read by name."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = [name for name in os.listdir(path) if name.endswith(".safetensors")]
        if not files:
            raise ValueError("it has no safetensors files")
        self._handles = [safe_open(os.path.join(path, file), framework="pt") for file in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def get(self, key: str) -> torch.Tensor | None:
        handle = self._where.get(key)
        return None if handle is None else handle.get_tensor(key)

    def need(self, key: str) -> torch.Tensor:
        value = self.get(key)
        if value is None:
            raise ValueError(f"the checkpoint lacks {key}")
        return value
