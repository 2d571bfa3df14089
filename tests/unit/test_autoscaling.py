"""Queue-depth autoscaling: exact decisions of the pure policy for given metrics, the
policy object Serve calls (with a stand-in context), the config's validation, and the
deployment options built from it."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from app.config import AppConfig
from deployments.compute.autoscaling import QUEUE_DEPTH_METRIC, QueueDepthPolicy, decide


def _decide(depths, *, queued=0.0, current=2, target=2, per=4.0, lo=1, hi=4):
    return decide(
        depths,
        queued_at_handles=queued,
        current_replicas=current,
        target_replicas=target,
        target_per_replica=per,
        min_replicas=lo,
        max_replicas=hi,
    )


@pytest.mark.parametrize(
    "depths, queued, current, target, expected",
    [
        ({"a": 4.0}, 0, 1, 1, 1),  # exactly at target: stay
        ({"a": 4.1}, 0, 1, 1, 2),  # just above: one more
        ({"a": 3.9999999999}, 0, 1, 1, 1),  # float noise under a multiple: no extra replica
        ({"a": 9.0, "b": 8.0}, 0, 2, 2, 4),  # 17 / 4 → 5, capped at max 4
        ({"a": 1.0, "b": 2.0}, 0, 2, 2, 1),  # 3 / 4 → 1: scale down
        ({"a": 0.0, "b": 0.0}, 0, 2, 2, 1),  # idle: min
        ({"a": 2.0}, 3.0, 1, 1, 2),  # queued at handles counts: 5 / 4 → 2
        ({"a": 2.0, "b": -1.0}, 0, 2, 2, 1),  # a negative report counts as 0
    ],
)
def test_decide_exact(depths, queued, current, target, expected):
    assert _decide(depths, queued=queued, current=current, target=target).desired == expected


def test_decide_total_and_reason():
    d = _decide({"a": 6.0, "b": 5.0}, queued=1.0, target=2)
    assert (d.desired, d.total_queue_depth, d.reason) == (3, 12.0, "queue above target")
    d = _decide({"a": 1.0, "b": 0.5}, target=2)
    assert (d.desired, d.reason) == (1, "queue below target")
    assert _decide({"a": 5.0, "b": 3.0}, target=2).reason == "steady"


def test_decide_holds_without_reports_and_respects_bounds():
    # No replica has reported: hold Serve's current target, never scale on no data.
    assert _decide({}, target=3).desired == 3
    assert _decide(None, target=3).desired == 3
    # Held targets are still bounded.
    assert _decide({}, target=9, hi=4).desired == 4
    assert _decide({"a": 0.0}, lo=2, current=3, target=3).desired == 2
    # No running replica: hold (Serve's own cold-start path scales 0 → n).
    assert _decide({"a": 50.0}, current=0, target=1).desired == 1


def test_decide_rejects_bad_target():
    with pytest.raises(ValueError):
        _decide({"a": 1.0}, per=0)


def _ctx(depths, *, current, target, lo=1, hi=2, queued=0.0):
    return SimpleNamespace(
        deployment_name="ComputeWorker",
        app_name="llm",
        current_num_replicas=current,
        target_num_replicas=target,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
        total_queued_requests=queued,
        aggregated_metrics={QUEUE_DEPTH_METRIC: depths, "num_running": {}} if depths is not None else {},
    )


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_policy_object_decides_and_logs_edges():
    policy = QueueDepthPolicy(target_queue_depth_per_replica=3)
    serve_logger = logging.getLogger("ray.serve")
    records, level = _Records(), serve_logger.level
    serve_logger.addHandler(records)
    serve_logger.setLevel(logging.INFO)
    try:
        assert policy(_ctx({"r1": 8.0}, current=1, target=1)) == (2, {})
        assert policy(_ctx({"r1": 8.0}, current=1, target=1)) == (2, {})  # same wish: no 2nd line
        wants = [m for m in records.messages if "wants 2 replicas" in m]
        assert len(wants) == 1 and "queue depth 8.0" in wants[0]
        # Serve raised the target: one "scaled up" line.
        assert policy(_ctx({"r1": 4.0, "r2": 2.0}, current=2, target=2)) == (2, {})
        assert len([m for m in records.messages if "scaled up 1 -> 2" in m]) == 1
        # Idle: wants min; Serve lowers the target later: one "scaled down" line.
        assert policy(_ctx({"r1": 0.0, "r2": 0.0}, current=2, target=2)) == (1, {})
        assert policy(_ctx({"r1": 0.0}, current=1, target=1)) == (1, {})
        assert len([m for m in records.messages if "scaled down 2 -> 1" in m]) == 1
        # No custom metric at all (replicas not reporting yet): hold Serve's target (2).
        assert policy(_ctx(None, current=2, target=2)) == (2, {})
        # Five lines in all: wants 2, scaled up, wants 1, scaled down, scaled up (the
        # target went 1 -> 2 between the last two calls); none for repeated ticks.
        assert len(records.messages) == 5, records.messages
        assert "scaled up 1 -> 2" in records.messages[-1]
    finally:
        serve_logger.removeHandler(records)
        serve_logger.setLevel(level)


def test_policy_rejects_bad_target():
    with pytest.raises(ValueError):
        QueueDepthPolicy(target_queue_depth_per_replica=0)


def _args(**autoscaling):
    return {"compute": {"autoscaling": autoscaling}}


def test_config_validation():
    ok = AppConfig.model_validate(_args(enabled=True, min_replicas=1, max_replicas=2))
    assert ok.compute.autoscaling.max_replicas == 2
    with pytest.raises(ValidationError, match="min_replicas .3. must not exceed max_replicas .2."):
        AppConfig.model_validate(_args(min_replicas=3, max_replicas=2))
    with pytest.raises(ValidationError, match="look_back_period_s"):
        AppConfig.model_validate(_args(metrics_interval_s=5, look_back_period_s=5))
    for bad in (
        {"target_queue_depth_per_replica": 0},
        {"min_replicas": 0},
        {"upscale_delay_s": -1},
        {"downscale_delay_s": -1},
        {"bogus": 1},
    ):
        with pytest.raises(ValidationError, match="compute.autoscaling"):
            AppConfig.model_validate(_args(**bad))
    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s"):
        AppConfig.model_validate({"compute": {"graceful_shutdown_timeout_s": 0}})


def test_deployment_options_follow_config():
    from deployments.compute.deployment import drain_options, replica_count_options

    off = AppConfig.model_validate({"compute": {"num_replicas": 3}})
    assert replica_count_options(off) == {"num_replicas": 3}

    cfg = AppConfig.model_validate(
        {
            "compute": {
                "graceful_shutdown_wait_loop_s": 0.2,
                "graceful_shutdown_timeout_s": 45,
                "autoscaling": {
                    "enabled": True,
                    "min_replicas": 1,
                    "max_replicas": 3,
                    "target_queue_depth_per_replica": 5,
                    "upscale_delay_s": 2,
                    "downscale_delay_s": 7,
                    "metrics_interval_s": 0.5,
                    "look_back_period_s": 3,
                },
            }
        }
    )
    assert drain_options(cfg) == {"graceful_shutdown_wait_loop_s": 0.2, "graceful_shutdown_timeout_s": 45}
    opts = replica_count_options(cfg)
    assert set(opts) == {"autoscaling_config"}  # no num_replicas beside it
    auto = opts["autoscaling_config"]
    assert (auto.min_replicas, auto.max_replicas) == (1, 3)
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (2, 7)
    assert (auto.metrics_interval_s, auto.look_back_period_s) == (0.5, 3)
    assert auto.policy.policy_function == "deployments.compute.autoscaling:QueueDepthPolicy"
    assert auto.policy.policy_kwargs == {"target_queue_depth_per_replica": 5.0}
    # What the controller will run: the class Serve pickled, built with the kwargs.
    policy = auto.policy.get_policy()(**auto.policy.policy_kwargs)
    assert policy.target_per_replica == 5.0


def test_pickled_policy_loads_where_the_repo_is_not_importable(tmp_path):
    """Serve pickles the policy by value into its controller, which may not have this
    repository on its path: the policy must load and decide where importing the project's
    packages fails."""
    from ray.serve.config import AutoscalingPolicy

    blob = AutoscalingPolicy(policy_function="deployments.compute.autoscaling:QueueDepthPolicy")
    path = tmp_path / "policy.pkl"
    path.write_bytes(blob.get_serialized_policy_def())
    code = f"""
import sys, types
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('deployments', 'app', 'tests'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Blocker())
from ray import cloudpickle
cls = cloudpickle.loads(open({str(path)!r}, 'rb').read())
ctx = types.SimpleNamespace(deployment_name='w', app_name='a', current_num_replicas=1,
    target_num_replicas=1, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
    total_queued_requests=0.0, aggregated_metrics={{'queue_depth': {{'r': 9.0}}}})
print(cls(target_queue_depth_per_replica=4)(ctx)[0])
print(sorted(m for m in sys.modules if m.split('.')[0] in ('deployments', 'app')))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["3", "[]"]
