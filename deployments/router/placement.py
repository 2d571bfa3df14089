"""Placement of requests on ComputeWorker replicas.

Two layers:

* pure logic, no Ray, unit-tested: :func:`choose_pair` (power of two choices),
  :class:`BatchAffinity`, :class:`BoundedLoadRing` (consistent hashing with bounded
  loads), :class:`PrefixIndex` (which replica holds which KV blocks), :func:`decide` (the
  policy) and :class:`CircuitBreaker` / :class:`BreakerBoard`;
* :class:`QueueAwareRequestRouter` plugs them into Ray Serve's request-router interface, so
  the handle to the workers places each call, in whatever process holds that handle. Serve
  calls ``choose_replicas`` for every request and then only checks that the chosen replica
  has room (``max_ongoing_requests``); the ranking is ours.

Policy, in order (the first that applies gives the reason):

1. replicas whose circuit breaker is open are left out (all of them only if none is left);
2. ``affinity``: a request with a ``session_id`` goes to its session's home replica on a
   consistent-hash ring of the replica ids, unless that replica's queue is over
   ``load_factor`` × the average (then the next replica clockwise that is not: bounded
   loads, Mirrokni et al.), and unless a replica within that bound already holds a longer
   prefix of the prompt in its L1 (then that one, reason ``prefix``);
3. ``batch``: members of one router batch follow the first member (the engine prefills
   them in one pass);
4. ``prefix``: the replica holding the longest cached prefix of the prompt, counted in
   whole KV blocks by their chained hashes (``engines/kv.py:block_hashes``), scored as
   ``hit_tokens - queue_weight_tokens × queue_len`` so a cache does not pull a request
   onto a long queue;
5. ``p2c``: otherwise power of two choices on queue length.

A replica's queue length is what this process has in flight there plus what the worker
last reported waiting in its engine (``record_routing_stats``). What a replica holds comes
from two sources: the block keys the worker reports (``prefix_keys``, the torch engine's
L1 prefix cache) and this process's own record of where it sent each prompt's blocks in
the last ``prefix_memory_s`` (that covers the report's lag, and engines that report
nothing, such as vLLM, whose prefix cache hashes differently).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from deployments.dataplane.routing import HashRing

logger = logging.getLogger("ray.serve")

BATCH_ID_KWARG = "batch_key"
# Bytes of a block hash kept in reports and indexes: 64 bits, collisions ~n²/2^65.
KEY_BYTES = 8

REASON_AFFINITY = "affinity"
REASON_BATCH = "batch"
REASON_PREFIX = "prefix"
REASON_P2C = "p2c"


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

    def get(self, batch_key: str) -> Hashable | None:
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


# ---------------------------------------------------------------- bounded-load hashing


class BoundedLoadRing:
    """Consistent hashing with bounded loads over replica names.

    A key's owners are the replicas clockwise from its position on a :class:`HashRing`
    (blake2b positions: the same in every process that knows the same replicas). The key
    goes to the first owner whose load, with this request added, stays within
    ``ceil(load_factor × (total load + 1) / replicas)``; with integer loads and
    ``load_factor >= 1`` some replica always does.
    """

    def __init__(self, load_factor: float = 1.25, vnodes: int = 64):
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.load_factor = load_factor
        self._ring = HashRing(vnodes=vnodes)

    def set_nodes(self, nodes: Iterable[str]) -> None:
        self._ring.set_nodes(nodes)

    @property
    def nodes(self) -> list[str]:
        return self._ring.nodes

    def owners(self, key: str, eligible: Iterable[str]) -> list[str]:
        """Eligible replicas in the key's ring order (home first). Eligible replicas the
        ring does not know yet (Serve reported them first) come last, by name."""
        eligible = set(eligible)
        ordered = [n for n in self._ring.owners(key, len(self._ring)) if n in eligible]
        return ordered + sorted(eligible.difference(ordered))

    def capacity(self, loads: Mapping[str, float]) -> int:
        """Most load a replica may carry after taking the new request."""
        if not loads:
            return 0
        return math.ceil(self.load_factor * (sum(loads.values()) + 1) / len(loads))

    def assign(self, key: str, loads: Mapping[str, float]) -> tuple[str, int] | None:
        """(replica, rank in the key's order: 0 = home) for ``key`` among ``loads``' keys,
        or None if there are none."""
        order = self.owners(key, loads)
        if not order:
            return None
        cap = self.capacity(loads)
        for rank, node in enumerate(order):
            if loads[node] + 1 <= cap:
                return node, rank
        # Unreachable with integer loads; fractional ones: the least loaded.
        node = min(order, key=lambda n: loads[n])
        return node, order.index(node)


# ---------------------------------------------------------------- prefix index


def block_key(block_hash: str) -> bytes:
    """The compact key of a block hash (hex) kept in reports and indexes."""
    return bytes.fromhex(block_hash[: 2 * KEY_BYTES])


def pack_keys(keys: Iterable[bytes]) -> bytes:
    """Block keys as one bytes object (what a worker reports)."""
    return b"".join(keys)


def unpack_keys(blob: bytes) -> frozenset[bytes]:
    if len(blob) % KEY_BYTES:
        raise ValueError(f"a packed key list has a multiple of {KEY_BYTES} bytes, got {len(blob)}")
    return frozenset(blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES))


def leading_hits(keys: Sequence[bytes], held: Callable[[bytes], bool]) -> int:
    """How many leading blocks of a chain are held (stops at the first miss: a block is
    usable only with every block before it)."""
    n = 0
    for key in keys:
        if not held(key):
            break
        n += 1
    return n


class PrefixIndex:
    """Which replica holds which KV blocks, by block key.

    ``reported``: the set each worker last reported (authoritative, includes evictions);
    ``remembered``: where this process sent each prompt's blocks, kept ``memory_s``
    (bounded LRU), which covers the report's lag and engines that report nothing.
    Thread-safe: Serve's routing loop writes it, other threads may read it.
    """

    def __init__(self, memory_s: float = 60.0, max_remembered: int = 200_000, clock=time.monotonic):
        self._memory_s = memory_s
        self._max_remembered = max_remembered
        self._clock = clock
        self._lock = threading.Lock()
        self._reported: dict[str, tuple[bytes, frozenset[bytes]]] = {}
        # key -> {replica: expires}
        self._remembered: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def set_reported(self, replica: str, blob: bytes | None) -> None:
        with self._lock:
            if not blob:
                self._reported.pop(replica, None)
                return
            current = self._reported.get(replica)
            if current is not None and current[0] == blob:
                return
            try:
                self._reported[replica] = (blob, unpack_keys(blob))
            except ValueError:
                logger.warning("placement: ignoring a malformed prefix report of %s", replica)

    def forget_replicas_except(self, replicas: Iterable[str]) -> None:
        keep = set(replicas)
        with self._lock:
            for replica in [r for r in self._reported if r not in keep]:
                del self._reported[replica]

    def remember(self, keys: Sequence[bytes], replica: str) -> None:
        if not keys or self._memory_s <= 0:
            return
        expires = self._clock() + self._memory_s
        with self._lock:
            for key in keys:
                holders = self._remembered.get(key)
                if holders is None:
                    self._remembered[key] = {replica: expires}
                else:
                    holders[replica] = expires
                    self._remembered.move_to_end(key)
            while len(self._remembered) > self._max_remembered:
                self._remembered.popitem(last=False)

    def hits(self, keys: Sequence[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``keys`` each replica holds."""
        now = self._clock()
        out = {}
        with self._lock:
            for replica in replicas:
                reported = self._reported.get(replica)
                reported_keys = reported[1] if reported else frozenset()

                def held(key, replica=replica, reported_keys=reported_keys):
                    if key in reported_keys:
                        return True
                    holders = self._remembered.get(key)
                    expires = holders.get(replica) if holders is not None else None
                    return expires is not None and expires >= now

                out[replica] = leading_hits(keys, held)
        return out


# ---------------------------------------------------------------- the policy


@dataclass(slots=True)
class Decision:
    """A placement: replicas in order of preference (Serve tries the next only when the
    previous has no room), why the first was chosen, and its score."""

    order: list[str]
    reason: str
    # affinity: the chosen replica's queue over the bound; prefix: hit_tokens - weight ×
    # queue; p2c and batch: the chosen replica's queue length.
    score: float
    hit_blocks: int = 0
    queue_len: float = 0.0
    # affinity only: 0 = the session's home replica, k = k-th replica after it.
    ring_rank: int = 0
    details: dict = field(default_factory=dict)


def prefix_scores(
    hit_blocks: Mapping[str, int],
    queue_len: Mapping[str, float],
    block_size: int,
    queue_weight_tokens: float,
) -> dict[str, float]:
    return {r: hit_blocks.get(r, 0) * block_size - queue_weight_tokens * queue_len[r] for r in queue_len}


def best_prefix(
    hit_blocks: Mapping[str, int],
    queue_len: Mapping[str, float],
    block_size: int,
    queue_weight_tokens: float,
) -> tuple[str, float] | None:
    """The replica with the best prefix score, if it holds at least one block; ties go to
    more blocks, then the shorter queue, then the name (deterministic)."""
    scores = prefix_scores(hit_blocks, queue_len, block_size, queue_weight_tokens)
    if not scores:
        return None
    best = max(scores, key=lambda r: (scores[r], hit_blocks.get(r, 0), -queue_len[r], r))
    if hit_blocks.get(best, 0) <= 0:
        return None
    return best, scores[best]


def decide(
    queue_len: Mapping[str, float],
    *,
    ring: BoundedLoadRing,
    rng: random.Random,
    session_id: str | None = None,
    hit_blocks: Mapping[str, int] | None = None,
    block_size: int = 16,
    queue_weight_tokens: float = 64.0,
    cache_aware: bool = True,
) -> Decision:
    """Rank the replicas in ``queue_len`` (candidates → queue length) for one request.

    ``cache_aware=False`` is plain power of two choices (the benchmark's baseline)."""
    candidates = list(queue_len)
    if not candidates:
        raise ValueError("no candidate replicas")
    hit_blocks = hit_blocks or {}

    def rest(first: str) -> list[str]:
        others = [r for r in candidates if r != first]
        return [first] + sorted(others, key=lambda r: (queue_len[r], r))

    if cache_aware and session_id is not None:
        placed = ring.assign(session_id, queue_len)
        assert placed is not None
        home, rank = placed
        cap = ring.capacity(queue_len)
        # A replica within the load bound that holds more of the prompt beats the home.
        within = {r: q for r, q in queue_len.items() if q + 1 <= cap}
        holder = max(within, key=lambda r: (hit_blocks.get(r, 0), r == home), default=home)
        if hit_blocks.get(holder, 0) > hit_blocks.get(home, 0):
            return Decision(
                rest(holder),
                REASON_PREFIX,
                float(hit_blocks[holder] * block_size),
                hit_blocks=hit_blocks[holder],
                queue_len=queue_len[holder],
                details={"session_home": home, "capacity": cap},
            )
        return Decision(
            rest(home),
            REASON_AFFINITY,
            (queue_len[home] + 1) / cap,
            hit_blocks=hit_blocks.get(home, 0),
            queue_len=queue_len[home],
            ring_rank=rank,
            details={"capacity": cap},
        )
    if cache_aware:
        best = best_prefix(hit_blocks, queue_len, block_size, queue_weight_tokens)
        if best is not None:
            replica, score = best
            return Decision(
                rest(replica), REASON_PREFIX, score, hit_blocks=hit_blocks[replica], queue_len=queue_len[replica]
            )
    pair = choose_pair(candidates, queue_len.__getitem__, rng)
    order = pair + [r for r in rest(pair[0]) if r not in pair]
    return Decision(
        order, REASON_P2C, queue_len[pair[0]], hit_blocks=hit_blocks.get(pair[0], 0), queue_len=queue_len[pair[0]]
    )


# ---------------------------------------------------------------- circuit breaking

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    """Error-rate circuit breaker of one replica. Not thread-safe (see BreakerBoard).

    * closed: outcomes of the last ``window_s`` are kept; once there are at least
      ``min_requests`` of them and the failed fraction reaches ``error_rate``, it opens;
    * open: the replica gets no requests; after ``cooldown_s`` it is half-open;
    * half-open: up to ``half_open_probes`` requests at a time go through; the first
      success closes it (a fresh window), a failure opens it again for another cool-down.
      A probe that ends without a verdict (cancelled) frees its slot.
    """

    def __init__(
        self,
        *,
        window_s: float = 30.0,
        min_requests: int = 5,
        error_rate: float = 0.5,
        cooldown_s: float = 10.0,
        half_open_probes: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.window_s = window_s
        self.min_requests = min_requests
        self.error_rate = error_rate
        self.cooldown_s = cooldown_s
        self.half_open_probes = half_open_probes
        self._clock = clock
        self._state = CLOSED
        self._events: collections.deque[tuple[float, bool]] = collections.deque()
        self._failures = 0
        self._opened_at = 0.0
        self._probes = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = HALF_OPEN
            self._probes = 0
        return self._state

    def available(self) -> bool:
        """Whether placement may send this replica a request now."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and self._probes < self.half_open_probes)

    def on_routed(self) -> None:
        if self.state == HALF_OPEN:
            self._probes += 1

    def on_cancelled(self, was_probe: bool) -> None:
        if was_probe and self._state == HALF_OPEN and self._probes > 0:
            self._probes -= 1

    def error_fraction(self) -> float:
        self._prune()
        return self._failures / len(self._events) if self._events else 0.0

    def _prune(self) -> None:
        horizon = self._clock() - self.window_s
        while self._events and self._events[0][0] < horizon:
            _, ok = self._events.popleft()
            if not ok:
                self._failures -= 1

    def record(self, ok: bool) -> str | None:
        """Count one outcome; returns the new state if it changed."""
        state = self.state
        if state == HALF_OPEN:
            self._probes = max(0, self._probes - 1)
            if ok:
                self._state = CLOSED
                self._events.clear()
                self._failures = 0
                return CLOSED
            self._open()
            return OPEN
        if state == OPEN:  # a request routed before it opened; the verdict is in
            return None
        self._events.append((self._clock(), ok))
        if not ok:
            self._failures += 1
        self._prune()
        if len(self._events) >= self.min_requests and self._failures >= self.error_rate * len(self._events):
            self._open()
            return OPEN
        return None

    def _open(self) -> None:
        self._state = OPEN
        self._opened_at = self._clock()
        self._probes = 0
        self._events.clear()
        self._failures = 0


class BreakerBoard:
    """One breaker per replica, thread-safe; ``on_change(replica, state)`` is called on
    every state change (outside the lock)."""

    def __init__(
        self,
        factory: Callable[[], CircuitBreaker],
        on_change: Callable[[str, str], None] | None = None,
    ):
        self._factory = factory
        self._on_change = on_change
        self._lock = threading.Lock()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._states: dict[str, str] = {}

    def _get(self, replica: str) -> CircuitBreaker:
        breaker = self._breakers.get(replica)
        if breaker is None:
            breaker = self._breakers[replica] = self._factory()
            self._states[replica] = CLOSED
        return breaker

    def _changes(self) -> list[tuple[str, str]]:
        changed = []
        for replica, breaker in self._breakers.items():
            state = breaker.state
            if state != self._states.get(replica):
                self._states[replica] = state
                changed.append((replica, state))
        return changed

    def _notify(self, changed: list[tuple[str, str]]) -> None:
        if self._on_change is not None:
            for replica, state in changed:
                self._on_change(replica, state)

    def available(self, replicas: Iterable[str]) -> list[str]:
        with self._lock:
            out = [r for r in replicas if self._get(r).available()]
            changed = self._changes()
        self._notify(changed)
        return out

    def on_routed(self, replica: str) -> bool:
        """Count a routed request; True if it is a half-open probe."""
        with self._lock:
            breaker = self._get(replica)
            probe = breaker.state == HALF_OPEN
            breaker.on_routed()
        return probe

    def record(self, replica: str, ok: bool | None, was_probe: bool = False) -> None:
        """One outcome: True ok, False failed, None no verdict (cancelled)."""
        with self._lock:
            breaker = self._get(replica)
            if ok is None:
                breaker.on_cancelled(was_probe)
            else:
                breaker.record(ok)
            changed = self._changes()
        self._notify(changed)

    def state(self, replica: str) -> str:
        with self._lock:
            return self._get(replica).state

    def forget_replicas_except(self, replicas: Iterable[str]) -> None:
        keep = set(replicas)
        with self._lock:
            for replica in [r for r in self._breakers if r not in keep]:
                del self._breakers[replica]
                self._states.pop(replica, None)


class OutcomeRegistry:
    """Where each ``generate`` call went (request id → breaker board, replica, probe),
    until its caller reports how it ended (:func:`report_outcome`). The caller sees the
    call's real error whatever transport Serve used; the request router does not.
    Bounded: an entry nobody reports on is dropped after ``max_entries`` newer ones."""

    def __init__(self, max_entries: int = 100_000):
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[BreakerBoard, str, bool]] = OrderedDict()

    def routed(self, request_id: str, board: BreakerBoard, replica: str, probe: bool) -> None:
        with self._lock:
            self._entries[request_id] = (board, replica, probe)
            self._entries.move_to_end(request_id)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def report(self, request_id: str, ok: bool | None) -> str | None:
        """Record the outcome of the call's latest placement; returns its replica."""
        with self._lock:
            entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        board, replica, probe = entry
        board.record(replica, ok, was_probe=probe)
        return replica

    def __len__(self) -> int:
        return len(self._entries)


# One per process, like TRACKER: the request router writes, the Router reports.
OUTCOMES = OutcomeRegistry()


def report_outcome(request_id: str, ok: bool | None) -> None:
    """How a worker call ended (see :func:`classify_outcome`), for the circuit breaker of
    the replica it ran on. Called by the Router once per call (and per retry)."""
    try:
        OUTCOMES.report(request_id, ok)
    except Exception:  # bookkeeping must never fail a request
        logger.exception("placement: recording the outcome of %s failed", request_id)


def classify_outcome(result) -> bool | None:
    """A finished worker call as the breaker sees it: True (the replica did its job, even
    if it refused a bad request), False (the replica or its engine failed), None (no
    verdict: the caller cancelled it)."""
    if not isinstance(result, BaseException):
        return True
    from app.errors import APIError, _causes
    from deployments.compute.engines.protocol import RequestRejected

    cancelled: tuple[type, ...] = ()
    try:
        import ray.exceptions as rex

        cancelled = (rex.TaskCancelledError,)
    except ImportError:  # pragma: no cover
        pass
    for cause in _causes(result):
        if isinstance(cause, (asyncio.CancelledError, *cancelled)):
            return None
        if isinstance(cause, RequestRejected):
            return True
        if isinstance(cause, APIError) and cause.status_code < 500:
            return True
    return False


# ---------------------------------------------------------------- Serve request router

try:  # Ray is absent in pure unit-test environments of the policy above.
    from ray.serve.request_router import (
        FIFOMixin,
        PendingRequest,
        ReplicaID,
        RequestRouter,
        RunningReplica,
    )
except ImportError:  # pragma: no cover - exercised where Ray is not installed (an accelerator box)

    class RequestRouter:  # type: ignore[no-redef]
        """Stand-in base so this module imports without Ray (two ``object`` bases would
        make the class below a duplicate-base TypeError)."""

    class FIFOMixin:  # type: ignore[no-redef]
        """Stand-in, as above."""


def router_kwargs(config) -> dict:
    """``request_router_kwargs`` of the ComputeWorker deployment from an AppConfig."""
    placement, breaker = config.router.placement, config.router.circuit_breaker
    return {
        "model_id": config.model.id,
        "block_size": config.dataplane.block_size,
        "policy": placement.policy,
        "load_factor": placement.load_factor,
        "queue_weight_tokens": placement.queue_weight_tokens,
        "prefix_memory_s": placement.prefix_memory_s,
        "breaker_enabled": breaker.enabled,
        "breaker_window_s": breaker.window_s,
        "breaker_min_requests": breaker.min_requests,
        "breaker_error_rate": breaker.error_rate,
        "breaker_cooldown_s": breaker.cooldown_s,
        "breaker_half_open_probes": breaker.half_open_probes,
    }


def replica_name(replica_id) -> str:
    """A replica's name in placement: its unique id, the same string in every process."""
    return str(getattr(replica_id, "unique_id", replica_id))


class QueueAwareRequestRouter(FIFOMixin, RequestRouter):  # type: ignore[misc,valid-type]
    """Serve request router: the policy of this module (see the module docstring).

    ``request_router_kwargs`` (set by ``worker_deployment`` from ``router.placement`` and
    ``router.circuit_breaker``): ``model_id``, ``block_size``, ``policy``
    (``cache_aware`` | ``p2c``), ``load_factor``, ``queue_weight_tokens``,
    ``prefix_memory_s`` and the breaker's ``breaker_*`` settings.
    """

    def initialize_state(self, **kwargs):
        self._rng = random.Random()
        self._affinity = BatchAffinity()
        self._tracker = TRACKER
        self._model_id = str(kwargs.get("model_id", "model"))
        self._block_size = int(kwargs.get("block_size", 16))
        self._cache_aware = kwargs.get("policy", "cache_aware") == "cache_aware"
        self._queue_weight = float(kwargs.get("queue_weight_tokens", 64.0))
        self._ring = BoundedLoadRing(float(kwargs.get("load_factor", 1.25)))
        self._index = PrefixIndex(memory_s=float(kwargs.get("prefix_memory_s", 60.0)))
        breaker_enabled = bool(kwargs.get("breaker_enabled", True))
        breaker_args = {
            "window_s": float(kwargs.get("breaker_window_s", 30.0)),
            "min_requests": int(kwargs.get("breaker_min_requests", 5)),
            "error_rate": float(kwargs.get("breaker_error_rate", 0.5)),
            "cooldown_s": float(kwargs.get("breaker_cooldown_s", 10.0)),
            "half_open_probes": int(kwargs.get("breaker_half_open_probes", 1)),
        }
        self._breakers = (
            BreakerBoard(lambda: CircuitBreaker(**breaker_args), self._on_breaker_change)
            if breaker_enabled
            else None
        )
        self._init_telemetry()

    def _init_telemetry(self) -> None:
        from ray.util import metrics

        from app import telemetry

        self._tracer = telemetry.tracer(__name__)
        self._m_decisions = metrics.Counter(
            "llm_placement_decisions",
            "Placements of worker calls by reason (affinity, prefix, batch, p2c).",
            tag_keys=("reason",),
        )
        self._m_hit_blocks = metrics.Counter(
            "llm_placement_prefix_hit_blocks",
            "KV blocks of a prompt the chosen replica was known to hold, by reason.",
            tag_keys=("reason",),
        )
        self._m_spills = metrics.Counter(
            "llm_placement_affinity_spills",
            "Session requests placed off their home replica because it was over the load bound.",
        )
        self._m_breaker = metrics.Counter(
            "llm_placement_breaker_transitions",
            "Circuit-breaker state changes of worker replicas, by new state.",
            tag_keys=("state",),
        )
        self._m_breaker_open = metrics.Gauge(
            "llm_placement_breaker_open_replicas",
            "Worker replicas whose circuit breaker is open or half-open.",
        )
        self._open_replicas: set[str] = set()

    def _on_breaker_change(self, replica: str, state: str) -> None:
        if state == CLOSED:
            self._open_replicas.discard(replica)
            logger.info("placement: breaker of replica %s closed; back in placement", replica)
        elif state == OPEN:
            self._open_replicas.add(replica)
            logger.warning("placement: breaker of replica %s opened (error rate over the window); out of placement", replica)
        else:
            logger.info("placement: breaker of replica %s half-open; probing", replica)
        self._m_breaker.inc(tags={"state": state})
        self._m_breaker_open.set(len(self._open_replicas))

    def update_replicas(self, replicas: list[RunningReplica]):
        result = super().update_replicas(replicas)
        self._tracker.set_replicas([r.replica_id for r in replicas])
        names = [replica_name(r.replica_id) for r in replicas]
        # The ring spans every running replica, not only those with room right now, so a
        # session's home does not move when its replica is briefly full.
        self._ring.set_nodes(names)
        self._index.forget_replicas_except(names)
        if self._breakers is not None:
            self._breakers.forget_replicas_except(names)
        return result

    def _queue_len(self, replica: RunningReplica) -> float:
        stats = replica.routing_stats or {}
        return self._tracker.inflight(replica.replica_id) + float(stats.get("num_waiting", 0))

    def _block_keys(self, request) -> list[bytes]:
        from deployments.compute.engines.kv import prompt_lookup_hashes

        # As the engine looks them up.
        return [block_key(h) for h in prompt_lookup_hashes(self._model_id, request, self._block_size)]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {replica_name(r.replica_id): r for r in candidate_replicas}
        names = list(by_name)
        if self._breakers is not None:
            names = self._breakers.available(names) or names  # none left: take them all
        request = pending_request.args[0] if pending_request and pending_request.args else None
        if not hasattr(request, "prompt_token_ids"):
            request = None
        batch_key = pending_request.kwargs.get(BATCH_ID_KWARG) if pending_request else None
        session_id = getattr(request, "session_id", None) if self._cache_aware else None
        queue = {n: self._queue_len(by_name[n]) for n in names}

        if batch_key is not None and session_id is None:
            first = self._affinity.get(batch_key)
            if first in queue:
                decision = Decision(
                    [first] + [n for n in names if n != first], REASON_BATCH, queue[first], queue_len=queue[first]
                )
                self._explain(decision, request, batch_key)
                return [[by_name[n]] for n in decision.order]

        keys: list[bytes] = []
        hits: dict[str, int] = {}
        if request is not None and self._cache_aware:
            keys = self._block_keys(request)
            if keys:
                for name in names:
                    stats = by_name[name].routing_stats or {}
                    self._index.set_reported(name, stats.get("prefix_keys"))
                hits = self._index.hits(keys, names)
        decision = decide(
            queue,
            ring=self._ring,
            rng=self._rng,
            session_id=session_id,
            hit_blocks=hits,
            block_size=self._block_size,
            queue_weight_tokens=self._queue_weight,
            cache_aware=self._cache_aware,
        )
        chosen = decision.order[0]
        if batch_key is not None and session_id is None:
            self._affinity.put(batch_key, chosen)
        if keys:
            # The chosen replica will hold these blocks once the request has run.
            self._index.remember(keys, chosen)
        self._explain(decision, request, batch_key)
        # One replica per rank: Serve tries our first choice, and the next only if the
        # previous has no room.
        return [[by_name[n]] for n in decision.order]

    def _explain(self, decision: Decision, request, batch_key) -> None:
        reason = decision.reason
        self._m_decisions.inc(tags={"reason": reason})
        if decision.hit_blocks:
            self._m_hit_blocks.inc(decision.hit_blocks, tags={"reason": reason})
        if reason == REASON_AFFINITY and decision.ring_rank > 0:
            self._m_spills.inc()
        request_id = getattr(request, "request_id", None)
        logger.debug(
            "placement: request=%s reason=%s replica=%s score=%.3f hit_blocks=%d queue_len=%.0f "
            "ring_rank=%d session=%s batch=%s details=%s",
            request_id,
            reason,
            decision.order[0],
            decision.score,
            decision.hit_blocks,
            decision.queue_len,
            decision.ring_rank,
            getattr(request, "session_id", None),
            batch_key,
            decision.details,
        )
        if request is None:
            return
        from app import telemetry

        ctx = telemetry.extract_context(request.trace_headers)
        with self._tracer.start_as_current_span("router.placement", context=ctx) as span:
            span.set_attribute("llm.request_id", request_id or "")
            span.set_attribute("llm.placement.replica", decision.order[0])
            span.set_attribute("llm.placement.reason", reason)
            span.set_attribute("llm.placement.score", float(decision.score))
            span.set_attribute("llm.placement.hit_blocks", decision.hit_blocks)
            span.set_attribute("llm.placement.queue_len", float(decision.queue_len))
            span.set_attribute("llm.placement.ring_rank", decision.ring_rank)

    def on_request_routed(self, pending_request, replica_id: ReplicaID, result) -> None:
        self._tracker.routed(replica_id)
        if self._breakers is None:
            return
        request = pending_request.args[0] if pending_request and pending_request.args else None
        request_id = getattr(request, "request_id", None)
        if request_id is None or not hasattr(request, "prompt_token_ids"):
            return  # not a generate call: nobody reports its outcome
        name = replica_name(replica_id)
        OUTCOMES.routed(request_id, self._breakers, name, self._breakers.on_routed(name))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._tracker.completed(replica_id)
