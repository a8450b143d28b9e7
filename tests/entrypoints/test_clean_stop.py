"""A clean start and a clean stop (issue 23), on a real server process: /health answers 503 while the model loads;
the first Ctrl+C drains (one line naming the streams it waits for, new requests refused 503, the streams finish,
exit 0); a second one ends them at once (each client's stream ends, no traceback, nothing left in /dev/shm, exit
130); Ctrl+C while loading is one line and exit 130; the CLI's usage and model errors are one line; GET on
the speech route is 405. Streams are held in flight by state: a WebSocket token-mode
utterance whose text has not ended cannot finish until its client sends the rest."""
import asyncio
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


def test_second_ctrl_c_ends_the_streams_at_once():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL)
    pid = server.proc.pid
    try:
        async def main():
            async with aiohttp.ClientSession() as http:
                held = [await HeldUtterance.open(http, server.url) for _ in range(3)]
                started = [asyncio.Event() for _ in range(2)]
                streams = [asyncio.create_task(http_stream(http, server.url, s)) for s in started]
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
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
        asyncio.run(main())
    finally:
        output = server.stop()
    assert "Traceback" not in output, output
    assert len(DRAIN.findall(output)) == 1, output
    assert shm_segments(pid) == [] and stage_pids(pid) == []


@pytest.mark.parametrize("first", ["ctrl-c", "sigterm"])
def test_first_ctrl_c_lets_the_streams_finish(first):
    """SIGTERM (what Kubernetes sends the server's process alone) drains as the first Ctrl+C does."""
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL)
    try:
        async def main():
            async with aiohttp.ClientSession() as http:
                assert_get_is_405(server)
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
