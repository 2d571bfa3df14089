"""The environment every replica gets from ``serve_runtime`` (app/builder.py)."""

from __future__ import annotations

from ray import serve

from app.builder import MEMORY_ENV, THROUGHPUT_ENV, with_serve_runtime
from app.config import AppConfig


@serve.deployment(ray_actor_options={"runtime_env": {"env_vars": {"MALLOC_TRIM_THRESHOLD_": "0", "OWN": "1"}}})
class Replica:
    pass


def env_of(deployment) -> dict:
    return ((deployment.ray_actor_options or {}).get("runtime_env") or {}).get("env_vars") or {}


def test_defaults_add_both_and_the_apps_own_variables_win():
    env = env_of(with_serve_runtime(Replica, AppConfig()))
    assert set(THROUGHPUT_ENV) | set(MEMORY_ENV) | {"OWN"} == set(env)
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0" and env["OWN"] == "1"
    assert env["MALLOC_MMAP_THRESHOLD_"] == MEMORY_ENV["MALLOC_MMAP_THRESHOLD_"]


def test_each_setting_adds_only_its_variables():
    memory_only = AppConfig.model_validate({"serve_runtime": {"throughput_optimized": False}})
    assert set(env_of(with_serve_runtime(Replica, memory_only))) == set(MEMORY_ENV) | {"OWN"}
    neither = AppConfig.model_validate(
        {"serve_runtime": {"throughput_optimized": False, "keep_freed_memory": False}}
    )
    assert with_serve_runtime(Replica, neither) is Replica
