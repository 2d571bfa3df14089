"""The redis-server that the project starts (app/local_redis.py): its allocator keeps the
pages it frees, and a MALLOC_CONF of the caller's wins."""

from __future__ import annotations

import re

import pytest
import redis

from app.local_redis import REDIS_MALLOC_CONF, LocalRedis

pytestmark = pytest.mark.integration


def decay_ms(server: LocalRedis) -> dict[str, int]:
    """jemalloc's purge delays in the running server, from MEMORY MALLOC-STATS."""
    client = redis.Redis.from_url(server.url)
    try:
        allocator = client.info("memory")["mem_allocator"]
        if not allocator.startswith("jemalloc"):
            pytest.skip(f"this redis-server allocates with {allocator}, not jemalloc")
        stats = client.execute_command("MEMORY", "MALLOC-STATS").decode()
    finally:
        client.close()
    return {
        name: int(value)
        for name, value in re.findall(r"opt\.(dirty_decay_ms|muzzy_decay_ms): (-?\d+)", stats)
    }


@pytest.mark.parametrize("cache", [False, True], ids=["durable", "cache"])
def test_the_server_keeps_the_pages_it_frees(cache, monkeypatch):
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    assert REDIS_MALLOC_CONF == "dirty_decay_ms:-1,muzzy_decay_ms:-1"
    with LocalRedis(cache_max_memory="16mb" if cache else None) as server:
        assert decay_ms(server) == {"dirty_decay_ms": -1, "muzzy_decay_ms": -1}


def test_a_malloc_conf_in_the_environment_wins(monkeypatch):
    # An empty one: jemalloc's own defaults (pages purged after 10 s; muzzy ones at once).
    monkeypatch.setenv("MALLOC_CONF", "")
    with LocalRedis() as server:
        assert decay_ms(server) == {"dirty_decay_ms": 10_000, "muzzy_decay_ms": 0}
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:60000")
    with LocalRedis() as server:
        assert decay_ms(server)["dirty_decay_ms"] == 60_000
