"""The Prometheus alert rules pass `promtool check rules` and their unit tests (`promtool test rules`:
each alert fires on a synthetic failure, stays quiet on a healthy series), cover what the issue asks
alerts for, and the Grafana dashboard is well formed. That every metric they name is exported is
tests/server/test_monitoring_names.py (it scrapes a running server)."""

from __future__ import annotations

import json

import yaml
from deploy_testing import DEPLOY, require_tool, run_tool

PROMETHEUS = DEPLOY / "prometheus"
REQUIRED_ALERTS = {
    "BitserveTTFTp99High",  # SLA breach on latency
    "BitserveRequestLatencyp99High",
    "BitserveHighErrorRate",
    "BitserveQueueSaturated",
    "BitserveEngineStalled",
    "BitserveKVCacheExhausted",
    "BitserveMemoryNearLimit",
    "BitserveModelRolledBack",
}


def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool", "Debian's prometheus package: .ci/run installs it")
    result = run_tool(promtool, "check", "rules", str(PROMETHEUS / "alerts.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules() -> None:
    promtool = require_tool("promtool", "Debian's prometheus package: .ci/run installs it")
    result = run_tool(promtool, "test", "rules", "alerts.test.yaml", cwd=PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_the_failure_modes() -> None:
    rules = [rule for group in yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())["groups"]
             for rule in group["rules"]]  # fmt: skip
    names = {rule["alert"] for rule in rules}
    assert REQUIRED_ALERTS <= names
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    tested = (PROMETHEUS / "alerts.test.yaml").read_text()
    untested = {name for name in REQUIRED_ALERTS if f"alertname: {name}" not in tested}
    assert not untested, untested


def test_grafana_dashboard_is_well_formed() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "bitserve.json").read_text())
    assert dashboard["uid"] and dashboard["title"] == "bitserve"
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    graphs = [panel for panel in panels if panel["type"] != "row"]
    assert len(graphs) >= 15
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(target["expr"] for target in panel["targets"]), panel["title"]
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
