"""The Serve application's arguments: ``ServerArgs`` (a Serve config's ``args``, or
``build_app({...})``), validated as a whole, and the structured-output defaults it
carries. Kept apart from the builders (as vLLM keeps ``cli_args.py``) so the engine
replica, the CLI and the Ray Serve LLM mapping read them without importing the app.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator
from ray.serve.config import AutoscalingConfig

from deploy.openai.tool_parser_names import TOOL_PARSERS
from deploy.openai.tools import DEFAULT_MAX_TOOLS
from deploy.request_router import check_router_kwargs
from worker import DEFAULT_MODEL_NAME
from worker.lora_fetch import check_location


class StructuredOutputsConfig(BaseModel):
    """Defaults for the JSON constraints of requests that do not set them (vLLM's
    ``--structured-outputs-config``)."""

    model_config = ConfigDict(extra="forbid")

    #: compact JSON: no whitespace between tokens (a weak model may otherwise spend
    #: its tokens on whitespace)
    disable_any_whitespace: bool = False
    #: objects with ``properties`` get ``additionalProperties: false`` unless they say
    disable_additional_properties: bool = False


class ServerArgs(BaseModel):
    """The application's configuration (Serve config ``args`` or ``build_app``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the embedded SmolLM2
    served_model_name: str | None = None  # the name clients use; default: the model's
    num_workers: int = 1
    api_key: str | None = None  # clients must send "Authorization: Bearer <key>"
    chat_template: str | None = None  # for tokenizers without one
    #: further ``EngineConfig`` fields: max_num_seqs, max_model_len, logits_processors,
    #: worker_resources, address, ...
    engine: dict[str, Any] = {}
    # -- the engine deployment: its replicas, their load and how they go --
    num_replicas: int = 1  # fixed replicas (each an engine with num_workers workers)
    #: Serve's autoscaling_config for the engine replicas (min_replicas, max_replicas,
    #: target_ongoing_requests, upscale_delay_s, downscale_delay_s, ...); replaces
    #: num_replicas
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = 256  # per replica, in the engine at once
    max_queued_requests: int = 512  # waiting for a replica; beyond: 503
    retry_after_s: float = 1.0
    #: a replica leaving (scale-down, redeploy, shutdown) takes no new requests and
    #: finishes its in-flight ones for up to this long before it is stopped
    graceful_shutdown_timeout_s: float = 60.0
    #: Ray runtime_env of the engine replicas and their workers (env_vars, py_modules, ...)
    runtime_env: dict[str, Any] | None = None
    #: how the ingress picks an engine replica: "prefix_aware" (the one that cached the
    #: longest prefix of the prompt, within a load-imbalance guard; deploy/request_router.py)
    #: or "power_of_two" (Serve's default). None: prefix_aware when the engine caches
    #: prefixes (engine enable_prefix_caching, the default), else power_of_two
    request_router: Literal["prefix_aware", "power_of_two"] | None = None
    #: the prefix-aware router's settings: imbalanced_threshold (default 8 requests),
    #: match_rate_threshold, min_match_chars, eviction_threshold_chars, ...
    request_router_kwargs: dict[str, Any] = {}
    # -- tools and structured outputs (vLLM's flag names) --
    #: the model's tool call format for tool_choice "auto": hermes, llama3_json, pythonic,
    #: llama4_pythonic, mistral, qwen3_xml (qwen3_coder), deepseek_v3, granite, internlm, openai
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False  # allow tool_choice "auto" (needs tool_call_parser), as vLLM
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": leave the tools out of the prompt
    max_tools: int = DEFAULT_MAX_TOOLS  # tools in one request, at most
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    #: keep Responses API responses for previous_response_id and GET /v1/responses/{id}
    #: (off by default, as vLLM's VLLM_ENABLE_RESPONSES_API_STORE): in each ingress
    #: replica's memory, at most responses_store_max_entries of them (the oldest go
    #: first), none kept longer than responses_store_max_age_s
    enable_responses_store: bool = False
    responses_store_max_entries: int = 10_000
    responses_store_max_age_s: float = 3600.0
    #: a file each replica (ingress and engine) appends one JSON line per request to:
    #: where its time to first token went (deploy/timeline.py); None: off
    request_timeline: str | None = None
    #: the ingress and the engine in one replica (deploy/colocated.py): no router, no
    #: gRPC hop and one process fewer per request; only with one engine replica that
    #: does not autoscale. While that replica is replaced, nothing answers HTTP
    colocate: bool = False
    # -- LoRA adapters (deploy/lora_adapters.py; the engine needs enable_lora) --
    #: adapters served from the start, each a model of its own (vLLM's --lora-modules):
    #: "name=path", or {"name", "path", "base_model_name"}
    lora_modules: list[str | dict[str, Any]] = []
    #: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime endpoints;
    #: also on when the environment sets VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    #: Ray Serve LLM's lora_config: a request for "<model>:<adapter>" loads the adapter
    #: from this folder's <adapter>/ on first use (a local path)
    dynamic_lora_loading_path: str | None = None

    def lora(self) -> dict[str, Any]:
        """The ingress's LoRA settings: the parsed ``lora_modules``, the runtime switch,
        the dynamic loading folder of this model."""
        from deploy.lora_adapters import parse_lora_module

        return {"modules": [parse_lora_module(m) for m in self.lora_modules],
                "runtime_updates": self.allow_runtime_lora_updating,
                "dynamic": {self.model_id(): self.dynamic_lora_loading_path} if self.dynamic_lora_loading_path else {}}

    def responses_store(self) -> dict[str, Any] | None:
        """The ingress's Responses API store settings (None: no store)."""
        if not self.enable_responses_store:
            return None
        return {"max_entries": self.responses_store_max_entries, "max_age_s": self.responses_store_max_age_s}

    def model_id(self) -> str:
        """The name clients send as ``model``: ``served_model_name``, else the model
        as given (a path or hub id), else the embedded default's name."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    @model_validator(mode="after")
    def _tools_make_sense(self) -> "ServerArgs":
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (as vLLM's --enable-auto-tool-choice)")
        if self.responses_store_max_entries < 1 or self.responses_store_max_age_s <= 0:
            raise ValueError("responses_store_max_entries must be at least 1 and responses_store_max_age_s above 0")
        if self.max_tools < 1:
            raise ValueError(f"max_tools must be at least 1, got {self.max_tools}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.autoscaling_config is not None:
            try:
                AutoscalingConfig(**self.autoscaling_config)
            except Exception as exc:  # pydantic's error names the field
                raise ValueError(f"autoscaling_config: {exc}") from None
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError(f"graceful_shutdown_timeout_s must be >= 0, got {self.graceful_shutdown_timeout_s}")
        if self.request_router_kwargs and self.request_router == "power_of_two":
            raise ValueError("request_router_kwargs: settings of the prefix-aware router, but request_router is "
                             "power_of_two")
        check_router_kwargs(self.request_router_kwargs)
        if (self.lora_modules or self.allow_runtime_lora_updating or self.dynamic_lora_loading_path) \
                and not self.engine.get("enable_lora"):
            raise ValueError("lora_modules, allow_runtime_lora_updating and dynamic_lora_loading_path need the "
                             "engine's enable_lora (--enable-lora)")
        if self.dynamic_lora_loading_path is not None:
            check_location(self.dynamic_lora_loading_path, "dynamic_lora_loading_path")
        names = [m["name"] for m in self.lora()["modules"]]
        if len(set(names)) != len(names) or self.model_id() in names:
            raise ValueError(f"lora_modules: each adapter needs a name of its own, not the model's ({names})")
        if self.colocate and (self.num_replicas != 1 or self.autoscaling_config is not None):
            raise ValueError("colocate: only with one engine replica (num_replicas 1, no autoscaling_config)")
        if self.colocate and (self.request_router is not None or self.request_router_kwargs):
            raise ValueError("colocate: one engine replica in the ingress's process has no request router to set "
                             "(request_router, request_router_kwargs)")
        return self
