"""Routing of data-plane calls to the replica that owns the key.

:class:`HashRing` is pure logic (consistent hashing with virtual nodes; positions come
from blake2b, never Python's per-process ``hash()``, so every process that knows the same
replica ids computes the same owner). :class:`KeyAffinityRequestRouter` plugs it into
Ray Serve as the DataPlane deployment's request router: a call's ``shard_key`` keyword
picks the owner, then the next distinct replicas on the ring as fallbacks (Serve moves to
a fallback only when the owner is full). A call without ``shard_key`` may go anywhere.
``exclude_replica`` takes one replica out of both (its keys' owners are then the replicas
that own them once it is gone).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from typing import Hashable, Iterable, List, Optional

logger = logging.getLogger("ray.serve")

SHARD_KEY_KWARG = "shard_key"
# A call's keyword naming a replica (``replica_key``) that must not take it: a replica
# being stopped hands its state to the key's next owner, never back to itself.
EXCLUDE_KWARG = "exclude_replica"
DEFAULT_VNODES = 128
NUM_FALLBACKS = 2


def _position(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES):
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._nodes: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for node in nodes:
            self._nodes.add(node)
        self._rebuild()

    @property
    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, node: str) -> None:
        if node not in self._nodes:
            self._nodes.add(node)
            self._rebuild()

    def remove(self, node: str) -> None:
        if node in self._nodes:
            self._nodes.discard(node)
            self._rebuild()

    def set_nodes(self, nodes: Iterable[str]) -> None:
        nodes = set(nodes)
        if nodes != self._nodes:
            self._nodes = nodes
            self._rebuild()

    def _rebuild(self) -> None:
        # Sorted by (position, node): identical in every process for the same node set,
        # including the (astronomically rare) tie of two positions.
        points = sorted(
            (_position(f"{node}#{i}"), node) for node in self._nodes for i in range(self.vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def owner(self, key: str) -> Optional[str]:
        owners = self.owners(key, 1)
        return owners[0] if owners else None

    def owners(self, key: str, n: int) -> list[str]:
        """The owner of ``key`` then the next distinct nodes clockwise, ``n`` at most."""
        if not self._points:
            return []
        out: list[str] = []
        start = bisect.bisect_right(self._points, _position(key))
        for i in range(len(self._points)):
            node = self._owners[(start + i) % len(self._points)]
            if node not in out:
                out.append(node)
                if len(out) >= n or len(out) == len(self._nodes):
                    break
        return out


try:  # Ray is absent in pure unit-test environments of the ring above.
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError:  # pragma: no cover
    RequestRouter = object  # type: ignore[assignment,misc]


def replica_key(replica_id) -> str:
    """A replica's name on the ring: its unique id, the same string in every process."""
    return str(getattr(replica_id, "unique_id", replica_id))


def replica_actor_name(sibling_actor_name: str, replica: str) -> str:
    """The Ray actor name of the replica whose ring name is ``replica``, given the actor
    name of another replica of the same deployment: Serve names them
    ``SERVE_REPLICA::[app#]deployment#<unique id>`` (``ReplicaID.to_full_id_str``)."""
    head, sep, _ = sibling_actor_name.rpartition("#")
    if not sep or not replica or "#" in replica:
        raise ValueError(f"not a Serve replica's actor name, or not a ring name: {sibling_actor_name!r}, {replica!r}")
    return f"{head}#{replica}"


# The running replicas each KeyAffinityRequestRouter of this process last got from Serve,
# by (app, deployment): a ring of their own over them and their Ray actors, for callers
# that send calls to a key's owner themselves (``owner_actor``). Replaced whole on each
# update, never changed in place.
_running: dict[tuple[str, str], tuple[HashRing, dict[str, object]]] = {}


def _registry() -> dict:
    """This module's ``_running``, looked up through the module by name. Written as a
    plain global, the request router Serve made for a handle filled a ``_running`` that
    ``owner_actor`` never saw (a copy of this class unpickled by value carries globals
    of its own); through the module both meet."""
    import importlib

    return importlib.import_module(__name__)._running


def owner_actor(app_name: str, deployment_name: str, shard_key: str):
    """The Ray actor of the replica that owns ``shard_key``, as this process's request
    router for that deployment last saw the replicas; None before it has seen any (a
    handle's router is made on its first call) or where it could not name their actors."""
    running = _registry().get((app_name, deployment_name))
    if running is None:
        return None
    ring, actors = running
    owner = ring.owner(str(shard_key))
    return None if owner is None else actors.get(owner)


def _request_id() -> str:
    """The Serve request this call is made for (so the replica's log lines carry the
    caller's request id, as through Serve's router), else a fresh one."""
    import uuid

    try:
        from ray.serve.context import _get_serve_request_context

        request_id = _get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - another Ray's Serve: a fresh id will do
        request_id = ""
    return request_id or uuid.uuid4().hex


def send_direct(handle, method: str, args: tuple, kwargs: dict):
    """``handle.<method>.remote(*args, **kwargs)`` sent straight to the Ray actor of the
    DataPlane replica that owns ``kwargs["shard_key"]``, as Serve's router sends a plain
    (non-streaming) call: ``ReplicaActor.handle_request`` with Serve's request metadata.
    The replica runs it as any call of its deployment (counted as ongoing, in its metrics);
    what is skipped is the caller's Serve router: its replica choice (made here on the same
    ring, :func:`owner_actor`), its request bookkeeping, and the rejection round of Ray
    2.60's calls. That costs the caller ~2.3 ms of CPU per call against ~0.9 for this
    (``loadtests.dataplane_calls``).

    Returns the call's ObjectRef, or None where it cannot go straight: no shard key, a
    replica to exclude (a handoff's), or no owner known yet (this process's router for the
    deployment has not seen the replicas: a handle's router is made on its first call).
    Serve's internal protocol: where the caller's side of it is missing (another Ray: no
    such actor method or metadata class) it raises ImportError, AttributeError or
    TypeError, and the caller should send through Serve from then on. A replica that died
    or cannot be reached fails the ObjectRef with a ``RayActorError``: Serve's router,
    which finds another replica on its own, should take the call again."""
    shard_key = kwargs.get(SHARD_KEY_KWARG)
    if shard_key is None or kwargs.get(EXCLUDE_KWARG) is not None:
        return None
    actor = owner_actor(handle.app_name, handle.deployment_name, shard_key)
    if actor is None:
        return None
    import pickle
    import uuid

    from ray.serve._private.common import RequestMetadata

    metadata = RequestMetadata(
        request_id=_request_id(),
        internal_request_id=uuid.uuid4().hex,
        call_method=method,
        app_name=handle.app_name,
    )
    return actor.handle_request.remote(pickle.dumps(metadata), *args, **kwargs)


class DirectCalls:
    """One caller's data-plane calls sent straight to the owner replica
    (:func:`send_direct`) while ``enabled``; off for good, with one warning, once this
    Ray's Serve (or a handle that is not Serve's) lacks what that needs."""

    def __init__(self, handle, enabled: bool, caller: str):
        self._handle = handle
        self.enabled = enabled
        self._caller = caller

    def send(self, method: str, args: tuple, kwargs: dict):
        """The call's ObjectRef, or None where it must go through Serve (see send_direct)."""
        if not self.enabled:
            return None
        try:
            return send_direct(self._handle, method, args, kwargs)
        except (ImportError, AttributeError, TypeError) as e:
            self.enabled = False
            logger.warning("%s: data-plane calls go through Serve's router from now on: %r", self._caller, e)
            return None

    def call(self, method: str, args: tuple, kwargs: dict, *, straight: bool = True):
        """``handle.<method>.remote(*args, **kwargs)``: straight to the owner replica
        where it can go so (and ``straight``), else through Serve's router. Returns the
        call (an ObjectRef, or the Serve handle's response) and whether it went straight."""
        ref = self.send(method, args, kwargs) if straight else None
        if ref is not None:
            return ref, True
        return getattr(self._handle, method).remote(*args, **kwargs), False


class KeyAffinityRequestRouter(RequestRouter):  # type: ignore[misc,valid-type]
    """Serve request router: the replica that owns ``shard_key`` on the hash ring."""

    def initialize_state(self, **kwargs):
        self._ring = HashRing(vnodes=int(kwargs.get("vnodes", DEFAULT_VNODES)))

    def update_replicas(self, replicas: List["RunningReplica"]):
        result = super().update_replicas(replicas)
        # The ring spans every running replica, not only those with room right now, so
        # a key's owner does not move when a replica is briefly full. A new ring, never
        # one changed in place: _publish hands it to callers in other threads.
        nodes = {replica_key(r.replica_id) for r in replicas}
        if nodes != set(self._ring.nodes):
            self._ring = HashRing(nodes, vnodes=self._ring.vnodes)
        self._publish(replicas)
        return result

    def _publish(self, replicas) -> None:
        """This router's ring and the replicas' actors, for ``owner_actor``."""
        deployment = getattr(self, "_deployment_id", None)
        # The actor handle Serve keeps for each replica (RunningReplica._actor_handle).
        actors = {replica_key(r.replica_id): getattr(r, "_actor_handle", None) for r in replicas}
        if deployment is None:
            return
        key = (deployment.app_name, deployment.name)
        if not actors or any(a is None for a in actors.values()):
            _registry().pop(key, None)
            return
        _registry()[key] = (self._ring, actors)

    async def choose_replicas(
        self,
        candidate_replicas: List["RunningReplica"],
        pending_request: Optional["PendingRequest"] = None,
    ) -> List[List["RunningReplica"]]:
        kwargs = pending_request.kwargs if pending_request else {}
        exclude = kwargs.get(EXCLUDE_KWARG)
        if exclude is not None:
            candidate_replicas = [r for r in candidate_replicas if replica_key(r.replica_id) != exclude]
        if not candidate_replicas:
            return []
        shard_key = kwargs.get(SHARD_KEY_KWARG)
        if shard_key is None:
            # Any replica: one rank, Serve picks the least loaded of them.
            return [list(candidate_replicas)]
        by_key: dict[Hashable, "RunningReplica"] = {
            replica_key(r.replica_id): r for r in candidate_replicas
        }
        ring = self._ring
        if any(k not in ring._nodes for k in by_key):  # candidates ahead of update_replicas
            ring = HashRing(set(ring._nodes) | set(by_key), vnodes=ring.vnodes)
        ranked = [by_key[k] for k in ring.owners(str(shard_key), len(ring)) if k in by_key]
        if not ranked:
            return [list(candidate_replicas)]
        return [[r] for r in ranked[: 1 + NUM_FALLBACKS]]
