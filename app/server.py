"""The Ingress and its ComputeWorker in one process (``ingress.with_worker``): the Serve
deployment "Server".

With the two apart, every streamed message crosses a Serve hop: the worker pickles it
and sends it over Serve's gRPC stream, the ingress receives it, then writes it to the
HTTP response. On the two cores here that costs the worker and the ingress together
about twice what vLLM's own API server spends per token (loadtests/README.md, "Direct
streaming"). A Server replica runs the ingress (FastAPI, its Router) and a ComputeWorker
side by side: the Router calls the worker through :class:`LocalWorkerHandle`, which has
the few methods of a DeploymentHandle the Router uses, so a delta goes from the engine's
generator to the SSE body in the same event loop.

What changes with it: there is no router placement across replicas (the HTTP proxy,
Serve's or HAProxy, spreads requests; a session's KV blocks reach whichever replica
serves its next turn through the data plane); the replica count, autoscaling, draining
and resources are compute's (plus ``ingress.num_cpus``). Everything the ingress checks,
and every error it answers, is the same code.

When the engine dies, the replica's health check fails and Serve replaces the whole
replica, stopping the old one gracefully: it keeps its in-flight requests. A request
that had no token yet is retried as in the other layout, only on a peer: the router's
retry waits for a Server replica whose engine answers ``ready`` (another replica, or
with one replica its replacement) and streams from it through this replica
(:class:`LocalWorkerHandle` switches to the deployment's own handle once the local
engine is dead).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import AsyncIterator, Optional

from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from ray.util import metrics

from app.config import AppConfig
from app.ingress import IngressDeployment, _LocalStream
from deployments.compute.deployment import ComputeWorker, worker_replica_options
from deployments.compute.engines.protocol import TokenDelta
from deployments.router.deployment import is_retryable_death

logger = logging.getLogger("ray.serve")


class _LocalMethod:
    """``handle.<method>``: ``.remote(...)`` calls the worker in this process."""

    __slots__ = ("_call",)

    def __init__(self, call):
        self._call = call

    def remote(self, *args, **kwargs):
        return self._call(*args, **kwargs)


# How long a peer call that lands on a replica whose engine is dead too (this one, until
# Serve stops routing to it) is made again, before its error goes to the router.
PEER_ROUTING_RETRY_S = 10.0
PEER_ROUTING_RETRY_INTERVAL_S = 0.25


class LocalWorkerHandle:
    """A ComputeWorker in this process behind the part of a DeploymentHandle the Router
    uses: ``options()``, ``generate.remote()`` (a stream of deltas with ``cancel()``,
    which closes the worker's generator and so aborts the sequence in the engine),
    ``capabilities.remote()`` and ``ready.remote()`` (awaitables).

    Once the local engine is dead, ``generate`` and ``ready`` go to the peers: the Server
    deployment's own replicas, through ``peers`` (a DeploymentHandle to it; None outside
    Serve, where a request the dead engine failed has nowhere else to go)."""

    def __init__(self, worker: ComputeWorker, peers: Optional[DeploymentHandle] = None):
        self._worker = worker
        self._peers = peers
        self._engine_dead = False
        self._m_peer_calls = metrics.Counter(
            "llm_server_peer_calls",
            "Calls a Server replica whose engine died made to a peer's worker, by result: "
            "streamed (the peer's first delta came), dead_replica (it landed on a dead "
            "engine too and was routed again), failed (its error went to the router).",
            tag_keys=("result",),
        )
        self.generate = _LocalMethod(self._generate)
        self.capabilities = _LocalMethod(self._capabilities)
        self.ready = _LocalMethod(self._ready)

    @property
    def retries_elsewhere(self) -> bool:
        # Read by the router: without peers a dead engine's request gets its 503 at once.
        return self._peers is not None

    def options(self, **_kwargs) -> "LocalWorkerHandle":
        return self

    async def _local_dead(self) -> bool:
        if not self._engine_dead and self._peers is not None:
            self._engine_dead = await self._worker.engine_dead()
            if self._engine_dead:
                logger.warning("the local engine is dead: requests retried from here go to a peer Server replica")
        return self._engine_dead

    def _generate(self, request, batch_key: Optional[str] = None) -> _LocalStream:
        # A copy, as a handle call would pass: the worker's engine fills in fields of its
        # own (the router may send the same request again after a failure).
        if self._engine_dead:
            return _LocalStream(self._from_peer(request, batch_key))
        return _LocalStream(self._worker.generate(copy.copy(request), batch_key))

    async def _from_peer(self, request, batch_key: Optional[str]) -> AsyncIterator[TokenDelta]:
        """A peer's deltas. A call that fails before its first delta because it landed on
        a replica whose engine is dead too (this one, until Serve stops routing to it) is
        made again for up to ``PEER_ROUTING_RETRY_S``: that is routing, not a second run."""
        give_up_at = time.monotonic() + PEER_ROUTING_RETRY_S
        while True:
            stream = self._peers.options(stream=True).worker_generate.remote(request, batch_key)
            started = done = False
            try:
                async for delta in stream:
                    if not started:
                        # Counted at the first delta: the end may come as this replica
                        # stops, too late for its metrics to be reported.
                        started = True
                        self._m_peer_calls.inc(tags={"result": "streamed"})
                    yield delta
                done = True
                return
            except Exception as e:
                done = True
                if started or not is_retryable_death(e) or time.monotonic() >= give_up_at:
                    self._m_peer_calls.inc(tags={"result": "failed"})
                    raise
                self._m_peer_calls.inc(tags={"result": "dead_replica"})
                logger.info("peer call for request %s reached a dead engine (%s); routing again",
                            request.request_id, type(e).__name__)
            finally:
                if not done:  # the client left or the router cancelled: stop the peer's work
                    stream.cancel()
            await asyncio.sleep(PEER_ROUTING_RETRY_INTERVAL_S)

    async def _ready(self) -> bool:
        if await self._local_dead():
            return await self._peers.worker_ready.remote()
        return await self._worker.ready()

    async def _capabilities(self):
        return self._worker.capabilities()


class Server(IngressDeployment):
    """Serve deployment class (bound in ``app.builder`` when ``ingress.with_worker``)."""

    async def __init__(self, config: dict, dataplane: Optional[DeploymentHandle] = None):
        worker = ComputeWorker.__new__(ComputeWorker)
        await ComputeWorker.__init__(worker, config, dataplane)
        self._local_worker = worker
        try:
            await super().__init__(LocalWorkerHandle(worker, _own_deployment_handle()), config, dataplane)
        except BaseException:
            # Serve retries a replica whose constructor failed: do not leave this one's
            # engine (vLLM's processes) behind.
            await worker.drain()
            raise
        logger.info("Server ready: the ingress and its ComputeWorker in one process")

    async def check_health(self) -> None:
        # Serve replaces the replica (ingress and worker) when the engine died.
        await self._local_worker.check_health()

    def record_autoscaling_stats(self) -> dict:
        return self._local_worker.record_autoscaling_stats()

    # A peer's retry of a request this replica's dead engine failed (LocalWorkerHandle).
    async def worker_generate(self, request, batch_key: Optional[str] = None) -> AsyncIterator[TokenDelta]:
        async for delta in self._local_worker.generate(request, batch_key):
            yield delta

    async def worker_ready(self) -> bool:
        return await self._local_worker.ready()

    # What tools read of a ComputeWorker through a handle (loadtests, tests).
    def stats(self):
        return self._local_worker.stats()

    def kv_stats(self) -> dict:
        return self._local_worker.kv_stats()

    def drop_kv_blocks(self, hashes: list[str]) -> int:
        return self._local_worker.drop_kv_blocks(hashes)

    def debug_kill_engine(self) -> list[int]:
        return self._local_worker.debug_kill_engine()

    async def __del__(self):
        # Serve calls this after the replica's in-flight requests finished: the worker's
        # drain (the engine stops, pending KV exports reach the data plane).
        worker = getattr(self, "_local_worker", None)
        try:
            if worker is not None:
                await worker.drain()
        finally:
            await super().__del__()  # the ASGI app's lifespan shutdown


def _own_deployment_handle() -> Optional[DeploymentHandle]:
    """A handle to this replica's own deployment (its peers, and itself), or None outside
    a Serve replica (unit tests)."""
    try:
        ctx = serve.get_replica_context()
    except RayServeException:  # not inside a replica
        return None
    return serve.get_deployment_handle(ctx.deployment, app_name=ctx.app_name)


def server_deployment(config: AppConfig):
    """The Server deployment: a ComputeWorker replica's options (count or autoscaling,
    draining, health checks, placement) with ``ingress.num_cpus`` more per replica (the
    ingress's share)."""
    options = worker_replica_options(config)
    actor = dict(options["ray_actor_options"])
    actor["num_cpus"] = actor["num_cpus"] + config.ingress.num_cpus
    options["ray_actor_options"] = actor
    if "placement_group_bundles" in options:
        bundles = [dict(b) for b in options["placement_group_bundles"]]
        bundles[0]["CPU"] = actor["num_cpus"]  # the replica's own bundle
        options["placement_group_bundles"] = bundles
    return serve.deployment(Server).options(
        name="Server",
        **options,
        # The ingress admits up to router.max_queue_depth itself (429 past it).
        max_ongoing_requests=config.router.max_queue_depth * 2,
    )
