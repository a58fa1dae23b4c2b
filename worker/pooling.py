"""Pooling models: which models a worker serves as embedders or classifiers, and what
each one pools (vLLM's ``runner="pooling"``).

A pooling worker runs the prompt once and answers one vector per request instead of
sampling tokens: a pooled hidden state (``embed``: last token, mean or CLS, then a
sentence-transformers folder's Dense layers) or a classification head's logits
(``classify``: a ``*ForSequenceClassification`` model's, cross-encoders included). What
depends on the request (``dimensions``, normalising, the activation, cosine scores) is
the driver's (``cluster/pooling.py``); what depends on the model is decided here, from
its config and its sentence-transformers files, the same way on both sides:

- ``runner="auto"`` (vLLM's default) serves an encoder (BERT, RoBERTa, XLM-RoBERTa), a
  base model (``architectures`` ending in ``Model``) and a ``*ForSequenceClassification``
  model as pooling models, anything else as a generative model; ``"pooling"`` makes a
  decoder an embedder (last-token pooling, as Qwen3-Embedding and GTE-Qwen do);
  ``"generate"`` refuses a model that only pools.
- The pooling type and normalisation come from ``pooler_config`` when given, else from a
  sentence-transformers folder (``modules.json``, its ``Pooling`` module's config, a
  ``Normalize`` module), else vLLM's defaults: CLS for encoders, LAST for decoders,
  embeddings normalised (``use_activation``).

Only the floor is imported here: the driver reads the same files before its workers load.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
#: a classifier's activations (vLLM's ``get_act_fn``): "classify" is softmax over
#: several labels, sigmoid over one
ACTIVATIONS = ("classify", "sigmoid", "identity", "tanh")
#: sentence-transformers' cross-encoder activations (``activation_fn``) -> ours
ST_CE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Sigmoid": "classify",
                     "torch.nn.modules.activation.Softmax": "classify", "torch.nn.modules.activation.Tanh": "tanh"}

#: encoder model types served as pooling models (bidirectional attention over the whole
#: prompt, no KV cache): model_type -> the position of the first token (RoBERTa's count
#: from its padding index + 1)
ENCODER_TYPES = {"bert": 0, "roberta": None, "xlm-roberta": None}

#: sentence-transformers modules a folder may list, by class (``sentence_transformers.
#: models.Pooling`` before version 6, ``...sentence_transformer.modules.pooling.Pooling``
#: from it on); anything else is refused by name
ST_MODULES = ("Transformer", "Pooling", "Normalize", "Dense")
#: sentence-transformers' pooling modes -> ours
ST_POOLING = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
#: the activations of sentence-transformers' Dense modules that a worker runs
ST_ACTIVATIONS = ("torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Tanh")

#: ``pooler_config`` keys (vLLM's names)
POOLER_CONFIG_KEYS = ("pooling_type", "use_activation")


class PoolerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a loaded pooling model answers per request (``WorkerInfo.pooler``)."""

    #: "embed" (a vector of the hidden states) or "classify" (a head's logits)
    task: str
    #: which positions' hidden states are pooled: "LAST", "MEAN" or "CLS"
    pooling_type: str
    #: width of the vector a request gets (hidden size, a Dense layer's, or the labels)
    width: int
    #: what a request that does not say gets (vLLM's ``use_activation``): embed,
    #: normalised vectors (off for a sentence-transformers folder without a Normalize
    #: module); classify, the activation (softmax over several labels, sigmoid over one)
    use_activation: bool = True
    #: classify: the activation ``use_activation`` turns on (``ACTIVATIONS``: from the
    #: config's ``problem_type`` or its sentence-transformers ``activation_fn``)
    activation: str = "classify"
    #: classify: the labels in order (``id2label``)
    labels: list[str] = []
    #: a sentence-transformers folder's ``do_lower_case``: text is lowercased first
    lowercase: bool = False
    #: an encoder: the whole prompt runs in one step with bidirectional attention and
    #: keeps no KV cache (a decoder pools over chunked prefill like any prompt)
    bidirectional: bool = False
    #: Matryoshka embeddings: any ``dimensions`` (``is_matryoshka``), or those listed
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None

    @property
    def supported_tasks(self) -> list[str]:
        """vLLM's task names the model answers: an embedder embeds and scores (cosine),
        a classifier classifies and, with one label, scores (a cross-encoder)."""
        if self.task == "embed":
            return ["embed", "score"]
        return ["classify", "score"] if self.width == 1 else ["classify"]


class PoolingModelError(ValueError):
    """A model that cannot serve the pooling it is asked for: the message says why."""


def check_runner(runner: object) -> None:
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}")


def check_pooler_config(options: object) -> None:
    """``pooler_config``: a mapping of vLLM's keys; ``ValueError`` naming the bad one."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise ValueError(f"pooler_config must be a mapping, got {options!r}")
    unknown = sorted(set(options) - set(POOLER_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"pooler_config: {unknown} are not supported (it takes {list(POOLER_CONFIG_KEYS)})")
    kind = options.get("pooling_type")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in POOLING_TYPES):
        raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, got {kind!r}")
    value = options.get("use_activation")
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"pooler_config.use_activation must be true or false, got {value!r}")


def architecture(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return str(archs[0]) if archs else ""


def is_encoder(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) in ENCODER_TYPES


def first_position(hf_config: Any) -> int:
    """An encoder's first position id (``ENCODER_TYPES``): 0 for BERT, RoBERTa's
    padding index + 1."""
    first = ENCODER_TYPES[hf_config.model_type]
    return first if first is not None else int(hf_config.pad_token_id) + 1


def is_base_model(hf_config: Any) -> bool:
    """Its architecture is its family's base model (``Qwen2Model``, not a model with a
    head: ``GPT2LMHeadModel`` ends in ``Model`` too), by transformers' own table."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
    names = base if isinstance(base, (list, tuple)) else [base]
    return bool(architecture(hf_config)) and architecture(hf_config) in names


def pooling_task(hf_config: Any) -> str | None:
    """The pooling task a model's architecture implies (None: a generative model)."""
    if architecture(hf_config).endswith("ForSequenceClassification"):
        return "classify"
    if is_encoder(hf_config) or is_base_model(hf_config):
        return "embed"
    return None


def uses_pooling(runner: str, hf_config: Any) -> bool:
    """Whether a worker with ``runner`` serves this model as a pooling model
    (``PoolingModelError`` when the runner asked for cannot serve it)."""
    check_runner(runner)
    task = pooling_task(hf_config)
    if runner == "generate":
        if task is not None:
            raise PoolingModelError(
                f"runner 'generate': {architecture(hf_config) or getattr(hf_config, 'model_type', '?')} is not a "
                "generative model (no language-model head; serve it with runner 'pooling' or 'auto': embeddings, "
                "scores, classification)")
        return False
    return runner == "pooling" or task is not None


def sentence_transformers_modules(folder: str) -> list[dict[str, Any]]:
    """A sentence-transformers folder's ``modules.json`` entries ([]: not one)."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, ValueError) as exc:
        raise PoolingModelError(f"{path}: not a readable sentence-transformers modules.json ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                and isinstance(m.get("path", ""), str) for m in modules):
        raise PoolingModelError(f"{path}: expected a list of modules with a type and a path")
    for m in modules:
        if not m["type"].startswith("sentence_transformers.") or module_kind(m) not in ST_MODULES:
            raise PoolingModelError(f"{path}: the sentence-transformers module {m['type']} is not supported "
                                    f"(raydecode runs {list(ST_MODULES)})")
    return modules


def module_kind(module: dict[str, Any]) -> str:
    """A modules.json entry's class name ("Pooling", ...)."""
    return module["type"].rsplit(".", 1)[-1]


def _module_config(folder: str, module: dict[str, Any], name: str = "config.json") -> dict[str, Any]:
    path = os.path.join(folder, module.get("path", ""), name)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise PoolingModelError(f"{path}: cannot read the {module_kind(module)} module's config "
                                f"({exc})") from None
    if not isinstance(value, dict):
        raise PoolingModelError(f"{path}: expected a JSON object")
    return value


def dense_layers(folder: str) -> list[dict[str, Any]]:
    """A sentence-transformers folder's Dense modules, in order: their config
    (``in_features``, ``out_features``, ``bias``, ``activation_function``) and folder."""
    out = []
    for m in sentence_transformers_modules(folder):
        if module_kind(m) == "Dense":
            cfg = _module_config(folder, m)
            act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
            if act not in ST_ACTIVATIONS:
                raise PoolingModelError(f"{folder}: a Dense module's activation {act} is not supported "
                                        f"(raydecode runs {list(ST_ACTIVATIONS)})")
            for key in ("in_features", "out_features"):
                if not isinstance(cfg.get(key), int) or cfg[key] < 1:
                    raise PoolingModelError(f"{folder}: a Dense module's {key} must be a positive integer")
            out.append({**cfg, "activation_function": act, "folder": os.path.join(folder, m.get("path", ""))})
    return out


def transformer_config(folder: str) -> dict[str, Any]:
    """A sentence-transformers folder's Transformer module config
    (``sentence_bert_config.json``: ``max_seq_length``, ``do_lower_case``); {}: none."""
    for m in sentence_transformers_modules(folder):
        if module_kind(m) == "Transformer":
            path = os.path.join(folder, m.get("path", ""), "sentence_bert_config.json")
            if os.path.isfile(path):
                return _module_config(folder, m, "sentence_bert_config.json")
    return {}


def max_seq_length(folder: str) -> int | None:
    """A sentence-transformers folder's ``max_seq_length``, which caps
    ``max_model_len``; None: not set."""
    value = transformer_config(folder).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def classifier_activation(hf_config: Any) -> str:
    """A classifier's activation as vLLM resolves it: the config's ``problem_type``
    (regression: none; multi-label: sigmoid), else a sentence-transformers cross-encoder's
    ``activation_fn`` (``torch.nn.modules`` only), else softmax / sigmoid by its labels."""
    problem = getattr(hf_config, "problem_type", None) or ""
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem == "single_label_classification":
        return "classify"
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name is None:
        return "classify"
    if name not in ST_CE_ACTIVATIONS:
        raise PoolingModelError(f"the cross-encoder's activation_fn {name!r} is not supported (raydecode runs "
                                f"{sorted(ST_CE_ACTIVATIONS)})")
    return ST_CE_ACTIVATIONS[name]


def pooler_spec(folder: str, hf_config: Any, pooler_config: dict[str, Any] | None = None) -> PoolerSpec:
    """What the model at ``folder`` pools (its config, its sentence-transformers files,
    then ``pooler_config`` on top)."""
    options = dict(pooler_config or {})
    check_pooler_config(options)
    task = pooling_task(hf_config) or "embed"
    encoder = is_encoder(hf_config)
    cfg = getattr(hf_config, "text_config", None) or hf_config
    width = int(cfg.hidden_size)
    kind = "CLS" if encoder else "LAST"
    use_activation = True
    modules = sentence_transformers_modules(folder) if task == "embed" else []
    if modules:
        use_activation = any(module_kind(m) == "Normalize" for m in modules)
        for m in modules:
            if module_kind(m) == "Pooling":
                kind = _st_pooling_mode(folder, m)
        dense = dense_layers(folder)
        if dense:
            width = int(dense[-1]["out_features"])
    labels: list[str] = []
    activation = "classify"
    if task == "classify":
        activation = classifier_activation(hf_config)
        num = int(getattr(hf_config, "num_labels", 0) or 0)
        id2label = getattr(hf_config, "id2label", None) or {}
        labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num)]
        width = num
        if not encoder:
            raise PoolingModelError(
                f"{architecture(hf_config)}: a decoder's sequence-classification head is not served yet "
                "(encoder cross-encoders and classifiers are; a decoder embeds with runner 'pooling')")
    if options.get("pooling_type"):
        kind = options["pooling_type"].upper()
        if task == "classify" and kind != "CLS":
            raise PoolingModelError(f"pooler_config.pooling_type {kind!r}: an encoder's classification head reads "
                                    "the first token (CLS)")
    if options.get("use_activation") is not None:
        use_activation = options["use_activation"]
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerSpec(
        task=task, pooling_type=kind, width=width, use_activation=use_activation, activation=activation,
        lowercase=bool(transformer_config(folder).get("do_lower_case")) if modules else False,
        labels=labels, bidirectional=encoder, is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=[int(d) for d in dims] if isinstance(dims, (list, tuple)) else None,
    )


def _st_pooling_mode(folder: str, module: dict[str, Any]) -> str:
    cfg = _module_config(folder, module)
    modes = [mode for key, mode in (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
                                    ("pooling_mode_lasttoken", "LAST")) if cfg.get(key)]
    name = cfg.get("pooling_mode")
    if isinstance(name, str):
        if name not in ST_POOLING:
            raise PoolingModelError(f"{folder}: pooling_mode {name!r} is not supported (raydecode pools "
                                    f"{sorted(ST_POOLING)})")
        modes = [ST_POOLING[name]]
    other = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in (
        "pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken")]
    if other or len(modes) != 1 or cfg.get("include_prompt") is False:
        raise PoolingModelError(f"{folder}: the Pooling module's config {cfg} is not one raydecode runs "
                                "(exactly one of cls, mean or lasttoken, over the whole prompt)")
    return modes[0]
