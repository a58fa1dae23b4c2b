"""LoRA adapters from remote storage (``worker/lora_fetch.py``), through pyarrow's
``file://`` filesystem (the same calls an ``s3://`` or ``gs://`` URI takes; no network
here): the copy is byte for byte, made once per adapter id and reused, a reload under a
new id is read again; what is missing or too big is refused by name and leaves no
partial folder; concurrent fetches of one adapter agree; the registry keeps the URI and
a worker given the URI runs the adapter as transformers + PEFT do."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cluster.lora import LoRARegistry, LoRARequest
from helpers import assert_greedy_equal, generate, make_worker, prompts
from lora_adapters import ATTENTION, make_adapter, peft_model
from sampler.params import SamplingParams
from worker import LoRAAdapter, LoRAAdapterError, lora_fetch
from worker.lora_adapter import CONFIG_FILE, WEIGHTS_FILE

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tiny_model_path, tmp_path_factory) -> str:
    return make_adapter(tiny_model_path, tmp_path_factory.mktemp("remote-loras") / "qv", ATTENTION, r=8, alpha=16,
                        seed=41)


def uri(path: str | Path) -> str:
    return f"file://{Path(path).resolve()}"


def test_a_remote_adapter_is_copied_once_per_id_byte_for_byte(adapter, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    local = lora_fetch.adapter_folder(uri(adapter), 7, str(cache))
    assert sorted(os.listdir(local)) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (Path(local) / name).read_bytes() == (Path(adapter) / name).read_bytes()
    fetched = []
    monkeypatch.setattr(lora_fetch, "_fetch", lambda u, into: fetched.append(u) or pytest.fail("fetched again"))
    assert lora_fetch.adapter_folder(uri(adapter), 7, str(cache)) == local
    monkeypatch.undo()
    again = lora_fetch.adapter_folder(uri(adapter), 8, str(cache))  # a reload under a new id
    assert again != local and os.path.isfile(os.path.join(again, WEIGHTS_FILE))
    assert not [n for n in os.listdir(cache) if n.startswith(".fetch-")]
    assert lora_fetch.adapter_folder(adapter, 7, str(cache)) == os.path.abspath(adapter)  # local: as it is


def test_missing_or_oversized_remote_folders_are_refused_and_leave_nothing(adapter, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    with pytest.raises(LoRAAdapterError, match="is not a folder"):
        lora_fetch.adapter_folder(uri(tmp_path / "nowhere"), 1, str(cache))
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / WEIGHTS_FILE).write_bytes((Path(adapter) / WEIGHTS_FILE).read_bytes())
    with pytest.raises(LoRAAdapterError, match=f"has no {CONFIG_FILE}"):
        lora_fetch.adapter_folder(uri(no_config), 1, str(cache))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / CONFIG_FILE).write_bytes((Path(adapter) / CONFIG_FILE).read_bytes())
    with pytest.raises(LoRAAdapterError, match=f"has no {WEIGHTS_FILE}"):
        lora_fetch.adapter_folder(uri(no_weights), 1, str(cache))
    monkeypatch.setattr(lora_fetch, "MAX_WEIGHTS_BYTES", 1000)
    with pytest.raises(LoRAAdapterError, match="over 1000 bytes"):
        lora_fetch.adapter_folder(uri(adapter), 1, str(cache))
    assert os.listdir(cache) == []


@pytest.mark.parametrize("path,match", [
    ("ftp://host/loras/a", "URI scheme 'ftp' is not supported"),
    ("s3://", "names no folder"),
    ("", "must be a folder path or a URI"),
    ("a\x00b", "must be a folder path or a URI"),
])
def test_bad_locations_are_refused_by_name(path, match):
    with pytest.raises(LoRAAdapterError, match=match):
        lora_fetch.check_location(path, "lora_path")


def test_join_and_location_keep_uris_and_make_local_paths_absolute():
    assert lora_fetch.join("s3://bucket/loras/", "qv") == "s3://bucket/loras/qv"
    assert lora_fetch.join("/srv/loras", "qv") == "/srv/loras/qv"
    assert lora_fetch.location("gs://b/x") == "gs://b/x"
    assert lora_fetch.location("rel/x") == os.path.abspath("rel/x")


def test_concurrent_fetches_of_one_adapter_agree(adapter, tmp_path):
    cache, results, errors = str(tmp_path / "cache"), [], []

    def fetch() -> None:
        try:
            results.append(lora_fetch.adapter_folder(uri(adapter), 3, cache))
        except Exception as exc:  # pragma: no cover - what the test looks for
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(os.listdir(cache)) == [os.path.basename(results[0])]


def test_the_registry_keeps_the_uri_and_a_worker_runs_the_remote_adapter_as_peft(tiny_model_path, adapter,
                                                                                 tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from worker.runner.lora import adaptable_linears
    from worker_driver import MiniDriver

    monkeypatch.setenv("RAYDECODE_LORA_CACHE", str(tmp_path / "cache"))
    registry = LoRARegistry(True, 16, adaptable_linears(AutoModelForCausalLM.from_pretrained(tiny_model_path)))
    checked = registry.check(LoRARequest("qv", 5, uri(adapter)))
    assert checked == LoRAAdapter(id=5, name="qv", path=uri(adapter))
    with pytest.raises(ValueError, match="is not a folder"):
        registry.check(LoRARequest("gone", 6, uri(tmp_path / "gone")))
    w = make_worker(tiny_model_path, enable_lora=True, max_loras=1, max_lora_rank=16)
    ps = prompts(400, [6, 19], seed=5)
    driver = MiniDriver(w.step, max_rows=2, token_budget=48, chunk=16)
    for i, p in enumerate(ps):
        driver.submit(f"r{i}", p, GREEDY, lora=checked)
    done = driver.run()
    ours = [done[f"r{i}"].output for i in range(len(ps))]
    ref = peft_model(tiny_model_path, adapter)
    base = peft_model(tiny_model_path, None)
    for p, out in zip(ps, ours):
        assert_greedy_equal(ref, p, out, generate(ref, p, len(out)))
        assert out != generate(base, p, len(out))
