"""GET /openapi.json: a valid OpenAPI 3.1 document that documents every route the app serves."""
import json
import urllib.request

import pytest
from openapi_spec_validator import validate

from conftest import FIXTURES
from omni_tts.config.stage_config import load_stage_config
from omni_tts.entrypoints.openapi import openapi_document
from omni_tts.entrypoints.server import ServerConfig, build_app
from omni_tts.orchestrator.async_engine import AsyncTTSEngine
from server_util import ServerProcess

MODEL = "openapi-model"
NAMES = (MODEL, "second-name")
ACCEPTED = NAMES + ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", *NAMES)
    yield server
    server.stop()


def test_served_document_is_valid_openapi(server):
    with urllib.request.urlopen(server.url + "/openapi.json") as response:
        assert response.headers["Content-Type"].startswith("application/json")
        document = json.loads(response.read())
    validate(document)
    assert document["openapi"].startswith("3.1")
    assert "servers" not in document
    speech = document["components"]["schemas"]["SpeechRequest"]
    assert speech["properties"]["model"]["enum"] == list(ACCEPTED)  # every name the server answers to
    with urllib.request.urlopen(server.url + "/v1/models") as response:
        assert [model["id"] for model in json.loads(response.read())["data"]] == list(ACCEPTED)
    assert speech["additionalProperties"] is False  # unknown fields are refused, as the server does
    upload = document["components"]["schemas"]["VoiceUpload"]
    assert upload["additionalProperties"] is False and upload["required"] == ["name", "audio_sample"]
    assert document == openapi_document(ACCEPTED, api_key_required=False)


def test_api_key_is_documented():
    document = openapi_document(ACCEPTED, api_key_required=True)
    validate(document)
    assert document["security"] == [{"apiKey": []}]
    for path, operations in document["paths"].items():
        for operation in operations.values():
            assert ("401" in operation["responses"]) == (path != "/health")


def test_every_route_is_documented():
    """A route added to build_app without its documentation fails here."""
    engine = AsyncTTSEngine(str(FIXTURES / "tiny-base"), load_stage_config("cpu_tiny"))  # not started
    app = build_app(engine, ServerConfig(served_model_names=(MODEL,)))
    served = {(route.method, route.resource.canonical) for route in app.router.routes()
              if route.method != "HEAD"}  # aiohttp answers HEAD for every GET route by itself
    document = openapi_document((MODEL,), api_key_required=False)
    documented = {(method.upper(), path) for path, operations in document["paths"].items() for method in operations}
    assert served == documented

