"""The Kubernetes manifests in deploy/kubernetes: valid against the Kubernetes API schema (kubernetes-validate,
strict: an unknown or misspelt field fails), and true to the server they run — the command parses with omni-tts's
own CLI and names a shipped stage config, the probes hit real routes, and the autoscaler's metric is one /metrics
exports."""
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from omni_tts.config import available_stage_configs
from omni_tts.entrypoints.cli import build_parser
from omni_tts.entrypoints.metrics import ServerMetrics
from omni_tts.entrypoints.openapi import openapi_document

MANIFESTS = sorted((Path(__file__).parent.parent / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.30.0"  # the oldest minor still in wide use that has autoscaling/v2


def documents() -> dict[str, dict]:
    return {f"{path.name}:{doc['kind']}": doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())}


@pytest.mark.parametrize("name", sorted(documents()))
def test_manifest_is_valid_kubernetes(name):
    kubernetes_validate.validate(documents()[name], KUBERNETES, strict=True)


def test_the_deployment_runs_this_server():
    deployment = documents()["deployment.yaml:Deployment"]
    container, = deployment["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[0] == "omni-tts"
    args = build_parser().parse_args(command[1:])  # SystemExit (a test failure) on an unknown flag
    assert args.command == "serve" and args.stage_config in available_stage_configs()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port
    paths = openapi_document(["qwen3-tts"], api_key_required=True)["paths"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]
        if "httpGet" in check:
            assert check["httpGet"]["path"] in paths and check["httpGet"]["port"] == "http"
            assert paths[check["httpGet"]["path"]]["get"].get("security") == []  # open: probes send no API key
    service = documents()["service.yaml:Service"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_the_autoscaler_reads_a_metric_the_server_exports():
    hpa = documents()["hpa.yaml:HorizontalPodAutoscaler"]
    exported = {metric.name for metric in ServerMetrics().registry.collect()}
    for metric in hpa["spec"]["metrics"]:
        assert metric["pods"]["metric"]["name"] in exported
    rules = yaml.safe_load(documents()["prometheus-adapter-rules.yaml:ConfigMap"]["data"]["config.yaml"])
    assert {rule["name"]["as"] for rule in rules["rules"]} == {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
