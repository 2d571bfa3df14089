"""``telemetry.access_log``: which replicas keep Ray Serve's access-log line per call.

The filter is checked on a real logger with a real handler; that the app's replicas
apply it is checked against a running app's replica logs in
``tests/integration/test_sessions_api.py``."""

from __future__ import annotations

import logging

import pytest

from app import telemetry
from app.config import AppConfig, TelemetryConfig


@pytest.mark.parametrize(
    "mode, deployment, kept",
    [
        ("ingress", "Ingress", True),
        ("ingress", "Server", True),
        ("ingress", "DataPlane", False),
        ("ingress", "ComputeWorker", False),
        ("ingress", None, True),  # not in a Serve replica: nothing to drop
        ("all", "DataPlane", True),
        ("all", "ComputeWorker", True),
        ("none", "Ingress", False),
        ("none", "Server", False),
    ],
)
def test_which_replicas_keep_the_access_log(mode, deployment, kept):
    assert telemetry.access_log_wanted(mode, deployment) is kept


def test_the_default_keeps_it_at_the_ingress_only():
    assert AppConfig().telemetry.access_log == "ingress"


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="access_log"):
        TelemetryConfig(access_log="some")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def serve_logger(monkeypatch):
    """The ``ray.serve`` logger with a handler that keeps what reaches it; its filters and
    level restored afterwards."""
    import ray.serve  # noqa: F401 - its first import sets up this logger's handlers afresh

    logger = logging.getLogger("ray.serve")
    records = _Records()
    saved = (list(logger.filters), logger.level)
    logger.addHandler(records)
    yield logger, records
    logger.removeHandler(records)
    logger.filters[:] = saved[0]
    logger.setLevel(saved[1])


def _log_both(logger):
    # As Serve's replica logs its access line (ray/serve/_private/replica.py), and a line of ours.
    logger.info("CALL lookup_prefix OK 1.2ms", extra={"serve_access_log": True, "skip_context_filter": True})
    logger.info("kv lookup start: request=r1")


def test_setup_drops_only_access_lines_where_not_wanted(serve_logger, monkeypatch):
    logger, records = serve_logger
    monkeypatch.setattr(telemetry, "_replica_deployment", lambda: "DataPlane")
    telemetry.setup(TelemetryConfig(access_log="ingress"), "dataplane")
    _log_both(logger)
    assert records.messages == ["kv lookup start: request=r1"]
    # Set up again (another component in the same process): still one filter.
    telemetry.setup(TelemetryConfig(access_log="ingress"), "dataplane")
    assert logger.filters.count(telemetry._NO_ACCESS_LOG) == 1


def test_setup_keeps_access_lines_where_wanted(serve_logger, monkeypatch):
    logger, records = serve_logger
    monkeypatch.setattr(telemetry, "_replica_deployment", lambda: "DataPlane")
    telemetry.setup(TelemetryConfig(access_log="all"), "dataplane")
    _log_both(logger)
    monkeypatch.setattr(telemetry, "_replica_deployment", lambda: "Ingress")
    telemetry.setup(TelemetryConfig(access_log="ingress"), "ingress")
    _log_both(logger)
    assert records.messages == ["CALL lookup_prefix OK 1.2ms", "kv lookup start: request=r1"] * 2


def test_outside_a_replica_nothing_is_dropped(serve_logger):
    logger, records = serve_logger
    telemetry.setup(TelemetryConfig(), "script")
    _log_both(logger)
    assert records.messages == ["CALL lookup_prefix OK 1.2ms", "kv lookup start: request=r1"]
