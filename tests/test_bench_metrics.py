"""bench_tts_serve.py's maths on synthetic timelines, and compare_runs.py."""
import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from bench_metrics import Packet, RequestResult, aggregate, pcm_seconds, sse_audio_seconds, summarize, underrun  # noqa: E402
import compare_runs  # noqa: E402


def test_ttfp_e2e_rtf():
    r = RequestResult(send=10.0, packets=[Packet(10.25, 0.16), Packet(10.5, 2.0), Packet(11.0, 1.84)], end=11.1,
                      status="200")
    assert r.ttfp == pytest.approx(0.25) and r.e2e == pytest.approx(1.1) and r.audio_s == pytest.approx(4.0)
    assert r.rtf == pytest.approx(1.1 / 4.0)
    failed = RequestResult(send=0.0, packets=[], end=0.3, status="429")
    assert failed.ttfp is None and failed.rtf is None and not failed.ok


def test_underrun_simulation():
    fast = [Packet(0.0, 0.5), Packet(0.2, 0.5), Packet(0.4, 0.5)]
    assert underrun(fast) == (0.0, True)
    # 0.16 s buffered at t=1.0, next packet at t=1.5: the player waits 0.34 s
    gap = [Packet(1.0, 0.16), Packet(1.5, 2.0), Packet(3.4, 1.0)]
    stall, continuous = underrun(gap)
    assert stall == pytest.approx(0.34) and not continuous
    # a 50 ms stall stays continuous at the 100 ms threshold, not at 40 ms
    small = [Packet(0.0, 0.1), Packet(0.15, 1.0)]
    assert underrun(small)[0] == pytest.approx(0.05)
    assert underrun(small)[1] and not underrun(small, threshold_s=0.04)[1]
    # stalls add up; audio arriving while the buffer still plays is no stall
    two = [Packet(0.0, 0.1), Packet(0.3, 0.1), Packet(0.45, 0.1), Packet(0.9, 0.1)]
    assert underrun(two)[0] == pytest.approx(0.2 + 0.05 + 0.35)
    assert underrun([Packet(5.0, 1.0)]) == (0.0, True)
    assert underrun([]) == (0.0, False)


def test_audio_durations_from_pcm_and_sse():
    assert pcm_seconds(48000) == pytest.approx(1.0)
    delta = json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(b"\0" * 9600).decode()})
    assert sse_audio_seconds(delta) == (pytest.approx(0.2), None)
    seconds, event = sse_audio_seconds(json.dumps({"type": "speech.audio.done", "usage": {"input_tokens": 3}}))
    assert seconds == 0 and event["type"] == "speech.audio.done"


def test_summaries_and_aggregates():
    values = [0.1, 0.2, 0.3, 0.4, 1.0]
    s = summarize(values)
    assert s["mean"] == pytest.approx(0.4) and s["median"] == pytest.approx(0.3)
    assert s["p90"] == pytest.approx(np.percentile(values, 90)) and s["max"] == 1.0
    assert summarize([])["median"] is None
    rows = [RequestResult(0.0, [Packet(0.1, 1.0), Packet(0.2, 1.0)], 0.5, "200").row(),
            RequestResult(0.0, [Packet(0.3, 2.0)], 1.0, "200").row(),
            RequestResult(0.0, [], 0.1, "429").row()]
    a = aggregate(rows, wall_s=2.0)
    assert a["ok"] == 2 and a["failures"] == {"429": 1}
    assert a["audio_seconds_per_second"] == pytest.approx(2.0) and a["request_throughput"] == pytest.approx(1.0)
    assert a["ttfp_s"]["median"] == pytest.approx(0.2) and a["continuity_rate"] == 1.0


def _run(ttfp, audio_rate, failures=0):
    level = {"concurrency": 4, "request_rate": None, "health_ms": {"p99": 5.0},
             "aggregates": {"ttfp_s": {"median": ttfp, "p99": ttfp * 2}, "e2e_s": {"median": 1.0},
                            "rtf": {"median": 0.5}, "audio_seconds_per_second": audio_rate,
                            "request_throughput": 1.0, "failures": {"500": failures} if failures else {}}}
    return {"schema_version": 1, "levels": [level]}


def test_compare_runs_deltas(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_run(0.2, 10.0)))
    new.write_text(json.dumps(_run(0.1, 15.0, failures=2)))
    assert compare_runs.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "| TTFP p50 ms | 200.000 | 100.000 | -100.000 | -50.0 % |" in out
    assert "| audio-s/s | 10.000 | 15.000 | +5.000 | +50.0 % |" in out
    assert "| failures | 0 | 2 | +2 | – |" in out
    (tmp_path / "bad.json").write_text("{}")
    assert compare_runs.main([str(old), str(tmp_path / "bad.json")]) == 2
    assert "not a bench_tts_serve.py result" in capsys.readouterr().err
