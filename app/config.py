"""Configuration: one pydantic tree validated from the ``args:`` of ``serve_config.yaml``.

Every field carries a description and bounds; a bad value fails ``build_app`` (and so the
deploy) with pydantic's message, which names the field path and the allowed range.
Secrets never live here: they come from the environment or files (the Redis password,
``security``'s API keys).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.auth import TENANT_RE
from deployments.compute.engines.lora import NAME_RE as LORA_NAME_RE
from deployments.compute.engines.lora import VLLM_MAX_LORA_RANKS


class _Strict(BaseModel):
    # An unknown key is an error that names it: a typo must not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


# Ray's built-in resources have their own fields (num_cpus, num_gpus); a custom resource
# (a node role such as `compute_node`) is any other name.
_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


def _check_role_resources(field: str, resources: dict[str, float]) -> dict[str, float]:
    for name, amount in resources.items():
        if not name or name in _BUILTIN_RESOURCES or name.startswith("node:"):
            raise ValueError(
                f"{field}: {name!r} is not a custom resource name (CPU/GPU have their own "
                "fields; node:* and memory are Ray's)"
            )
        if not 0 < amount <= 1024:
            raise ValueError(f"{field}.{name} must be in (0, 1024], got {amount}")
    return resources


ROLE_RESOURCES_DESCRIPTION = (
    "Ray custom resources each replica requests, e.g. {compute_node: 0.01}: a node role "
    "(`ray start --resources`), so replicas land only on nodes of that role. Empty (the "
    "default): any node, as on a laptop."
)


class LoraModule(_Strict):
    name: str = Field(
        pattern=LORA_NAME_RE.pattern,
        description="What clients send as `model` to use the adapter (or `<model.id>:<name>`).",
    )
    path: str = Field(
        min_length=1,
        description="Local directory of the adapter in PEFT's format (adapter_config.json, "
        "adapter_model.safetensors). Relative paths resolve as `model.path` does.",
    )
    tenants: Optional[list[Annotated[str, Field(pattern=TENANT_RE.pattern)]]] = Field(
        default=None,
        min_length=1,
        description="Only these tenants (API keys' tenants, security.api_keys) may use the "
        "adapter; to any other it does not exist (a 404, and /v1/models leaves it out), as "
        "another tenant's session does not. Unset: every tenant. Without API keys every "
        "request is tenant `default`.",
    )

    def resolved_path(self) -> Path:
        return Path(self.path).expanduser().resolve()


class ModelConfig(_Strict):
    id: str = Field(
        default="tiny-llama",
        min_length=1,
        description="Model name clients send in the `model` field and /v1/models lists.",
    )
    path: str = Field(
        default="models/tiny",
        description="Local directory of a Hugging Face checkpoint (config.json, "
        "safetensors, tokenizer.json). Relative paths resolve against the working "
        "directory of `serve run`. Read-only.",
    )
    build_preset: Optional[Literal["tiny", "small"]] = Field(
        default=None,
        description="If set and `path` holds no checkpoint, build the offline random-"
        "weight model of this preset there before loading (development and CI only).",
    )
    max_model_len: Optional[int] = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description="Context length in tokens (prompt + output). Defaults to the "
        "checkpoint's max_position_embeddings.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Weight and activation dtype of the torch engine."
    )
    tool_call_parser: Optional[str] = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Serve tool_choice 'auto' (the default when a chat request sends tools): "
        "the model decides whether to call a tool, in its own format, and this parser of "
        "vLLM's reads the calls out of its reply, as `vllm serve --enable-auto-tool-choice "
        "--tool-call-parser NAME` (`hermes` for Qwen 2.5/3, `llama3_json` for Llama 3.1/3.3, "
        "`mistral`, `pythonic`, ...). Needs vLLM installed (either engine); an unknown name "
        "fails the ingress's start, naming the known ones. Unset: 'auto' is a 400.",
    )
    reasoning_parser: Optional[str] = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Split a reasoning model's reasoning from its answer: this parser of "
        "vLLM's (`qwen3`, `deepseek_r1`, `granite`, ...; `vllm serve --reasoning-parser NAME`) "
        "reads it out of each chat reply into `reasoning`, and tool calls (with "
        "tool_call_parser) from what follows. Not under a request's own structured output "
        "(the engines hold the whole reply to the grammar). Needs vLLM installed.",
    )

    lora_modules: list[LoraModule] = Field(
        default_factory=list,
        max_length=256,
        description="LoRA adapters served beside the base model, on either engine (`vllm "
        "serve --enable-lora --lora-modules name=path`): a request whose `model` names one "
        "runs with it, and /v1/models lists them. Each adapter's KV is its own (never "
        "reused by the base model or another adapter). Give a retrained adapter a new "
        "name: cached KV is keyed by the name, as the base model's by `id`.",
    )

    @model_validator(mode="after")
    def _check_lora_names(self) -> "ModelConfig":
        names = [m.name for m in self.lora_modules]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"model.lora_modules names {doubled} more than once")
        if self.id in names:
            raise ValueError(f"model.lora_modules: an adapter may not be called {self.id!r}, the model's id")
        return self

    def lora_paths(self) -> dict[str, str]:
        """Each adapter's name and absolute path, in the configured order."""
        return {m.name: str(m.resolved_path()) for m in self.lora_modules}

    def lora_tenants(self) -> dict[str, Optional[frozenset[str]]]:
        """Each adapter's name and the tenants that may use it (None: every tenant)."""
        return {m.name: None if m.tenants is None else frozenset(m.tenants) for m in self.lora_modules}

    def resolved_path(self) -> Path:
        return Path(self.path).expanduser().resolve()

    def checkpoint_max_len(self) -> int:
        """The context length: the configured one, else the checkpoint's own."""
        if self.max_model_len is not None:
            return self.max_model_len
        cfg = json.loads((self.resolved_path() / "config.json").read_text())
        return int(cfg["max_position_embeddings"])


class VLLMOptions(_Strict):
    """Options handed to vLLM's engine; validated here, before vLLM starts."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=64)
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=0.95,
        description="Fraction of GPU memory vLLM may take; the rest is headroom against "
        "KV bursts.",
    )
    max_num_batched_tokens: Optional[int] = Field(default=None, ge=16, le=1_048_576)
    enable_prefix_caching: bool = Field(default=True)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"] = "auto"
    # vLLM 0.32's QUANTIZATION_METHODS (vllm.model_executor.layers.quantization).
    quantization: Optional[
        Literal[
            "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4",
            "modelopt_mxfp8", "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin",
            "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark",
            "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
            "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel",
            "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
        ]
    ] = Field(default=None, description="Weight quantization method; unset: what the checkpoint says.")
    enforce_eager: bool = Field(default=False)
    cpu_kv_cache_space_gib: Optional[float] = Field(
        default=None,
        gt=0,
        le=1024,
        description="KV cache size of the CPU build (VLLM_CPU_KVCACHE_SPACE), in GiB.",
    )
    seed: int = Field(default=0, ge=0)
    max_loras: Optional[int] = Field(
        default=None,
        ge=1,
        le=256,
        description="With model.lora_modules: most adapters in one batch (vLLM's "
        "max_loras; each takes GPU memory). Default: every adapter, at most 8.",
    )
    max_lora_rank: Optional[Literal[VLLM_MAX_LORA_RANKS]] = Field(
        default=None,
        description="With model.lora_modules: vLLM's max_lora_rank. Default: the smallest "
        "that fits every configured adapter's rank.",
    )


class EngineConfig(_Strict):
    name: Literal["torch", "vllm"] = Field(
        default="torch", description="Which engine the ComputeWorkers run."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="torch engine device; `auto` takes CUDA when present."
    )
    max_num_seqs: int = Field(
        default=32,
        ge=1,
        le=4096,
        description="Most sequences the engine runs at once (continuous batch size).",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="Which waiting request an engine starts next when a slot frees (vLLM's "
        "option, on both engines). `fcfs`: arrival order, and a request's `priority` other "
        "than 0 is a 400. `priority`: the lowest `priority` first (vLLM's meaning: lower is "
        "sooner; the default 0), arrival order among equals; vLLM also preempts the lowest "
        "running request first when its KV cache runs out.",
    )
    num_threads: Optional[int] = Field(
        default=None,
        ge=1,
        le=512,
        description="torch intra-op threads per worker on CPU; default: the CPUs Ray "
        "gave the replica.",
    )
    cpu_nice: int = Field(
        default=4,
        ge=0,
        le=19,
        description="torch engine on a CPU: its loop and compute threads run this much "
        "below the node's other work (a Linux nice increment). The HTTP front, router and "
        "data plane answer in milliseconds and share the cores with the engine; under "
        "overload they go first, so a 429 is not queued behind decode steps (at 50 req/s "
        "on 2 cores: 429 p99 0.20 s against 0.40 s at 0, medians; loadtests/overload.py). "
        "Ray starts its workers at nice 15 (RAY_worker_niceness) and nice stops at 19, so "
        "there 4 is the most that counts. 0: off.",
    )
    warmup: bool = Field(
        default=True,
        description="Run one generation before the replica reports ready.",
    )
    model_impl: Literal["auto", "native", "transformers"] = Field(
        default="auto",
        description="torch engine: how the model runs. `native`: the engine's own Llama "
        "(deployments/compute/engines/llama.py; same tokens as transformers', and a replica "
        "starts without importing transformers: 2.7-3.1 s from the first import to a started "
        "engine against 7.4-8.8 on the 2-core machines here, loadtests/torch_model_impl.py). `transformers`: Hugging Face's model class. `auto`: native "
        "where the checkpoint is a Llama it implements, else transformers.",
    )
    stream_interval_ms: float = Field(
        default=15.0,
        ge=0,
        le=1000,
        description="A worker sends a request's tokens on at most every this many ms (the "
        "first token at once): each message crosses worker → ingress → HTTP proxy, so fewer, "
        "fuller messages cost less CPU per token. A request's last tokens leave when they are "
        "made (its end is not held for the rest of the wait). 0 sends every engine delta.",
    )
    stream_max_messages_per_s: float = Field(
        default=500.0,
        ge=0,
        le=1_000_000,
        description="Cap on the messages per second one worker sends over all its streams: "
        "with n requests streaming, each waits at least n / this between messages (so 32 "
        "streams at 500/s send every 64 ms). Under load the CPU a streamed token costs in "
        "Serve's hops stays bounded and goes to the engine instead; at low load "
        "stream_interval_ms rules. 0: no cap.",
    )
    prefix_cache_bytes: int = Field(
        default=256 << 20,
        ge=0,
        le=1 << 40,
        description="torch engine: L1 prefix cache, the KV blocks of recent prompts kept in "
        "the worker's own memory in front of the data plane (what cache-aware placement "
        "steers requests to). Active with dataplane.kv_reuse; 0 turns it off.",
    )
    kv_arena_bytes: int = Field(
        default=256 << 20,
        ge=0,
        le=1 << 40,
        description="torch engine on a CPU: host memory mapped and touched once as the worker "
        "starts, that the KV buffers of its sequences and fetched prefixes are carved from "
        "(deployments/compute/engines/kv_arena.py). Memory from malloc faults on first write, "
        "3-140 us a page on the VMs measured: a fetched 2k-token prefix's decode took 3-16 ms "
        "from touched pages and up to 386 ms from fresh ones. Capped at what max_num_seqs "
        "sequences of max_model_len tokens hold; buffers beyond it come from malloc "
        "(llm_engine_kv_arena_fallbacks). Resident for the replica's life. 0 turns it off.",
    )
    warmup_prefill_tokens: int = Field(
        default=0,
        ge=0,
        le=1 << 20,
        description="torch engine: the replica's warm-up also prefills one prompt this long "
        "(capped at max_model_len - 1; 0: only the short warm-up). A prompt longer than any "
        "before it grows the allocator's memory, and on a CPU each new page faults on first "
        "write; this moves part of that to the start. Off by default: on the small model "
        "2048 tokens cut the page faults of a growing 8-turn conversation's prefills from "
        "46k to 13-21k (later ones still grow the heap), with no TTFT difference measured, "
        "and added 2-2.8 s to each replica's start (loadtests/README.md). The vLLM engine "
        "profiles at start itself.",
    )
    vllm: VLLMOptions = Field(
        default_factory=VLLMOptions, description="Options of the vllm engine (ignored by torch)."
    )


class ComputeAutoscalingConfig(_Strict):
    """Queue-depth autoscaling of the ComputeWorkers (deployments/compute/autoscaling.py)."""

    enabled: bool = Field(
        default=False,
        description="Scale ComputeWorker replicas on queue depth; off: `num_replicas` fixed.",
    )
    min_replicas: int = Field(default=1, ge=1, le=1024, description="Fewest replicas.")
    max_replicas: int = Field(default=4, ge=1, le=1024, description="Most replicas.")
    target_queue_depth_per_replica: float = Field(
        default=16.0,
        gt=0,
        le=100_000,
        description="Requests (running + waiting) one replica should hold on average; "
        "replicas = ceil(total queue depth / this), within [min_replicas, max_replicas].",
    )
    upscale_delay_s: float = Field(
        default=10.0, ge=0, le=3600, description="How long the queue must ask for more replicas."
    )
    downscale_delay_s: float = Field(
        default=60.0, ge=0, le=86_400, description="How long the queue must ask for fewer replicas."
    )
    metrics_interval_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="How often each replica sends its queue depth to Serve's controller.",
    )
    look_back_period_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Window over which a replica's queue depth is averaged.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> ComputeAutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"compute.autoscaling.min_replicas ({self.min_replicas}) must not exceed "
                f"max_replicas ({self.max_replicas})"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"compute.autoscaling.look_back_period_s ({self.look_back_period_s}) must be "
                f"above metrics_interval_s ({self.metrics_interval_s})"
            )
        return self


class ComputeConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1, le=1024, description="ComputeWorker replicas.")
    num_cpus: float = Field(default=1.0, ge=0, le=1024, description="CPUs per replica.")
    num_gpus: float = Field(default=0.0, ge=0, le=64, description="GPUs per replica.")
    max_ongoing_requests: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Requests Serve lets into one replica at once (running + waiting).",
    )
    health_check_period_s: float = Field(default=10.0, gt=0, le=600)
    health_check_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    resources: dict[str, float] = Field(default_factory=dict, description=ROLE_RESOURCES_DESCRIPTION)
    autoscaling: ComputeAutoscalingConfig = Field(default_factory=ComputeAutoscalingConfig)
    # A replica that Serve stops (scale-down, redeploy) first finishes its requests, then
    # flushes its KV exports to the data plane (ComputeWorker.drain, from __del__).
    graceful_shutdown_wait_loop_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="How often a stopping replica checks whether its requests finished.",
    )
    graceful_shutdown_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Longest a stopping replica may take to drain its requests and flush "
        "its KV exports before Serve kills it.",
    )

    @model_validator(mode="after")
    def _resources(self) -> ComputeConfig:
        _check_role_resources("compute.resources", self.resources)
        return self


class PlacementConfig(_Strict):
    """Where a request runs (deployments/router/placement.py)."""

    policy: Literal["cache_aware", "p2c"] = Field(
        default="cache_aware",
        description="`cache_aware`: session affinity (consistent hashing with bounded "
        "load), then the replica holding the longest cached prefix, then power of two "
        "choices; `p2c`: power of two choices on queue length only.",
    )
    load_factor: float = Field(
        default=1.25,
        ge=1.0,
        le=10.0,
        description="A session stays on its replica while that replica's queue (with the "
        "request) is within load_factor x the average; past it, the next on the ring.",
    )
    queue_weight_tokens: float = Field(
        default=64.0,
        ge=0,
        le=1_000_000,
        description="Prefix score = cached prompt tokens - queue_weight_tokens x queue "
        "length: how many cached tokens one queued request ahead is worth.",
    )
    prefix_memory_s: float = Field(
        default=60.0,
        ge=0,
        le=86_400,
        description="How long the router counts a prompt's blocks as held by the replica "
        "it sent them to (beside what workers report); 0: reports only.",
    )


class CircuitBreakerConfig(_Strict):
    """Per worker replica: out of placement when its error rate is too high."""

    enabled: bool = Field(default=True)
    window_s: float = Field(
        default=30.0, gt=0, le=3600, description="Outcomes of this many seconds count."
    )
    min_requests: int = Field(
        default=5, ge=1, le=100_000, description="Fewest outcomes in the window before it may open."
    )
    error_rate: float = Field(
        default=0.5, gt=0, le=1, description="Failed fraction of the window that opens it."
    )
    cooldown_s: float = Field(
        default=10.0, gt=0, le=3600, description="Time out of placement before a probe."
    )
    half_open_probes: int = Field(
        default=1, ge=1, le=1000, description="Requests let through at once while probing."
    )


class RouterConfig(_Strict):
    """The router runs inside every Ingress replica (one per replica, no deployment of
    its own); ``ingress.num_replicas`` therefore also sets the number of routers."""

    max_batch_size: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="A batch is dispatched as soon as it holds this many requests.",
    )
    batch_wait_timeout_ms: float = Field(
        default=5.0,
        ge=0,
        le=10_000,
        description="Longest a request waits for its batch to fill while every worker "
        "is busy. A request arriving while a worker is idle is dispatched at once.",
    )
    max_queue_depth: int = Field(
        default=512,
        ge=1,
        le=1_000_000,
        description="Requests admitted by one router (one per ingress replica) and not yet finished; "
        "beyond it new requests get 429 with Retry-After.",
    )
    max_queue_share_per_tenant: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="The share of max_queue_depth that one tenant's requests (an API key's; "
        "security) may hold in a router; beyond it that tenant's new requests get 429 "
        "(code tenant_queue_full) while the other tenants' still get in. 1: no share.",
    )
    retry_after_s: int = Field(
        default=1, ge=1, le=3600, description="Retry-After seconds sent with a 429."
    )
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)


class LimitsConfig(_Strict):
    max_request_body_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        le=1 << 30,
        description="Largest HTTP request body; larger gets 413.",
    )
    default_max_tokens: int = Field(
        default=256,
        ge=1,
        le=1_048_576,
        description="`max_tokens` when the client sends none (capped by the context).",
    )
    max_stop_sequences: int = Field(default=4, ge=0, le=64)
    request_timeout_s: float = Field(
        default=600.0, gt=0, le=86_400, description="Wall-clock cap on one request."
    )


class IngressConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1, le=64, description="Ingress replicas.")
    # With the defaults every deployment fits Ray's 2 logical CPUs of a 2-core laptop
    # (`serve run` without a cluster): ingress 0.25 (with its router) + worker 1 + 2 × 0.25.
    num_cpus: float = Field(default=0.25, ge=0, le=64)
    with_worker: Optional[bool] = Field(
        default=None,
        description="Run each ComputeWorker in the process of an Ingress replica (one "
        "deployment, 'Server', with compute's replica count, autoscaling and resources "
        "plus ingress.num_cpus): a token goes from the engine to the HTTP response "
        "without a Serve hop. Requests are spread over replicas by the HTTP proxy "
        "(Serve's or HAProxy), not by the router's placement; a session's KV reaches any "
        "replica through the data plane; a request a dead engine failed before its first "
        "token is retried on a peer replica (or the dead one's replacement). "
        "ingress.num_replicas does not apply. Unset: on for the vLLM engine (which batches "
        "by itself) when there is one worker replica and one ingress replica, so no "
        "placement is given up; off otherwise.",
    )

    def resolve_with_worker(self, engine: str, compute: "ComputeConfig") -> bool:
        if self.with_worker is not None:
            return self.with_worker
        return (
            engine == "vllm"
            and not compute.autoscaling.enabled
            and compute.num_replicas == 1
            and self.num_replicas == 1
        )


class TenantRateLimits(_Strict):
    requests_per_minute: Optional[int] = Field(
        default=None, ge=1, le=10**9,
        description="Completions and chat completions a tenant may start per minute; null: "
        "no limit.",
    )
    tokens_per_minute: Optional[int] = Field(
        default=None, ge=1, le=10**12,
        description="Tokens a tenant may use per minute: a request is charged its prompt "
        "plus n × max_tokens when it starts, and what it did not generate is given back "
        "when it ends; null: no limit.",
    )

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


class RateLimitsConfig(TenantRateLimits):
    """Per-tenant rate limits (app/rate_limits.py), shared by every ingress replica through
    the data plane's Redis (``dataplane.redis``). The top-level limits apply to every
    tenant (``default`` too, while API keys are off) that ``tenants`` does not list."""

    tenants: dict[str, TenantRateLimits] = Field(
        default_factory=dict,
        description="A tenant's own limits, instead of the top-level ones (a limit it "
        "leaves out is no limit for it).",
    )

    @model_validator(mode="after")
    def _tenant_names(self) -> "RateLimitsConfig":
        for name in self.tenants:
            if not TENANT_RE.match(name):
                raise ValueError(f"rate_limits.tenants: {name!r} is not a tenant name (letters, digits, "
                                 "'_', '.' or '-', at most 64, starting with a letter or digit)")
        return self

    @property
    def any(self) -> bool:
        return self.limited or any(t.limited for t in self.tenants.values())

    def of(self, tenant: str) -> TenantRateLimits:
        return self.tenants.get(tenant, self)


class SecurityConfig(_Strict):
    """API keys → tenants (app/auth.py), and their rate limits (app/rate_limits.py). The
    keys themselves never go here."""

    api_keys_env: Optional[str] = Field(
        default="LLM_API_KEYS",
        min_length=1,
        description="Environment variable of each ingress replica holding API keys as "
        "'tenant:key' entries separated by whitespace or commas. No entry (here or in "
        "api_keys_file): keys are off and every request is tenant 'default'.",
    )
    api_keys_file: Optional[str] = Field(
        default=None,
        min_length=1,
        description="A file of 'tenant:key' entries (one a line, '#' comments), e.g. a "
        "mounted Kubernetes Secret; read again when it changes. It must exist where the "
        "ingress replicas run.",
    )
    reload_interval_s: float = Field(
        default=5.0, gt=0, le=3600, description="How often api_keys_file is checked for a change."
    )
    rate_limits: RateLimitsConfig = Field(
        default_factory=RateLimitsConfig,
        description="Requests and tokens per minute, per tenant (off by default); needs "
        "the data plane's Redis.",
    )


class TelemetryConfig(_Strict):
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO")
    otlp_endpoint: Optional[str] = Field(
        default=None,
        description="OTLP/HTTP traces endpoint (e.g. http://collector:4318/v1/traces); "
        "unset keeps spans in-process (visible to tests and logs) and exports nothing.",
    )
    trace_sample_ratio: float = Field(default=1.0, ge=0, le=1)
    access_log: Literal["ingress", "all", "none"] = Field(
        default="ingress",
        description="Which replicas write Ray Serve's access-log line for each call they "
        "take: 'ingress' (the default) only the Ingress (or the Server, where the ingress "
        "and its worker share a replica), one line per HTTP or gRPC request; 'all' also "
        "every ComputeWorker and DataPlane call (several per chat turn: session read, KV "
        "lookup, block saves, the turn's append); 'none' no replica. Serve's request "
        "metrics count every call either way. Without the line a DataPlane replica took "
        "1.10-1.16x the calls per second at 4 and 16 in flight (loadtests/README.md).",
    )


class RedisConfig(_Strict):
    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="redis:// or rediss:// (TLS) URL, without the password.",
    )
    password_env: Optional[str] = Field(
        default="REDIS_PASSWORD",
        description="Name of the environment variable holding the password (never the "
        "password itself); unset or empty variable: no password.",
    )
    pool_size: int = Field(default=32, ge=1, le=10_000)
    socket_timeout_s: float = Field(default=2.0, gt=0, le=120)
    connect_timeout_s: float = Field(default=1.0, gt=0, le=120)
    reconnect_interval_s: float = Field(
        default=1.0, gt=0, le=300, description="How often a degraded pool retries Redis."
    )
    tls_ca_certs: Optional[str] = Field(
        default=None,
        description="rediss:// only: PEM file of the CA certificate(s) the server's "
        "certificate must chain to; unset: the system's trust store.",
    )
    tls_certfile: Optional[str] = Field(
        default=None,
        description="rediss:// only: this client's certificate (PEM), for a server that "
        "asks clients for one (redis-server --tls-auth-clients yes).",
    )
    tls_keyfile: Optional[str] = Field(
        default=None, description="rediss:// only: the private key of tls_certfile (PEM)."
    )
    tls_verify: Literal["required", "none"] = Field(
        default="required",
        description="rediss:// only: `required` checks the server's certificate and host "
        "name; `none` checks neither (encryption without authentication: tests only).",
    )

    @model_validator(mode="after")
    def _tls(self) -> "RedisConfig":
        tls_set = [
            name for name in ("tls_ca_certs", "tls_certfile", "tls_keyfile")
            if getattr(self, name) is not None
        ] + (["tls_verify"] if self.tls_verify != "required" else [])
        if tls_set and not self.url.startswith("rediss://"):
            raise ValueError(f"{', '.join(tls_set)} need a rediss:// url (TLS), not {self.url.split('://')[0]}://")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together (a client certificate and its key)")
        return self

    def tls_kwargs(self) -> dict:
        """redis-py's keyword arguments for these TLS settings (none for redis://)."""
        if not self.url.startswith("rediss://"):
            return {}
        kwargs: dict = {"ssl_cert_reqs": self.tls_verify, "ssl_check_hostname": self.tls_verify == "required"}
        for ours, theirs in (("tls_ca_certs", "ssl_ca_certs"), ("tls_certfile", "ssl_certfile"), ("tls_keyfile", "ssl_keyfile")):
            if getattr(self, ours) is not None:
                kwargs[theirs] = getattr(self, ours)
        return kwargs


class SessionConfig(_Strict):
    cache_ttl_s: int = Field(
        default=1800, ge=1, le=30 * 86_400, description="Session expiry, refreshed on use."
    )
    overflow_policy: Literal["error", "truncate_oldest"] = Field(
        default="error",
        description="When history + request exceed the context: `error` answers 400 "
        "saying how many tokens are over; `truncate_oldest` drops the oldest turns.",
    )
    max_messages: int = Field(default=10_000, ge=1, le=1_000_000)
    response_ttl_s: int = Field(
        default=86_400,
        ge=1,
        le=30 * 86_400,
        description="How long a response stored by POST /v1/responses (store: true) can be "
        "read and continued (previous_response_id), refreshed on use. Each one keeps its "
        "whole conversation, a copy of its previous response's plus its own turn.",
    )
    ingress_cache_tokens: int = Field(
        default=1_000_000,
        ge=0,
        le=1 << 32,
        description="Each ingress replica keeps the sessions it read or wrote last, up to "
        "this many tokens of history in all (~40-70 bytes each). A turn of a session found "
        "there builds its prompt at once while the store's copy is read, and goes to a "
        "worker only once the two agree (else it is built again from the store's copy). "
        "0: every turn waits for the read.",
    )
    call_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="How long the ingress waits for the data plane's answer to one session "
        "call (read, append, create, delete; milliseconds normally, and the data plane's "
        "own Redis calls give up after redis.socket_timeout_s) before it cancels the call "
        "and makes it again, once; then 503. Every session write is safe to repeat.",
    )


class DataPlaneConfig(_Strict):
    enabled: bool = Field(
        default=True, description="Sessions API and KV-block reuse through the data plane."
    )
    kv_reuse: bool = Field(
        default=True,
        description="Save and reuse KV blocks through the data plane; off: every request "
        "prefills its whole prompt (sessions still work).",
    )
    num_replicas: int = Field(default=2, ge=1, le=1024, description="Data-plane actors (M).")
    prefetch: Literal["when_queued", "always", "off"] = Field(
        default="when_queued",
        description="When the router asks the data plane to bring a session's blocks up to "
        "host memory: `when_queued` only when no worker is idle (the request will wait, so "
        "the fetch overlaps the wait; with an idle worker the worker's own lookup follows at "
        "once and a prefetch only adds a call), `always`, or `off`.",
    )
    direct_l3_reads: bool = Field(
        default=True,
        description="Torch workers read the L3 blocks of a prefix from the blocks' Redis "
        "themselves (one transfer, checked in the worker) and the data plane then brings them "
        "up to L2; off: the data plane reads them and hands them over through the object "
        "store. vLLM's connector always reads Redis itself.",
    )
    promote_hold_bytes: int = Field(
        default=64 << 20,
        ge=0,
        le=1 << 40,
        description="A torch worker that read blocks from Redis itself keeps up to this many "
        "bytes of those reads until their promotion a second later, and hands the data plane "
        "its bytes through the object store (one copy in the worker) instead of having it read "
        "them from Redis again: Redis sends each L3 hit once. Reads past it, and every read "
        "with 0, are promoted by the data plane's own read. The reads' buffers come from the "
        "worker's KV arena, so at most a quarter of engine.kv_arena_bytes is kept.",
    )
    direct_calls: bool = Field(
        default=True,
        description="Workers send their KV calls (lookups, reads, puts, promotions), and the "
        "ingress its session calls and the KV lookups and prefetches its router starts, straight to the "
        "data-plane replica that owns the key, on the hash ring of Serve's own replica list, as "
        "Serve's router sends a plain call (the replica's handle_request), instead of through "
        "the Serve handle: ~1/3 of the caller's CPU per call and 1.4-2.2x the calls per second "
        "on 2 cores. A call whose replica died goes through Serve. Off: every call through the "
        "Serve handle.",
    )
    num_cpus: float = Field(default=0.25, ge=0, le=64)
    resources: dict[str, float] = Field(default_factory=dict, description=ROLE_RESOURCES_DESCRIPTION)
    block_size: int = Field(
        default=16, ge=1, le=4096, description="Tokens per KV block (the reuse granularity)."
    )
    l2_capacity_bytes: int = Field(
        default=1 << 30, ge=1 << 20, le=1 << 42, description="Host-memory tier size per actor."
    )
    high_watermark: float = Field(default=0.85, gt=0, le=1)
    low_watermark: float = Field(default=0.70, gt=0, le=1)
    eviction_policy: Literal["lru", "lfu"] = "lru"
    sync_interval_ms: int = Field(
        default=200, ge=1, le=600_000, description="Write-behind period from L2 to Redis."
    )
    write_behind_yield_ms: int = Field(
        default=50,
        ge=0,
        le=60_000,
        description="While blocks keep arriving at a replica (its last put less than this "
        "many ms ago), its write-behind waits for the burst to end, so that the puts (and "
        "the reads beside them) do not share the machine's CPU with the Redis writes of the "
        "same bytes; never longer than write_behind_max_delay_ms for the first block still "
        "unwritten, and not once L2 holds more than its low watermark (a dirty block "
        "evicted is written on the put's path). Counted in "
        "llm_dataplane_write_behind_deferred. 0: write behind every sync_interval_ms.",
    )
    write_behind_max_delay_ms: int = Field(
        default=2000,
        ge=1,
        le=600_000,
        description="The longest write_behind_yield_ms holds back a block's write to Redis.",
    )
    kv_ttl_s: int = Field(default=86_400, ge=1, le=365 * 86_400, description="TTL of L3 blocks.")
    drain_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="A replica that Serve stops (scale-down, redeploy, node drain) spends at "
        "most this long writing back what only its memory holds (blocks not yet written "
        "behind; sessions' turns and deletes from a Redis outage) and handing what Redis "
        "cannot take yet to the replicas that own those sessions next. Serve's graceful "
        "shutdown timeout of the deployment is this plus 5 s.",
    )
    outage_backup_timeout_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="While the sessions Redis is unreachable, a replica acknowledges a "
        "session change (create, turn, delete) that only its memory holds after a copy "
        "reached the replica that owns the session once this one is gone, so that a crash "
        "of this one during the outage loses no acknowledged turn. It waits this long for "
        "that copy, then acknowledges anyway (counted in llm_dataplane_outage_backups and "
        "logged). 0: no copies.",
    )
    root_index_sync_ms: int = Field(
        default=250,
        ge=0,
        le=60_000,
        description="The chain-root index (deployments/dataplane/root_index.py): the data "
        "plane publishes the first block hash of every stored chain to Redis this often, "
        "and each router mirrors that set this often, so a request that does not continue "
        "a session (stateless, or a first turn) and whose first block no stored chain "
        "starts with skips the data-plane lookup (a certain miss) instead of paying a call "
        "for it. A chain stored through another ingress replica becomes visible to this "
        "one within about two periods; until then a request for it recomputes. A "
        "session's later turns always look up. 0: off, every request looks up.",
    )
    redis: RedisConfig = Field(
        default_factory=RedisConfig,
        description="The durable Redis (AOF): session records, and KV blocks too unless "
        "`kv_redis` names another server.",
    )
    kv_redis: Optional[RedisConfig] = Field(
        default=None,
        description="A separate Redis for the L3 KV blocks, run as a cache: no "
        "persistence, `maxmemory` with `allkeys-lru`. Blocks are a cache that can always "
        "be recomputed, and they are most of the bytes: in the durable Redis they would "
        "go through its AOF and grow its memory without bound, and a full server would "
        "refuse session writes. An evicted block is a miss. None: blocks share `redis`.",
    )
    sessions: SessionConfig = Field(default_factory=SessionConfig)

    @model_validator(mode="after")
    def _resources(self) -> DataPlaneConfig:
        _check_role_resources("dataplane.resources", self.resources)
        return self

    @model_validator(mode="after")
    def _watermarks(self) -> "DataPlaneConfig":
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"dataplane.low_watermark ({self.low_watermark}) must be below "
                f"high_watermark ({self.high_watermark})"
            )
        return self


class ServeRuntimeConfig(_Strict):
    throughput_optimized: bool = Field(
        default=True,
        description="Run every replica of the app with Ray Serve's throughput settings "
        "(RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0, RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0"
        "): fewer thread and loop hand-offs per streamed message. "
        "Variables set in the application's own runtime_env win.",
    )
    keep_freed_memory: bool = Field(
        default=True,
        description="Run every replica with glibc malloc keeping freed memory for reuse "
        "(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) and numpy not asking for "
        "transparent huge pages (NUMPY_MADVISE_HUGEPAGE=0): the KV buffers and prefix "
        "tensors of each request then reuse pages instead of faulting in fresh ones; a "
        "replica's resident memory stays at its high-water mark. "
        "Variables set in the application's own runtime_env win.",
    )
    prefault_object_store_bytes: int = Field(
        default=2 << 30,
        ge=0,
        le=1 << 42,
        description="Bytes of the node's object store whose pages each replica that moves "
        "KV blocks through it (the data plane, torch workers with KV reuse) maps at start "
        "(app/object_store.py): its puts and reads of blocks then skip a page fault per "
        "4 KiB. Takes 0.2-0.7 s of one core per GiB at start (in a thread, at half a "
        "core, so twice that long) and allocates that much of the store's shared memory "
        "up front (at most a quarter of the memory available then, machine or "
        "container); 0 turns it off. Cover the data plane's L2 on the node (replicas x "
        "l2_capacity_bytes).",
    )
    prefault_heap_bytes: int = Field(
        default=0,
        ge=0,
        le=3 << 30,
        description="Bytes of malloc heap each torch ComputeWorker touches at start and "
        "frees again (app/host_memory.py), with keep_freed_memory on: its KV buffers are "
        "then carved from mapped pages instead of faulting in new ones whenever a context "
        "outgrows every one before it. Resident memory grows by that much at start (at "
        "most a quarter of the memory available); the worker runs on one malloc arena "
        "(MALLOC_ARENA_MAX=1) for it. 0 (the default) turns it off: with 512 MiB a "
        "session's L2 prefix decodes stopped faulting (4-10 ms at every turn against "
        "spikes of 13-20), but its loads from Redis (L3) through the data plane took 3-4x "
        "as long: the data plane's MGET slowed, with no more page faults. Since workers "
        "read L3 themselves (dataplane.direct_l3_reads) those reads stopped faulting with "
        "it (17 blocks 12 ms against 30), but TTFT did not follow in two runs each "
        "(loadtests/README.md).",
    )

    @property
    def heap_prefault_on(self) -> bool:
        """Whether a torch worker prefaults its heap (it needs malloc to keep freed memory)."""
        return self.keep_freed_memory and self.prefault_heap_bytes > 0


class AppConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    dataplane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    serve_runtime: ServeRuntimeConfig = Field(default_factory=ServeRuntimeConfig)

    @property
    def worker_prefaults_heap(self) -> bool:
        """Whether the ComputeWorker prefaults its heap (a torch engine only): the builder
        puts it on one malloc arena and the worker runs the prefault on this one answer."""
        return self.engine.name == "torch" and self.serve_runtime.heap_prefault_on

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "AppConfig":
        # The layout is decided once, here: every reader (builder, CLI, deployments) sees
        # a bool. (The models are frozen; this replaces the section before anyone has it.)
        if self.ingress.with_worker is None:
            resolved = self.ingress.resolve_with_worker(self.engine.name, self.compute)
            object.__setattr__(self, "ingress", self.ingress.model_copy(update={"with_worker": resolved}))
        if self.router.max_batch_size > self.compute.max_ongoing_requests:
            raise ValueError(
                f"router.max_batch_size ({self.router.max_batch_size}) must not exceed "
                f"compute.max_ongoing_requests ({self.compute.max_ongoing_requests})"
            )
        if self.security.rate_limits.any and not self.dataplane.enabled:
            raise ValueError(
                "security.rate_limits keeps its counts in the data plane's Redis: it needs "
                "dataplane.enabled"
            )
        if self.model.lora_modules and self.engine.name == "torch" and self.engine.model_impl == "transformers":
            raise ValueError(
                "model.lora_modules: the torch engine applies LoRA adapters in its native model; "
                "engine.model_impl transformers has none (use auto or native)"
            )
        if not self.model.lora_modules and (self.engine.vllm.max_loras or self.engine.vllm.max_lora_rank):
            raise ValueError("engine.vllm.max_loras and max_lora_rank need model.lora_modules")
        batched = self.engine.vllm.max_num_batched_tokens
        if self.engine.name == "vllm" and batched is not None and batched < self.engine.max_num_seqs:
            # vLLM's own check (SchedulerConfig), made here so that it fails before vLLM starts.
            raise ValueError(
                f"engine.vllm.max_num_batched_tokens ({batched}) must be at least "
                f"engine.max_num_seqs ({self.engine.max_num_seqs})"
            )
        return self
