"""Supervision and self-healing (issue 10): real stage processes, real faults — kill -9, SIGSTOP, a corrupt ring
chunk, an exception in the orchestrator's event task, a slow consumer, a killed server process. Every fault fails
the in-flight requests fast, the pipeline restarts by itself, and a greedy request afterwards equals its golden.
The faults that need no settings of their own share one pipeline (a start is seconds): it recovers from each."""
import asyncio
import contextlib
import http.client
import json
import mmap
import os
import signal
import struct
import time

import _posixshmem
import msgspec
import numpy as np
import pytest
import pytest_asyncio
import zmq

from conftest import FIXTURES, GOLDEN_CASES, RUNS_TO_ITS_LIMIT, case_arrays, case_requests, stage_config
from omni_tts.config import PipelineConfig, load_stage_config, stage_config_from_dict
from omni_tts.config.settings import SupervisionSettings
from omni_tts.connectors import FLAG_IS_LAST
from omni_tts.connectors.shm_ring import HEADER_BYTES
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.types import RequestFailed, RequestTimedOut, StageDeadError
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams
from omni_tts.stages.messages import Register
from server_util import ServerProcess, stage_pids
from waiting import RESTART_TIMEOUT, SHARED_PIPELINE, eventually, eventually_async

CASE = next(c for c in GOLDEN_CASES if c["variant"] == "tiny-custom-voice")

GREEDY = SamplingParams(temperature=0, repetition_penalty=1.0, max_new_tokens=400)
# a text whose end never comes: the talker speaks what it has, then parks the row until more text arrives, so the
# request stays in flight in both stages until the test ends it (held by state, not by the machine's speed)
HELD_TEXT = "A sentence that waits for the rest of"


def long_requests(n: int) -> list[SynthesisRequest]:
    return [SynthesisRequest(text="A sentence that runs for a while.", voice="ryan", sampling=GREEDY)
            for _ in range(n)]


async def collect(engine: AsyncTTS, request: SynthesisRequest) -> np.ndarray:
    return np.concatenate([c.audio async for c in engine.generate(request)])


class HeldRequest:
    """A request held in flight by its unfinished text; `started` is set at its first audio. `finish()` sends the
    rest of its text so that it can end; `task` collects its audio (or raises what ended it)."""

    def __init__(self, engine: AsyncTTS, request_id: str | None = None) -> None:
        self.engine, self.request_id = engine, request_id
        self.started = asyncio.Event()
        self.stream = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> np.ndarray:
        self.stream = await self.engine.open_text_stream(SynthesisRequest(text="", voice="ryan", sampling=GREEDY),
                                                         request_id=self.request_id, idle_timeout=600)
        async with self.stream:
            await self.stream.append(HELD_TEXT)
            audio = []
            async for chunk in self.stream:
                audio.append(chunk.audio)
                self.started.set()
            return np.concatenate(audio)

    async def finish(self) -> None:
        await self.stream.append(" the text.")
        await self.stream.finish()


async def hold(engine: AsyncTTS, n: int) -> list[HeldRequest]:
    """n requests, each running (its first audio arrived) and unable to end until the test acts."""
    held = [HeldRequest(engine) for _ in range(n)]
    await asyncio.wait_for(asyncio.gather(*(h.started.wait() for h in held)), 60)
    assert not any(h.task.done() for h in held)
    return held


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def shm_blocks(owner_pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"omni_tts_{owner_pid}_")]


@contextlib.asynccontextmanager
async def pipeline(config: str | PipelineConfig = "cpu_tiny", **engine_kwargs):
    """A started engine of tiny-custom-voice; at its shutdown none of its processes or shared memory is left."""
    before = set(shm_blocks(os.getpid()))
    engine = AsyncTTS(str(FIXTURES / "tiny-custom-voice"),
                      load_stage_config(config) if isinstance(config, str) else config, **engine_kwargs)
    await engine.start()
    try:
        yield engine
    finally:
        pids = engine.stage_pids()
        await engine.shutdown()
    assert not any(alive(pid) for pid in pids.values())
    assert set(shm_blocks(os.getpid())) - before == set()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    """The module's pipeline for the faults that need no settings of their own (fewer than its restart limit)."""
    async with pipeline(**SHARED_PIPELINE) as engine:
        yield engine


async def fault_then_recover(engine: AsyncTTS, fault, reason: str = "") -> None:
    """Hold 4 requests in flight, inject `fault(engine)`, and check: every in-flight request fails with an error that
    names the failed stage and `reason` (held with no deadline of their own, only the supervisor can have ended
    them), requests during recovery are refused, the pipeline is healthy again, restarted once, without the failed
    pipeline's processes, and a greedy request equals its golden audio."""
    old_pids, restarts = engine.stage_pids(), engine.restarts.copy()
    tasks = [h.task for h in await hold(engine, 4)]
    expected_stage = fault(engine)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
    assert all(isinstance(r, StageDeadError) for r in results), results
    assert all(str(r).startswith(f"stage {expected_stage} failed: {reason}") for r in results), results
    assert engine.restarts[expected_stage] > restarts[expected_stage] or engine.down == expected_stage
    if not engine.is_healthy:
        with pytest.raises(StageDeadError, match="restarting"):
            await collect(engine, long_requests(1)[0])
    await eventually_async(lambda: engine.is_healthy, RESTART_TIMEOUT,
                           lambda: f"healthy again: {engine.down, engine.down_reason, engine.fatal}")
    assert engine.restarts - restarts == {expected_stage: 1}
    assert not any(alive(pid) for pid in old_pids.values())  # the failed pipeline's processes are gone
    audio = await collect(engine, case_requests(CASE)[0])
    np.testing.assert_allclose(audio, case_arrays(CASE)["wav_0"], atol=1e-4, rtol=0)


async def fault_then_recover_alone(fault, reason: str, config: str | PipelineConfig = "cpu_tiny",
                                   **engine_kwargs) -> None:
    """`fault_then_recover` on a pipeline of its own, with these settings."""
    async with pipeline(config, **engine_kwargs) as engine:
        await fault_then_recover(engine, fault, reason)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("stage", ["talker", "code2wav"])
async def test_killed_stage_fails_requests_fast_and_the_pipeline_restarts(engine, stage):
    def kill(engine):
        os.kill(engine.stage_pids()[stage], signal.SIGKILL)
        return stage
    await fault_then_recover(engine, kill, reason="killed by signal SIGKILL")


@pytest.mark.parametrize("fault", ["kill", "code2wav control"])
def test_the_fused_process_fails_whole_names_the_stage_and_restarts(fault):
    """The fused layout (connector kind local): one process, both stages. A kill ends both and is reported as the
    talker's (the process's main thread); code2wav's loop failing on its own thread ends the process with code2wav
    named (a command it cannot decode: its control thread fails, then its loop)."""
    def inject(engine):
        pids = engine.stage_pids()
        assert pids["talker"] == pids["code2wav"]
        if fault == "kill":
            os.kill(pids["talker"], signal.SIGKILL)
            return "talker"
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
            sock.connect(engine.supervisor._launches["code2wav"].command_address)
            sock.send(b"\xc1 not msgpack")
            sock.close(linger=1000)
        return "code2wav"
    reason = "killed by signal SIGKILL" if fault == "kill" else "ThreadFailed: code2wav control thread failed"
    asyncio.run(fault_then_recover_alone(inject, reason, stage_config("local")))


def test_stopped_stage_is_declared_hung_killed_and_restarted():
    stopped = []

    def stop(engine):
        stopped.append(engine.stage_pids()["code2wav"])
        os.kill(stopped[0], signal.SIGSTOP)
        return "code2wav"
    asyncio.run(fault_then_recover_alone(stop, "hung: no heartbeat",
                                         supervision=SupervisionSettings(heartbeat_timeout=1.5)))
    assert not alive(stopped[0])


def test_a_connector_out_of_slots_restarts_the_pipeline():
    """code2wav stopped while its heartbeats are not yet missed: the talker's chunks fill the 4 slots and wait. A
    connector without a free slot for connector_stall_timeout counts as hung, as lost slots would: the pipeline
    restarts (which gets the slots back) instead of every request timing out while /health says 200."""
    data = msgspec.to_builtins(load_stage_config("cpu_tiny"))
    data["connector"]["ring_slots"] = 4
    config = stage_config_from_dict(data, "cpu_tiny with 4 ring slots")

    fillers = []

    def stop(engine):
        os.kill(engine.stage_pids()["code2wav"], signal.SIGSTOP)
        # the held requests may have made all the chunks their text allows: these run to the model's length limit,
        # chunk after chunk, whatever their timing
        fillers.extend(asyncio.ensure_future(collect(engine, SynthesisRequest(text=RUNS_TO_ITS_LIMIT, voice="ryan",
                                                                                sampling=GREEDY)))
                       for _ in range(2))
        return "talker"

    async def main():
        await fault_then_recover_alone(
            stop, "hung: its connector has had no free slot", config,
            supervision=SupervisionSettings(heartbeat_timeout=3600.0, connector_stall_timeout=1.0))
        assert all(isinstance(r, StageDeadError) for r in await asyncio.gather(*fillers, return_exceptions=True))
    asyncio.run(main())


@pytest.mark.asyncio(loop_scope="module")
async def test_corrupt_ring_chunk_fails_the_stage_and_the_pipeline_restarts(engine):
    """A chunk header the reader cannot parse: its slot goes back to the writer and the stage fails loudly
    (its request would otherwise wait forever for a chunk that was dropped)."""
    def corrupt(engine):
        spec = engine.connector_spec
        slot = spec.num_slots - 1  # far from the slots 4 requests use
        fd = _posixshmem.shm_open("/" + spec.name, os.O_RDWR, mode=0o600)
        with mmap.mmap(fd, spec.total_bytes) as mm:
            struct.pack_into("<I", mm, slot * spec.slot_bytes + 16, 0xFFFFFFFF)  # num_frames beyond max_frames
        os.close(fd)
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
            sock.connect(spec.notify_address)
            sock.send(struct.pack("<I", slot))
            sock.close(linger=1000)
        return "code2wav"
    await fault_then_recover(engine, corrupt, reason="ThreadFailed: code2wav connector thread failed")


@pytest.mark.asyncio(loop_scope="module")
async def test_codes_out_of_range_fail_one_request_not_the_stage(engine):
    """A chunk whose codes the decoder cannot look up (as fuzzing once produced) fails its own request with a clear
    error; the requests batched beside it finish, and no stage dies or restarts."""
    pids, restarts = engine.stage_pids(), engine.restarts.copy()
    others = await hold(engine, 2)
    victim = engine.client.add("victim", 0)   # its chunks are forged: its first one holds the bad codes
    await engine.client.send(victim, "code2wav", Register("victim"))
    # the ring hands its slots out in order and these short requests used a few: its last one, which the forged
    # chunk takes, is free on both sides; the talker is held still so that it stays so
    assert (await engine.stats())["code2wav"].connector_chunks < engine.connector_spec.num_slots // 2
    os.kill(pids["talker"], signal.SIGSTOP)
    try:
        forge_chunk(engine, "victim", np.full((4, 16), 4096, np.int32))
        with pytest.raises(RequestFailed, match=r"code2wav cannot decode its codes: chunk 0 \(generated\): "
                           r"codes in \[4096, 4096\]"):
            await asyncio.wait_for(anext(engine.client.outputs(victim)), 30)
    finally:
        os.kill(pids["talker"], signal.SIGCONT)
    await engine.client.release(victim)
    for other in others:
        await other.finish()
    for audio in await asyncio.wait_for(asyncio.gather(*(h.task for h in others)), 60):
        assert audio.size > 0
    assert engine.is_healthy and engine.restarts == restarts and engine.stage_pids() == pids
    audio = await collect(engine, case_requests(CASE)[0])
    np.testing.assert_allclose(audio, case_arrays(CASE)["wav_0"], atol=1e-4, rtol=0)


def forge_chunk(engine: AsyncTTS, request_id: str, codes: np.ndarray, seq: int = 0, is_last: bool = False) -> None:
    """Write chunk `seq` of `request_id` into the ring's last slot and notify code2wav, as the talker would."""
    spec = engine.connector_spec
    slot = spec.num_slots - 1
    fd = _posixshmem.shm_open("/" + spec.name, os.O_RDWR, mode=0o600)
    with mmap.mmap(fd, spec.total_bytes) as mm:
        offset = slot * spec.slot_bytes
        mm[offset + HEADER_BYTES:offset + HEADER_BYTES + codes.nbytes] = codes.tobytes()
        raw_id = request_id.encode()
        struct.pack_into("<qqIIH64s", mm, offset, seq, time.monotonic_ns(), codes.shape[0],
                         FLAG_IS_LAST if is_last else 0, len(raw_id), raw_id)
    os.close(fd)
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
        sock.connect(spec.notify_address)
        sock.send(struct.pack("<I", slot))
        sock.close(linger=1000)


@pytest.mark.asyncio(loop_scope="module")
async def test_exception_in_the_event_task_fails_requests_and_the_pipeline_restarts(engine):
    def garbage_event(engine):
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
            sock.connect(engine.event_address)
            sock.send(b"\xc1 not msgpack")
            sock.close(linger=1000)
        return "orchestrator"
    await fault_then_recover(engine, garbage_event, reason="DecodeError: ")


def test_restarts_beyond_the_limit_make_the_engine_give_up():
    async def main():
        engine = AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny"),
                          SupervisionSettings(max_restarts=1))
        fatal = []
        engine.on_fatal = fatal.append
        await engine.start()
        try:
            for _ in range(2):
                await eventually_async(lambda: engine.is_healthy or fatal, RESTART_TIMEOUT, "healthy (or given up)")
                os.kill(engine.stage_pids()["talker"], signal.SIGKILL)
                await eventually_async(lambda: engine.down is not None or fatal, what="the engine seeing the failure")
            await eventually_async(lambda: fatal, RESTART_TIMEOUT, "the engine giving up")
            assert "restarts" in fatal[0] and engine.fatal == fatal[0]
            assert not engine.is_healthy
            with pytest.raises(StageDeadError, match="for good"):
                await collect(engine, long_requests(1)[0])
        finally:
            await engine.shutdown()
    asyncio.run(main())


def test_slow_consumer_is_failed_instead_of_buffered():
    async def main():
        async with AsyncTTS(str(FIXTURES / "tiny-custom-voice"), load_stage_config("cpu_tiny"),
                            max_buffered_seconds=1.0) as engine:
            request = SynthesisRequest(text=RUNS_TO_ITS_LIMIT, voice="ryan", sampling=SamplingParams(
                temperature=0, repetition_penalty=1.0, max_new_tokens=2000))  # 15 s of audio
            stream = engine.generate(request, request_id="slow")
            await anext(stream)
            # the client stops reading; the stages keep producing until the engine fails the request
            await eventually_async(lambda: "slow" not in engine.requests, what="the slow request failed")
            with pytest.raises(RequestFailed, match="too slowly"):
                async for _ in stream:
                    pass
            assert engine.requests == {}
            await wait_until_no_stage_holds_requests(engine)  # aborted in both stages
            assert engine.is_healthy
    asyncio.run(main())


async def wait_until_no_stage_holds_requests(engine: AsyncTTS) -> None:
    async def none_held() -> bool:
        return not any(s.request_ids for s in (await engine.stats()).values())
    await eventually_async(none_held, what="no stage holding a request")


@pytest.mark.asyncio(loop_scope="module")
async def test_request_deadlines_end_and_abort_the_request(engine):
    # a deadline already past when the request is sent: it expires before any audio can come back
    with pytest.raises(RequestTimedOut, match="no audio within 0 s") as late:
        await collect_with(engine, long_requests(1)[0], first_audio_timeout=0)
    assert late.value.before_first_audio
    await wait_until_no_stage_holds_requests(engine)
    chunks = []
    # its text never ends, so only the deadline can end it; the first audio comes long before 3 s
    stream = await engine.open_text_stream(SynthesisRequest(text="", voice="ryan", sampling=GREEDY),
                                           first_audio_timeout=30, timeout=3, idle_timeout=600)
    await stream.append(HELD_TEXT)
    with pytest.raises(RequestTimedOut, match="did not finish within 3 s") as long:
        async for chunk in stream:
            chunks.append(chunk)
    await stream.aclose()
    assert chunks and not long.value.before_first_audio
    await wait_until_no_stage_holds_requests(engine)
    assert engine.requests == {} and engine.is_healthy


async def collect_with(engine: AsyncTTS, request: SynthesisRequest, **kwargs) -> list:
    return [c async for c in engine.generate(request, **kwargs)]


# --- the HTTP server ------------------------------------------------------------------------------------------
def test_killed_server_process_takes_its_stages_and_shared_memory_along():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"))
    pids = stage_pids(server.proc.pid)
    assert len(pids) == 2 and shm_blocks(server.proc.pid)
    server.proc.kill()
    server.proc.wait()
    eventually(lambda: not any(alive(p) for p in pids), what="the stages gone")
    eventually(lambda: shm_blocks(server.proc.pid) == [], what="the shared memory gone")


def _health(port: int) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def _talker_steps(port: int) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('omni_tts_stage_steps_total{stage="talker"}'))


def test_stage_killed_mid_stream_cuts_the_body_then_the_server_heals():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", "m")
    try:
        body = json.dumps({"model": "m", "voice": "ryan", "input": RUNS_TO_ITS_LIMIT, "response_format": "pcm",
                           "stream_format": "audio", "temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 2000})
        streaming = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        streaming.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
        response = streaming.getresponse()
        assert response.status == 200 and len(response.read(3840)) == 3840
        steps_before = _talker_steps(server.port)
        # a stage paused at the stream's first audio: its 191 frames cannot all be out, so the body is held
        stage = stage_pids(server.proc.pid)[0]
        os.kill(stage, signal.SIGSTOP)
        whole = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        whole.request("POST", "/v1/audio/speech", json.dumps(dict(json.loads(body), stream=False)),
                      {"Content-Type": "application/json"})  # admitted and waiting, or refused once it is down
        os.kill(stage, signal.SIGKILL)
        # cut by the server (its socket's timeout would be a TimeoutError), not a second response inside the body
        with pytest.raises(http.client.IncompleteRead) as cut:
            response.read()
        assert b"HTTP/1.1" not in cut.value.partial
        failed = whole.getresponse()
        assert failed.status == 503 and failed.getheader("Retry-After") == "1"
        assert json.loads(failed.read())["error"]["code"] == "service_unavailable"
        status, health = _health(server.port)
        if status == 503:
            assert health["status"] == "unhealthy" and health["stage"] in ("talker", "code2wav")
        eventually(lambda: _health(server.port)[0] == 200, RESTART_TIMEOUT, "healthy again")
        assert _health(server.port) == (200, {"status": "healthy"})
        metrics = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        metrics.request("GET", "/metrics")
        text = metrics.getresponse().read().decode()
        assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("omni_tts_pipeline_restarts_total{")) == 1
        ok = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        ok.request("POST", "/v1/audio/speech", json.dumps(dict(json.loads(body), max_new_tokens=10, stream=False)),
                   {"Content-Type": "application/json"})
        assert ok.getresponse().status == 200
        assert _talker_steps(server.port) > steps_before  # a counter: the restarted stage adds to it
    finally:
        server.stop()
