"""Long-form narration over real sockets (tiny fixture, greedy): a 30,000-character input in every HTTP transport is
the concatenation of its segments spoken one by one plus the pauses; progress events; resume; back-pressure and a
disconnect mid-way (an app in this process, whose state the test reads)."""
import asyncio
import base64
import concurrent.futures
import contextlib
import io
import json
import os
import tempfile
import wave

import av
import numpy as np
import pytest

from audio_util import assert_same_audio
from conftest import FIXTURES
from server_util import app_in_process, request
from omni_tts.entrypoints.api.narrated_file import SPOOL_MEMORY_BYTES
from waiting import eventually, eventually_async

SENTENCE_PAUSE_MS, PARAGRAPH_PAUSE_MS = 200, 600
GREEDY = {"voice": "ryan", "temperature": 0, "max_new_tokens": 3, "seed": 11,
          "sentence_pause_ms": SENTENCE_PAUSE_MS, "paragraph_pause_ms": PARAGRAPH_PAUSE_MS}


def book(chars: int) -> str:
    """Paragraphs of varied sentences (a long one among them, cut at its clauses), about `chars` characters."""
    words = "the quiet river ran past old mills and green fields while travellers rested".split()
    paragraphs, size, n = [], 0, 0
    while size < chars:
        sentences = []
        for k in range(4):
            n += 1
            length = 6 + (n * 7) % 11 if n % 13 else 70   # every 13th sentence is far over a segment
            body = " ".join(words[(n + i) % len(words)] for i in range(length))
            if length == 70:
                body = ", ".join(body.split(" and "))
            sentences.append(f"{body[0].upper()}{body[1:]} number {n}{'?' if k == 2 else '.'}")
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs)


TEXT = book(30_000)


@pytest.fixture(scope="module")
def server(cv_server):
    """The session's tiny-custom-voice server: narration needs no flags of its own."""
    return cv_server


def speak(server, **fields) -> tuple[int, dict, bytes]:
    return request(server.url + "/v1/audio/speech", dict(GREEDY, **fields))


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.int16)


@pytest.fixture(scope="module")
def narrated(server) -> dict:
    """The whole narration as JSON (its segments) and as a WAV file."""
    status, _, body = speak(server, input=TEXT, response_format="json")
    assert status == 200, body[:300]
    answer = json.loads(body)
    with wave.open(io.BytesIO(base64.b64decode(answer["audio"]))) as w:
        answer["samples"] = pcm_samples(w.readframes(w.getnframes()))
    return answer


def test_a_long_input_is_its_segments_one_by_one_plus_the_pauses(server, narrated):
    segments = narrated["segments"]
    assert len(segments) > 50 and [s["index"] for s in segments] == list(range(len(segments)))
    assert " ".join(s["text"] for s in segments).split() == TEXT.split()
    assert all(len(s["text"]) <= 300 for s in segments)
    # the first segment is the first sentence alone: what the listener hears first comes quickest
    assert segments[0]["text"] == TEXT.split(". ")[0] + "."
    expected, pauses = [], []
    for i, segment in enumerate(segments):
        status, _, body = speak(server, input=segment["text"], response_format="pcm", non_streaming_mode=True,
                                seed=GREEDY["seed"] + i)
        assert status == 200
        audio = pcm_samples(body)
        assert audio.shape[0] == round(segment["duration"] * 24000)
        expected.append(audio)
        if i + 1 < len(segments):
            pause = round((segments[i + 1]["audio_offset"] - segment["audio_offset"] - segment["duration"]) * 1000)
            pauses.append(pause)
            expected.append(np.zeros(round(pause * 24), np.int16))
    np.testing.assert_array_equal(narrated["samples"], np.concatenate(expected))
    assert set(pauses) <= {0, SENTENCE_PAUSE_MS, PARAGRAPH_PAUSE_MS}
    assert pauses.count(PARAGRAPH_PAUSE_MS) == TEXT.count("\n\n")
    assert 0 in pauses   # the long sentences were cut at clauses, which add no pause
    assert narrated["usage"]["output_tokens"] == sum(round(s["duration"] * 12.5) for s in segments)


def test_streamed_pcm_and_mp3_and_the_wav_file_are_one_stream_each(server, narrated):
    status, headers, body = speak(server, input=TEXT, response_format="pcm", stream_format="audio")
    assert status == 200
    np.testing.assert_array_equal(pcm_samples(body), narrated["samples"])

    status, headers, body = speak(server, input=TEXT, response_format="wav")
    assert status == 200 and headers["x-omni-tts-segments"] == str(len(narrated["segments"]))
    with wave.open(io.BytesIO(body)) as w:   # one header whose length is the whole narration's
        assert w.getnframes() == narrated["samples"].shape[0] and w.getframerate() == 24000
        np.testing.assert_array_equal(pcm_samples(w.readframes(w.getnframes())), narrated["samples"])

    status, headers, body = speak(server, input=TEXT, response_format="mp3", stream_format="audio")
    assert status == 200
    with av.open(io.BytesIO(body)) as container:   # one stream, decodable to its end
        assert len(container.streams.audio) == 1
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    seconds = narrated["samples"].shape[0] / 24000
    assert abs(decoded.shape[0] / 24000 - seconds) < 0.2, (decoded.shape[0] / 24000, seconds)


def sse_events(body: bytes) -> list[dict]:
    return [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]


def test_sse_reports_each_segment_with_its_offset_and_duration(server, narrated):
    status, _, body = speak(server, input=TEXT, response_format="pcm", stream=True)
    assert status == 200
    events = sse_events(body)
    assert events[-1]["type"] == "speech.audio.done"
    samples, current, done = 0, None, []
    for event in events:
        if event["type"] == "speech.segment":
            assert current is None and event["total"] == len(narrated["segments"])
            assert event["audio_offset"] == pytest.approx(samples / 24000, abs=1e-6)
            current = event
        elif event["type"] == "speech.audio.delta":
            samples += len(base64.b64decode(event["audio"])) // 2
        elif event["type"] == "speech.segment.done":
            assert event["index"] == current["index"] and event["text"] == current["text"]
            assert event["duration"] == pytest.approx(samples / 24000 - current["audio_offset"], abs=1e-6)
            done.append(event)
            current = None
    assert [e["index"] for e in done] == list(range(len(narrated["segments"])))
    assert [{k: e[k] for k in ("text", "audio_offset", "duration")} for e in done] == \
        [{k: s[k] for k in ("text", "audio_offset", "duration")} for s in narrated["segments"]]
    assert all(e["finish_reason"] == "length" and e["attempts"] == 1 for e in done)   # cut at max_new_tokens
    assert samples == narrated["samples"].shape[0]


def test_resume_from_a_segment_gives_the_tail_of_the_same_audio(server, narrated):
    k = len(narrated["segments"]) // 2
    status, _, body = speak(server, input=TEXT, response_format="json", start_segment=k)
    assert status == 200
    resumed = json.loads(body)
    with wave.open(io.BytesIO(base64.b64decode(resumed["audio"]))) as w:
        tail = pcm_samples(w.readframes(w.getnframes()))
    offset = round(narrated["segments"][k]["audio_offset"] * 24000)
    np.testing.assert_array_equal(tail, narrated["samples"][offset:])
    assert resumed["segments"][0]["index"] == k and resumed["segments"][0]["audio_offset"] == 0.0


@pytest.mark.parametrize("fields,param", [
    (dict(input=TEXT, start_segment=100_000), "start_segment"),
    (dict(input=TEXT, speed=1.5), "speed"),
    (dict(input="word. " * 40_000), "input"),   # 240,000 characters: over --max-input-chars
])
def test_what_a_narration_cannot_do_is_a_400(server, fields, param):
    status, _, body = speak(server, **fields)
    assert status == 400 and json.loads(body)["error"]["param"] == param, body


SEGMENT_BYTES = 39 * 1920 * 2   # max_new_tokens 40: 39 frames of pcm
SOCKET_BYTES = 12 * 2**20       # what the kernel's buffers on both ends and aiohttp's may hold, generously


@pytest.mark.asyncio(loop_scope="session")
async def test_a_slow_reader_holds_the_narration_and_a_disconnect_frees_everything(in_process_app):
    """A client that reads slowly: the narration never runs more than its window (2) ahead of what went out, so
    what the server holds is bounded by the window, not the input; closing the connection mid-way ends every
    segment's request in both stages and frees the slot."""
    import aiohttp

    url, state = in_process_app
    counter = state.metrics.narration_segments
    before = {event: int(counter.labels(event)._value.get()) for event in ("started", "delivered")}

    def count(event: str) -> int:  # this narration's
        return int(counter.labels(event)._value.get()) - before[event]
    body = dict(GREEDY, input=TEXT, response_format="pcm", stream_format="audio", max_new_tokens=40)
    total = TEXT.count(".") + TEXT.count("?")   # at least the sentences
    async with aiohttp.ClientSession() as http:
        response = await http.post(url + "/v1/audio/speech", json=body)
        assert response.status == 200
        received = 0
        while received < total * SEGMENT_BYTES // 8:
            received += len(await response.content.read(2**16))
            started, delivered = count("started"), count("delivered")
            assert started - delivered <= 2 and len(state.tts.requests) <= 2, (started, delivered)
            assert (started - 2) * SEGMENT_BYTES <= received + SOCKET_BYTES, (started, received)
            await asyncio.sleep(0.005)   # reads slower than the narration is made
        assert state.admitted == 1
        response.close()   # the client goes away mid-way
    await eventually_async(lambda: not (state.admitted or state.tts.requests), what="the narration ended")
    stats = await state.tts.stats()
    assert all(not s.request_ids for s in stats.values()), stats
    assert count("delivered") < total


def test_a_voice_design_narration_clones_its_first_segment_after_it():
    """VoiceDesign: segment 0 designs the voice; every later segment the stage receives is an ICL clone of it
    (segment 0's codes and text as the reference, the description kept), equal to that request made alone; a
    narration resumed past segment 0 makes it again for the same voice."""
    asyncio.run(_voice_design(str(FIXTURES / "tiny-voice-design")))


async def _voice_design(model_dir: str) -> None:
    import aiohttp

    from omni_tts.audio.pcm import to_int16
    from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
    from omni_tts.models.qwen3_tts.sampling_params import SamplingParams

    text = " ".join(f"Chapter {i} begins where the road bends toward the sea." for i in range(12))
    fields = dict(GREEDY, voice=None, instructions="A calm, low voice with a slight rasp.", input=text,
                  response_format="json", max_new_tokens=6, sentence_pause_ms=0)
    async with app_in_process(model_dir) as (url, state), aiohttp.ClientSession() as http:
        async def narrate(**extra) -> tuple[list[dict], np.ndarray]:
            async with http.post(url + "/v1/audio/speech", json=dict(fields, **extra)) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
            with wave.open(io.BytesIO(base64.b64decode(answer["audio"]))) as w:
                return answer["segments"], pcm_samples(w.readframes(w.getnframes()))

        async def alone(index: int, **voice) -> tuple[np.ndarray, np.ndarray | None]:
            request = SynthesisRequest(text=segments[index]["text"], instructions=fields["instructions"],
                                       non_streaming_mode=True,
                                       sampling=SamplingParams(temperature=0, max_new_tokens=6,
                                                               seed=GREEDY["seed"] + index), **voice)
            parts, codes = [], None
            async for chunk in state.tts.generate(request, return_codes=index == 0):
                parts.append(chunk.audio)
                codes = chunk.codes if chunk.usage is not None else codes
            return to_int16(np.concatenate(parts)), codes

        segments, audio = await narrate()
        assert len(segments) > 2
        first, codes = await alone(0)
        assert segments[0]["reference_frames"] == 0
        assert all(s["reference_frames"] == codes.shape[0] for s in segments[1:])
        for index, segment in enumerate(segments):
            start = round(segment["audio_offset"] * 24000)
            heard = audio[start:start + round(segment["duration"] * 24000)]
            made, _ = (first, None) if index == 0 else await alone(
                index, ref_codes=codes, ref_text=segments[0]["text"])
            np.testing.assert_array_equal(heard, made)
        designed_afresh, _ = await alone(1)   # without the clone, segment 1 would be a voice of its own
        assert not np.array_equal(designed_afresh, audio[round(segments[1]["audio_offset"] * 24000):][
            :designed_afresh.shape[0]])
        tail_segments, tail = await narrate(start_segment=2)
        np.testing.assert_array_equal(tail, audio[round(segments[2]["audio_offset"] * 24000):])
        assert all(s["reference_frames"] == codes.shape[0] for s in tail_segments)


def test_a_websocket_utterance_keeps_its_pieces_and_joins_them_once():
    """An utterance grown by `+=` per message copies all its text so far each time: quadratic in its length (up to
    --max-input-chars, 200,000 characters by default). Pieces that refuse to be concatenated show the text is
    joined once; the limit holds as before."""
    from types import SimpleNamespace

    from omni_tts.entrypoints.api.narrated_utterance import NarratedUtterance
    from omni_tts.entrypoints.api.schema import ApiError

    class Piece(str):
        def __radd__(self, text: str) -> str:
            raise AssertionError("the utterance's text grown by concatenation")

    utterance = NarratedUtterance(SimpleNamespace(state=SimpleNamespace(config=SimpleNamespace(max_input_chars=30))))
    for piece in ("One piece, ", "then another"):
        asyncio.run(utterance.add(Piece(piece)))
    with pytest.raises(ApiError) as refused:
        asyncio.run(utterance.add(Piece(" and one too many.")))
    assert refused.value.param == "input" and "at most 30 characters" in refused.value.message


def test_a_websocket_utterance_in_none_mode_is_narrated_as_over_http(server, narrated):
    """split_granularity none: the whole utterance at input.done, of any length; each segment is a "sentence" of the
    protocol whose audio.done says where it lies; the binary audio is the HTTP narration's."""
    from server_util import ws_utterance

    config = {k: v for k, v in GREEDY.items()} | {"type": "session.config", "split_granularity": "none",
                                                  "response_format": "pcm", "stream_audio": True}
    pieces = [TEXT[i:i + 5000] for i in range(0, len(TEXT), 5000)]
    audio, events = asyncio.run(ws_utterance(server.url, [config] + [{"type": "input.text", "text": p}
                                                                     for p in pieces] + [{"type": "input.done"}]))
    np.testing.assert_array_equal(pcm_samples(audio), narrated["samples"])
    done = [e for e in events if e["type"] == "audio.done"]
    assert [e["sentence_index"] for e in done] == list(range(len(narrated["segments"])))
    assert [(e["audio_offset"], e["duration"]) for e in done] == \
        [(s["audio_offset"], s["duration"]) for s in narrated["segments"]]
    starts = [e for e in events if e["type"] == "audio.start"]
    assert [e["sentence_text"] for e in starts] == [s["text"] for s in narrated["segments"]]
    assert events[-1] == {"type": "session.done", "utterance_index": 0, "total_sentences": len(done)}


def test_a_narrated_file_is_spooled_not_held(server):
    """A narration's whole file is encoded as its audio comes into a spool that goes to a temporary file past
    SPOOL_MEMORY_BYTES: the server holds its window, not its audio (it once held the whole narration as float32,
    twice). The file is the streamed audio (within one 16-bit step); the spool is gone with the response."""
    text = book(3_000)
    fields = dict(input=text, max_new_tokens=64, response_format="wav")

    def spools() -> list[int]:
        sizes = []
        for fd in os.listdir(f"/proc/{server.proc.pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{server.proc.pid}/fd/{fd}")
                if target.startswith(tempfile.gettempdir()) and target.endswith("(deleted)"):
                    sizes.append(os.stat(f"/proc/{server.proc.pid}/fd/{fd}").st_size)
        return sizes

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(speak, server, **fields)
        eventually(lambda: any(size > SPOOL_MEMORY_BYTES for size in spools()) or answer.done(),
                   what="the narration's file spooled to disk")
        assert not answer.done()
        status, headers, body = answer.result()
    assert status == 200 and len(body) > SPOOL_MEMORY_BYTES
    streamed = speak(server, **(fields | {"response_format": "pcm", "stream_format": "audio"}))[2]
    with wave.open(io.BytesIO(body)) as w:
        # the same samples within one 16-bit step: where the decoder's chunks fall depends on the machine's timing
        assert_same_audio(w.readframes(w.getnframes()), streamed)
    eventually(lambda: not any(size > SPOOL_MEMORY_BYTES for size in spools()), what="the spool closed")
