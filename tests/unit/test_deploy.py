"""Deployment files are checked like code: Prometheus config and alert rules with promtool (its rule
unit tests included), the Grafana dashboard's shape. (`make install` installs promtool, as it installs
redis-server.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make install` installs it (Debian package prometheus)"
    return subprocess.run(
        [promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=120, check=False
    )


def test_prometheus_config_and_rules_are_valid() -> None:
    done = _promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8 rules found" in done.stdout


def test_alert_rules_pass_their_unit_tests() -> None:
    done = _promtool("test", "rules", "mrc-alerts.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_test() -> None:
    rules = (DEPLOY / "prometheus" / "mrc-alerts.yml").read_text()
    tests = (DEPLOY / "prometheus" / "mrc-alerts.test.yml").read_text()
    alerts = re.findall(r"- alert: (\w+)", rules)
    assert len(alerts) == 8
    for alert in alerts:
        assert f"alertname: {alert}" in tests, alert


def dashboard_metrics() -> set[str]:
    """The mrc_ metric families the dashboard queries (histogram suffixes removed)."""
    dashboard = json.loads((DEPLOY / "grafana" / "mrc-dashboard.json").read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bmrc_[a-z0-9_]+", target["expr"]):
                names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def test_the_dashboard_has_the_shape_grafana_imports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "mrc-dashboard.json").read_text())
    assert {"title", "uid", "panels", "schemaVersion", "templating"} <= set(dashboard)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["type"] in {"timeseries", "heatmap", "stat", "table"}
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for topic in ("latency", "stage", "batch", "Queue", "busy", "GPU memory", "NVML", "Outcomes"):
        assert topic.lower() in titles.lower(), topic
    assert len(dashboard_metrics()) >= 20


@pytest.mark.parametrize("name", ["mrc_job_latency_seconds", "mrc_queue_depth", "mrc_model_busy_ratio"])
def test_the_dashboard_queries_the_key_series(name: str) -> None:
    assert name in dashboard_metrics()
