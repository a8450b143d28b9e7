"""/metrics of a real server, linted against Prometheus' naming conventions (as vLLM's /metrics follows them), its
histograms checked against the counts they summarise, and the stage figures' survival of a stage restart."""
import asyncio
import json
import re
import urllib.error
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_tts.entrypoints.api.metrics import StageCollector
from omni_tts.stages.messages import STEP_SECONDS_BUCKETS, DurationHistogram, StageStats
from server_util import MODEL

NAME = re.compile(r"omni_tts_[a-z0-9_]+")
# words that make a name a measure of time, which Prometheus wants in base units with the unit as suffix
TIME_WORDS = {"latency", "duration", "ttfp", "ttft", "seconds", "timeout", "delay", "elapsed", "wait", "uptime"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def naming_problems(exposition: str) -> list[str]:
    """Each break of the conventions in a Prometheus text exposition, one line per problem."""
    problems = []
    # the parser names a counter's family without `_total` and adds it to the samples: read the declarations
    for declared, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE):
        if kind == "counter" and not declared.endswith("_total"):
            problems.append(f"{declared}: a counter whose name does not end in _total")
    for family in text_string_to_metric_families(exposition):
        name, kind = family.name, family.type
        if not NAME.fullmatch(name):
            problems.append(f"{name}: not omni_tts_[a-z0-9_]+")
        if not family.documentation.strip():
            problems.append(f"{name}: no help text")
        if kind == "gauge" and name.endswith("_total"):
            problems.append(f"{name}: a gauge named like a counter")
        if kind not in ("counter", "gauge", "histogram", "summary"):
            problems.append(f"{name}: type {kind} (samples without a declaration of their own)")
        if set(name.split("_")) & TIME_WORDS and not name.endswith("_seconds"):
            problems.append(f"{name}: a time without the _seconds suffix")
        if "bytes" in name.split("_") and not name.endswith("_bytes"):
            problems.append(f"{name}: a size without the _bytes suffix")
        suffixes = {sample.name[len(name):] for sample in family.samples}
        if not suffixes <= set(SUFFIXES.get(kind, ("",))):
            problems.append(f"{name}: {kind} samples {sorted(suffixes)}")
        if kind == "histogram" and family.samples:
            if suffixes != {"_bucket", "_sum", "_count"}:
                problems.append(f"{name}: histogram without _bucket, _sum and _count")
            if not any(s.labels.get("le") == "+Inf" for s in family.samples):
                problems.append(f"{name}: histogram without a +Inf bucket")
        if kind != "summary" and any("quantile" in sample.labels for sample in family.samples):
            problems.append(f"{name}: a quantile label outside a summary")
    return problems


def test_the_lint_finds_each_rule_broken():
    bad = "\n".join([
        "# HELP omni_tts_chunks Chunks", "# TYPE omni_tts_chunks gauge", "omni_tts_chunks_total 1",
        "# HELP omni_tts_steps Steps", "# TYPE omni_tts_steps counter", "omni_tts_steps 3",
        "# HELP omni_tts_done_total Done", "# TYPE omni_tts_done_total gauge", "omni_tts_done_total 3",
        "# HELP omni_tts_step_latency Step time", "# TYPE omni_tts_step_latency gauge",
        'omni_tts_step_latency{quantile="0.5"} 0.1',
        "# HELP vllm:ttfp_seconds x", "# TYPE vllm:ttfp_seconds gauge", "vllm:ttfp_seconds 1",
        "# TYPE omni_tts_rtf gauge", "omni_tts_rtf 0.5",
        "# HELP omni_tts_ring_bytes_used Ring", "# TYPE omni_tts_ring_bytes_used gauge", "omni_tts_ring_bytes_used 1",
        "# HELP omni_tts_wait_seconds Wait", "# TYPE omni_tts_wait_seconds histogram",
        'omni_tts_wait_seconds_bucket{le="1.0"} 1', "omni_tts_wait_seconds_count 1", ""])
    problems = "\n".join(naming_problems(bad))
    for expected in ("omni_tts_chunks_total: type unknown", "omni_tts_steps: a counter whose name does not end",
                     "omni_tts_done_total: a gauge named like a counter",
                     "omni_tts_step_latency: a time without the _seconds suffix",
                     "omni_tts_step_latency: a quantile label outside a summary",
                     "vllm:ttfp_seconds: not omni_tts_", "omni_tts_rtf: no help text",
                     "omni_tts_ring_bytes_used: a size without the _bytes suffix",
                     "omni_tts_wait_seconds: histogram without _bucket, _sum and _count",
                     "omni_tts_wait_seconds: histogram without a +Inf bucket"):
        assert expected in problems, (expected, problems)


def post(server, payload=None, data=None) -> int:
    body = data if data is not None else json.dumps(payload).encode()
    req = urllib.request.Request(server.url + "/v1/audio/speech", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def scrape(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {"text": text, "families": {f.name: f for f in text_string_to_metric_families(text)}}


def value(families: dict, name: str, suffix: str = "", **labels) -> float:
    return sum(s.value for s in families[name].samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_follow_prometheus_naming(cv_server):
    ok = dict(model=MODEL, input="Metrics.", voice="ryan", response_format="pcm", temperature=0, max_new_tokens=12)
    before = scrape(cv_server)["families"]
    assert post(cv_server, ok) == 200
    assert post(cv_server, dict(ok, stream_format="audio")) == 200
    assert post(cv_server, dict(ok, model="tts-1", voice="alloy")) == 200
    assert post(cv_server, data=b"{nope") == 400
    assert post(cv_server, dict(ok, model="no-such-model")) == 404
    assert post(cv_server, dict(ok, voice="nobody")) == 400
    metrics = scrape(cv_server)
    assert naming_problems(metrics["text"]) == []
    kinds = {name: family.type for name, family in metrics["families"].items()}
    assert kinds == {
        "omni_tts_requests": "counter", "omni_tts_requests_finished": "counter", "omni_tts_queue_depth": "gauge",
        "omni_tts_in_flight": "gauge", "omni_tts_ttfp_seconds": "histogram",
        "omni_tts_e2e_request_latency_seconds": "histogram", "omni_tts_request_real_time_factor": "histogram",
        "omni_tts_audio_seconds": "counter", "omni_tts_stage_up": "gauge", "omni_tts_pipeline_restarts": "counter",
        "omni_tts_stage_steps": "counter", "omni_tts_stage_step_duration_seconds": "histogram",
        "omni_tts_stage_requests": "gauge", "omni_tts_connector_chunks": "counter",
        "omni_tts_connector_latency_seconds": "histogram", "omni_tts_talker_waiting_for_text": "gauge",
        "omni_tts_narration_segments": "counter", "omni_tts_request_errors": "counter",
        "omni_tts_connector_waiting_chunks": "gauge", "omni_tts_connector_slots_in_use": "gauge",
        "omni_tts_connector_slot_stalls": "counter", "omni_tts_talker_deferred_admissions": "counter"}
    # the three refused requests, each the request's own fault
    errors = {kind: value(metrics["families"], "omni_tts_request_errors", "_total", kind=kind)
              - value(before, "omni_tts_request_errors", "_total", kind=kind)
              for kind in ("bad_input", "internal", "unavailable", "timeout")}
    assert errors == {"bad_input": 3, "internal": 0, "unavailable": 0, "timeout": 0}


def test_histograms_count_what_they_summarise(cv_server):
    ok = dict(model=MODEL, input="Counted.", voice="vivian", response_format="pcm", temperature=0, max_new_tokens=12)
    before = scrape(cv_server)["families"]
    for _ in range(2):
        assert post(cv_server, ok) == 200
    after = scrape(cv_server)["families"]

    def grew(name, suffix="", **labels):
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    assert grew("omni_tts_requests", "_total", status="200") == 2
    for name in ("omni_tts_ttfp_seconds", "omni_tts_e2e_request_latency_seconds",
                 "omni_tts_request_real_time_factor"):
        assert grew(name, "_count") == 2 and grew(name, "_bucket", le="+Inf") == 2 and grew(name, "_sum") > 0, name
    for stage in ("talker", "code2wav"):  # every step is timed once: the histogram counts the steps counter
        steps = value(after, "omni_tts_stage_steps", "_total", stage=stage)
        assert grew("omni_tts_stage_steps", "_total", stage=stage) > 0
        assert value(after, "omni_tts_stage_step_duration_seconds", "_count", stage=stage) == steps
        assert value(after, "omni_tts_stage_step_duration_seconds", "_bucket", stage=stage, le="+Inf") == steps
    chunks = value(after, "omni_tts_connector_chunks", "_total")
    assert grew("omni_tts_connector_chunks", "_total") >= 2
    assert value(after, "omni_tts_connector_latency_seconds", "_count") == chunks


@pytest.mark.asyncio(loop_scope="session")
async def test_concurrent_scrapes_all_get_the_stage_figures(in_process_app, monkeypatch):
    """Overlapping scrapes each get the stages' figures: concurrent stats() callers share the round trip in flight
    (StageClient.stats), none is left to time out with the figures of the scrape before."""
    url, state = in_process_app
    outcomes = []
    stats = state.tts.stats

    async def counted_stats(timeout: float):
        try:
            result = await stats(timeout=timeout)
        except Exception as e:
            outcomes.append(e)
            raise
        outcomes.append("answered")
        return result
    monkeypatch.setattr(state.tts, "stats", counted_stats)
    async with aiohttp.ClientSession() as http:
        async def scrape() -> str:
            async with http.get(url + "/metrics") as response:
                return await response.text()
        for _ in range(3):
            for text in await asyncio.gather(*(scrape() for _ in range(5))):
                assert 'omni_tts_stage_steps_total{stage="talker"}' in text
                assert 'omni_tts_stage_steps_total{stage="code2wav"}' in text
    assert outcomes and set(outcomes) == {"answered"}, outcomes


def stage_stats(pid: int, steps: int, step_seconds: float, deferred_admissions: int = 0) -> StageStats:
    durations = DurationHistogram.empty(STEP_SECONDS_BUCKETS)
    for _ in range(steps):
        durations.observe(step_seconds)
    return StageStats("talker", pid, [], steps, 0.0, durations, deferred_admissions=deferred_admissions)


def test_stage_counters_keep_counting_across_a_stage_restart():
    collector = StageCollector()
    collector.update({"talker": stage_stats(pid=100, steps=40, step_seconds=0.01, deferred_admissions=6)})
    collector.update({"talker": stage_stats(pid=200, steps=3, step_seconds=0.5, deferred_admissions=1)})  # restarted
    families = {family.name: family for family in collector.collect()}
    assert value(families, "omni_tts_stage_steps", "_total", stage="talker") == 43
    assert value(families, "omni_tts_talker_deferred_admissions", "_total") == 7
    assert value(families, "omni_tts_stage_step_duration_seconds", "_count", stage="talker") == 43
    assert value(families, "omni_tts_stage_step_duration_seconds", "_sum", stage="talker") == pytest.approx(1.9)
    assert value(families, "omni_tts_stage_step_duration_seconds", "_bucket", stage="talker", le="0.01") == 40
    collector.update({"talker": stage_stats(pid=200, steps=5, step_seconds=0.5)})  # the same process, later
    families = {family.name: family for family in collector.collect()}
    assert value(families, "omni_tts_stage_steps", "_total", stage="talker") == 45
