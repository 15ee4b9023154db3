"""deploy/kubernetes as `kubectl kustomize` renders it: every Kubernetes object valid against the
published schemas (kubernetes-validate, strict: no unknown field), every GIE object against the
fields of GIE's CRDs, and the objects consistent with each other and with the config.json they
ship. The rendered config served for real: tests/integration/test_kubernetes_config.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from server.settings.loader import load_settings
from tests.kube import (
    Manifest,
    config_json,
    container,
    one,
    port_number,
    rendered,
)

KUBERNETES = "1.33.0"
GIE_CRDS = "inference.networking.k8s.io/v1", "inference.networking.x-k8s.io/v1alpha2"

# The fields of GIE's CRDs (kubernetes-sigs/gateway-api-inference-extension v1.5.0, commit
# df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849: config/crd/bases/
# inference.networking.k8s.io_inferencepools.yaml, inference.networking.x-k8s.io_
# inferenceobjectives.yaml, inference.networking.x-k8s.io_inferencemodelrewrites.yaml), written
# out as a schema here with unknown fields refused (the API server would prune them silently).
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
POOL_REF = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {"group": {"type": "string", "maxLength": 253},
                   "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                   "name": NAME},
}


def _object(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "spec"],
        "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                       "metadata": {"type": "object"}, "spec": spec},
    }


GIE_SCHEMAS: dict[str, dict[str, Any]] = {
    "InferencePool": _object({
        "type": "object", "additionalProperties": False,
        "required": ["endpointPickerRef", "selector", "targetPorts"],
        "properties": {
            "selector": {
                "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                "properties": {"matchLabels": {
                    "type": "object", "minProperties": 1, "maxProperties": 64,
                    "additionalProperties": {"type": "string", "maxLength": 63},
                }},
            },
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {
                    "group": {"type": "string", "maxLength": 253},
                    "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                    "name": NAME, "port": PORT,
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
            },
        },
    }),
    "InferenceObjective": _object({
        "type": "object", "additionalProperties": False, "required": ["poolRef"],
        "properties": {"poolRef": POOL_REF, "priority": {"type": "integer"}},
    }),
    "InferenceModelRewrite": _object({
        "type": "object", "additionalProperties": False, "required": ["poolRef", "rules"],
        "properties": {"poolRef": POOL_REF, "rules": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "matches": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["model"],
                    "properties": {"model": {
                        "type": "object", "additionalProperties": False, "required": ["value"],
                        "properties": {"type": {"enum": ["Exact"]},
                                       "value": {"type": "string", "minLength": 1}},
                    }},
                }},
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "required": ["modelRewrite"],
                    "properties": {"modelRewrite": {"type": "string"},
                                   "weight": {"type": "integer", "minimum": 1,
                                              "maximum": 1_000_000}},
                }},
            },
        }}},
    }),
}


def kubernetes_objects() -> list[Manifest]:
    return [m for m in rendered() if m["apiVersion"] not in GIE_CRDS]


def test_every_kubernetes_object_is_valid_against_the_published_schemas() -> None:
    kinds = sorted(m["kind"] for m in kubernetes_objects())
    assert kinds == [
        "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
        "Service", "Service", "Service", "Service",
    ]
    for manifest in kubernetes_objects():
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)


def test_every_gie_object_has_only_the_fields_of_gies_crds() -> None:
    gie = [m for m in rendered() if m["apiVersion"] in GIE_CRDS]
    assert sorted(m["kind"] for m in gie) == [
        "InferenceModelRewrite", "InferenceObjective", "InferenceObjective", "InferencePool",
    ]
    for manifest in gie:
        jsonschema.Draft7Validator(GIE_SCHEMAS[manifest["kind"]]).validate(manifest)


def test_the_field_list_refuses_what_the_crds_refuse() -> None:
    pool = one("InferencePool")
    wrong = {**pool, "spec": {**pool["spec"], "targetPortz": pool["spec"]["targetPorts"]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, GIE_SCHEMAS["InferencePool"])
    no_picker = {**pool, "spec": {k: v for k, v in pool["spec"].items()
                                  if k != "endpointPickerRef"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(no_picker, GIE_SCHEMAS["InferencePool"])


def test_the_shipped_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    import json

    path.write_text(json.dumps(config_json()))
    settings = load_settings(config_path=path, environ={}).settings
    assert settings.server.data.tls.enabled is False  # probes and the inference gateway
    assert settings.server.metrics.tls.enabled is False  # Prometheus, the endpoint picker
    assert settings.server.management.tls.enabled is True  # the control plane: mutual TLS


def test_pods_select_and_ports_match_the_config() -> None:
    config = config_json()["ServerConfig"]
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    gateway = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"data": config["port"], "management": config["managementPort"],
                     "metrics": config["metricsPort"], "grpc": config["grpcPort"]}
    for service in (m for m in rendered() if m["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
    assert {s["spec"]["ports"][0]["targetPort"]
            for s in rendered() if s["kind"] == "Service"} == set(ports)
    pool = one("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": config["port"]}]
    assert one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = one("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    for objective in (m for m in rendered() if "poolRef" in m.get("spec", {})):
        assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]


def test_probes_watch_the_data_listener_and_a_stop_drains_before_the_grace_period_ends() -> None:
    config = config_json()
    deployment = one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    gateway = container(deployment)
    probes = {kind: gateway[kind]["httpGet"]
              for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    data_port = config["ServerConfig"]["port"]
    assert {k: (p["path"], port_number(gateway, p["port"]), p["scheme"])
            for k, p in probes.items()} == {
        "startupProbe": ("/v2/health/ready", data_port, "HTTP"),
        "readinessProbe": ("/v2/health/ready", data_port, "HTTP"),
        "livenessProbe": ("/v2/health/live", data_port, "HTTP"),
    }
    drain = config["ServerConfig"]["drainDelay"] + config["LimitsConfig"]["drainTimeout"]
    assert pod["terminationGracePeriodSeconds"] >= drain
    command = gateway["lifecycle"]["preStop"]["exec"]["command"]
    management = config["ServerConfig"]["managementPort"]
    assert f"https://127.0.0.1:{management}/stopService" in command
    assert "sleep" not in " ".join(command)
    timeout = float(command[command.index("--timeout") + 1])
    assert drain <= timeout
    assert timeout <= pod["terminationGracePeriodSeconds"]


def test_the_pod_runs_as_non_root_on_a_read_only_root_with_writable_scratch() -> None:
    deployment = one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    gateway = container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    assert gateway["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in gateway["volumeMounts"]}
    writable = {path for path, m in mounts.items() if not m.get("readOnly")}
    home = {e["name"]: e["value"] for e in gateway["env"]}["HOME"]
    assert {"/tmp", "/dev/shm", home} <= writable
    assert all("emptyDir" in volumes[mounts[path]["name"]] for path in writable)
    assert volumes[mounts["/certs"]["name"]]["secret"]["secretName"] == "llm-gateway-certs"
    config_map = one("ConfigMap")["metadata"]["name"]
    assert volumes[mounts["/etc/llm-gateway"]["name"]]["configMap"]["name"] == config_map
    assert gateway["args"] == ["--config", "/etc/llm-gateway/config.json"]
    assert gateway["resources"]["requests"] and gateway["resources"]["limits"]["memory"]
