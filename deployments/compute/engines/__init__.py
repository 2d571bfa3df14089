"""Engines behind the ComputeWorker, chosen by name. Each factory imports its engine
lazily, so a torch-only environment never imports vLLM (and the router never imports torch).
A factory takes the validated AppConfig and returns an unstarted Engine."""

from __future__ import annotations

from deployments.compute.engines.protocol import Engine


def _torch_engine(config, kv_connector=None) -> Engine:
    from deployments.compute.engines.torch_engine import TorchEngine

    return TorchEngine(
        str(config.model.resolved_path()),
        max_num_seqs=config.engine.max_num_seqs,
        scheduling_policy=config.engine.scheduling_policy,
        device=config.engine.device,
        dtype=config.model.dtype,
        # Default: as many threads as CPUs Ray reserved for the replica.
        num_threads=config.engine.num_threads or max(1, int(config.compute.num_cpus)),
        max_model_len=config.model.max_model_len,
        kv_connector=kv_connector,
        model_id=config.model.id,
        block_size=config.dataplane.block_size,
        prefix_cache_bytes=config.engine.prefix_cache_bytes,
        model_impl=config.engine.model_impl,
        cpu_nice=config.engine.cpu_nice,
        kv_arena_bytes=config.engine.kv_arena_bytes,
        warmup_prefill_tokens=config.engine.warmup_prefill_tokens if config.engine.warmup else 0,
        lora_modules=config.model.lora_paths(),
    )


def _vllm_engine(config, kv_connector=None) -> Engine:
    from deployments.compute.engines.vllm_engine import VLLMEngine

    return VLLMEngine.from_app_config(config)


ENGINE_FACTORIES = {"torch": _torch_engine, "vllm": _vllm_engine}


def create_engine(config, kv_connector=None) -> Engine:
    factory = ENGINE_FACTORIES.get(config.engine.name)
    if factory is None:
        raise ValueError(
            f"unknown engine {config.engine.name!r}; choose one of {sorted(ENGINE_FACTORIES)}"
        )
    return factory(config, kv_connector=kv_connector)
