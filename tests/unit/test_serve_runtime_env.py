"""The environment every replica gets from ``serve_runtime``, and the one where Ray starts
(``use_serve_process_env``, the CLI's ``--ingress``: ``auto`` takes HAProxy where it can
start, else Serve's proxy) (app/builder.py, app/cli.py)."""

from __future__ import annotations

import os
import socket

import pytest
import yaml
from ray import serve

from app import cli
from app.builder import (
    HAPROXY_ENV,
    HAPROXY_PORT_VARS,
    MEMORY_ENV,
    ONE_ARENA_ENV,
    SERVE_PROCESS_ENV,
    THROUGHPUT_ENV,
    haproxy_ports,
    resolve_ingress,
    use_serve_process_env,
    with_serve_runtime,
)
from app.config import AppConfig
from tests.fixtures.serve_app import free_port


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


@pytest.fixture
def process_env(monkeypatch):
    """A copy of os.environ without the variables these tests set (this process may
    start Ray later, which must not inherit them), with HAProxy's ports on free ones."""
    names = {**SERVE_PROCESS_ENV, **HAPROXY_ENV, **dict.fromkeys(HAPROXY_PORT_VARS.values())}
    env = {k: v for k, v in os.environ.items() if k not in names}
    monkeypatch.setattr(os, "environ", env)
    for var in HAPROXY_PORT_VARS.values():
        env[var] = str(free_port())
    return env


@pytest.fixture
def haproxy_binary(monkeypatch):
    """get_haproxy_binary stubbed: ``haproxy_binary.missing = True`` makes it fail."""
    from ray.serve._private import haproxy

    class Binary:
        missing = False

    def get():
        if Binary.missing:
            raise FileNotFoundError("Could not find an HAProxy binary.")
        return "/usr/sbin/haproxy"

    monkeypatch.setattr(haproxy, "get_haproxy_binary", get)
    return Binary


def test_auto_is_haproxy_where_it_can_start_else_serve_proxy_saying_why(process_env, haproxy_binary):
    stats, metrics = (int(process_env[v]) for v in (HAPROXY_PORT_VARS["stats"], HAPROXY_PORT_VARS["metrics"]))
    assert haproxy_ports() == {"stats": stats, "metrics": metrics}
    mode, why = resolve_ingress("auto")
    assert mode == "haproxy" and f":{stats}" in why and f":{metrics}" in why
    assert resolve_ingress("haproxy")[0] == "haproxy"
    assert resolve_ingress("serve-proxy")[0] == "serve-proxy"

    # Another listener on the metrics port (on loopback only: HAProxy binds every interface).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", metrics))
        taken.listen()
        mode, why = resolve_ingress("auto")
        assert mode == "serve-proxy" and f"metrics port {metrics} is taken" in why
        assert "RAY_SERVE_HAPROXY_METRICS_PORT" in why
        with pytest.raises(ValueError, match=f"cannot start: HAProxy's metrics port {metrics} is taken"):
            resolve_ingress("haproxy")
        assert resolve_ingress("serve-proxy")[0] == "serve-proxy"
    assert resolve_ingress("auto")[0] == "haproxy"  # free again

    haproxy_binary.missing = True
    mode, why = resolve_ingress("auto")
    assert mode == "serve-proxy" and "no HAProxy binary" in why
    with pytest.raises(ValueError, match="no HAProxy binary"):
        resolve_ingress("haproxy")
    with pytest.raises(ValueError, match="auto, serve-proxy, haproxy"):
        resolve_ingress("nginx")


def test_use_serve_process_env_resolves_auto(process_env, haproxy_binary):
    assert use_serve_process_env("auto") == "haproxy"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for var in HAPROXY_ENV:
        del os.environ[var]
    haproxy_binary.missing = True
    assert use_serve_process_env("auto") == "serve-proxy"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ


class _Stop(Exception):
    pass


@pytest.fixture
def config_file(tmp_path):
    """The project's serve_config.yaml with its HTTP and gRPC ports on free ones."""
    doc = yaml.safe_load(open("serve_config.yaml").read())
    doc["http_options"]["port"] = free_port()
    doc["grpc_options"]["port"] = free_port()
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, doc


def _cli_until_ray_init(monkeypatch, argv):
    """``cli.main(argv)`` with Redis stubbed and ``ray.init`` raising _Stop: the exit
    code (None if it got to ray.init), what started, and the environment ray.init saw."""
    import ray

    started, seen = [], {}

    class Redis:
        def stop(self):
            started.append("redis stopped")

    monkeypatch.setattr(cli, "start_embedded_redis", lambda *a, **k: started.append("redis") or [Redis()])

    def init(*a, **k):
        started.append("ray")
        seen.update(os.environ)
        raise _Stop

    monkeypatch.setattr(ray, "init", init)
    try:
        code = cli.main(argv)
    except _Stop:
        code = None
    return code, started, seen


def test_the_cli_stops_before_starting_anything_without_an_haproxy_binary(process_env, haproxy_binary, config_file, monkeypatch, capsys):
    haproxy_binary.missing = True
    code, started, _ = _cli_until_ray_init(monkeypatch, ["run", "--ingress", "haproxy", "--config", str(config_file[0])])
    assert code == 2 and started == []
    assert "--ingress haproxy cannot start: no HAProxy binary" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["run", "--ingress", "nginx"])


def test_the_cli_by_default_runs_haproxy_or_falls_back_saying_why(process_env, haproxy_binary, config_file, monkeypatch, capsys):
    config = str(config_file[0])
    code, started, seen = _cli_until_ray_init(monkeypatch, ["run", "--config", config])
    assert code is None and started == ["redis", "ray", "redis stopped"]  # Redis stopped on the way out
    assert seen["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert "ingress: HAProxy" in capsys.readouterr().out

    for var in HAPROXY_ENV:
        process_env.pop(var, None)
    haproxy_binary.missing = True
    code, started, seen = _cli_until_ray_init(monkeypatch, ["run", "--config", config])
    assert code is None and "ray" in started
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in seen
    assert seen["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    assert "ingress: Serve's proxy, not HAProxy: no HAProxy binary" in capsys.readouterr().out


@pytest.mark.parametrize("which", ["http_options", "grpc_options"])
def test_the_cli_stops_before_starting_anything_when_its_port_is_taken(which, process_env, haproxy_binary, config_file, monkeypatch, capsys):
    path, doc = config_file
    port = doc[which]["port"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        code, started, _ = _cli_until_ray_init(monkeypatch, ["run", "--config", str(path)])
    assert code == 2 and started == []
    out = capsys.readouterr().out
    assert f"port {port} on 127.0.0.1 is taken" in out and f"set {which}.port in {path}" in out
