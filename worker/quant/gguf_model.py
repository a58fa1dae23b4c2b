"""A transformers causal LM built from a GGUF file with its quantized weights kept
quantized.

The file's metadata gives the model's config and tokenizer (transformers' own GGUF
reader, converted once and cached under the user cache folder: parsing a large
vocabulary takes seconds); the model is built from that config without initialising
its weights; then every tensor of the file is placed by transformers' own GGUF name
map (and its tensor processor, which undoes llama.cpp's permutation of the query and
key rows): a quantized linear layer becomes a ``QuantizedLinear``, a quantized
embedding a ``QuantizedEmbedding`` (shared with the output layer when the file ties
them), and float tensors (norms, biases) load as they are. Files split into
``-00001-of-0000N.gguf`` parts load as one model.

Only tensor processors that move whole rows (or leave quantized tensors alone) can
keep a tensor quantized; a file whose processor computes on a quantized tensor is
refused by name (``quantization="none"`` dequantizes it through transformers instead).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from worker.quant.gguf_blocks import FLOAT_TYPES, READERS, quantized_weight
from worker.quant.linear import QuantizedEmbedding, QuantizedLinear, embedding_scale

#: ``name-00001-of-00003.gguf``: one part of a split file
SPLIT_PART = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
#: transformers' GGUF tensor processors (by GGUF architecture) that may see a quantized
#: tensor: they leave it alone or move whole rows (the query and key permutation)
ROW_PROCESSORS = {"TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor"}


class GGUFError(ValueError):
    """A GGUF file that cannot be served quantized: the message says why."""


@dataclass
class GGUFModel:
    model: nn.Module
    config: Any
    #: a folder holding the converted tokenizer and config (``from_pretrained`` loads it)
    meta_folder: Path
    #: quantized layers by format, and float tensors: the load report
    formats: dict[str, int]


def gguf_parts(path: str) -> list[str]:
    """The files of a GGUF model: ``path`` alone, or every part of a split file (any
    part names them all); ``GGUFError`` naming a missing part."""
    match = SPLIT_PART.match(os.path.basename(path))
    if match is None:
        return [path]
    folder, stem, count = os.path.dirname(path), match["stem"], int(match["count"])
    parts = [os.path.join(folder, f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        names = [os.path.basename(m) for m in missing]
        raise GGUFError(f"{os.path.basename(path)} is part of a split file whose parts {names} are missing")
    return parts


def meta_folder(path: str) -> Path:
    """The file's config and tokenizer converted by transformers, cached once per file
    (its parts' paths, sizes and times) under ``$RAYDECODE_CACHE/gguf``."""
    from transformers import AutoConfig, AutoTokenizer

    from worker.cache import cache_dir

    parts = gguf_parts(path)
    first = parts[0]
    identity = "".join(f"{os.path.abspath(p)}\0{os.stat(p).st_size}\0{os.stat(p).st_mtime_ns}\0" for p in parts)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / key
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        folder, name = os.path.dirname(os.path.abspath(first)), os.path.basename(first)
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            raise GGUFError(f"{name}: not a readable GGUF file (truncated or corrupt?): transformers cannot read its "
                            f"metadata: {exc}") from None
        config.tie_word_embeddings = not any(t == "output.weight" for t in tensor_names(path))
        complete_config(config, _reader(first))
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


#: llama.cpp's Gemma 2/3 models whose query scale is 1 / sqrt(hidden / heads), not 1 /
#: sqrt(head_dim): the 27B ones, which it recognises by their layer count
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def complete_config(config: Any, reader: Any) -> None:
    """What transformers' conversion of a GGUF file's metadata drops, put back: the head
    width (``ARCH.attention.key_length``; transformers maps it for Gemma only, so a
    Qwen3 whose heads are not hidden / heads wide, Qwen3-0.6B's 128 against 1024 / 16,
    got the wrong shapes), and Gemma 2/3's query scale as llama.cpp computes it
    (``query_pre_attn_scalar``: the head width, or hidden / heads for the 27B models),
    where transformers left its default of 256."""
    arch = str(_field(reader, "general.architecture"))
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length)
    if arch in _GEMMA_27B_LAYERS and hasattr(config, "query_pre_attn_scalar"):
        wide = int(config.num_hidden_layers) == _GEMMA_27B_LAYERS[arch]
        config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads if wide
                                        else config.head_dim)


def _field(reader: Any, key: str) -> Any:
    """A scalar or string metadata field of a GGUF file; None when absent."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if len(field.types) == 1 and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def tensor_names(path: str) -> list[str]:
    return [t.name for part in gguf_parts(path) for t in _reader(part).tensors]


def _reader(part: str) -> Any:
    """The ``gguf`` package's reader of one file; ``GGUFError`` naming it when the file
    is not whole (the reader checks every tensor's bytes against the file's size)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(part)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise GGUFError(f"{os.path.basename(part)}: not a readable GGUF file (truncated or corrupt?): {exc}") from None


def _architecture(reader: Any, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise GGUFError(f"{os.path.basename(path)} has no general.architecture")
    return str(arch)


@contextlib.contextmanager
def _name_maps_built_once() -> Iterator[None]:
    """transformers' GGUF name map asks gguf for the architecture's tensor name map once
    per submodule (hundreds of times, seconds each load): the same map, built once."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def load_gguf_model(path: str, *, attn_implementation: str | None = None, trust_remote_code: bool = False) -> GGUFModel:
    """The model of GGUF file ``path`` with its quantized tensors kept quantized."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    folder = meta_folder(path)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    arch, tensors = _tensors(path, folder)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    model.eval()
    with _name_maps_built_once():
        names = get_gguf_hf_weights_map(model, processor)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    filled: set[str] = set()
    formats: dict[str, int] = {}
    for tensor in tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            raise GGUFError(f"{os.path.basename(path)}: tensor {tensor.name} has no place in {type(model).__name__}")
        try:
            formats_of = _load_tensor(model, modules, params, processor, tensor, hf_name, arch)
        except GGUFError as exc:
            raise GGUFError(f"{os.path.basename(path)}: {exc}") from None
        except (ValueError, IndexError, RuntimeError) as exc:  # numpy's and torch's, on shapes the file got wrong
            raise GGUFError(f"{os.path.basename(path)}: tensor {tensor.name} cannot be loaded: {exc}") from None
        formats[formats_of] = formats.get(formats_of, 0) + 1
        filled.add(hf_name)
    if config.tie_word_embeddings:
        _tie_output_embedding(model)
        filled.add("lm_head.weight")
    missing = [n for n in params if n not in filled]
    if missing:
        raise GGUFError(f"{os.path.basename(path)} lacks the tensors of {missing[:5]}")
    return GGUFModel(model, config, folder, formats)


def _load_tensor(model: nn.Module, modules: dict[str, nn.Module], params: dict[str, nn.Parameter], processor: Any,
                 tensor: Tensor, hf_name: str, arch: str) -> str:
    """Puts one tensor of the file into the model: a float one into its parameter, a
    quantized one as its layer's QuantizedWeight. Returns its format."""
    type_name = tensor.type_name
    if type_name in FLOAT_TYPES:
        values = _float_values(tensor.data, type_name)
        values = processor.process(weights=values, name=tensor.name).weights
        _set_param(params, hf_name, values, tensor.name)
        return type_name
    if type_name in READERS:
        if type(processor).__name__ not in ROW_PROCESSORS:
            raise GGUFError(f"({arch}) its tensors cannot be kept quantized (transformers' "
                            f"{type(processor).__name__} computes on them); quantization='none' dequantizes the file")
        raw = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        if raw.ndim != 2:
            raise GGUFError(f"tensor {tensor.name} is {type_name} with {raw.ndim} dimensions: only a layer's "
                            "2-dimensional weight is read quantized")
        weight = quantized_weight(raw, type_name)
        _place_quantized(model, modules, hf_name, weight, tensor.name)
        return weight.format
    raise GGUFError(f"tensor {tensor.name} is {type_name}, which raydecode does not run (supported: "
                    f"{', '.join([*READERS, *FLOAT_TYPES])})")


@dataclass
class Tensor:
    """One tensor of the file: its name, its GGUF type and its bytes (as the ``gguf``
    reader shapes them: quantized ones ``[rows, row bytes]``), memory-mapped."""

    name: str
    type_name: str
    data: np.ndarray


#: the file's tensor table, cached beside its converted metadata: the ``gguf`` reader
#: parses every metadata field (the vocabulary: seconds) before it lists the tensors
TABLE = "tensors.json"


def _tensors(path: str, folder: Path) -> tuple[str, list[Tensor]]:
    """The file's architecture and tensors: from the cached table when there is one,
    else read by the ``gguf`` package (and the table cached)."""
    parts = gguf_parts(path)
    table = folder / TABLE
    if table.exists():
        cached = json.loads(table.read_text())
        tensors = []
        for part, entries in zip(parts, cached["parts"]):
            mm = np.memmap(part, dtype=np.uint8, mode="r")
            for e in entries:
                raw = mm[e["offset"] : e["offset"] + e["bytes"]]
                if len(raw) != e["bytes"]:
                    raise GGUFError(f"{os.path.basename(part)}: not a readable GGUF file (truncated or corrupt?): "
                                    f"tensor {e['name']} runs past its end")
                data = raw.view(np.dtype(e["dtype"])).reshape(e["shape"])
                tensors.append(Tensor(e["name"], e["type"], data))
        return cached["architecture"], tensors
    readers = [_reader(part) for part in parts]
    arch = _architecture(readers[0], path)
    entries = [[{"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset), "bytes": int(t.n_bytes),
                 "dtype": str(np.asarray(t.data).dtype), "shape": list(np.asarray(t.data).shape)} for t in r.tensors]
               for r in readers]
    tmp = table.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"architecture": arch, "parts": entries}))
    tmp.replace(table)
    return arch, [Tensor(t.name, t.tensor_type.name, t.data) for r in readers for t in r.tensors]


def _float_values(data: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "BF16":
        return (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(data).astype(np.float32)


def _set_param(params: dict[str, nn.Parameter], hf_name: str, values: np.ndarray, gguf_name: str) -> None:
    param = params.get(hf_name)
    if param is None:
        raise GGUFError(f"tensor {gguf_name} maps to {hf_name}, which the model does not have")
    if tuple(np.squeeze(values).shape) != tuple(size for size in param.shape if size != 1):
        raise GGUFError(f"tensor {gguf_name} is {list(np.shape(values))}, {hf_name} is {list(param.shape)}")
    tensor = torch.from_numpy(np.ascontiguousarray(values)).reshape(param.shape).to(param.dtype)
    param.data = tensor


def _place_quantized(model: nn.Module, modules: dict[str, nn.Module], hf_name: str, weight: Any, gguf_name: str) -> None:
    module_name, _, attr = hf_name.rpartition(".")
    module = modules.get(module_name)
    if attr != "weight" or module is None:
        raise GGUFError(f"quantized tensor {gguf_name} maps to {hf_name}, not a layer's weight")
    parent_name, _, child = module_name.rpartition(".")
    parent = modules[parent_name] if parent_name else model
    if isinstance(module, nn.Linear):
        if (weight.out_features, weight.in_features) != (module.out_features, module.in_features):
            raise GGUFError(f"{gguf_name} is {weight.out_features}x{weight.in_features}, {module_name} expects "
                            f"{module.out_features}x{module.in_features}")
        replacement: nn.Module = QuantizedLinear(weight, module.bias)  # the bias Parameter, filled from the file
    elif isinstance(module, nn.Embedding):
        if (weight.out_features, weight.in_features) != (module.num_embeddings, module.embedding_dim):
            raise GGUFError(f"{gguf_name} is {weight.out_features}x{weight.in_features}, {module_name} expects "
                            f"{module.num_embeddings}x{module.embedding_dim}")
        replacement = QuantizedEmbedding(weight, module.padding_idx, embedding_scale(module))
    else:
        raise GGUFError(f"quantized tensor {gguf_name} belongs to {module_name} ({type(module).__name__}), which "
                        "raydecode cannot run quantized")
    setattr(parent, child, replacement)
    modules[module_name] = replacement


def _tie_output_embedding(model: nn.Module) -> None:
    """The output layer reads the input embedding's table (quantized or not)."""
    embedding = model.get_input_embeddings()
    if isinstance(embedding, QuantizedEmbedding):
        model.lm_head = QuantizedLinear(embedding.quantized)
    else:
        model.lm_head.weight = embedding.weight
