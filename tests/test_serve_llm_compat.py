"""Ray Serve LLM's configuration shape on raydecode (``deploy/serve_llm/``).

A Serve config written as Ray's docs write one (two models in one app,
``import_path: ray.serve.llm:build_openai_app``) has its ``import_path`` swapped to
``deploy.serve_llm:build_openai_app`` and nothing else, and is deployed the way
``serve run config.yaml`` deploys it (``ServeDeploySchema``, then the controller builds
the app from the import path and the args). Both models answer by ``model`` (each with
the greedy tokens of its own weights, computed by transformers), an unknown model is a
404, ``/v1/models`` lists both with the engine_kwargs applied. The mapping of every
field and every refusal are checked without Ray.
"""

from __future__ import annotations

import string
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deploy.serve import ServerArgs
from deploy.serve_llm import (
    DEPLOYMENT_PREFIX,
    LLMConfig,
    LLMServingArgs,
    build_llm_deployment,
    build_openai_app,
    build_pd_openai_app,
    map_engine_kwargs,
    missing_accelerator,
)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
APP = "llm_app"

# Ray Serve LLM's documented shape; model_source is filled with local paths (nothing
# downloads here).
RAY_LLM_CONFIG = string.Template("""
applications:
- args:
    llm_configs:
      - model_loading_config:
          model_id: tiny-a
          model_source: $tiny_a
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
        engine_kwargs:
          max_model_len: 256
          max_num_seqs: 8
          enable_chunked_prefill: true
          dtype: float32
        runtime_env:
          env_vars:
            RAYDECODE_COMPAT_TEST: "a"
      - model_loading_config:
          model_id: tiny-b
          model_source: $tiny_b
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
            target_ongoing_requests: 4
          max_ongoing_requests: 16
        engine_kwargs:
          max_model_len: 384
          max_num_seqs: 4
          block_size: 16
          chat_template: "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  import_path: ray.serve.llm:build_openai_app
  name: llm_app
  route_prefix: "/"
""")


def llm(model_id: str = "m", **fields: Any) -> dict[str, Any]:
    return {"model_loading_config": {"model_id": model_id, "model_source": "/models/m"}, **fields}


# -- the mapping, without Ray ---------------------------------------------------------


def test_a_ray_llm_config_maps_onto_server_args_and_the_deployment():
    config = LLMConfig(
        model_loading_config={"model_id": "qwen-0.5b", "model_source": "Qwen/Qwen2.5-0.5B-Instruct"},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4},
                           "max_ongoing_requests": 32, "max_queued_requests": 64,
                           "graceful_shutdown_timeout_s": 20, "health_check_timeout_s": 30,
                           "ray_actor_options": {"num_cpus": 0.5, "runtime_env": {"env_vars": {"A": "1", "B": "x"}}}},
        engine_kwargs={"max_model_len": 1024, "tensor_parallel_size": 2, "max_num_batched_tokens": 256,
                       "gpu_memory_utilization": 0.8, "trust_remote_code": False, "enable_prefix_caching": True,
                       "tool_call_parser": "hermes", "enable_auto_tool_choice": True},
        accelerator_type="A10",
        runtime_env={"env_vars": {"B": "2"}},
        placement_group_config={"bundle_per_worker": {"CPU": 2, "GPU": 1}, "strategy": "SPREAD"},
    )
    plan = config.plan()
    args = plan.args
    assert (args.model, args.served_model_name, args.model_id()) == ("Qwen/Qwen2.5-0.5B-Instruct", "qwen-0.5b",
                                                                     "qwen-0.5b")
    assert args.engine == {"max_model_len": 1024, "tensor_parallel_size": 2, "max_num_batched_tokens": 256,
                           "gpu_memory_utilization": 0.8, "trust_remote_code": False, "enable_prefix_caching": True,
                           "placement_group_strategy": "SPREAD", "worker_num_cpus": 2, "worker_num_gpus": 1,
                           "worker_resources": {"accelerator_type:A10G": 0.001}}
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == ("hermes", True)
    assert args.autoscaling_config == {"min_replicas": 1, "max_replicas": 4}
    assert (args.max_ongoing_requests, args.max_queued_requests, args.graceful_shutdown_timeout_s) == (32, 64, 20)
    assert args.runtime_env == {"env_vars": {"B": "2"}}  # the LLMConfig's wins over ray_actor_options' (as Ray)
    assert plan.actor_options == {"num_cpus": 0.5}
    assert plan.serve_options == {"health_check_timeout_s": 30}
    assert (plan.name, plan.accelerator_type) == ("qwen-0_5b", "A10G")


def test_defaults_where_a_ray_config_says_nothing():
    plan = LLMConfig(model_loading_config={"model_id": "org/model.v2"}).plan()
    defaults = ServerArgs()
    assert plan.args.model == "org/model.v2"  # no model_source: the model_id as a hub id
    assert plan.name == "org--model_v2"  # Ray Serve LLM's deployment name of it
    assert (plan.args.num_replicas, plan.args.autoscaling_config) == (1, None)
    assert plan.args.max_ongoing_requests == defaults.max_ongoing_requests
    assert plan.args.engine == {} and plan.actor_options == {} and plan.serve_options == {}
    auto = LLMConfig(**llm(deployment_config={"num_replicas": "auto"})).plan().args.autoscaling_config
    assert auto["min_replicas"] == 1 and auto["max_replicas"] > 1  # Serve's defaults for "auto"


def test_vllm_names_raydecode_shares_or_renames():
    server, engine, key = map_engine_kwargs({
        "block_size": 32, "data_parallel_size": 2, "distributed_timeout_seconds": 90, "enforce_eager": True,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                               "prompt_lookup_max": 5},
        "dtype": "half", "long_prefill_token_threshold": 0, "max_num_seqs": None, "seed": 7,
        "enable_chunked_prefill": True, "distributed_executor_backend": "ray", "disable_log_stats": False,
        "enable_lora": True, "max_loras": 4, "lora_dtype": "auto", "chat_template": "{{ messages }}",
        "structured_outputs_config":
            {"disable_any_whitespace": True},
        "api_key": "sk-1", "tokenizer": "/models/m", "worker_num_cpus": 0.5,  # raydecode's own names pass too
    }, "/models/m")
    assert server == {"num_workers": 2, "chat_template": "{{ messages }}",
                      "structured_outputs_config": {"disable_any_whitespace": True}}
    assert engine == {"kv_block_size": 32, "distributed_timeout_s": 90, "cuda_graphs": False,
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                             "prompt_lookup_max": 5},
                      "dtype": "float16", "seed": 7, "worker_num_cpus": 0.5, "enable_lora": True, "max_loras": 4}
    draft = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    assert map_engine_kwargs({"speculative_config": draft}, "m")[1] == {"speculative_config": draft}
    assert key == "sk-1"
    # vLLM's default (graphs where they apply) is ours: nothing forced, CPU workers stay eager
    assert map_engine_kwargs({"enforce_eager": False, "dtype": "float"}, "m")[1] == {"dtype": "float32"}


REFUSED = [
    # engine_kwargs: vLLM-only, unknown, LoRA, prefill/decode disaggregation, bad types
    (llm(engine_kwargs={"quantization": "fp8"}), r"engine_kwargs: quantization 'fp8' is not supported by raydecode"),
    (llm(engine_kwargs={"reasoning_parser_plugin": "my.py"}), r"engine_kwargs\.reasoning_parser_plugin: .*vLLM-only"),
    (llm(engine_kwargs={"reasoning_parser": "o1"}), r"reasoning_parser must be one of .*got 'o1'"),
    (llm(engine_kwargs={"max_modle_len": 256}), r"engine_kwargs\.max_modle_len: unknown engine argument"),
    (llm(engine_kwargs={"fully_sharded_loras": True}), r"engine_kwargs\.fully_sharded_loras: not supported by "
                                                        r"raydecode's LoRA adapters"),
    (llm(engine_kwargs={"enable_lora": True, "max_lora_rank": 0}), r"max_lora_rank must be a positive integer"),
    (llm(engine_kwargs={"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}),
     r"engine_kwargs\.kv_transfer_config: prefill/decode disaggregation .* not supported"),
    (llm(engine_kwargs={"speculative_config": {"method": "eagle", "model": "x", "num_speculative_tokens": 2}}),
     r"engine_kwargs\.speculative_config\.method: 'eagle' is not run by raydecode"),
    (llm(engine_kwargs={"speculative_config": {"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
                                               "draft_tensor_parallel_size": 2}}),
     r"engine_kwargs\.speculative_config: Object contains unknown field `draft_tensor_parallel_size`"),
    (llm(engine_kwargs={"enable_chunked_prefill": False}), r"enable_chunked_prefill: only True"),
    (llm(engine_kwargs={"enforce_eager": "yes"}), r"engine_kwargs\.enforce_eager: expected true or false"),
    (llm(engine_kwargs={"distributed_executor_backend": "mp"}), r"distributed_executor_backend: only 'ray'"),
    (llm(engine_kwargs={"tokenizer": "other/tok"}), r"engine_kwargs\.tokenizer: .*vLLM-only"),
    (llm(engine_kwargs={"model": "x"}), r"engine_kwargs\.model: set model_loading_config\.model_source"),
    (llm(engine_kwargs={"structured_outputs_config": {"backend": "xgrammar"}}),
     r"structured_outputs_config: \['backend'\] are vLLM-only"),
    (llm(engine_kwargs={"dtype": "fp8"}), r"engine_kwargs\.dtype: expected one of"),
    (llm(engine_kwargs={"max_model_len": "long"}), r"engine_kwargs\.max_model_len: Expected `int \| null`, got `str`"),
    (llm(engine_kwargs={"max_num_seqs": 0}), r"max_num_seqs must be a positive integer"),
    (llm(engine_kwargs={"tool_call_parser": "nope"}), r"tool_call_parser must be one of"),
    (llm(engine_kwargs=["max_model_len"]), r"engine_kwargs\s+Input should be a valid dictionary"),
    # the LLMConfig's own fields
    (llm(lora_config={"dynamic_lora_loading_path": "ftp://bucket/loras"}),
     r"dynamic_lora_loading_path: URI scheme 'ftp' is not supported"),
    (llm(lora_config={"dynamic_lora_loading_path": "/loras", "max_num_adapters_per_replica": 0}),
     r"max_num_adapters_per_replica must be at least 1"),
    (llm(lora_config={"dynamic_lora_loading_path": "/loras", "max_loras": 2}), r"lora_config\.max_loras\s+Extra inputs"),
    (llm(accelerator_type="H1000"), r"Unsupported accelerator type: H1000"),
    (llm(accelerator_type="TPU-V4"), r"TPUs are not supported"),
    (llm(accelerator_type=7), r"accelerator_type\s+Input should be a valid string"),
    (llm(accelerator_config={"kind": "cpu"}, accelerator_type="L4"), r"cannot be used with CPU-only"),
    (llm(placement_group_config={"bundles": [{"GPU": 1}]}), r"placement_group_config\.bundles: not supported"),
    (llm(llm_engine="SGLang"), r"Unsupported engine: SGLang"),
    (llm(server_cls="my.module:Server"), r"server_cls: not supported"),
    (llm(callback_config={"callback_class": "my.module:Callback"}), r"callback_config: .* not supported"),
    (llm(experimental_configs={"num_router_replicas": 2}), r"experimental_configs\.num_router_replicas"),
    (llm(log_engine_metrics="yes please"), r"log_engine_metrics\s+Input should be a valid boolean"),
    (llm(no_such_field=1), r"no_such_field\s+Extra inputs are not permitted"),
    ({"model_loading_config": {"model_id": 5}}, r"model_loading_config\.model_id\s+Input should be a valid string"),
    ({"model_loading_config": {"model_source": "/m"}}, r"model_loading_config\.model_id\s+Field required"),
    ({"model_loading_config": {"model_id": "m", "model_source": "s3://bucket/m"}}, r"cloud storage mirrors"),
    ({"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "gs://b/m"}}}, r"cloud storage"),
    # deployment_config
    (llm(deployment_config={"num_replicas": "two"}),
     r"deployment_config\.num_replicas: Input should be a valid integer"),
    (llm(deployment_config={"max_ongoing_requests": -1}), r"deployment_config\.max_ongoing_requests: "),
    (llm(deployment_config={"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}}),
     r"deployment_config\.autoscaling_config.*max_replicas"),
    (llm(deployment_config={"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}),
     r"num_replicas and autoscaling_config together"),
    (llm(deployment_config={"user_config": {"a": 1}}), r"deployment_config\.user_config: not supported"),
    (llm(deployment_config={"placement_group_bundles": [{"CPU": 1}]}), r"use placement_group_config"),
    (llm(deployment_config={"route_prefix": "/x"}), r"deployment_config\.route_prefix: not a deployment option"),
    (llm(deployment_config={"ray_actor_options": "lots"}), r"ray_actor_options: expected a dict"),
    (llm(deployment_config="one replica"), r"deployment_config\s+Input should be a valid dictionary"),
]


@pytest.mark.parametrize(("config", "message"), REFUSED, ids=[m.replace("\\", "")[:48] for _, m in REFUSED])
def test_what_raydecode_cannot_honour_is_refused_with_the_reason(config, message):
    with pytest.raises(ValueError, match=message):
        LLMConfig.model_validate(config)


def test_serving_args_refusals():
    with pytest.raises(ValueError, match=r"Duplicate models found: model_id 'same' is given twice"):
        LLMServingArgs(llm_configs=[llm("same"), llm("same", engine_kwargs={"max_model_len": 64})])
    with pytest.raises(ValueError, match=r"the same deployment name"):
        LLMServingArgs(llm_configs=[llm("a/b"), llm("a--b")])
    with pytest.raises(ValueError, match=r"the list of models is empty"):
        LLMServingArgs(llm_configs=[])
    with pytest.raises(ValueError, match=r"same api_key on every llm_config"):
        LLMServingArgs(llm_configs=[llm("a", engine_kwargs={"api_key": "k1"}), llm("b")])
    with pytest.raises(ValueError, match=r"ingress_cls_config: a custom ingress is not supported"):
        LLMServingArgs(llm_configs=[llm()], ingress_cls_config={"ingress_cls": "my.module:Ingress"})
    with pytest.raises(ValueError, match=r"ingress_deployment_config\.num_replicas: "):
        LLMServingArgs(llm_configs=[llm()], ingress_deployment_config={"num_replicas": "many"})
    with pytest.raises(ValueError, match=r"does not exist"):
        LLMServingArgs(llm_configs=["/no/such/model.yaml"])
    with pytest.raises(ValueError, match=r"prefill/decode disaggregation .* not supported"):
        build_pd_openai_app({"prefill_config": llm(), "decode_config": llm()})
    with pytest.raises(ValueError, match=r"bind_kwargs and deployment_cls are not supported"):
        build_llm_deployment(LLMConfig(**llm()), bind_kwargs={"x": 1})


def test_llm_configs_may_be_yaml_files_and_the_ingress_takes_its_options(tmp_path):
    path = tmp_path / "model-b.yaml"
    path.write_text(yaml.safe_dump(llm("b", engine_kwargs={"max_model_len": 128},
                                       experimental_configs={"num_ingress_replicas": 3})))
    args = LLMServingArgs(llm_configs=[llm("a"), str(path)])
    assert [c.model_id for c in args.llm_configs] == ["a", "b"]
    assert args.llm_configs[1].plan().args.engine == {"max_model_len": 128}
    assert args.ingress_options() == {"num_replicas": 3}
    explicit = LLMServingArgs(llm_configs=[str(path)], ingress_deployment_config={"num_replicas": 2})
    assert explicit.ingress_options() == {"num_replicas": 2}


def test_the_app_is_one_ingress_over_one_engine_deployment_per_model():
    app = build_openai_app({
        "llm_configs": [LLMConfig(**llm("a", deployment_config={"num_replicas": 2, "health_check_timeout_s": 33})),
                        llm("org/b.v1", deployment_config={"autoscaling_config": {"max_replicas": 3},
                                                           "name": "bee"})],
        "ingress_deployment_config": {"num_replicas": 2, "max_ongoing_requests": 500}})
    ingress = app._bound_deployment
    engines, api_key, *_ = ingress.init_args
    assert (ingress.name, ingress._deployment_config.num_replicas, api_key) == ("OpenAIIngress", 2, None)
    assert ingress._deployment_config.max_ongoing_requests == 500
    assert sorted(engines) == ["a", "org/b.v1"]
    a, b = engines["a"]._bound_deployment, engines["org/b.v1"]._bound_deployment
    assert (a.name, b.name) == ("LLMEngine:a", "LLMEngine:bee")  # deployment_config.name, as Ray
    assert (a._deployment_config.num_replicas, a._deployment_config.health_check_timeout_s) == (2, 33)
    assert b._deployment_config.autoscaling_config.max_replicas == 3
    assert (a.init_args[0]["served_model_name"], b.init_args[0]["model"]) == ("a", "/models/m")
    named = build_llm_deployment(LLMConfig(**llm("c")), name_prefix="X:", override_serve_options={"num_replicas": 3})
    assert (named._bound_deployment.name, named._bound_deployment._deployment_config.num_replicas) == ("X:c", 3)


def test_lora_config_maps_onto_the_dynamic_folder_and_the_engine():
    plan = LLMConfig(**llm(lora_config={"dynamic_lora_loading_path": "/loras", "max_num_adapters_per_replica": 8,
                                        "download_timeout_s": 60, "max_download_tries": 2},
                           engine_kwargs={"max_loras": 4})).plan()
    assert plan.args.dynamic_lora_loading_path == "/loras"
    assert plan.args.engine == {"enable_lora": True, "max_loras": 4, "max_cpu_loras": 8}
    assert plan.args.lora()["dynamic"] == {"m": "/loras"}


def test_a_pooling_models_engine_kwargs_pass_through():
    """A Ray Serve LLM config of an embedding model: ``runner`` and ``pooler_config``
    (vLLM's names) reach the engine; the app then serves the pooling routes
    (``tests/test_pooling_served.py`` serves them)."""
    plan = LLMConfig(**llm(engine_kwargs={"runner": "pooling", "pooler_config": {"pooling_type": "MEAN"}})).plan()
    assert plan.args.engine == {"runner": "pooling", "pooler_config": {"pooling_type": "MEAN"}}
    for bad, named in (({"runner": "embed"}, "runner"), ({"pooler_config": {"pooling_type": "MAX"}}, "pooling_type"),
                       ({"pooler_config": {"normalize": True}}, "normalize")):
        with pytest.raises(ValueError, match=named):
            LLMConfig(**llm(engine_kwargs=bad)).plan()


def test_each_engine_kwarg_name_has_one_meaning():
    from cluster.config import EngineConfig
    from deploy.serve_llm import ALWAYS, LORA_KWARGS, PD_KWARGS, RENAMED, SERVER_FIELDS, VLLM_ONLY

    handled = set(EngineConfig.__struct_fields__) | set(RENAMED) | SERVER_FIELDS | set(ALWAYS) | LORA_KWARGS | PD_KWARGS
    assert not VLLM_ONLY & handled  # a name listed as vLLM-only is one raydecode handles
    assert not LORA_KWARGS & PD_KWARGS and not set(ALWAYS) & set(EngineConfig.__struct_fields__)
    assert set(RENAMED.values()) <= set(EngineConfig.__struct_fields__) | SERVER_FIELDS
    assert SERVER_FIELDS <= set(ServerArgs.model_fields)


def test_accelerator_type_against_what_the_cluster_has_or_could_add():
    assert missing_accelerator("A10G", {"CPU": 8, "GPU": 1, "accelerator_type:A10G": 1}, {}) is None
    assert missing_accelerator("L4", {"CPU": 8}, {"GPU": 4, "accelerator_type:L4": 4}) is None  # autoscaler
    assert missing_accelerator("L4", {"CPU": 8}, None) is None  # an autoscaler that does not say: it may
    why = missing_accelerator("H100", {"CPU": 8, "accelerator_type:A10G": 1}, {"accelerator_type:L4": 2})
    assert why is not None and "'H100'" in why and "accelerator_type:H100" in why and "A10G, L4" in why
    assert "none" in missing_accelerator("H100", {"CPU": 2}, {})


def test_sample_config_is_ray_serve_llm_shaped_and_builds():
    config = yaml.safe_load((DEPLOY / "serve-llm.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deploy.serve_llm:build_openai_app"
    args = LLMServingArgs.model_validate(app["args"])
    assert [c.model_id for c in args.llm_configs] == ["smollm2-135m", "smollm2-360m"]
    build_openai_app(app["args"])  # binds the deployments; nothing starts until serve.run
    with pytest.raises(ValueError, match="engine_kwargs: quantization 'bitsandbytes' is not supported"):
        broken = yaml.safe_load((DEPLOY / "serve-llm.yaml").read_text())["applications"][0]["args"]
        broken["llm_configs"][0]["engine_kwargs"]["quantization"] = "bitsandbytes"
        build_openai_app(broken)


# -- the app under Serve, deployed from the config ------------------------------------


def _wait_running(timeout: float) -> float:
    from ray import serve

    start = time.monotonic()
    while True:
        status = serve.status().applications.get(APP)
        state = str(getattr(status.status, "value", status.status)) if status else None
        if state == "RUNNING":
            return time.monotonic() - start
        if state == "DEPLOY_FAILED" or time.monotonic() - start > timeout:
            raise AssertionError(f"{APP} is {state} after {time.monotonic() - start:.0f} s: "
                                 f"{status.message if status else 'not deployed'}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def deployed(ray_local, tiny_model_path, tmp_path_factory):
    """The Ray-docs config, import_path swapped, deployed as ``serve run config.yaml``
    deploys one; yields (base URL, model A's path, model B's path)."""
    from ray import serve
    from ray.serve._private.api import serve_start

    from helpers import free_port
    from tiny_model import build_tiny_model

    tiny_b = str(build_tiny_model(tmp_path_factory.mktemp("tiny-b"), seed=1))  # other weights
    config = yaml.safe_load(RAY_LLM_CONFIG.substitute(tiny_a=tiny_model_path, tiny_b=tiny_b))
    (app,) = config["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    app["import_path"] = "deploy.serve_llm:build_openai_app"  # the one change
    schema = ServeDeploySchema.model_validate(config)
    port = free_port()
    client = serve_start(http_options={"host": "127.0.0.1", "port": port})
    client.deploy_apps(schema)
    took = _wait_running(timeout=300)
    print(f"\ntwo-model app from the Ray Serve LLM config running after {took:.1f} s")
    try:
        yield f"http://127.0.0.1:{port}", tiny_model_path, tiny_b
    finally:
        serve.shutdown()


def _greedy_ids(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                                  "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return body["choices"][0]["token_ids"]


def test_each_model_answers_by_its_model_field(deployed):
    from hf_reference import HFReference

    url, path_a, path_b = deployed
    ref_a, ref_b = HFReference(path_a), HFReference(path_b)
    prompt = ref_a.tokenizer.encode("the quick brown fox")
    assert prompt == ref_b.tokenizer.encode("the quick brown fox")
    want_a, want_b = ref_a.greedy(prompt, 8), ref_b.greedy(prompt, 8)
    assert want_a != want_b  # the two models tell apart which one answered
    assert _greedy_ids(url, "tiny-b", prompt, 8) == want_b
    assert _greedy_ids(url, "tiny-a", prompt, 8) == want_a
    # engine_kwargs are per model: only tiny-b was given a chat template (the tiny
    # tokenizer has none).
    messages = [{"role": "user", "content": "the quick brown fox"}]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny-b", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "tiny-b"
    assert chat.json()["choices"][0]["message"]["content"] == ref_b.tokenizer.decode(want_b)
    no_template = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny-a", "messages": messages, "max_tokens": 2})
    assert no_template.status_code == 400 and "chat template" in no_template.text, no_template.text


def test_unknown_model_is_404_and_models_lists_both(deployed):
    url, path_a, path_b = deployed
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-c", "prompt": "x", "max_tokens": 1}, timeout=60)
    assert r.status_code == 404 and "tiny-c" in r.json()["error"]["message"], r.text
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]}
    assert sorted(cards) == ["tiny-a", "tiny-b"]
    assert (cards["tiny-a"]["root"], cards["tiny-a"]["max_model_len"]) == (path_a, 256)  # engine_kwargs applied
    assert (cards["tiny-b"]["root"], cards["tiny-b"]["max_model_len"]) == (path_b, 384)
    assert httpx.get(f"{url}/v1/models/tiny-b", timeout=60).json()["id"] == "tiny-b"


def test_each_model_is_its_own_engine_deployment_with_its_deployment_config(deployed):
    from ray import serve
    from ray.serve._private.api import _get_global_client

    deployments = serve.status().applications[APP].deployments
    assert set(deployments) == {"OpenAIIngress", f"{DEPLOYMENT_PREFIX}tiny-a", f"{DEPLOYMENT_PREFIX}tiny-b"}
    details = _get_global_client().get_serve_details()["applications"][APP]["deployments"]
    a = details[f"{DEPLOYMENT_PREFIX}tiny-a"]["deployment_config"]
    b = details[f"{DEPLOYMENT_PREFIX}tiny-b"]["deployment_config"]
    assert (a["autoscaling_config"]["min_replicas"], a["autoscaling_config"]["max_replicas"]) == (1, 2)
    assert (b["autoscaling_config"]["target_ongoing_requests"], b["max_ongoing_requests"]) == (4, 16)
    assert a["ray_actor_options"]["runtime_env"]["env_vars"]["RAYDECODE_COMPAT_TEST"] == "a"
    assert "runtime_env" not in b["ray_actor_options"] or not b["ray_actor_options"]["runtime_env"].get("env_vars")


def test_accelerator_type_no_node_could_have_is_an_error_at_build(deployed, monkeypatch):
    import deploy.serve_llm.placement as placement

    config = llm("gpu-model", accelerator_type="H100")
    assert placement._autoscaler_resources() == {}  # this local Ray: no autoscaler
    with pytest.raises(ValueError, match=r"accelerator_type 'H100': no node of this Ray cluster has it"):
        build_openai_app({"llm_configs": [config]})
    # Where a node offers it, the build goes through and the workers ask for it.
    real = placement.ray.cluster_resources
    monkeypatch.setattr(placement.ray, "cluster_resources", lambda: {**real(), "accelerator_type:H100": 1.0})
    build_openai_app({"llm_configs": [config]})
    assert LLMConfig(**config).plan().args.engine["worker_resources"] == {"accelerator_type:H100": 0.001}
