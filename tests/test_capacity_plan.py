"""benchmarks/capacity_plan.py: streams per replica from a measured curve, then replicas and GPUs."""
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from capacity_plan import Level, main, plan, streams_per_replica  # noqa: E402

# audio rate grows with batching: 1 stream 2 audio-s/s, 8 streams 10, 16 streams 12 (TTFP p99 0.2, 0.5, 2.0 s)
CURVE = [Level(1, 2.0, 0.2), Level(8, 10.0, 0.5), Level(16, 12.0, 2.0)]


def test_streams_per_replica_is_where_the_audio_rate_stops_keeping_up():
    # between 8 and 16 the rate is 10 + (c - 8) / 4: real time with 20 % headroom needs it >= 1.2 c → c <= 8
    assert streams_per_replica(CURVE, ttfp_target=5.0, headroom=0.2) == 8
    # no headroom: 10 + (c - 8) / 4 >= c up to c = 10
    assert streams_per_replica(CURVE, ttfp_target=5.0, headroom=0.0) == 10
    # the TTFP target binds first: 0.5 s is reached at c = 8
    assert streams_per_replica(CURVE, ttfp_target=0.5, headroom=0.0) == 8
    assert streams_per_replica(CURVE, ttfp_target=0.1, headroom=0.0) == 0


def test_never_beyond_the_largest_level_measured():
    assert streams_per_replica([Level(1, 50.0, 0.1), Level(4, 100.0, 0.1)], ttfp_target=1.0, headroom=0.0) == 4


def test_replicas_and_gpus_round_up():
    rows = plan(CURVE, [10, 100, 1000], ttfp_target=5.0, headroom=0.2, replicas_per_gpu=2)
    assert [(r["replicas"], r["gpus"]) for r in rows] == [(2, 1), (13, 7), (125, 63)]


def test_cli_reads_a_bench_result_and_fails_clearly(tmp_path, capsys):
    result = tmp_path / "run.json"
    result.write_text(json.dumps({"levels": [
        {"concurrency": c, "aggregates": {"audio_seconds_per_second": rate, "ttfp_s": {"p99": ttfp}}}
        for c, rate, ttfp in [(1, 2.0, 0.2), (8, 10.0, 0.5), (16, 12.0, 2.0)]]}))
    assert main([str(result), "--ttfp-target", "5"]) == 0
    assert "one replica: 8 real-time streams" in capsys.readouterr().out
    assert main([str(result), "--ttfp-target", "0.1"]) == 2
    assert "no measured level" in capsys.readouterr().err
    (tmp_path / "other.json").write_text("{}")
    assert main([str(tmp_path / "other.json")]) == 2
    assert "not a bench_tts_serve.py result" in capsys.readouterr().err
