"""Prometheus text for GET /metrics: the metrics of every node's Ray metrics agent, merged.

Replicas record metrics with ``ray.util.metrics``; each node's metrics agent exports them
(what a Prometheus server scrapes in production). The ingress fetches every alive node's
export and merges samples per metric family, so one scrape of the serving port shows the
whole cluster.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("ray.serve")


def merge_exposition(texts: list[str]) -> str:
    """Merge Prometheus text expositions, keeping each family's samples together."""
    families: dict[str, Metric] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                families[fam.name] = fam
            else:
                merged.samples.extend(fam.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(sorted(families.values(), key=lambda f: f.name)))
    return generate_latest(registry).decode()


class _Static:
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self):
        return iter(self._families)


def _agent_urls() -> list[str]:
    urls = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            urls.append(f"http://{node['NodeManagerAddress']}:{port}/metrics")
    return urls


# A node's agent renders every Ray metric of the node (MBs with many replicas); on a busy
# node that took longer than 5 s, and /metrics came back without the agent's samples.
AGENT_TIMEOUT_S = 20.0


async def collect_cluster_metrics(timeout_s: float = AGENT_TIMEOUT_S) -> str:
    urls = await asyncio.to_thread(_agent_urls)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        results = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    texts = []
    for url, res in zip(urls, results):
        if isinstance(res, Exception) or res.status_code != 200:
            logger.warning("metrics agent %s did not answer: %s", url, res)
            continue
        texts.append(res.text)
    try:
        return merge_exposition(texts)
    except Exception:  # noqa: BLE001 - a scrape must not fail because one family does not parse
        logger.warning("metrics: merging the agents' exports failed; returning them as they are", exc_info=True)
        return "\n".join(texts)
