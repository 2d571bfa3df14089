"""ComputeWorker: one engine per replica, behind the engine protocol.

The replica is ready (Serve routes to it) only after the engine has loaded its weights and,
if configured, run a warm-up generation, because Serve waits for ``__init__`` to return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import AsyncIterator, Callable, Optional

from opentelemetry.trace import Status, StatusCode
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util import metrics

from app import telemetry
from app.config import AppConfig
from app.host_memory import HeapPrefault
from app.object_store import Prefault
from app.serve_context import DrainsOnStop
from deployments.compute.engines import create_engine
from deployments.compute.engines.kv import Ewma
from deployments.compute.engines.protocol import (
    Engine,
    EngineCapabilities,
    EngineDeadError,
    EngineError,
    EngineStats,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)

logger = logging.getLogger("ray.serve")


def _until_length_end(remaining_tokens: int, tokens_per_s: float) -> float:
    """How long until a stream that still has ``remaining_tokens`` before ``max_tokens``,
    arriving at ``tokens_per_s``, has them all: the coalescing wait need not last longer
    (its last delta would otherwise sit in the engine for the rest of the wait: up to
    64 ms at 32 streams, a tenth of a 64-token request). A request that ends early
    (EOS, stop) still waits out the interval."""
    if tokens_per_s <= 0:
        return float("inf")
    return max(0.0, remaining_tokens) / tokens_per_s


async def _wait_unless_done(done: asyncio.Future, seconds: float) -> bool:
    """Wait ``seconds``, or until ``done`` completes if sooner (it is watched, never
    cancelled); whether it is done. As cheap as ``asyncio.sleep`` (a timer and a future;
    ``asyncio.timeout`` around a wait cost ~30 µs more per wait here, in its cancellation)."""
    if done.done():
        return True
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_=None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(seconds, wake)
    done.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        done.remove_done_callback(wake)
    return done.done()


WARMUP_PROMPT_TOKEN_IDS = list(range(10, 42))


def _process_age_s() -> float:
    """Seconds since this process started (NaN where unknown): a replica's start before
    its constructor (the worker process, Ray's and Serve's imports) is part of its start."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a log figure only
        return float("nan")


def promote_hold_bytes(config: AppConfig) -> int:
    """The bytes of its own L3 reads a torch worker keeps for their promotions
    (``dataplane.promote_hold_bytes``): at most a quarter of its KV arena, whose buffers
    they are (the rest stays for the sequences' caches)."""
    hold = config.dataplane.promote_hold_bytes
    if config.engine.kv_arena_bytes:
        hold = min(hold, config.engine.kv_arena_bytes // 4)
    return hold


class ComputeWorker(DrainsOnStop):
    """Serve deployment class (bound in ``app.builder``)."""

    async def __init__(
        self,
        config: dict,
        dataplane: Optional[DeploymentHandle] = None,
        engine_factory: Optional[Callable[..., Engine]] = None,
    ):
        self._drain_started = False
        self._config = AppConfig.model_validate(config)
        telemetry.setup(self._config.telemetry, "compute-worker")
        self._tracer = telemetry.tracer(__name__)
        # Requests inside generate() (the replica's queue depth).
        self._num_in_flight = 0
        # Tokens per second of one stream (moving average over streams): how soon a stream
        # reaches max_tokens, before it has shown its own rate (see generate's pacing).
        self._stream_tokens_per_s = Ewma(0.2)
        # generate() calls this replica took (placement tests read it from routing stats).
        self._num_requests = 0
        started = time.monotonic()
        # Where the replica's start went (the ready line): a replacement replica's start is
        # how long its share of the traffic waits, and on a busy node most of it is imports.
        phases: dict[str, float] = {}
        mark = started

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[name] = now - mark
            mark = now

        kv_connector = None
        if dataplane is not None and self._config.dataplane.kv_reuse:
            from deployments.dataplane.connector import DataPlaneKVConnector

            dc = self._config.dataplane
            reader = None
            if dc.direct_l3_reads and self._config.engine.name == "torch":
                # (vLLM's own connector reads Redis in its processes: vllm_kv_connector.py.)
                from deployments.compute.engines.kv_arena import host_bytes
                from deployments.dataplane.redis_store import BlockReader

                # Its reply buffers come from the engine's KV arena (no page faults).
                reader = BlockReader.from_config(dc.kv_redis or dc.redis, buffer=host_bytes)
            kv_connector = DataPlaneKVConnector(
                dataplane, dc.block_size, l3_reader=reader, direct_calls=None if dc.direct_calls else False,
                promote_hold_bytes=promote_hold_bytes(self._config),
            )
        self._kv_connector = kv_connector
        phase("connector")
        self._engine = (engine_factory or create_engine)(self._config, kv_connector=kv_connector)
        phase("engine")
        self._prefault = None
        if kv_connector is not None and self._config.engine.name == "torch":
            # The torch engine's KV blocks go to and come from the data plane through the
            # object store (vLLM's connector reads Redis): map its pages (in a thread, from
            # now on), not a fault per 4 KiB of every block.
            self._prefault = Prefault(self._config.serve_runtime.prefault_object_store_bytes, who="ComputeWorker")
        self._heap_prefault = None
        if self._config.worker_prefaults_heap:
            # KV buffers outgrowing every one before them fault in new pages (in a thread
            # beside the engine's start; app/host_memory.py). The builder put this replica
            # on one malloc arena on the same condition.
            self._heap_prefault = HeapPrefault(self._config.serve_runtime.prefault_heap_bytes, who="ComputeWorker")
        await self._engine.start()
        phase("load")
        if self._config.engine.warmup:
            await self._warm_up()
            phase("warm_up")
        if self._heap_prefault is not None:
            # Done before the first request: beside traffic it slows the very buffers it
            # is for (app/host_memory.py:HeapPrefault).
            await asyncio.to_thread(self._heap_prefault.finished.wait)
            phase("heap_prefault")
        self._init_metrics()
        total = time.monotonic() - started
        before = _process_age_s() - total
        start_gauge = metrics.Gauge(
            "llm_worker_start_seconds",
            "How long this replica took to start, by phase: process (before the constructor: "
            "the worker process, Ray's and Serve's imports), connector, engine (its imports "
            "and construction), load, warm_up, heap_prefault, and constructor (all of these "
            "but process).",
            tag_keys=("engine", "phase"),
        )
        for name, seconds in {**phases, "constructor": total, "process": before}.items():
            if seconds == seconds:  # not NaN
                start_gauge.set(seconds, tags={"engine": self._config.engine.name, "phase": name})
        impl = getattr(self._engine, "model_impl", None)
        logger.info(
            "ComputeWorker ready: engine=%s%s model=%s in %.1fs (%s; process up %.1fs before)",
            self._config.engine.name,
            f" ({impl})" if impl else "",
            self._config.model.id,
            total,
            " ".join(f"{k} {v:.1f}s" for k, v in phases.items()),
            before,
        )

    def _init_metrics(self) -> None:
        tags = ("engine",)
        self._m_running = metrics.Gauge(
            "llm_engine_running_seqs", "Sequences the engine is running.", tag_keys=tags
        )
        self._m_waiting = metrics.Gauge(
            "llm_engine_waiting_seqs", "Sequences waiting for an engine slot.", tag_keys=tags
        )
        self._m_kv = metrics.Gauge(
            "llm_engine_kv_usage_ratio", "Fraction of engine KV capacity in use.", tag_keys=tags
        )
        self._m_tokens = metrics.Counter(
            "llm_engine_generated_tokens", "Tokens generated by the engine.", tag_keys=tags
        )
        self._m_kv_counters = {
            name: metrics.Counter(f"llm_engine_kv_{name}", doc, tag_keys=tags)
            for name, doc in (
                ("prefix_hit_tokens", "Prompt tokens whose KV came from the data plane."),
                ("prefilled_tokens", "Prompt tokens computed by prefill."),
                ("fetch_skipped", "Stored prefixes recomputed because that was measured faster."),
                ("import_rate_resets", "Imports over 4x faster than the tier's measured import speed, which then restarted from them (a stalled import, or smaller ones, had set it)."),
                ("lookups_skipped", "Data-plane lookups not made: no stored chain starts with the prompt's first block (the router's root index)."),
                ("fetch_failures", "KV fetches that failed or returned a bad block (then recomputed)."),
                ("blocks_exported", "KV blocks handed to the data plane."),
                ("l1_hit_tokens", "Prompt tokens whose KV came from the worker's own L1 prefix cache."),
                ("l1_dropped_blocks", "KV blocks dropped from the worker's L1 prefix cache because their session was deleted."),
                ("arena_fallbacks", "KV buffers that came from malloc because the KV arena had no room for them."),
                ("early_lookups_used", "Prefix lookups started by the router that the worker used instead of its own."),
                ("early_lookups_failed", "Router-started prefix lookups that failed (the worker then asked itself)."),
                ("direct_l3_reads", "Prefix loads whose L3 blocks this worker read from Redis itself."),
                ("direct_l3_blocks", "L3 blocks this worker read from Redis itself."),
                ("direct_l3_bytes", "Bytes of L3 blocks this worker read from Redis itself."),
                ("lost_refs", "Prefix loads that found an L2 object's owner (the worker that put it) gone and read the blocks inline from the data plane instead."),
                ("direct_l3_fallbacks", "Prefix loads whose L3 blocks the data plane read instead (Redis unreachable from the worker, a block gone or corrupt)."),
                ("promotions_by_ref", "Promotions of blocks this worker read from Redis that handed the data plane its bytes through the object store."),
                ("promotions_reread", "Promotions of blocks this worker read from Redis that the data plane read from Redis again (over the bytes a worker keeps for them)."),
                ("dataplane_direct_calls", "Data-plane calls sent straight to the replica that owns the key (dataplane.direct_calls)."),
                ("dataplane_direct_fallbacks", "Data-plane calls sent straight to a replica that died or could not be reached, then made through Serve."),
            )
        }
        self._kv_reported: dict[str, int] = {}
        # What the engine's fetch-or-recompute decision compares (engines/kv.py:should_fetch).
        self._m_prefill_speed = metrics.Gauge(
            "llm_engine_prefill_tokens_per_s",
            "Measured marginal prefill speed (prompt tokens per second beyond a prefill's fixed cost).",
            tag_keys=tags,
        )
        self._m_prefill_fixed = metrics.Gauge(
            "llm_engine_prefill_fixed_seconds", "Measured fixed cost of a prefill (seconds).", tag_keys=tags
        )
        self._m_import_speed = metrics.Gauge(
            "llm_engine_kv_import_bytes_per_s",
            "Measured speed of importing a stored prefix from a tier (load, decode, copy to the device).",
            tag_keys=(*tags, "tier"),
        )
        self._m_arena_bytes = metrics.Gauge(
            "llm_engine_kv_arena_bytes",
            "The torch engine's KV arena on a CPU (kv_arena.py): bytes in use and capacity.",
            tag_keys=(*tags, "state"),
        )
        self._m_queue_depth = metrics.Gauge(
            "llm_worker_queue_depth",
            "Requests in this replica not yet finished (what the autoscaler scales on).",
            tag_keys=tags,
        )
        self._m_pacing_ended_early = metrics.Counter(
            "llm_worker_stream_waits_ended_early",
            "Waits between a stream's messages (engine.stream_interval_ms) cut short because "
            "the engine had the request's last delta ready (Engine.end_signal).",
            tag_keys=tags,
        )
        self._m_drains = metrics.Counter(
            "llm_worker_drains", "Replicas that drained and flushed their KV before exiting.", tag_keys=tags
        )
        self._m_drain_flushed = metrics.Counter(
            "llm_worker_drain_flushed_exports",
            "KV exports still pending when a replica was stopped, flushed before it exited.",
            tag_keys=tags,
        )
        self._m_drain_seconds = metrics.Histogram(
            "llm_worker_drain_flush_seconds",
            "Time a stopping replica spent flushing its KV exports to the data plane.",
            boundaries=[0.01, 0.05, 0.1, 0.5, 1, 5, 30],
            tag_keys=tags,
        )
        self._tags = {"engine": self._config.engine.name}
        for m in (
            self._m_running,
            self._m_waiting,
            self._m_kv,
            self._m_tokens,
            *self._m_kv_counters.values(),
            self._m_prefill_speed,
            self._m_prefill_fixed,
            self._m_import_speed,
            self._m_arena_bytes,
            self._m_queue_depth,
            self._m_pacing_ended_early,
            self._m_drains,
            self._m_drain_flushed,
            self._m_drain_seconds,
        ):
            m.set_default_tags(self._tags)

    async def _warm_up(self) -> None:
        request = GenerationRequest(
            request_id=f"warmup-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=WARMUP_PROMPT_TOKEN_IDS,
            sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        async for _ in self._engine.generate(request):
            pass
        # It ran while the application's other replicas started on the same cores: its
        # timings would mislead the engine's fetch-or-recompute decision.
        self._engine.forget_measurements()

    async def generate(
        self, request: GenerationRequest, batch_key: Optional[str] = None
    ) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of one request. ``batch_key`` is read by the request router
        (placement) only. Cancelling this stream aborts the request in the engine."""
        self._num_requests += 1
        ctx = telemetry.extract_context(request.trace_headers)
        # Not the current span: this generator's first delta and its last may be read in
        # different tasks (the ingress's handler, then its streaming body), and a span
        # made current in one Context cannot be detached in another. Nothing inside needs
        # it current; it only has to end.
        span = self._tracer.start_span("worker.generate", context=ctx)
        try:
            span.set_attribute("llm.request_id", request.request_id)
            span.set_attribute("llm.prompt_tokens", len(request.prompt_token_ids))
            num_tokens = 0
            ec = self._config.engine
            base_interval_s = ec.stream_interval_ms / 1000.0
            rate = ec.stream_max_messages_per_s
            max_tokens = request.sampling.max_tokens
            first_at, first_tokens = None, 0
            # The engine's future for this request's end (Engine.end_signal), looked up at
            # the first wait: the engine makes it when it takes the request.
            end_signal = getattr(self._engine, "end_signal", None)
            ended = None
            self._num_in_flight += 1
            try:
                # aclosing: a cancellation that lands outside the engine's iterator (in
                # the sleep below) must still close it, which aborts the request.
                entered = time.monotonic()
                async with contextlib.aclosing(self._engine.generate(request)) as deltas:
                    async for delta in deltas:
                        if not num_tokens and delta.token_ids and logger.isEnabledFor(logging.DEBUG):
                            # With the engine's "kv prefix fetched" line (its part of this
                            # wait) and the ingress's "request done" (the whole TTFT).
                            logger.debug(
                                "first delta: request=%s prompt_tokens=%d worker_ms=%.1f",
                                request.request_id, len(request.prompt_token_ids),
                                1000 * (time.monotonic() - entered),
                            )
                        num_tokens += len(delta.token_ids)
                        yield delta
                        if delta.finish_reason is not None:
                            continue
                        # Tokens keep coming while we wait; the engine hands them over
                        # coalesced into the next delta. The wait grows with the number
                        # of streams so the worker's total message rate stays capped.
                        interval_s = max(base_interval_s, self._num_in_flight / rate if rate else 0.0)
                        if not interval_s:
                            continue
                        if ended is None and end_signal is not None:
                            ended = end_signal(request.request_id)
                        if ended is not None:
                            # The engine says when the last delta is ready (EOS, a stop,
                            # max_tokens): the wait ends then, not at its full length.
                            if await _wait_unless_done(ended, interval_s):  # once: the next delta is the last
                                self._m_pacing_ended_early.inc()
                            continue
                        now = time.monotonic()
                        tokens_per_s = self._stream_tokens_per_s.value  # other streams', until ours shows
                        if first_at is None:
                            first_at, first_tokens = now, num_tokens
                        elif num_tokens > first_tokens and now > first_at:
                            tokens_per_s = (num_tokens - first_tokens) / (now - first_at)
                            self._stream_tokens_per_s.update(tokens_per_s)
                        if tokens_per_s:
                            interval_s = min(interval_s, _until_length_end(max_tokens - num_tokens, tokens_per_s))
                        await asyncio.sleep(interval_s)
            except EngineError as e:
                # A request failed by an engine that died with it (the torch loop fails
                # its requests with the step's error) reports the death, so the router
                # can send it elsewhere when no token was out yet.
                if not isinstance(e, EngineDeadError) and await self.engine_dead():
                    raise EngineDeadError(f"the engine died: {e}") from e
                raise
            finally:
                self._num_in_flight -= 1
            span.set_attribute("llm.output_tokens", num_tokens)
            self._m_tokens.inc(num_tokens)
        except Exception as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            span.end()

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def kv_stats(self) -> dict:
        """The engine's cumulative KV-reuse counters ({} for an engine without them)."""
        kv_stats = getattr(self._engine, "kv_stats", None)
        if kv_stats is None:
            return {}
        s = kv_stats()
        early = getattr(self._kv_connector, "early_lookups", {})
        return {name: getattr(s, name) for name in self._m_kv_counters if hasattr(s, name)} | {
            "early_lookups_used": early.get("used", 0),
            "early_lookups_failed": early.get("failed", 0),
            "lost_refs": getattr(self._kv_connector, "lost_refs", 0),
            **{f"dataplane_direct_{k}": v for k, v in getattr(self._kv_connector, "direct_calls", {}).items()},
            **{f"direct_l3_{k}": v for k, v in getattr(self._kv_connector, "direct_l3", {}).items()},
            **{f"promotions_{k}": v for k, v in getattr(self._kv_connector, "promotions", {}).items()},
            "lookups": s.lookups,
            "arena_used_bytes": getattr(s, "arena_used_bytes", 0),
            "arena_capacity_bytes": getattr(s, "arena_capacity_bytes", 0),
            "prefill_tokens_per_s": s.prefill_tokens_per_s,
            "prefill_fixed_seconds": getattr(s, "prefill_fixed_seconds", None),
            "import_bytes_per_s": dict(getattr(s, "import_bytes_per_s", {})),
        }

    def drop_kv_blocks(self, hashes: list[str]) -> int:
        """Drop these KV blocks from the engine's own prefix cache (L1): a deleted
        session's, which ``DataPlane.delete_session`` broadcasts to every worker replica.
        How many it held; 0 for an engine that cannot drop single blocks (vLLM's prefix
        cache has no call for it: only ``reset_prefix_cache``, every block at once)."""
        drop = getattr(self._engine, "drop_cached_blocks", None)
        n = drop(hashes) if drop is not None else 0
        if n:
            logger.info("dropped %d of %d KV blocks of a deleted session from L1", n, len(hashes))
        return n

    def capabilities(self) -> EngineCapabilities:
        return self._engine.capabilities

    async def ready(self) -> bool:
        await self._engine.check_health()
        return True

    async def check_health(self) -> None:
        # Serve replaces the replica when this raises (engine thread or process died).
        await self._engine.check_health()

    async def engine_dead(self) -> bool:
        try:
            await self._engine.check_health()
        except EngineDeadError:
            return True
        return False

    def debug_kill_engine(self) -> list[int]:
        """Test hook: make the engine die as a crash would, leaving the replica up (so
        ``check_health`` has to notice). vLLM: SIGKILL its EngineCore child process(es);
        torch: the loop thread's next forward raises. Returns the killed pids."""
        import os
        import signal

        import psutil

        children = psutil.Process().children(recursive=False)
        cores = [p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name()]
        for proc in cores:
            os.kill(proc.pid, signal.SIGKILL)
        if not cores and hasattr(self._engine, "logits_hook"):

            def crash(*_):
                raise RuntimeError("engine crash injected by debug_kill_engine")

            self._engine.logits_hook = crash
        elif not cores:
            raise RuntimeError(f"no way to kill engine {type(self._engine).__name__}")
        return [p.pid for p in cores]

    def record_routing_stats(self) -> dict:
        """Polled by Serve and handed to the request router (see router/placement.py)."""
        stats = self._engine.stats()
        self._m_running.set(stats.num_running)
        self._m_waiting.set(stats.num_waiting)
        self._m_kv.set(stats.kv_usage)
        kv = self.kv_stats()
        if kv.get("prefill_tokens_per_s"):
            self._m_prefill_speed.set(kv["prefill_tokens_per_s"])
        if kv.get("prefill_fixed_seconds") is not None:
            self._m_prefill_fixed.set(kv["prefill_fixed_seconds"])
        for tier, rate in kv.get("import_bytes_per_s", {}).items():
            self._m_import_speed.set(rate, tags={"tier": tier})
        if kv.get("arena_capacity_bytes"):
            self._m_arena_bytes.set(kv["arena_used_bytes"], tags={"state": "used"})
            self._m_arena_bytes.set(kv["arena_capacity_bytes"], tags={"state": "capacity"})
        for name, value in kv.items():
            counter = self._m_kv_counters.get(name)
            if counter is not None and value > self._kv_reported.get(name, 0):
                counter.inc(value - self._kv_reported.get(name, 0))
                self._kv_reported[name] = value
        prefix_keys = getattr(self._engine, "prefix_cache_keys", None)
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_requests": self._num_requests,
            "kv": kv,  # this replica's KV-reuse counters (benchmarks read them per replica)
            # Keys of the KV blocks in the engine's L1 (cache-aware placement).
            "prefix_keys": prefix_keys() if prefix_keys is not None else b"",
        }

    def record_autoscaling_stats(self) -> dict:
        """Polled by Serve (every ``compute.autoscaling`` record interval) when autoscaling
        is on; ``queue_depth`` is what ``deployments/compute/autoscaling.py`` scales on:
        the requests this replica holds, running or waiting (in the engine or before it)."""
        stats = self._engine.stats()
        engine_depth = stats.num_running + stats.num_waiting
        depth = max(self._num_in_flight, engine_depth)
        self._m_queue_depth.set(depth)
        return {
            "queue_depth": float(depth),
            "num_running": float(stats.num_running),
            "num_waiting": float(stats.num_waiting),
        }

    async def drain(self):
        """What Serve's stop of the replica runs (``DrainsOnStop.__del__``; in an ingress
        with its worker, ``Server.__del__`` calls it). The engine stops, then every KV
        export still under way (the torch engine exports a finished request's blocks in
        the background) is flushed to the data plane, so the sessions this replica served
        keep their prefix on another replica. vLLM's connector saves synchronously per
        step: nothing is pending there."""
        self._drain_started = True
        started = time.monotonic()
        pending = self._pending_kv_exports()
        await self._engine.shutdown()  # waits for the engine's own export tasks
        if self._kv_connector is not None:
            drain_timeout = max(1.0, self._config.compute.graceful_shutdown_timeout_s - 1.0)
            try:
                await asyncio.wait_for(self._kv_connector.drain(), drain_timeout)
            except asyncio.TimeoutError:
                logger.warning("ComputeWorker drain: KV saves still pending after %.0fs", drain_timeout)
            await self._kv_connector.close()
        elapsed = time.monotonic() - started
        kv = self.kv_stats()
        if hasattr(self, "_m_drains"):
            self._m_drains.inc()
            if pending:
                self._m_drain_flushed.inc(pending)
            self._m_drain_seconds.observe(elapsed)
        logger.info(
            "ComputeWorker drained: in-flight requests finished, %d pending KV exports flushed "
            "to the data plane in %.2fs (blocks exported in total: %s); exiting",
            pending,
            elapsed,
            kv.get("blocks_exported", "n/a"),
        )
        # Serve may buffer log records (RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE); the process
        # ends soon after this returns, so write the drain's lines out now.
        for handler in logger.handlers:
            with contextlib.suppress(Exception):
                handler.flush()

    def _pending_kv_exports(self) -> int:
        """KV exports not yet acknowledged by the data plane: the engine's export tasks plus
        the connector's save calls in flight."""
        pending_exports = getattr(self._engine, "num_pending_kv_exports", None)
        exports = pending_exports() if pending_exports is not None else 0
        return exports + int(getattr(self._kv_connector, "num_pending", 0) or 0)


def placement_options(config: AppConfig) -> dict:
    """Resources of one replica. A sharded vLLM replica (tensor × pipeline > 1) reserves a
    placement group: one bundle for the replica process, one GPU bundle per shard, packed
    on one node for tensor parallelism (STRICT_PACK) or allowed across nodes for pipeline
    parallelism (PACK); vLLM starts its shard workers in those bundles."""
    compute = config.compute
    opts = config.engine.vllm
    num_shards = opts.tensor_parallel_size * opts.pipeline_parallel_size
    # The node role (`compute.resources`, e.g. {compute_node: 0.01}) goes on the replica
    # and on every bundle, so neither the replica nor a shard lands on another role's node.
    role = dict(compute.resources)
    if config.engine.name != "vllm" or num_shards == 1:
        actor = {"num_cpus": compute.num_cpus, "num_gpus": compute.num_gpus}
        return {"ray_actor_options": actor | ({"resources": role} if role else {})}
    return {
        "ray_actor_options": {"num_cpus": compute.num_cpus, "num_gpus": 0}
        | ({"resources": role} if role else {}),
        "placement_group_bundles": [{"CPU": compute.num_cpus, **role}]
        + [{"GPU": 1, "CPU": 1, **role} for _ in range(num_shards)],
        "placement_group_strategy": "STRICT_PACK" if opts.pipeline_parallel_size == 1 else "PACK",
    }


def worker_deployment(config: AppConfig):
    """The ComputeWorker deployment with the options the config asks for."""
    from ray.serve.config import RequestRouterConfig

    from deployments.router.placement import router_kwargs

    return serve.deployment(ComputeWorker).options(
        name="ComputeWorker",
        **worker_replica_options(config),
        max_ongoing_requests=config.compute.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="deployments.router.placement:QueueAwareRequestRouter",
            request_routing_stats_period_s=0.5,
            request_routing_stats_timeout_s=2.0,
            request_router_kwargs=router_kwargs(config),
        ),
    )


def worker_replica_options(config: AppConfig) -> dict:
    """How the replicas that run a ComputeWorker (the ComputeWorker deployment's, or
    app/server.py's Server) are counted or autoscaled, drained, health-checked and placed."""
    compute = config.compute
    return {
        **replica_count_options(config),
        **drain_options(config),
        "health_check_period_s": compute.health_check_period_s,
        "health_check_timeout_s": compute.health_check_timeout_s,
        **placement_options(config),
    }


def replica_count_options(config: AppConfig) -> dict:
    """``num_replicas`` as configured, or, with ``compute.autoscaling.enabled``, Serve's
    autoscaling with the queue-depth policy (``deployments/compute/autoscaling.py``)."""
    auto = config.compute.autoscaling
    if not auto.enabled:
        return {"num_replicas": config.compute.num_replicas}
    import warnings

    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    from deployments.compute.autoscaling import POLICY_PATH

    with warnings.catch_warnings():
        # Serve marks metrics_interval_s deprecated (for env variables that set it for
        # every deployment at once); it is still the field that sets this push period.
        warnings.simplefilter("ignore", DeprecationWarning)
        autoscaling = AutoscalingConfig(
            min_replicas=auto.min_replicas,
            max_replicas=auto.max_replicas,
            upscale_delay_s=auto.upscale_delay_s,
            downscale_delay_s=auto.downscale_delay_s,
            metrics_interval_s=auto.metrics_interval_s,
            look_back_period_s=auto.look_back_period_s,
            policy=AutoscalingPolicy(
                policy_function=POLICY_PATH,
                policy_kwargs={"target_queue_depth_per_replica": auto.target_queue_depth_per_replica},
            ),
        )
    return {"autoscaling_config": autoscaling}


def drain_options(config: AppConfig) -> dict:
    """How Serve stops a replica (scale-down, redeploy): it stops routing to it, waits for
    its in-flight requests (checking every ``wait_loop_s``), then calls ``__del__``, whose
    ``drain`` flushes the KV exports; all within ``timeout_s``, after which Serve kills it."""
    return {
        "graceful_shutdown_wait_loop_s": config.compute.graceful_shutdown_wait_loop_s,
        "graceful_shutdown_timeout_s": config.compute.graceful_shutdown_timeout_s,
    }
