"""A multi-node layout on one machine: a head plus a `compute` and a `data` worker node,
each started by the project's own scripts (``cluster/start_head.sh``,
``cluster/start_worker.sh <role>``) with token authentication. The application is deployed
with the node-role resources of ``cluster/serve_config.cluster.yaml``; every ComputeWorker
replica must run on a `compute_node` node and every DataPlane replica on a `data_node`
node, and chat requests (plain and with a session) must succeed. A worker's KV put
crosses nodes there: the data plane must copy it into an object of its own rather than
keep the worker's (``DataPlane.put_block_refs``).

The cluster is separate from the suite's in-process Ray (``ray_cluster`` fixture), so the
driver that deploys runs as a subprocess; the nodes are always stopped, by process group.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.fixtures.models import get_model_path
from tests.fixtures.multinode import LocalCluster, dataplane_stats, deploy
from tests.fixtures.serve_app import app_args, free_port

pytestmark = pytest.mark.integration

ROLE_OF = {"ComputeWorker": "compute_node", "DataPlane": "data_node"}


@pytest.fixture
def cluster():
    started = time.monotonic()
    c = LocalCluster()
    try:
        # The head holds the Serve controller, proxy, Ingress and Router; the role nodes
        # have just enough CPU for their role's replicas (a misplaced replica would fit
        # on the head, so the test fails if the role resources are not requested).
        c.start_head(num_cpus=4)
        c.wait_nodes(1)
        # One at a time: raylets registering together can time out on 2 cores.
        c.add_node("compute", num_cpus=2)
        c.wait_nodes(2)
        c.add_node("data", num_cpus=1)
        c.wait_nodes(3)
        print(f"3-node cluster up in {time.monotonic() - started:.1f}s")
        yield c
    except BaseException:
        print(c.diagnostics())
        raise
    finally:
        c.shutdown()


def _chat(client: httpx.Client, content: str, session_id: str | None = None) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": session_id} if session_id else {},
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
        },
    )


def test_deployments_run_on_their_role_nodes_and_serve(cluster, redis_server):
    try:
        _check_roles_and_serve(cluster, redis_server)
    except BaseException:
        print(cluster.diagnostics())
        raise


def _check_roles_and_serve(cluster, redis_server):
    started = time.monotonic()
    http_port = free_port()
    args = app_args(
        get_model_path("tiny"),
        redis_server.url,
        compute={"resources": {"compute_node": 0.01}},
        dataplane={"num_replicas": 2, "resources": {"data_node": 0.01}},
    )
    placement = deploy(cluster, args, http_port)
    print(f"deployed in {time.monotonic() - started:.1f}s: "
          + ", ".join(f"{d}: {[r['node_id'][:8] for r in rs]}" for d, rs in placement.items()))

    assert {"ComputeWorker", "DataPlane"} <= set(placement), placement
    for deployment, role in ROLE_OF.items():
        replicas = placement[deployment]
        expected = args["compute" if deployment == "ComputeWorker" else "dataplane"]["num_replicas"]
        assert len(replicas) == expected, (deployment, replicas)
        for r in replicas:
            assert role in r["resources"], f"{deployment} replica {r['actor']} runs on a node without {role}: {r}"
    # Every other deployment (ingress, router) runs somewhere alive.
    for deployment, replicas in placement.items():
        assert replicas, f"{deployment} has no live replica"

    base = f"http://127.0.0.1:{http_port}"
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(4):
            r = _chat(client, f"hello {i}")
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
        # A session's turns go through the data plane on the data node.
        sid = client.post("/v1/sessions").json()["id"]
        for i in range(2):
            r = _chat(client, f"turn {i}", session_id=sid)
            assert r.status_code == 200, r.text
        record = client.get(f"/v1/sessions/{sid}").json()
        assert [m["content"] for m in record["messages"][0::2]] == ["turn 0", "turn 1"]
        # A prompt of several KV blocks: the worker on the compute node saves them by
        # reference, and the data plane on the data node copies them into an object of
        # its own (Ray brought them over), so that L2 pins no compute-node memory.
        r = _chat(client, "a longer prompt " + " ".join(f"w{i}" for i in range(120)))
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while True:
        stats = dataplane_stats(cluster)
        copied = sum(s.get("put_bytes_copy", 0) for s in stats.values())
        if copied or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert copied > 0, stats
    assert sum(s.get("put_bytes_ref", 0) for s in stats.values()) == 0, stats
    print(f"multi-node test done in {time.monotonic() - started:.1f}s after the cluster was up")
