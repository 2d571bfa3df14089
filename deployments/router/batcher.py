"""Dynamic batching in front of the compute workers: plain asyncio, no Ray.

A batch leaves when it holds ``max_batch_size`` items or when its oldest item has waited
``batch_wait_timeout_s``, whichever comes first. Batching must never cost latency at low
load, so an item that arrives while nothing is pending and a worker is idle leaves at once,
alone (the idle fast path), and a worker turning idle flushes whatever is pending.

Grouping arrivals pays off because the engine prefills a whole batch in one forward pass
instead of interrupting its decode loop once per request.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")

# Why a batch left: recorded as a metric tag by the router.
FLUSH_IDLE = "idle"
FLUSH_FULL = "full"
FLUSH_TIMEOUT = "timeout"


class DynamicBatcher(Generic[T]):
    """Groups submitted items into batches handed to ``dispatch``.

    ``dispatch(batch_id, items, reason)`` is called synchronously from the event loop;
    it must not block (the router resolves futures there). ``has_idle_worker()`` is asked
    on every arrival while nothing is pending.
    """

    def __init__(
        self,
        dispatch: Callable[[int, list[T], str], None],
        *,
        max_batch_size: int,
        batch_wait_timeout_s: float,
        has_idle_worker: Callable[[], bool],
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_wait_timeout_s < 0:
            raise ValueError(f"batch_wait_timeout_s must be >= 0, got {batch_wait_timeout_s}")
        self._dispatch = dispatch
        self.max_batch_size = max_batch_size
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self._has_idle_worker = has_idle_worker
        self._pending: list[T] = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self._batch_ids = itertools.count(1)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, item: T) -> None:
        if not self._pending and (self._has_idle_worker() or self.max_batch_size == 1):
            # A batch of one gains nothing by waiting: the first request of an idle
            # worker (or any request when batching is off) goes straight through.
            self._emit([item], FLUSH_IDLE)
            return
        self._pending.append(item)
        if len(self._pending) >= self.max_batch_size:
            self._flush(FLUSH_FULL)
        elif self.batch_wait_timeout_s == 0:
            self._flush(FLUSH_TIMEOUT)
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.batch_wait_timeout_s, self._flush, FLUSH_TIMEOUT)

    def remove(self, item: T) -> bool:
        """Withdraw an item still pending (its client went away). True if it was pending."""
        try:
            self._pending.remove(item)
        except ValueError:
            return False
        if not self._pending:
            self._cancel_timer()
        return True

    def notify_idle(self) -> None:
        """A worker has become idle: pending items should not wait for the timer."""
        if self._pending:
            self._flush(FLUSH_IDLE)

    def _flush(self, reason: str) -> None:
        # submit() flushes as soon as max_batch_size items are pending, so the pending
        # list never holds more than one batch.
        self._cancel_timer()
        batch, self._pending = self._pending, []
        if batch:
            self._emit(batch, reason)

    def _emit(self, batch: list[T], reason: str) -> None:
        self._dispatch(next(self._batch_ids), batch, reason)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> list[T]:
        """Stop the timer and return the items that were still pending."""
        self._cancel_timer()
        pending, self._pending = self._pending, []
        return pending
