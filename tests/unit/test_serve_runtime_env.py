"""The environment every replica gets from ``serve_runtime``, and the one where Ray starts
(``use_serve_process_env``, the CLI's ``--ingress``) (app/builder.py, app/cli.py)."""

from __future__ import annotations

import os

import pytest
from ray import serve

from app import cli
from app.builder import (
    HAPROXY_ENV,
    MEMORY_ENV,
    ONE_ARENA_ENV,
    SERVE_PROCESS_ENV,
    THROUGHPUT_ENV,
    use_serve_process_env,
    with_serve_runtime,
)
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


def test_only_a_replica_that_prefaults_its_heap_runs_on_one_malloc_arena():
    assert AppConfig().serve_runtime.prefault_heap_bytes == 0  # off unless asked for
    assert "MALLOC_ARENA_MAX" not in env_of(with_serve_runtime(Replica, AppConfig(), heap_prefault=True))
    config = AppConfig.model_validate({"serve_runtime": {"prefault_heap_bytes": 512 << 20}})
    assert "MALLOC_ARENA_MAX" not in env_of(with_serve_runtime(Replica, config))
    env = env_of(with_serve_runtime(Replica, config, heap_prefault=True))
    assert env["MALLOC_ARENA_MAX"] == ONE_ARENA_ENV["MALLOC_ARENA_MAX"] == "1"
    for off in ({"prefault_heap_bytes": 0}, {"keep_freed_memory": False}):
        cfg = AppConfig.model_validate({"serve_runtime": off})
        assert "MALLOC_ARENA_MAX" not in env_of(with_serve_runtime(Replica, cfg, heap_prefault=True))


def test_the_ingress_mode_sets_the_process_env_and_values_already_set_win(monkeypatch):
    # A copy: this process may start Ray later, which must not inherit these.
    env = {k: v for k, v in os.environ.items() if k not in {**SERVE_PROCESS_ENV, **HAPROXY_ENV}}
    monkeypatch.setattr(os, "environ", env)
    use_serve_process_env()
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "30"
    use_serve_process_env("haproxy")
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "30"
    with pytest.raises(ValueError, match="serve-proxy, haproxy"):
        use_serve_process_env("nginx")


def test_the_cli_stops_before_starting_anything_without_an_haproxy_binary(monkeypatch, capsys):
    import ray
    from ray.serve._private import haproxy

    def missing():
        raise FileNotFoundError("Could not find an HAProxy binary.")

    monkeypatch.setattr(haproxy, "get_haproxy_binary", missing)
    started = []
    monkeypatch.setattr(cli, "start_embedded_redis", lambda *a, **k: started.append("redis") or [])
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray"))
    assert cli.main(["run", "--ingress", "haproxy", "--config", "serve_config.yaml"]) == 2
    assert started == []
    assert "needs an HAProxy binary" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["run", "--ingress", "nginx"])
