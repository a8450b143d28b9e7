"""GET /openapi.json: a valid OpenAPI 3.1 document that documents every route the app serves; GET /docs renders it
with nothing from outside the server."""
import html.parser
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import jsonschema
import pytest
from openapi_spec_validator import validate

from conftest import FIXTURES
from omni_tts.config.stage_config import load_stage_config
from omni_tts.entrypoints.api.openapi import openapi_document
from omni_tts.entrypoints.api.app import build_app
from omni_tts.entrypoints.api.server_config import ServerConfig
from omni_tts.orchestrator.async_tts import AsyncTTS
from server_util import ServerProcess, request

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
    assert speech["properties"]["model"]["anyOf"][0]["enum"] == list(ACCEPTED)  # every name the server answers to
    assert "model" not in speech["required"]  # absent: the served model
    with urllib.request.urlopen(server.url + "/v1/models") as response:
        assert [model["id"] for model in json.loads(response.read())["data"]] == list(ACCEPTED)
    assert "additionalProperties" not in speech  # unknown fields are ignored, as the server does
    strict = openapi_document(ACCEPTED, api_key_required=False, strict_fields=True)["components"]["schemas"]
    assert strict["SpeechRequest"]["additionalProperties"] is False  # --strict-fields refuses them
    upload = document["components"]["schemas"]["VoiceUpload"]
    assert upload["additionalProperties"] is False and upload["required"] == ["name"]
    assert upload["oneOf"] == [{"required": ["audio_sample"]}, {"required": ["speaker_embedding"]}]  # one of them
    assert document == openapi_document(ACCEPTED, api_key_required=False)


def test_api_key_is_documented():
    """A keyed server's document has the 401s; made in the same process, an open server's still has none (no part
    of one document is shared with the next)."""
    open_document = json.dumps(openapi_document(ACCEPTED, api_key_required=False))
    document = openapi_document(ACCEPTED, api_key_required=True)
    assert json.dumps(openapi_document(ACCEPTED, api_key_required=False)) == open_document
    validate(document)
    assert document["security"] == [{"apiKey": []}]
    for path, operations in document["paths"].items():
        for operation in operations.values():
            assert ("401" in operation["responses"]) == (path not in (
                "/health", "/docs", "/", "/playground/{name}", "/api/v1/audio/{audio_id}"))


def test_every_route_is_documented():
    """A route added to build_app without its documentation fails here."""
    engine = AsyncTTS(str(FIXTURES / "tiny-base"), load_stage_config("cpu_tiny"))  # not started
    app = build_app(engine, ServerConfig(served_model_names=(MODEL,)))
    served = {(route.method, route.resource.canonical) for route in app.router.routes()
              if route.method != "HEAD"}  # aiohttp answers HEAD for every GET route by itself
    document = openapi_document((MODEL,), api_key_required=False)
    documented = {(method.upper(), path) for path, operations in document["paths"].items() for method in operations}
    assert served == documented


class _Resources(html.parser.HTMLParser):
    """Every URL an HTML page makes the browser load (src, href, action, CSS url())."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href", "action", "srcset") and value]

    def handle_data(self, data):
        self.urls += re.findall(r"url\(([^)]*)\)", data)


def test_docs_page_renders_the_document_from_this_server_only(server):
    with urllib.request.urlopen(server.url + "/docs") as response:
        assert response.headers["Content-Type"].startswith("text/html")
        policy = response.headers["Content-Security-Policy"]
        page = response.read().decode()
    resources = _Resources()
    resources.feed(page)
    assert all(not urllib.parse.urlsplit(url).netloc and not url.startswith("//") for url in resources.urls)
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]", page, re.IGNORECASE)  # no outside host, in any form
    fetched = re.findall(r"fetch\(\"([^\"]*)\"", page)
    assert fetched == ["openapi.json"]  # relative: /docs → /openapi.json on this server
    with urllib.request.urlopen(urllib.parse.urljoin(server.url + "/docs", fetched[0])) as response:
        assert json.loads(response.read())["openapi"].startswith("3.1")
    # the browser enforces it too: nothing but this origin may be fetched, nothing external loaded
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy


def test_the_docs_page_and_the_playground_ship_in_the_wheel(tmp_path):
    root = Path(__file__).parents[2]
    source = tmp_path / "source"  # a copy: setuptools leaves build/ behind, whose stale files a later build reuses
    shutil.copytree(root / "omni_tts", source / "omni_tts", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("omni_tts-*.whl")
    static = root / "omni_tts" / "entrypoints" / "api" / "static"
    shipped = [static / "docs.html", *sorted((static / "playground").iterdir())]
    assert len(shipped) > 2
    with zipfile.ZipFile(wheel) as archive:
        for path in shipped:
            assert archive.read(path.relative_to(root).as_posix()) == path.read_bytes()


def test_a_json_speech_answer_is_the_documented_shape(cv_server):
    """response_format json answers one JSON object: its content type and its shape are in the document (a fuzzer
    once found the content type undocumented)."""
    with urllib.request.urlopen(cv_server.url + "/openapi.json") as response:
        document = json.loads(response.read())
    status, headers, body = request(cv_server.url + "/v1/audio/speech", {
        "input": "Documented.", "voice": "ryan", "response_format": "json", "temperature": 0, "max_new_tokens": 8})
    assert status == 200
    documented = document["paths"]["/v1/audio/speech"]["post"]["responses"]["200"]["content"]
    assert headers["Content-Type"].split(";")[0] in documented
    jsonschema.validate(json.loads(body), documented["application/json"]["schema"] | {
        "components": document["components"]})
