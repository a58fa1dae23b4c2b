"""GGUF files end to end: tiny Llama and Qwen2 models written as GGUF here
(tests/gguf_files.py, as llama.cpp's converter writes them), served kept quantized by
the in-process worker, against transformers' own GGUF loader (which dequantizes).

For every type raydecode reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and a
Q4_K_M-like mix: the worker's greedy tokens equal transformers' ``generate`` (up to a
near-tie), the logits of its forwards equal transformers' forward (up to float32
summation order), and its decoder layers really hold quantized weights; the same with
the CPU kernels switched off and with no kernels at all (the torch reference path);
``quantization="none"`` gives the same tokens; a split file loads as one model. Hostile
files (an unsupported type, truncated, a missing part, a quantization option that does
not fit) fail at load with an error that names the problem.

The models are 2 layers of hidden size 256 (the K-quants' super-blocks are 256 values
wide; the suite's usual 64 fits none), built once per module, and each GGUF file is
written the first time a test asks for it.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from gguf.quants import Q4_K as GGUF_Q4_K
from torch import nn

from gguf_files import Q4_K_M, quantize_k, write_gguf
from helpers import assert_greedy_equal, generate, make_worker, prompts
from sampler.params import SamplingParams
from tiny_model import build_tiny_model
from worker.quant.gguf_blocks import FLOAT_TYPES
from worker.quant.gguf_model import gguf_parts
from worker.runner.model_loader import ModelLoadError
from worker_driver import MiniDriver

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
KINDS = [*TYPES, "Q4_K_M"]
SHAPE = dict(hidden_size=256, intermediate_size=512)
#: Gemma 3 as llama.cpp lays it out (every sixth layer global: six layers hold one), its
#: query scale 1 / sqrt(head width) as llama.cpp computes it; Qwen3 with heads 64 wide in
#: a hidden size of 256 over 8 heads (Qwen3-0.6B's mismatch) and no window, as it ships
#: (GGUF has no key for one). Every matrix's rows a multiple of the K-quants' 256.
ARCH_SHAPE = {"gemma3_text": dict(num_hidden_layers=6, layer_types=None, head_dim=64, query_pre_attn_scalar=64),
              "qwen3": dict(use_sliding_window=False, num_attention_heads=8, head_dim=64)}
VOCAB = 400
#: logits of the same weights summed in another order (the suite's float32 tolerance)
LOGIT_TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
#: the worker's switches for its CPU kernels, all off
KERNELS_OFF = dict(cpu_fused_decoder=False, cpu_packed_linear=False, cpu_panel_linear=False,
                   cpu_attention_kernel=False)


def types_of(kind: str) -> dict[str, str] | str:
    return Q4_K_M if kind == "Q4_K_M" else kind


class Files:
    """The module's tiny models, GGUF files and transformers references, each built the
    first time a test asks for it."""

    def __init__(self, tmp_path_factory) -> None:
        self.factory = tmp_path_factory
        self.root = Path(tmp_path_factory.mktemp("gguf"))
        self.models: dict[tuple, Path] = {}
        self.files: dict[tuple, Path] = {}
        self.refs: dict[tuple, nn.Module] = {}

    def model_dir(self, arch: str = "llama", tied: bool = False) -> Path:
        key = (arch, tied)
        if key not in self.models:
            folder = self.factory.mktemp(f"tiny-{arch}{'-tied' if tied else ''}")
            self.models[key] = build_tiny_model(folder, arch=arch, tie_word_embeddings=tied, **SHAPE,
                                                **ARCH_SHAPE.get(arch, {}))
        return self.models[key]

    def path(self, kind: str, arch: str = "llama", tied: bool = False) -> str:
        key = (kind, arch, tied)
        if key not in self.files:
            folder = self.root / f"{arch}{'-tied' if tied else ''}"
            folder.mkdir(exist_ok=True)
            (self.files[key],) = write_gguf(self.model_dir(arch, tied), folder / f"tiny-{kind}.gguf", types_of(kind))
        return str(self.files[key])

    def reference(self, kind: str, arch: str = "llama", tied: bool = False) -> nn.Module:
        """transformers' model of the file (dequantized by its own GGUF loader)."""
        from transformers import AutoModelForCausalLM

        key = (kind, arch, tied)
        if key not in self.refs:
            path = Path(self.path(kind, arch, tied))
            self.refs[key] = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        return self.refs[key]


    def dequantized(self, kind: str, arch: str, tied: bool = False) -> nn.Module:
        """The original model with every matrix replaced by the file's, dequantized by
        the ``gguf`` package: the reference for architectures transformers' own GGUF
        loader gets wrong (a Qwen3 whose heads are not hidden / heads wide, Gemma 3's
        query scale)."""
        from gguf import GGMLQuantizationType, GGUFReader, dequantize
        from transformers import AutoModelForCausalLM

        from gguf_files import ARCHITECTURES, gguf_name

        key = ("dequantized", kind, arch, tied)
        if key not in self.refs:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir(arch, tied), dtype=torch.float32).eval()
            stored = {t.name: t for t in GGUFReader(self.path(kind, arch, tied)).tensors}
            names = ARCHITECTURES[arch][1]
            with torch.no_grad():
                for name, param in model.state_dict().items():
                    t = stored.get(gguf_name(name, names))
                    if t is None or param.dim() < 2:
                        continue
                    values = dequantize(t.data, GGMLQuantizationType(int(t.tensor_type)))
                    param.copy_(torch.from_numpy(np.array(values, dtype=np.float32)).reshape(param.shape))
            self.refs[key] = model
        return self.refs[key]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return Files(tmp_path_factory)


# -- what the checks share ------------------------------------------------------------------


def file_formats(path: str) -> dict[str, int]:
    """The tensor types of a GGUF file (all its parts), counted."""
    return dict(Counter(t.tensor_type.name for part in gguf_parts(path) for t in GGUFReader(part).tensors))


def load_report(path: str) -> dict[str, int]:
    """What the worker's load report should say of the file: its quantized layers as
    "gguf TYPE", its float tensors by type."""
    return {(t if t in FLOAT_TYPES else f"gguf {t}"): n for t, n in file_formats(path).items()}


def assert_layers_quantized(w, path: str) -> None:
    """The worker's load report (and the WorkerInfo the driver gets) names the file's
    types, its weights take the room of quantized ones, and its decoder layers (and
    embeddings) hold no float matrix."""
    from worker.cpu.packed_linear import PackedLinear, PanelLinear
    from worker.cpu.quant_linear import QuantPanelEmbedding, QuantPanelLinear
    from worker.quant.linear import QuantizedEmbedding, QuantizedLinear

    report = load_report(path)
    assert w._runner.loaded.quantized == report
    assert w._runner.info.quantized == {k: n for k, n in report.items() if k not in FLOAT_TYPES}
    float_bytes = 4 * sum(int(np.prod(t.shape)) for part in gguf_parts(path) for t in GGUFReader(part).tensors)
    assert w._runner.weight_bytes < 0.4 * float_bytes  # 6 bits and a scale and offset per 16 at most
    model = w._runner.model
    layers = model.model.layers
    linears = [m for m in layers.modules() if isinstance(m, (nn.Linear, PackedLinear, PanelLinear, QuantizedLinear,
                                                             QuantPanelLinear))]
    assert linears and all(isinstance(m, (QuantizedLinear, QuantPanelLinear)) for m in linears), \
        sorted({type(m).__name__ for m in linears})
    matrices = [n for n, t in [*layers.named_parameters(), *layers.named_buffers()] if t.dim() >= 2]
    assert matrices == [], f"float matrices left in the decoder layers: {matrices}"
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(head, (QuantizedLinear, QuantPanelLinear))
    # A table tied to the output layer is looked up in that layer's panels (held once).
    assert isinstance(embedding, QuantizedEmbedding) or (isinstance(embedding, QuantPanelEmbedding)
                                                         and embedding.head is head)


def run_and_compare(path: str, ref: nn.Module, **config) -> tuple[object, dict[str, list[int]]]:
    """One continuous-batching run on a worker over ``path``: three greedy requests
    (against ``generate``) and one that reports its prompt's logprobs and its sampled
    tokens' raw logits over the whole vocabulary (against one transformers forward).
    Returns the worker and the greedy outputs."""
    w = make_worker(path, logprobs_mode="raw_logits", max_logprobs=-1, **config)
    d = MiniDriver(w.step, max_rows=4, token_budget=48, chunk=16)
    greedy = dict(zip(("a", "b", "c"), prompts(VOCAB, [5, 40, 17], seed=1)))
    for i, (rid, p) in enumerate(greedy.items()):
        d.submit(rid, p, GREEDY, arrival_step=i)
    scored = prompts(VOCAB, [24], seed=3)[0]
    d.submit("logits", scored, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=-1,
                                              logprobs=-1))
    done = d.run()
    outs = {}
    for rid, p in greedy.items():
        assert done[rid].error is None, done[rid].error
        outs[rid] = done[rid].output
        assert_greedy_equal(ref, p, outs[rid], generate(ref, p, len(outs[rid])))
    req = done["logits"]
    with torch.inference_mode():
        logits = ref(torch.tensor([scored + req.output])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    assert len(req.prompt_logprobs) == len(scored) - 1 and len(req.logprobs) == 4
    # Prompt position t (t >= 1) is scored by the logits at t - 1 (log-softmaxed); a
    # sampled token reports the raw logits of its position.
    rows = [(ids, vals, logprobs[t - 1]) for t, (ids, vals, _) in enumerate(req.prompt_logprobs, start=1)]
    rows += [(ids, vals, logits[len(scored) - 1 + j]) for j, (ids, vals, _) in enumerate(req.logprobs)]
    for ids, vals, expected in rows:
        assert len(ids) == VOCAB + 1  # the scored token, then the whole vocabulary by rank
        ours = torch.full((VOCAB,), float("nan"))
        ours[torch.tensor(ids[1:])] = torch.tensor(vals[1:])
        torch.testing.assert_close(ours, expected, rtol=0, atol=LOGIT_TOL)
    return w, outs


# -- the writer's own checks ---------------------------------------------------------------


def _k_steps(raw: np.ndarray, type_name: str) -> np.ndarray:
    """The step of each value of K-quant blocks ``raw [rows, bytes]``: its sub-block's
    scale, read with the gguf package's own unpacking."""
    rows = raw.shape[0]
    if type_name == "Q6_K":
        b = raw.reshape(-1, 210)
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
        steps = d * b[:, 192:208].copy().view(np.int8).astype(np.float32)
        return np.abs(steps).repeat(16, axis=1).reshape(rows, -1)
    b = raw.reshape(-1, 144 if type_name == "Q4_K" else 176)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    sc, _ = GGUF_Q4_K.get_scale_min(b[:, 4:16].copy())
    return (d * sc.astype(np.float32)).repeat(32, axis=1).reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quantizer_round_trips_within_half_a_step(type_name):
    """The helper's K-quant blocks, dequantized by the gguf package: every value within
    half its sub-block's step of the input (all-positive, all-negative, zero, tiny and
    huge rows too), and the step no coarser than the format allows."""
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.normal(0, 0.08, (16, 512)), np.abs(rng.normal(0, 1, (2, 512))), -np.abs(rng.normal(0, 1, (2, 512))),
        np.zeros((1, 512)), rng.normal(0, 1e-4, (1, 512)), rng.normal(0, 300, (2, 512)),
        np.tile(np.linspace(-1, 1, 256), (1, 2)),
    ]).astype(np.float32)
    raw = quantize_k(x, type_name)
    block_bytes = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], 2 * block_bytes)
    values = dequantize(raw, GGMLQuantizationType[type_name]).reshape(x.shape)
    err = np.abs(values - x)
    step = _k_steps(raw, type_name)
    assert (err <= step / 2 * (1 + 1e-5) + 1e-30).all(), float((err / np.maximum(step, 1e-30)).max())
    assert (values[x.shape[0] - 5] == 0).all()  # the zero row
    gaussian = slice(0, 16)
    rms = np.sqrt((err[gaussian] ** 2).mean() / (x[gaussian] ** 2).mean())
    assert rms < {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[type_name], rms


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_f32_file_is_the_original_model(files, arch):
    """The writer itself: an F32 file read back by transformers holds the original
    weights exactly (names; a Llama's query/key permutation undone, a Qwen2's biases),
    its config and its tokenizer (which encodes as the original's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = files.model_dir(arch)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = files.reference("F32", arch)
    assert type(ref) is type(original)
    for name, value in original.state_dict().items():
        torch.testing.assert_close(ref.state_dict()[name], value, rtol=0, atol=0, msg=name)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        assert getattr(ref.config, key, None) == getattr(original.config, key, None), key
    # GGUF stores them as float32
    assert ref.config.rms_norm_eps == pytest.approx(original.config.rms_norm_eps, rel=1e-6)
    assert ref.config.rope_parameters["rope_theta"] == pytest.approx(original.config.rope_parameters["rope_theta"])
    path = Path(files.path("F32", arch))
    tok, tok0 = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), AutoTokenizer.from_pretrained(folder)
    text = "the quick brown fox <think> héllo wörld 日本語 🙂</think><|endoftext|>"
    assert tok.encode(text, add_special_tokens=False) == tok0.encode(text, add_special_tokens=False)
    assert (tok.eos_token_id, tok.bos_token_id) == (tok0.eos_token_id, tok0.bos_token_id)


def test_the_worker_on_an_f32_file_generates_the_originals_tokens(files):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(files.model_dir(), dtype=torch.float32).eval()
    w = make_worker(files.path("F32"))
    assert w._runner.loaded.quantized == {"F32": 21}
    d = MiniDriver(w.step, max_rows=2)
    p = prompts(VOCAB, [20], seed=2)[0]
    d.submit("a", p, GREEDY)
    out = d.run()["a"].output
    assert_greedy_equal(original, p, out, generate(original, p, len(out)))


# -- served quantized -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_llama_kept_quantized_matches_transformers(files, kind):
    path = files.path(kind)
    w, _ = run_and_compare(path, files.reference(kind))
    assert_layers_quantized(w, path)
    expected = {t: n for t, n in file_formats(path).items() if t != "F32"}
    if kind == "Q4_K_M":
        assert expected == {"Q8_0": 1, "Q6_K": 5, "Q4_K": 10}
    else:
        assert expected == {kind: 16}  # 7 per layer, the embeddings, the output layer


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q6_K", "Q4_K_M"])
def test_qwen2_kept_quantized_matches_transformers(files, kind):
    """Qwen2: float biases on q, k and v beside quantized weights; no permutation."""
    path = files.path(kind, "qwen2")
    w, _ = run_and_compare(path, files.reference(kind, "qwen2"))
    assert_layers_quantized(w, path)
    assert file_formats(path)["F32"] == 5 + 6  # the norms, and q/k/v biases of 2 layers


@pytest.mark.parametrize("arch,kind,tied", [("qwen3", "F32", False), ("qwen3", "Q4_K_M", False),
                                             ("gemma3_text", "F32", False), ("gemma3_text", "Q4_K_M", False),
                                             ("gemma3_text", "Q4_K_M", True)])
def test_qwen3_and_gemma3_files_serve_as_the_dequantized_weights(files, arch, kind, tied):
    """Qwen3 (q/k norms, heads 64 wide in a hidden size of 256 over 8 heads:
    transformers' GGUF config drops the width) and Gemma 3 (four norms a layer stored as 1 + w, q/k norms,
    sliding and global layers, llama.cpp's query scale): a Q4_K_M file served kept
    quantized on the fused decoder answers as the original model with the file's
    matrices dequantized by the gguf package; an F32 file as the original model. Gemma's
    embedding scale (sqrt(hidden)) applies to a quantized table too, tied to the output
    layer (as Gemma ships) or not."""
    from transformers import AutoModelForCausalLM

    path = files.path(kind, arch, tied)
    ref = (AutoModelForCausalLM.from_pretrained(files.model_dir(arch), dtype=torch.float32).eval() if kind == "F32"
           else files.dequantized(kind, arch, tied))
    w, _ = run_and_compare(path, ref)
    assert w._runner.backend.decoder is not None  # the fused decoder, on quantized layers
    assert w._runner.model.config.head_dim == 64
    if kind != "F32":
        assert_layers_quantized(w, path)


@pytest.mark.parametrize("kind", ["Q5_1", "Q4_K_M"])
def test_tied_embeddings_share_the_quantized_table(files, kind):
    """No output tensor in the file: the output layer reads the quantized embeddings."""
    path = files.path(kind, tied=True)
    assert "output.weight" not in {t.name for t in GGUFReader(path).tensors}
    w, _ = run_and_compare(path, files.reference(kind, tied=True))
    assert_layers_quantized(w, path)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_K", "Q4_K_M"])
def test_with_the_cpu_kernels_switched_off(files, kind):
    """The transformers forward (no fused decoder, no merged projections, no paged
    attention kernel); the quantized layers keep their kernel."""
    path = files.path(kind)
    w, _ = run_and_compare(path, files.reference(kind), **KERNELS_OFF)
    assert w._runner.backend.decoder is None
    assert_layers_quantized(w, path)


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K", "Q4_K_M"])
def test_without_any_kernel_the_torch_path_matches(files, kind, monkeypatch):
    """Where the CPU kernels cannot load: every quantized layer runs QuantizedLinear's
    torch forward (dequantize, then F.linear)."""
    from worker.cpu import backend
    from worker.quant.linear import QuantizedLinear

    monkeypatch.setattr(backend, "load_kernels", lambda: None)
    path = files.path(kind)
    w, _ = run_and_compare(path, files.reference(kind))
    assert_layers_quantized(w, path)
    layers = w._runner.model.model.layers
    assert all(type(getattr(layer.self_attn, n)) is QuantizedLinear for layer in layers
               for n in ("q_proj", "k_proj", "v_proj", "o_proj"))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K_M"])
def test_quantization_none_dequantizes_to_the_same_tokens(files, kind):
    path = files.path(kind)
    ref = files.reference(kind)
    _, kept = run_and_compare(path, ref)
    w, plain = run_and_compare(path, ref, quantization="none")
    assert w._runner.loaded.quantized == {}
    assert not any("Quantized" in type(m).__name__ or "QuantPanel" in type(m).__name__
                   for m in w._runner.model.modules())
    ps = dict(zip(("a", "b", "c"), prompts(VOCAB, [5, 40, 17], seed=1)))
    for rid, p in ps.items():
        assert_greedy_equal(ref, p, plain[rid], kept[rid])


def test_quantization_gguf_keeps_the_file_quantized(files):
    """"gguf" names the file's own format: kept quantized, as by default."""
    path = files.path("Q5_0")
    w, _ = run_and_compare(path, files.reference("Q5_0"), quantization="gguf")
    assert_layers_quantized(w, path)


def scalar(reader: GGUFReader, key: str) -> int:
    field = reader.fields[key]
    return int(field.parts[field.data[0]][0])


def test_a_split_file_loads_as_one_model(files, tmp_path):
    kind = "Q4_K_M"
    parts = write_gguf(files.model_dir(), tmp_path / "tiny.gguf", types_of(kind), split=3)
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    readers = [GGUFReader(p) for p in parts]
    counts = [len(r.tensors) for r in readers]
    assert all(counts) and sum(counts) == 21
    for i, r in enumerate(readers):
        assert scalar(r, "split.no") == i
        assert scalar(r, "split.count") == 3
        assert scalar(r, "split.tensors.count") == 21
    assert file_formats(str(parts[0])) == file_formats(files.path(kind))
    _, whole = run_and_compare(files.path(kind), files.reference(kind))
    for part in (parts[0], parts[2]):  # any part names them all
        w, split = run_and_compare(str(part), files.reference(kind))
        assert_layers_quantized(w, str(part))
        assert split == whole


# -- hostile files ---------------------------------------------------------------------------


def load_error(path: str, timeout: float = 60.0, **config) -> BaseException:
    """The error loading a worker on ``path`` raises (in a thread: a hang fails the test
    instead of hanging the suite)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(make_worker, path, **config)
        try:
            future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"loading {path} hung for {timeout} s")
        except BaseException as exc:  # noqa: BLE001  (the test inspects it)
            return exc
    pytest.fail(f"{path} loaded")


def test_an_unsupported_quant_type_is_named_before_anything_runs(files, tmp_path):
    path = tmp_path / "iq2.gguf"
    write_gguf(files.model_dir(), path, {"blk.1.ffn_up.weight": "IQ2_XXS", "*": "Q8_0"}, placeholder_bytes=True)
    assert file_formats(str(path))["IQ2_XXS"] == 1
    exc = load_error(str(path))
    assert isinstance(exc, ModelLoadError), repr(exc)
    assert "IQ2_XXS" in str(exc) and "blk.1.ffn_up.weight" in str(exc)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_file_truncated_in_its_tensors_is_refused(files, tmp_path, keep):
    data = Path(files.path("Q4_K")).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    exc = load_error(str(path))
    assert isinstance(exc, ModelLoadError), repr(exc)
    assert "cut.gguf" in str(exc)


@pytest.mark.parametrize("size", [10, 100, 5000])
def test_a_file_truncated_in_its_metadata_is_refused(files, tmp_path, size):
    data = Path(files.path("Q4_K")).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:size])
    exc = load_error(str(path))
    assert isinstance(exc, ModelLoadError), repr(exc)
    assert "cut.gguf" in str(exc) and "truncated or corrupt" in str(exc)


def test_not_a_gguf_file_is_refused(tmp_path):
    for name, data in (("empty.gguf", b""), ("junk.gguf", b"not a gguf file" * 100)):
        (tmp_path / name).write_bytes(data)
        exc = load_error(str(tmp_path / name))
        assert isinstance(exc, ModelLoadError) and name in str(exc), repr(exc)


def test_a_split_file_missing_a_part_names_it(files, tmp_path):
    parts = write_gguf(files.model_dir(), tmp_path / "tiny.gguf", "Q8_0", split=3)
    os.remove(parts[1])
    for part in (parts[0], parts[2]):
        exc = load_error(str(part))
        assert isinstance(exc, ModelLoadError), repr(exc)
        assert "tiny-00002-of-00003.gguf" in str(exc) and "missing" in str(exc)


def _nan_in_one_block(name: str, array: np.ndarray) -> np.ndarray:
    if name == "blk.0.ffn_up.weight":
        array = array.copy()
        array[0, 0] = np.nan
    return array


HOSTILE_TENSORS = {
    # a float tensor of the wrong size, and one of the right size in the wrong shape
    "short norm": ("F32", lambda n, a: a[: len(a) // 2] if n == "output_norm.weight" else a, "output_norm.weight"),
    "transposed embedding": ("F32", lambda n, a: np.ascontiguousarray(a.T) if n == "token_embd.weight" else a,
                             "token_embd.weight"),
    # a quantized tensor where a layer's 1-dimensional weight belongs
    "quantized norm": ({"output_norm.weight": "Q8_0", "*": "Q8_0"}, None, "output_norm.weight"),
    # a NaN in the weights gives a NaN block scale
    "NaN scale": ("Q8_0", _nan_in_one_block, "NaN"),
}


@pytest.mark.parametrize("case", list(HOSTILE_TENSORS))
def test_a_tensor_the_file_got_wrong_is_refused_naming_it(files, tmp_path, case):
    types, tamper, named = HOSTILE_TENSORS[case]
    path = tmp_path / "bad.gguf"
    write_gguf(files.model_dir(), path, types, tamper=tamper)
    exc = load_error(str(path))
    assert isinstance(exc, ModelLoadError), repr(exc)
    assert "bad.gguf" in str(exc) and named in str(exc), str(exc)


@pytest.mark.parametrize(("quantization", "message"), [
    ("compressed-tensors", "does not match"), ("awq", "does not match"), ("int4", "already gguf"),
    ("int8", "already gguf"),
])
def test_a_quantization_that_does_not_fit_the_file_is_refused(files, quantization, message):
    path = files.path("Q4_0")
    exc = load_error(path, quantization=quantization)
    assert isinstance(exc, ModelLoadError), repr(exc)
    assert quantization in str(exc) and message in str(exc) and "gguf" in str(exc)
