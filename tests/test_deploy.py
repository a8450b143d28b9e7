"""The deployment artefacts agree with each other and with the server they run. The Kubernetes manifests in
deploy/kubernetes are valid against the Kubernetes API schema (kubernetes-validate, strict: an unknown or misspelt
field fails). The Dockerfile builds a `cpu` and a `cuda` image from files the repository has (and .dockerignore lets
through), installs the package as a wheel over a torch that meets pyproject's floor, and runs the server as a user
that is not root, in exec form (SIGTERM reaches the server, which drains). The image's entrypoint with the
manifest's args parses with omni-tts's own CLI and names a shipped stage config; the port it listens on is the one
the image exposes and the manifest names; the image's health check and the manifest's probes hit routes open without
the API key; the manifest runs the image docs/deploy.md builds; the autoscaler's metric is one /metrics exports.
Docker itself is not needed: the Dockerfile is read, not built."""
import json
import re
import shlex
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from huggingface_hub.utils import validate_repo_id

from omni_tts.config import available_stage_configs, load_stage_config
from omni_tts.entrypoints.cli.commands import build_parser
from omni_tts.entrypoints.api.metrics import ServerMetrics
from omni_tts.entrypoints.api.openapi import openapi_document

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.30.0"  # the oldest minor still in wide use that has autoscaling/v2
TARGETS = ("cpu", "cuda")
OPEN_PATHS = openapi_document(["qwen3-tts"], api_key_required=True)["paths"]


def documents() -> dict[str, dict]:
    return {f"{path.name}:{doc['kind']}": doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) in order: continuation lines joined, comment lines dropped (as Docker drops them, also
    inside a continuation)."""
    instructions, pending = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def dockerfile_stages() -> dict[str, dict]:
    """Each named stage: its parent (an image or an earlier stage), its own instructions, and the image settings
    it ends with, inherited from a parent stage (a stage's ENTRYPOINT resets the CMD it inherited, as Docker does)."""
    stages: dict[str, dict] = {}
    for keyword, arguments in dockerfile_instructions():
        if keyword == "FROM":
            image, _, name = re.fullmatch(r"(\S+)(\s+AS\s+(\S+))?", arguments, re.IGNORECASE).groups()
            inherited = dict(stages[image]["settings"]) if image in stages else {}
            stage = stages[name] = {"parent": image, "instructions": [], "settings": inherited}
        elif stages:
            stage["instructions"].append((keyword, arguments))
            settings = stage["settings"]
            if keyword in ("ENTRYPOINT", "CMD"):
                settings[keyword] = json.loads(arguments)  # exec form: anything else is not JSON
                if keyword == "ENTRYPOINT":
                    settings.pop("CMD", None)
            elif keyword in ("USER", "EXPOSE", "HEALTHCHECK"):
                settings[keyword] = arguments
    return stages


def dockerfile_arg_default(name: str) -> str:
    for stage in dockerfile_stages().values():
        for keyword, arguments in stage["instructions"]:
            if keyword == "ARG" and arguments.startswith(f"{name}="):
                return arguments.partition("=")[2]
    raise AssertionError(f"the Dockerfile has no ARG {name}=default")


def docker_ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (relative, '/'-separated) out of the build context: the last pattern
    matching the path or one of its parent directories decides; '!' re-includes."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated, pattern = pattern.startswith("!"), pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            ignored = not negated
    return ignored


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def image_uid(target: str) -> int:
    user = dockerfile_stages()[target]["settings"]["USER"]
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user}: numeric, so that runAsNonRoot can check it"
    return int(user.partition(":")[0])


def serve_arguments(command: list[str]):
    assert command[0] == "omni-tts"
    args = build_parser().parse_args(command[1:])  # SystemExit (a test failure) on an unknown flag
    assert args.command == "serve"
    assert args.stage_config is None or args.stage_config in available_stage_configs()
    return args


def assert_open_route(path: str) -> None:
    assert path in OPEN_PATHS, path
    assert OPEN_PATHS[path]["get"].get("security") == []  # open: a probe sends no API key


def built_images() -> dict[str, str]:
    """target → image name, from the build commands docs/deploy.md gives."""
    text = (REPO / "docs" / "deploy.md").read_text()
    return dict(re.findall(r"docker build --target (\S+) -t (\S+) \.", text))


@pytest.mark.parametrize("name", sorted(documents()))
def test_manifest_is_valid_kubernetes(name):
    kubernetes_validate.validate(documents()[name], KUBERNETES, strict=True)


def test_the_dockerfile_builds_both_images_from_the_repository_as_a_wheel():
    stages = dockerfile_stages()
    assert set(TARGETS) <= set(stages) and set(built_images()) == set(TARGETS)
    patterns = dockerignore_patterns()
    for name, stage in stages.items():
        for keyword, arguments in stage["instructions"]:
            words = shlex.split(arguments)
            if keyword in ("COPY", "ADD") and not any(word.startswith("--from=") for word in words):
                for source in [word for word in words if not word.startswith("--")][:-1]:
                    assert (REPO / source).exists(), f"stage {name} copies {source}, which the repository lacks"
                    assert not docker_ignored(source, patterns), f"stage {name} copies {source}: .dockerignore drops it"
            assert not (keyword == "RUN" and re.search(r"pip install (-e|--editable)\b", arguments)), arguments
    for path in ("tests/fixtures/qwen3_tts/tiny-base/model.safetensors", "benchmarks/results/run.json", ".git/HEAD",
                 "docs/bench/issue22/cpu-compare/summary.txt", ".whl/soxr.whl", "omni_tts-0.1.0-py3-none-any.whl",
                 "omni_tts/__pycache__/cli.cpython-312.pyc"):
        assert docker_ignored(path, patterns), f"{path} would be sent to the Docker build"
    # torch first, from PyTorch's index for the target, at a version pyproject accepts; then the wheel
    floor = next(dep for dep in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                 if dep.startswith("torch>="))
    version = tuple(int(part) for part in dockerfile_arg_default("TORCH_VERSION").split("."))
    assert version >= tuple(int(part) for part in floor.removeprefix("torch>=").split("."))
    for target, index in (("cpu", "cpu"), ("cuda", "cu")):
        runs = " ".join(arguments for keyword, arguments in stages[target]["instructions"] if keyword == "RUN")
        installs = re.findall(r"pip install (\S+)", runs)
        assert installs[0] == '"torch==${TORCH_VERSION}"' and installs[1].endswith(".whl"), installs
        assert re.search(rf"--index-url https://download\.pytorch\.org/whl/{index}\w*\b", runs), runs


@pytest.mark.parametrize("target", TARGETS)
def test_the_image_serves_as_a_user_not_root_on_the_port_it_exposes(target):
    settings = dockerfile_stages()[target]["settings"]
    assert image_uid(target) != 0
    args = serve_arguments(settings["ENTRYPOINT"] + settings["CMD"])
    assert args.host == "0.0.0.0" and settings["EXPOSE"].split() == [str(args.port)]
    if target == "cuda":  # a released checkpoint on one GPU
        [model] = args.model   # --model is repeatable: the image serves one
        validate_repo_id(model)
        assert model.count("/") == 1  # owner/name, as --model reads a repo id
        config = load_stage_config(args.stage_config)
        assert {config.stages.talker.device, config.stages.code2wav.device} == {"cuda:0"}
    health = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", settings["HEALTHCHECK"])
    assert health, settings["HEALTHCHECK"]
    assert int(health[1]) == args.port
    assert_open_route(health[2])


def test_the_deployment_runs_the_cuda_image():
    deployment = documents()["deployment.yaml:Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container, = pod["containers"]
    assert container["image"] == built_images()["cuda"]
    assert "command" not in container  # the image's entrypoint runs, so SIGTERM reaches the server
    settings = dockerfile_stages()["cuda"]["settings"]
    args = serve_arguments(settings["ENTRYPOINT"] + container["args"])
    assert args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and settings["EXPOSE"].split() == [str(args.port)]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroup"] == image_uid("cuda")  # the image's user can write the voices volume
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]
        if "httpGet" in check:
            assert check["httpGet"]["port"] == "http"
            assert_open_route(check["httpGet"]["path"])
    service = documents()["service.yaml:Service"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_the_autoscaler_reads_a_metric_the_server_exports():
    hpa = documents()["hpa.yaml:HorizontalPodAutoscaler"]
    exported = {metric.name for metric in ServerMetrics().registry.collect()}
    for metric in hpa["spec"]["metrics"]:
        assert metric["pods"]["metric"]["name"] in exported
    rules = yaml.safe_load(documents()["prometheus-adapter-rules.yaml:ConfigMap"]["data"]["config.yaml"])
    assert {rule["name"]["as"] for rule in rules["rules"]} == {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
