"""POST /v1/audio/speech/batch against a real server on loopback: good and bad items side by side (each good item's
audio equals the same request sent alone to /v1/audio/speech, each bad item fails alone with the 400 that route
answers), the order and the summary, a malformed batch as one 400, a full queue failing only the items beyond it,
and a client that goes away aborting every item in the stages."""
import base64
import http.client
import json
import os
import signal

import numpy as np
import pytest

from conftest import FIXTURES, RUNS_TO_ITS_LIMIT
from omni_tts.entrypoints.api.schema import MAX_BATCH_ITEMS
from server_util import ServerProcess, request, stage_pids
from test_server import GREEDY, MODEL, assert_pcm_close
from waiting import eventually

DEFAULTS = dict(GREEDY, response_format="pcm", voice="ryan")


def batch(server, payload):
    status, headers, body = request(server.url + "/v1/audio/speech/batch", payload)
    return status, headers, json.loads(body)


def alone(server, item):
    """The item with the batch's defaults (its `speaker` replaces their `voice`), sent to /v1/audio/speech: (status,
    headers, body)."""
    defaults = {k: v for k, v in DEFAULTS.items() if not (k == "voice" and "speaker" in item)}
    return request(server.url + "/v1/audio/speech", dict(defaults, **item))


def test_good_and_bad_items_fail_alone_in_order(cv_server):
    good = [{"input": "The first good item."},
            {"input": "A second voice.", "speaker": "vivian"},           # an alias overrides the default voice
            {"input": "A whole wav file.", "response_format": "wav"},
            {"input": "Unknown fields are named.", "lip_sync": False}]
    bad = [{"input": ""},                                                # vllm-omni's holes: an empty input,
           {"input": "Nobody speaks.", "voice": "nobody"},              # an unknown voice
           {"input": "Too fast.", "speed": "fast"},
           {"input": "Streamed.", "stream_format": "sse"}]
    items = [good[0], bad[0], good[1], bad[1], good[2], bad[2], good[3], bad[3]]
    status, headers, answer = batch(cv_server, dict(DEFAULTS, items=items))
    assert status == 200, answer
    results = answer["results"]
    assert [r["index"] for r in results] == list(range(len(items)))
    assert answer["summary"] == {"total": 8, "succeeded": 4, "failed": 4} == {k: answer[k] for k in answer["summary"]}
    assert answer["id"] == headers["X-Request-Id"]
    for item, result in zip(items, results):
        if item in bad[:3]:  # the 400 /v1/audio/speech answers, word for word
            got, _, body = alone(cv_server, item)
            assert result["status"] == "error" and result["status_code"] == got == 400
            assert result["error"] == json.loads(body)["error"]
            assert "audio_data" not in result and "usage" not in result
        elif item is bad[3]:  # alone it would stream: in a batch it fails, naming the field
            assert result["status_code"] == 400 and result["error"]["param"] == "stream_format"
            assert "whole files" in result["error"]["message"]
        else:
            got, headers_alone, body = alone(cv_server, item)
            assert result["status"] == "success" and got == result["status_code"] == 200
            header = 44 if item.get("response_format") == "wav" else 0
            audio = base64.b64decode(result["audio_data"])
            assert audio[:header] == body[:header]
            assert_pcm_close(audio[header:], np.frombuffer(body[header:], "<i2"))
            assert result["response_format"] == item.get("response_format", "pcm")
            assert result["media_type"] == headers_alone["Content-Type"]
            assert result["usage"]["output_tokens"] == int(headers_alone["x-omni-tts-output-tokens"])
            assert result["usage"]["input_tokens"] == int(headers_alone["x-omni-tts-input-tokens"])
            assert result["finish_reason"] == headers_alone["x-omni-tts-finish-reason"]
    assert results[6]["ignored_fields"] == "lip_sync"
    assert "x-omni-tts-ignored-fields" not in headers
    assert request(cv_server.url + "/health")[0] == 200


MALFORMED = [
    ("not an object", [1, 2], None, "must be a JSON object"),
    ("not JSON", b"{items", None, "not valid JSON"),
    ("no items", {"voice": "ryan"}, "items", "missing required field 'items'"),
    ("items not a list", {"items": {"input": "Hi."}}, "items", "Expected `array`"),
    ("no item", {"items": []}, "items", "length >= 1"),
    ("too many items", {"items": [{"input": "Hi."}] * (MAX_BATCH_ITEMS + 1)}, "items", f"length <= {MAX_BATCH_ITEMS}"),
    ("an item not an object", {"items": [{"input": "Hi."}, "Hi."]}, "items", "Expected `object`"),
    ("a default of the wrong type", {"items": [{"input": "Hi."}], "speed": "fast"}, "speed", "invalid 'speed'"),
    ("input beside items", {"items": [{"input": "Hi."}], "input": "Hi."}, "input", "given in each item"),
    ("streaming beside items", {"items": [{"input": "Hi."}], "stream": True}, "stream", "whole files"),
]


@pytest.mark.parametrize("name,payload,param,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_batch_is_one_400(cv_server, name, payload, param, message):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, _, body = request(cv_server.url + "/v1/audio/speech/batch", data=data,
                              headers={"Content-Type": "application/json"})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == param and message in error["message"], error


def test_a_model_not_served_is_the_batch_404(cv_server):
    status, _, answer = batch(cv_server, {"model": "other", "items": [{"input": "Hi."}]})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, _, answer = batch(cv_server, dict(DEFAULTS, items=[{"input": "Hi.", "model": "other"}]))  # an item's own
    assert status == 200 and answer["results"][0]["status_code"] == 404


def _metric(server, prefix: str) -> float:
    text = request(server.url + "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_a_full_queue_fails_the_items_beyond_it_and_a_client_that_leaves_aborts_every_item():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--max-queue", "2")
    try:
        # the items take their slots in order: the third finds the queue full
        status, _, answer = batch(server, dict(DEFAULTS, items=[{"input": f"Item {i}."} for i in range(3)]))
        assert status == 200 and [r["status_code"] for r in answer["results"]] == [200, 200, 429]
        assert answer["results"][2]["error"]["type"] == "rate_limit_error"
        assert answer["summary"] == {"total": 3, "succeeded": 2, "failed": 1}

        finished = _metric(server, "omni_tts_requests_finished_total")
        long_items = dict(DEFAULTS, max_new_tokens=2000, repetition_penalty=1.0,
                          items=[{"input": RUNS_TO_ITS_LIMIT}, {"input": RUNS_TO_ITS_LIMIT, "voice": "vivian"}])
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/audio/speech/batch", json.dumps(long_items), {"Content-Type": "application/json"})
        # both items admitted and past their first audio (191 frames each: they run for seconds more)
        eventually(lambda: _metric(server, "omni_tts_in_flight") == 2 and _metric(server, "omni_tts_queue_depth") == 0,
                   what="both items admitted")
        stages = stage_pids(server.proc.pid)
        for pid in stages:  # nothing can finish while the client leaves
            os.kill(pid, signal.SIGSTOP)
        try:
            assert _metric(server, "omni_tts_in_flight") == 2
            conn.close()
            eventually(lambda: not _metric(server, "omni_tts_in_flight"), what="the items aborted")
        finally:
            for pid in stages:
                os.kill(pid, signal.SIGCONT)
        eventually(lambda: not _metric(server, "omni_tts_stage_requests"), what="the stages holding nothing")
        assert _metric(server, "omni_tts_in_flight") == 0
        assert _metric(server, 'omni_tts_requests_total{status="abort"}') == 2
        assert _metric(server, "omni_tts_requests_finished_total") == finished  # aborted, not run to their end
        assert batch(server, dict(DEFAULTS, items=[{"input": "Still serving."}]))[0] == 200
    finally:
        server.stop()
