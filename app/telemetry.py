"""Tracing and logging setup shared by every deployment.

Spans: ``ingress.request`` → ``router.queue`` / ``router.dispatch`` → ``worker.generate``;
the trace context travels inside :class:`GenerationRequest.trace_headers` across Serve hops.
Without ``telemetry.otlp_endpoint`` spans are recorded but exported nowhere (the SDK still
assigns ids, which appear in log lines); with it they go to an OTLP/HTTP collector.

Metrics use ``ray.util.metrics`` so every replica's figures are exported by its node's
metrics agent and scraped by Prometheus; the ingress serves the merged text at /metrics.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import threading
import time
from typing import Iterator, Optional

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from app.config import TelemetryConfig

_lock = threading.Lock()
_configured = False

# Latency buckets in seconds, from sub-millisecond router hops to multi-minute generations.
LATENCY_BUCKETS_S = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
]
TOKEN_LATENCY_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]


# The deployments whose replicas take clients' requests: their access log is kept under
# ``telemetry.access_log: ingress``.
FRONT_DEPLOYMENTS = frozenset({"Ingress", "Server"})


class _NoAccessLog(logging.Filter):
    """Drops Ray Serve's access-log records (``serve_access_log`` in their ``extra``) on the
    ``ray.serve`` logger, before they reach any handler. (Serve's own
    ``enable_access_log: false`` filters them in each of its handlers; set as a deployment
    option it would also keep an application's ``logging_config`` from applying to that
    deployment.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "serve_access_log", False)


_NO_ACCESS_LOG = _NoAccessLog()


def access_log_wanted(mode: str, deployment: Optional[str]) -> bool:
    """Whether a replica of ``deployment`` (None: not in a Serve replica) writes Serve's
    access log under ``telemetry.access_log`` ``mode``."""
    if mode == "all":
        return True
    if mode == "none":
        return False
    return deployment is None or deployment in FRONT_DEPLOYMENTS


def _replica_deployment() -> Optional[str]:
    try:
        from ray import serve

        return serve.get_replica_context().deployment
    except Exception:  # noqa: BLE001 - not in a Serve replica (a script, a test)
        return None


def setup(config: TelemetryConfig, service_name: str) -> None:
    """Configure logging level, Serve's access log and the tracer provider once per process."""
    global _configured
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.setLevel(config.log_level)
    if access_log_wanted(config.access_log, _replica_deployment()):
        serve_logger.removeFilter(_NO_ACCESS_LOG)
    else:
        serve_logger.addFilter(_NO_ACCESS_LOG)  # once: addFilter skips a filter already there
    with _lock:
        if _configured:
            return
        provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBasedTraceIdRatio(config.trace_sample_ratio),
        )
        if config.otlp_endpoint:
            # Imported only when configured: the exporter is an optional dependency.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint))
            )
        trace.set_tracer_provider(provider)
        _configured = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_context() -> dict[str, str]:
    """The current span's context as W3C headers, to carry across a Serve hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Optional[dict[str, str]]):
    return propagate.extract(headers or {})


def trace_id_hex() -> str:
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else "-"


@contextlib.contextmanager
def keep_log_handlers(*logger_names: str) -> Iterator[None]:
    """Undo, on exit, what the block did to the handlers of ``logger_names`` (default
    ``ray.serve``, the logger Serve writes a replica's log file through).

    ``logging.config.dictConfig`` closes every handler of the process, and vLLM calls it
    when it builds its engine (``configure_logging``): Serve's buffering handler then
    drops its target, and the replica's log file stopped after "Started initializing
    replica" (its lines still reached stderr). Here each handler removed comes back, and
    a buffering handler gets its target back (a closed file handler reopens on the next
    record)."""
    loggers = [logging.getLogger(n) for n in (logger_names or ("ray.serve",))]
    saved = [(lg, list(lg.handlers)) for lg in loggers]
    targets = [
        (h, h.target) for _, hs in saved for h in hs if isinstance(h, logging.handlers.MemoryHandler)
    ]
    try:
        yield
    finally:
        for lg, handlers in saved:
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
        for h, target in targets:
            if h.target is None and target is not None:
                h.setTarget(target)


class Every:
    """``due()`` is true at most once per ``interval_s`` (the first time at once): one log
    line for a flood of like events, which a metric counts one by one."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.last = float("-inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True
