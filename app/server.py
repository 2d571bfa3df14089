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
serves its next turn through the data plane); a replica whose engine dies takes its
ingress with it (Serve replaces the whole replica, its in-flight requests fail); the
replica count, autoscaling, draining and resources are compute's (plus
``ingress.num_cpus``). Everything the ingress checks, and every error it answers, is
the same code.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import AppConfig
from app.ingress import IngressDeployment, _LocalStream
from deployments.compute.deployment import ComputeWorker, worker_replica_options

logger = logging.getLogger("ray.serve")


class _LocalMethod:
    """``handle.<method>``: ``.remote(...)`` calls the worker in this process."""

    __slots__ = ("_call",)

    def __init__(self, call):
        self._call = call

    def remote(self, *args, **kwargs):
        return self._call(*args, **kwargs)


class LocalWorkerHandle:
    """A ComputeWorker in this process behind the part of a DeploymentHandle the Router
    uses: ``options()``, ``generate.remote()`` (a stream of deltas with ``cancel()``,
    which closes the worker's generator and so aborts the sequence in the engine),
    ``capabilities.remote()`` and ``ready.remote()`` (awaitables)."""

    # Its engine's death is this replica's: the router answers the request's error at
    # once (503) instead of waiting for a worker to try it again on.
    retries_elsewhere = False

    def __init__(self, worker: ComputeWorker):
        self._worker = worker
        self.generate = _LocalMethod(self._generate)
        self.capabilities = _LocalMethod(self._capabilities)
        self.ready = _LocalMethod(worker.ready)

    def options(self, **_kwargs) -> "LocalWorkerHandle":
        return self

    def _generate(self, request, batch_key: Optional[str] = None) -> _LocalStream:
        # A copy, as a handle call would pass: the worker's engine fills in fields of its
        # own (the router may send the same request again after a failure).
        return _LocalStream(self._worker.generate(copy.copy(request), batch_key))

    async def _capabilities(self):
        return self._worker.capabilities()


class Server(IngressDeployment):
    """Serve deployment class (bound in ``app.builder`` when ``ingress.with_worker``)."""

    async def __init__(self, config: dict, dataplane: Optional[DeploymentHandle] = None):
        worker = ComputeWorker.__new__(ComputeWorker)
        await ComputeWorker.__init__(worker, config, dataplane)
        self._local_worker = worker
        try:
            await super().__init__(LocalWorkerHandle(worker), config, dataplane)
        except BaseException:
            # Serve retries a replica whose constructor failed: do not leave this one's
            # engine (vLLM's processes) behind.
            await worker.__del__()
            raise
        logger.info("Server ready: the ingress and its ComputeWorker in one process")

    async def check_health(self) -> None:
        # Serve replaces the replica (ingress and worker) when the engine died.
        await self._local_worker.check_health()

    def record_autoscaling_stats(self) -> dict:
        return self._local_worker.record_autoscaling_stats()

    # What tools read of a ComputeWorker through a handle (loadtests, tests).
    def stats(self):
        return self._local_worker.stats()

    def kv_stats(self) -> dict:
        return self._local_worker.kv_stats()

    async def __del__(self):
        # Serve calls this after the replica's in-flight requests finished: the worker's
        # drain (the engine stops, pending KV exports reach the data plane).
        worker = getattr(self, "_local_worker", None)
        try:
            if worker is not None:
                await worker.__del__()
        finally:
            await super().__del__()  # the ASGI app's lifespan shutdown


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
