"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""
from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from omni_tts.stages.protocol import StageStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
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
        self.queue_depth = Gauge("omni_tts_queue_depth", "Admitted requests waiting for their first audio", registry=r)
        self.in_flight = Gauge("omni_tts_in_flight", "Admitted requests not finished", registry=r)
        self.ttfp = Histogram("omni_tts_ttfp_seconds", "Request arrival to first audio byte", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.rtf = Histogram("omni_tts_rtf", "Generation time / audio duration per request", registry=r,
                             buckets=_RTF_BUCKETS)
        self.audio_seconds = Counter("omni_tts_audio_seconds", "Audio produced", registry=r)
        self.step_seconds = Gauge("omni_tts_stage_step_seconds", "Mean engine step time per stage", ["stage"],
                                  registry=r)
        self.stage_steps = Gauge("omni_tts_stage_steps", "Engine steps per stage", ["stage"], registry=r)
        self.stage_requests = Gauge("omni_tts_stage_requests", "Requests held by each stage", ["stage"], registry=r)
        self.connector_latency = Gauge("omni_tts_connector_latency_seconds",
                                       "talker put() → code2wav receipt per chunk, over recent chunks", ["quantile"],
                                       registry=r)
        self.connector_chunks = Gauge("omni_tts_connector_chunks", "Chunks through the talker → code2wav ring",
                                      registry=r)
        self.waiting_for_text = Gauge(
            "omni_tts_talker_waiting_for_text", "Text-stream requests waiting for text: before their prefill "
            "(prefill: it needs the first text token; an ICL voice clone as many as its reference has frames), or "
            "parked out of the batch until their next text token arrives (row)", ["waiting"], registry=r)
        self.stage_up = Gauge("omni_tts_stage_up", "1 while every stage process is alive", registry=r)
        self.restarts = Counter("omni_tts_pipeline_restarts", "Pipeline restarts, by the stage whose failure (exit, "
                                "error, hang; orchestrator: its own task) caused them", ["stage"], registry=r)
        self._restarts_counted: dict[str, int] = {}

    def observe_stages(self, stats: dict[str, StageStats], healthy: bool, restarts: Mapping[str, int]) -> None:
        self.stage_up.set(1 if healthy else 0)
        for name, count in restarts.items():  # the engine counts; the counter catches up at each scrape
            self.restarts.labels(name).inc(count - self._restarts_counted.get(name, 0))
            self._restarts_counted[name] = count
        for name, s in stats.items():
            self.stage_steps.labels(name).set(s.num_steps)
            self.stage_requests.labels(name).set(len(s.request_ids))
            self.step_seconds.labels(name).set(s.step_seconds / s.num_steps if s.num_steps else 0.0)
        if "talker" in stats:
            self.waiting_for_text.labels("prefill").set(stats["talker"].prompts_waiting_for_text)
            self.waiting_for_text.labels("row").set(stats["talker"].rows_waiting_for_text)
        if "code2wav" in stats:
            ring = stats["code2wav"]
            self.connector_chunks.set(ring.connector_chunks)
            self.connector_latency.labels("0.5").set(ring.connector_latency_p50)
            self.connector_latency.labels("0.99").set(ring.connector_latency_p99)

    def render(self) -> bytes:
        return generate_latest(self.registry)
