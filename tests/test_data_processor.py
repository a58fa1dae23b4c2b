"""Batch inference over Ray Datasets (``deploy.data``, Ray Data LLM's shape) on the tiny
model: every row's output equals ``LLM.generate`` on the same row (greedy and seeded,
chat and completion rows, ids kept) over two engine replicas, also when one replica is
killed mid-run; rows that fail alone get ``__inference_error__``; Ray's own documented
example runs with only its import line changed; and the config refuses what it cannot
honour, naming the field."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import signal
import sys
import textwrap
from collections import Counter

import psutil
import pytest
import ray

from cluster import LLM
from deploy.data import (
    ChatTemplateStageConfig,
    TokenizerStageConfig,
    build_processor,
    vLLMEngineProcessorConfig,
)
from sampler.params import SamplingParams

TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ENGINE = dict(max_num_seqs=32, max_model_len=256, max_num_batched_tokens=256, worker_num_cpus=1)
# Ray's workers cannot import this module (tests/ is not on their path): the row
# functions it hands Ray Data travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORDS = "the quick brown fox jumps over a lazy dog while seven cats watch from high walls".split()


@pytest.fixture(scope="module")
def chat_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with a chat template saved beside its tokenizer (as real models
    carry one)."""
    folder = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(folder)


def text_of(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 11)) + f" {i}"


def row_params(i: int) -> dict:
    if i % 3 == 0:
        return dict(temperature=0.8, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True)
    return dict(temperature=0.0, max_tokens=4 + i % 5, ignore_eos=True)


def preprocess(row: dict) -> dict:
    i = int(row["id"])
    if i % 2:
        return dict(messages=[{"role": "user", "content": text_of(i)}], sampling_params=row_params(i))
    return dict(prompt=text_of(i), sampling_params=row_params(i))


def reference(model: str, ids: list[int]) -> dict[int, list[int]]:
    """``LLM.generate`` / ``LLM.chat`` on one engine, row by row the same inputs."""
    llm = LLM(model, **ENGINE)
    try:
        chat = [i for i in ids if i % 2]
        plain = [i for i in ids if not i % 2]
        outs = llm.generate([text_of(i) for i in plain], [SamplingParams(**row_params(i)) for i in plain],
                            use_tqdm=False)
        outs += llm.chat([[{"role": "user", "content": text_of(i)}] for i in chat],
                         [SamplingParams(**row_params(i)) for i in chat], use_tqdm=False)
        return {i: o.outputs[0].token_ids for i, o in zip(plain + chat, outs)}
    finally:
        llm.shutdown()


def engine_replica_pids() -> list[int]:
    """The processes of the processor's engine replicas (Ray names them by their stage)."""
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "MapBatches(EngineStage)" in " ".join(p.info["cmdline"] or [])]


@pytest.fixture(scope="module")
def expected(ray_local, chat_model) -> dict[int, list[int]]:
    return reference(chat_model, list(range(800)))


def run(model: str, rows: int, *, on_progress=None, **config) -> list[dict]:
    processor = build_processor(
        vLLMEngineProcessorConfig(model_source=model, engine_kwargs=ENGINE,
                                  **{"concurrency": (2, 2), "batch_size": 32, **config}),
        preprocess=preprocess,
        postprocess=lambda row: dict(id=row["id"], tokens=row["generated_tokens"], text=row["generated_text"],
                                     n=row["num_generated_tokens"], prompt_len=row["num_input_tokens"],
                                     finish=row["finish_reason"]),
    )
    out = []
    for row in processor(ray.data.range(rows, override_num_blocks=16)).iter_rows():
        out.append(row)
        if on_progress is not None:
            on_progress(len(out))
    return out


@pytest.mark.slow
def test_two_replicas_give_every_row_what_llm_generate_gives_though_one_is_killed(ray_local, chat_model, expected):
    """800 rows (chat and completion, greedy and seeded) over two replicas, one of
    them SIGKILLed (as the OOM killer would) once 200 rows are out: Ray Data restarts it
    and retries its batches; every id comes back once, with LLM.generate's tokens."""
    killed: list[int] = []

    def kill_one(done: int) -> None:
        if done >= 200 and not killed:
            pids = engine_replica_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    rows = run(chat_model, 800, on_progress=kill_one, batch_size=16)
    assert killed, "the run ended before a replica was killed"
    counts = Counter(r["id"] for r in rows)
    assert len(counts) == 800 and set(counts.values()) == {1}, "every id exactly once"
    mismatched = [r["id"] for r in rows if list(r["tokens"]) != expected[r["id"]]]
    assert mismatched == [], f"{len(mismatched)} rows differ from LLM.generate, e.g. {mismatched[:5]}"
    assert all(r["n"] == len(r["tokens"]) and r["finish"] == "length" for r in rows)


@pytest.mark.slow
def test_rows_that_fail_alone_get_the_error_column(ray_local, chat_model):
    bad = {
        1: dict(prompt="fine", sampling_params=dict(temperature=-1.0, max_tokens=4)),
        2: dict(prompt="fine", sampling_params=dict(max_tokens=4, bogus=1)),
        3: dict(prompt="word " * 400, sampling_params=dict(max_tokens=4)),
        4: dict(messages=[{"content": "no role"}], sampling_params=dict(max_tokens=4)),
        5: dict(messages="not a list", sampling_params=dict(max_tokens=4)),
    }

    def pre(row: dict) -> dict:
        i = int(row["id"])
        return bad.get(i, dict(prompt=text_of(i), sampling_params=dict(temperature=0.0, max_tokens=4)))

    config = vLLMEngineProcessorConfig(model_source=chat_model, engine_kwargs=ENGINE, concurrency=1, batch_size=4,
                                       should_continue_on_error=True)
    processor = build_processor(config, preprocess=pre,
                                postprocess=lambda row: dict(id=row["id"], n=row["num_generated_tokens"]))
    rows = {r["id"]: r for r in processor(ray.data.range(12)).take_all()}
    assert sorted(rows) == list(range(12))
    errors = {i: r["__inference_error__"] for i, r in rows.items() if r["__inference_error__"]}
    assert sorted(errors) == [1, 2, 3, 4, 5]
    assert "temperature" in errors[1] and "bogus" in errors[2] and "too long" in errors[3]
    assert "messages" in errors[4] and "messages" in errors[5]
    assert all(rows[i]["n"] == 4 for i in rows if i not in errors)

    strict = build_processor(config.model_copy(update={"should_continue_on_error": False}), preprocess=pre)
    with pytest.raises(Exception, match="temperature|bogus|too long|messages"):
        strict(ray.data.range(12)).take_all()


@pytest.mark.slow
def test_rays_documented_example_runs_with_only_its_import_changed(ray_local, chat_model, capsys):
    """The example in Ray's own ``vLLMEngineProcessorConfig`` docstring (the installed
    Ray), its import line changed to ``deploy.data`` and its hub model id to a local
    folder (no hub here)."""
    import ray.data.llm as ray_llm

    doc = inspect.getdoc(ray_llm.vLLMEngineProcessorConfig)
    block = doc.split(".. testcode::", 1)[1].split(":skipif: True", 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    source = textwrap.dedent("\n".join(lines))
    assert "from ray.data.llm import vLLMEngineProcessorConfig, build_processor" in source
    source = source.replace("from ray.data.llm import", "from deploy.data import")
    model_id = re.search(r'model_source="([^"]+)"', source).group(1)
    source = source.replace(f'"{model_id}"', repr(chat_model))
    exec(compile(source, "ray_data_llm_example", "exec"), {"__name__": "example"})
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(printed) == 300 and all("'resp'" in line for line in printed)


def test_the_config_refuses_what_it_cannot_honour_by_name():
    ok = dict(model_source="/some/model")
    cases = [
        (dict(no_such_field=1), "no_such_field"),
        (dict(concurrency=0), "concurrency"),
        (dict(concurrency=(3, 2)), "concurrency"),
        (dict(batch_size=0), "batch_size"),
        (dict(task_type="score"), "task_type"),
        (dict(task_type="embed", engine_kwargs={"runner": "generate"}), "engine_kwargs.runner"),
        (dict(task_type="nonsense"), "task_type"),
        (dict(engine_kwargs={"no_such_arg": 1}), "engine_kwargs.no_such_arg"),
        (dict(engine_kwargs={"kv_transfer_config": {}}), "engine_kwargs.kv_transfer_config"),
        (dict(engine_kwargs={"api_key": "k"}), "engine_kwargs.api_key"),
        (dict(engine_kwargs={"tool_call_parser": "hermes"}), "engine_kwargs.tool_call_parser"),
        (dict(engine_kwargs={"max_num_seqs": "many"}), "max_num_seqs"),
        (dict(prepare_multimodal_stage=True), "prepare_multimodal_stage"),
        (dict(chat_template_stage={"bogus": 1}), "chat_template_stage"),
        (dict(tokenize_stage=3), "tokenize_stage"),
        (dict(dynamic_lora_loading_path="ftp://bucket/adapters"), "dynamic_lora_loading_path: URI scheme 'ftp'"),
        (dict(placement_group_config={"bundles": [{"CPU": 1}]}), "placement_group_config.bundles"),
        (dict(max_concurrent_batches=0), "max_concurrent_batches"),
    ]
    for extra, name in cases:
        with pytest.raises(ValueError, match=re.escape(name)):
            vLLMEngineProcessorConfig(**ok, **extra)
    config = vLLMEngineProcessorConfig(**ok, engine_kwargs={"enable_prefix_caching": True, "max_num_seqs": 8,
                                                            "data_parallel_size": 2, "task_type": "generate"},
                                       chat_template_stage=ChatTemplateStageConfig(batch_size=8),
                                       tokenize_stage={"concurrency": 2})
    assert config.engine_spec().engine == {"enable_prefix_caching": True, "max_num_seqs": 8, "num_workers": 2}
    assert config.pending_limit(config.engine_spec().config()) == 18  # ceil(1.1 * 8 seqs * 2 workers)
    assert config.stage("chat_template_stage").batch_size == 8
    assert config.stage("tokenize_stage").concurrency == 2 and config.stage("tokenize_stage").batch_size == 32
    assert isinstance(config.stage("tokenize_stage"), TokenizerStageConfig)
    with pytest.raises(ValueError, match="builder_kwargs.nope"):
        build_processor(config, builder_kwargs={"nope": 1})


@pytest.mark.multinode
def test_a_node_removed_mid_run_loses_and_repeats_no_row(chat_model, expected):
    """Three Ray nodes on this machine (``ray.cluster_utils.Cluster``, as
    tests/test_multinode.py), the head too small for both replicas' workers; once 100
    rows are out, the other node holding most of the processor's actors (a replica and
    its workers, or a worker) is removed with whatever else is on it (stage actors,
    blocks): every id still comes back once, with LLM.generate's tokens."""
    from test_multinode import local_cluster

    health = {"health_check_period_ms": 300, "health_check_failure_threshold": 3}
    with local_cluster({"num_cpus": 1, "_system_config": health}, {"num_cpus": 2}) as (cluster, second):
        third = cluster.add_node(num_cpus=2)
        removed: list[list[str]] = []

        def remove(done: int) -> None:
            if done >= 100 and not removed:
                node = max((second, third), key=lambda n: (sum("EngineStage" in t for t in ours_on(n)),
                                                            len(ours_on(n))))
                removed.append(sorted(ours_on(node)))
                cluster.remove_node(node)

        rows = run(chat_model, 400, on_progress=remove, batch_size=16)
    assert removed, "the run ended before the node was removed"
    assert removed[0], "nothing of the processor's was on the removed node"
    counts = Counter(r["id"] for r in rows)
    assert len(counts) == 400 and set(counts.values()) == {1}
    assert [r["id"] for r in rows if list(r["tokens"]) != expected[r["id"]]] == []


def ours_on(node) -> list[str]:
    """The engine replicas and model workers running on a node of a
    ``ray.cluster_utils.Cluster``: its raylet's children, by their Ray process titles."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    titles = []
    for proc in raylet.children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "EngineStage" in title or title.startswith("ray::Worker"):
            titles.append(title.strip())
    return titles


@pytest.mark.slow
def test_an_embedding_processor_writes_sentence_transformers_vectors(ray_local, tmp_path):
    """``task_type="embed"`` on a sentence-transformers folder: every row's ``embeddings``
    equal sentence-transformers' own ``encode`` of its prompt (``pooling_params`` per row)."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from tiny_encoder import build_sentence_transformer, build_tiny_encoder

    folder = str(build_sentence_transformer(tmp_path / "st", build_tiny_encoder(tmp_path / "bert"), pooling="mean"))
    processor = build_processor(
        vLLMEngineProcessorConfig(model_source=folder, task_type="embed", batch_size=16, concurrency=1,
                                  engine_kwargs={"max_num_seqs": 16}, chat_template_stage=False,
                                  detokenize_stage=False),
        preprocess=lambda row: dict(prompt=text_of(int(row["id"])),
                                    pooling_params={"use_activation": int(row["id"]) % 4 != 0}),
        postprocess=lambda row: dict(id=row["id"], vector=row["embeddings"], n=row["num_input_tokens"]),
    )
    rows = sorted(processor(ray.data.range(64, override_num_blocks=4)).take_all(), key=lambda r: r["id"])
    ref = SentenceTransformer(folder, device="cpu").encode([text_of(i) for i in range(64)])
    assert [r["id"] for r in rows] == list(range(64))
    for r in rows:
        v = np.asarray(r["vector"])
        if r["id"] % 4 == 0:  # use_activation off: the mean, not normalised
            v = v / np.linalg.norm(v)
        np.testing.assert_allclose(v, ref[r["id"]], atol=1e-5)


def test_a_rows_model_names_its_adapter_under_dynamic_lora_loading_path(ray_local, chat_model, tmp_path):
    """Ray Data LLM's ``dynamic_lora_loading_path`` (a ``file://`` URI: the remote
    storage path, each worker copying the adapter): a row whose ``model`` is not the
    base model runs the adapter in ``<path>/<model>``; rows of the base model and of two
    adapters mixed in the replica's batches each give transformers + PEFT's greedy
    tokens; a row naming a folder that is not there fails alone, naming it."""
    from helpers import assert_greedy_equal, generate
    from lora_adapters import ALL_SEVEN, ATTENTION, make_adapter, peft_model

    root = tmp_path / "loras"
    make_adapter(chat_model, root / "qv", ATTENTION, r=8, alpha=16, seed=31)
    make_adapter(chat_model, root / "all", ALL_SEVEN, r=4, alpha=8, seed=32)
    names = {0: None, 1: "qv", 2: "all"}

    def pre(row: dict) -> dict:
        i = int(row["id"])
        model = "missing" if i == 7 else names[i % 3] or chat_model
        return dict(prompt=text_of(i), model=model, sampling_params=dict(temperature=0.0, max_tokens=6, ignore_eos=True))

    processor = build_processor(
        vLLMEngineProcessorConfig(model_source=chat_model, engine_kwargs={**ENGINE, "max_loras": 2}, concurrency=1,
                                  batch_size=8, dynamic_lora_loading_path=f"file://{root}", should_continue_on_error=True,
                                  chat_template_stage=False),
        preprocess=pre,
        postprocess=lambda row: dict(id=row["id"], tokens=row["generated_tokens"], ids=row["prompt_token_ids"],
                                     error=row["__inference_error__"]),
    )
    rows = {r["id"]: r for r in processor(ray.data.range(24, override_num_blocks=3)).take_all()}
    assert sorted(rows) == list(range(24))
    # an error row bypasses postprocess (Ray's rule): it carries the stage's columns
    assert "missing" in (rows[7].get("__inference_error__") or ""), rows[7]
    assert all(not r["error"] for i, r in rows.items() if i != 7)
    base = peft_model(chat_model, None)
    for adapter in ("qv", "all", None):
        model = peft_model(chat_model, str(root / adapter)) if adapter else base
        differ = 0
        for i in (i for i in rows if i != 7 and names[i % 3] == adapter):
            ids, ours = list(rows[i]["ids"]), list(rows[i]["tokens"])
            assert len(ours) == 6
            assert_greedy_equal(model, ids, ours, generate(model, ids, 6))
            differ += ours != generate(base, ids, 6)
        assert adapter is None or differ >= 4, f"{adapter}: only {differ} rows differ from the base model"
