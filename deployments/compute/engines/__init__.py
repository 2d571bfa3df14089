"""Engines behind the ComputeWorker, chosen by name and imported lazily so a torch-only
environment never imports vLLM (and the router never imports torch)."""

from __future__ import annotations

import importlib

from deployments.compute.engines.protocol import Engine

# name -> "module:factory"; a factory takes the validated AppConfig and returns an Engine.
ENGINE_FACTORIES = {
    "torch": "deployments.compute.engines.torch_engine:from_app_config",
    "vllm": "deployments.compute.engines.vllm_engine:from_app_config",
}


def create_engine(config) -> Engine:
    target = ENGINE_FACTORIES.get(config.engine.name)
    if target is None:
        raise ValueError(
            f"unknown engine {config.engine.name!r}; choose one of {sorted(ENGINE_FACTORIES)}"
        )
    module_name, factory_name = target.split(":")
    return getattr(importlib.import_module(module_name), factory_name)(config)
