"""Every metric that deploy/ reads (the alert rules, the Grafana dashboard, the Prometheus adapter's rule
behind the HPA) is one a running server exports: names are taken from each PromQL expression and looked
up in the `# TYPE` lines of a real /metrics scrape (a labelled series with no samples yet still has its
TYPE line; histograms export _bucket, _count and _sum)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# Series Prometheus writes itself for every target, not the server.
PROMETHEUS_SERIES = {"up"}
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "by",
    "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
    "label_values", "topk", "bottomk", "abs", "clamp_min", "clamp_max", "time", "vector",
}  # fmt: skip
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expression: str) -> set[str]:
    """The metric names in a PromQL expression: strings, label matchers, ranges, grouping clauses,
    function names and keywords removed."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expression)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)
    text = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?[a-z]*", " ", text)  # numbers and durations (offset 5m)
    names = set()
    for match in IDENTIFIER.finditer(text):
        word, rest = match.group(), text[match.end() :].lstrip()
        if word in PROMQL_WORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def deploy_expressions() -> dict[str, str]:
    """Every PromQL expression under deploy/, keyed by where it is."""
    found = {}
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            found[f"alerts.yaml {rule['alert']}"] = rule["expr"]
    dashboard = json.loads((DEPLOY / "grafana" / "bitserve.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found[f"bitserve.json {panel['title']} {target['refId']}"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(SERIES, LABEL): SERIES is the expression
            series = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
            assert series is not None, variable["definition"]
            found[f"bitserve.json ${variable['name']}"] = series.group(1)
    adapter = yaml.safe_load((DEPLOY / "kubernetes" / "prometheus-adapter" / "values.yaml").read_text())
    for index, rule in enumerate(adapter["rules"]["custom"]):
        found[f"prometheus-adapter rule {index}"] = rule["seriesQuery"]
    return found


def exported_names(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = ("_bucket", "_count", "_sum") if kind == "histogram" else ("",)
            names |= {name + suffix for suffix in suffixes}
    return names


@pytest.fixture(scope="module")
def scraped(client: TestClient) -> set[str]:
    body = {"prompt": "one two", "max_tokens": 3, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200
    return exported_names(response.text)


def test_metric_name_extraction() -> None:
    expression = (
        'histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{x="y(z)"}[5m]))) > 10 '
        "unless on (pod) b / ignoring (q) c_total offset 5m and up{job=~'.*'} == 0"
    )
    assert metric_names(expression) == {"a_bucket", "b", "c_total", "up"}
    assert metric_names('bitserve_model_info{namespace=~"$namespace"}') == {"bitserve_model_info"}


def test_every_deploy_expression_names_exported_metrics(scraped: set[str]) -> None:
    expressions = deploy_expressions()
    assert len(expressions) > 30
    unknown = {
        where: sorted(metric_names(expr) - scraped - PROMETHEUS_SERIES)
        for where, expr in expressions.items()
        if metric_names(expr) - scraped - PROMETHEUS_SERIES
    }
    assert not unknown, unknown
    used = set().union(*(metric_names(expr) for expr in expressions.values()))
    # the series the issue asks the operator to see are all on the dashboard or in an alert
    for name in (
        "bitserve_time_to_first_token_seconds_bucket",
        "bitserve_inter_token_latency_seconds_bucket",
        "bitserve_request_queue_seconds_bucket",
        "bitserve_num_requests_waiting",
        "bitserve_kv_cache_usage_ratio",
        "process_resident_memory_bytes",
        "bitserve_model_swaps_total",
    ):
        assert name in used, name


def test_vllm_aliases_are_exported(scraped: set[str]) -> None:
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc"} <= scraped


def test_a_served_request_observes_its_queue_time(client: TestClient) -> None:
    def queue_count() -> float:
        lines = client.get("/metrics").text.splitlines()
        counts = [
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("bitserve_request_queue_seconds_count")
        ]
        return sum(counts)

    before = queue_count()
    body = {"prompt": "one two", "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert queue_count() == before + 1


def test_per_replica_series_carry_the_quant_format(client: TestClient) -> None:
    running = [
        line
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("bitserve_requests_total{")
    ]
    assert running and all('quant_format="TQ2_0"' in line for line in running)  # the synthetic model's format


def test_energy_is_exported_where_readable_and_health_says_why_not(client: TestClient) -> None:
    status = client.get("/health").json()["components"]["energy"]
    samples = [
        line for line in client.get("/metrics").text.splitlines() if line.startswith("bitserve_energy_joules")
    ]
    if status["cpu"].startswith("ok"):
        assert any(line.startswith('bitserve_energy_joules_total{device="cpu"}') for line in samples)
    else:  # e.g. a VM without /sys/class/powercap: no sample, and the reason in /health
        assert not any('device="cpu"' in line for line in samples) and status["cpu"]
