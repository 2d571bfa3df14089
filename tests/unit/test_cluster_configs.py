"""The multi-node configs in cluster/: every YAML there loads and is valid for what it is
(a serve config, a KubeRay RayService carrying one as a string, a Ray cluster launcher
config checked against Ray's own schema); the node roles the serve configs ask for are
provided by the node types / worker groups next to them; the role resources reach the
deployment options; the start scripts refuse bad input before starting anything."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
YAMLS = sorted(CLUSTER.glob("*.yaml"))


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _serve_configs() -> list[tuple[str, dict]]:
    """(where, serve config) of every serve config in cluster/, embedded ones included."""
    found = []
    for path in YAMLS:
        for doc in _docs(path):
            if "applications" in doc:
                found.append((path.name, doc))
            elif doc.get("kind") == "RayService":
                found.append((f"{path.name}:serveConfigV2", yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return found


def _role_resources_asked(serve_config: dict) -> set[str]:
    asked = set()
    for app in serve_config["applications"]:
        cfg = AppConfig.model_validate(app.get("args") or {})
        asked |= set(cfg.compute.resources) | set(cfg.dataplane.resources)
    return asked


def _kuberay_resources(ray_start_params: dict) -> dict:
    # KubeRay's documented form: resources: '"{\"name\": 1}"' (quoted for the shell).
    raw = ray_start_params.get("resources")
    if raw is None:
        return {}
    return json.loads(raw.strip().strip('"').replace('\\"', '"'))


def test_cluster_dir_has_launcher_rayservice_and_serve_config():
    kinds = set()
    for path in YAMLS:
        for doc in _docs(path):
            if "available_node_types" in doc:
                kinds.add("launcher")
            elif doc.get("kind") == "RayService":
                kinds.add("rayservice")
            elif "applications" in doc:
                kinds.add("serve")
    assert kinds == {"launcher", "rayservice", "serve"}, [p.name for p in YAMLS]


@pytest.mark.parametrize("where, serve_config", _serve_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_serve_config_args_validate(where, serve_config):
    assert serve_config["applications"], where
    for app in serve_config["applications"]:
        assert app["import_path"] == "app.builder:build_app", where
        AppConfig.model_validate(app.get("args") or {})  # raises, naming the field


@pytest.mark.parametrize(
    "where, serve_config",
    [("serve_config.yaml", yaml.safe_load((REPO / "serve_config.yaml").read_text())), *_serve_configs()],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_serve_config_is_valid_for_serve_and_serves_the_grpc_api(where, serve_config):
    """Serve's own schema takes each config (as ``serve deploy`` checks it), and each one
    starts the gRPC API: a servicer function that imports, the app's own."""
    import importlib

    from ray.serve.schema import ServeDeploySchema

    from app.grpc_api import SERVICER_FUNCTION

    ServeDeploySchema.parse_obj(serve_config)
    functions = serve_config["grpc_options"]["grpc_servicer_functions"]
    assert functions == [SERVICER_FUNCTION], where
    module, _, name = SERVICER_FUNCTION.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_launcher_config_matches_ray_schema_and_provides_roles():
    from ray.autoscaler._private.util import validate_config

    launchers = [(p, d) for p in YAMLS for d in _docs(p) if "available_node_types" in d]
    assert launchers
    for path, doc in launchers:
        validate_config(doc)  # Ray's ray-schema.json (jsonschema), as `ray up` does
        types = doc["available_node_types"]
        assert doc["head_node_type"] in types
        provided = {r for t in types.values() for r in t["resources"]}
        assert {"compute_node", "data_node"} <= provided, path.name
        # Each worker type writes its role for cluster/start_worker.sh.
        for name in ("compute", "data"):
            assert f"echo {name} > ~/.llm_node_role" in types[name]["worker_setup_commands"]
            assert types[name]["resources"] == {f"{name}_node": 1}
        assert any("start_worker.sh" in c for c in doc["worker_start_ray_commands"])
        assert any("start_head.sh" in c for c in doc["head_start_ray_commands"])
    # The cluster serve config asks only for roles the launcher's node types provide.
    serve_cfg = yaml.safe_load((CLUSTER / "serve_config.cluster.yaml").read_text())
    assert _role_resources_asked(serve_cfg) == {"compute_node", "data_node"}


def test_rayservice_groups_provide_the_roles_its_serve_config_asks_for():
    services = [d for p in YAMLS for d in _docs(p) if d.get("kind") == "RayService"]
    assert services
    for svc in services:
        assert svc["apiVersion"] == "ray.io/v1"
        spec = svc["spec"]
        assert isinstance(spec["serveConfigV2"], str)  # KubeRay takes the serve config as a string
        cluster = spec["rayClusterConfig"]
        assert cluster["authOptions"] == {"mode": "token"}
        groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
        provided = set(_kuberay_resources(cluster["headGroupSpec"]["rayStartParams"]))
        for g in groups.values():
            provided |= set(_kuberay_resources(g["rayStartParams"]))
        asked = _role_resources_asked(yaml.safe_load(spec["serveConfigV2"]))
        assert asked and asked <= provided, (asked, provided)
        gpu = groups["compute"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(gpu["nvidia.com/gpu"]) >= 1
        # What app/builder.py says must be where Ray starts, in every Ray container.
        from app.builder import SERVE_PROCESS_ENV

        pods = [cluster["headGroupSpec"], *groups.values()]
        for pod in pods:
            for container in pod["template"]["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                assert all(env.get(k) == v for k, v in SERVE_PROCESS_ENV.items()), container["name"]


# ---- role resources in the config and the deployment options ----


def test_role_resources_default_empty_and_reach_deployment_options():
    from deployments.compute.deployment import placement_options
    from deployments.dataplane.deployment import dataplane_deployment

    laptop = AppConfig()
    assert laptop.compute.resources == {} and laptop.dataplane.resources == {}
    assert "resources" not in placement_options(laptop)["ray_actor_options"]

    cfg = AppConfig.model_validate(
        {"compute": {"resources": {"compute_node": 0.01}}, "dataplane": {"resources": {"data_node": 0.01}}}
    )
    # worker_deployment passes placement_options(config) to Serve as they are.
    assert placement_options(cfg)["ray_actor_options"]["resources"] == {"compute_node": 0.01}
    assert dataplane_deployment(cfg).ray_actor_options["resources"] == {"data_node": 0.01}


def test_sharded_vllm_replica_puts_the_role_on_every_bundle():
    from deployments.compute.deployment import placement_options

    cfg = AppConfig.model_validate(
        {
            "engine": {"name": "vllm", "vllm": {"tensor_parallel_size": 2}},
            "compute": {"resources": {"compute_node": 0.01}},
        }
    )
    opts = placement_options(cfg)
    assert opts["ray_actor_options"]["resources"] == {"compute_node": 0.01}
    assert len(opts["placement_group_bundles"]) == 3
    assert all(b["compute_node"] == 0.01 for b in opts["placement_group_bundles"])


@pytest.mark.parametrize(
    "section, resources, message",
    [
        ("compute", {"CPU": 1}, "compute.resources: 'CPU' is not a custom resource"),
        ("compute", {"GPU": 1}, "compute.resources: 'GPU' is not a custom resource"),
        ("dataplane", {"memory": 1}, "dataplane.resources: 'memory' is not a custom resource"),
        ("dataplane", {"data_node": 0}, "dataplane.resources.data_node must be in (0, 1024]"),
        ("compute", {"compute_node": -1}, "compute.resources.compute_node must be in (0, 1024]"),
    ],
)
def test_bad_role_resources_are_named(section, resources, message):
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate({section: {"resources": resources}})
    assert message in str(e.value)


# ---- the start scripts (nothing is started: they fail before `ray start`) ----


def _run_script(args: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # A ray that must not be reached: the checks come first.
    base.update({"HOME": str(tmp_path), "RAY_BIN": "false", **env})
    return subprocess.run(args, env=base, capture_output=True, text=True, timeout=30, check=False)


def test_scripts_parse():
    for script in ("start_head.sh", "start_worker.sh", "_common.sh"):
        subprocess.run(["bash", "-n", str(CLUSTER / script)], check=True)


def test_worker_script_rejects_unknown_role(tmp_path):
    r = _run_script([str(CLUSTER / "start_worker.sh"), "gpu", "10.0.0.1:6379"], tmp_path, RAY_AUTH_TOKEN="x")
    assert r.returncode == 2 and "unknown role 'gpu'" in r.stderr, r.stderr


def test_worker_script_needs_the_cluster_token(tmp_path):
    r = _run_script([str(CLUSTER / "start_worker.sh"), "compute", "10.0.0.1:6379"], tmp_path)
    assert r.returncode == 2 and "no auth token" in r.stderr, r.stderr
    r = _run_script(
        [str(CLUSTER / "start_worker.sh"), "data", "10.0.0.1:6379"],
        tmp_path,
        RAY_AUTH_TOKEN_PATH=str(tmp_path / "missing"),
    )
    assert r.returncode == 2 and "missing or empty" in r.stderr, r.stderr


def test_worker_script_passes_role_and_token_mode_to_ray_start(tmp_path):
    # A stand-in `ray` that records its arguments and environment.
    fake = tmp_path / "ray"
    fake.write_text(
        '#!/bin/sh\necho "$RAY_AUTH_MODE $RAY_SERVE_PROXY_USE_GRPC $RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH $*"'
        ' > "$HOME/called"\n'
    )
    fake.chmod(0o755)
    r = _run_script(
        [str(CLUSTER / "start_worker.sh"), "data", "10.0.0.1:6379", "--num-cpus=4"],
        tmp_path,
        RAY_AUTH_TOKEN="t0k",
        RAY_BIN=str(fake),
    )
    assert r.returncode == 0, r.stderr
    called = (tmp_path / "called").read_text()
    from app.builder import GRPC_MAX_MESSAGE_BYTES

    assert called.startswith(f"token 1 {GRPC_MAX_MESSAGE_BYTES} start --address=10.0.0.1:6379")
    assert '--resources={"data_node": 1}' in called and called.rstrip().endswith("--num-cpus=4")
