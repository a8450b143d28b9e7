"""`omni-tts serve-ray` (issue 13) as a user runs it: a local Ray instance, two replicas of the tiny Base model and
one front end on a loopback port. Concurrent greedy requests — whole, streamed, SSE and a WebSocket session — each
equal offline synthesis (as `omni-tts serve`'s answers do), both replicas serve, a voice uploaded once speaks from
every replica, a replica's refusal has the server's error envelope, and a replica killed with kill -9 under load
fails only its own requests, is replaced by Ray, and serves again. One Ray instance and one server for all of it
(about a minute on two cores): the `ray` extra is in the `test` extra, so CI runs it."""
import asyncio
import base64
import json
import os
import signal
import time

import aiohttp
import numpy as np
import pytest

from conftest import FIXTURES
from omni_tts.config import available_cpus
from server_util import ServerProcess, request, stage_pids
from test_server import GREEDY, offline_pcm
from waiting import RESTART_TIMEOUT, eventually, eventually_async

pytest.importorskip("ray.serve")

MODEL = "qwen3-tts"
TEXTS = ["Replicas speak alike.", "One front end, two pipelines.", "Greedy means the same audio.",
         "A voice uploaded once is heard everywhere."]
LONG = dict(GREEDY, max_new_tokens=200, repetition_penalty=1.0)  # runs seconds: still going when the kill comes
REF_TEXT = (FIXTURES / "ref_voice.txt").read_text().strip()
VOICE = "fox"
BAD_LANGUAGE = "klingon"  # refused by the tokenizer: inside a replica under serve-ray


def upload_voice(server: ServerProcess) -> None:
    boundary = "omnittsboundary"
    fields = [(b"name", VOICE.encode()), (b"ref_text", REF_TEXT.encode()), (b"consent", b"yes")]
    body = b"".join(b"--" + boundary.encode() + b'\r\nContent-Disposition: form-data; name="' + k + b'"\r\n\r\n' + v +
                    b"\r\n" for k, v in fields)
    body += (b"--" + boundary.encode() + b'\r\nContent-Disposition: form-data; name="audio_sample"; filename="a.wav"'
             b"\r\nContent-Type: audio/wav\r\n\r\n" + (FIXTURES / "ref_voice.wav").read_bytes() + b"\r\n--" +
             boundary.encode() + b"--\r\n")
    status, _, answer = request(server.url + "/v1/audio/voices", data=body,
                                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, answer


def payload(text: str, **fields) -> dict:
    return dict(dict(GREEDY, model=MODEL, input=text, voice=VOICE, language="english", response_format="pcm"),
                **fields)


def as_pcm(mode: str, body: bytes) -> bytes:
    if mode != "sse":
        return body
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")


async def speak(http: aiohttp.ClientSession, server: ServerProcess, text: str, mode: str,
                **fields) -> tuple[int, str | None, bytes]:
    """(status, replica, PCM or error body) of one HTTP request: mode whole, stream (raw PCM) or sse."""
    extra = {"whole": {}, "stream": {"stream_format": "audio"}, "sse": {"stream_format": "sse"}}[mode]
    async with http.post(server.url + "/v1/audio/speech", json=payload(text, **extra, **fields)) as response:
        body = await response.read()
        pcm = as_pcm(mode, body) if response.status == 200 else body
        return response.status, response.headers.get("x-omni-tts-replica"), pcm


async def long_stream(http: aiohttp.ClientSession, server: ServerProcess, text: str,
                      started: asyncio.Queue) -> tuple[int, str | None, bytes]:
    """A streamed request that runs for seconds; its replica goes into `started` once its audio is flowing."""
    async with http.post(server.url + "/v1/audio/speech", json=payload(text, stream_format="audio", **LONG)) as response:
        replica = response.headers.get("x-omni-tts-replica")
        started.put_nowait(replica)
        return response.status, replica, await response.read()


async def ws_utterance(http: aiohttp.ClientSession, server: ServerProcess, text: str) -> bytes:
    """A token-mode session: the text in pieces cut inside words, with pauses; its streamed PCM."""
    async with http.ws_connect(server.url + "/v1/audio/speech/stream") as ws:
        config = {k: v for k, v in payload("").items() if k != "input"}
        await ws.send_json(dict(config, type="session.config", stream_audio=True))
        cuts = [0, 3, 9, 10, 17, len(text)]
        for start, end in zip(cuts, cuts[1:]):
            await ws.send_json({"type": "input.text", "text": text[start:end]})
            await asyncio.sleep(0.15)
        await ws.send_json({"type": "input.done"})
        pcm = b""
        async for message in ws:
            if message.type == aiohttp.WSMsgType.BINARY:
                pcm += message.data
                continue
            event = json.loads(message.data)
            assert event["type"] != "error", event
            if event["type"] == "session.done":
                return pcm
    raise AssertionError("the session closed before session.done")


def assert_pcm_close(pcm: bytes, expected: bytes) -> None:
    got, want = np.frombuffer(pcm, "<i2").astype(np.int32), np.frombuffer(expected, "<i2").astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1


def replica_pids(app: str) -> list[int]:
    """The replica actors' processes (Ray titles them `ray::ServeReplica:<app>:<deployment>`)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(f"ray::ServeReplica:{app}:".encode()):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def in_flight(server: ServerProcess) -> float:
    text = request(server.url + "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("omni_tts_in_flight "))


@pytest.fixture(scope="module")
def expected() -> dict[str, bytes]:
    """Each text's PCM offline, the uploaded voice's clip and transcript speaking."""
    return {text: offline_pcm("tiny-base", text=text, ref_audio=str(FIXTURES / "ref_voice.wav"), ref_text=REF_TEXT,
                              language="english").tobytes() for text in TEXTS}


def test_two_replicas_answer_as_one_server_and_survive_a_killed_replica(expected, tmp_path):
    app = f"omni-tts-test-{os.getpid()}"
    started = time.monotonic()
    # the two replicas share the cores there are: one each on 2 cores, half of the one on a single core
    cpus = min(1.0, available_cpus() / 2)
    server = ServerProcess("--replicas", "2", "--cpus-per-replica", f"{cpus:g}", "--app-name", app,
                           "--model", str(FIXTURES / "tiny-base"),
                           "--served-model-name", MODEL, "--voices-dir", str(tmp_path / "voices"),
                           subcommand="serve-ray", startup_timeout=300)
    timings = {"start": time.monotonic() - started}
    try:
        assert "through Ray Serve application" in server.output()
        assert len(replica_pids(app)) == 2
        upload_voice(server)  # once, through the front end: every replica gets the voice inside each request

        async def sixteen() -> list:
            async with aiohttp.ClientSession() as http:
                modes = ["whole", "stream", "sse"]
                return await asyncio.gather(
                    *(speak(http, server, TEXTS[i % 4], modes[i % 3]) for i in range(15)),
                    ws_utterance(http, server, TEXTS[3]))
        at = time.monotonic()
        answers = asyncio.run(sixteen())
        timings["16 requests"] = time.monotonic() - at
        for i, (status, replica, pcm) in enumerate(answers[:15]):
            assert status == 200, pcm[:300]
            assert_pcm_close(pcm, expected[TEXTS[i % 4]])
        assert_pcm_close(answers[15], expected[TEXTS[3]])
        replicas = {replica for _, replica, _ in answers[:15]}
        assert len(replicas) == 2 and None not in replicas, replicas
        status, _, body = request(server.url + "/v1/audio/speech", payload(TEXTS[0], language=BAD_LANGUAGE))
        error = json.loads(body)["error"]  # a replica's refusal: the envelope `omni-tts serve` answers (test_server)
        assert status == 400 and set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error" and "unsupported language 'klingon'" in error["message"]

        victim = replica_pids(app)[0]
        victim_stages = stage_pids(victim)
        assert len(victim_stages) == 2

        async def kill_under_load() -> tuple[list, list]:
            async with aiohttp.ClientSession() as http:
                started: asyncio.Queue[str] = asyncio.Queue()
                loaded, busy = [], set()
                while len(busy) < 2 and len(loaded) < 16:  # until both replicas are streaming audio
                    batch = [asyncio.create_task(long_stream(http, server, TEXTS[i % 4], started)) for i in range(4)]
                    loaded += batch
                    for _ in batch:
                        busy.add(await asyncio.wait_for(started.get(), 60))
                assert len(busy) == 2, busy
                loaded += [asyncio.create_task(speak(http, server, text, "whole", **LONG)) for text in TEXTS[:2]]
                async def all_admitted() -> bool:  # or already done
                    return await asyncio.to_thread(in_flight, server) + sum(t.done() for t in loaded) >= len(loaded)
                await eventually_async(all_admitted, what="every request admitted")
                os.kill(victim, signal.SIGKILL)
                during = await asyncio.gather(*loaded, return_exceptions=True)
                after = await asyncio.gather(*(speak(http, server, text, "whole") for text in TEXTS))
                return during, after
        at = time.monotonic()
        during, after = asyncio.run(kill_under_load())
        # the killed replica's requests fail as a dead stage's do (503, or a cut stream); the other's finish
        failed = [r for r in during if isinstance(r, BaseException) or r[0] != 200]
        assert failed and len(failed) < len(during), during
        for r in failed:
            assert isinstance(r, aiohttp.ClientPayloadError) or (
                r[0] == 503 and "the replica serving this request died" in json.loads(r[2])["error"]["message"]), r
        for text, (status, replica, pcm) in zip(TEXTS, after):
            assert status == 200, pcm[:300]
            assert_pcm_close(pcm, expected[text])
        eventually(lambda: not any(map(alive, victim_stages)), what="the stages saw their parent die and left")

        # Ray starts a replica in the killed one's place; it serves the voice as well
        served_by = set()

        def a_new_replica_served() -> bool:
            async def four() -> list:
                async with aiohttp.ClientSession() as http:
                    return await asyncio.gather(*(speak(http, server, text, "stream") for text in TEXTS))
            for text, (status, replica, pcm) in zip(TEXTS, asyncio.run(four())):
                assert status == 200, pcm[:300]
                assert_pcm_close(pcm, expected[text])
                served_by.add(replica)
            return bool(served_by - replicas)
        eventually(a_new_replica_served, 2 * RESTART_TIMEOUT, "a new replica serving", interval=0.5)
        timings["replacement"] = time.monotonic() - at
        assert len(replica_pids(app)) == 2 and victim not in replica_pids(app)
        print("serve-ray timings (s):", {name: round(seconds, 1) for name, seconds in timings.items()})
    finally:
        output = server.stop()
    assert server.proc.returncode == 0, output[-3000:]
    assert replica_pids(app) == []
