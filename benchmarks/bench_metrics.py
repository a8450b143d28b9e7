"""Metric maths of bench_tts_serve.py: pure functions and small stateful parsers, no I/O (tests/test_bench_metrics.py).

A request's timeline is its send time, the arrival time and audio duration of every packet, and its end. From it:

* TTFP   = arrival of the first packet that carries audio − send
* E2E    = end (last byte read) − send
* RTF    = E2E / audio seconds (lower is better; < 1 means faster than real time)
* underrun: a player starts playing at the first audio packet's arrival and plays in real time. Whenever its buffer
  runs dry before the next packet arrives it waits; the waits add up to the stall time. The stream is *continuous*
  when no single wait exceeds the threshold (100 ms by default).

Audio durations always come from decoded samples: raw `pcm` bytes / 2 / 24000, a `wav` stream minus its 44-byte
header, and for SSE the base64-decoded `speech.audio.delta` payloads (which are themselves pcm or wav bytes).
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 24000
BYTES_PER_SAMPLE = 2
WAV_HEADER_BYTES = 44
CONTINUITY_THRESHOLD_S = 0.1
_EPS = 1e-9          # float slack: a stall of exactly the threshold is still continuous
STAT_KEYS = ("count", "mean", "std", "min", "median", "p90", "p95", "p99", "max")


# --- audio duration -------------------------------------------------------------------------------------------
def pcm_seconds(num_bytes: int) -> float:
    """Seconds of 24 kHz 16-bit mono PCM in num_bytes (a trailing odd byte is no sample)."""
    return (num_bytes // BYTES_PER_SAMPLE) / SAMPLE_RATE


def wav_seconds(num_bytes: int) -> float:
    """Seconds of a whole streamed wav (one 44-byte header, then PCM)."""
    return pcm_seconds(max(0, num_bytes - WAV_HEADER_BYTES))


class AudioByteCounter:
    """Turns the byte chunks of one pcm or wav stream, as they arrive, into the audio seconds each completes.

    The wav header is skipped however the chunks split it, and a 16-bit sample split across two chunks is counted
    once, in the chunk that completes it. Used for raw streams and for the decoded payloads of SSE deltas alike.
    """

    def __init__(self, response_format: str = "pcm") -> None:
        if response_format not in ("pcm", "wav"):
            raise ValueError(f"durations are measured on pcm or wav, not {response_format!r}")
        self.header_left = WAV_HEADER_BYTES if response_format == "wav" else 0
        self.pcm_bytes = 0          # PCM bytes seen so far (header excluded)
        self.total_bytes = 0        # everything seen

    def feed(self, num_bytes: int) -> float:
        """Audio seconds completed by a chunk of num_bytes."""
        self.total_bytes += num_bytes
        skipped = min(self.header_left, num_bytes)
        self.header_left -= skipped
        before = self.pcm_bytes // BYTES_PER_SAMPLE
        self.pcm_bytes += num_bytes - skipped
        return (self.pcm_bytes // BYTES_PER_SAMPLE - before) / SAMPLE_RATE

    @property
    def seconds(self) -> float:
        return pcm_seconds(self.pcm_bytes)


# --- server-sent events -----------------------------------------------------------------------------------------
class SSEParser:
    """Incremental `text/event-stream` parser: feed raw bytes, get the `data` of every completed event.

    Follows the HTML spec's rules that matter here: LF, CRLF or CR line ends; `data:` with or without one space;
    multi-line data joined by newlines; `:` comment lines (keep-alives) and other fields ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return events
            end, nxt = cut
            line = self._buffer[:end].decode("utf-8", errors="replace")
            self._buffer = self._buffer[nxt:]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)

    def finish(self) -> list[str]:
        """At end of stream: an unterminated last event still counts (lenient)."""
        tail = self.feed(b"\n\n") if self._buffer or self._data else []
        self._buffer = b""
        return tail


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None while the line is incomplete."""
    lf, cr = buffer.find(b"\n"), buffer.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return (lf, lf + 1) if lf != -1 else None
    if cr + 1 == len(buffer):
        return None                     # a CR at the very end may be half of a CRLF
    return cr, cr + 2 if buffer[cr + 1] == 0x0A else cr + 1


def parse_sse_event(data: str) -> tuple[str, bytes, dict]:
    """One event's data → (type, decoded audio bytes of a delta, the event). Raises ValueError on a bad event."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"SSE data is not JSON: {data[:80]!r}") from e
    if not isinstance(event, dict):
        raise ValueError(f"SSE data is not an object: {data[:80]!r}")
    kind = str(event.get("type", ""))
    if kind == "speech.audio.delta":
        try:
            return kind, base64.b64decode(event.get("audio") or "", validate=True), event
        except (binascii.Error, TypeError) as e:
            raise ValueError("speech.audio.delta with invalid base64 audio") from e
    return kind, b"", event


def sse_audio_seconds(datas: list[str], response_format: str = "pcm") -> float:
    """Audio seconds of a whole SSE response given its events' data (convenience for tests and offline checks)."""
    counter = AudioByteCounter(response_format)
    for data in datas:
        kind, audio, _ = parse_sse_event(data)
        if kind == "speech.audio.delta":
            counter.feed(len(audio))
    return counter.seconds


# --- per-request timeline ----------------------------------------------------------------------------------------
@dataclass
class Packet:
    arrival: float       # seconds, same clock as the send time
    audio_s: float       # audio seconds this packet completes


@dataclass
class PlayerStats:
    stall_s: float       # total time the started player waited on an empty buffer
    max_stall_s: float   # the longest single wait
    stalls: int          # number of waits (> 0 s)
    continuous: bool     # no wait above the threshold (and there was audio at all)


def simulate_player(packets: list[Packet], threshold_s: float = CONTINUITY_THRESHOLD_S) -> PlayerStats:
    """Real-time player starting at the first audio packet's arrival; packets in arrival order."""
    audible = [p for p in packets if p.audio_s > 0]
    if not audible:
        return PlayerStats(0.0, 0.0, 0, False)
    runs_dry_at = audible[0].arrival        # when the buffered audio runs out
    total, worst, count = 0.0, 0.0, 0
    for packet in audible:
        if packet.arrival > runs_dry_at + _EPS:
            wait = packet.arrival - runs_dry_at
            total += wait
            worst = max(worst, wait)
            count += 1
            runs_dry_at = packet.arrival
        runs_dry_at += packet.audio_s
    return PlayerStats(total, worst, count, worst <= threshold_s + _EPS)


def underrun(packets: list[Packet], threshold_s: float = CONTINUITY_THRESHOLD_S) -> tuple[float, bool]:
    """(total stall seconds, continuous)."""
    stats = simulate_player(packets, threshold_s)
    return stats.stall_s, stats.continuous


@dataclass
class RequestResult:
    send: float
    packets: list[Packet]
    end: float
    status: str                  # "200" (success) or the failure: "429", "sse_error", "ClientConnectorError", ...
    error: str | None = None     # the failure's message, shortened
    usage: dict | None = None    # SSE `speech.audio.done` usage
    total_bytes: int = 0
    meta: dict = field(default_factory=dict)   # prompt index, text length, language, ... copied into the row

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def audio_s(self) -> float:
        return sum(p.audio_s for p in self.packets)

    @property
    def ttfp(self) -> float | None:
        first = next((p for p in self.packets if p.audio_s > 0), None)
        return first.arrival - self.send if first else None

    @property
    def e2e(self) -> float:
        return self.end - self.send

    @property
    def rtf(self) -> float | None:
        audio = self.audio_s
        return self.e2e / audio if audio > 0 else None

    def row(self, threshold_s: float = CONTINUITY_THRESHOLD_S, origin: float | None = None,
            with_packets: bool = False) -> dict:
        """The JSON row (docs/bench_json_schema.md). origin: the level's start, for send_offset_s."""
        player = simulate_player(self.packets, threshold_s)
        row = dict(self.meta)
        row.update({"status": self.status, "ttfp_s": self.ttfp, "e2e_s": self.e2e, "audio_s": self.audio_s,
                    "rtf": self.rtf, "stall_s": player.stall_s, "max_stall_s": player.max_stall_s,
                    "stalls": player.stalls, "continuous": player.continuous, "packets": len(self.packets),
                    "bytes": self.total_bytes,
                    "output_tokens": (self.usage or {}).get("output_tokens"), "error": self.error})
        if origin is not None:
            row["send_offset_s"] = self.send - origin
        if with_packets:
            row["timeline"] = [[round(p.arrival - self.send, 6), round(p.audio_s, 6)] for p in self.packets]
        return row


# --- aggregates --------------------------------------------------------------------------------------------------
def summarize(values: list[float]) -> dict:
    """count / mean / std (population) / min / median / p90 / p95 / p99 / max; numpy's default (linear)
    percentiles. Empty → count 0 and None elsewhere."""
    if not values:
        return {k: (0 if k == "count" else None) for k in STAT_KEYS}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p95, p99 = (float(x) for x in np.percentile(a, [50, 90, 95, 99]))
    return {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
            "median": p50, "p90": p90, "p95": p95, "p99": p99, "max": float(a.max())}


def count_by(statuses: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return dict(sorted(counts.items()))


def aggregate(rows: list[dict], wall_s: float) -> dict:
    """One level's figures from its rows. Latency/RTF/stall statistics are over successful requests only;
    throughputs are successful requests (and their audio) per wall second of the level."""
    ok = [r for r in rows if r["status"] == "200"]
    audio = sum(r["audio_s"] for r in ok)
    per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: 0.0)
    return {"requests": len(rows), "ok": len(ok),
            "failures": count_by([r["status"] for r in rows if r["status"] != "200"]),
            "failure_rate": (len(rows) - len(ok)) / len(rows) if rows else 0.0,
            "wall_s": wall_s,
            "request_throughput": per_s(len(ok)),
            "audio_seconds": audio, "audio_seconds_per_second": per_s(audio),
            "ttfp_s": summarize([r["ttfp_s"] for r in ok if r["ttfp_s"] is not None]),
            "e2e_s": summarize([r["e2e_s"] for r in ok]),
            "rtf": summarize([r["rtf"] for r in ok if r["rtf"] is not None]),
            "audio_s": summarize([r["audio_s"] for r in ok]),
            "stall_s": summarize([r["stall_s"] for r in ok]),
            "continuity_rate": (sum(bool(r["continuous"]) for r in ok) / len(ok)) if ok else 0.0}


def health_figures(latencies_s: list[float], failures: list[str], interval_s: float) -> dict:
    """The /health probe of one level: latency statistics in ms, failures by status."""
    return dict(summarize([x * 1e3 for x in latencies_s]), probes=len(latencies_s), failures=len(failures),
                failures_by_status=count_by(failures), interval_ms=interval_s * 1e3)
