"""The benchmark client's maths (benchmarks/bench_metrics.py) on synthetic timelines, and compare_runs.py."""
import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import compare_runs  # noqa: E402
from bench_metrics import (AudioByteCounter, Packet, RequestResult, SSEParser, aggregate,  # noqa: E402
                           health_figures, parse_sse_event, pcm_seconds, simulate_player, sse_audio_seconds,
                           summarize, underrun, wav_seconds)


# --- TTFP / E2E / RTF ----------------------------------------------------------------------------------------------
def test_ttfp_e2e_rtf_exact():
    r = RequestResult(send=10.0, packets=[Packet(10.25, 0.5), Packet(10.5, 2.0), Packet(11.0, 1.5)], end=11.0,
                      status="200")
    assert r.ttfp == pytest.approx(0.25)
    assert r.e2e == pytest.approx(1.0)
    assert r.audio_s == pytest.approx(4.0)
    assert r.rtf == pytest.approx(0.25)
    row = r.row(origin=9.5)
    assert row["send_offset_s"] == pytest.approx(0.5) and row["packets"] == 3 and row["stall_s"] == 0.0


def test_ttfp_skips_packets_without_audio_and_failures_have_none():
    # a header-only (or lone odd byte) packet is no audio: TTFP counts from the first real samples
    r = RequestResult(0.0, [Packet(0.1, 0.0), Packet(0.3, 1.0)], 0.5, "200")
    assert r.ttfp == pytest.approx(0.3)
    failed = RequestResult(send=0.0, packets=[], end=0.3, status="429", error="busy")
    assert failed.ttfp is None and failed.rtf is None and not failed.ok and failed.e2e == pytest.approx(0.3)
    assert failed.row()["continuous"] is False and failed.row()["error"] == "busy"


# --- underrun simulation --------------------------------------------------------------------------------------------
def test_faster_than_real_time_never_stalls():
    fast = [Packet(0.0, 0.5), Packet(0.2, 0.5), Packet(0.4, 0.5), Packet(0.6, 0.5)]
    assert underrun(fast) == (0.0, True)
    # arriving exactly when the buffer runs dry is no stall either
    edge = [Packet(1.0, 0.25), Packet(1.25, 0.25), Packet(1.5, 0.25)]
    assert simulate_player(edge).stalls == 0 and underrun(edge) == (0.0, True)


def test_a_gap_gives_the_exact_stall():
    # 0.16 s buffered at t=1.0 runs dry at 1.16; the next packet comes at 1.5: a 0.34 s wait.
    # Playback then runs 1.5 → 3.5, so the packet at 3.4 arrives in time.
    gap = [Packet(1.0, 0.16), Packet(1.5, 2.0), Packet(3.4, 1.0)]
    stats = simulate_player(gap)
    assert stats.stall_s == pytest.approx(0.34) and stats.max_stall_s == pytest.approx(0.34)
    assert stats.stalls == 1 and not stats.continuous
    # several waits add up; audio arriving while the buffer still plays is no stall
    two = [Packet(0.0, 0.1), Packet(0.3, 0.1), Packet(0.45, 0.1), Packet(0.9, 0.1)]
    stats = simulate_player(two)
    assert stats.stall_s == pytest.approx(0.2 + 0.05 + 0.35) and stats.stalls == 3
    assert stats.max_stall_s == pytest.approx(0.35)


def test_continuity_threshold():
    small = [Packet(0.0, 0.1), Packet(0.15, 1.0)]                 # one 50 ms wait
    assert underrun(small)[0] == pytest.approx(0.05)
    assert underrun(small)[1]                                      # ≤ 100 ms: continuous
    assert not underrun(small, threshold_s=0.04)[1]
    at = [Packet(0.0, 0.1), Packet(0.2, 1.0)]                      # a wait of exactly the threshold is allowed
    assert underrun(at, threshold_s=0.1)[1]
    # many small waits stay continuous even though their sum exceeds the threshold
    many = [Packet(0.08 * i + 0.02 * i, 0.08) for i in range(10)]  # 20 ms wait before each later packet
    stall, continuous = underrun(many)
    assert stall == pytest.approx(9 * 0.02) and stall > 0.1 and continuous


def test_single_packet_and_empty():
    assert underrun([Packet(5.0, 1.0)]) == (0.0, True)
    assert underrun([]) == (0.0, False)
    assert underrun([Packet(1.0, 0.0)]) == (0.0, False)           # bytes but no whole sample


def test_player_starts_at_the_first_audio_packet():
    # the zero-audio packet at t=0 (e.g. a wav header) does not start the clock
    stats = simulate_player([Packet(0.0, 0.0), Packet(0.5, 0.2), Packet(0.7, 0.2)])
    assert stats.stall_s == 0.0 and stats.continuous


# --- audio duration from decoded samples ----------------------------------------------------------------------------
def test_pcm_and_wav_byte_counts():
    assert pcm_seconds(48000) == pytest.approx(1.0)
    assert pcm_seconds(48001) == pytest.approx(1.0)               # a trailing odd byte is no sample
    assert wav_seconds(44 + 4800) == pytest.approx(0.1)
    assert wav_seconds(44) == 0.0 and wav_seconds(10) == 0.0


def test_counter_splits_wav_header_and_samples_across_chunks():
    wav = AudioByteCounter("wav")
    assert wav.feed(30) == 0.0                                     # part of the header
    assert wav.feed(14 + 3) == pytest.approx(1 / 24000)            # rest of the header + 1.5 samples
    assert wav.feed(1) == pytest.approx(1 / 24000)                 # completes the split sample
    assert wav.feed(47996) == pytest.approx(47996 / 2 / 24000)
    assert wav.seconds == pytest.approx(1.0) and wav.total_bytes == 44 + 48000
    pcm = AudioByteCounter("pcm")
    assert sum(pcm.feed(n) for n in (1, 1, 4799, 4799)) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        AudioByteCounter("mp3")


def _sse(events: list[dict], line_end: str = "\n") -> bytes:
    return "".join(f"event: {e['type']}{line_end}data: {json.dumps(e)}{line_end}{line_end}" for e in events).encode()


def _delta(raw: bytes) -> dict:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(raw).decode(), "response_format": "pcm"}


DONE = {"type": "speech.audio.done", "usage": {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8}}


@pytest.mark.parametrize("line_end", ["\n", "\r\n", "\r"])
def test_sse_parser_any_split_any_line_end(line_end):
    stream = b": keepalive" + line_end.encode() + line_end.encode() + _sse([_delta(b"\0" * 9600), DONE], line_end)
    for size in (1, 2, 7, len(stream)):
        parser, datas = SSEParser(), []
        for i in range(0, len(stream), size):
            datas += parser.feed(stream[i:i + size])
        datas += parser.finish()
        kinds = [parse_sse_event(d)[0] for d in datas]
        assert kinds == ["speech.audio.delta", "speech.audio.done"], (size, kinds)
        assert sse_audio_seconds(datas) == pytest.approx(0.2)


def test_sse_durations_decode_the_base64_payloads():
    # the base64 text is 4/3 the bytes: counting it would overstate the audio by a third
    datas = [json.dumps(_delta(b"\0" * 4800)), json.dumps(_delta(b"\0" * 19200)), json.dumps(DONE)]
    assert sse_audio_seconds(datas) == pytest.approx(0.5)
    # wav over SSE: the first delta carries the 44-byte header
    wav = [json.dumps(_delta(b"R" * 44 + b"\0" * 4800)), json.dumps(_delta(b"\0" * 4800))]
    assert sse_audio_seconds(wav, "wav") == pytest.approx(0.2)
    kind, audio, event = parse_sse_event(json.dumps(DONE))
    assert kind == "speech.audio.done" and audio == b"" and event["usage"]["output_tokens"] == 3
    assert parse_sse_event('{"type":"speech.audio.error","error":{"message":"x"}}')[0] == "speech.audio.error"
    for bad in ("not json", "[1]", '{"type":"speech.audio.delta","audio":"@@@"}'):
        with pytest.raises(ValueError):
            parse_sse_event(bad)
    # data: without the space, multi-line data, an unterminated last event
    parser = SSEParser()
    assert parser.feed(b'data:{"a":\ndata: 1}\n\ndata: {"b": 2}') == ['{"a":\n1}']
    assert parser.finish() == ['{"b": 2}']


# --- aggregates -----------------------------------------------------------------------------------------------------
def test_summarize_matches_numpy():
    values = [0.1, 0.2, 0.3, 0.4, 1.0, 2.5, 0.05]
    s = summarize(values)
    assert s["count"] == 7 and s["mean"] == pytest.approx(np.mean(values)) and s["std"] == pytest.approx(np.std(values))
    for key, q in (("median", 50), ("p90", 90), ("p95", 95), ("p99", 99)):
        assert s[key] == pytest.approx(np.percentile(values, q))
    assert s["min"] == 0.05 and s["max"] == 2.5
    assert summarize([0.1, 0.2, 0.3, 0.4])["p90"] == pytest.approx(0.37)   # linear interpolation
    empty = summarize([])
    assert empty["count"] == 0 and empty["median"] is None and empty["p99"] is None


def test_aggregate_known_rows():
    rows = [RequestResult(0.0, [Packet(0.1, 1.0), Packet(0.2, 1.0)], 0.5, "200").row(),      # ttfp .1, rtf .25
            RequestResult(0.0, [Packet(0.3, 2.0)], 1.0, "200").row(),                        # ttfp .3, rtf .5
            RequestResult(0.0, [Packet(0.2, 0.1), Packet(0.5, 1.9)], 2.0, "200").row(),      # ttfp .2, 0.2 s stall
            RequestResult(0.0, [], 0.1, "429").row(),
            RequestResult(0.0, [], 0.2, "429").row(),
            RequestResult(0.0, [], 5.0, "ClientConnectorError").row()]
    a = aggregate(rows, wall_s=2.0)
    assert a["requests"] == 6 and a["ok"] == 3 and a["failure_rate"] == pytest.approx(0.5)
    assert a["failures"] == {"429": 2, "ClientConnectorError": 1}
    assert a["audio_seconds"] == pytest.approx(6.0) and a["audio_seconds_per_second"] == pytest.approx(3.0)
    assert a["request_throughput"] == pytest.approx(1.5)
    assert a["ttfp_s"]["median"] == pytest.approx(0.2) and a["ttfp_s"]["count"] == 3
    assert a["ttfp_s"]["p99"] == pytest.approx(np.percentile([0.1, 0.3, 0.2], 99))
    assert a["e2e_s"]["mean"] == pytest.approx(3.5 / 3)                      # failures excluded
    assert a["rtf"]["median"] == pytest.approx(0.5)                         # rtfs .25, .5, 1.0
    assert a["stall_s"]["max"] == pytest.approx(0.2)
    assert a["continuity_rate"] == pytest.approx(2 / 3)
    nothing = aggregate([RequestResult(0.0, [], 1.0, "500").row()], wall_s=1.0)
    assert nothing["ok"] == 0 and nothing["ttfp_s"]["median"] is None and nothing["continuity_rate"] == 0.0
    assert aggregate([], wall_s=0.0)["request_throughput"] == 0.0


def test_health_figures():
    h = health_figures([0.001, 0.002, 0.003, 0.010], ["503", "TimeoutError", "503"], 0.05)
    assert h["probes"] == 4 and h["failures"] == 3 and h["failures_by_status"] == {"503": 2, "TimeoutError": 1}
    assert h["median"] == pytest.approx(2.5) and h["max"] == pytest.approx(10.0) and h["interval_ms"] == 50.0
    assert h["p99"] == pytest.approx(np.percentile([1, 2, 3, 10], 99))


# --- compare_runs ---------------------------------------------------------------------------------------------------
def _run(ttfp, audio_rate, failures=0, schema=2, concurrency=4, **config):
    level = {"concurrency": concurrency, "request_rate": None, "health_ms": {"p99": 5.0},
             "aggregates": {"ttfp_s": {"median": ttfp, "p99": ttfp * 2}, "e2e_s": {"median": 1.0},
                            "rtf": {"median": 0.5}, "audio_seconds_per_second": audio_rate,
                            "request_throughput": 1.0, "continuity_rate": 1.0,
                            "failures": {"500": failures} if failures else {}}}
    return {"schema_version": schema, "config": dict({"model": "m"}, **config), "levels": [level]}


def test_compare_runs_deltas(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_run(0.2, 10.0, schema=1)))
    new.write_text(json.dumps(_run(0.1, 15.0, failures=2)))
    assert compare_runs.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "## c=4" in out
    assert "| TTFP p50 ms | 200.000 | 100.000 | -100.000 | -50.0 % | better |" in out
    assert "| TTFP p99 ms | 400.000 | 200.000 | -200.000 | -50.0 % | better |" in out
    assert "| audio-s/s | 10.000 | 15.000 | +5.000 | +50.0 % | better |" in out
    assert "| RTF p50 | 0.500 | 0.500 | +0.000 | +0.0 % | = |" in out
    assert "| failures | 0 | 2 | +2 | – | worse |" in out
    assert "configuration differs" not in out
    d = compare_runs.delta(4.0, 5.0, lower_is_better=True)
    assert d == {"abs": 1.0, "pct": 25.0, "direction": "worse"}


def test_compare_runs_flags_config_and_levels(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run(0.2, 10.0, stream_format="audio")))
    run_b = _run(0.2, 10.0, stream_format="sse")
    run_b["levels"].append(dict(run_b["levels"][0], concurrency=16))
    b.write_text(json.dumps(run_b))
    assert compare_runs.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "configuration differs: stream_format: 'audio' → 'sse'" in out and "only in B: c=16" in out


def test_compare_runs_rejects_bad_inputs(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_run(0.2, 10.0)))
    cases = {"missing.json": None, "garbage.json": "{not json", "empty.json": "{}",
             "future.json": json.dumps(_run(0.2, 10.0, schema=99)),
             "malformed.json": json.dumps({"schema_version": 2, "levels": [{"concurrency": 1}]}),
             "disjoint.json": json.dumps(_run(0.2, 10.0, concurrency=64))}
    expected = {"missing.json": "cannot read", "garbage.json": "cannot read", "empty.json": "not a bench_tts_serve",
                "future.json": "schema_version 99", "malformed.json": "level 0 is malformed",
                "disjoint.json": "share no level"}
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        assert compare_runs.main([str(good), str(path)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("compare_runs: ") and expected[name] in err, (name, err)


# --- the client against a fake server: failures are counted by status, never crash the run --------------------------
def test_client_counts_failures_by_status(tmp_path):
    import asyncio

    from aiohttp import web

    import bench_tts_serve

    pcm = b"\1\0" * 2400                                            # 0.1 s

    async def speech(request):
        body = await request.json()
        text, sse = body["input"], body["stream_format"] == "sse"
        if text == "busy":
            return web.json_response({"error": {"message": "queue full", "type": "x", "param": None, "code": None}},
                                     status=429)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "audio/pcm"})
        await response.prepare(request)
        if text == "empty":
            return response
        if sse:
            await response.write(_sse([_delta(pcm)]))
            if text == "sse-error":
                await response.write(_sse([{"type": "speech.audio.error", "error": {"message": "boom"}}]))
            elif text != "no-done":
                await response.write(_sse([DONE]))
        else:
            for _ in range(3):
                await response.write(pcm)
                await asyncio.sleep(0.01)
            if text == "drop":
                request.transport.close()
                return response
        await response.write_eof()
        return response

    async def health(request):
        return web.json_response({"status": "healthy"})

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/audio/speech", speech)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with bench_tts_serve.aiohttp.ClientSession() as session:
                out = {}
                for text, fmt in (("ok", "audio"), ("ok", "sse"), ("busy", "audio"), ("sse-error", "sse"),
                                  ("no-done", "sse"), ("empty", "audio"), ("drop", "audio")):
                    payload = {"model": "m", "input": text, "stream_format": fmt, "response_format": "pcm"}
                    out[text, fmt] = await bench_tts_serve.one_request(session, url, payload, {})
            dataset = tmp_path / "d.jsonl"
            dataset.write_text("\n".join(json.dumps({"text": t}) for t in ("ok", "busy", "empty", "ok")) + "\n")
            argv = ["--base-url", url, "--model", "m", "--concurrency", "1", "2", "--num-prompts", "4",
                    "--warmups", "1", "--dataset", str(dataset), "--no-plots", "--no-progress", "--health-interval-ms",
                    "20", "--result-dir", str(tmp_path), "--name", "run"]
            args = bench_tts_serve.parse_args(argv)
            doc = {"config": vars(args), "levels": [], "warmup": None}
            await bench_tts_serve.run(args, doc)
            return out, doc
        finally:
            await runner.cleanup()

    out, doc = asyncio.run(scenario())
    assert out["ok", "audio"].status == "200" and out["ok", "audio"].audio_s == pytest.approx(0.3)
    assert out["ok", "sse"].status == "200" and out["ok", "sse"].usage["output_tokens"] == 3
    assert out["busy", "audio"].status == "429" and out["busy", "audio"].error == "queue full"
    assert out["sse-error", "sse"].status == "sse_error" and "boom" in out["sse-error", "sse"].error
    assert out["no-done", "sse"].status == "sse_no_done"
    assert out["empty", "audio"].status == "empty_audio"
    assert out["drop", "audio"].status not in ("200", "empty_audio"), out["drop", "audio"].status
    assert [lv["label"] for lv in doc["levels"]] == ["c=1", "c=2"]
    for level in doc["levels"]:
        a = level["aggregates"]
        assert a["requests"] == 4 and a["ok"] == 2 and a["failures"] == {"429": 1, "empty_audio": 1}
        assert level["health_ms"]["probes"] >= 1 and level["health_ms"]["failures"] == 0
        assert sorted(r["prompt"] for r in level["rows"]) == [0, 1, 2, 3]
    assert doc["warmup"]["requests"] == 1
