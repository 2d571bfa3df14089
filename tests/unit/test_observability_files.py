"""The Grafana dashboard and the Prometheus alerts in cluster/observability/ against the
code: every metric they query is one the code defines (``ray.util.metrics`` Counter,
Gauge or Histogram named ``llm_*``, read from the source), under the name Ray's exporter
gives it (``ray_`` prefix; ``_total`` for a counter, ``_bucket``/``_sum``/``_count`` for a
histogram), and every label they group or match by is one of its tag keys."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OBSERVABILITY = REPO / "cluster" / "observability"
# Labels Ray's exporter adds to every series, and a histogram bucket's bound.
RAY_LABELS = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "le"}
SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}


def defined_metrics() -> dict[str, tuple[str, frozenset]]:
    """``{name: (kind, tag keys)}`` of every llm_* metric made in app/ and deployments/."""
    found: dict[str, tuple[str, frozenset]] = {}
    for path in [*REPO.glob("app/**/*.py"), *REPO.glob("deployments/**/*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                continue
            tuples = {  # local names bound to a tuple of strings (``tags = ("engine",)``)
                t.id: node.value for node in ast.walk(fn) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.Tuple)
            }
            for call in ast.walk(fn):
                if not isinstance(call, ast.Call):
                    continue
                kind = getattr(call.func, "attr", None) or getattr(call.func, "id", None)
                if kind not in SUFFIXES or not call.args or not isinstance(call.args[0], ast.Constant):
                    continue
                name = call.args[0].value
                if not (isinstance(name, str) and name.startswith("llm_")):
                    continue
                keys = next((k.value for k in call.keywords if k.arg == "tag_keys"), None)
                if isinstance(keys, ast.Name):
                    keys = tuples.get(keys.id)
                tags = frozenset(e.value for e in keys.elts) if isinstance(keys, ast.Tuple) else frozenset()
                found[name] = (kind, tags)
    return found


DEFINED = defined_metrics()
EXPORTED = {f"ray_{name}{suffix}": name for name, (kind, _) in DEFINED.items() for suffix in SUFFIXES[kind]}


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]
    exprs.append(("tenant variable", next(v["query"] for v in dash["templating"]["list"] if v["name"] == "tenant")))
    return exprs


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())["groups"] for r in g["rules"]]


def check_expr(where: str, expr: str) -> None:
    series = set(re.findall(r"\bray_llm_[a-z0-9_]+", expr))
    assert series, f"{where}: queries none of the llm_* metrics"
    for s in series:
        assert s in EXPORTED, f"{where}: {s} is not a metric the code exports (defined: {sorted(DEFINED)})"
    tags = set().union(*(DEFINED[EXPORTED[s]][1] for s in series)) | RAY_LABELS
    used = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    used |= set(re.findall(r"[{,]\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", expr))
    used |= set(re.findall(r"label_values\([^,]+,\s*([A-Za-z_]+)\)", expr))
    assert used <= tags, f"{where}: labels {sorted(used - tags)} are not tag keys of {sorted(series)}"
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), where


def test_the_code_defines_the_metrics_these_files_rely_on():
    # The scan itself: a few metrics of each kind with their tag keys, as the code has them.
    assert DEFINED["llm_requests"] == ("Counter", frozenset({"endpoint", "status"}))
    assert DEFINED["llm_ttft_seconds"] == ("Histogram", frozenset({"endpoint"}))
    assert DEFINED["llm_engine_kv_usage_ratio"] == ("Gauge", frozenset({"engine"}))
    assert DEFINED["llm_rate_limited"] == ("Counter", frozenset({"tenant", "limit"}))


@pytest.mark.parametrize("where, expr", dashboard_exprs(), ids=lambda v: v if len(v) < 60 else v[:60])
def test_every_dashboard_query_names_exported_metrics_and_their_labels(where, expr):
    check_expr(where, expr)


def test_the_dashboard_is_a_grafana_dashboard():
    dash = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]


def test_alert_rules_are_complete_and_name_exported_metrics():
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules) >= 5
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"page", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        check_expr(rule["alert"], rule["expr"])
