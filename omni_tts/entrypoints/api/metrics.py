"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Names follow Prometheus' conventions, as vLLM's /metrics does: `omni_tts_` prefix, counters end in `_total`, base
units as suffixes (`_seconds`), distributions as histograms (never means or quantile-labelled gauges). The real-time
factor is generation time ÷ audio duration, dimensionless and unbounded above (> 1: slower than real time), so it is
`omni_tts_request_real_time_factor`: `_ratio` is kept for fractions in [0, 1]. tests/entrypoints/test_metrics.py lints
the exposition against these rules.

The stages count their own steps and step times (StageStats); `StageCollector` turns each scrape's figures into
counters and histograms that never go down, across stage restarts as well, and sums the replicas' under serve-ray.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from omni_tts.stages.messages import DurationHistogram, StageStats, stage_kind

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omni_tts_requests", "Speech requests by outcome: every response's HTTP status, "
                                "or abort when the client went away", ["status"], registry=r)
        self.finished = Counter("omni_tts_requests_finished", "Generations that ran to their end, by finish reason "
                                "(length: the frame budget ended it, not the end token)", ["finish_reason"],
                                registry=r)
        self.request_errors = Counter(
            "omni_tts_request_errors", "Speech requests an error ended, before or after their first audio, by kind: "
            "bad_input (the request's own fault, found by the API or inside a stage; never retried), internal (a "
            "stage failed it), unavailable (the pipeline down, or the server overloaded), timeout (no end in time)",
            ["kind"], registry=r)
        self.queue_depth = Gauge("omni_tts_queue_depth", "Admitted requests waiting for their first audio", registry=r)
        self.in_flight = Gauge("omni_tts_in_flight", "Admitted requests not finished", registry=r)
        self.ttfp = Histogram("omni_tts_ttfp_seconds", "Request arrival to first audio", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.e2e_latency = Histogram("omni_tts_e2e_request_latency_seconds", "Request arrival to its last audio",
                                     registry=r, buckets=_LATENCY_BUCKETS)
        self.real_time_factor = Histogram("omni_tts_request_real_time_factor", "Per request: arrival to last "
                                          "audio, divided by the audio's duration (below 1: faster than real time)",
                                          registry=r, buckets=_RTF_BUCKETS)
        self.audio_seconds = Counter("omni_tts_audio_seconds", "Audio produced", registry=r)
        self.narration_segments = Counter(
            "omni_tts_narration_segments", "Narrated inputs' segments: started (their request sent), delivered (their "
            "audio handed to the response whole), retried (a second try after a failure)", ["event"], registry=r)
        self.waiting_for_text = Gauge(
            "omni_tts_talker_waiting_for_text", "Text-stream requests waiting for text: before their prefill "
            "(prefill: it needs the first text token; an ICL voice clone as many as its reference has frames), or "
            "parked out of the batch until their next text token arrives (row)", ["waiting"], registry=r)
        self.stage_up = Gauge("omni_tts_stage_up", "1 while every stage process is alive", registry=r)
        self.restarts = Counter("omni_tts_pipeline_restarts", "Pipeline restarts, by the stage whose failure (exit, "
                                "error, hang; orchestrator: its own task) caused them", ["stage"], registry=r)
        self.stages = StageCollector()
        r.register(self.stages)
        self._restarts_counted: dict[str, int] = {}

    def observe_stages(self, stats: dict[str, StageStats], healthy: bool, restarts: Mapping[str, int]) -> None:
        self.stage_up.set(1 if healthy else 0)
        for name, count in restarts.items():  # the pipeline counts; the counter catches up at each scrape
            self.restarts.labels(name).inc(count - self._restarts_counted.get(name, 0))
            self._restarts_counted[name] = count
        self.stages.update(stats)
        talkers = [s for key, s in stats.items() if stage_kind(stage_name(key)) == "talker"]   # every model's
        if talkers:
            self.waiting_for_text.labels("prefill").set(sum(s.prompts_waiting_for_text for s in talkers))
            self.waiting_for_text.labels("row").set(sum(s.rows_waiting_for_text for s in talkers))

    def count_error(self, status: int) -> None:
        """A speech request ended by an error answered with `status` (errors.api_error gives it by the error's kind)."""
        self.request_errors.labels(error_kind(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def error_kind(status: int) -> str:
    """The `omni_tts_request_errors` kind of an error answered with `status`."""
    if status in (429, 503):
        return "unavailable"
    if status == 504:
        return "timeout"
    return "bad_input" if status < 500 else "internal"


def stage_name(key: str) -> str:
    """The stage of a stats key: `talker` (`talker:<model>`), or `<replica>/talker` from one of several
    pipelines."""
    return key.rpartition("/")[2]


def _added(a: DurationHistogram | None, b: DurationHistogram | None) -> DurationHistogram | None:
    if a is None or b is None:
        return a or b
    return DurationHistogram(a.bounds, [x + y for x, y in zip(a.counts, b.counts)], a.sum + b.sum)


@dataclass
class _StageTotals:
    """One stage's figures: the latest report of its current process, and the sums its earlier processes reported
    last (what they counted after that is lost with them)."""
    latest: StageStats
    earlier_steps: int = 0
    earlier_chunks: int = 0
    earlier_step_durations: DurationHistogram | None = None
    earlier_connector_latencies: DurationHistogram | None = None
    earlier_slot_stalls: int = 0
    earlier_deferred_admissions: int = 0

    def update(self, stats: StageStats) -> None:
        if stats.pid != self.latest.pid:  # a restarted stage counts from zero again
            self.earlier_steps += self.latest.num_steps
            self.earlier_chunks += self.latest.connector_chunks
            self.earlier_slot_stalls += self.latest.connector_slot_stalls
            self.earlier_deferred_admissions += self.latest.deferred_admissions
            self.earlier_step_durations = _added(self.earlier_step_durations, self.latest.step_durations)
            self.earlier_connector_latencies = _added(self.earlier_connector_latencies,
                                                      self.latest.connector_latencies)
        self.latest = stats

    @property
    def steps(self) -> int:
        return self.earlier_steps + self.latest.num_steps

    @property
    def chunks(self) -> int:
        return self.earlier_chunks + self.latest.connector_chunks

    @property
    def slot_stalls(self) -> int:
        return self.earlier_slot_stalls + self.latest.connector_slot_stalls

    @property
    def deferred_admissions(self) -> int:
        return self.earlier_deferred_admissions + self.latest.deferred_admissions

    @property
    def step_durations(self) -> DurationHistogram:
        return _added(self.earlier_step_durations, self.latest.step_durations)

    @property
    def connector_latencies(self) -> DurationHistogram | None:
        return _added(self.earlier_connector_latencies, self.latest.connector_latencies)


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: DurationHistogram) -> None:
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, histogram.bounds), "+Inf"], histogram.counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, histogram.sum)


class StageCollector:
    """The stages' own figures (steps, step times, the ring's chunks and latency) as Prometheus families, from the
    latest scrape's StageStats, each summed over the pipelines (replicas) that report it; a figure keeps its last
    value while the stages cannot answer. A replica that is gone keeps its counts in the sums (counters never go
    down) but holds no requests."""

    def __init__(self) -> None:
        self._totals: dict[str, _StageTotals] = {}   # by stats key
        self._answered: set[str] = set()             # the keys of the latest answer

    def update(self, stats: dict[str, StageStats]) -> None:
        if stats:
            self._answered = set(stats)
        for key, s in stats.items():
            if key in self._totals:
                self._totals[key].update(s)
            else:
                self._totals[key] = _StageTotals(latest=s)

    def describe(self) -> list[Metric]:
        return []  # names are checked at registration by collect() otherwise, before any stage has reported

    def collect(self) -> Iterator[Metric]:
        steps = CounterMetricFamily("omni_tts_stage_steps", "Engine steps per stage", labels=["stage"])
        step_seconds = HistogramMetricFamily("omni_tts_stage_step_duration_seconds", "Time inside one engine step",
                                             labels=["stage"])
        requests = GaugeMetricFamily("omni_tts_stage_requests", "Requests held by each stage", labels=["stage"])
        chunks = CounterMetricFamily("omni_tts_connector_chunks", "Chunks through the talker → code2wav ring")
        latency = HistogramMetricFamily("omni_tts_connector_latency_seconds",
                                        "Talker put() to code2wav taking the chunk, per ring chunk")
        waiting = GaugeMetricFamily("omni_tts_connector_waiting_chunks", "Chunks the talker made that wait for a "
                                    "free connector slot (every slot held: code2wav behind, or slots lost)")
        slots = GaugeMetricFamily("omni_tts_connector_slots_in_use", "Connector slots written by the talker and not "
                                  "yet released by code2wav")
        stalls = CounterMetricFamily("omni_tts_connector_slot_stalls", "Times every connector slot was held while "
                                     "chunks waited (a stall that lasts restarts the pipeline)")
        deferred = CounterMetricFamily("omni_tts_talker_deferred_admissions", "Talker admissions put off a step "
                                       "so that a stream about to run dry got its frame first (deadline-first steps)")
        by_stage: dict[str, list[tuple[str, _StageTotals]]] = {}
        for key, totals in sorted(self._totals.items()):
            by_stage.setdefault(stage_name(key), []).append((key, totals))
        for name, pipelines in by_stage.items():
            steps.add_metric([name], sum(totals.steps for _, totals in pipelines))
            _histogram(step_seconds, [name], functools.reduce(_added, (t.step_durations for _, t in pipelines)))
            requests.add_metric([name], sum(len(totals.latest.request_ids) for key, totals in pipelines
                                            if key in self._answered))
            connector = functools.reduce(_added, (t.connector_latencies for _, t in pipelines))
            if connector is not None:  # the stage that receives from the ring
                chunks.add_metric([], sum(totals.chunks for _, totals in pipelines))
                _histogram(latency, [], connector)
            if name == "talker":  # the stage that writes into it
                answered = [totals.latest for key, totals in pipelines if key in self._answered]
                waiting.add_metric([], sum(s.connector_waiting for s in answered))
                slots.add_metric([], sum(s.connector_slots_in_use for s in answered))
                stalls.add_metric([], sum(totals.slot_stalls for _, totals in pipelines))
                deferred.add_metric([], sum(totals.deferred_admissions for _, totals in pipelines))
        yield from (steps, step_seconds, requests, chunks, latency, waiting, slots, stalls, deferred)
