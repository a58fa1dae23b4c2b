"""GGUF files written from a tiny Hugging Face model folder, as llama.cpp's
``convert_hf_to_gguf.py`` (then ``llama-quantize``) would write them, for the tests that
load GGUF files end to end. No tests here.

``write_gguf(folder, out, types)`` writes the model of ``folder`` (a Llama, Qwen2, Qwen3
or Gemma 3 text model saved by ``tests/tiny_model.py``) with the ``gguf`` package's
``GGUFWriter``:

- the architecture's metadata under llama.cpp's keys (``llama.block_count``, ...);
- the tokenizer as llama.cpp stores a byte-level BPE one (``tokenizer.ggml.model``
  "gpt2": tokens in their byte-level spelling, token types, merges, BOS/EOS/padding ids),
  which transformers rebuilds;
- the tensors under GGUF names (``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``,
  ``output`` unless the embeddings are tied), a Llama's query and key rows permuted as
  llama.cpp's converter does (transformers' ``LlamaTensorProcessor`` undoes it; Qwen2
  and Qwen3 are stored unpermuted), Gemma's norms as 1 + w (llama.cpp's converter adds
  the one that Gemma's norm adds at run time), norms and biases in F32 and each matrix in the type ``types``
  asks for: one type for all, or ``{fnmatch pattern: type}`` (first match wins) for a
  mix such as ``Q4_K_M``.

The ``gguf`` package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; Q4_K, Q5_K and Q6_K are
quantized here (``quantize_k``): a plain reference quantizer, not llama.cpp's search
for the best scales, whose every value is within half a step of the input (the step:
the sub-block's scale, ``d * sc``). ``split=N`` writes ``stem-0000i-of-0000N.gguf``
parts (llama.cpp's ``split.no`` / ``split.count`` / ``split.tensors.count`` keys, the
metadata in the first part); ``placeholder_bytes`` writes zero bytes of the right size
for a type nothing here quantizes (a file of a type raydecode should refuse).
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

QK_K = 256

#: a Q4_K_M-like mix, as llama-quantize picks it (most matrices Q4_K; the value and
#: down projections and the output layer Q6_K; here the embeddings Q8_0)
Q4_K_M = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q6_K",
    "blk.*.attn_v.weight": "Q6_K",
    "blk.*.ffn_down.weight": "Q6_K",
    "*": "Q4_K",
}

#: Hugging Face name (a layer's, after ``model.layers.N.``) -> GGUF name
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
#: what differs in Gemma 3's layers: its four norms (the one after attention is not the
#: MLP's), its q/k norms
_GEMMA3_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_QWEN3_NAMES = {**_LAYER_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
#: Hugging Face model type -> (llama.cpp's architecture, its layer names)
ARCHITECTURES = {"llama": ("llama", _LAYER_NAMES), "qwen2": ("qwen2", _LAYER_NAMES),
                 "qwen3": ("qwen3", _QWEN3_NAMES), "gemma3_text": ("gemma3", _GEMMA3_NAMES)}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
#: token types, as llama.cpp's vocabulary stores them
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def gguf_name(hf_name: str, names: dict[str, str] = _LAYER_NAMES) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight`` (``names``:
    the architecture's layer names)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in names:
        return f"blk.{parts[2]}.{names[parts[3]]}.{suffix}"
    raise ValueError(f"no GGUF name for {hf_name}")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's query/key permutation: within each head, the rotary pairs (i, i +
    dim/2), which Hugging Face's rotation pairs, become adjacent rows (2i, 2i + 1), as
    GGML's rotation pairs them."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- the K-quants, quantized here ---------------------------------------------------------------


def _f16_at_least(v: np.ndarray) -> np.ndarray:
    """The smallest half-precision value >= ``v`` (>= 0), as float16."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _ceil_codes(need: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """``ceil(need / unit)`` clipped to ``[0, top]`` (0 where ``unit`` is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(unit > 0, np.ceil(need / np.where(unit > 0, unit, 1)), 0)
    return np.clip(q, 0, top).astype(np.uint8)


def _round_codes(x: np.ndarray, step: np.ndarray, low: int, high: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(x / np.where(step > 0, step, 1)), 0)
    return np.clip(q, low, high).astype(np.int16)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins ``[..., 8]`` -> Q4_K/Q5_K's 12 bytes: bytes 0-3 hold
    scales 0-3 (and the top bits of 4-7), bytes 4-7 the mins alike, bytes 8-11 the low
    nibbles of scales and mins 4-7."""
    lo_sc, hi_sc, lo_mn, hi_mn = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    return np.concatenate([
        lo_sc | ((hi_sc >> 4) << 6),
        lo_mn | ((hi_mn >> 4) << 6),
        (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4),
    ], axis=-1).astype(np.uint8)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) blocks of ``x [n, 256]``: value = d sc q - dmin m.

    The minimum of each sub-block of 32 (at most 0) comes first, rounded down to a
    multiple of ``dmin``; the scale then covers the rest of the range, rounded up to a
    multiple of ``d``: every input lies in the representable range, within half a step of
    a code."""
    top = (1 << bits) - 1
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    need_min = -np.minimum(sub.min(-1), 0)  # >= 0
    dmin = _f16_at_least(need_min.max(-1) / 63)
    m = _ceil_codes(need_min, dmin.astype(np.float32)[:, None], 63)
    m_eff = dmin.astype(np.float32)[:, None] * m
    need_scale = np.maximum(sub.max(-1) + m_eff, 0) / top
    d = _f16_at_least(need_scale.max(-1) / 63)
    sc = _ceil_codes(need_scale, d.astype(np.float32)[:, None], 63)
    step = d.astype(np.float32)[:, None] * sc
    q = _round_codes(sub + m_eff[..., None], step[..., None], 0, top).astype(np.uint8)  # [n, 8, 32]
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)  # a run of 32 bytes: sub-blocks 2i, 2i + 1
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_scale_min(sc, m)]
    if bits == 5:
        high = (q >> 4) & 1  # [n, 8, 32]: byte l's bit j is sub-block j's code l
        parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``x [n, 256]``: value = d sc (q - 32), sub-blocks of 16 with int8
    scales, each rounded up so that +-max|x| is within codes -31..31."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    need_scale = np.abs(sub).max(-1) / 31
    d = _f16_at_least(need_scale.max(-1) / 127)
    sc = _ceil_codes(need_scale, d.astype(np.float32)[:, None], 127)
    step = d.astype(np.float32)[:, None] * sc
    codes = (_round_codes(sub, step[..., None], -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, run, l]
    ql = np.concatenate([(codes[:, :, 0] & 0x0F) | ((codes[:, :, 2] & 0x0F) << 4),
                         (codes[:, :, 1] & 0x0F) | ((codes[:, :, 3] & 0x0F) << 4)], axis=-1)  # [n, 2, 64]
    qh = (((codes >> 4) & 3) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=2, dtype=np.uint8)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc,
                           d.view(np.uint8).reshape(n, 2)], axis=-1)


K_QUANTIZERS = {"Q4_K": lambda x: _q45_k(x, 4), "Q5_K": lambda x: _q45_k(x, 5), "Q6_K": _q6_k}


def quantize_k(x: np.ndarray, type_name: str) -> np.ndarray:
    """``x [rows, K]`` (K a multiple of 256) as ``type_name`` blocks: uint8 ``[rows,
    K / 256 * block bytes]``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    if k % QK_K:
        raise ValueError(f"{type_name} needs rows of a multiple of {QK_K} values, got {k}")
    blocks = K_QUANTIZERS[type_name](x.reshape(-1, QK_K))
    return np.ascontiguousarray(blocks).reshape(rows, -1)


def quantize_tensor(x: np.ndarray, type_name: str, placeholder_bytes: bool = False) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for ``GGUFWriter.add_tensor``: ``x`` as ``type_name``."""
    from gguf import GGMLQuantizationType, quantize
    from gguf.constants import GGML_QUANT_SIZES

    if type_name == "F32":
        return np.ascontiguousarray(x, dtype=np.float32), None
    if type_name == "F16":
        return np.ascontiguousarray(x, dtype=np.float16), None
    qtype = GGMLQuantizationType[type_name]
    if type_name in K_QUANTIZERS:
        return quantize_k(x, type_name), qtype
    try:
        return quantize(np.ascontiguousarray(x, dtype=np.float32), qtype), qtype
    except NotImplementedError:
        if not placeholder_bytes:
            raise
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if x.shape[-1] % block:
        raise ValueError(f"{type_name} needs rows of a multiple of {block} values, got {x.shape[-1]}")
    return np.zeros((x.shape[0], x.shape[-1] // block * block_bytes), dtype=np.uint8), qtype


def type_for(name: str, types: dict[str, str] | str) -> str:
    """The type ``types`` gives the matrix ``name`` (a GGUF name)."""
    if isinstance(types, str):
        return types
    for pattern, type_name in types.items():
        if fnmatch.fnmatchcase(name, pattern):
            return type_name
    raise ValueError(f"no type for {name} in {types} (add a '*' entry)")


# -- the file ----------------------------------------------------------------------------------


def _rope_theta(config: dict) -> float:
    """The rotary base (of the global layers where each layer type has its own: GGUF's
    ``rope.freq_base``; llama.cpp fixes Gemma 3's local base at 10000)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = params.get("full_attention", params)
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The byte-level BPE tokenizer of ``folder`` as llama.cpp stores one ("gpt2")."""
    data = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{folder}: a {model.get('type')} tokenizer (only byte-level BPE is written)")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    tokens, token_types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # a model row no token uses (llama.cpp pads so)
            tokens.append(f"[PAD{i}]")
            token_types.append(USER_DEFINED)
            continue
        tokens.append(by_id[i])
        token_types.append(CONTROL if i in added and added[i].get("special") else
                           USER_DEFINED if i in added else NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token in ids:
            add(ids[token])
    writer.add_add_bos_token(False)


def write_gguf(hf_model_dir: str | Path, out_path: str | Path, types: dict[str, str] | str, *, split: int = 1,
               placeholder_bytes: bool = False, name: str | None = None,
               tamper: Callable[[str, np.ndarray], np.ndarray] | None = None) -> list[Path]:
    """Writes the model of ``hf_model_dir`` to ``out_path`` (``split`` > 1: that many
    parts, ``stem-0000i-of-0000N.gguf`` beside it) with each matrix in the type
    ``types`` gives it (``Q4_K_M`` above is a mix). Returns the files written, the one to
    load first. ``tamper(gguf_name, array)`` may replace a tensor before it is written
    (hostile files); a 1-dimensional tensor ``types`` names explicitly is quantized too."""
    from gguf import GGML_QUANT_VERSION, GGUFWriter
    from safetensors.torch import load_file

    folder, out_path = Path(hf_model_dir), Path(out_path)
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] not in ARCHITECTURES:
        raise ValueError(f"{folder}: a {config['model_type']} model (written: {sorted(ARCHITECTURES)})")
    arch, names = ARCHITECTURES[config["model_type"]]
    state = load_file(str(folder / "model.safetensors"))
    tied = bool(config.get("tie_word_embeddings")) or "lm_head.weight" not in state
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head

    tensors: list[tuple[str, np.ndarray]] = []
    for hf_name, value in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        g = gguf_name(hf_name, names)
        array = value.to(torch.float32).numpy()
        if arch == "gemma3" and g.endswith("norm.weight"):  # llama.cpp's norms multiply by w: Gemma's 1 + w
            array = array + 1.0
        if arch == "llama" and g.endswith((".attn_q.weight", ".attn_q.bias")):
            array = permute_rows(array, n_head)
        elif arch == "llama" and g.endswith((".attn_k.weight", ".attn_k.bias")):
            array = permute_rows(array, n_kv)
        tensors.append((g, array))
    order = {"token_embd": 0, "blk": 1, "output_norm": 2, "output": 3}

    def key(item: tuple[str, np.ndarray]) -> tuple:
        parts = item[0].split(".")
        return (order[parts[0]], int(parts[1]) if parts[0] == "blk" else 0, item[0])

    tensors.sort(key=key)

    per_part = math.ceil(len(tensors) / split) if split > 1 else 0
    writer = GGUFWriter(out_path, arch, split_max_tensors=per_part)
    writer.add_name(name or f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):  # heads not hidden / heads wide
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3" and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    _add_tokenizer(writer, folder, config["vocab_size"])
    for g, array in tensors:
        if tamper is not None:
            array = tamper(g, array)
        if array.ndim == 1 and not (isinstance(types, dict) and g in types):  # norms and biases stay F32
            writer.add_tensor(g, np.ascontiguousarray(array, dtype=np.float32))
            continue
        data, raw_dtype = quantize_tensor(array, type_for(g, types), placeholder_bytes)
        if raw_dtype is None:
            writer.add_tensor(g, data)
        else:
            writer.add_tensor(g, data, raw_dtype=raw_dtype)
    files = writer.format_shard_names(out_path)
    if split > 1 and len(files) != split:
        raise ValueError(f"{len(tensors)} tensors do not divide into {split} parts of {per_part}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return files
