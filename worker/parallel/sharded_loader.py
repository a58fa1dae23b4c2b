"""Loading one rank's shard of a model (tensor and pipeline parallelism).

The rank's model is the transformers model itself, built from a *local* config: the
same architecture with this rank's share of the heads (``num_attention_heads``,
``num_key_value_heads``), of the MLP (``intermediate_size``) and of the layers
(``num_hidden_layers``, ``layer_types``). Its linear layers therefore have exactly the
shard's shapes and the model's own forward runs on them unchanged: attention reshapes
by ``head_dim`` and sees the rank's heads, ``o_proj`` and ``down_proj`` produce partial
sums that the runner all-reduces. The LM head becomes a slice of the vocabulary
(``RankLayout.vocab``; the runner gathers the slices on the leader) and is never tied to
the embedding; a stage that is not the first gets no embedding table, one that is not
the last no final norm and no LM head.

A mixture of experts keeps every expert on every rank, each cut like a dense MLP (its
columns of the gate and up projections, its rows of the down projection; gpt-oss's
gate and up columns interleaved, its 3D weights transposed), the router whole; the
block's output is then one partial sum, all-reduced. With expert parallelism
(``enable_expert_parallel``) a rank holds its share of the experts whole instead, and
its experts module skips the pairs routed to the others (``worker/runner/experts.py``). Attention sinks (gpt-oss) go with
their query heads.

Each tensor is read from the checkpoint's safetensors files as the slice the rank
holds (``safe_open(...).get_slice``): a rank never has the whole model in memory.
Checkpoints in another format (``.bin``, GGUF), and mixtures of experts whose files
keep one tensor per expert where transformers stacks them (Qwen3-MoE, Mixtral: the
stacking is transformers' load-time conversion), are loaded whole once and sliced,
which costs the whole model's memory while loading.

Why not transformers' own ``tp_plan``: it shards through DTensor and hooks on every
linear, needs ``torch.distributed`` set up by its launcher, and leaves linears the CPU
backend cannot pack (``worker/cpu/packed_linear.py``) or fuse
(``worker/cpu/fused_decoder.py``); plain local shapes keep both fast paths.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from worker.cpu.fused_decoder import FAMILIES as FUSED_FAMILIES
from worker.parallel.layout import (
    ModelShape,
    ParallelSizeError,
    RankLayout,
    check_parallel_sizes,
    parse_partition,
    rank_layout,
)
from worker.quant.checkpoint import KEEP_COMPRESSED, KEEP_GGUF, ON_THE_FLY
from worker.quant.linear import QuantizedEmbedding, QuantizedLinear, embedding_scale, quantized_formats
from worker.quant.weight import QuantizedWeight
from worker.runner.experts import hold_experts, is_stacked_experts, unstack_experts
from worker.runner.families import causal_lm_class, parallel_families
from worker.runner.lora import Localize, adaptable_linears
from worker.runner.model_loader import (
    LoadedModel,
    ModelLoadError,
    choose_device,
    choose_dtype,
    finish_loading,
    load_config,
    load_weights,
    plan_loading,
)

#: model_type -> causal-LM class whose layers shard by the rules below (Llama-shaped:
#: q/k/v/o projections or Phi-3's fused qkv_proj, a gated MLP or its fused gate_up_proj,
#: RMSNorms, per-head q/k norms, Gemma's sandwich norms): the registry's parallel
#: families, with the fused decoder's class for each.
SHARDABLE = {name: FUSED_FAMILIES.get(name) or causal_lm_class(name) for name in sorted(parallel_families())}
#: families whose checkpoint fuses projections (their rows cut per part and joined):
#: quantized weights do not join, so these shard from float checkpoints only
FUSED_PROJECTIONS = {"phi3"}
#: families whose stacked experts are stored ``[experts, in, out]`` with the gate and up
#: columns interleaved (gate of column j at 2j, its up at 2j + 1); the others
#: ``[experts, out, in]``, the gate rows, then the up rows
TRANSPOSED_INTERLEAVED_EXPERTS = {"gpt_oss"}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def local_config(config: Any, layout: RankLayout) -> Any:
    """``config`` with this rank's share of heads, MLP columns and layers."""
    local = copy.deepcopy(config)
    shape = ModelShape.of(config)
    local.head_dim = shape.head_dim
    local.num_attention_heads = layout.q_heads[1] - layout.q_heads[0]
    local.num_key_value_heads = layout.kv_heads[1] - layout.kv_heads[0]
    expert_width = layout.expert_intermediate[1] - layout.expert_intermediate[0]
    if shape.expert_intermediate_size and not getattr(config, "moe_intermediate_size", None):
        local.intermediate_size = expert_width  # the experts are intermediate_size wide (Mixtral, gpt-oss)
    else:
        local.intermediate_size = layout.intermediate[1] - layout.intermediate[0]
        if shape.expert_intermediate_size:
            local.moe_intermediate_size = expert_width
    types = getattr(config, "layer_types", None)
    if types is not None:
        local.layer_types = list(types)[layout.first_layer : layout.first_layer + layout.num_layers]
    if hasattr(config, "mlp_only_layers") and hasattr(config, "decoder_sparse_step"):
        # which layers are dense is a function of the global index (Qwen MoE): as local indices
        dense = [i - layout.first_layer for i in layout.layers
                 if i in config.mlp_only_layers or (i + 1) % config.decoder_sparse_step]
        local.mlp_only_layers, local.decoder_sparse_step = dense, 1
    local.num_hidden_layers = layout.num_layers
    local.tie_word_embeddings = False
    return local


#: the projections whose input is cut across tensor ranks (their outputs all-reduced)
ROW_PARALLEL = ("o_proj", "down_proj")


def shard_slice(key: str, layout: RankLayout, head_dim: int, shape: ModelShape | None = None,
                model_type: str | None = None) -> tuple[str, Callable[[Any], torch.Tensor] | None]:
    """For a key of the rank's model: the checkpoint key it comes from and how to cut
    the rank's part out of it (a function of a safetensors slice or a tensor; None:
    taken whole). ``o_proj`` and ``down_proj`` biases are kept by tensor rank 0 only
    (the all-reduce would add them ``tp`` times). A fused ``qkv_proj`` (its q, k and v
    rows one after another) and ``gate_up_proj`` (gate rows, then up rows) give each
    part's cut, joined (``shape``: the whole model's, for where each part starts).
    Stacked experts (``...experts.gate_up_proj``) are cut per expert the same way, in
    ``model_type``'s layout (``TRANSPOSED_INTERLEAVED_EXPERTS``)."""
    m = _LAYER.match(key)
    if m is None:
        if key == "lm_head.weight":
            a, b = layout.vocab
            return key, lambda t: t[a:b]
        return key, None
    index, rest = int(m.group(1)), m.group(2)
    source = f"model.layers.{index + layout.first_layer}.{rest}"
    if layout.tp_size == 1:
        return source, None
    q0, q1 = (h * head_dim for h in layout.q_heads)
    k0, k1 = (h * head_dim for h in layout.kv_heads)
    i0, i1 = layout.intermediate
    name, _, kind = rest.rpartition(".")
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "experts":
        return source, _expert_cut(kind, layout, shape, model_type in TRANSPOSED_INTERLEAVED_EXPERTS)
    if kind == "sinks":  # one per query head
        h0, h1 = layout.q_heads
        return source, lambda t: t[h0:h1]
    if leaf == "q_proj":
        return source, lambda t: t[q0:q1]
    if leaf == "qkv_proj" and shape is not None:
        q_rows, kv_rows = shape.num_heads * head_dim, shape.num_kv_heads * head_dim
        return source, lambda t: torch.cat([t[q0:q1], t[q_rows + k0 : q_rows + k1],
                                            t[q_rows + kv_rows + k0 : q_rows + kv_rows + k1]])
    if leaf == "gate_up_proj" and shape is not None:
        width = shape.intermediate_size
        return source, lambda t: torch.cat([t[i0:i1], t[width + i0 : width + i1]])
    if leaf in ("k_proj", "v_proj"):
        return source, lambda t: t[k0:k1]
    if leaf in ("gate_proj", "up_proj"):
        return source, lambda t: t[i0:i1]
    if leaf in ROW_PARALLEL:
        if kind == "bias":
            return source, (None if layout.tp_rank == 0 else (lambda t: torch.zeros_like(t[:])))
        c0, c1 = (q0, q1) if leaf == "o_proj" else (i0, i1)
        return source, lambda t: t[:, c0:c1]
    return source, None


def _expert_cut(kind: str, layout: RankLayout, shape: ModelShape | None,
                interleaved: bool) -> Callable[[Any], torch.Tensor] | None:
    """The rank's cut of a stacked experts tensor ``kind``: its experts whole (expert
    parallelism), or every expert cut to the rank's columns ``layout.expert_intermediate``."""
    if layout.expert_parallel:
        x0, x1 = layout.experts
        return lambda t: t[x0:x1]
    e0, e1 = layout.expert_intermediate
    if kind == "down_proj_bias":  # added once: by tensor rank 0
        return None if layout.tp_rank == 0 else (lambda t: torch.zeros_like(t[:]))
    if interleaved:  # [experts, in, out]: gate and up of column j at 2j, 2j + 1
        if kind == "gate_up_proj":
            return lambda t: t[:, :, 2 * e0 : 2 * e1]
        if kind == "gate_up_proj_bias":
            return lambda t: t[:, 2 * e0 : 2 * e1]
        if kind == "down_proj":
            return lambda t: t[:, e0:e1, :]
    else:  # [experts, out, in]: the gate rows, then the up rows
        if kind == "gate_up_proj" and shape is not None:
            width = shape.expert_intermediate_size
            return lambda t: torch.cat([t[:, e0:e1], t[:, width + e0 : width + e1]], dim=1)
        if kind == "up_proj":
            return lambda t: t[:, e0:e1]
        if kind == "down_proj":
            return lambda t: t[:, :, e0:e1]
    raise ModelLoadError(f"the experts' {kind} has no rule for splitting across tensor ranks")


class CheckpointReader:
    """The tensors of a checkpoint folder, read slice by slice from safetensors (or,
    for other formats, from the whole model loaded once)."""

    def __init__(self, path: str, name: str, kwargs: dict[str, Any], whole: bool = False) -> None:
        """``whole``: load the model whole once, whatever its format (the stored
        tensors are not the model's: transformers converts them at load)."""
        from safetensors import safe_open

        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        self._whole: dict[str, torch.Tensor] | None = None
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if whole:
            pass
        elif os.path.isfile(index) and "gguf_file" not in kwargs:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for key, file in weight_map.items():
                self._where[key] = os.path.join(path, file)
        elif os.path.isfile(single) and "gguf_file" not in kwargs:
            with safe_open(single, framework="pt") as f:
                self._where = {key: single for key in f.keys()}
        if whole or not self._where:  # .bin / GGUF / converted at load: the whole model once
            from transformers import AutoModelForCausalLM

            try:
                whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"cannot load {name}: {exc}") from None
            self._whole = {k: v.detach() for k, v in whole.state_dict().items()}
        self._safe_open = safe_open

    def has(self, key: str) -> bool:
        return key in (self._whole if self._whole is not None else self._where)

    def read(self, key: str, cut: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
        if self._whole is not None:
            tensor = self._whole[key]
            return tensor if cut is None else cut(tensor)
        file = self._where[key]
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = self._safe_open(file, framework="pt")
        if cut is None:
            return handle.get_tensor(key)
        return cut(handle.get_slice(key))

    def close(self) -> None:
        self._files.clear()
        self._whole = None


def load_model_shard(
    model: str | None,
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    rank: int,
    pipeline_layer_partition: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    max_model_len: int | None = None,
    trust_remote_code: bool = False,
    quantization: str | None = None,
    quantization_config: dict[str, Any] | None = None,
    enable_expert_parallel: bool = False,
) -> tuple[LoadedModel, RankLayout]:
    """Global rank ``rank``'s part of ``model`` (see the module docstring); its
    ``vocab_size`` is the whole vocabulary (what the gathered logits hold). Quantized
    weights shard as they are (whole output rows, input columns at group boundaries).
    ``enable_expert_parallel``: the rank holds its share of each layer's experts whole."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    dev = choose_device(device)
    torch_dtype = choose_dtype(dev, dtype)
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    path, name, kwargs, config, shape = _shardable(model, tp, pp, pipeline_layer_partition, trust_remote_code,
                                                   quantization, enable_expert_parallel)
    plan = plan_loading(path, name, kwargs, quantization)
    layout = rank_layout(shape, tp, pp, rank, parse_partition(pipeline_layer_partition), enable_expert_parallel)
    local = local_config(config, layout)
    with no_init_weights():
        hf_model = AutoModelForCausalLM.from_config(local, dtype=torch_dtype, attn_implementation=attn_implementation,
                                                    trust_remote_code=trust_remote_code)
    inner = hf_model.model
    if not layout.first_stage:
        inner.embed_tokens = nn.Embedding(1, shape.hidden_size, dtype=torch_dtype)  # unused: h arrives
    if layout.last_stage:
        hf_model.lm_head = nn.Linear(shape.hidden_size, layout.vocab_shard, bias=False, dtype=torch_dtype)
    else:
        inner.norm = nn.Identity()
        hf_model.lm_head = nn.Identity()
    if layout.expert_parallel:
        _hold_rank_experts(hf_model, layout)
    formats: dict[str, int] = {}
    if plan.action in (KEEP_GGUF, KEEP_COMPRESSED, ON_THE_FLY):
        whole, _, path, kwargs, formats = load_weights(path, name, kwargs, plan, torch.float32, attn_implementation,
                                                       quantization_config)
        reader: CheckpointReader | QuantizedReader = QuantizedReader(whole)
    else:
        reader = CheckpointReader(path, name, kwargs)
        if _stored_otherwise(hf_model, reader, layout):
            reader.close()
            reader = CheckpointReader(path, name, kwargs, whole=True)
    try:
        vocab = _load_tensors(hf_model, reader, layout, shape, name, torch_dtype, config.model_type)
    finally:
        reader.close()
    if layout.expert_parallel:
        unstack_experts(hf_model)  # the packed forward is the one that skips other ranks' experts
    hf_model.to(dev).eval()
    formats = {**{k: v for k, v in formats.items() if k in ("F32", "F16", "BF16")}, **quantized_formats(hf_model)}
    loaded = finish_loading(hf_model, config, path, name, kwargs, dev, torch_dtype, vocab, max_model_len, formats)
    return loaded, layout


def _hold_rank_experts(model: nn.Module, layout: RankLayout) -> None:
    """Every stacked experts module of the rank's model made to hold only its experts
    (``layout.experts``): its 3D weights that many experts deep, the routing still over
    all of them."""
    first, last = layout.experts
    for module in model.modules():
        if not is_stacked_experts(module):
            continue
        total = int(module.num_experts)
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() >= 1 and param.shape[0] == total:
                setattr(module, name, nn.Parameter(param.new_empty((last - first, *param.shape[1:])),
                                                   requires_grad=False))
        module.num_experts = last - first
        hold_experts(module, first, total)


def _stored_otherwise(hf_model: nn.Module, reader: CheckpointReader, layout: RankLayout) -> bool:
    """Whether the checkpoint's files lack the model's stacked experts (one tensor per
    expert on disk, stacked by transformers' conversion at load)."""
    for key in hf_model.state_dict():
        m = _LAYER.match(key)
        if m is not None and ".experts." in key:
            return not reader.has(f"model.layers.{int(m.group(1)) + layout.first_layer}.{m.group(2)}")
    return False


def _load_tensors(hf_model: nn.Module, reader: CheckpointReader, layout: RankLayout, shape: ModelShape,
                  name: str, dtype: torch.dtype, model_type: str | None = None) -> int:
    """Fills every parameter of the rank's model from the checkpoint; returns the
    vocabulary size (rows of the embedding / LM head in the checkpoint)."""
    vocab = shape.vocab_size
    skip = set()
    if not layout.first_stage:
        skip.add("model.embed_tokens.weight")
    with torch.no_grad():
        for key, param in hf_model.state_dict(keep_vars=True).items():
            if key in skip:
                continue
            source, cut = shard_slice(key, layout, shape.head_dim, shape, model_type)
            if key == "lm_head.weight" and not reader.has(source):
                source = "model.embed_tokens.weight"  # tied embeddings
            if not reader.has(source):
                raise ModelLoadError(f"{name}: the checkpoint has no tensor {source} (for {key})")
            tensor = reader.read(source, cut)
            if isinstance(tensor, QuantizedWeight):
                _place_quantized(hf_model, key, tensor, name)
                continue
            tensor = tensor.to(dtype)
            if key == "lm_head.weight":
                vocab = shape.vocab_size
                if tensor.shape[0] < param.shape[0]:  # the last slice, padded with zero rows
                    tensor = torch.cat([tensor, tensor.new_zeros(param.shape[0] - tensor.shape[0], tensor.shape[1])])
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(f"{name}: {source} has shape {tuple(tensor.shape)}, the shard needs {tuple(param.shape)}")
            param.copy_(tensor)
    return vocab


def stage_module_name(layout: RankLayout, name: str) -> str | None:
    """A pipeline stage's name of the whole model's module ``name`` (its layers count
    from 0), or None for a module of another stage's layers."""
    match = _LAYER.match(name)
    if match is None:
        return name
    index = int(match.group(1))
    if index not in layout.layers:
        return None
    return f"model.layers.{index - layout.first_layer}.{match.group(2)}"


def lora_sharding(model: str | None, layout: RankLayout, trust_remote_code: bool = False,
                  quantization: str | None = None) -> tuple[dict[str, list[int]], Localize]:
    """What a rank of a group needs to run LoRA adapters: the whole model's adaptable
    linears (``adaptable_linears`` of its config on the meta device, no weights: what
    adapters are checked against and the driver is told), and the rank's cut of each
    module's (A, B). A later stage's layers count from 0 (``stage_module_name``);
    across tensor ranks an adapter is cut as its linear is (``shard_slice``): B by the
    output rows of a column-parallel projection (q, k, v, gate, up, fused qkv and
    gate_up), A by the input columns of a row-parallel one (o, down), whose partial
    products then join the base output's all-reduce (``B (sum_i A_i x_i)`` is
    ``B (A x)``), so adapters cost no collective of their own."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    _, _, _, config = load_config(model, trust_remote_code, quantization)
    with torch.device("meta"), no_init_weights():
        whole = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    shape, model_type = ModelShape.of(config), getattr(config, "model_type", None)

    def localize(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        local = stage_module_name(layout, name)
        if local is None or layout.tp_size == 1:
            return None if local is None else (local, a, b)
        _, cut = shard_slice(f"{local}.weight", layout, shape.head_dim, shape, model_type)
        if cut is None:
            return local, a, b
        if local.rsplit(".", 1)[-1] in ROW_PARALLEL:
            return local, cut(a), b
        return local, a, cut(b)

    return adaptable_linears(whole), localize


def check_model_parallel(model: str | None, tensor_parallel_size: int, pipeline_parallel_size: int,
                         pipeline_layer_partition: str | None = None, trust_remote_code: bool = False,
                         quantization: str | None = None, enable_expert_parallel: bool = False) -> ModelShape:
    """The driver's check before any rank starts: the model's family shards and its
    heads, MLP (or experts) and layers divide (``ModelLoadError``, a ``ValueError``,
    saying why and which sizes work), and its weights load as ``quantization`` asks."""
    path, name, kwargs, _, shape = _shardable(model, tensor_parallel_size, pipeline_parallel_size,
                                              pipeline_layer_partition, trust_remote_code, quantization,
                                              enable_expert_parallel)
    plan_loading(path, name, kwargs, quantization)
    return shape


def _shardable(model: str | None, tp: int, pp: int, partition: str | None, trust_remote_code: bool,
               quantization: str | None = None,
               expert_parallel: bool = False) -> tuple[str, str, dict[str, Any], Any, ModelShape]:
    """The model's (folder, name, keyword arguments, config, shape), once its family
    and sizes are known to split ``tp x pp`` ways."""
    path, name, kwargs, config = load_config(model, trust_remote_code, quantization)
    family = SHARDABLE.get(getattr(config, "model_type", None))
    if family is None or family not in (getattr(config, "architectures", None) or [family]):
        raise ModelLoadError(
            f"{name}: tensor and pipeline parallelism support {sorted(SHARDABLE.values())}, "
            f"not {getattr(config, 'architectures', None) or config.model_type}"
        )
    if config.model_type in FUSED_PROJECTIONS and tp > 1:
        plan = plan_loading(path, name, kwargs, quantization)
        if plan.action in (KEEP_GGUF, KEEP_COMPRESSED, ON_THE_FLY):
            raise ModelLoadError(
                f"{name}: {config.model_type}'s fused projections (qkv_proj, gate_up_proj) split across tensor ranks "
                f"from float weights only, not {plan.scheme or plan.checkpoint}: run it with quantization none, or "
                "with pipeline parallelism alone")
    if ModelShape.of(config).expert_intermediate_size and tp * pp > 1:
        plan = plan_loading(path, name, kwargs, quantization)
        if plan.action in (KEEP_GGUF, KEEP_COMPRESSED, ON_THE_FLY):
            raise ModelLoadError(
                f"{name}: {config.model_type}'s experts split across ranks from float weights only, not "
                f"{plan.scheme or plan.checkpoint}: run it with quantization none, or on one worker")
    try:
        return path, name, kwargs, config, check_parallel_sizes(config, tp, pp, partition, expert_parallel)
    except ParallelSizeError as exc:
        raise ModelLoadError(f"{name}: {exc}") from None


class QuantizedReader:
    """The tensors of a whole model loaded with its weights kept quantized, read by
    name: a quantized layer's weight comes back as a ``QuantizedWeight`` that the cuts of
    ``shard_slice`` slice as they slice a tensor (rows: outputs; ``[:, a:b]``: inputs, at
    group boundaries)."""

    def __init__(self, model: nn.Module) -> None:
        self._tensors: dict[str, torch.Tensor | QuantizedWeight] = {
            k: v.detach() for k, v in model.state_dict().items()}
        for module_name, module in model.named_modules():
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
                self._tensors[f"{module_name}.weight"] = module.quantized

    def has(self, key: str) -> bool:
        return key in self._tensors

    def read(self, key: str, cut: Callable[[Any], Any] | None) -> torch.Tensor | QuantizedWeight:
        value = self._tensors[key]
        if cut is None:
            return value
        if not isinstance(value, QuantizedWeight):
            return cut(value)
        try:
            return cut(_QuantizedSlicer(value))
        except ValueError as exc:
            raise ModelLoadError(f"{key}: {exc}") from None

    def close(self) -> None:
        self._tensors = {}


class _QuantizedSlicer:
    """``t[a:b]`` and ``t[:, a:b]`` of a quantized weight."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def __getitem__(self, index: Any) -> QuantizedWeight:
        if isinstance(index, slice):
            return self.weight.output_rows(index.start or 0, min(index.stop, self.weight.out_features))
        rows, cols = index
        if rows != slice(None) or not isinstance(cols, slice):
            raise ValueError(f"a quantized weight is cut by whole rows or columns, not {index!r}")
        try:
            return self.weight.input_columns(cols.start or 0, cols.stop)
        except ValueError as exc:
            raise ValueError(f"tensor parallelism would cut this layer's inputs across its quantization groups "
                             f"({exc})") from None


def _place_quantized(model: nn.Module, key: str, weight: QuantizedWeight, name: str) -> None:
    """The rank's layer ``key`` (a linear's or an embedding's weight) becomes a quantized
    one over ``weight`` (the LM head's last vocabulary slice padded with zero rows)."""
    module_name = key.rpartition(".")[0]
    module = model.get_submodule(module_name)
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(module, nn.Embedding):
        setattr(parent, child, QuantizedEmbedding(weight, module.padding_idx, embedding_scale(module)))
        return
    if not isinstance(module, nn.Linear) or weight.in_features != module.in_features:
        raise ModelLoadError(f"{name}: the quantized {key} does not fit the shard's {module_name}")
    if weight.out_features < module.out_features:  # the LM head's last slice
        pad = module.out_features - weight.out_features
        weight = replace(weight, codes=torch.cat([weight.codes, weight.codes.new_zeros(pad, weight.codes.shape[1])]),
                         scales=torch.cat([weight.scales, weight.scales.new_zeros(pad, weight.scales.shape[1])]),
                         offsets=torch.cat([weight.offsets, weight.offsets.new_zeros(pad, weight.offsets.shape[1])]))
    if weight.out_features != module.out_features:
        raise ModelLoadError(f"{name}: the quantized {key} has {weight.out_features} outputs, the shard {module.out_features}")
    setattr(parent, child, QuantizedLinear(weight, module.bias))
