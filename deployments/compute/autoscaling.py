"""Queue-depth autoscaling of the ComputeWorker deployment (a Ray Serve custom policy).

Each ComputeWorker replica reports, through Serve's ``record_autoscaling_stats`` hook, its
**queue depth**: the requests it holds that have not finished (running in the engine plus
waiting for an engine slot or for their prefix fetch). Serve keeps those reports per
replica, averages each over ``look_back_period_s`` and calls this policy in the Serve
controller every control-loop tick (0.1 s) with an ``AutoscalingContext``.

The decision (``decide``, pure):

    total   = Σ queue_depth over the running replicas + requests queued at handles
    desired = ceil(total / target_queue_depth_per_replica), within [min, max]

Requests queued at handles are those Serve could not place because every replica was at
``max_ongoing_requests`` (Serve's handle metric, whatever process holds the handle). With
no report from any replica yet, the policy holds the current target. Serve then applies
``upscale_delay_s`` / ``downscale_delay_s`` (the wish must hold that long) and the bounds.

The module is pickled by value into the controller (Serve does that for custom policies),
so it imports only the standard library and Ray.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

# The custom metric each replica reports (``ComputeWorker.record_autoscaling_stats``).
QUEUE_DEPTH_METRIC = "queue_depth"
POLICY_PATH = "deployments.compute.autoscaling:QueueDepthPolicy"


@dataclass(frozen=True)
class Decision:
    desired: int
    total_queue_depth: float
    reason: str


def decide(
    queue_depths: Mapping[Hashable, float] | None,
    *,
    queued_at_handles: float,
    current_replicas: int,
    target_replicas: int,
    target_per_replica: float,
    min_replicas: int,
    max_replicas: int,
) -> Decision:
    """The number of replicas the load asks for (before Serve's delays).

    ``queue_depths``: replica → its reported queue depth (averaged over the look-back
    window); only running replicas. ``queued_at_handles``: requests Serve holds at handles
    because no replica had room. ``target_replicas``: Serve's current target.
    """
    if target_per_replica <= 0:
        raise ValueError(f"target_per_replica must be > 0, got {target_per_replica}")
    queued = max(0.0, float(queued_at_handles or 0.0))
    if current_replicas == 0:
        # Serve's own cold-start path scales 0 → n when requests wait at handles.
        return Decision(_bound(target_replicas, min_replicas, max_replicas), queued, "no running replica")
    if not queue_depths:
        return Decision(
            _bound(target_replicas, min_replicas, max_replicas), queued, "no replica reported yet"
        )
    total = sum(max(0.0, float(v)) for v in queue_depths.values()) + queued
    # A hair under an exact multiple must not ask for one more replica.
    wanted = math.ceil(total / target_per_replica - 1e-9)
    desired = _bound(wanted, min_replicas, max_replicas)
    if desired > target_replicas:
        reason = "queue above target"
    elif desired < target_replicas:
        reason = "queue below target"
    else:
        reason = "steady"
    return Decision(desired, total, reason)


def _bound(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


class QueueDepthPolicy:
    """Serve instantiates this once per deployment config (``policy_kwargs`` → here) and
    calls it every control-loop tick. Logs and metrics are edge-triggered: one line when
    the wish changes, one when Serve's target changes."""

    def __init__(self, target_queue_depth_per_replica: float):
        if target_queue_depth_per_replica <= 0:
            raise ValueError("target_queue_depth_per_replica must be > 0")
        self.target_per_replica = float(target_queue_depth_per_replica)
        self._last_desired: int | None = None
        self._last_target: int | None = None
        self._metrics: dict | None = None

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        depths = metrics.get(QUEUE_DEPTH_METRIC) or {}
        try:
            queued = ctx.total_queued_requests or 0.0
        except Exception:  # noqa: BLE001 - no handle report yet
            queued = 0.0
        d = decide(
            depths,
            queued_at_handles=queued,
            current_replicas=ctx.current_num_replicas,
            target_replicas=ctx.target_num_replicas,
            target_per_replica=self.target_per_replica,
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
        )
        self._observe(ctx, d, len(depths))
        return d.desired, {}

    def _observe(self, ctx, d: Decision, num_reporting: int) -> None:
        name = ctx.deployment_name
        m = self._get_metrics(name, ctx.app_name or "")
        if m is not None:
            m["depth"].set(d.total_queue_depth)
            m["desired"].set(d.desired)
        if d.desired != self._last_desired and d.desired != ctx.target_num_replicas:
            logger.info(
                "autoscaler %s: wants %d replicas (target %d, running %d): queue depth %.1f "
                "over %d reporting replicas, target %.1f per replica (%s)",
                name,
                d.desired,
                ctx.target_num_replicas,
                ctx.current_num_replicas,
                d.total_queue_depth,
                num_reporting,
                self.target_per_replica,
                d.reason,
            )
        self._last_desired = d.desired
        target = ctx.target_num_replicas
        if self._last_target is not None and target != self._last_target:
            direction = "up" if target > self._last_target else "down"
            logger.info(
                "autoscaler %s: scaled %s %d -> %d replicas (queue depth %.1f)",
                name,
                direction,
                self._last_target,
                target,
                d.total_queue_depth,
            )
            if m is not None:
                m["decisions"].inc(tags={"direction": direction})
        self._last_target = target

    def _get_metrics(self, deployment: str, app: str) -> dict | None:
        if self._metrics is None:
            try:
                from ray.util import metrics

                tags = ("deployment", "application")
                self._metrics = {
                    "depth": metrics.Gauge(
                        "llm_autoscaler_queue_depth",
                        "Queue depth (running + waiting) summed over a deployment's "
                        "replicas, as the autoscaler saw it.",
                        tag_keys=tags,
                    ),
                    "desired": metrics.Gauge(
                        "llm_autoscaler_desired_replicas",
                        "Replicas the queue depth asks for (before Serve's delays).",
                        tag_keys=tags,
                    ),
                    "decisions": metrics.Counter(
                        "llm_autoscaler_scale_decisions",
                        "Changes of the deployment's target replica count, by direction.",
                        tag_keys=(*tags, "direction"),
                    ),
                }
                for metric in self._metrics.values():
                    metric.set_default_tags({"deployment": deployment, "application": app})
            except Exception:  # noqa: BLE001 - outside Ray (unit tests): no metrics
                self._metrics = {}
        return self._metrics or None
