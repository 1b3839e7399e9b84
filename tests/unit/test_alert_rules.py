"""The chart's alert rules and dashboard, offline: `promtool check rules`; each rule's
expression on synthetic series (`promtool test rules`: who it fires for, and who not);
every metric they name is one a worker or the gateway exports; every dashboard panel
has a query. tests/integration/test_alerts.py runs them against a live Prometheus."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from worker.metrics import WorkerMetrics

FILES = Path(__file__).resolve().parents[2] / "infra" / "helm" / "sluice" / "files"
ALERTS = FILES / "alerts.yaml"
DASHBOARD = FILES / "dashboard.json"
# Metrics Prometheus makes itself, not an exporter.
PROMETHEUS_OWN = {"up"}


def rules() -> dict[str, dict[str, Any]]:
    (group,) = yaml.safe_load(ALERTS.read_text())["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry's families can have, children made or not."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    return {family.name + suffix for family in registry.collect()
            for suffix in suffixes.get(family.type, ("",))}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:sluice_[a-z_]+|up)\b(?=\s*[{\[)])", expr)) | set(
        re.findall(r"\bsluice_[a-z_]+\b", expr))


def test_promtool_checks_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (infra/system-deps.sh installs it)")
    proc = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_every_rule_waits_has_a_severity_and_says_what_to_do() -> None:
    assert set(rules()) == {"SluiceWorkerDown", "SluiceConsumerLagGrowing",
                            "SluiceTTFTOverMaxTTFT", "SluiceDeadLetters"}
    for name, rule in rules().items():
        assert re.fullmatch(r"[1-9][0-9]*m", rule["for"]), name  # real waits, in minutes
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_rules_and_panels_name_only_exported_metrics() -> None:
    exported = (exported_names(WorkerMetrics("m", "p").registry)
                | exported_names(GatewayMetrics().registry) | PROMETHEUS_OWN)
    named = set().union(*(metric_names(r["expr"]) for r in rules().values()),
                        *(metric_names(e) for e in dashboard_exprs()))
    assert named, "no metric names found"
    assert named <= exported, f"not exported by anyone: {sorted(named - exported)}"


def test_every_panel_has_queries_on_the_datasource_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 39
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "model"} <= variables
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        targets = panel["targets"]
        assert targets and all(t["expr"].strip() for t in targets), panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:  # only variables the dashboard defines, or Grafana's own
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= variables | {"__rate_interval"}, (panel["title"], used)


# Each rule's expression on synthetic series, one sample a minute: (series, values)
# in promtool's notation, then {minute of evaluation: labels of the firing series}.
CASES: dict[str, tuple[dict[str, str], dict[int, set[str]]]] = {
    "SluiceWorkerDown": (
        {'up{job="sluice-worker",instance="w1"}': "1 1 0 0 0",
         'up{job="sluice-worker",instance="w2"}': "1 1 1 1 1",
         'up{job="other",instance="w3"}': "0 0 0 0 0"},
        {1: set(), 3: {'{instance="w1"}'}}),
    "SluiceConsumerLagGrowing": (
        {# growing past 100: fires; growing below it, or high and flat: not
         'sluice_consumer_lag{model="busy",partition="0"}': "0+20x10",
         'sluice_consumer_lag{model="small",partition="0"}': "0+5x10",
         'sluice_consumer_lag{model="steady",partition="0"}': "150x10",
         # the model's partitions summed: 2 x 60
         'sluice_consumer_lag{model="two",partition="0"}': "0+6x10",
         'sluice_consumer_lag{model="two",partition="1"}': "0+6x10"},
        {4: set(), 10: {'{model="busy"}', '{model="two"}'}}),
    "SluiceTTFTOverMaxTTFT": (
        {# 2% timed out: fires; 0.5%: not; errors are not in the ratio; no traffic: not
         'sluice_request_timeouts_total{model="late"}': "0+1x10",
         'sluice_requests_total{model="late",type="done"}': "0+49x10",
         'sluice_requests_total{model="late",type="timeout"}': "0+1x10",
         'sluice_request_timeouts_total{model="ok"}': "0+1x10",
         'sluice_requests_total{model="ok",type="done"}': "0+199x10",
         'sluice_requests_total{model="ok",type="timeout"}': "0+1x10",
         'sluice_requests_total{model="ok",type="error"}': "0+1000x10",
         'sluice_request_timeouts_total{model="idle"}': "0x10",
         'sluice_requests_total{model="idle",type="done"}': "0x10",
         'sluice_requests_total{model="idle",type="timeout"}': "0x10"},
        {10: {'{model="late"}'}}),
    "SluiceDeadLetters": (
        {'sluice_dead_lettered_records_total{model="bad"}': "0 0 0 0 0 0 0 0 1 1 1",
         'sluice_dead_lettered_records_total{model="old"}': "0 1 1 1 1 1 1 1 1 1 1",
         'sluice_dead_lettered_records_total{model="good"}': "0x10"},
        {5: {'{model="old"}'}, 10: {'{model="bad"}'}}),
}


@pytest.mark.parametrize("alert", sorted(CASES))
def test_rule_fires_for_its_fault_only(alert: str, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (infra/system-deps.sh installs it)")
    series, expected = CASES[alert]
    expr = rules()[alert]["expr"]
    # `count by` of the rule's own expression: one exact 1 per series it fires for
    # (promtool compares values exactly, and ratios are not).
    by = "instance" if alert == "SluiceWorkerDown" else "model"
    test = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "promql_expr_test": [{
            "expr": f"count by ({by}) ({expr})", "eval_time": f"{minute}m",
            "exp_samples": [{"labels": labels, "value": 1} for labels in sorted(firing)]}
            for minute, firing in expected.items()],
    }]}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
