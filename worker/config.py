"""WorkerConfig: how a worker loads its model, sizes its batch and KV pool, and samples.

It is the worker's part of the engine's configuration: ``cluster.config.EngineConfig``
extends it with the driver's settings, so every field here is an engine setting too (an
``LLM(...)`` keyword, a ``raydecode`` flag, a Serve YAML ``engine:`` key) without a copy.
The driver sends it to each worker once, at load (msgpack), after filling in what it
sizes per worker (``worker_num_threads``, ``kv_cache_memory_bytes``).

Validation lives in ``__post_init__``, which runs both when the config is built and when
a worker decodes it, so one set of rules guards both sides; each failure is a
``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sampler.config import DEFAULT_MAX_LOGPROBS, LogprobsMode, SamplerConfig, check_logprobs_options
from worker.pooling import check_pooler_config, check_runner
from worker.speculative_config import SpeculativeConfig, parse_speculative_config


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(ok: bool, name: str, rule: str, value: object) -> None:
    """``ValueError`` naming ``name`` when a rule does not hold."""
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def check_positive(config: object, *names: str, optional: bool = False) -> None:
    """Each named field is an integer >= 1 (or None, when ``optional``)."""
    for name in names:
        value = getattr(config, name)
        if optional and value is None:
            continue
        require(is_int(value) and value >= 1, name, "a positive integer", value)


def check_fraction(config: object, *names: str) -> None:
    """Each named field is a number in (0, 1]."""
    for name in names:
        value = getattr(config, name)
        require(not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1,
                name, "in (0, 1]", value)


class WorkerConfig(msgspec.Struct, kw_only=True):
    # -- the model ----------------------------------------------------------------
    #: local path, hub id or .gguf file; None: the embedded SmolLM2-135M-Instruct
    model: str | None = None
    #: torch device of the workers ("cpu", "cuda", ...); None: cuda when a worker has a
    #: GPU, else cpu
    device: str | None = None
    #: model dtype: auto, float32, float16 or bfloat16; None (auto): float32 on CPU,
    #: bfloat16/float16 on CUDA
    dtype: str | None = None
    #: seed of the random stream that requests without a seed of their own draw from
    seed: int = 0
    #: let transformers run the model repository's own code
    trust_remote_code: bool = False
    #: the weights' format, vLLM's option: None runs the checkpoint as it is (a GGUF in
    #: its own quant types, a compressed-tensors checkpoint in its own, a float one in
    #: float); "gguf" / "compressed-tensors" the same, checked against the checkpoint;
    #: "int8" (per channel) and "int4" (groups of 128) quantize a float checkpoint at
    #: load (raydecode's); "none" dequantizes a quantized checkpoint to ``dtype``
    quantization: str | None = None
    #: options of the on-the-fly schemes: int4's group_size and symmetric
    quantization_config: dict[str, Any] | None = None
    #: vLLM's runner: "auto" serves an encoder (BERT, RoBERTa, XLM-RoBERTa), a base
    #: model and a sequence-classification model as pooling models (embeddings, scores,
    #: classification), anything else as a generative one; "pooling" makes a decoder an
    #: embedder (last-token pooling); "generate" refuses a model that only pools
    runner: str = "auto"
    #: a pooling model's pooler, vLLM's keys: {"pooling_type": "LAST" | "MEAN" | "CLS",
    #: "use_activation": bool (embeddings normalised, classifications activated)};
    #: None: the model's sentence-transformers config, else vLLM's defaults (CLS for
    #: encoders, LAST for decoders, use_activation on)
    pooler_config: dict[str, Any] | None = None
    # -- model parallelism (one replica as a group of Ray actors) -----------------
    #: tensor-parallel ranks per replica: each holds a slice of every layer's heads and
    #: MLP and of the vocabulary (two all-reduces per layer); the heads must divide
    tensor_parallel_size: int = 1
    #: pipeline stages per replica: each holds a run of the layers
    pipeline_parallel_size: int = 1
    #: layers per pipeline stage, comma-separated (vLLM's VLLM_PP_LAYER_PARTITION);
    #: None: even, the leftovers to the earlier stages
    pipeline_layer_partition: str | None = None
    #: mixtures of experts in a tensor-parallel group: each rank holds num_experts /
    #: tensor_parallel_size whole experts (vLLM's flag) instead of a slice of every
    #: expert; attention stays split by heads
    enable_expert_parallel: bool = False
    #: seconds a collective (all-reduce, stage hand-off) waits for the group's other
    #: ranks before the step fails (and the group is replaced)
    distributed_timeout_s: float = 60.0
    # -- the batch and the KV pool ------------------------------------------------
    #: rows per worker (the worker may allow fewer when its KV budget is smaller)
    max_num_seqs: int = 64
    #: longest prompt + output in tokens; None: the model's own limit
    #: (``max_position_embeddings``), at most 4096
    max_model_len: int | None = None
    #: tokens per KV block (the unit of allocation and of prefix caching)
    kv_block_size: int = 16
    #: each worker's KV pool in tokens (a whole number of ``kv_block_size`` blocks);
    #: overrides the memory-based size. None: what the memory budget below holds, at
    #: most enough for every row at max_model_len
    kv_cache_tokens: int | None = None
    #: each worker's KV budget in bytes; None: on CUDA from gpu_memory_utilization, on
    #: CPU cpu_kv_cache_fraction of the node's RAM split among this engine's workers there
    kv_cache_memory_bytes: int | None = None
    #: CPU: commit every page of the KV pool when the worker loads (what vLLM's zeroed
    #: pool does) instead of as blocks are first used. Costs start time (in proportion
    #: to the pool's size) and the whole pool's RAM up front; spares the first requests
    #: the page faults
    kv_cache_prefault: bool = False
    #: CUDA: the share of each GPU's memory a worker may use (model, activations, KV), as in vLLM
    gpu_memory_utilization: float = 0.9
    #: torch threads per worker; None: ``worker_num_cpus`` when set (>= 1), else the
    #: cores of the worker's node split among this engine's workers on it
    worker_num_threads: int | None = None
    #: CPU: the niceness (Linux, -20 to 19) the worker's threads take when it loads:
    #: higher than the serving processes' beside it (a lower priority), so that a request
    #: or a token that arrives gets a core at once (``raydecode serve`` starts Ray's
    #: workers at 0); None: what Ray gave the process (15 for its workers unless
    #: ``RAY_worker_niceness`` says otherwise)
    cpu_worker_niceness: int | None = 15
    # -- sampling -----------------------------------------------------------------
    #: n-gram (prompt lookup) draft tokens per decode step for speculative decoding; 0:
    #: off (the shorthand of ``speculative_config`` with method ngram)
    num_spec_tokens: int = 0
    #: speculative decoding in vLLM's shape: {"method": "ngram" | "draft_model",
    #: "num_speculative_tokens": k, "model": draft path or "self", "quantization":
    #: "int4" | "int8" (the draft's weights quantized at load), "disable_by_batch_size",
    #: "prompt_lookup_min", "prompt_lookup_max"}; None: ``num_spec_tokens`` decides
    speculative_config: dict[str, Any] | None = None
    #: shortest n-gram the prompt-lookup proposer matches
    ngram_min: int = 1
    #: longest n-gram the prompt-lookup proposer matches
    ngram_max: int = 4
    #: the most logprobs / prompt_logprobs a request may ask per token; -1: no limit
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    #: what logprobs report: "raw_logprobs" (the model's, before any processing, as
    #: vLLM's default), "raw_logits", "processed_logprobs" or "processed_logits"
    logprobs_mode: LogprobsMode = "raw_logprobs"
    #: custom logits processors, as "module:Qualname" (server configuration only)
    logits_processors: list[str] = msgspec.field(default_factory=list)
    #: text of the token that opens a reasoning section (thinking_token_budget)
    reasoning_start: str | None = None
    #: text of the token that closes a reasoning section (thinking_token_budget)
    reasoning_end: str | None = None
    # -- LoRA adapters (worker/runner/lora.py) ----------------------------------------
    #: serve LoRA adapters (PEFT's format): requests name one (``lora_request``, or an
    #: adapter's name as the HTTP ``model``), rows of different adapters in one batch
    enable_lora: bool = False
    #: the most distinct adapters one worker's batch holds at once (vLLM's max_loras)
    max_loras: int = 1
    #: the highest adapter rank served (vLLM's max_lora_rank)
    max_lora_rank: int = 16
    #: adapters a worker keeps loaded, the least recently used dropped past it; None:
    #: max_loras (vLLM's max_cpu_loras)
    max_cpu_loras: int | None = None
    # -- attention and the CPU backend (worker/cpu/) ---------------------------------
    #: paged attention through torch's FlexAttention, reading the KV pool in place
    #: (compiled with Triton on CUDA). None: on for GPU workers; CPU workers use their
    #: own kernel (True there runs FlexAttention eagerly: for tests). False: gather each
    #: row's blocks, then SDPA (the reference path)
    flex_attention: bool | None = None
    #: CUDA, with FlexAttention: replay decode steps (every row one token) from CUDA
    #: graphs captured per batch-size bucket, instead of launching each kernel from
    #: Python. None: on for CUDA workers; False: every step eager (vLLM's enforce_eager)
    cuda_graphs: bool | None = None
    #: with cuda_graphs: the decode steps the graphs replay run the model's RMSNorms
    #: compiled into one kernel each (torch.compile; steps launched from Python keep
    #: transformers' own). False: transformers' own everywhere
    compiled_norms: bool = True
    #: CPU: run linear layers with prepacked weights (faster; off: plain F.linear)
    cpu_packed_linear: bool = True
    #: CPU, float32: linear layers over weights packed in column panels, our own kernel
    #: (faster than oneDNN's at decode sizes; off: oneDNN's packed linear)
    cpu_panel_linear: bool = True
    #: CPU, float32, with cpu_panel_linear: linears called with at least this many rows
    #: (prefill chunks) run on a library GEMM's packed copy of their weights
    #: (cpu_gemm_library's), kept beside the panels (the linears' weights then twice in
    #: memory, the LM head once); 0: panels at every size, one copy
    cpu_gemm_from_rows: int = 128
    #: CPU, float32: the library of those large calls: "mkl" (MKL's packed sgemm),
    #: "onednn" (oneDNN's packed linear), or "auto": the faster of the two, raced at
    #: load on the model's largest linear (MKL leads on Intel Xeons; oneDNN by 2x on AMD
    #: Zen 5, where MKL stays off AVX-512)
    cpu_gemm_library: str = "auto"
    #: CPU: attention with the compiled paged kernel (off: gather the blocks + SDPA)
    cpu_attention_kernel: bool = True
    #: CPU: the fast families (docs/usage.md's table) run with fused layer ops (off: the
    #: transformers forward)
    cpu_fused_decoder: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "max_num_seqs", "kv_block_size", "ngram_min", "ngram_max", "tensor_parallel_size",
                       "pipeline_parallel_size")
        parse_partition(self.pipeline_layer_partition)
        require(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel", "true or false",
                self.enable_expert_parallel)
        if self.pipeline_layer_partition is not None:
            stages = len(parse_partition(self.pipeline_layer_partition) or [])
            require(stages == self.pipeline_parallel_size, "pipeline_layer_partition",
                    f"{self.pipeline_parallel_size} layer counts (one per pipeline stage)", self.pipeline_layer_partition)
        require(not isinstance(self.distributed_timeout_s, bool) and isinstance(self.distributed_timeout_s, (int, float))
                and self.distributed_timeout_s > 0, "distributed_timeout_s", "a positive number of seconds",
                self.distributed_timeout_s)
        check_positive(self, "kv_cache_tokens", "kv_cache_memory_bytes", "worker_num_threads", optional=True)
        niceness = self.cpu_worker_niceness
        require(niceness is None or (is_int(niceness) and -20 <= niceness <= 19), "cpu_worker_niceness",
                "an integer from -20 to 19, or None", niceness)
        if self.max_model_len is not None:
            require(is_int(self.max_model_len) and self.max_model_len >= 2, "max_model_len",
                    "an integer >= 2 (a prompt token and one to generate)", self.max_model_len)
        check_fraction(self, "gpu_memory_utilization")
        require(is_int(self.num_spec_tokens) and self.num_spec_tokens >= 0, "num_spec_tokens", ">= 0",
                self.num_spec_tokens)
        require(is_int(self.cpu_gemm_from_rows) and self.cpu_gemm_from_rows >= 0, "cpu_gemm_from_rows", ">= 0",
                self.cpu_gemm_from_rows)
        require(self.cpu_gemm_library in ("auto", "mkl", "onednn"), "cpu_gemm_library", '"auto", "mkl" or "onednn"',
                self.cpu_gemm_library)
        require(self.ngram_min <= self.ngram_max, "ngram_min", f"<= ngram_max ({self.ngram_max})", self.ngram_min)
        require(is_int(self.seed), "seed", "an integer", self.seed)
        check_logprobs_options(self.max_logprobs, self.logprobs_mode)
        check_quantization(self.quantization, self.quantization_config)
        check_runner(self.runner)
        check_pooler_config(self.pooler_config)
        if self.runner == "pooling":
            check_pooling_options(self)
        require(isinstance(self.enable_lora, bool), "enable_lora", "true or false", self.enable_lora)
        check_positive(self, "max_loras", "max_lora_rank")
        check_positive(self, "max_cpu_loras", optional=True)
        if self.max_cpu_loras is not None:
            require(self.max_cpu_loras >= self.max_loras, "max_cpu_loras", f">= max_loras ({self.max_loras})",
                    self.max_cpu_loras)
        spec = self.speculative
        if spec is not None and spec.is_draft_model and self.group_size > 1:
            raise ValueError("speculative_config: a draft model runs in a single-rank worker only, not with "
                             "tensor_parallel_size or pipeline_parallel_size > 1 (the draft would need sharding "
                             "beside the target's); use method ngram there")
        if spec is not None and spec.quantization_config is not None:
            try:
                check_quantization(spec.quantization, spec.quantization_config)
            except ValueError as exc:
                raise ValueError(f"speculative_config.{exc}") from None

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """Speculative decoding as configured (``speculative_config`` checked, or the
        ``num_spec_tokens`` shorthand as n-gram drafting); None: off. ``ValueError``
        naming the field, or both when both are given."""
        if self.speculative_config is None:
            if not self.num_spec_tokens:
                return None
            return SpeculativeConfig(method="ngram", num_speculative_tokens=self.num_spec_tokens,
                                     prompt_lookup_min=self.ngram_min, prompt_lookup_max=self.ngram_max)
        if self.num_spec_tokens:
            raise ValueError("num_spec_tokens (--spec-tokens) and speculative_config both set speculative "
                             "decoding: give one (num_spec_tokens is the n-gram shorthand)")
        if (self.ngram_min, self.ngram_max) != (1, 4):
            raise ValueError("ngram_min / ngram_max go with num_spec_tokens; with speculative_config use its "
                             "prompt_lookup_min / prompt_lookup_max")
        return parse_speculative_config(self.speculative_config)

    @property
    def spec_tokens(self) -> int:
        """Draft tokens per decoding row and step (0: no speculative decoding)."""
        spec = self.speculative
        return spec.num_speculative_tokens if spec is not None else 0

    @property
    def group_size(self) -> int:
        """Ranks (Ray actors) per replica: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def sampler_config(self, vocab_size: int) -> SamplerConfig:
        """The sampler's and the logits processors' configuration, for a model of
        ``vocab_size`` tokens."""
        return SamplerConfig(
            vocab_size=vocab_size, max_num_seqs=self.max_num_seqs, num_spec_tokens=self.spec_tokens,
            max_logprobs=self.max_logprobs, logprobs_mode=self.logprobs_mode,
            logits_processors=list(self.logits_processors),
        )


def check_pooling_options(config: WorkerConfig) -> None:
    """A pooling model runs on one rank, without drafts or adapters (``ValueError``
    naming the option that asks for them)."""
    if config.group_size > 1:
        raise ValueError("runner pooling: a pooling model runs in a single-rank worker (tensor_parallel_size and "
                         "pipeline_parallel_size 1)")
    if config.spec_tokens:
        raise ValueError("runner pooling: speculative decoding (speculative_config, num_spec_tokens) has nothing "
                         "to draft for a pooling model")
    if config.enable_lora:
        raise ValueError("runner pooling: enable_lora is not supported for pooling models yet")


def parse_partition(text: str | None) -> list[int] | None:
    """``"10,10,10"`` -> ``[10, 10, 10]`` (None stays None); ``ValueError`` naming
    ``pipeline_layer_partition`` otherwise."""
    if text is None:
        return None
    try:
        parts = [int(p) for p in str(text).split(",")]
    except ValueError:
        raise ValueError(f"pipeline_layer_partition must be comma-separated layer counts, got {text!r}") from None
    if not parts or any(p < 1 for p in parts):
        raise ValueError(f"pipeline_layer_partition must be positive layer counts, got {text!r}")
    return parts


#: ``quantization`` values raydecode runs (None: the checkpoint's own format)
QUANTIZATION_METHODS = ("gguf", "compressed-tensors", "awq", "gptq", "int8", "int4", "none")
#: values vLLM knows that raydecode does not run, refused by name before anything starts
QUANTIZATION_NOT_RUN = (
    "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "mxfp4", "mxfp6", "bitsandbytes", "gptq_marlin",
    "gptq_marlin_24", "awq_marlin", "marlin", "gptq_bitblas", "bitblas", "deepspeedfp", "tpu_int8", "experts_int8",
    "quark", "moe_wna16", "torchao", "inc", "auto-round", "petit_nvfp4", "hqq", "ptpc_fp8", "rtn",
)


def check_quantization(quantization: str | None, options: dict[str, Any] | None) -> None:
    """``quantization`` names a method raydecode runs; the ones vLLM knows and raydecode
    does not are refused by name, any other value with the accepted list."""
    if quantization is not None:
        require(isinstance(quantization, str), "quantization", f"one of {list(QUANTIZATION_METHODS)} or None",
                quantization)
        if quantization in QUANTIZATION_NOT_RUN:
            raise ValueError(f"quantization {quantization!r} is not supported by raydecode (it accepts "
                             f"{', '.join(QUANTIZATION_METHODS)}, or None for the checkpoint's own format)")
        require(quantization in QUANTIZATION_METHODS, "quantization",
                f"one of {list(QUANTIZATION_METHODS)} or None", quantization)
    if options is not None:
        require(isinstance(options, dict), "quantization_config", "a mapping of options", options)
        require(quantization in ("int4", "int8"), "quantization_config",
                "only with quantization int4 or int8 (the on-the-fly schemes' options)", options)
        check_quantization_options(quantization, options)


#: ``quantization_config`` keys of the on-the-fly schemes
ON_THE_FLY_OPTIONS = {"int4": {"group_size", "symmetric"}, "int8": set()}


def check_quantization_options(scheme: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The validated ``quantization_config`` of an on-the-fly scheme; ``ValueError``
    naming a key or value it does not take."""
    options = dict(options or {})
    allowed = ON_THE_FLY_OPTIONS.get(scheme, set())
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"quantization_config: {unknown} are not options of {scheme} "
                         f"(it takes {sorted(allowed) or 'none'})")
    if "group_size" in options:
        g = options["group_size"]
        if not isinstance(g, int) or isinstance(g, bool) or g < 2 or g % 2:
            raise ValueError(f"quantization_config: group_size must be an even integer >= 2, got {g!r}")
    if "symmetric" in options and not isinstance(options["symmetric"], bool):
        raise ValueError(f"quantization_config: symmetric must be true or false, got {options['symmetric']!r}")
    return options
