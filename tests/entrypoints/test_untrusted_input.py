"""Untrusted input against the real server (issue 10, part 3): reference-audio URLs (SSRF), decompression bombs,
malformed voice uploads, disk use of replaced voices, the store quota, the API key, control characters in names.
Loopback only."""
import asyncio
import base64
import http.client
import json
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest
import websockets
from openai import AsyncOpenAI

from audio_util import flac_claiming
from conftest import FIXTURES
from omni_tts.audio.ref_audio import URL_FAILED
from omni_tts.entrypoints.api.names import VoiceNames
from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.entrypoints.cli import main
from omni_tts.voices.store import MAX_REF_TEXT_CHARS
from server_util import ServerProcess, free_port, request, ws_utterance
from waiting import eventually

MODEL = "qwen3-tts"
CLIP = (FIXTURES / "ref_voice.wav").read_bytes()
API_KEY = "s3cret-key"
APP_ORIGIN = "https://app.example:8443"
SPEECH = {"model": MODEL, "input": "Hi.", "x_vector_only_mode": True, "response_format": "pcm",
          "temperature": 0, "max_new_tokens": 4}


class CountingSite:
    """A real HTTP server on a loopback address, in its own thread, counting the requests that reach it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        hits = self.hits = []
        release = self.release = threading.Event()  # what /hang.wav waits for before it answers 404

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                path, _, query = self.path.partition("?")
                if path == "/hang.wav":
                    release.wait(60)
                    self._answer(404, b"not found", "text/plain")
                elif path == "/clip.wav":
                    self._answer(200, CLIP, "audio/wav")
                elif path == "/page.html":
                    self._answer(200, b"<html><body>a page, not audio</body></html>", "text/html")
                elif path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", urllib.parse.parse_qs(query)["to"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._answer(404, b"not found", "text/plain")

            def _answer(self, status, body, content_type):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def site():
    site = CountingSite()
    yield site
    site.close()


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def plain_server(voices_dir):
    """Defaults, plus a voices dir with a 1 MiB quota."""
    server = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL,
                           "--voices-dir", str(voices_dir), "--voices-quota-mb", "1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded_server():
    """Remote ref_audio on, 127.0.0.2 allow-listed; the API key from the environment; CORS for APP_ORIGIN."""
    server = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL,
                           "--allow-remote-ref-audio", "--ref-audio-allowed-hosts", "127.0.0.2/32",
                           "--allowed-origins", APP_ORIGIN, env={"OMNI_TTS_API_KEY": API_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_slot_server():
    """Room for one request; remote ref_audio on, 127.0.0.2 allow-listed; idle connections closed after 1 s."""
    server = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL, "--max-queue", "1",
                           "--allow-remote-ref-audio", "--ref-audio-allowed-hosts", "127.0.0.2/32",
                           "--keepalive-timeout", "1")
    yield server
    server.stop()


def call(server, method, path, body=b"", headers=None) -> tuple[int, dict | bytes]:
    """(status, parsed JSON or raw bytes) of one request on a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    if response.getheader("Content-Type", "").startswith("application/json"):
        return response.status, json.loads(data)
    return response.status, data


def speak(server, headers=None, **fields) -> tuple[int, dict | bytes]:
    return call(server, "POST", "/v1/audio/speech", json.dumps(dict(SPEECH, **fields)).encode(),
                {"Content-Type": "application/json", **(headers or {})})


def assert_error(answer, status, message, param=None):
    got_status, body = answer
    assert got_status == status and set(body["error"]) == {"message", "type", "param", "code"}, body
    if message is not None:
        assert body["error"]["message"] == message, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# --- reference-audio URLs ----------------------------------------------------------------------------------------
def test_ref_audio_urls_are_off_by_default(plain_server, site):
    before = len(site.hits)
    assert_error(speak(plain_server, ref_audio=site.url + "/clip.wav"), 400,
                 "ref_audio: URLs are disabled on this server; send a data: URI", "ref_audio")
    assert len(site.hits) == before


def test_ref_audio_urls_refuse_loopback_and_fail_alike(guarded_server, site):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    allowed = CountingSite("127.0.0.2")
    try:
        before = len(site.hits)
        # loopback, by address and by name: refused, and no request reaches it
        for url in (site.url + "/clip.wav", site.url.replace("127.0.0.1", "localhost") + "/clip.wav",
                    allowed.url + "/redirect?to=" + urllib.parse.quote(site.url + "/clip.wav")):
            assert_error(speak(guarded_server, auth, ref_audio=url), 400, URL_FAILED, "ref_audio")
        assert len(site.hits) == before
        # the allow-listed address: 404, a page, a closed port all read the same; the clip is fetched and used
        for url in (allowed.url + "/missing.wav", allowed.url + "/page.html",
                    f"http://127.0.0.2:{free_port()}/clip.wav"):
            assert_error(speak(guarded_server, auth, ref_audio=url), 400, URL_FAILED, "ref_audio")
        status, audio = speak(guarded_server, auth, ref_audio=allowed.url + "/clip.wav")
        assert status == 200 and isinstance(audio, bytes) and len(audio) > 0
        assert allowed.hits[-1] == "/clip.wav"
    finally:
        allowed.close()


def test_admission_comes_before_the_reference_fetch(one_slot_server):
    """A fetch holds its request's slot: while one request waits on a hanging URL, the next is refused (429)
    without a fetch of its own; once the slot is free again a request is served."""
    remote = CountingSite("127.0.0.2")
    try:
        answers = []
        holder = threading.Thread(target=lambda: answers.append(
            speak(one_slot_server, ref_audio=remote.url + "/hang.wav")))
        holder.start()
        eventually(lambda: "/hang.wav" in remote.hits, what="the first request fetching its reference")
        assert remote.hits == ["/hang.wav"]
        assert_error(speak(one_slot_server, ref_audio=remote.url + "/clip.wav"), 429, None)
        assert remote.hits == ["/hang.wav"]  # the refused request fetched nothing
        remote.release.set()
        holder.join(60)
        assert_error(answers[0], 400, URL_FAILED, "ref_audio")
        status, audio = speak(one_slot_server, ref_audio=remote.url + "/clip.wav")
        assert status == 200 and len(audio) > 0 and remote.hits == ["/hang.wav", "/clip.wav"]
    finally:
        remote.close()


# --- API key -----------------------------------------------------------------------------------------------------
def test_idle_and_half_sent_connections_are_closed(one_slot_server):
    """A connection that never finishes its headers (slowloris), or idles after an answer, holds a socket only for
    --keepalive-timeout."""
    def server_closes(sock: socket.socket) -> None:
        # the server's close (b"") before this deadline, under the default keepalive (30 s): its 1 s is what applied
        sock.settimeout(20)
        while sock.recv(65536):  # an answer first, if there was a whole request; then the close
            pass

    with socket.create_connection(("127.0.0.1", one_slot_server.port)) as half_sent:
        half_sent.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        server_closes(half_sent)
    with socket.create_connection(("127.0.0.1", one_slot_server.port)) as idle:
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        server_closes(idle)
    status, _, _ = request(one_slot_server.url + "/health")
    assert status == 200  # the server itself is unaffected


def test_cors_only_for_the_allowed_origins(guarded_server, plain_server):
    """A preflight from an allowed origin is answered before the API key is checked; answers to it (streamed ones
    too) name it; any other origin, and every origin on a server without --allowed-origins, gets no CORS header."""
    preflight = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = request(guarded_server.url + "/v1/audio/speech", method="OPTIONS", headers=preflight)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    key = {"Authorization": f"Bearer {API_KEY}"}
    speech = dict(model=MODEL, input="Hi.", voice="alloy", response_format="pcm", stream_format="audio", max_new_tokens=4,
                  ref_audio=data_uri(CLIP), x_vector_only_mode=True)
    status, headers, _ = request(guarded_server.url + "/v1/audio/speech", speech, headers={**key, "Origin": APP_ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"] and "Origin" in headers["Vary"]
    for server, origin in [(guarded_server, "http://elsewhere.example"), (plain_server, APP_ORIGIN)]:
        status, headers, _ = request(server.url + "/v1/audio/speech", method="OPTIONS",
                                     headers={**preflight, "Origin": origin})
        assert status != 204 and "Access-Control-Allow-Origin" not in headers
        status, headers, _ = request(server.url + "/health", headers={"Origin": origin})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_api_key_guards_every_route_but_health(guarded_server):
    assert call(guarded_server, "GET", "/health")[0] == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/audio/voices"),
                             ("POST", "/v1/audio/speech"), ("DELETE", "/v1/audio/voices/x")):
            error = assert_error(call(guarded_server, method, path, b"{}", headers), 401, None)
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    status, models = call(guarded_server, "GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and models["data"][0]["id"] == MODEL
    # the docs page is static and asks its reader for the key: a browser cannot send the header on navigation
    status, page = call(guarded_server, "GET", "/docs")
    assert status == 200 and page.startswith(b"<!DOCTYPE html>")


def test_the_realtime_route_takes_the_key_as_openai_clients_send_it(guarded_server):
    """The `openai` SDK's bearer header, or a browser's subprotocols `realtime` and `openai-insecure-api-key.<key>`
    (the server answers `realtime`); a wrong or missing key is refused (401) before the upgrade."""
    def realtime(key: str):
        client = AsyncOpenAI(base_url=guarded_server.url + "/v1", api_key=key)
        return client.realtime.connect(model="gpt-realtime-2.1-mini")

    async def main():
        async with realtime(API_KEY) as connection:
            assert (await connection.recv()).type == "session.created"
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with realtime("wrong"):
                pass
        assert refused.value.response.status_code == 401
        url = guarded_server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime-2.1-mini"
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, protocols=("realtime", f"openai-insecure-api-key.{API_KEY}")) as ws:
                assert ws.protocol == "realtime" and (await ws.receive_json())["type"] == "session.created"
            for protocols in (("realtime", "openai-insecure-api-key.wrong"), (f"openai-insecure-api-key.{API_KEY}",)):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(url, protocols=protocols)
                assert refused.value.status == 401

    asyncio.run(main())


# --- decompression bombs and library text ------------------------------------------------------------------------
def data_uri(data: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


def test_bombs_and_junk_give_plain_400s(plain_server):
    assert_error(speak(plain_server, ref_audio=data_uri(flac_claiming(8000 * 3600 * 10, 2.0))), 400,
                 "ref_audio is too long: it must last 1–30 s, got 36000.00 s", "ref_audio")
    # junk that libsndfile half-recognises: our words, none of libsndfile's
    for junk in (b"RIFF" + b"\xff" * 400, b"fLaC" + b"\0" * 400, b"OggS" + b"\1" * 400):
        assert_error(speak(plain_server, ref_audio=data_uri(junk)), 400,
                     "ref_audio is not a readable audio file; send wav, flac, ogg or mp3", "ref_audio")


# --- voice uploads -----------------------------------------------------------------------------------------------
BOUNDARY = "omni-tts-test-boundary"
FORM = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def part(name: str, value: bytes, filename: str | None = None, content_type: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"Content-Disposition: {disposition}\r\n" + (f"Content-Type: {content_type}\r\n" if content_type else "")
    return f"--{BOUNDARY}\r\n{head}\r\n".encode() + value + b"\r\n"


def form(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def upload(server, *parts: bytes, headers=FORM):
    return call(server, "POST", "/v1/audio/voices", form(*parts), headers)


def test_malformed_uploads_are_400(plain_server):
    clip = part("audio_sample", CLIP, "v.wav", "audio/wav")
    cases = [
        (b'{"name": "v"}', {"Content-Type": "application/json"}, "type"),   # JSON: only a designed voice
        (b"name=v", {}, None),
        (form(part("name", b"v"), clip), {"Content-Type": "multipart/form-data"}, None),  # no boundary
        # a NUL and a non-ASCII byte in part headers; a body that never shows its boundary (any param will do)
        (b"--" + BOUNDARY.encode() + b'\r\nContent-Disposition: form-data; name="na\0me"\r\n\r\nv\r\n'
         + form(clip), FORM, ...),
        (b"--" + BOUNDARY.encode() + b'\r\nContent-Dispo\xffsition: form-data; name="name"\r\n\r\nv\r\n'
         + form(clip), FORM, ...),
        (b"--wrong-boundary\r\n\r\n", FORM, ...),
        (form(part("name", b"\xff\xfev"), clip), FORM, "name"),
        (form(part("name", b"v"), part("ref_text", b"caf\xe9"), clip), FORM, "ref_text"),
        (form(part("name", b"v"), part("ref_text", b"x" * (MAX_REF_TEXT_CHARS + 1)), clip), FORM, "ref_text"),
        (form(part("name", b"../etc"), clip), FORM, "name"),
        (form(part("name", b"v")), FORM, "audio_sample"),
        (form(clip), FORM, "name"),
        # strict: unknown fields (refused unread), repeats (an alias counts as its field), text sent as a file; a
        # prompt-designed voice takes no clip, and needs a VoiceDesign model
        (form(part("name", b"v"), part("colour", b"blue"), clip), FORM, "colour"),
        (form(part("name", b"v"), part("speaker_embedding", b"[0.1]"), clip), FORM, "speaker_embedding"),
        (form(part("name", b"v"), part("name", b"w"), clip), FORM, "name"),
        (form(part("name", b"v"), clip, part("file", CLIP, "v.wav")), FORM, "audio_sample"),
        (form(part("name", b"v", "name.txt", "text/plain"), clip), FORM, "name"),
        (form(part("name", b"v"), part("type", b"prompt"), clip), FORM, "audio_sample"),
        (form(part("name", b"v"), part("type", b"prompt"), part("prompt", b"calm")), FORM, "type"),
        (form(part("name", b"v"), part("consent", b"c" * 2000), clip), FORM, "consent"),
    ]
    for body, headers, param in cases:
        error = assert_error(call(plain_server, "POST", "/v1/audio/voices", body, headers), 400, None)
        assert param is ... or error["param"] == param, (body[:80], error)
    assert call(plain_server, "GET", "/v1/audio/voices")[1]["uploaded_voices"] == []


def test_uploads_are_sniffed_and_accept_the_file_alias(plain_server):
    # a wav named like a program, under the openai SDK's field name `file`: stored as what its bytes are
    status, answer = upload(plain_server, part("name", b"sniffed"),
                            part("file", CLIP, "setup.exe", "application/x-msdownload"))
    assert status == 200 and answer["voice"]["mime_type"] == "audio/wav", answer
    # text in a .wav: refused by content
    assert_error(upload(plain_server, part("name", b"fake"), part("audio_sample", b"hello " * 500, "x.wav",
                                                                   "audio/wav")),
                 400, "audio_sample is not a readable audio file; send wav, flac, ogg or mp3", "audio_sample")
    assert call(plain_server, "DELETE", "/v1/audio/voices/sniffed")[0] == 200


def test_overwritten_and_deleted_voices_leave_the_disk(plain_server, voices_dir):
    for i in range(40):
        status, answer = upload(plain_server, part("name", b"loop"), part("ref_text", f"take {i}".encode()),
                                part("audio_sample", CLIP, "loop.wav", "audio/wav"))
        assert status == 200, answer
    names = sorted(p.name for p in (voices_dir / "loop").iterdir())
    assert len(names) == 2 and names[0].startswith("clip-") and names[1] == "meta.json"  # the newest clip only
    assert call(plain_server, "DELETE", "/v1/audio/voices/loop")[0] == 200
    assert not (voices_dir / "loop").exists()


def test_store_quota_is_413(plain_server):
    names = []
    for i in range(2 ** 20 // len(CLIP)):  # what fits in the 1 MiB quota
        names.append(f"q{i}")
        assert upload(plain_server, part("name", names[-1].encode()), part("audio_sample", CLIP))[0] == 200
    error = assert_error(upload(plain_server, part("name", b"one-more"), part("audio_sample", CLIP)), 413, None)
    assert "voice store is full" in error["message"]
    assert upload(plain_server, part("name", b"q0"), part("audio_sample", CLIP))[0] == 200  # replacing fits
    for name in names:
        assert call(plain_server, "DELETE", f"/v1/audio/voices/{name}")[0] == 200
    assert upload(plain_server, part("name", b"one-more"), part("audio_sample", CLIP))[0] == 200
    assert call(plain_server, "DELETE", "/v1/audio/voices/one-more")[0] == 200


def test_serve_flags_are_checked_before_anything_starts(capsys):
    assert main(["serve", "--ref-audio-allowed-hosts", "127.0.0.1"]) == 2
    assert "--ref-audio-allowed-hosts needs --allow-remote-ref-audio" in capsys.readouterr().err
    assert main(["serve", "--allow-remote-ref-audio", "--ref-audio-allowed-hosts", "10.0.0.0/8,http://x"]) == 2
    assert "'http://x' is neither an IP address" in capsys.readouterr().err
    assert main(["serve", "--allowed-origins", "https://app.example/path"]) == 2
    assert "--allowed-origins takes origins such as" in capsys.readouterr().err
    assert main(["serve", "--voices-quota-mb", "0"]) == 2


# --- control characters in names ---------------------------------------------------------------------------------
CONTROL_NAMES = ["new\nline", "nul\0byte", "escape\x1b[31m"]


@pytest.mark.parametrize("voice", CONTROL_NAMES, ids=["newline", "NUL", "ESC"])
def test_a_voice_with_a_control_character_is_a_400_before_any_work(base_server, voice):
    """Beside ref_audio a Base model ignores a voice that is no uploaded one and names it in a response header, which
    cannot hold a control character (it was a 500 with a traceback, after the audio was made): refused on every
    route, before admission, whatever the model would do with the name."""
    options = {k: v for k, v in SPEECH.items() if k != "input"} | {"ref_audio": str(FIXTURES / "ref_voice.wav")}
    made, logged = _audio_seconds(base_server), len(base_server.output())
    assert_error(speak(base_server, voice=voice, ref_audio=options["ref_audio"]), 400,
                 "voice must not contain control characters", "voice")
    status, _, body = request(base_server.url + "/v1/audio/speech/batch",
                              dict(options, items=[{"input": "Hi.", "voice": voice}]))
    result = json.loads(body)["results"][0]
    assert status == 200 and (result["status_code"], result["error"]["param"]) == (400, "voice"), result
    _, events = asyncio.run(ws_utterance(base_server.url, [dict(options, type="session.config", voice=voice),
                                                           {"type": "input.text", "text": "Hi."},
                                                           {"type": "input.done"}]))
    assert events == [{"type": "error", "message": "voice must not contain control characters"}]
    assert _audio_seconds(base_server) == made   # nothing was spoken
    assert "Traceback" not in base_server.output()[logged:]


@pytest.mark.parametrize("model_type,speakers", [("custom_voice", ["ryan"]), ("voice_design", []), ("base", [])])
def test_every_model_kind_refuses_a_control_character_in_a_voice(model_type, speakers):
    """The one place a voice is decided (names.VoiceNames.choose), for the kinds of checkpoint the shared servers do
    not serve too: a VoiceDesign model ignores every voice, and would echo this one."""
    for voice in CONTROL_NAMES:
        with pytest.raises(ApiError) as refused:
            VoiceNames(model_type, speakers).choose(voice, "ref_audio" if model_type == "base" else None,
                                                    lambda name: False)
        assert (refused.value.status, refused.value.param) == (400, "voice")


def _audio_seconds(server) -> float:
    text = request(server.url + "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("omni_tts_audio_seconds_total"))
