"""LoRA adapters: in-process workers against transformers + PEFT, the adapter checks,
the scheduler's adapter slots and the prefix cache's separation (no Ray here; the
served paths are in tests/test_lora_served.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cluster.lora import LoRARegistry, LoRARequest
from helpers import assert_greedy_equal, generate, make_worker, prompts
from lora_adapters import ALL_SEVEN, ATTENTION, make_adapter, peft_model
from sampler.params import SamplingParams
from worker import LoRAAdapter, LoRAAdapterError, inspect_adapter
from worker.lora_adapter import read_adapter
from worker_driver import MiniDriver

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "qv8": make_adapter(tiny_model_path, root / "qv8", ATTENTION, r=8, alpha=16, seed=1),
        "all4_rs": make_adapter(tiny_model_path, root / "all4_rs", ALL_SEVEN, r=4, alpha=8, seed=2, use_rslora=True),
        "mlp16": make_adapter(tiny_model_path, root / "mlp16", ["gate_proj", "down_proj"], r=16, alpha=4, seed=3,
                              rank_pattern={"down_proj": 2}, alpha_pattern={"gate_proj": 32}),
    }


def spec(adapters: dict[str, str], name: str, adapter_id: int) -> LoRAAdapter:
    return LoRAAdapter(id=adapter_id, name=name, path=adapters[name])


def run_mixed(worker, jobs: list[tuple[list[int], LoRAAdapter | None]], chunk: int = 16, swap_seed=None) -> list[list[int]]:
    driver = MiniDriver(worker.step, max_rows=4, token_budget=48, chunk=chunk, swap_seed=swap_seed)
    for i, (p, lora) in enumerate(jobs):
        driver.submit(f"r{i}", p, GREEDY, arrival_step=i % 3, lora=lora)
    done = driver.run()
    return [done[f"r{i}"].output for i in range(len(jobs))]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decoder", "transformers-forward"])
def test_mixed_adapters_in_one_batch_equal_peft(tiny_model_path, adapters, fused):
    """Rows of three adapters (ranks 8, 4 with rsLoRA on all seven linears, 16 with
    rank and alpha patterns) and of the base model share steps, prefill chunks and row
    moves; each row's greedy tokens equal transformers + PEFT's for its adapter."""
    w = make_worker(tiny_model_path, enable_lora=True, max_loras=3, max_lora_rank=16, cpu_fused_decoder=fused)
    assert (w._runner.backend.decoder is not None) == fused
    names = [None, "qv8", "all4_rs", "mlp16"]
    ps = prompts(400, [5, 23, 40, 9, 17, 31], seed=3)
    jobs = [(p, None if names[i % 4] is None else spec(adapters, names[i % 4], 1 + i % 4)) for i, p in enumerate(ps)]
    ours = run_mixed(w, jobs, chunk=7, swap_seed=2)
    references = {name: peft_model(tiny_model_path, adapters.get(name)) for name in names}
    for i, (p, out) in enumerate(zip(ps, ours)):
        ref_model = references[names[i % 4]]
        assert_greedy_equal(ref_model, p, out, generate(ref_model, p, len(out)))
    base = references[None]
    differs = [out != generate(base, p, len(out)) for i, (p, out) in enumerate(zip(ps, ours)) if names[i % 4]]
    assert all(differs), "an adapter's output equals the base model's: the test could not tell them apart"
    assert w._runner.lora.num_loads == 3


@pytest.mark.parametrize("arch,targets", [("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
                                          ("qwen3", ALL_SEVEN)])
def test_fused_checkpoint_projections_and_qk_norms_take_adapters(arch, targets, tmp_path_factory):
    """Phi-3 ships q/k/v and gate/up fused (adapters attach to them whole); Qwen3 norms
    q and k per head after the projection: both equal PEFT."""
    from tiny_model import build_tiny_model

    base = str(build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch))
    adapter = make_adapter(base, tmp_path_factory.mktemp(f"{arch}-lora"), targets, r=4, alpha=8, seed=5)
    w = make_worker(base, enable_lora=True, max_loras=2)
    assert w._runner.backend.decoder is not None
    lora = LoRAAdapter(id=7, name="a", path=adapter)
    ps = prompts(400, [6, 19, 33], seed=8)
    ours = run_mixed(w, [(ps[0], lora), (ps[1], None), (ps[2], lora)])
    ref = peft_model(base, adapter)
    for p, out, has in zip(ps, ours, [True, False, True]):
        model = ref if has else peft_model(base, None)
        assert_greedy_equal(model, p, out, generate(model, p, len(out)))


def test_int8_base_with_a_float_adapter_equals_peft_on_the_dequantized_base(tiny_model_path, adapters, tmp_path):
    """An adapter over quantized base weights (QLoRA's setting): transformers holding
    the int8 scheme's dequantized weights (docs: max |w| / 127 per row, the scale in
    half precision, codes rounded), PEFT's adapter on top, is the reference."""
    w = make_worker(tiny_model_path, enable_lora=True, quantization="int8")
    assert w._runner.info.quantized
    reference = peft_model(tiny_model_path, None)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if name.rsplit(".", 1)[-1] in ALL_SEVEN:
                weight = module.weight
                scale = (weight.abs().amax(dim=1, keepdim=True) / 127).half().float()
                weight.copy_(torch.clamp(torch.round(weight / scale), -127, 127) * scale)
    reference.save_pretrained(tmp_path / "dequantized")
    for f in Path(tiny_model_path).glob("tokenizer*"):
        (tmp_path / "dequantized" / f.name).write_bytes(f.read_bytes())
    ref = peft_model(str(tmp_path / "dequantized"), adapters["qv8"])
    ps = prompts(400, [7, 21], seed=11)
    ours = run_mixed(w, [(p, spec(adapters, "qv8", 3)) for p in ps])
    for p, out in zip(ps, ours):
        assert_greedy_equal(ref, p, out, generate(ref, p, len(out)))


def test_scales_equal_peft(tiny_model_path, adapters):
    """rsLoRA, rank_pattern and alpha_pattern resolve to PEFT's own scaling."""
    for name, folder in adapters.items():
        modules = inspect_adapter(folder, 16, _targets(tiny_model_path))
        model = peft_model(tiny_model_path, folder)
        for module, info in modules.items():
            layer = model.get_submodule(module)
            assert math.isclose(info.scale, layer.scaling["default"], rel_tol=1e-9), (name, module)
            assert info.rank == layer.r["default"]


def _targets(path: str) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    from worker.runner.lora import adaptable_linears

    return adaptable_linears(AutoModelForCausalLM.from_pretrained(path))


# -- hostile folders and names --------------------------------------------------------


def _copy(folder: str, dest: Path, **config_changes) -> str:
    dest.mkdir()
    for f in Path(folder).iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    if config_changes:
        config = json.loads((dest / "adapter_config.json").read_text())
        config.update(config_changes)
        (dest / "adapter_config.json").write_text(json.dumps(config))
    return str(dest)


def test_bad_adapter_folders_are_refused_naming_what_is_wrong(tiny_model_path, adapters, tmp_path):
    targets = _targets(tiny_model_path)
    good = adapters["qv8"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "notpeft").mkdir()
    (tmp_path / "notpeft" / "adapter_config.json").write_text("[1, 2]")
    bin_only = Path(_copy(good, tmp_path / "bin"))
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    garbage = Path(_copy(good, tmp_path / "garbage"))
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    cases = [
        (str(tmp_path / "missing"), "is not a folder"),
        (str(tmp_path / "empty"), "has no adapter_config.json"),
        (str(tmp_path / "notpeft"), "not a JSON object"),
        (_copy(good, tmp_path / "prefix", peft_type="PREFIX_TUNING"), "only LORA adapters"),
        (_copy(good, tmp_path / "dora", use_dora=True), "use_dora"),
        (_copy(good, tmp_path / "bias", bias="all"), "bias is not supported"),
        (_copy(good, tmp_path / "mts", modules_to_save=["lm_head"]), "modules_to_save"),
        (_copy(good, tmp_path / "rank", r=4), "the config says 4"),
        (_copy(good, tmp_path / "alpha", lora_alpha=-1), "lora_alpha must be a positive number"),
        (str(bin_only), "save with safe_serialization=True"),
        (str(garbage), "not a safetensors file"),
        (make_adapter(tiny_model_path, tmp_path / "embed", ["embed_tokens"], r=2), "the token embedding"),
        (make_adapter(tiny_model_path, tmp_path / "head", ["lm_head"], r=2), "the LM head"),
    ]
    for folder, message in cases:
        with pytest.raises(LoRAAdapterError, match=message):
            inspect_adapter(folder, 16, targets)
    with pytest.raises(LoRAAdapterError, match="rank 8 is over max_lora_rank 4"):
        inspect_adapter(good, 4, targets)
    with pytest.raises(LoRAAdapterError, match="the model has no such module"):
        inspect_adapter(good, 16, {k: v for k, v in targets.items() if "layers.1.self_attn.q_proj" not in k})
    with pytest.raises(LoRAAdapterError, match="do not fit the model"):
        inspect_adapter(good, 16, {k: [v[0] * 2, v[1]] for k, v in targets.items()})


def test_nan_weights_are_refused_at_read(tiny_model_path, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = Path(_copy(adapters["qv8"], tmp_path / "nan"))
    tensors = load_file(bad / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="NaN or infinity"):
        read_adapter(str(bad), 16, _targets(tiny_model_path), torch.float32)


@pytest.mark.parametrize("name", ["../etc", "a/b", "a\\b", "", ".hidden", "x" * 200, "a\x00b", 7])
def test_adapter_names_with_separators_or_odd_bytes_are_refused(name, tmp_path):
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest(name, 1, str(tmp_path))


@pytest.mark.parametrize("adapter_id", [0, -1, 2**31, True, 1.5, "1"])
def test_adapter_ids_outside_the_range_are_refused(adapter_id, tmp_path):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", adapter_id, str(tmp_path))


def test_the_registry_checks_once_and_refuses_an_id_reused(tiny_model_path, adapters):
    registry = LoRARegistry(True, 16, _targets(tiny_model_path))
    first = registry.check(LoRARequest("qv8", 1, adapters["qv8"]))
    assert registry.check(LoRARequest("qv8", 1, adapters["qv8"])) is first
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'qv8'"):
        registry.check(LoRARequest("other", 1, adapters["mlp16"]))
    with pytest.raises(ValueError, match="without enable_lora"):
        LoRARegistry(False, 16, {}).check(LoRARequest("qv8", 1, adapters["qv8"]))


def test_a_worker_without_enable_lora_refuses_an_adapter_row(tiny_model_path, adapters):
    from worker import ProtocolError

    w = make_worker(tiny_model_path)
    with pytest.raises(ProtocolError, match="without enable_lora"):
        run_mixed(w, [(prompts(400, [5])[0], spec(adapters, "qv8", 1))])


def test_lora_config_is_validated():
    from worker.config import WorkerConfig

    for kw, message in [({"max_loras": 0}, "max_loras"), ({"max_lora_rank": -1}, "max_lora_rank"),
                        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras must be >= max_loras"),
                        ({"enable_lora": 1}, "enable_lora")]:
        with pytest.raises(ValueError, match=message):
            WorkerConfig(**kw)
    WorkerConfig(enable_lora=True, tensor_parallel_size=2, pipeline_parallel_size=2)  # each rank its cut


# -- the driver: adapter slots and the prefix cache -----------------------------------


class _Tok:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids, **_):
        return [chr(97 + i % 26) for i in ids]


def _seq(seq_id: str, lora: LoRAAdapter | None, prompt=None):
    from cluster.sequence import Sequence

    seq = Sequence(seq_id, 0, prompt or list(range(40)), SamplingParams(max_tokens=4), _Tok(), 256)
    seq.lora = lora
    return seq


def test_a_batch_holds_at_most_max_loras_distinct_adapters_and_the_rest_wait():
    from cluster.scheduler import WaitingQueue, WorkerScheduler

    a, b, c = (LoRAAdapter(id=i, name=n, path="/x") for i, n in ((1, "a"), (2, "b"), (3, "c")))
    s = WorkerScheduler(max_rows=8, max_num_batched_tokens=1024, kv_blocks=64, kv_block_size=16, max_loras=2)
    waiting = WaitingQueue()
    seqs = [_seq("0", a), _seq("1", b), _seq("2", c), _seq("3", a), _seq("4", None), _seq("5", b)]
    for i, seq in enumerate(seqs):
        seq.order = i
        waiting.push(seq)
    step, _ = s.schedule(waiting, share=8)
    placed = {seq.seq_id for seq in s.running}
    assert placed == {"0", "1", "3", "4", "5"}  # c waits: a and b hold the two slots
    assert [q.seq_id for q in [waiting.pop()]] == ["2"]
    added = {a.request_id: a.lora for a in step.message.added}
    assert added["0"] == a and added["4"] is None


def test_prefix_keys_differ_between_adapters_and_the_base():
    from cluster.block_manager import BlockManager

    blocks = BlockManager(16, 8, True, "salt")
    a, b = LoRAAdapter(id=1, name="a", path="/a"), LoRAAdapter(id=2, name="b", path="/b")
    keys = {name: _seq(name, lora).full_block_keys(blocks, 3) for name, lora in (("base", None), ("a", a), ("b", b))}
    assert len({k for ks in keys.values() for k in ks}) == 9  # no block key shared
    assert _seq("a2", a).full_block_keys(blocks, 3) == keys["a"]  # the same adapter shares its prefixes


@pytest.mark.smollm2
def test_smollm2_with_adapters_mixed_in_a_batch_equals_peft(tmp_path):
    """The real model (SmolLM2-135M, float32, the fused decoder): rank-16 adapters on
    q/v and on all seven linears, rows of both and of the base model in one batch."""
    from transformers import AutoTokenizer

    from worker.runner.model_loader import default_model_path

    base = str(default_model_path())
    qv = make_adapter(base, tmp_path / "qv", ATTENTION, r=16, alpha=32, seed=31, std=0.08)
    seven = make_adapter(base, tmp_path / "seven", ALL_SEVEN, r=16, alpha=16, seed=32, std=0.08)
    tok = AutoTokenizer.from_pretrained(base)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers."]
    ps = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    ps = [p if isinstance(p, list) else p["input_ids"] for p in ps]
    w = make_worker(base, enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=512)
    assert w._runner.backend.decoder is not None
    specs = [LoRAAdapter(id=1, name="qv", path=qv), LoRAAdapter(id=2, name="seven", path=seven), None]
    jobs = [(p, specs[(i + j) % 3]) for i, p in enumerate(ps) for j in range(3)]
    driver = MiniDriver(w.step, max_rows=4, token_budget=96, chunk=32)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, (p, lora) in enumerate(jobs):
        driver.submit(f"r{i}", p, params, lora=lora)
    done = driver.run()
    models = {"qv": peft_model(base, qv), "seven": peft_model(base, seven), None: peft_model(base, None)}
    for i, (p, lora) in enumerate(jobs):
        model = models[lora.name if lora else None]
        ours = done[f"r{i}"].output
        assert_greedy_equal(model, p, ours, generate(model, p, len(ours)))
    for i, (p, lora) in enumerate(jobs):
        if lora is not None:
            assert done[f"r{i}"].output != generate(models[None], p, 16), "an adapter changed nothing"
