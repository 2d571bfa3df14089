"""ComputeWorker's warm-up: one generation through the engine before the replica takes
traffic, after which the engine forgets what it measured (the warm-up runs while the
application's other replicas start on the same cores). A stand-in engine (no Ray)."""

from __future__ import annotations

import asyncio

from deployments.compute.deployment import WARMUP_PROMPT_TOKEN_IDS, ComputeWorker
from deployments.compute.engines.protocol import Engine, EngineStats, TokenDelta


class _RecordingEngine(Engine):
    def __init__(self):
        self.events: list[str] = []

    async def start(self):
        self.events.append("start")

    async def generate(self, request):
        self.events.append(f"generate {request.prompt_token_ids == WARMUP_PROMPT_TOKEN_IDS}")
        yield TokenDelta(text="x", token_ids=[7], finish_reason="length", num_output_tokens=1)

    async def check_health(self):
        pass

    def stats(self):
        return EngineStats(num_running=0, num_waiting=0)

    async def shutdown(self):
        pass

    def forget_measurements(self):
        self.events.append("forget")


def _start(warmup: bool) -> list[str]:
    async def main():
        engine = _RecordingEngine()
        worker = ComputeWorker.__new__(ComputeWorker)
        config = {"engine": {"warmup": warmup}, "telemetry": {"log_level": "INFO"}}
        await ComputeWorker.__init__(worker, config, engine_factory=lambda *a, **k: engine)
        return engine.events

    return asyncio.run(main())


def test_the_warm_up_generation_is_forgotten_by_the_engine():
    assert _start(warmup=True) == ["start", "generate True", "forget"]


def test_without_warm_up_nothing_is_generated_or_forgotten():
    assert _start(warmup=False) == ["start"]
