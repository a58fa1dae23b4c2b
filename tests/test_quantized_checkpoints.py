"""Quantized checkpoints end to end: compressed-tensors folders made here with the
``compressed-tensors`` package, hostile quantization configs, and int8 / int4 on the fly.

1. compressed-tensors: a tiny Llama (and a Qwen2, whose q, k and v projections carry
   biases) gets a ``QuantizationConfig`` applied by the package (targets ``Linear``,
   ``lm_head`` ignored), its scales and zero points computed from the weights by the
   package's ``calculate_qparams``, is compressed by ``ModelCompressor`` (pack-quantized,
   naive-quantized, int-quantized) and saved with its tokenizer. raydecode serves it with
   its layers kept quantized; greedy tokens equal those of transformers' own load of the
   folder (decompressed by compressed-tensors, ``CompressedTensorsConfig(dequantize=True)``),
   up to a near-tie; every layer's ``QuantizedWeight.dequantize()`` equals the package's
   decompression (bit for bit where the scales carry half- or bfloat16-precision values,
   within float32 rounding otherwise).
2. Hostile configs are refused at load with ``ModelLoadError`` naming what they ask for,
   and ``WorkerConfig`` refuses quantization methods it does not run.
3. On the fly: ``quantization="int8"`` / ``"int4"`` quantize the float tiny model; each
   weight is within half a step of the float one, and greedy tokens equal transformers'
   on the dequantized weights.

Checkpoints are built once per module (a fraction of a second each), lazily, so each
test pays only for the folders it uses.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import assert_greedy_equal, generate, make_worker, prompts
from sampler.params import SamplingParams
from worker.config import WorkerConfig
from worker.quant.linear import QuantizedLinear
from worker.runner.model_loader import ModelLoadError, load_model
from worker_driver import MiniDriver

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
#: decoder linear layers of the tiny models: 2 layers x (q, k, v, o, gate, up, down)
LINEARS = 14


@dataclass(frozen=True)
class Variant:
    arch: str  # the tiny model's architecture
    weights: dict  # QuantizationArgs of the weights
    format: str  # the compression format ModelCompressor writes
    label: str  # the format raydecode's load report names (a regular expression)
    exact: bool  # scales rounded to a 16-bit float: the dequantized values are exact


VARIANTS = {
    # W4A16 (llmcompressor's preset, at group 32), scales rounded to half precision
    "llama-w4a16-g32-sym": Variant(
        "llama", dict(num_bits=4, strategy="group", group_size=32, symmetric=True, scale_dtype=torch.float16),
        "pack-quantized", "compressed-tensors int4 g32 sym", exact=True),
    # W4A16_ASYM: zero points, packed along the outputs; float32 scales
    "llama-w4a16-g32-asym": Variant(
        "llama", dict(num_bits=4, strategy="group", group_size=32, symmetric=False),
        "pack-quantized", "compressed-tensors int4 g32 asym", exact=False),
    # W8A16: one scale per output channel, bfloat16 values
    "llama-w8a16-channel": Variant(
        "llama", dict(num_bits=8, strategy="channel", symmetric=True, scale_dtype=torch.bfloat16),
        "pack-quantized", "compressed-tensors int8 channel sym", exact=True),
    # int8 codes stored as int8 tensors
    "llama-int8-naive-channel": Variant(
        "llama", dict(num_bits=8, strategy="channel", symmetric=True),
        "naive-quantized", "compressed-tensors int8 channel sym", exact=False),
    # one scale for the whole tensor, half-precision values (the load report now calls
    # it "channel": each row's scale is the tensor's)
    "llama-int8-int-quantized-tensor": Variant(
        "llama", dict(num_bits=8, strategy="tensor", symmetric=True, scale_dtype=torch.float16),
        "int-quantized", "compressed-tensors int8 (tensor|channel) sym", exact=True),
    # biases on q, k and v, with zero points
    "qwen2-w4a16-g32-asym": Variant(
        "qwen2", dict(num_bits=4, strategy="group", group_size=32, symmetric=False),
        "pack-quantized", "compressed-tensors int4 g32 asym", exact=False),
}


def quiet_from_pretrained(path, **kwargs):
    """transformers' load, without its warning that a passed quantization_config only
    overrides the loading attributes (``dequantize``) of the folder's own."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def weight_qparams(module: nn.Module) -> None:
    """The module's scale (and zero point) from its weight's range, per its scheme's
    strategy, computed by the package (min-max, what llmcompressor's default observer
    does for RTN)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.detach()
    if args.strategy == "group":
        grouped = w.unflatten(-1, (-1, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "tensor":
        lo, hi = w.amin(), w.amax()
    else:
        raise AssertionError(f"no qparams for strategy {args.strategy}")
    scale, zero_point = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def write_compressed(base: nn.Module, tokenizer_dir: str, folder: Path, scheme: dict, fmt: str) -> Path:
    """``base`` (left as it is) quantized with ``scheme`` by compressed-tensors, compressed
    in ``fmt`` and saved with its tokenizer into ``folder``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from transformers import AutoTokenizer

    model = copy.deepcopy(base)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    assert len(quantized) == LINEARS and model.lm_head not in quantized
    for module in quantized:
        weight_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


class Checkpoints:
    """The module's folders and reference models, each made on first use."""

    def __init__(self, root: Path, llama_path: str) -> None:
        self.root = root
        self.sources = {"llama": llama_path}
        self._bases: dict[str, nn.Module] = {}
        self._folders: dict[str, Path] = {}
        self._references: dict[str, nn.Module] = {}

    def source(self, arch: str) -> str:
        """The float tiny model of ``arch``."""
        if arch not in self.sources:
            from tiny_model import build_tiny_model

            self.sources[arch] = str(build_tiny_model(self.root / f"float-{arch}", arch=arch))
        return self.sources[arch]

    def base(self, arch: str) -> nn.Module:
        if arch not in self._bases:
            self._bases[arch] = quiet_from_pretrained(self.source(arch))
        return self._bases[arch]

    def folder(self, name: str) -> Path:
        """The compressed-tensors folder of ``VARIANTS[name]``, or of a scheme named here:
        "w8a8" (int8 activations too) and "fp8" (float8 weights and activations)."""
        if name not in self._folders:
            from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

            if name in VARIANTS:
                v = VARIANTS[name]
                arch, scheme, fmt = v.arch, {"weights": v.weights}, v.format
            else:
                arch, (preset, fmt) = "llama", {"w8a8": ("W8A8", "int-quantized"),
                                                "fp8": ("FP8_DYNAMIC", "float-quantized")}[name]
                scheme = dict(PRESET_SCHEMES[preset])
            self._folders[name] = write_compressed(self.base(arch), self.source(arch), self.root / name, scheme, fmt)
        return self._folders[name]

    def reference(self, name: str) -> nn.Module:
        """transformers' load of the folder, decompressed by compressed-tensors."""
        if name not in self._references:
            from transformers import CompressedTensorsConfig

            self._references[name] = quiet_from_pretrained(
                self.folder(name), quantization_config=CompressedTensorsConfig(dequantize=True))
        return self._references[name]

    def edited(self, name: str, edit, variant: str = "llama-w4a16-g32-sym") -> Path:
        """A copy of ``VARIANTS[variant]``'s folder whose config.json ``edit`` changed."""
        target = self.root / f"edited-{name}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.folder(variant), target)
        config = json.loads((target / "config.json").read_text())
        edit(config)
        (target / "config.json").write_text(json.dumps(config))
        return target


    def tensors_edited(self, variant: str, name: str, edit) -> Path:
        """A copy of ``VARIANTS[variant]``'s folder whose tensors ``edit`` changed (it gets
        the name -> tensor dict and changes it in place)."""
        from safetensors.torch import load_file, save_file

        target = self.root / f"tensors-{name}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.folder(variant), target)
        files = sorted(target.glob("*.safetensors"))
        assert len(files) == 1, files
        tensors = load_file(str(files[0]))
        edit(tensors)
        save_file(tensors, str(files[0]), metadata={"format": "pt"})
        return target


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_path) -> Checkpoints:
    import compressed_tensors.compressors  # noqa: F401  (a process's one-time imports, paid here)
    import transformers.integrations.compressed_tensors  # noqa: F401

    made = Checkpoints(tmp_path_factory.mktemp("quantized-checkpoints"), tiny_model_path)
    made.base("llama")
    return made


def run_greedy(worker, ps: list[list[int]]) -> list[list[int]]:
    driver = MiniDriver(worker.step, max_rows=4, chunk=16)
    for i, p in enumerate(ps):
        driver.submit(f"r{i}", p, GREEDY, arrival_step=i)
    done = driver.run()
    return [done[f"r{i}"].output for i in range(len(ps))]


def assert_greedy_like(reference: nn.Module, worker, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """The worker's greedy tokens on three prompts equal ``reference``'s ``generate``,
    up to a near-tie; returns (prompts, the worker's tokens)."""
    ps = prompts(reference.config.vocab_size, [5, 23, 40], seed=seed)
    outs = run_greedy(worker, ps)
    for p, out in zip(ps, outs):
        assert len(out) == GREEDY.max_tokens
        assert_greedy_equal(reference, p, out, generate(reference, p, len(out)))
    return ps, outs


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


# -- 1. compressed-tensors checkpoints ---------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compressed_checkpoint_serves_quantized_like_transformers(checkpoints, name):
    folder = checkpoints.folder(name)
    qconfig = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == VARIANTS[name].format
    w = make_worker(str(folder))
    # Every decoder linear kept quantized (none dequantized to float), in its format.
    [(label, count)] = w._runner.loaded.quantized.items()
    assert re.fullmatch(VARIANTS[name].label, label) and count == LINEARS, w._runner.loaded.quantized
    ps, outs = assert_greedy_like(checkpoints.reference(name), w)
    if VARIANTS[name].weights["num_bits"] == 4:  # the 4-bit rounding shows in the tokens
        float_model = checkpoints.base(VARIANTS[name].arch)
        assert any(out != generate(float_model, p, len(out)) for p, out in zip(ps, outs))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dequantized_weights_equal_the_packages_decompression(checkpoints, name):
    """Each layer's ``QuantizedWeight.dequantize()`` against the package's compressor
    decompressing that layer's tensors from the folder."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    variant = VARIANTS[name]
    folder = checkpoints.folder(name)
    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k != "version"}).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(variant.format)
    tensors = load_file(folder / "model.safetensors")

    layers = quantized_layers(load_model(str(folder)).model)
    assert len(layers) == LINEARS
    bits = variant.weights["num_bits"]
    for layer_name, layer in layers.items():
        state = {key[len(layer_name) + 1:]: t for key, t in tensors.items() if key.startswith(layer_name + ".")}
        theirs = compressor.decompress(state, scheme)["weight"].float()
        ours = layer.quantized.dequantize()
        assert ours.shape == theirs.shape, layer_name
        if variant.exact:
            assert torch.equal(ours, theirs), f"{layer_name}: {(ours - theirs).abs().max():.3g}"
        else:
            # scale * code + offset rounded in float32 against (code - zero) * scale: a
            # few ulps of the largest code's product
            scale = layer.quantized.scales.repeat_interleave(layer.quantized.group_size, dim=1)
            assert ((ours - theirs).abs() <= scale * 2.0**bits * 2.0**-22).all(), layer_name
        if layer.bias is not None:  # qwen2's q, k, v
            torch.testing.assert_close(layer.bias.float(), tensors[layer_name + ".bias"].float(), rtol=0, atol=0)
    if variant.arch == "qwen2":
        assert sum(layer.bias is not None for layer in layers.values()) == 6


@pytest.mark.parametrize("name", ["llama-w4a16-g32-sym", "llama-int8-naive-channel"])
def test_quantization_none_dequantizes_a_compressed_checkpoint(checkpoints, name):
    w = make_worker(str(checkpoints.folder(name)), quantization="none")
    assert w._runner.loaded.quantized == {}
    assert_greedy_like(checkpoints.reference(name), w, seed=1)


def test_none_on_a_compressed_checkpoint_loads_float_weights(checkpoints):
    """What ``quantization="none"`` gives the worker: every
    decoder linear a float ``nn.Linear`` equal to the package's decompression."""
    name = "llama-w4a16-g32-sym"
    loaded = load_model(str(checkpoints.folder(name)), quantization="none")
    assert loaded.quantized == {}
    reference = dict(checkpoints.reference(name).named_modules())
    for layer_name, module in loaded.model.named_modules():
        if layer_name.startswith("model.layers.") and layer_name.endswith("_proj"):
            assert hasattr(module, "weight") and module.weight.dtype == torch.float32, (
                f"{layer_name} has no float weight: {[n for n, _ in module.named_parameters()]}")
            assert torch.equal(module.weight, reference[layer_name].weight), layer_name



def test_compressed_checkpoint_passes_its_own_quantization_name(checkpoints):
    folder = str(checkpoints.folder("llama-w4a16-g32-sym"))
    assert load_model(folder, quantization="compressed-tensors").quantized == {
        "compressed-tensors int4 g32 sym": LINEARS}
    with pytest.raises(ModelLoadError, match="gguf.*compressed-tensors"):
        load_model(folder, quantization="gguf")


# -- 2. hostile checkpoints and settings -------------------------------------------------


def _group(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]


HOSTILE_EDITS = {
    "unknown strategy": (lambda c: _group(c)["weights"].update(strategy="diagonal"), "diagonal"),
    "unknown type": (lambda c: _group(c)["weights"].update(type="nf4"), "nf4"),
    "unknown format": (lambda c: c["quantization_config"].update(format="marlin-99"), "marlin-99"),
    "block strategy": (lambda c: _group(c)["weights"].update(strategy="block", block_structure=[32, 32],
                                                               group_size=None), "block strategy"),
    "3-bit weights": (lambda c: _group(c)["weights"].update(num_bits=3), "3-bit"),
    "float weights": (lambda c: _group(c)["weights"].update(type="float", num_bits=8), "float"),
    "dynamic weights": (lambda c: _group(c)["weights"].update(dynamic=True), "dynamic"),
    "no weights": (lambda c: _group(c).update(weights=None), "group_0 quantizes no weights"),
    "config_groups not a mapping": (lambda c: c["quantization_config"].update(config_groups="oops"), "config_groups"),
    "activations in the config": (lambda c: _group(c).update(input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}), "activations"),
    "another quant_method": (lambda c: c["quantization_config"].update(quant_method="hqq"), "hqq"),
    "no quant_method": (lambda c: c["quantization_config"].pop("quant_method"), "unknown"),
}


@pytest.mark.parametrize("case", list(HOSTILE_EDITS))
def test_hostile_quantization_config_is_refused_naming_it(checkpoints, case):
    edit, named = HOSTILE_EDITS[case]
    folder = checkpoints.edited(case.replace(" ", "-"), edit)
    with pytest.raises(ModelLoadError, match=named) as info:
        load_model(str(folder))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("value", [["oops"], "int4"])
def test_malformed_quantization_config_is_refused_naming_it(checkpoints, value):
    folder = checkpoints.edited(f"qc-{type(value).__name__}", lambda c: c.update(quantization_config=value))
    with pytest.raises(ModelLoadError, match="quantization_config"):
        load_model(str(folder))


def _set(key: str, value):
    return lambda t: t.__setitem__(key, value(t[key]))


def _drop(key: str):
    return lambda t: t.pop(key)


LAYER = "model.layers.0.self_attn.q_proj"
HOSTILE_TENSORS = {
    "no zero point": ("llama-w4a16-g32-asym", _drop(f"{LAYER}.weight_zero_point"), "weight_zero_point"),
    "zero point of one group": ("llama-w4a16-g32-asym", _set(f"{LAYER}.weight_zero_point", lambda z: z[:, :1].clone()),
                                "weight_zero_point"),
    "scales of no group": ("llama-w4a16-g32-sym", _set(f"{LAYER}.weight_scale", lambda s: s[:, :0].clone()),
                           "weight_scale"),
    "scales in three dimensions": ("llama-w4a16-g32-sym", _set(f"{LAYER}.weight_scale", lambda s: s.unsqueeze(-1)),
                                   "weight_scale"),
    "a NaN scale": ("llama-w8a16-channel", _set(f"{LAYER}.weight_scale", lambda s: s.fill_(float("nan"))), "NaN"),
    "packed codes cut short": ("llama-w4a16-g32-sym", _set(f"{LAYER}.weight_packed", lambda w: w[:, :-1].clone()),
                               "weight_packed"),
    "a bias missing": ("qwen2-w4a16-g32-asym", _drop(f"{LAYER}.bias"), f"{LAYER}.bias"),
    "a bias too long": ("qwen2-w4a16-g32-asym", _set(f"{LAYER}.bias", lambda b: torch.cat([b, b])), f"{LAYER}.bias"),
}


@pytest.mark.parametrize("case", list(HOSTILE_TENSORS))
def test_hostile_tensors_are_refused_naming_them(checkpoints, case):
    variant, edit, named = HOSTILE_TENSORS[case]
    folder = checkpoints.tensors_edited(variant, case.replace(" ", "-"), edit)
    with pytest.raises(ModelLoadError, match=named) as info:
        load_model(str(folder))
    assert isinstance(info.value, ValueError)


def test_naive_codes_outside_their_bits_are_refused(checkpoints):
    """int8 codes under a config that says 4 bits: packed two to a byte, a code past 15
    would leak into its neighbour's nibble."""
    folder = checkpoints.edited("naive-as-int4", lambda c: _group(c)["weights"].update(num_bits=4),
                                variant="llama-int8-naive-channel")
    with pytest.raises(ModelLoadError, match="outside the 4-bit range"):
        load_model(str(folder))


def test_group_size_disagreeing_with_the_scales_is_refused(checkpoints):
    folder = checkpoints.edited("group-64", lambda c: _group(c)["weights"].update(group_size=64))
    with pytest.raises(ModelLoadError, match="group_size|group"):
        load_model(str(folder))


def test_activation_quantizing_scheme_is_refused(checkpoints):
    """A real W8A8 checkpoint (int8 weights, dynamic per-token int8 activations)."""
    folder = checkpoints.folder("w8a8")
    assert _group(json.loads((folder / "config.json").read_text()))["input_activations"]["num_bits"] == 8
    with pytest.raises(ModelLoadError, match="activations"):
        load_model(str(folder))
    with pytest.raises(ModelLoadError, match="activations"):  # through the worker too
        make_worker(str(folder))


def test_fp8_checkpoint_is_refused_by_name(checkpoints):
    folder = checkpoints.folder("fp8")
    with pytest.raises(ModelLoadError, match="float-quantized"):
        load_model(str(folder))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_native_awq_and_gptq_folders_are_refused_naming_them(tiny_model_path, tmp_path, method):
    folder = tmp_path / method
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128, "zero_point": True,
                                     "desc_act": False, "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(config))
    for quantization in (None, method, "none"):
        with pytest.raises(ModelLoadError, match=method) as info:
            load_model(str(folder), quantization=quantization)
        assert isinstance(info.value, ValueError)
    with pytest.raises(ModelLoadError, match=method):
        make_worker(str(folder))


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", "gptq_marlin"])
def test_worker_config_refuses_vllm_methods_by_name(method):
    with pytest.raises(ValueError, match=rf"quantization '{method}' is not supported"):
        WorkerConfig(model="m", quantization=method)


def test_worker_config_refuses_an_unknown_method_with_the_accepted_values():
    with pytest.raises(ValueError, match="quantization must be one of") as info:
        WorkerConfig(model="m", quantization="bogus")
    assert "'bogus'" in str(info.value)
    for accepted in ("compressed-tensors", "gguf", "int8", "int4", "none"):
        assert f"'{accepted}'" in str(info.value)
    with pytest.raises(ValueError, match="quantization must be"):
        WorkerConfig(model="m", quantization=4)


@pytest.mark.parametrize("quantization", [None, "none", "compressed-tensors", "gguf"])
def test_worker_config_refuses_options_without_an_on_the_fly_scheme(quantization):
    with pytest.raises(ValueError, match="quantization_config"):
        WorkerConfig(model="m", quantization=quantization, quantization_config={"group_size": 32})


def test_worker_config_refuses_options_that_are_not_a_mapping():
    with pytest.raises(ValueError, match="quantization_config"):
        WorkerConfig(model="m", quantization="int4", quantization_config=[("group_size", 32)])


# -- 3. on the fly -----------------------------------------------------------------------

#: (quantization, quantization_config) -> formats of the tiny model's layers. Its inputs
#: are 64 wide but for down_proj's 128: int4's default group of 128 falls back to 64.
ON_THE_FLY = {
    "int8": ("int8", None, {"int8 per-channel": LINEARS}),
    "int4": ("int4", None, {"int4 g64 sym": 12, "int4 g128 sym": 2}),
    "int4-g32-asym": ("int4", {"group_size": 32, "symmetric": False}, {"int4 g32 asym": LINEARS}),
}


@pytest.fixture(scope="module")
def float_reference(tiny_model_path) -> nn.Module:
    return quiet_from_pretrained(tiny_model_path)


def dequantized_copy(float_model: nn.Module, quantized_model: nn.Module) -> nn.Module:
    """``float_model`` with each quantized layer's weight replaced by its dequantization."""
    reference = copy.deepcopy(float_model)
    modules = dict(reference.named_modules())
    for name, layer in quantized_layers(quantized_model).items():
        with torch.no_grad():
            modules[name].weight.copy_(layer.quantized.dequantize())
    return reference


def assert_within_half_a_step(float_model: nn.Module, quantized_model: nn.Module) -> int:
    """Every quantized weight within half its group's scale of the float weight;
    returns how many layers were checked."""
    floats = dict(float_model.named_modules())
    layers = quantized_layers(quantized_model)
    for name, layer in layers.items():
        q = layer.quantized
        w = floats[name].weight.detach().float()
        scales = q.scales.repeat_interleave(q.group_size, dim=1)
        bound = scales / 2 + 4 * torch.finfo(torch.float32).eps * w.abs()  # float32 rounding: ulps of |w|
        if "asym" in q.format:
            # The scale is (max - min) / 15 rounded to half precision (2**-11 relative): the
            # 15 steps above the rounded zero point may end short of the max by 15 of those
            # roundings, where the zero point's own rounding already took half a step.
            bound += scales * (2**q.bits - 1) * 2.0**-11
        worst = ((w - q.dequantize()).abs() - bound).max()
        assert worst <= 0, f"{name} ({q.format}): {float(worst):.3g} past half a step"
    return len(layers)


@pytest.mark.parametrize("case", list(ON_THE_FLY))
def test_on_the_fly_weights_are_within_half_a_step(tiny_model_path, float_reference, case):
    quantization, options, formats = ON_THE_FLY[case]
    loaded = load_model(tiny_model_path, quantization=quantization, quantization_config=options)
    assert loaded.quantized == formats
    assert assert_within_half_a_step(float_reference, loaded.model) == LINEARS
    # the embeddings and the output layer stay float
    assert type(loaded.model.lm_head) is nn.Linear and loaded.model.lm_head.weight.dtype == torch.float32
    assert torch.equal(loaded.model.lm_head.weight, float_reference.lm_head.weight)


@pytest.mark.parametrize("case", list(ON_THE_FLY))
def test_on_the_fly_greedy_equals_transformers_on_the_dequantized_weights(tiny_model_path, float_reference, case):
    quantization, options, formats = ON_THE_FLY[case]
    loaded = load_model(tiny_model_path, quantization=quantization, quantization_config=options)
    reference = dequantized_copy(float_reference, loaded.model)
    w = make_worker(tiny_model_path, quantization=quantization, quantization_config=options)
    assert w._runner.loaded.quantized == formats
    assert_greedy_like(reference, w, seed=2)


@pytest.mark.parametrize("case", ["positive layer g32", "tiny model g2"])
def test_asymmetric_int4_of_one_signed_groups_stays_within_half_a_step(tiny_model_path, float_reference, case):
    if case == "positive layer g32":
        from worker.quant.on_the_fly import quantize_int4

        w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.02 + 0.1  # a positive layer
        q = quantize_int4(w, group_size=32, symmetric=False)
        half_step = q.scales.repeat_interleave(32, dim=1) / 2
        assert ((w - q.dequantize()).abs() <= half_step * (1 + 1e-5)).all()
    else:  # groups of two: a quarter of them both positive
        loaded = load_model(tiny_model_path, quantization="int4",
                            quantization_config={"group_size": 2, "symmetric": False})
        assert_within_half_a_step(float_reference, loaded.model)


@pytest.mark.parametrize("options, key", [
    ({"group_size": 3}, "group_size"),
    ({"group_size": 0}, "group_size"),
    ({"group_size": "32"}, "group_size"),
    ({"bits": 2}, "bits"),
    ({"symmetric": "no"}, "symmetric"),
])
def test_bad_on_the_fly_options_are_refused_naming_the_key(tiny_model_path, options, key):
    with pytest.raises(ValueError, match=key):
        load_model(tiny_model_path, quantization="int4", quantization_config=options)


def test_int8_takes_no_options(tiny_model_path):
    with pytest.raises(ValueError, match="group_size"):
        load_model(tiny_model_path, quantization="int8", quantization_config={"group_size": 32})


def test_bad_on_the_fly_options_are_refused_by_the_config(tiny_model_path):
    with pytest.raises(ValueError, match=r"quantization_config: \['bits'\] are not options of int4"):
        make_worker(tiny_model_path, quantization="int4", quantization_config={"bits": 2})


def write_gguf(path: Path) -> Path:
    """A small valid GGUF file (a llama's metadata and one Q8_0 tensor)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    x = np.random.default_rng(0).normal(size=(4, 32)).astype(np.float32)
    raw = quantize(x, GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_on_the_fly_on_a_quantized_checkpoint_names_the_mismatch(checkpoints, tmp_path, scheme):
    gguf = write_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ModelLoadError, match=rf"quantization {scheme} quantizes a float checkpoint.*already gguf"):
        load_model(str(gguf), quantization=scheme)
    folder = str(checkpoints.folder("llama-w4a16-g32-sym"))
    with pytest.raises(ModelLoadError, match=rf"quantization {scheme} .*already compressed-tensors"):
        load_model(folder, quantization=scheme)
    with pytest.raises(ModelLoadError, match="already compressed-tensors"):
        make_worker(folder, quantization=scheme, quantization_config={"group_size": 32} if scheme == "int4" else None)
