"""Placement of requests on ComputeWorker replicas.

Two layers:

* :func:`choose_pair` and :class:`BatchAffinity` are pure logic (no Ray), unit-tested;
* :class:`QueueAwareRequestRouter` plugs them into Ray Serve's request-router interface, so
  the Router deployment's handle to the workers places each call. Serve calls
  ``choose_replicas`` for every request and then only checks that the chosen replica has
  room (``max_ongoing_requests``); the ranking is ours.

Policy: members of one router batch go to the same replica (so the engine prefills them in
one pass); otherwise power-of-two-choices on queue length, where a replica's queue length
is what this router has in flight there plus what the worker last reported waiting in its
engine (``record_routing_stats``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable, List, Optional, Sequence

logger = logging.getLogger("ray.serve")

BATCH_ID_KWARG = "batch_key"


def choose_pair(
    candidate_ids: Sequence[Hashable],
    queue_len: Callable[[Hashable], float],
    rng: random.Random,
) -> list[Hashable]:
    """Power of two choices: sample two distinct candidates, shorter queue first."""
    if len(candidate_ids) <= 2:
        sampled = list(candidate_ids)
        rng.shuffle(sampled)  # ties broken at random, not by list order
    else:
        sampled = rng.sample(list(candidate_ids), 2)
    return sorted(sampled, key=queue_len)


class BatchAffinity:
    """Remembers where the first member of a batch went, for a short time."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000, clock=time.monotonic):
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[Hashable, float]] = OrderedDict()

    def get(self, batch_key: str) -> Optional[Hashable]:
        entry = self._entries.get(batch_key)
        if entry is None:
            return None
        replica_id, expires = entry
        if self._clock() > expires:
            del self._entries[batch_key]
            return None
        return replica_id

    def put(self, batch_key: str, replica_id: Hashable) -> None:
        self._entries[batch_key] = (replica_id, self._clock() + self._ttl_s)
        self._entries.move_to_end(batch_key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)


class WorkerLoadTracker:
    """This process's view of the worker replicas: how many, and what it has in flight.

    Written by the request router (which Serve may run on its own event loop thread) and
    read by the Router deployment, hence the lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, int] = {}
        self._num_replicas = 0

    def set_replicas(self, replica_ids: Sequence[Hashable]) -> None:
        with self._lock:
            self._num_replicas = len(replica_ids)
            self._inflight = {r: self._inflight.get(r, 0) for r in replica_ids}

    def routed(self, replica_id: Hashable) -> None:
        with self._lock:
            self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1

    def completed(self, replica_id: Hashable) -> None:
        with self._lock:
            if self._inflight.get(replica_id, 0) > 0:
                self._inflight[replica_id] -= 1

    def inflight(self, replica_id: Hashable) -> int:
        return self._inflight.get(replica_id, 0)

    @property
    def num_replicas(self) -> int:
        """Replicas known to be running; 0 until Serve first reports them."""
        return self._num_replicas


# One Router replica per process, so one tracker per process.
TRACKER = WorkerLoadTracker()

try:  # Ray is absent in pure unit-test environments of the policy above.
    from ray.serve.request_router import (
        FIFOMixin,
        PendingRequest,
        ReplicaID,
        RequestRouter,
        RunningReplica,
    )
except ImportError:  # pragma: no cover
    RequestRouter = object  # type: ignore[assignment,misc]
    FIFOMixin = object  # type: ignore[assignment,misc]


class QueueAwareRequestRouter(FIFOMixin, RequestRouter):  # type: ignore[misc,valid-type]
    """Serve request router: batch affinity, then power-of-two-choices on queue length."""

    def initialize_state(self, **kwargs):
        self._rng = random.Random()
        self._affinity = BatchAffinity()
        self._tracker = TRACKER

    def update_replicas(self, replicas: List["RunningReplica"]):
        result = super().update_replicas(replicas)
        self._tracker.set_replicas([r.replica_id for r in replicas])
        return result

    def _queue_len(self, replica: "RunningReplica") -> float:
        stats = replica.routing_stats or {}
        return self._tracker.inflight(replica.replica_id) + float(stats.get("num_waiting", 0))

    async def choose_replicas(
        self,
        candidate_replicas: List["RunningReplica"],
        pending_request: Optional["PendingRequest"] = None,
    ) -> List[List["RunningReplica"]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        batch_key = pending_request.kwargs.get(BATCH_ID_KWARG) if pending_request else None
        if batch_key is not None:
            replica_id = self._affinity.get(batch_key)
            if replica_id in by_id:
                return [[by_id[replica_id]]]
        order = choose_pair(list(by_id), lambda rid: self._queue_len(by_id[rid]), self._rng)
        if batch_key is not None:
            self._affinity.put(batch_key, order[0])
        logger.debug(
            "placement: batch=%s candidates=%s chosen=%s queue_lens=%s",
            batch_key,
            len(by_id),
            order[0],
            [self._queue_len(by_id[r]) for r in order],
        )
        # One replica per rank: Serve tries our first choice, and the second only if
        # the first has no room.
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request, replica_id: "ReplicaID", result) -> None:
        self._tracker.routed(replica_id)

    def on_request_completed(self, replica_id: "ReplicaID", internal_request_id: str) -> None:
        self._tracker.completed(replica_id)
