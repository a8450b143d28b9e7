"""Metric maths of bench_tts_serve.py, pure functions (unit-tested in tests/test_bench_metrics.py).

A request's timeline is its send time and the arrival time and audio duration of every packet. From it:
TTFP (first audio − send), E2E (last byte − send), RTF (E2E / audio seconds), and an underrun simulation: a player
that starts at the first packet and plays in real time; whenever its buffer runs dry before the next packet
arrives it stalls. The stream is continuous when no single stall exceeds the threshold (100 ms by default).
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 24000
BYTES_PER_SAMPLE = 2
WAV_HEADER_BYTES = 44
CONTINUITY_THRESHOLD_S = 0.1


@dataclass
class Packet:
    arrival: float       # seconds (same clock as the send time)
    audio_s: float       # audio seconds this packet carries


def underrun(packets: list[Packet], threshold_s: float = CONTINUITY_THRESHOLD_S) -> tuple[float, bool]:
    """(total stall seconds, continuous) for a real-time player starting at the first packet."""
    if not packets:
        return 0.0, False
    playhead_free_at = packets[0].arrival   # when the buffered audio runs out
    stall_total, worst = 0.0, 0.0
    for packet in packets:
        if packet.arrival > playhead_free_at:
            stall = packet.arrival - playhead_free_at
            stall_total += stall
            worst = max(worst, stall)
            playhead_free_at = packet.arrival
        playhead_free_at += packet.audio_s
    return stall_total, worst <= threshold_s


def pcm_seconds(num_bytes: int) -> float:
    return num_bytes / BYTES_PER_SAMPLE / SAMPLE_RATE


def sse_audio_seconds(event_data: str) -> tuple[float, dict | None]:
    """One SSE `data:` payload → (audio seconds of a pcm delta, the event dict for done/error events)."""
    event = json.loads(event_data)
    if event.get("type") == "speech.audio.delta":
        return pcm_seconds(len(base64.b64decode(event["audio"]))), None
    return 0.0, event


@dataclass
class RequestResult:
    send: float
    packets: list[Packet]
    end: float
    status: str                  # "200" or the failure ("429", "sse_error", "ClientError", "empty_audio", …)

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def audio_s(self) -> float:
        return sum(p.audio_s for p in self.packets)

    @property
    def ttfp(self) -> float | None:
        return self.packets[0].arrival - self.send if self.packets else None

    @property
    def e2e(self) -> float:
        return self.end - self.send

    @property
    def rtf(self) -> float | None:
        return self.e2e / self.audio_s if self.audio_s > 0 else None

    def row(self) -> dict:
        stall, continuous = underrun(self.packets)
        return {"status": self.status, "ttfp_s": self.ttfp, "e2e_s": self.e2e, "audio_s": self.audio_s,
                "rtf": self.rtf, "stall_s": stall, "continuous": continuous, "packets": len(self.packets)}


def summarize(values: list[float]) -> dict:
    """mean / median / p90 / p95 / p99 / max (numpy's linear percentiles); empty → None values."""
    if not values:
        return {k: None for k in ("mean", "median", "p90", "p95", "p99", "max")}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "median": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def aggregate(rows: list[dict], wall_s: float) -> dict:
    ok = [r for r in rows if r["status"] == "200"]
    failures: dict[str, int] = {}
    for r in rows:
        if r["status"] != "200":
            failures[r["status"]] = failures.get(r["status"], 0) + 1
    audio = sum(r["audio_s"] for r in ok)
    return {"requests": len(rows), "ok": len(ok), "failures": failures, "wall_s": wall_s,
            "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
            "audio_seconds": audio, "audio_seconds_per_second": audio / wall_s if wall_s > 0 else 0.0,
            "ttfp_s": summarize([r["ttfp_s"] for r in ok if r["ttfp_s"] is not None]),
            "e2e_s": summarize([r["e2e_s"] for r in ok]),
            "rtf": summarize([r["rtf"] for r in ok if r["rtf"] is not None]),
            "stall_s": summarize([r["stall_s"] for r in ok]),
            "continuity_rate": (sum(r["continuous"] for r in ok) / len(ok)) if ok else 0.0}
