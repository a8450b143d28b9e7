"""word_timestamps over real sockets: a server with the tiny forced aligner as its own stage process."""
import asyncio
import base64
import contextlib
import io
import json
import os
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import soundfile as sf

from conftest import FIXTURES
from omni_tts.config import STAGE_CONFIG_DIR
from omni_tts.models.qwen3_forced_aligner.words import split_words
from server_util import ServerProcess, request, stage_pids, ws_utterance
from test_server import parse_sse
from waiting import RESTART_TIMEOUT, eventually

ALIGNER = FIXTURES.parent / "qwen3_forced_aligner" / "tiny-forced-aligner"
TEXT = "Hello world, this is a test. The quick brown fox jumps over the lazy dog!"
# narrated (over 300 characters): 7 segments, the first sentence alone and then four a segment
SENTENCES = [f"Sentence number {n} tells of the quiet river and the old mill." for n in range(24)]
NARRATION = {"input": " ".join(SENTENCES), "voice": "vivian", "seed": 7, "temperature": 0, "max_new_tokens": 4,
             "stream_format": "sse", "response_format": "pcm"}
HEARTBEAT_TIMEOUT_S = 3


def start_server(tmp_path_factory, *flags: str) -> ServerProcess:
    """The tiny CustomVoice model and the tiny aligner; a segment the aligner holds is held until the aligner ends
    (no timeout_s ends it)."""
    yaml = tmp_path_factory.mktemp("config") / "stages.yaml"
    yaml.write_text((STAGE_CONFIG_DIR / "cpu_tiny.yaml").read_text()
                    + "\naligner:\n  max_batch_size: 4\n  timeout_s: 3600\n")
    return ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--forced-aligner", str(ALIGNER),
                         "--stage-config", str(yaml), *flags)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A stopped aligner is never declared hung here: its holds last until a test ends them."""
    server = start_server(tmp_path_factory, "--stage-heartbeat-timeout", "3600")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hang_server(tmp_path_factory):
    """A stopped aligner (or stage) is declared hung after HEARTBEAT_TIMEOUT_S without a heartbeat."""
    server = start_server(tmp_path_factory, "--stage-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    yield server
    server.stop()


def speak(server, headers=None, **fields):
    body = {"input": TEXT, "voice": "vivian", "seed": 7, "word_timestamps": True} | fields
    return request(server.url + "/v1/audio/speech", body, headers=headers)


def check_words(words: list[tuple[str, float, float]], text: str, seconds: float, offset: float = 0.0) -> None:
    """Every word of the text in order, times non-decreasing, within [offset, offset + seconds]."""
    assert [w for w, _, _ in words] == split_words(text, None)
    times = [t for _, start, end in words for t in (start, end)]
    assert times == sorted(times)
    assert offset <= times[0] and times[-1] <= offset + seconds + 1e-3


def test_a_pronunciation_rule_keeps_the_clients_words(server):
    """The audio says the rule's alias, and the words are the client's, each timed by the aligner over the text the
    client sent (this server keeps its dictionaries in memory: it has no --voices-dir)."""
    status, _, body = request(server.url + "/v1/pronunciation-dictionaries/add-from-rules", {
        "name": "acronyms", "rules": [{"type": "alias", "string_to_replace": "TTS", "alias": "text to speech"}]})
    assert status == 200, body
    locator = [{"pronunciation_dictionary_id": json.loads(body)["id"]}]
    text = "I like TTS a lot."
    status, _, body = speak(server, input=text, response_format="json", pronunciation_dictionary_locators=locator)
    assert status == 200, body[:300]
    answer = json.loads(body)
    audio = base64.b64decode(answer["audio"])
    plain = json.loads(speak(server, input="I like text to speech a lot.", response_format="json")[2])
    assert audio == base64.b64decode(plain["audio"])
    check_words([(w["word"], w["start"], w["end"]) for w in answer["words"]], text, sf.info(io.BytesIO(audio)).duration)
    assert "TTS" in [w["word"] for w in answer["words"]]


def test_whole_file_carries_them_in_a_header(server):
    status, headers, body = speak(server, response_format="wav")
    assert status == 200, body[:300]
    seconds = float(headers["x-omni-tts-audio-seconds"])
    assert sf.info(io.BytesIO(body)).duration == pytest.approx(seconds, abs=1e-3)
    words = json.loads(headers["x-word-timestamps"])
    assert set(words[0]) == {"word", "start_ms", "end_ms"}
    check_words([(w["word"], w["start_ms"] / 1000, w["end_ms"] / 1000) for w in words], TEXT, seconds)


def test_json_body_has_audio_words_and_characters(server):
    status, headers, body = speak(server, response_format="json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    answer = json.loads(body)
    audio = base64.b64decode(answer["audio"])
    assert answer["format"] == "wav" and answer["sample_rate"] == 24000
    seconds = sf.info(io.BytesIO(audio)).duration
    check_words([(w["word"], w["start"], w["end"]) for w in answer["words"]], TEXT, seconds)
    assert "".join(c["character"] for c in answer["characters"]) == "".join(w["word"] for w in answer["words"])
    # the same request as a header: the same times (greedy with a seed: the same audio)
    _, headers, _ = speak(server, response_format="wav")
    assert [[w["word"], w["start_ms"] / 1000, w["end_ms"] / 1000] for w in json.loads(headers["x-word-timestamps"])] \
        == [[w["word"], w["start"], w["end"]] for w in answer["words"]]
    # Accept: application/json with another format: that format inside the JSON
    status, _, body = speak(server, response_format="flac", headers={"Content-Type": "application/json",
                                                                      "Accept": "application/json"})
    assert status == 200 and json.loads(body)["format"] == "flac"


def test_sse_sends_a_timestamps_event_per_sentence_before_done(server):
    status, _, body = speak(server, stream_format="sse", response_format="pcm")
    assert status == 200
    events = parse_sse(body)
    types = [e["type"] for e in events]
    assert types[-3:] == ["speech.audio.timestamps", "speech.audio.timestamps", "speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    sentences = events[-3:-1]
    assert [e["sentence_index"] for e in sentences] == [0, 1]
    assert " ".join(e["text"] for e in sentences) == TEXT
    for event in sentences:
        assert [w["word"] for w in event["words"]] == split_words(event["text"], None)
    check_words([(w["word"], w["start"], w["end"]) for e in sentences for w in e["words"]], TEXT,
                len(pcm) / 2 / 24000)


def test_where_they_cannot_go_is_a_400(server):
    for fields, param in [({"stream_format": "audio"}, "word_timestamps"),
                          ({"stream": True, "response_format": "json"}, "response_format")]:
        status, _, body = speak(server, **fields)
        assert status == 400 and json.loads(body)["error"]["param"] == param, body
    status, _, body = request(server.url + "/v1/audio/speech/batch",
                              {"items": [{"input": "Hi.", "word_timestamps": True}]})
    [result] = json.loads(body)["results"]
    assert result["status_code"] == 400 and result["error"]["param"] == "word_timestamps", result


def test_websocket_trailing_chunks_per_sentence_are_absolute(server):
    sentences = ["Hello world, this is a test.", "The quick brown fox jumps over the lazy dog!"]
    _, events = asyncio.run(ws_utterance(server.url, [
        {"type": "session.config", "voice": "vivian", "seed": 7, "response_format": "pcm", "stream_audio": True,
         "split_granularity": "sentence", "word_timestamps": True, "audio_frames": "binary"},
        {"type": "input.text", "text": " ".join(sentences)}, {"type": "input.done"}]))
    assert events[-1]["type"] == "session.done", events[-1]
    done = {e["sentence_index"]: e["total_bytes"] / 2 / 24000 for e in events if e["type"] == "audio.done"}
    trailing = [e for e in events if e["type"] == "audio.chunk"]
    assert [e["sentence_index"] for e in trailing] == [0, 1]
    for event, sentence in zip(trailing, sentences):
        offset = sum(done[i] for i in range(event["sentence_index"]))
        check_words([(w["word"], w["start_ms"] / 1000, w["end_ms"] / 1000) for w in event["timestamps"]], sentence,
                    done[event["sentence_index"]], offset)
        # trails its own sentence's audio
        assert events.index(event) > next(i for i, e in enumerate(events)
                                          if e["type"] == "audio.done" and e["sentence_index"] == event["sentence_index"])


def test_websocket_token_mode_gets_them_sentence_by_sentence(server):
    """One request speaks the utterance; its words come per sentence, each sentence once, in order, absolute."""
    sentences = ["Hello world, this is a test.", "The quick brown fox jumps over the lazy dog!", "See you soon."]
    pieces = ["Hello world, ", "this is a test. The quick brown ", "fox jumps over the lazy dog! See you soon."]
    _, events = asyncio.run(ws_utterance(server.url, [
        {"type": "session.config", "voice": "vivian", "seed": 7, "response_format": "pcm", "stream_audio": True,
         "word_timestamps": True, "audio_frames": "binary"},
        *[{"type": "input.text", "text": piece} for piece in pieces], {"type": "input.done"}]))
    assert events[-1]["type"] == "session.done"
    trailing = [e for e in events if e["type"] == "audio.chunk"]
    [done] = [e for e in events if e["type"] == "audio.done"]
    assert [e["sentence_index"] for e in trailing] == [0, 1, 2]
    for event, sentence in zip(trailing, sentences):
        assert [w["word"] for w in event["timestamps"]] == split_words(sentence, None)
    check_words([(w["word"], w["start_ms"] / 1000, w["end_ms"] / 1000) for e in trailing for w in e["timestamps"]],
                " ".join(sentences), done["total_bytes"] / 2 / 24000)


def test_websocket_audio_chunk_events_carry_each_requests_audio_then_its_words(server):
    """vllm-omni's framing, the default for word_timestamps over streamed pcm: each request's audio in audio.chunk
    events, then its words in one more (no audio) before its audio.done, timed from the request's own start."""
    sentences = ["Hello world, this is a test.", "The quick brown fox jumps over the lazy dog!"]
    binary, events = asyncio.run(ws_utterance(server.url, [
        {"type": "session.config", "voice": "vivian", "seed": 7, "response_format": "pcm", "stream_audio": True,
         "split_granularity": "sentence", "word_timestamps": True},
        {"type": "input.text", "text": " ".join(sentences)}, {"type": "input.done"}]))
    assert events[-1]["type"] == "session.done" and binary == b""
    for index, sentence in enumerate(sentences):
        start, done = (next(i for i, e in enumerate(events) if e["type"] == kind and e["sentence_index"] == index)
                       for kind in ("audio.start", "audio.done"))
        *audio, words = [e for e in events[start:done] if e["type"] == "audio.chunk"]
        assert [e["chunk_id"] for e in [*audio, words]] == list(range(len(audio) + 1))
        assert audio and all(e["timestamps"] is None and e["sample_rate"] == 24000 for e in audio)
        pcm = b"".join(base64.b64decode(e["audio_b64"]) for e in audio)
        assert len(pcm) == events[done]["total_bytes"] and words["audio_b64"] == ""
        check_words([(w["word"], w["start_ms"] / 1000, w["end_ms"] / 1000) for w in words["timestamps"]], sentence,
                    len(pcm) / 2 / 24000)


def aligner_status(server) -> dict:
    return json.loads(request(server.url + "/health")[2])["aligner"]


def aligner_restarted(server, pid: int) -> dict:
    """/health's aligner once a process other than `pid` aligns."""
    return eventually(lambda: (s := aligner_status(server))["ready"] and s["pid"] != pid and s, RESTART_TIMEOUT,
                      "aligner restarted")


def is_stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def is_gone(pid: int) -> bool:
    """Ended and collected by its parent (a zombie keeps its /proc entry until then)."""
    return not os.path.exists(f"/proc/{pid}")


def end_stopped(pid: int) -> None:
    """A stopped process that a test has not seen end is ended (a failed test leaves none behind)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)


def sse_events(url: str, body: dict):
    """The events of an SSE response, each as it arrives."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as response:
        block = b""
        for line in response:
            if line.strip():
                block += line
            elif block:
                yield parse_sse(block)[0]
                block = b""


def sse_pcm(events: list[dict]) -> bytes:
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")


def sentence_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "speech.audio.timestamps"]


def test_sse_audio_never_waits_for_a_stopped_aligner(server):
    """Held by state: the aligner is stopped (SIGSTOP) through a whole SSE narration, and nothing here ends that
    (no heartbeat timeout, no timeout_s). All the audio comes while it stays stopped, the same as without timestamps;
    the oldest segments' sentences come without words (given up: the aligner fell behind), the rest once the aligner
    is killed, with the signal named; each sentence once, numbered as when the aligner answers."""
    url = server.url + "/v1/audio/speech"
    expected = sse_pcm(parse_sse(request(url, NARRATION)[2]))
    pid = aligner_status(server)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        stream = sse_events(url, NARRATION | {"word_timestamps": True})
        events, pcm = [], b""
        for event in stream:   # up to its last audio: its end waits for the words it still owes
            events.append(event)
            if event["type"] == "speech.audio.delta":
                pcm += base64.b64decode(event["audio"])
                if len(pcm) >= len(expected):
                    break
        assert pcm == expected
        assert is_stopped(pid) and aligner_status(server)["pid"] == pid   # the audio waited for nothing
        assert sentence_events(events), "the oldest segments given up while the audio went on"
        os.kill(pid, signal.SIGKILL)
        events += list(stream)
    finally:
        end_stopped(pid)
    assert events[-1]["type"] == "speech.audio.done" and sse_pcm(events) == expected
    assert len([e for e in events if e["type"] == "speech.segment.done"]) == 7
    failed = sentence_events(events)
    assert [(e["sentence_index"], e["text"]) for e in failed] == list(enumerate(SENTENCES))
    assert all(e["words"] is None for e in failed)
    why = ["behind" if "fell more than 4 segments behind" in e["reason"] else
           "killed" if "exited (killed by signal SIGKILL)" in e["reason"] else e["reason"] for e in failed]
    given_up = why.count("behind")
    assert 0 < given_up < len(why) and why == ["behind"] * given_up + ["killed"] * (len(why) - given_up)
    aligner_restarted(server, pid)
    answered = sentence_events(parse_sse(request(url, NARRATION | {"word_timestamps": True})[2]))
    assert [(e["sentence_index"], e["text"]) for e in answered] == list(enumerate(SENTENCES))
    for event in answered:
        assert [w["word"] for w in event["words"]] == split_words(event["text"], None)


def test_after_an_aligner_failure_sse_keeps_one_event_per_sentence(server):
    """The events of an alignment that failed are the ones the same request gets when it does not (one per sentence,
    the same indexes and texts), each with the reason."""
    _, _, body = speak(server, stream_format="sse", response_format="pcm")
    answered = sentence_events(parse_sse(body))
    assert len(answered) == 2 and all(e["words"] for e in answered)
    expected = [(e["sentence_index"], e["text"]) for e in answered]
    pid = aligner_status(server)["pid"]
    os.kill(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(speak, server, stream_format="sse", response_format="pcm")
        eventually(lambda: aligner_status(server)["pending"] >= 1, what="the text waits in the aligner")
        os.kill(pid, signal.SIGKILL)
        status, _, body = answer.result()
    assert status == 200
    failed = sentence_events(parse_sse(body))
    assert [(e["sentence_index"], e["text"]) for e in failed] == expected
    assert all(e["words"] is None and "killed by signal SIGKILL" in e["reason"] for e in failed)
    aligner_restarted(server, pid)


def test_a_segment_in_flight_when_the_aligner_dies_ends_with_a_reason(server):
    pid = aligner_status(server)["pid"]
    os.kill(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(speak, server, response_format="json")
        eventually(lambda: aligner_status(server)["pending"] >= 1, what="a segment waits in the aligner")
        os.kill(pid, signal.SIGKILL)
        status, _, body = answer.result()
    assert status == 200
    result = json.loads(body)
    assert result["words"] is None
    assert result["timestamps_unavailable"] == "the aligner stage exited (killed by signal SIGKILL); it is restarting"
    assert sf.info(io.BytesIO(base64.b64decode(result["audio"]))).duration > 0
    status = aligner_restarted(server, pid)
    assert status["pending"] == 0
    status, headers, _ = speak(server, response_format="wav")
    assert status == 200 and "x-word-timestamps" in headers


def test_a_stopped_aligner_is_declared_hung_killed_and_restarted(hang_server):
    """Held by state: the aligner is stopped (SIGSTOP) during an SSE narration. The audio all comes, the same as
    without timestamps; missing its heartbeats for the heartbeat timeout, the aligner is declared hung (/health says
    so while it is down), killed by the server and started again; the sentences it owed end with that reason, and
    later requests get their words again."""
    url = hang_server.url + "/v1/audio/speech"
    expected = sse_pcm(parse_sse(request(url, NARRATION)[2]))
    pid = aligner_status(hang_server)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(request, url, NARRATION | {"word_timestamps": True})
            down = eventually(lambda: (s := aligner_status(hang_server))["reason"] and "hung" in s["reason"] and s,
                              what="/health: the aligner hung")
            status, _, body = answer.result()
        assert not down["ready"] and down["reason"].startswith("the aligner stage is hung: no heartbeat for ")
        eventually(lambda: is_gone(pid), what="the hung aligner killed")
    finally:
        end_stopped(pid)
    assert status == 200
    events = parse_sse(body)
    assert events[-1]["type"] == "speech.audio.done" and sse_pcm(events) == expected
    sentences = sentence_events(events)
    assert [(e["sentence_index"], e["text"]) for e in sentences] == list(enumerate(SENTENCES))
    assert any(e["words"] is None and "is hung: no heartbeat" in e["reason"] for e in sentences)
    assert "forced aligner stage is hung: no heartbeat for" in hang_server.output()
    aligner_restarted(hang_server, pid)
    answered = sentence_events(parse_sse(request(url, NARRATION | {"word_timestamps": True})[2]))
    assert all([w["word"] for w in e["words"]] == split_words(e["text"], None) for e in answered)


def test_beside_code2wav_the_aligner_lives_and_restarts_with_its_process(tmp_path):
    """Placement code2wav: a thread of code2wav's process, not a process of its own; when that process dies the
    pipeline's restart brings the aligner back with it."""
    yaml = tmp_path / "stages.yaml"
    yaml.write_text((STAGE_CONFIG_DIR / "cpu_tiny.yaml").read_text() + "\naligner:\n  placement: code2wav\n")
    hosted = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--forced-aligner", str(ALIGNER),
                           "--stage-config", str(yaml))
    try:
        status = aligner_status(hosted)
        assert status["ready"] and status["placement"] == "code2wav"
        code2wav = status["pid"]
        pids = stage_pids(hosted.proc.pid)
        assert code2wav in pids and len(pids) == 2   # talker and code2wav: no aligner process
        _, headers, _ = speak(hosted, response_format="wav")
        words = json.loads(headers["x-word-timestamps"])
        check_words([(w["word"], w["start_ms"] / 1000, w["end_ms"] / 1000) for w in words], TEXT,
                    float(headers["x-omni-tts-audio-seconds"]))
        os.kill(code2wav, signal.SIGKILL)
        eventually(lambda: (s := aligner_status(hosted))["ready"] and s["pid"] != code2wav, RESTART_TIMEOUT,
                   "aligner back with code2wav")
        eventually(lambda: request(hosted.url + "/health")[0] == 200, RESTART_TIMEOUT, "pipeline healthy")
        status_code, headers, _ = speak(hosted, response_format="wav")
        assert status_code == 200 and "x-word-timestamps" in headers
    finally:
        hosted.stop()
