"""The Helm chart cannot be rendered here (no helm binary from the registries this machine reaches), so:
every values file, merged over values.yaml the way Helm merges it, validates against the chart's
values.schema.json; the schema rejects unsafe values; every `.Values` path a template reads exists; and
each environment's values agree with the Kustomize overlay of the same name, the path validated end to
end."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from deploy_testing import DEPLOY, OVERLAYS, render_overlay

CHART = DEPLOY / "helm" / "bitserve"


def merged_values(environment: str | None) -> dict:
    """values.yaml with values-<environment>.yaml over it: maps merge key by key, anything else replaces."""

    def merge(base: dict, override: dict) -> dict:
        out = copy.deepcopy(base)
        for key, value in override.items():
            both_maps = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merge(out[key], value) if both_maps else copy.deepcopy(value)
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if environment is None:
        return values
    return merge(values, yaml.safe_load((CHART / f"values-{environment}.yaml").read_text()))


def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("environment", [None, *OVERLAYS])
def test_values_match_schema(environment: str | None) -> None:
    values = merged_values(environment)
    errors = [f"{list(error.path)}: {error.message}" for error in validator().iter_errors(values)]
    assert not errors
    server = values["server"]
    assert server["terminationGracePeriodSeconds"] > server["drainTimeoutS"] + server["preStopSleepS"]
    scaling = values["autoscaling"]
    assert scaling["minReplicas"] <= values["replicaCount"] <= scaling["maxReplicas"]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("podSecurityContext", "runAsUser"), 0),
        (("image", "tag"), "latest"),
        (("image", "digest"), "sha256:not-a-digest"),
        (("server", "device"), "tpu"),
        (("resources", "limits", "memory"), "lots"),
        (("autoscaling", "cpuFallbackUtilization"), 150),
        (("unknownKey",), True),
    ],
)
def test_schema_rejects(path: tuple[str, ...], value: object) -> None:
    values = merged_values("prod")
    target = values
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert list(validator().iter_errors(values)), f"{path} = {value!r} passed the schema"


def test_templates_read_only_defined_values() -> None:
    defaults = merged_values(None)
    for template in sorted((CHART / "templates").glob("*")):
        for path in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()):
            node = defaults
            for key in path.split("."):
                assert isinstance(node, dict) and key in node, f"{template.name}: .Values.{path} undefined"
                node = node[key]


def _env(container: dict) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container["env"]}


@pytest.mark.parametrize("environment", OVERLAYS)
def test_values_agree_with_kustomize(environment: str) -> None:
    values = merged_values(environment)
    objects = list(yaml.safe_load_all(render_overlay(environment)))
    (deployment,) = [obj for obj in objects if obj["kind"] == "Deployment"]
    (hpa,) = [obj for obj in objects if obj["kind"] == "HorizontalPodAutoscaler"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _env(container)
    assert deployment["spec"]["replicas"] == values["replicaCount"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        values["autoscaling"]["minReplicas"],
        values["autoscaling"]["maxReplicas"],
    )
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == values["autoscaling"]["queueDepthMetric"]
    assert pod["terminationGracePeriodSeconds"] == values["server"]["terminationGracePeriodSeconds"]
    assert float(env["BITSERVE_DRAIN_TIMEOUT_S"]) == values["server"]["drainTimeoutS"]
    assert env.get("BITSERVE_MODEL", "") == values["server"]["model"]
    assert env.get("BITSERVE_DEVICE", "") == values["server"]["device"]
    assert container["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    for kind in ("requests", "limits"):
        expected = dict(values["resources"][kind])
        if values["gpu"]["count"]:
            expected["nvidia.com/gpu"] = str(values["gpu"]["count"])
        assert container["resources"][kind] == expected, kind
    assert pod.get("nodeSelector", {}) == values["nodeSelector"]
    assert pod.get("tolerations", []) == values["tolerations"]
    has_models = any(mount["mountPath"] == "/models" for mount in container["volumeMounts"])
    assert has_models == values["models"]["persistentVolumeClaim"]["enabled"]


def test_chart_files_present() -> None:
    names = {path.name for path in Path(CHART).iterdir()}
    assert {"Chart.yaml", "values.yaml", "values.schema.json"} <= names
    assert {f"values-{environment}.yaml" for environment in OVERLAYS} <= names
