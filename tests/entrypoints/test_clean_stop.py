"""A clean start and a clean stop (issue 23), on a real server process: /health answers 503 while the model loads;
the first Ctrl+C drains (one line naming the streams it waits for, new requests refused 503, the streams finish,
exit 0); a second one ends them at once (each client's stream ends as promised, narrated ones too: no traceback,
nothing left in /dev/shm, exit 130); every request, WebSocket session and utterance has its access-log line, a
request the stop cut too; Ctrl+C while loading is one line and exit 130; the CLI's usage and model errors are one
line; GET on the speech route is 405. Streams are held in flight by state: a WebSocket token-mode utterance whose
text has not ended cannot finish until its client sends the rest, a request whose body has not all arrived cannot
start, and a narration of many segments that each run to the model's length limit lasts minutes."""
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import aiohttp
import numpy as np
import pytest

from conftest import FIXTURES, RUNS_TO_ITS_LIMIT
from server_util import ServerProcess, free_port, request, stage_pids
from test_server import assert_pcm_close
from waiting import eventually, eventually_async

MODEL = "m"
GREEDY = {"temperature": 0, "max_new_tokens": 4096}
HELD_TEXT = "A sentence that waits for the rest of"
DRAIN = re.compile(r"shutting down: finishing (\d+) streams? \(Ctrl-C again to stop now\)")
STOPPING = "the server is shutting down; retry shortly"
ENGINE_STOPPING = "the engine is shut"   # shutting down (or shut down, for a segment that starts after)
NUM_HELD = 3   # WebSocket utterances held in flight at a second Ctrl+C
# a narration of 100 segments, each running to the model's length limit (seconds of serving each)
NARRATED = "\n\n".join([RUNS_TO_ITS_LIMIT] * 100)
# access-log lines (omni_tts.access): an HTTP request's; a WebSocket session's at its end and each of its utterances'
ACCESS = re.compile(r' INFO omni_tts\.access: (\w+) \S+ "(\w+) (\S+)" (\S+) [\d.]+s(.*)$', re.M)
SESSION = re.compile(r' INFO omni_tts\.access: (\w+) \S+ "GET /v1/audio/speech/stream" 101 [\d.]+s '
                     r'utterances=(\d+) outcome=(\S+)$', re.M)
UTTERANCE = re.compile(r' INFO omni_tts\.access: (\w+)#(\d+) \S+ "GET /v1/audio/speech/stream" (\S+) [\d.]+s '
                       r'audio=(\S+) ttfp=(\S+)$', re.M)


def ctrl_c(server: ServerProcess) -> None:
    """What a terminal's Ctrl+C does: SIGINT to the server and its stages (its process group)."""
    for pid in [server.proc.pid, *stage_pids(server.proc.pid)]:
        os.kill(pid, signal.SIGINT)


def drain_line(server: ServerProcess) -> re.Match | None:
    assert server.proc.poll() is None, server.output()
    return DRAIN.search(server.output())


def shm_segments(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"omni_tts_{pid}_")]


def assert_refused(server: ServerProcess) -> None:
    """During a drain every new request is answered 503 with the OpenAI envelope, /health included."""
    for path, payload in [("/v1/audio/speech", {"model": MODEL, "input": "Hello.", "voice": "ryan"}),
                          ("/health", None)]:
        status, headers, body = request(server.url + path, payload)
        assert status == 503, (path, status, body)
        assert b'"message": "%s"' % STOPPING.encode() in body and b'"code": "service_unavailable"' in body


def assert_get_is_405(server: ServerProcess) -> None:
    status, headers, body = request(server.url + "/v1/audio/speech")
    assert status == 405 and headers["Allow"] == "POST", (status, headers)
    assert b'"code": "method_not_allowed"' in body and b'"type": "invalid_request_error"' in body, body


class HeldUtterance:
    """A WebSocket token-mode utterance in flight (its first audio arrived) that cannot end until `finish`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.pcm, self.events = ws, b"", []

    @classmethod
    async def open(cls, http: aiohttp.ClientSession, url: str) -> "HeldUtterance":
        ws = await http.ws_connect(url + "/v1/audio/speech/stream")
        await ws.send_json({"type": "session.config", "voice": "ryan", "response_format": "pcm",
                            "stream_audio": True, **GREEDY})
        await ws.send_json({"type": "input.text", "text": HELD_TEXT})
        held = cls(ws)
        while not held.pcm:
            await held.next()
        return held

    async def next(self) -> dict | None:
        """The next event (None once closed); audio is collected."""
        message = await asyncio.wait_for(self.ws.receive(), 60)
        if message.type == aiohttp.WSMsgType.BINARY:
            self.pcm += message.data
            return {"type": "audio"}
        if message.type == aiohttp.WSMsgType.TEXT:
            self.events.append(message.json())
            return self.events[-1]
        return None

    async def finish(self) -> None:
        await self.ws.send_json({"type": "input.text", "text": " the text."})
        await self.ws.send_json({"type": "input.done"})
        while (event := await self.next()) is None or event["type"] != "session.done":
            assert event is not None and event["type"] != "error", self.events
        await self.ws.send_json({"type": "session.close"})
        assert await self.next() is None

    async def ended(self) -> list[dict]:
        """Read until the server closes the connection; the events it sent."""
        while await self.next() is not None:
            pass
        return self.events


async def http_stream(http: aiohttp.ClientSession, url: str, started: asyncio.Event) -> bytes:
    """A raw PCM stream of a text that runs to the model's length limit; `started` at its first bytes."""
    payload = {"model": MODEL, "input": RUNS_TO_ITS_LIMIT, "voice": "ryan", "response_format": "pcm",
               "stream_format": "audio", **GREEDY}
    async with http.post(url + "/v1/audio/speech", json=payload) as response:
        assert response.status == 200
        body = await response.content.readany()
        started.set()
        return body + await response.content.read()


async def narrated_sse(http: aiohttp.ClientSession, url: str, started: asyncio.Event) -> list[dict]:
    """The events of an SSE narration of NARRATED until the server ends the stream; `started` at its first."""
    payload = {"model": MODEL, "input": NARRATED, "voice": "ryan", "response_format": "pcm", "stream_format": "sse",
               **GREEDY}
    events, pending = [], b""
    async with http.post(url + "/v1/audio/speech", json=payload) as response:
        assert response.status == 200
        async for data in response.content.iter_any():   # an audio delta's line outgrows readline's limit
            *whole, pending = (pending + data).split(b"\n\n")
            events += [json.loads(event.split(b"\ndata: ", 1)[1]) for event in whole]
            if events:
                started.set()
    return events


async def narrated_whole(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    """The status and JSON body of a request for the whole file of NARRATED."""
    payload = {"model": MODEL, "input": NARRATED, "voice": "ryan", "response_format": "pcm", **GREEDY}
    async with http.post(url + "/v1/audio/speech", json=payload) as response:
        return response.status, await response.json()


async def segments_started(url: str) -> float:
    """omni_tts_narration_segments_total{event="started"} of the server at `url`."""
    status, _, body = await asyncio.get_running_loop().run_in_executor(None, request, url + "/metrics")
    match = re.search(r'^omni_tts_narration_segments_total\{event="started"\} (\S+)$', body.decode(), re.M)
    return float(match.group(1)) if match else 0.0


async def held_body(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A speech request whose body has not all arrived: its handler runs (the server said `100 Continue`, which it
    says on entering the handler), waiting for the rest."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\nExpect: 100-continue\r\n\r\n{")
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)).startswith(b"HTTP/1.1 100 Continue")
    return reader, writer


def access_lines(output: str, path: str) -> list[tuple[str, str, str]]:
    """(id, status, details) of each HTTP access-log line for `path`."""
    return [(rid, status, details) for rid, method, line_path, status, details in ACCESS.findall(output)
            if line_path == path and method == "POST"]


def test_second_ctrl_c_ends_the_streams_at_once():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL)
    pid = server.proc.pid
    try:
        async def main():
            async with aiohttp.ClientSession() as http:
                whole = asyncio.create_task(narrated_whole(http, server.url))
                await eventually_async(lambda: segments_started(server.url), what="the whole file's narration")
                held = [await HeldUtterance.open(http, server.url) for _ in range(NUM_HELD)]
                started = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(http_stream(http, server.url, s)) for s in started[:2]]
                sse = asyncio.create_task(narrated_sse(http, server.url, started[2]))
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
                body_reader, _ = await held_body(server.port)
                assert shm_segments(pid)  # the ring the stages share while they serve
                ctrl_c(server)
                drain = await eventually_async(lambda: drain_line(server), what="the drain line")
                assert int(drain.group(1)) >= len(held)  # the held utterances cannot have finished
                await asyncio.get_running_loop().run_in_executor(None, assert_refused, server)
                ctrl_c(server)
                status = await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 30)
                assert status == 130
                for utterance in held:  # an error event, then the server closes the connection
                    events = await utterance.ended()
                    assert events[-1]["type"] == "error" and "shutting down" in events[-1]["message"], events
                for stream in streams:
                    # a stream still running is cut by closing the connection before the chunked body's end:
                    # the client sees an incomplete body (aiohttp: ClientPayloadError), never audio that merely
                    # stops; one that finished before the second Ctrl+C is whole
                    try:
                        await stream
                    except aiohttp.ClientPayloadError:
                        pass
                # a narration ends as one request does: its SSE stream with an error event, its whole file a 503
                events = await sse
                assert events[-1]["type"] == "speech.audio.error", events[-1]
                assert events[-1]["error"]["code"] == "service_unavailable", events[-1]
                assert ENGINE_STOPPING in events[-1]["error"]["message"], events[-1]
                status, body = await whole
                assert status == 503 and body["error"]["code"] == "service_unavailable", (status, body)
                assert ENGINE_STOPPING in body["error"]["message"], body
                assert await body_reader.read() == b""   # the request without its body: closed unanswered
        asyncio.run(main())
    finally:
        output = server.stop()
    assert "Traceback" not in output, output
    assert len(DRAIN.findall(output)) == 1, output
    assert shm_segments(pid) == [] and stage_pids(pid) == []
    # each request has its line: the raw streams' and the SSE narration's 200 (the status they were sent), the whole
    # file's and assert_refused's 503, and `shutdown` for the request the stop cut before its body arrived
    statuses = sorted(status for _, status, _ in access_lines(output, "/v1/audio/speech"))
    assert statuses == ["200"] * 3 + ["503"] * 2 + ["shutdown"], output
    # each session a line at its end (its utterance ended by the stop's error event), each utterance its own
    sessions = SESSION.findall(output)
    assert sorted(outcome for _, _, outcome in sessions) == ["error:503"] * NUM_HELD, output
    assert all(count == "1" for _, count, _ in sessions), output
    utterances = UTTERANCE.findall(output)
    assert sorted((rid, index, status) for rid, index, status, _, _ in utterances) == sorted(
        (rid, "0", "503") for rid, _, _ in sessions), output
    assert all(audio != "-" and ttfp != "-" for _, _, _, audio, ttfp in utterances), output


@pytest.mark.parametrize("first", ["ctrl-c", "sigterm"])
def test_first_ctrl_c_lets_the_streams_finish(first):
    """SIGTERM (what Kubernetes sends the server's process alone) drains as the first Ctrl+C does."""
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL)
    try:
        async def main():
            async with aiohttp.ClientSession() as http:
                assert_get_is_405(server)
                _, writer = await held_body(server.port)
                writer.close()   # the client goes away: its request is cut, and logged so
                await eventually_async(lambda: access_lines(server.output(), "/v1/audio/speech"),
                                       what="the access-log line of the request its client left")
                whole = await http_stream(http, server.url, asyncio.Event())
                held = [await HeldUtterance.open(http, server.url) for _ in range(2)]
                started = asyncio.Event()
                stream = asyncio.create_task(http_stream(http, server.url, started))
                await asyncio.wait_for(started.wait(), 60)
                ctrl_c(server) if first == "ctrl-c" else server.proc.terminate()
                drain = await eventually_async(lambda: drain_line(server), what="the drain line")
                assert int(drain.group(1)) >= len(held)
                await asyncio.get_running_loop().run_in_executor(None, assert_refused, server)
                assert server.proc.poll() is None  # the held utterances keep it running
                for utterance in held:
                    held_bytes = len(utterance.pcm)
                    await utterance.finish()
                    done = next(e for e in utterance.events if e["type"] == "audio.done")
                    assert done["total_bytes"] == len(utterance.pcm) > held_bytes  # the rest of its text spoken
                # greedy: the whole stream (within the last bit a batch of other rows may move, as everywhere)
                assert_pcm_close(await stream, np.frombuffer(whole, "<i2"))
                assert await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 30) == 0
        asyncio.run(main())
    finally:
        output = server.stop()
    assert "Traceback" not in output, output
    assert len(DRAIN.findall(output)) == 1, output
    assert access_lines(output, "/v1/audio/speech")[0][1] == "disconnect", output
    # each session closed by its client, its one utterance spoken whole
    sessions = SESSION.findall(output)
    assert [(count, outcome) for _, count, outcome in sessions] == [("1", "closed")] * 2, output
    assert sorted((rid, index, status) for rid, index, status, _, _ in UTTERANCE.findall(output)) == sorted(
        (rid, "0", "200") for rid, _, _ in sessions), output


def test_health_is_503_while_loading_and_ctrl_c_then_is_one_line(tmp_path):
    """Loading is held by state: the speech tokenizer's config is a FIFO nobody writes, so both stages wait in its
    open() while the server must already answer."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny-custom-voice", model)
    os.remove(model / "speech_tokenizer" / "config.json")
    os.mkfifo(model / "speech_tokenizer" / "config.json")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--port", str(port),
                            "--model", str(model)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def both_spawned() -> list[int]:  # they block on the FIFO while loading
            assert proc.poll() is None
            return len(pids := stage_pids(proc.pid)) == 2 and pids
        stages = eventually(both_spawned, what="both stages spawned")
        for stage in stages:  # SIGINT never reaches a stage: blocked from its fork, then ignored
            with open(f"/proc/{stage}/status") as f:
                masks = dict(line.split(":\t") for line in f.read().splitlines() if line.startswith("Sig"))
            assert (int(masks["SigBlk"], 16) | int(masks["SigIgn"], 16)) & (1 << (signal.SIGINT - 1)), masks
        for path in ("/health", "/v1/models", "/v1/audio/speech"):  # answered while the load cannot end
            status, headers, body = request(url + path, {"input": "x"} if path.endswith("speech") else None)
            assert status == 503 and headers["Retry-After"] == "5", (path, status, body)
            assert b'"message": "the server is loading the model; retry shortly"' in body, body
        for pid in [proc.pid, *stage_pids(proc.pid)]:
            os.kill(pid, signal.SIGINT)
        assert proc.wait(30) == 130
        output = proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in output.splitlines() if " INFO " not in line]
    assert len(lines) == 1 and "stopped while loading (SIGINT)" in lines[0], output
    assert "Traceback" not in output and shm_segments(proc.pid) == [] and stage_pids(proc.pid) == []


@pytest.mark.parametrize("args,message", [
    (["--bogus-flag", "1"], "omni-tts serve: error: unrecognized arguments: --bogus-flag 1"),
    (["--model", "nobody/no-such-model"], "omni-tts serve: error: model 'nobody/no-such-model' is not a local "
                                          "directory and could not be downloaded from the Hugging Face Hub"),
])
def test_cli_errors_are_one_line(args, message):
    result = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--port", str(free_port()),
                             *args], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 2, result
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""
