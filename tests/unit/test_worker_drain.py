"""ComputeWorker's shutdown (what Serve calls after draining a replica's requests) flushes
the KV saves still in flight to the data plane before it returns, and reports it; and the
queue depth it reports to the autoscaler. A stand-in engine and data-plane handle (pure
unit test: no Ray); the connector is the real one."""

from __future__ import annotations

import asyncio
import logging

from deployments.compute.deployment import ComputeWorker
from deployments.compute.engines.protocol import (
    EngineCapabilities,
    EngineStats,
    TokenDelta,
)
from deployments.dataplane.connector import DataPlaneKVConnector


class _StubEngine:
    capabilities = EngineCapabilities()

    def __init__(self):
        self.running, self.waiting = 0, 0
        self.shut_down = False

    async def start(self):
        pass

    async def generate(self, request):
        yield TokenDelta(text="x", token_ids=[7], finish_reason="length", num_output_tokens=1)

    def stats(self):
        return EngineStats(num_running=self.running, num_waiting=self.waiting)

    async def check_health(self):
        pass

    async def shutdown(self):
        self.shut_down = True


class _SlowPut:
    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.done: list[list[str]] = []

    def remote(self, tenant, hashes, *args, shard_key=None):
        async def call():
            await asyncio.sleep(self.delay_s)
            self.done.append(list(hashes))
            return len(hashes)

        return call()


class _Handle:
    def __init__(self, delay_s: float):
        self.put_blocks_packed = _SlowPut(delay_s)


class _Reader:
    """A direct L3 reader (``redis_store.BlockReader``) that records being closed."""

    closed = False

    async def close(self) -> None:
        self.closed = True


def _config() -> dict:
    return {"engine": {"warmup": False}, "telemetry": {"log_level": "INFO"}}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_shutdown_waits_for_pending_kv_saves_and_logs_the_drain():
    async def main():
        engine = _StubEngine()
        worker = ComputeWorker.__new__(ComputeWorker)
        await ComputeWorker.__init__(worker, _config(), engine_factory=lambda *a, **k: engine)
        handle = _Handle(delay_s=0.3)
        reader = _Reader()
        worker._kv_connector = DataPlaneKVConnector(handle, block_size=16, l3_reader=reader)
        # Two exports handed to the connector just before Serve stops the replica.
        worker._kv_connector.save("default", ["h1", "h2"], [b"a" * 16, b"b" * 16])
        worker._kv_connector.save("default", ["h3"], [b"c" * 16])
        serve_logger = logging.getLogger("ray.serve")
        records, level = _Records(), serve_logger.level
        serve_logger.addHandler(records)
        serve_logger.setLevel(logging.INFO)
        try:
            await worker.drain()
        finally:
            serve_logger.removeHandler(records)
            serve_logger.setLevel(level)
        return engine, handle, records.messages, reader

    engine, handle, messages, reader = asyncio.run(main())
    assert engine.shut_down
    # Its direct L3 reader's Redis connections are closed, after the saves.
    assert reader.closed
    # Both saves reached the data plane before shutdown returned.
    assert sorted(handle.put_blocks_packed.done) == [["h1", "h2"], ["h3"]]
    drained = [m for m in messages if m.startswith("ComputeWorker drained")]
    assert len(drained) == 1 and "2 pending KV exports flushed" in drained[0], messages


def test_queue_depth_counts_requests_inside_the_worker_and_the_engine():
    async def main():
        engine = _StubEngine()
        worker = ComputeWorker.__new__(ComputeWorker)
        await ComputeWorker.__init__(worker, _config(), engine_factory=lambda *a, **k: engine)
        assert worker.record_autoscaling_stats()["queue_depth"] == 0.0
        engine.running, engine.waiting = 3, 2
        stats = worker.record_autoscaling_stats()
        assert stats == {"queue_depth": 5.0, "num_running": 3.0, "num_waiting": 2.0}
        # Requests inside generate() that the engine does not count yet (e.g. fetching
        # their prefix) still count.
        engine.running, engine.waiting = 0, 0
        worker._num_in_flight = 4
        assert worker.record_autoscaling_stats()["queue_depth"] == 4.0

    asyncio.run(main())
