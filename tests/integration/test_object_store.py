"""app/object_store.py against a real Ray: a fresh worker process's mapping of the object
store holds the pages after the prefault (its resident size in /proc/self/smaps), objects
already in the store keep their bytes, and the data plane's replicas do it at start."""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np
import pytest

from app.object_store import plasma_mappings, store_mapping

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and MADV_POPULATE_WRITE are Linux's"),
]

MiB = 1 << 20


def mapping_rss(start: int) -> int:
    """Resident bytes of this process's mapping that starts at ``start`` (smaps' Rss)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                inside = int(first.split("-")[0], 16) == start
            elif inside and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found in smaps")


def this_store():
    """This process's mapping of the store in memory (None: the store is on disk)."""
    from app.object_store import _map_store

    _map_store()
    with open("/proc/self/maps") as f, open("/proc/self/mounts") as m:
        return store_mapping(plasma_mappings(f.read()), m.read())


def test_a_fresh_process_maps_the_pages_and_objects_keep_their_bytes(ray_cluster):
    import ray

    if this_store() is None:
        pytest.skip("this Ray's object store is on disk, which prefault leaves alone")
    data = np.random.default_rng(7).integers(0, 256, 4 * MiB, dtype=np.uint8)
    held = [ray.put(data)]  # in a list: the task gets the reference, not the bytes

    @ray.remote(num_cpus=0)
    class Probe:  # an actor: a process of its own, which nothing used before
        def run(self, nbytes: int, refs: list) -> dict:
            return probe(nbytes, refs)

    def probe(nbytes: int, refs: list) -> dict:
        from app.object_store import available_memory, prefault_budget, prefault_object_store

        store = this_store()
        budget = prefault_budget(nbytes, store.end - store.start, available_memory())
        before = mapping_rss(store.start)
        none = prefault_object_store(0)
        done = prefault_object_store(nbytes, who="test")
        after = mapping_rss(store.start)
        got = ray.get(refs[0])
        return {"before": before, "none": none, "done": done, "after": after, "budget": budget,
                "size": store.end - store.start, "sha": hashlib.sha256(got).hexdigest()}

    want = 256 * MiB
    actor = Probe.remote()
    try:
        out = ray.get(actor.run.remote(want, held), timeout=120)
    finally:
        ray.kill(actor)
    assert out["none"] == 0
    if out["budget"] < 64 * MiB:
        pytest.skip(f"too little memory available here for the check ({out['budget']} bytes)")
    assert out["done"] == out["budget"] <= want
    # The worker had touched little of the store; now its page tables hold the range.
    assert out["before"] < want // 2
    assert out["after"] >= out["done"]
    assert out["sha"] == hashlib.sha256(data).hexdigest()


def test_dataplane_replicas_prefault_at_start(ray_cluster, redis_server):
    from ray import serve

    from app.builder import with_serve_runtime
    from app.config import AppConfig
    from deployments.dataplane.deployment import dataplane_deployment

    if this_store() is None:
        pytest.skip("this Ray's object store is on disk, which prefault leaves alone")
    cfg = AppConfig.model_validate({
        "dataplane": {"num_replicas": 2, "num_cpus": 0.1, "redis": {"url": redis_server.url, "password_env": None}},
        "serve_runtime": {"prefault_object_store_bytes": 96 * MiB},
    })
    handle = serve.run(
        with_serve_runtime(dataplane_deployment(cfg), cfg).bind(cfg.model_dump(mode="json")),
        name="object-store-test", route_prefix=None,
    )
    try:
        seen: dict[str, int] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # each replica does it in a thread, at start
            for i in range(32):  # shard keys that reach both replicas
                stats = handle.stats.remote(shard_key=f"key-{i}").result(timeout_s=60)
                seen[stats["replica"]] = stats["object_store_prefaulted_bytes"]
            if len(seen) == 2 and set(seen.values()) == {96 * MiB}:
                break
            time.sleep(0.2)
        assert len(seen) == 2
        assert set(seen.values()) == {96 * MiB}
    finally:
        serve.delete("object-store-test")
