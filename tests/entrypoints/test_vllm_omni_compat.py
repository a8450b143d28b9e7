"""vllm-omni's clients unmodified (issue 23, item 1), against a real server on loopback: requests without `model`,
`speaker` for `voice`, a default CustomVoice speaker, Base with `voice` + `ref_audio`, unknown fields ignored (and
named) or refused with --strict-fields, `stream: true` as SSE, vllm-omni's usage headers and SSE details, and the
WebSocket's session.config read the same way."""
import asyncio
import base64
import io
import json

import numpy as np
import soundfile as sf

from conftest import FIXTURES
from omni_tts.models.qwen3_forced_aligner.words import split_words
from server_util import ServerProcess, request, ws_utterance
from test_server import GREEDY, MODEL, REF_TEXT, REF_WAV, assert_pcm_close, offline_pcm, parse_sse, upload_voice

TEXT = "Hello there, vllm-omni client."


def speech(server, payload):
    return request(server.url + "/v1/audio/speech", dict(GREEDY, response_format="pcm", **payload))


def test_model_is_optional_speaker_is_voice_and_a_voice_defaults_to_the_first_speaker(cv_server):
    expected = offline_pcm("tiny-custom-voice", text=TEXT, voice="ryan")
    for payload in ({"input": TEXT, "voice": "ryan"},                      # no model: the served one
                    {"input": TEXT, "speaker": "ryan", "model": MODEL},   # vllm-omni's alias
                    {"input": TEXT, "speaker": "Ryan", "voice": "Ryan"}):  # both, the same: fine
        status, headers, body = speech(cv_server, payload)
        assert status == 200, body[:300]
        assert_pcm_close(body, expected)
        assert "x-omni-tts-ignored-fields" not in headers
    status, _, body = speech(cv_server, {"input": TEXT, "speaker": "ryan", "voice": "vivian"})
    assert status == 400
    assert json.loads(body)["error"]["param"] == "speaker" and "another name for 'voice'" in body.decode()
    # no voice at all: the checkpoint's first speaker (its config's spk_id order), not a 400
    first = next(iter(json.loads((FIXTURES / "tiny-custom-voice" / "config.json").read_text())["talker_config"]
                      ["spk_id"]))
    status, _, body = speech(cv_server, {"input": TEXT})
    assert status == 200
    assert_pcm_close(body, offline_pcm("tiny-custom-voice", text=TEXT, voice=first))


def test_unknown_fields_are_ignored_named_and_logged(cv_server):
    def warnings() -> list[str]:
        return [line for line in cv_server.output().splitlines() if "ignored unknown field(s)" in line]
    before = len(warnings())
    status, headers, body = speech(cv_server, {"input": TEXT, "voice": "ryan", "extra_params": {"a": 1},
                                               "lip_sync": False, "speed_hint": "fast"})
    assert status == 200
    assert headers["x-omni-tts-ignored-fields"] == "extra_params, lip_sync, speed_hint"
    assert_pcm_close(body, offline_pcm("tiny-custom-voice", text=TEXT, voice="ryan"))
    [warning] = warnings()[before:]  # one line for this request
    assert "extra_params, lip_sync, speed_hint" in warning
    # a known field of the wrong type is still a 400: only unknown names are let through
    status, _, body = speech(cv_server, {"input": TEXT, "voice": "ryan", "speed": "fast"})
    assert status == 400 and json.loads(body)["error"]["param"] == "speed"


def test_strict_fields_refuses_unknown_fields():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--strict-fields")
    try:
        status, _, body = speech(server, {"input": TEXT, "voice": "ryan", "extra_params": {}})
        assert status == 400
        error = json.loads(body)["error"]
        assert error["param"] == "extra_params" and "--strict-fields" in error["message"]
        status, _, body = speech(server, {"input": TEXT, "speaker": "ryan"})  # an alias is not unknown
        assert status == 200
    finally:
        server.stop()


def test_stream_true_is_sse_with_vllm_omni_usage(cv_server):
    expected = offline_pcm("tiny-custom-voice", text=TEXT, voice="ryan")
    status, headers, body = speech(cv_server, {"input": TEXT, "voice": "ryan", "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(body)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert_pcm_close(pcm, expected)
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_token_details"] == {"text_tokens": usage["input_tokens"], "audio_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    # with stream_format audio, raw audio as before
    status, headers, body = speech(cv_server, {"input": TEXT, "voice": "ryan", "stream": True,
                                               "stream_format": "audio"})
    assert status == 200 and not headers["Content-Type"].startswith("text/event-stream")
    assert_pcm_close(body, expected)
    # a whole file: both header families, the same numbers as the SSE usage
    status, headers, _ = speech(cv_server, {"input": TEXT, "voice": "ryan"})
    assert status == 200
    assert headers["x-vllm-omni-input-tokens"] == headers["x-omni-tts-input-tokens"] == str(usage["input_tokens"])
    assert headers["x-vllm-omni-output-tokens"] == str(usage["output_tokens"])
    assert headers["x-vllm-omni-total-tokens"] == str(usage["total_tokens"])
    assert headers["x-vllm-omni-input-text-tokens"] == str(usage["input_tokens"])
    assert headers["x-vllm-omni-input-audio-tokens"] == "0"


def test_base_voice_beside_ref_audio_uses_the_reference_and_says_so(base_server):
    data_uri = "data:audio/wav;base64," + base64.b64encode(REF_WAV.read_bytes()).decode()
    expected = offline_pcm("tiny-base", text=TEXT, ref_audio=str(REF_WAV), ref_text=REF_TEXT)
    clone = {"input": TEXT, "ref_audio": data_uri, "ref_text": REF_TEXT}
    status, headers, body = speech(base_server, dict(clone, voice="default"))  # vllm-omni's client sends one
    assert status == 200, body[:300]
    assert headers["x-omni-tts-voice-ignored"] == "default"
    assert_pcm_close(body, expected)
    # the ICL reference's frames are the audio input tokens
    audio_tokens = int(headers["x-vllm-omni-input-audio-tokens"])
    assert audio_tokens > 0
    assert int(headers["x-vllm-omni-input-tokens"]) == int(headers["x-vllm-omni-input-text-tokens"]) + audio_tokens
    # an uploaded voice's name beside ref_audio stays ambiguous: 400
    upload_voice(base_server, "mine", REF_WAV.read_bytes(), ref_text=REF_TEXT)
    status, _, body = speech(base_server, dict(clone, voice="mine"))
    assert status == 400 and json.loads(body)["error"]["param"] == "voice"


def test_websocket_session_config_takes_speaker_and_unknown_fields(cv_server):
    audio, events = asyncio.run(ws_utterance(cv_server.url, [
        {"type": "session.config", "speaker": "ryan", "response_format": "pcm", "split_granularity": "none",
         "unknown_knob": 3, **GREEDY},
        {"type": "input.text", "text": TEXT}, {"type": "input.done"}]))
    assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"], events
    assert events[1]["error"] is False
    assert_pcm_close(audio, offline_pcm("tiny-custom-voice", text=TEXT, voice="ryan"))
    assert any("session.config: ignored unknown field(s): unknown_knob" in line
               for line in cv_server.output().splitlines())


def test_ignored_field_names_are_escaped_and_bounded(cv_server):
    """A client's field names reach a header and the log: control characters escaped, the list bounded."""
    names = {"bad\r\nX-Injected: 1": 1, "é": 2, **{f"f{i}": i for i in range(20)}}
    status, headers, _ = speech(cv_server, {"input": TEXT, "voice": "ryan", **names})
    assert status == 200 and "X-Injected" not in headers
    assert headers["x-omni-tts-ignored-fields"] == ("bad\\r\\nX-Injected: 1, \\u00e9, " +
                                                    ", ".join(f"f{i}" for i in range(14)) + ", and 6 more")


def test_websocket_sentence_commit_adds_text_at_each_commit(cv_server):
    """vllm-omni's streaming_mode sentence_commit: input.text is held until input.commit, which adds it to the
    utterance's one request and is answered input.committed; input.done adds the rest. The audio is the whole text's
    (token mode: the streaming layout), however the commits cut it."""
    pieces = ["Hello there, ", "vllm-omni ", "client. And ", "the rest."]
    audio, events = asyncio.run(ws_utterance(cv_server.url, [
        {"type": "session.config", "voice": "ryan", "response_format": "pcm", "streaming_mode": "sentence_commit",
         "stream_audio": True, "non_streaming_mode": False, **GREEDY},
        {"type": "input.text", "text": pieces[0]}, {"type": "input.text", "text": pieces[1]},
        {"type": "input.commit"},
        {"type": "input.text", "text": pieces[2]}, {"type": "input.commit"},
        {"type": "input.text", "text": pieces[3]},  # never committed: input.done adds it
        {"type": "input.done"}]))
    commits = [e for e in events if e["type"] == "input.committed"]
    committed = ["".join(pieces[:2]), pieces[2]]
    assert commits == [{"type": "input.committed", "utterance_index": 0, "commit_index": i, "text": text,
                        "commit_id": None, "sentence_index": i, "chars_committed": len(text)}
                       for i, text in enumerate(committed)]
    assert events[-1] == {"type": "session.done", "utterance_index": 0, "total_sentences": 1}
    status, _, expected = speech(cv_server, {"input": "".join(pieces), "voice": "ryan", "non_streaming_mode": False})
    assert status == 200
    assert_pcm_close(audio, np.frombuffer(expected, "<i2"))


def test_websocket_streaming_mode_needs_token_granularity(cv_server):
    _, events = asyncio.run(ws_utterance(cv_server.url, [
        {"type": "session.config", "voice": "ryan", "streaming_mode": "token_level", "split_granularity": "sentence"}]))
    assert events[-1]["type"] == "error" and "split_granularity must be token" in events[-1]["message"]


# --- vllm-omni's published examples (issue 33): the batch client and its docs' batch curl examples, the sentence-commit
# client, the word-timestamps demo page; each speaks as it is published and is read as it reads.
def read_batch_as_vllm_omni(server, payload: dict) -> list[bytes]:
    """POST /v1/audio/speech/batch read as vllm-omni's batch_speech_client.py reads it: `total`, `succeeded`,
    `failed`, then each result's `index`, `status` ("success") and `audio_data` (base64); every item succeeds."""
    status, _, body = request(server.url + "/v1/audio/speech/batch", payload)
    assert status == 200, body[:300]
    data = json.loads(body)
    assert (data["total"], data["succeeded"], data["failed"]) == (len(payload["items"]), len(payload["items"]), 0)
    assert [(r["index"], r["status"]) for r in data["results"]] == [(i, "success") for i in range(data["total"])]
    return [base64.b64decode(r["audio_data"]) for r in data["results"]]


def assert_same_file(got: bytes, expected: bytes, fmt: str) -> None:
    """A batch item's file against the one /v1/audio/speech answers for the same fields. wav: the header equal, the
    samples within 1 LSB (a batch's items run batched together). mp3: as long once decoded, and the same audio within
    the coder's noise: an input 1 LSB off can flip the encoder's bit allocation and decode hundreds of LSB apart
    (measured: ~18 dB apart at worst), where two different utterances are ~0 dB apart."""
    if fmt == "wav":
        assert got[:44] == expected[:44]
        assert_pcm_close(got[44:], np.frombuffer(expected[44:], "<i2"))
        return
    got_pcm, expected_pcm = (sf.read(io.BytesIO(data), dtype="float64")[0] for data in (got, expected))
    assert got_pcm.shape == expected_pcm.shape and np.any(expected_pcm)
    assert np.sum(expected_pcm ** 2) >= 10 * np.sum((got_pcm - expected_pcm) ** 2)


def check_batch(server, payload: dict) -> None:
    """Each item's file equals the one /v1/audio/speech answers for that item over the batch's other fields, a wav
    file when none asks for a format (vllm-omni's batch default: its docs' snippet saves each as output_{i}.wav)."""
    defaults = {"response_format": "wav"} | {k: v for k, v in payload.items() if k != "items"}
    for item, got in zip(payload["items"], read_batch_as_vllm_omni(server, payload)):
        fields = defaults | item
        status, _, expected = request(server.url + "/v1/audio/speech", fields)
        assert status == 200, expected[:300]
        assert_same_file(got, expected, fields["response_format"])


def test_batch_client_and_docs_examples_read_totals_status_and_audio_data(cv_server, base_server):
    """vllm-omni's batch client (the payload it builds from its arguments: response_format wav and voice vivian by
    default, a clone's reference as a data URL) and the three batch curl examples of its speech API docs."""
    texts = ["Hello, how are you?", "Goodbye, see you later!"]
    data_url = "data:audio/wav;base64," + base64.b64encode(REF_WAV.read_bytes()).decode()
    check_batch(cv_server, dict(GREEDY, items=[{"input": t} for t in texts], response_format="wav", voice="vivian"))
    check_batch(base_server, dict(GREEDY, items=[{"input": "First cloned sentence."},
                                                 {"input": "Second cloned sentence."}],
                                  response_format="wav", voice="vivian", task_type="Base", ref_audio=data_url,
                                  ref_text=REF_TEXT))
    # the docs: shared defaults; per-item voices and formats; a clone's reference shared by the items
    check_batch(cv_server, dict(GREEDY, items=[{"input": t} for t in texts], voice="vivian", language="English"))
    check_batch(cv_server, dict(GREEDY, items=[{"input": "Hello!", "voice": "vivian", "response_format": "mp3"},
                                               {"input": "你好！", "voice": "ryan", "language": "Chinese"}],
                                response_format="wav"))
    check_batch(base_server, dict(GREEDY, items=[{"input": "First sentence in the cloned voice."},
                                                 {"input": "Second sentence in the cloned voice."}],
                                  task_type="Base", ref_audio=data_url, ref_text=REF_TEXT))


def test_sentence_commit_client_gets_its_commit_ids_back(cv_server):
    """vllm-omni's sentence_commit_streaming_client.py: each sentence sent, then committed with a `commit_id`; it
    reads `commit_id` and `sentence_index` from each input.committed, and the binary audio until session.done."""
    sentences = ["Hello there, this first sentence can begin playing.", " The second sentence resumes the request.",
                 " The final sentence is followed by input.done."]
    messages = [{"type": "session.config", "voice": "vivian", "streaming_mode": "sentence_commit",
                 "response_format": "pcm", **GREEDY}]
    for index, sentence in enumerate(sentences):
        messages += [{"type": "input.text", "text": sentence},
                     {"type": "input.commit", "commit_id": f"sentence-{index}"}]
    audio, events = asyncio.run(ws_utterance(cv_server.url, [*messages, {"type": "input.done"}]))
    assert events[-1]["type"] == "session.done", events[-1]
    commits = [e for e in events if e["type"] == "input.committed"]
    assert [(e["commit_id"], e["sentence_index"], e["chars_committed"]) for e in commits] == \
        [(f"sentence-{i}", i, len(s)) for i, s in enumerate(sentences)]
    status, _, expected = speech(cv_server, {"input": "".join(sentences), "voice": "vivian",
                                             "non_streaming_mode": False})
    assert status == 200
    assert_pcm_close(audio, np.frombuffer(expected, "<i2"))


ALIGNER = FIXTURES.parent / "qwen3_forced_aligner" / "tiny-forced-aligner"


def test_word_timestamps_demo_plays_audio_chunks_and_highlights_words():
    """vllm-omni's word_timestamps_demo.py page: its session.config, the whole text, input.done. It keeps each
    sentence's audio from the `audio_b64` of its audio.chunk messages (a binary frame fails its JSON.parse and is
    dropped) and the last non-null `timestamps`, and at the sentence's audio.done renders both, the words timed from
    the start of that sentence's audio."""
    text = "Hello world. How are you today? I am doing great."
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--forced-aligner", str(ALIGNER))
    try:
        binary, events = asyncio.run(ws_utterance(server.url, [
            {"type": "session.config", "task_type": "CustomVoice", "word_timestamps": True, "stream_audio": True,
             "response_format": "pcm", "language": "Auto", "voice": "aiden", **GREEDY},
            {"type": "input.text", "text": text}, {"type": "input.done"}]))
        assert events[-1]["type"] == "session.done", events[-1]
        sentences, rendered = {}, []
        for event in events:   # the page's onmessage
            if event["type"] == "audio.start":
                sentences[event["sentence_index"]] = {"text": event["sentence_text"], "chunks": [], "timestamps": None}
            elif event["type"] == "audio.chunk" and event["sentence_index"] in sentences:
                sentence = sentences[event["sentence_index"]]
                if event["audio_b64"]:
                    sentence["chunks"].append(base64.b64decode(event["audio_b64"]))
                if event["timestamps"] is not None:
                    sentence["timestamps"] = event["timestamps"]
            elif event["type"] == "audio.done":
                rendered.append(dict(sentences[event["sentence_index"]]))
        assert binary == b""
        [sentence] = rendered   # token mode: the utterance is one request
        assert sentence["text"] == text
        pcm = b"".join(sentence["chunks"])
        status, _, expected = speech(server, {"input": text, "voice": "aiden", "non_streaming_mode": False})
        assert status == 200
        assert_pcm_close(pcm, np.frombuffer(expected, "<i2"))
        words = sentence["timestamps"]
        assert [w["word"] for w in words] == split_words(text, None)
        times = [t for w in words for t in (w["start_ms"], w["end_ms"])]
        assert times == sorted(times) and 0 <= times[0] and times[-1] <= round(len(pcm) / 48)  # 48 bytes a ms
    finally:
        server.stop()
