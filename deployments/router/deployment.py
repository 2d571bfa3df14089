"""Router: admission control and dynamic batching between the ingress and the workers.

Not a Serve deployment: every Ingress replica holds one ``Router`` in its own process (as
Ray Serve LLM's ingress holds its handles), so a token crosses one Serve hop (worker →
ingress) instead of two, and Ray Serve's request router (placement.py) runs there too.

Request path inside one router::

    generate() ─ admission (bounded; full → 429) ─ batcher (size / wait / idle fast path)
             ─ dispatch: each member of a batch calls the worker with the batch's key, so
               the request router (placement.py) puts the whole batch on one replica
             ─ stream the worker's deltas back; closing the stream cancels the worker call.
             ─ a worker call that fails before its first delta because the replica or its
               engine died (:func:`is_retryable_death`) is retried once, after waiting
               (within the request's time) for a worker that answers ``ready``; after the
               first delta a failure always reaches the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Optional

from ray.serve.handle import DeploymentHandle
from ray.util import metrics

from app import serve_context, telemetry
from app.auth import DEFAULT_TENANT
from app.config import AppConfig
from app.errors import GatewayTimeoutError, RateLimitError, _causes, replica_death_types
from app.telemetry import LATENCY_BUCKETS_S
from deployments.compute.engines.kv import block_hashes, prompt_lookup_hashes
from deployments.compute.engines.protocol import EngineDeadError, GenerationRequest, TokenDelta
from deployments.dataplane.root_index import RootIndex, redis_fetcher
from deployments.dataplane.routing import DirectCalls
from deployments.router.batcher import DynamicBatcher
from deployments.router.placement import TRACKER, classify_outcome, report_outcome

logger = logging.getLogger("ray.serve")

# A tenant refused for its share of the queue is logged at most this often (a flood
# of its requests must not flood the log).
TENANT_REFUSAL_LOG_INTERVAL_S = 10.0

# Block hashes of sessions' last turns (``Router.start_session_lookup``), all sessions
# together: 89 bytes each in Python (a 32-character str and its list slot), so ~23 MB at
# most per router (a 2k-token turn has 128 blocks of 16 tokens: 2,048 sessions of that
# length).
SESSION_CHAINS_MAX_HASHES = 1 << 18
# How long a KV lookup's start (its assignment to a data-plane replica) may hold a
# request; after that the worker asks the data plane itself.
LOOKUP_START_TIMEOUT_S = 0.2


class Admission:
    """A bounded count of requests in the router (queued + running), in all and per
    tenant: one tenant holds at most ``tenant_share`` of the places (at least one), so a
    tenant that floods the router leaves the rest to the others. Plain logic."""

    def __init__(self, max_depth: int, tenant_share: float = 1.0):
        self.max_depth = max_depth
        self.max_tenant_depth = max(1, math.ceil(max_depth * tenant_share - 1e-9))
        self.depth = 0
        self.by_tenant: dict[str, int] = {}

    def refusal(self, tenant: str) -> Optional[str]:
        """Why a request of ``tenant`` cannot be admitted now (None: it can)."""
        if self.depth >= self.max_depth:
            return QUEUE_FULL
        if self.by_tenant.get(tenant, 0) >= self.max_tenant_depth:
            return TENANT_QUEUE_FULL
        return None

    def try_acquire(self, tenant: str) -> Optional[str]:
        """Admit a request of ``tenant``: None, or why not (and nothing changes)."""
        why = self.refusal(tenant)
        if why is None:
            self.depth += 1
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        return why

    def release(self, tenant: str) -> None:
        self.depth -= 1
        left = self.by_tenant.get(tenant, 0) - 1
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)


QUEUE_FULL = "queue_full"
TENANT_QUEUE_FULL = "tenant_queue_full"


_DEATH_TYPES = (EngineDeadError, *replica_death_types())


def is_retryable_death(exc: BaseException) -> bool:
    """Whether ``exc`` (or a cause Ray wrapped it in) says the worker replica or its engine
    died, so the same request may run again elsewhere: a dead engine, a dead or
    unreachable replica actor, or a deployment with no replica to take it. Errors of the
    request itself (rejection, a failed step of a live engine, timeouts) are not."""
    return any(isinstance(cause, _DEATH_TYPES) for cause in _causes(exc))


@dataclass(eq=False, slots=True)
class SessionLookup:
    """:meth:`Router.start_session_lookup`'s lookup of a session turn's blocks: the
    session's version right after that turn (a prompt built on a later version has
    turns from elsewhere in between, which that lookup does not cover) and the task."""

    version: int
    task: asyncio.Task


@dataclass(eq=False, slots=True)
class _Queued:
    request: GenerationRequest
    enqueued_at: float
    dispatched: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Router:
    def __init__(
        self,
        worker: DeploymentHandle,
        config: dict,
        dataplane: Optional[DeploymentHandle] = None,
        *,
        root_index: Optional[RootIndex] = None,
    ):
        self._config = AppConfig.model_validate(config)
        self._dataplane = dataplane
        # The KV lookups it starts go straight to the owner replica (dataplane.direct_calls):
        # an ObjectRef at once, without Serve's round that accepts the call first.
        self._direct = DirectCalls(
            dataplane, dataplane is not None and self._config.dataplane.direct_calls, "router's KV lookups"
        )
        telemetry.setup(self._config.telemetry, "router")
        self._tracer = telemetry.tracer(__name__)
        self._worker = worker.options(stream=True, _by_reference=False)
        self._capabilities_worker = worker
        # False for a worker in this process without peers (app/server.py, outside
        # Serve): a request its dead engine failed has nowhere else to go.
        self._retries_elsewhere = getattr(worker, "retries_elsewhere", True)
        rc = self._config.router
        self._admission = Admission(rc.max_queue_depth, rc.max_queue_share_per_tenant)
        self._tenant_refusal_log = telemetry.Every(TENANT_REFUSAL_LOG_INTERVAL_S)
        self._batcher: DynamicBatcher[_Queued] = DynamicBatcher(
            self._dispatch,
            max_batch_size=rc.max_batch_size,
            batch_wait_timeout_s=rc.batch_wait_timeout_ms / 1000.0,
            has_idle_worker=self._has_idle_worker,
        )
        self._batching_resolved = False
        self._router_id = uuid.uuid4().hex[:8]
        # Requests dispatched to a worker and not yet finished, across all workers.
        self._num_inflight = 0
        self._m_queue_depth = metrics.Gauge(
            "llm_router_queue_depth", "Requests admitted by the router and not finished."
        )
        self._m_pending = metrics.Gauge(
            "llm_router_batch_pending", "Requests waiting in the router for a batch to leave."
        )
        self._m_batch_size = metrics.Histogram(
            "llm_router_batch_size",
            "Requests per dispatched batch.",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128],
            tag_keys=("reason",),
        )
        self._m_queue_wait = metrics.Histogram(
            "llm_router_queue_wait_seconds",
            "Time from admission to dispatch to a worker.",
            boundaries=LATENCY_BUCKETS_S,
        )
        self._m_rejected = metrics.Counter(
            "llm_router_rejected",
            "Requests rejected 429: reason=queue_full (the router's queue) or "
            "tenant_queue_full (the tenant's share of it, router.max_queue_share_per_tenant).",
            tag_keys=("reason",),
        )
        self._m_prefetch = metrics.Counter(
            "llm_router_prefetch_requests",
            "Prefetches of session KV blocks asked of the data plane: straight to the replica "
            "that owns the prefix (via=direct, dataplane.direct_calls) or through Serve's router "
            "(via=serve).",
            tag_keys=("via",),
        )
        self._m_kv_lookups = metrics.Counter(
            "llm_router_kv_lookups_started",
            "KV prefix lookups the router started for the worker as a request arrived.",
        )
        self._m_kv_lookup_calls = metrics.Counter(
            "llm_router_kv_lookup_calls",
            "The data-plane calls of the KV lookups the router starts, by how they went: "
            "straight to the replica that owns the prefix (via=direct, dataplane.direct_calls) "
            "or through Serve's router (via=serve: off, or this process has not seen the "
            "replicas yet).",
            tag_keys=("via",),
        )
        self._m_session_lookups = metrics.Counter(
            "llm_router_kv_session_lookups",
            "KV lookups of a session's last turn started as its next turn arrived, before "
            "the prompt was built: used (the prompt extends that turn, the worker got it), "
            "mismatch (it does not: the usual lookup went instead), stale (the session had "
            "turns from elsewhere since: not used), failed (the call was not started in "
            "time, or failed).",
            tag_keys=("result",),
        )
        self._m_retries = metrics.Counter(
            "llm_router_retries",
            "Requests sent to a worker again because the first one died before any token.",
            tag_keys=("error",),
        )
        self._m_timeouts = metrics.Counter(
            "llm_router_timeouts",
            "Requests past limits.request_timeout_s (504, work cancelled), by where they were.",
            tag_keys=("stage",),
        )
        self._m_kv_lookups_skipped = metrics.Counter(
            "llm_router_kv_lookups_skipped",
            "Requests (not continuing a session) sent without a KV lookup: no stored chain starts "
            "with their first block (the root index).",
        )
        self._m_root_index_roots = metrics.Gauge(
            "llm_router_kv_root_index_roots", "Chain roots in this router's mirror of the root index."
        )
        self._m_root_index_synced = metrics.Gauge(
            "llm_router_kv_root_index_synced",
            "1 while the last sync of the root index from Redis worked, 0 after a failure.",
        )
        self._prefetch_tasks: set[asyncio.Task] = set()
        self._root_index = root_index if root_index is not None else self._make_root_index()
        # (tenant, session id) -> (its version after its last turn here, that turn's
        # block hashes: prompt and reply), most recently used last; and how many hashes
        # they hold together.
        self._session_chains: OrderedDict[tuple[str, str], tuple[int, list[str]]] = OrderedDict()
        self._session_chain_hashes = 0

    def _make_root_index(self) -> Optional[RootIndex]:
        """The mirror of the data plane's chain roots (root_index.py), when lookups go
        through the data plane and the index is on."""
        dc = self._config.dataplane
        if self._dataplane is None or self._config.engine.name != "torch" or not dc.kv_reuse:
            return None
        if not dc.root_index_sync_ms:
            return None
        fetch, _ = redis_fetcher(dc)
        return RootIndex(fetch, sync_interval_s=dc.root_index_sync_ms / 1000, on_sync=self._root_index_synced)

    def _root_index_synced(self, index: RootIndex, ok: bool) -> None:
        self._m_root_index_roots.set(index.num_roots)
        self._m_root_index_synced.set(1 if ok else 0)

    def _skip_kv_lookup(self, request: GenerationRequest, hashes: list[str]) -> bool:
        """Whether the request goes without a KV lookup (``kv_lookup_skip``): it does not
        continue a session (whose previous turn's blocks were exported moments ago,
        sooner than any mirror catches up) and the root index, fresh, holds no chain
        starting with its first block."""
        index = self._root_index
        if index is None or not hashes or request.session_continues:
            return False
        index.start()
        if index.may_hold(request.tenant, hashes[0]):
            return False
        request.kv_lookup_skip = True
        self._m_kv_lookups_skipped.inc()
        return True

    def _kv_hashes(self, request: GenerationRequest) -> list[str]:
        """The block hashes the worker's engine will look up for this prompt (all but its
        last token), when KV reuse goes through the data plane (the torch engine; vLLM's
        connector reads Redis directly, docs/vllm_kv.md); else none."""
        dc = self._config.dataplane
        if self._dataplane is None or self._config.engine.name != "torch" or not dc.kv_reuse:
            return []
        return prompt_lookup_hashes(self._config.model.id, request, dc.block_size)

    async def _start_lookup_call(self, tenant: str, hashes: list[str]):
        """Call the data plane's lookup of ``hashes`` (with references, for the worker)
        and return the call's ObjectRef: at once when it goes straight to the owner
        replica (``routing.send_direct``), else once Serve assigned it to a replica (not
        answered); asyncio.TimeoutError after LOOKUP_START_TIMEOUT_S."""
        kwargs = {"shard_key": hashes[0], "with_refs": True, "direct_l3": self._config.dataplane.direct_l3_reads}
        call, straight = self._direct.call("lookup_prefix", (tenant, hashes), kwargs)
        self._m_kv_lookup_calls.inc(tags={"via": "direct" if straight else "serve"})
        if straight:
            return call
        return await asyncio.wait_for(call._to_object_ref(), timeout=LOOKUP_START_TIMEOUT_S)

    async def _start_kv_lookup(
        self,
        request: GenerationRequest,
        hashes: Optional[list[str]] = None,
        session_lookup: Optional[asyncio.Future] = None,
    ) -> None:
        """Start the data plane's lookup of the prompt's prefix now and hand the call to
        the worker with the request (``kv_lookup``): it runs while the request travels to
        the worker, whose engine would otherwise make the same call first thing, so a
        miss costs less and a hit starts loading sooner. ``session_lookup``: the lookup
        of the session's last turn that :meth:`start_session_lookup` started as the
        request arrived; used instead when the prompt extends that turn. Any failure
        only means the worker asks itself."""
        hashes = self._kv_hashes(request) if hashes is None else hashes
        if not hashes:
            return
        started = time.perf_counter()
        if session_lookup is not None:
            result = await self._use_session_lookup(request, hashes, session_lookup)
            self._log_lookup_start(request, f"session:{result}", started)
            if result in ("used", "failed"):
                # Used; or not started in LOOKUP_START_TIMEOUT_S (the data plane is slow
                # to take calls: another try would hold the request as long again, so
                # the worker asks itself).
                return
            started = time.perf_counter()
        try:
            # Bounded: with no data-plane replica to take it, the worker asks itself later.
            request.kv_lookup = await self._start_lookup_call(request.tenant, hashes)
            request.kv_lookup_key = hashes[-1]
            self._m_kv_lookups.inc()
            self._log_lookup_start(request, "prompt", started)
        except Exception as e:  # noqa: BLE001 - the worker looks up itself
            logger.debug("router-started KV lookup not started: %r", e)

    @staticmethod
    def _log_lookup_start(request: GenerationRequest, kind: str, started: float) -> None:
        """DEBUG: how long this request waited here for its KV lookup's start (the
        assignment of the call to a data-plane replica), by kind: ``prompt`` (started
        here, for the prompt's blocks) or ``session:<result>`` (started as the request
        arrived, :meth:`start_session_lookup`)."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv lookup start: request=%s kind=%s blocks=%s wait_ms=%.1f",
                request.request_id, kind, request.kv_lookup_blocks, 1000 * (time.perf_counter() - started),
            )

    async def _use_session_lookup(
        self, request: GenerationRequest, hashes: list[str], session_lookup: asyncio.Future
    ) -> str:
        """Hand the request the lookup of its session's last turn when the prompt's
        blocks begin with all of that turn's (then the data plane holds nothing more of
        the prompt, whose other blocks are the new messages): "used". "mismatch": they do
        not; "failed": the call was not started in time (or the task was cancelled);
        "error": the call failed otherwise (no data-plane replica took it), counted as
        failed, and the usual lookup, which Serve may send to another replica, goes (as
        after a mismatch)."""
        try:
            started = await session_lookup
        except asyncio.CancelledError:
            if not session_lookup.cancelled() or asyncio.current_task().cancelling():
                raise  # this request is being cancelled, not only the lookup
            started = None
        except Exception as e:  # noqa: BLE001 - the usual lookup instead
            logger.debug("session KV lookup failed: %r", e)
            self._m_session_lookups.inc(tags={"result": "failed"})
            return "error"
        if started is None:
            self._m_session_lookups.inc(tags={"result": "failed"})
            return "failed"
        tenant, chain, ref = started
        n = len(chain)
        if tenant != request.tenant or n > len(hashes) or hashes[n - 1] != chain[-1]:
            # A history changed by truncation, or a reply whose ids the next prompt does
            # not repeat: the lookup of the prompt's own blocks goes instead.
            self._m_session_lookups.inc(tags={"result": "mismatch"})
            return "mismatch"
        # Chained hashes: an equal last hash means equal blocks all the way up.
        request.kv_lookup, request.kv_lookup_key, request.kv_lookup_blocks = ref, chain[-1], n
        self._m_session_lookups.inc(tags={"result": "used"})
        self._m_kv_lookups.inc()
        return "used"

    def start_session_lookup(
        self, tenant: str, session_id: str, version: Optional[int] = None
    ) -> Optional[SessionLookup]:
        """The data plane's lookup of the blocks of session ``session_id``'s last turn
        here (:meth:`remember_session_turn`), started now, as its next turn arrives: the
        call's assignment to a data-plane replica (a Serve handshake, ~4-9 ms on 2 cores)
        then overlaps the ingress building the prompt instead of following it. Its task
        resolves to ``(tenant, hashes, ObjectRef)``, or to None if no replica took the
        call within LOOKUP_START_TIMEOUT_S. None when this router has no such turn
        (another ingress replica served it, or it was evicted), when ``version`` (the
        session's, as the caller knows it) is not the one right after that turn, or when
        the request would be prefetched (no idle worker: it will queue)."""
        key = (tenant, session_id)
        entry = self._session_chains.get(key)
        if entry is None or self._dataplane is None or self._prefetches_now():
            # (A request that will queue is prefetched instead; the worker looks it up.)
            return None
        chain_version, chain = entry
        if version is not None and version != chain_version:
            self._m_session_lookups.inc(tags={"result": "stale"})
            return None
        self._session_chains.move_to_end(key)

        async def start():
            try:
                return tenant, chain, await self._start_lookup_call(tenant, chain)
            except asyncio.TimeoutError:
                return None

        # Its own Serve request id: the session read of the same request may be in
        # flight to the data plane beside it (app/serve_context.py).
        task = serve_context.spawn(start())
        # Retrieved here: a request that failed before the router awaited it leaves it.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return SessionLookup(chain_version, task)

    def drop_session_lookup(self, lookup: SessionLookup) -> None:
        """``lookup`` will not be used: the prompt was built on another version of the
        session than the one right after the looked-up turn."""
        lookup.task.cancel()
        self._m_session_lookups.inc(tags={"result": "stale"})

    def remember_session_turn(
        self,
        tenant: str,
        session_id: str,
        version: int,
        token_ids: list[int],
        salt: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> None:
        """Keep the block hashes of a session turn (``token_ids``: its prompt and the
        reply's ids as stored with the session, which the next turn's prompt repeats;
        ``salt``, ``lora``: the turn's ``cache_salt`` and adapter; a next turn with others
        looks up other hashes, and the worker drops this lookup as not its own) and the
        session's ``version`` after it, for
        :meth:`start_session_lookup`. Only where this router's lookups go through the
        data plane (the torch engine)."""
        dc = self._config.dataplane
        if self._dataplane is None or self._config.engine.name != "torch" or not dc.kv_reuse:
            return
        chain = block_hashes(self._config.model.id, tenant, token_ids, dc.block_size, salt, lora)
        if not chain:
            return
        key = (tenant, session_id)
        old = self._session_chains.pop(key, None)
        self._session_chain_hashes += len(chain) - (len(old[1]) if old else 0)
        self._session_chains[key] = (version, chain)
        while self._session_chain_hashes > SESSION_CHAINS_MAX_HASHES and len(self._session_chains) > 1:
            _, (_, dropped) = self._session_chains.popitem(last=False)
            self._session_chain_hashes -= len(dropped)

    def _prefetch(self, request: GenerationRequest, hashes: Optional[list[str]] = None) -> bool:
        """Ask the data plane to bring a request's blocks up to host memory while the
        request waits here: compute (queueing) and data (fetching) overlap. For a request
        that names a session, or whose prefix is known (the root index lists its chain's
        first block); another's blocks are most likely nowhere. Whether it did."""
        if not self._prefetches_now():
            # Dispatched at once: the router-started lookup serves it instead.
            return False
        hashes = self._kv_hashes(request) if hashes is None else hashes
        if not hashes:
            return False
        if request.session_id is None and (
            self._root_index is None or not self._root_index.holds(request.tenant, hashes[0])
        ):
            return False
        # Straight to the owner replica where known (dataplane.direct_calls): under load,
        # when prefetches happen, the ingress's CPU is what runs out.
        call, straight = self._direct.call("prefetch", (request.tenant, hashes), {"shard_key": hashes[0]})
        self._m_prefetch.inc(tags={"via": "direct" if straight else "serve"})
        task = asyncio.ensure_future(call)
        # Keep a reference until done; a failed prefetch only costs the later fetch.
        self._prefetch_tasks.add(task)
        task.add_done_callback(self._prefetch_done)
        return True

    def _prefetches_now(self) -> bool:
        """Whether a session request arriving now would be prefetched (it will queue)
        rather than go with a router-started lookup."""
        policy = self._config.dataplane.prefetch
        return policy == "always" or (policy == "when_queued" and not self._has_idle_worker())

    def _prefetch_done(self, task: asyncio.Task) -> None:
        self._prefetch_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("prefetch failed: %r", task.exception())

    def _has_idle_worker(self) -> bool:
        # Placement spreads requests by queue length, so while this router has fewer
        # requests in flight than there are workers, at least one worker is idle.
        return self._num_inflight < max(TRACKER.num_replicas, 1)

    def _dispatch(self, batch_id: int, batch: list[_Queued], reason: str) -> None:
        self._m_batch_size.observe(len(batch), tags={"reason": reason})
        batch_key = f"{self._router_id}-{batch_id}"
        now = time.monotonic()
        for item in batch:
            self._m_queue_wait.observe(now - item.enqueued_at)
            if not item.dispatched.done():
                item.dispatched.set_result(batch_key)
                # Counted here, synchronously, so the next arrival already sees it.
                self._num_inflight += 1
        self._m_pending.set(self._batcher.num_pending)

    async def _resolve_batching(self) -> None:
        # An engine that batches continuously by itself (vLLM) gains nothing from a wait.
        if self._batching_resolved:
            return
        self._batching_resolved = True
        try:
            caps = await self._capabilities_worker.capabilities.remote()
            if not caps.wants_router_batching:
                self._batcher.max_batch_size = 1
                logger.info("router batching off: the engine batches continuously itself")
        except Exception:  # a worker still starting: keep the configured batching
            self._batching_resolved = False
        except BaseException:  # this request cancelled (its deadline, its client gone)
            self._batching_resolved = False  # the next request asks again
            raise

    async def _await_ready_worker(self, deadline: float) -> None:
        """Wait until a worker answers ``ready`` (with one replica: its replacement),
        polling while the dead one is still routed to; raises once ``deadline`` passes."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            try:
                await asyncio.wait_for(self._capabilities_worker.ready.remote(), remaining)
                return
            except asyncio.TimeoutError:
                raise
            except Exception as e:  # noqa: BLE001 - only deaths are waited out
                if not is_retryable_death(e):
                    raise
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    async def _stream_with_retry(
        self, request: GenerationRequest, batch_key: str, deadline: float
    ) -> AsyncIterator[TokenDelta]:
        """The worker's deltas; one more try, on any replica, if the worker or its engine
        died before the client got a token: before the first delta, or at any point for a
        ``buffered`` request, whose deltas are held here until the worker's stream ended
        (the client of a non-streaming request sees nothing before the end anyway). Never
        once a streaming client has tokens."""
        retried = False
        while True:
            stream = self._worker.generate.remote(request, batch_key=batch_key)
            client_has_tokens = ended = False
            held: list[TokenDelta] = []
            try:
                async for delta in stream:
                    if request.buffered:
                        held.append(delta)
                    else:
                        client_has_tokens = True
                        yield delta
                ended = True
                report_outcome(request.request_id, True)  # for the replica's circuit breaker
                for delta in held:
                    yield delta
                return
            except Exception as e:
                ended = True
                report_outcome(request.request_id, classify_outcome(e))
                if client_has_tokens or retried or not is_retryable_death(e) or not self._retries_elsewhere:
                    raise
                error = e
            finally:
                if not ended:  # closed or cancelled by the caller: stop the worker's work
                    stream.cancel()
                    report_outcome(request.request_id, None)
            retried = True
            self._m_retries.inc(tags={"error": type(error).__name__})
            logger.warning(
                "request %s: worker died before the client got a token (%s: %s; %d deltas "
                "held back); retrying once",
                request.request_id,
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "",
                len(held),
            )
            try:
                await self._await_ready_worker(deadline)
            except asyncio.TimeoutError:
                raise error from None
            # A fresh placement: the batch's affinity may still point at the dead replica.
            batch_key = f"{batch_key}-retry"

    def _queue_full(self, why: str, tenant: str) -> RateLimitError:
        self._m_rejected.inc(tags={"reason": why})
        retry_after = str(self._config.router.retry_after_s)
        if why == TENANT_QUEUE_FULL:
            if self._tenant_refusal_log.due():
                logger.info(
                    "tenant %s holds its share of the router queue (%d of %d places, "
                    "router.max_queue_share_per_tenant): 429 (at most one such line every %.0f s)",
                    tenant, self._admission.max_tenant_depth, self._admission.max_depth,
                    TENANT_REFUSAL_LOG_INTERVAL_S,
                )
            message = (
                f"This API key's requests hold their share of the router queue "
                f"({self._admission.max_tenant_depth} of {self._admission.max_depth}); "
                f"retry after {retry_after}s."
            )
        else:
            message = (
                f"The router queue is full ({self._admission.max_depth} requests); "
                f"retry after {retry_after}s."
            )
        return RateLimitError(message, code=why, headers={"Retry-After": retry_after})

    def reject_if_full(self, tenant: str = DEFAULT_TENANT) -> None:
        """429 at once when the queue, or ``tenant``'s share of it, is full: the ingress
        asks before it reads, parses and tokenises a body, so under overload a rejection
        costs almost no CPU (which the requests being served need). ``generate`` still
        admits atomically."""
        why = self._admission.refusal(tenant)
        if why is not None:
            raise self._queue_full(why, tenant)

    async def generate(
        self,
        request: GenerationRequest,
        gate: Optional[Awaitable] = None,
        session_lookup: Optional[asyncio.Future] = None,
    ) -> AsyncIterator[TokenDelta]:
        """The request's deltas. ``gate``: awaited before the worker call, whose failure
        fails the request before anything reached a worker (the ingress's check that the
        session history it built the prompt from is the store's). ``session_lookup``:
        the task of :meth:`start_session_lookup` for the request's session, if it started
        one for the version the prompt was built on."""
        deadline = time.monotonic() + self._config.limits.request_timeout_s
        why = self._admission.try_acquire(request.tenant)
        if why is not None:
            raise self._queue_full(why, request.tenant)
        self._m_queue_depth.set(self._admission.depth)
        ctx = telemetry.extract_context(request.trace_headers)
        item = lookup = None
        hashes: list[str] = []
        try:
            hashes = self._kv_hashes(request)
            if self._skip_kv_lookup(request, hashes):
                pass  # a certain miss: no lookup here nor in the worker
            elif hashes and not self._prefetch(request, hashes):
                # Its assignment to a data-plane replica (~3 ms on 2 cores, which every
                # request paid in full when awaited here) runs while the request queues.
                lookup = asyncio.ensure_future(self._start_kv_lookup(request, hashes, session_lookup))
            if not self._batching_resolved:  # the first request: asks a worker
                await self._within_deadline(self._resolve_batching(), deadline, request, "queue")
            with self._tracer.start_as_current_span("router.queue", context=ctx) as span:
                item = _Queued(request, time.monotonic())
                self._batcher.submit(item)
                self._m_pending.set(self._batcher.num_pending)
                batch_key = await self._within_deadline(item.dispatched, deadline, request, "queue")
                span.set_attribute("llm.batch_key", batch_key)
                span.set_attribute("llm.kv_lookup_skipped", request.kv_lookup_skip)
                request.trace_headers = telemetry.inject_context()
            if lookup is not None:
                await lookup  # the request goes with the call's reference (bounded: 0.2 s)
            if gate is not None:
                await self._within_deadline(gate, deadline, request, "session")
            async with contextlib.aclosing(self._stream_with_retry(request, batch_key, deadline)) as deltas:
                while True:
                    try:
                        delta = await self._within_deadline(deltas.__anext__(), deadline, request, "generate")
                    except StopAsyncIteration:
                        break
                    yield delta
            if hashes and self._root_index is not None:
                # The worker exports the request's blocks under this root as it finishes.
                self._root_index.add(request.tenant, hashes[0])
        finally:
            if lookup is not None and not lookup.done():
                lookup.cancel()
            if item is not None and (item.dispatched.cancelled() or not item.dispatched.done()):
                # The client left while the request waited for its batch.
                item.dispatched.cancel()
                self._batcher.remove(item)
                self._m_pending.set(self._batcher.num_pending)
            elif item is not None:
                self._num_inflight -= 1
                if self._has_idle_worker():
                    self._batcher.notify_idle()
            self._admission.release(request.tenant)
            self._m_queue_depth.set(self._admission.depth)

    async def _within_deadline(self, awaitable, deadline: float, request: GenerationRequest, stage: str):
        """``awaitable``'s result, or a 504 once the request's deadline passed. The
        awaitable is cancelled then: out of the batcher's queue, or the worker stream is
        cancelled, which aborts the sequence in the engine."""
        try:
            # asyncio.timeout, not wait_for: no extra task per delta on the hot path.
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await awaitable
        except TimeoutError:
            if time.monotonic() < deadline:
                raise  # not ours: a timeout inside the call
        timeout_s = self._config.limits.request_timeout_s
        self._m_timeouts.inc(tags={"stage": stage})
        logger.warning(
            "request %s passed its deadline (request_timeout_s=%.1fs) in %s; cancelled, 504",
            request.request_id,
            timeout_s,
            stage,
        )
        raise GatewayTimeoutError(
            f"The request took longer than the server's limit of {timeout_s:g}s and was cancelled.",
            code="timeout",
        )

    async def ready(self) -> bool:
        return await self._capabilities_worker.ready.remote()

    def queue_depth(self) -> int:
        return self._admission.depth

    @property
    def max_tenant_places(self) -> int:
        """The most places of this router's queue one tenant's requests may hold."""
        return self._admission.max_tenant_depth
