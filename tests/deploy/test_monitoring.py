"""The dashboard, alerts and autoscaler queries in deploy/ read metrics Sluice exports, and say the same.

Why: PromQL on a misspelled or renamed metric is no error, just an empty panel, a silent alert or an
autoscaler stuck at its minimum. Every expression is checked against promql.METRICS; the HPA's adapter
rule and the KEDA query must be the same query, so switching between them changes nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.deploy import schemas
from tests.deploy.promql import METRICS, metric_names, unknown_metrics
from tests.deploy.rendering import DEPLOY, Rendered

DASHBOARD = DEPLOY / "components" / "monitoring" / "dashboards" / "sluice.json"
ADAPTER_RULES = DEPLOY / "components" / "hpa" / "prometheus-adapter-rules.yaml"

# What the dashboard must show: panel content as the metrics it reads.
REQUIRED_PANELS = {
    "request rate by code": "sluice_router_requests_total",
    "latency p50/p99": "sluice_router_request_duration_seconds_bucket",
    "queue depth": "sluice_router_queue_depth",
    "batch size": "sluice_router_batch_size_sum",
    "worker busy ratio": "sluice_worker_busy_ratio",
    "desired workers": "sluice_autoscaler_desired_workers",
    "actual workers": "sluice_router_workers",
    "rejections by reason": "sluice_router_rejections_total",
}


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panel_exprs(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    return {
        panel["title"]: [target["expr"] for target in panel.get("targets", [])]
        for panel in dashboard["panels"]
        if panel["type"] != "row"
    }


def test_dashboard_reads_only_exported_metrics() -> None:
    dashboard = _dashboard()
    exprs = _panel_exprs(dashboard)
    bad = {title: sorted(unknown_metrics(e)) for title, es in exprs.items() for e in es if unknown_metrics(e)}
    assert bad == {}
    assert all(es for es in exprs.values()), "a panel without a query"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for variable in variables:
        selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
        assert selector and unknown_metrics(selector.group(1)) == set(), variable["name"]


def test_dashboard_has_the_required_panels() -> None:
    exprs = [e for es in _panel_exprs(_dashboard()).values() for e in es]
    read = set().union(*(metric_names(e) for e in exprs))
    missing = {panel for panel, metric in REQUIRED_PANELS.items() if metric not in read}
    assert missing == set()
    latency = [e for e in exprs if "sluice_router_request_duration_seconds_bucket" in e]
    assert any("histogram_quantile(0.5," in e for e in latency)
    assert any("histogram_quantile(0.99," in e for e in latency)
    assert any("by (code)" in e for e in exprs if "sluice_router_requests_total" in e)
    assert any("by (reason)" in e for e in exprs if "sluice_router_rejections_total" in e)


def test_dashboard_ships_in_a_configmap(overlays: dict[str, Rendered]) -> None:
    config_map = overlays["prod-gpu"].get("ConfigMap", "sluice-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["sluice.json"]) == _dashboard()


def test_metric_name_check_catches_mistakes() -> None:
    assert unknown_metrics("rate(sluice_router_request_total[5m])") == {"sluice_router_request_total"}
    assert unknown_metrics("sluice_router_batch_size") == {"sluice_router_batch_size"}  # a histogram
    assert unknown_metrics("sum(up) by (job)") == {"up"}
    expr = 'histogram_quantile(0.99, sum by (le) (rate(sluice_worker_execute_seconds_bucket{a="b{c}"}[5m])))'
    assert metric_names(expr) == {"sluice_worker_execute_seconds_bucket"}
    assert metric_names("x > 14.4 * 1e-3 and on (ns) y offset 5m") == {"x", "y"}


def _rules(overlays: dict[str, Rendered]) -> list[dict[str, Any]]:
    rule = overlays["prod-gpu"].get("PrometheusRule", "sluice")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_alert_rules_read_only_exported_metrics(overlays: dict[str, Rendered]) -> None:
    rules = _rules(overlays)
    recorded = frozenset(r["record"] for r in rules if "record" in r)
    bad = {r.get("alert", r.get("record")): unknown_metrics(r["expr"], recorded) for r in rules}
    assert {name: names for name, names in bad.items() if names} == {}


def test_alert_rules_cover_the_failure_modes(overlays: dict[str, Rendered]) -> None:
    alerts = {r["alert"]: r for r in _rules(overlays) if "alert" in r}
    recorded = {r["record"]: r["expr"] for r in _rules(overlays) if "record" in r}

    def reads(alert: dict[str, Any]) -> set[str]:
        names = metric_names(alert["expr"])
        return names.union(*(metric_names(recorded[n]) for n in names if n in recorded))

    # An SLO burn alert pages on the requests counter through the recorded error ratios.
    burn = [a for a in alerts.values() if "sluice_router_requests_total" in reads(a)]
    assert {a["labels"]["severity"] for a in burn} == {"critical", "warning"}
    for metric in ("sluice_router_rejections_total", "sluice_router_workers", "sluice_etcd_session_up"):
        assert any(metric in reads(a) for a in alerts.values()), f"no alert on {metric}"
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in {"critical", "warning"}, name
        assert alert["annotations"]["summary"] and "for" in alert, name


def _adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load(ADAPTER_RULES.read_text())
    rules: list[dict[str, Any]] = values["rules"]["external"]
    return rules


def test_hpa_metric_is_served_by_the_adapter_rule(overlays: dict[str, Rendered]) -> None:
    hpa = overlays["prod-gpu"].get("HorizontalPodAutoscaler", "sluice-worker")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["target"] == {
        "type": "AverageValue",
        "averageValue": "1",
    }
    served = {rule["name"]["as"]: rule for rule in _adapter_rules()}
    rule = served[metric["external"]["metric"]["name"]]
    assert metric_names(rule["seriesQuery"]) <= set(METRICS)
    assert (
        unknown_metrics(rule["metricsQuery"].replace("<<.Series>>", "sluice_autoscaler_desired_workers"))
        == set()
    )


def test_keda_runs_the_adapter_query(overlays: dict[str, Rendered]) -> None:
    """KEDA and the HPA scale on the same number: the KEDA query is the adapter's, for this namespace."""
    scaled = overlays["prod-gpu-keda"].get("ScaledObject", "sluice-worker")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    (rule,) = _adapter_rules()
    namespace = scaled["metadata"]["namespace"]
    expected = (
        rule["metricsQuery"]
        .replace("<<.Series>>", "sluice_autoscaler_desired_workers")
        .replace("<<.LabelMatchers>>", f'namespace="{namespace}"')
    )
    assert trigger["metadata"]["query"] == expected
    hpa = overlays["prod-gpu"].get("HorizontalPodAutoscaler", "sluice-worker")["spec"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (
        hpa["minReplicas"],
        hpa["maxReplicas"],
    )
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]


@pytest.mark.parametrize("field", ["scrapeInterval", "relabelings_"])
def test_crd_schemas_reject_unknown_fields(overlays: dict[str, Rendered], field: str) -> None:
    monitor = json.loads(json.dumps(overlays["prod-gpu"].get("ServiceMonitor", "sluice")))
    monitor["spec"]["endpoints"][0][field] = "15s"
    assert any(field in p for p in schemas.problems(monitor))
