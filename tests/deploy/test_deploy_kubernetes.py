"""Every Kustomize overlay renders (kubectl's embedded kustomize), validates against the Kubernetes
OpenAPI schemas with `kubernetes-validate --strict`, passes checkov with only the named skips, and keeps
the invariants the server relies on: probes on the real routes, a grace period longer than the drain,
hardened security contexts, memory sized from the measured RSS, GPUs in the gpu overlay, auth from a
Secret, and an HPA on the queue-depth metric the Prometheus adapter serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from deploy_testing import DEPLOY, OVERLAYS, render_overlay, require_tool, run_tool

KUBERNETES_VERSION = "1.30.0"  # the oldest minor the manifests promise (HPA v2, PDB policy/v1)
MIB = 1024 * 1024
# Peak serving RSS from benchmarks/RESULTS.md: SmolLM2 (the image's default model; "Deploy sizing") and
# the 2B-4T I2_S model that the prod and gpu overlays mount (8 streams).
MEASURED_PEAK_RSS_MB = {"dev": 1479, "staging": 1479, "prod": 1920, "gpu": 1920}
# checkov checks skipped, each with its reason beside it: a checkov.io/skip annotation in a manifest, a
# checkov:skip comment in a Dockerfile (CKV_DOCKER_7: its FROM is a build argument checkov cannot resolve).
ALLOWED_CHECKOV_SKIPS = {"CKV_K8S_43", "CKV_DOCKER_7"}
SERVER_KINDS = {"ServiceAccount", "Deployment", "Service", "PodDisruptionBudget"}
SERVER_KINDS |= {"HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: list(yaml.safe_load_all(render_overlay(overlay))) for overlay in OVERLAYS}


def _one(objects: list[dict], kind: str) -> dict:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


def _quantity_bytes(value: str) -> int:
    units = {"Ki": 1024, "Mi": MIB, "Gi": 1024 * MIB}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return int(float(value[: -len(suffix)]) * factor)
    return int(value)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str, tmp_path: Path, rendered: dict[str, list[dict]]) -> None:
    validate = require_tool("kubernetes-validate", "pip install kubernetes-validate: the test extra")
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(render_overlay(overlay))
    result = run_tool(validate, "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    # the one object without a built-in schema is the Prometheus Operator's CRD, checked below
    unvalidated = [line for line in result.stdout.splitlines() if "Couldn't find schema" in line]
    assert all("kind ServiceMonitor " in line for line in unvalidated), unvalidated
    kinds = {obj["kind"] for obj in rendered[overlay]}
    assert SERVER_KINDS <= kinds
    assert all(obj["metadata"].get("namespace", "default") != "default" for obj in rendered[overlay])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_invariants(overlay: str, rendered: dict[str, list[dict]]) -> None:
    pod = _one(rendered[overlay], "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert container["startupProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # covers a 2B model's load
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain_s = float(env["BITSERVE_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > drain_s + float(pre_stop[1])
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
    assert security["seccompProfile"]["type"] == pod["securityContext"]["seccompProfile"]["type"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert {mount["mountPath"] for mount in container["volumeMounts"]} >= {"/tmp", "/etc/bitserve/auth"}
    resources = container["resources"]
    request = _quantity_bytes(resources["requests"]["memory"])
    assert request >= MEASURED_PEAK_RSS_MB[overlay] * 1e6
    assert _quantity_bytes(resources["limits"]["memory"]) > request
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"]
    secrets = {vol["secret"]["secretName"] for vol in pod["volumes"] if "secret" in vol}
    assert "bitserve-auth" in secrets and container["args"][:1] == ["--auth-file"]
    assert container["args"][1].startswith("/etc/bitserve/auth/")
    gpus = resources["limits"].get("nvidia.com/gpu")
    if overlay == "gpu":
        assert gpus == "1" and env["BITSERVE_DEVICE"] == "cuda" and "bitserve-cuda" in container["image"]
    else:
        assert gpus is None and "cuda" not in container["image"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_and_autoscaling(overlay: str, rendered: dict[str, list[dict]]) -> None:
    objects = rendered[overlay]
    deployment = _one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = _one(objects, "Service")
    for selector in (
        service["spec"]["selector"],
        deployment["spec"]["selector"]["matchLabels"],
        _one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        _one(objects, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()
    monitor = _one(objects, "ServiceMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {port["name"] for port in service["spec"]["ports"]}
    assert all(endpoint["port"] in port_names for endpoint in monitor["endpoints"])
    assert all(endpoint["path"] == "/metrics" for endpoint in monitor["endpoints"])
    hpa = _one(objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["maxReplicas"]
    metrics = {metric["type"]: metric for metric in hpa["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == adapter_metric_name()
    assert metrics["Resource"]["resource"]["name"] == "cpu"


def adapter_metric_name() -> str:
    """The custom metric the Prometheus adapter's rule publishes (the HPA must ask for that name)."""
    values = yaml.safe_load((DEPLOY / "kubernetes" / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    return rule["name"]["as"]


def test_checkov(tmp_path: Path) -> None:
    """checkov over every rendered overlay and both Dockerfiles: no failed check, and only the skips
    named in ALLOWED_CHECKOV_SKIPS (each with its reason in the manifest)."""
    checkov = require_tool("checkov", "installed into its own venv by .ci/run", env_var="CHECKOV_BIN")
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(render_overlay(overlay))
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        shutil.copy(DEPLOY / "docker" / dockerfile, tmp_path / dockerfile)
    options = ("--framework", "kubernetes", "dockerfile", "--skip-download", "-o", "json")
    result = run_tool(checkov, "-d", str(tmp_path), *options, timeout_s=300)
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {report["check_type"] for report in reports} == {"kubernetes", "dockerfile"}
    for report in reports:
        assert report["summary"]["failed"] == 0, report["results"].get("failed_checks")
        assert report["summary"]["parsing_errors"] == 0
        skipped = report["results"].get("skipped_checks", [])
        assert {check["check_id"] for check in skipped} <= ALLOWED_CHECKOV_SKIPS
        assert all(check["check_result"].get("suppress_comment") for check in skipped)
    assert result.returncode == 0, result.stderr[-2000:]
