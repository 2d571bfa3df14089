"""ComputeWorker's stream pacing: between messages it waits (``engine.stream_interval_ms``,
longer with many streams) while the engine coalesces tokens, but a request that will reach
``max_tokens`` sooner is not held past its last token, nor is one whose engine says its
last delta is ready (``Engine.end_signal``). A stand-in engine that makes a token
every few ms on its own clock and hands over what it has made since the last read, as
vLLM's DELTA outputs do (pure unit test: no Ray)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from deployments.compute.deployment import ComputeWorker, _until_length_end, _wait_unless_done
from deployments.compute.engines.protocol import (
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)
from tests.fixtures.logs import log_fields, messages_containing, serve_log_captured
from tests.fixtures.engines import StandInEngine

TOKEN_PERIOD_S = 0.005


class _ClockEngine(StandInEngine):
    def __init__(self, eos_after: int | None = None):
        self.eos_after = eos_after

    async def generate(self, request):
        limit = request.sampling.max_tokens if self.eos_after is None else self.eos_after
        finish = "length" if self.eos_after is None else "stop"
        started, sent = time.monotonic(), 0
        while sent < limit:
            made = min(limit, int((time.monotonic() - started) / TOKEN_PERIOD_S) + 1)
            if made > sent:
                yield TokenDelta(
                    text="x" * (made - sent), token_ids=[7] * (made - sent),
                    finish_reason=finish if made == limit else None, num_output_tokens=made,
                )
                sent = made
            else:
                await asyncio.sleep(TOKEN_PERIOD_S / 5)


class _SignallingEngine(_ClockEngine):
    """Says when a request's last delta is ready (Engine.end_signal), as the torch and
    vLLM engines do."""

    def __init__(self, eos_after: int | None = None):
        super().__init__(eos_after)
        self._ended: dict[str, asyncio.Future] = {}
        self.signals_made = 0

    def end_signal(self, request_id):
        return self._ended.get(request_id)

    async def generate(self, request):
        ended = self._ended[request.request_id] = asyncio.get_running_loop().create_future()
        self.signals_made += 1
        limit = request.sampling.max_tokens if self.eos_after is None else self.eos_after
        # The last token is made behind the consumer's back while it waits: the future is
        # done then, and the delta that carries it is read when the wait ends.
        async def mark_end():
            await asyncio.sleep(limit * TOKEN_PERIOD_S)
            ended.set_result(None)

        marker = asyncio.create_task(mark_end())
        try:
            async for delta in super().generate(request):
                yield delta
        finally:
            marker.cancel()
            self._ended.pop(request.request_id, None)


class _SlowStartEngine(_ClockEngine):
    """Its first token comes after ``delay_s`` (a prefix fetch, a prefill)."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    async def generate(self, request):
        await asyncio.sleep(self.delay_s)
        async for delta in super().generate(request):
            yield delta


async def _streams(engine, max_tokens: list[int], interval_ms: float, log_level: str = "INFO"):
    """One worker; its requests one after the other: (deltas, seconds) of each."""
    config = {
        "engine": {"warmup": False, "stream_interval_ms": interval_ms, "stream_max_messages_per_s": 0},
        "telemetry": {"log_level": log_level},
    }
    worker = ComputeWorker.__new__(ComputeWorker)
    await ComputeWorker.__init__(worker, config, engine_factory=lambda *a, **k: engine)
    out = []
    for i, n in enumerate(max_tokens):
        request = GenerationRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=n))
        started = time.monotonic()
        deltas = [d async for d in worker.generate(request)]
        out.append((deltas, time.monotonic() - started))
    return out


def test_a_length_capped_stream_is_not_held_past_its_last_token():
    # 40 tokens take ~0.2 s; a coalescing wait is 1 s. The first stream waits once before
    # the worker knows how fast streams go (then its own rate ends the next wait at its
    # last token); the next one is not held at all.
    (first, first_s), (second, second_s) = asyncio.run(
        _streams(_ClockEngine(), max_tokens=[400, 40], interval_ms=1000)
    )
    assert sum(len(d.token_ids) for d in first) == 400 and first[-1].finish_reason == "length"
    assert first_s < 2.0 + 1.0, f"held past its last token: {first_s:.2f}s for ~2 s of tokens"
    assert sum(len(d.token_ids) for d in second) == 40 and second[-1].finish_reason == "length"
    assert second_s < 0.7, f"the last token waited out the interval: {second_s:.2f}s"
    # Still coalesced: the first token alone, then a few messages, not one per token.
    assert len(first) <= 6 and len(second) <= 6, ([len(d.token_ids) for d in first], [len(d.token_ids) for d in second])


def test_a_stream_that_ends_early_still_waits_out_its_interval():
    # Ends by EOS after 10 of 40 tokens: an engine without an end signal does not say so,
    # and the wait stands.
    [(deltas, took)] = asyncio.run(_streams(_ClockEngine(eos_after=10), max_tokens=[40], interval_ms=300))
    assert sum(len(d.token_ids) for d in deltas) == 10 and deltas[-1].finish_reason == "stop"
    assert took >= 0.3 and len(deltas) == 2


def test_a_stream_that_ends_early_is_not_held_when_the_engine_says_so():
    # The same EOS after 10 of 40 tokens (~50 ms) with a 1 s wait: an engine with an end
    # signal ends the wait when the last delta is ready; the stream is still coalesced
    # (the first token alone, then the rest in one delta).
    engine = _SignallingEngine(eos_after=10)
    [(deltas, took)] = asyncio.run(_streams(engine, max_tokens=[40], interval_ms=1000))
    assert sum(len(d.token_ids) for d in deltas) == 10 and deltas[-1].finish_reason == "stop"
    assert took < 0.6, f"the finished stream waited out its interval: {took:.2f}s"
    assert len(deltas) == 2, [len(d.token_ids) for d in deltas]
    assert engine.signals_made == 1 and engine.end_signal("r0") is None  # dropped with its stream


def test_a_length_capped_stream_with_an_end_signal_ends_at_its_last_token():
    # No rate projection is needed: the first request's end already ends its wait.
    engine = _SignallingEngine()
    [(deltas, took)] = asyncio.run(_streams(engine, max_tokens=[40], interval_ms=1000))
    assert sum(len(d.token_ids) for d in deltas) == 40 and deltas[-1].finish_reason == "length"
    assert took < 0.6, f"held past its last token: {took:.2f}s"
    assert len(deltas) == 2, [len(d.token_ids) for d in deltas]


def test_the_first_delta_logs_the_workers_part_of_ttft_at_debug(caplog):
    with serve_log_captured(caplog, logging.DEBUG):
        [(deltas, _)] = asyncio.run(_streams(_SlowStartEngine(0.15), max_tokens=[20], interval_ms=10, log_level="DEBUG"))
    assert len(deltas) > 1
    [line] = messages_containing(caplog, "first delta:")  # once a request, not per delta
    fields = log_fields(line)
    assert fields["request"] == "r0" and fields["prompt_tokens"] == "3"
    assert 150 <= float(fields["worker_ms"]) < 1000


@pytest.mark.parametrize(
    ("remaining", "rate", "expected"),
    [(10, 100.0, 0.1), (0, 100.0, 0.0), (-3, 100.0, 0.0), (5, 0.0, float("inf"))],
)
def test_until_length_end(remaining, rate, expected):
    assert _until_length_end(remaining, rate) == pytest.approx(expected)


def test_wait_unless_done_ends_with_the_future_and_leaves_it_alone():
    async def run():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        loop.call_later(0.05, done.set_result, None)
        started = time.monotonic()
        assert await _wait_unless_done(done, 5.0) is True
        cut = time.monotonic() - started
        assert await _wait_unless_done(done, 5.0) is True  # already done: no wait

        pending = loop.create_future()
        started = time.monotonic()
        assert await _wait_unless_done(pending, 0.05) is False
        waited = time.monotonic() - started
        # A cancelled wait leaves the watched future as it was, with no callback of ours.
        task = asyncio.ensure_future(_wait_unless_done(pending, 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not pending.done() and not pending.cancelled()
        return cut, waited, pending._callbacks  # asyncio's own list (None when empty)

    cut, waited, callbacks = asyncio.run(run())
    assert cut < 2.0, f"did not end with the future: {cut:.2f}s"
    assert waited >= 0.04
    assert not callbacks
