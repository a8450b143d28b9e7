"""Chunk connectors: put → get latency across two real processes, idle CPU, burst throughput, per kind.

    python benchmarks/bench_connector.py [--kind shm|tcp|both] [--chunks 1000] [--gap-ms 2]

The orchestrator-like parent owns the connector (shared-memory ring, or TCP on loopback
with a port it picks); a writer process (talker side) and a reader process (code2wav side)
are spawned. Each chunk carries its CLOCK_MONOTONIC put time in its first two int32 codes
(monotonic is system-wide, so both processes read one clock). Prints a Markdown table per
kind.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np

from omni_tts.connectors import ConnectorSpec, RingOwner, TcpOwner, chunk_reader, chunk_writer

SIZES = (1, 2, 25)
WARMUP = 50
IDLE_S = 2.0
BURST_CHUNKS = 5000


def stamp(codes: np.ndarray) -> None:
    codes[0, :2] = np.array([time.monotonic_ns()], dtype=np.int64).view(np.int32)


def writer_main(spec: ConnectorSpec, chunks: int, gap_s: float, ready: mp.Event, go: mp.Event, out: mp.Queue) -> None:
    put_ns: dict[int | str, list[int]] = {}
    with chunk_writer(spec) as writer:
        ready.wait()  # the reader would queue early chunks anyway; waiting keeps its start-up out of the numbers
        for frames in SIZES:
            codes = np.zeros((frames, spec.num_codebooks), np.int32)
            put_ns[frames] = []
            for i in range(chunks + WARMUP):
                stamp(codes)
                t0 = time.perf_counter_ns()
                writer.put(f"F{frames}", i, codes, is_last=i == chunks + WARMUP - 1)
                put_ns[frames].append(time.perf_counter_ns() - t0)
                time.sleep(gap_s)  # paced like a talker step loop: measures latency, not queueing
        writer.flush()
        codes = np.zeros((25, spec.num_codebooks), np.int32)
        put_ns["burst"] = []
        for i in range(BURST_CHUNKS):  # unpaced: throughput with back-pressure on a full ring
            stamp(codes)
            t0 = time.perf_counter_ns()
            writer.put("burst", i, codes, is_last=i == BURST_CHUNKS - 1)
            put_ns["burst"].append(time.perf_counter_ns() - t0)
        writer.flush()
        go.wait()
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(IDLE_S)
        idle = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        out.put(("writer", {f: np.array(v[WARMUP:]) for f, v in put_ns.items()}, idle, writer.stats().slot_stalls))


def reader_main(spec: ConnectorSpec, ready: mp.Event, go: mp.Event, out: mp.Queue) -> None:
    lat_ns: dict[str, list[int]] = {}
    burst_first = burst_last = 0
    with chunk_reader(spec) as reader:
        ready.set()
        finished = 0
        while finished < len(SIZES) + 1:
            chunk = reader.get()
            now = time.monotonic_ns()
            lat_ns.setdefault(chunk.request_id, []).append(now - int(chunk.codes[0, :2].view(np.int64)[0]))
            if chunk.request_id == "burst":
                burst_first = burst_first or now
                burst_last = now
            finished += chunk.is_last
            reader.release(chunk)
        go.set()
        cpu0, wall0 = time.process_time(), time.monotonic()
        assert reader.get(timeout=IDLE_S) is None  # consumer parked in get(), like the code2wav loop
        idle = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    lat = {k: np.array(v[WARMUP:]) for k, v in lat_ns.items() if k != "burst"}
    out.put(("reader", lat, idle, BURST_CHUNKS / ((burst_last - burst_first) / 1e9)))


def measure(kind: str, args: argparse.Namespace) -> dict[str, list]:
    """Both processes' results for one connector kind."""
    ctx = mp.get_context("spawn")
    if kind == "tcp":
        owner = TcpOwner.create(num_slots=args.slots, max_frames=max(SIZES))
    else:
        owner = RingOwner.create(num_slots=args.slots, max_frames=max(SIZES), edge="bench")
    with owner:
        out, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
        procs = [ctx.Process(target=reader_main, args=(owner.spec, ready, go, out)),
                 ctx.Process(target=writer_main, args=(owner.spec, args.chunks, args.gap_ms / 1e3, ready, go, out))]
        for p in procs:
            p.start()
        res = {}
        for _ in procs:
            role, *rest = out.get(timeout=600)
            res[role] = rest
        for p in procs:
            p.join()
    return res


def report(kind: str, res: dict[str, list]) -> None:
    put_ns, writer_idle, stalls = res["writer"]
    lat_ns, reader_idle, burst_rate = res["reader"]

    us = lambda a, q: np.percentile(a, q) / 1e3  # noqa: E731
    print(f"\n**{kind}**\n")
    print("| chunk frames | payload bytes | put() p50 µs | put() p99 µs "
          "| put→get p50 µs | put→get p99 µs | max µs |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for f in SIZES:
        lat = lat_ns[f"F{f}"]
        print(f"| {f} | {f * 16 * 4} | {us(put_ns[f], 50):.1f} | {us(put_ns[f], 99):.1f} | {us(lat, 50):.0f} | "
              f"{us(lat, 99):.0f} | {lat.max() / 1e3:.0f} |")
    print(f"\nburst of {BURST_CHUNKS} × 25-frame chunks: {burst_rate:,.0f} chunks/s "
          f"({burst_rate * 25 * 64 / 1e6:.1f} MB/s), {stalls} back-pressure stalls; put() p50 "
          f"{us(put_ns['burst'], 50):.1f} µs, p99 {us(put_ns['burst'], 99):.1f} µs when called back to back")
    print(f"idle CPU over {IDLE_S:.0f} s: writer process {writer_idle * 100:.2f} %, "
          f"reader process {reader_idle * 100:.2f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("shm", "tcp", "both"), default="both", help="connector kind(s) to measure")
    ap.add_argument("--chunks", type=int, default=1000, help="measured chunks per size")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="pause between puts")
    ap.add_argument("--slots", type=int, default=64, help="slots (chunks in flight)")
    args = ap.parse_args()

    kinds = ("shm", "tcp") if args.kind == "both" else (args.kind,)
    print(f"\n{os.cpu_count()} CPUs, {args.chunks} chunks per size paced {args.gap_ms} ms apart, "
          f"{args.slots} slots, load average {os.getloadavg()[0]:.2f} at start")
    for kind in kinds:  # one after the other: the two kinds never share the cores
        report(kind, measure(kind, args))


if __name__ == "__main__":
    main()
