"""What `sample_rate` costs a stream: CPU microseconds per second of audio for the resampler (24 kHz → each rate,
fed in the server's 4-frame chunks) and for the whole uncompressed encoder (resampler + int16 or G.711 bytes).

    python benchmarks/bench_resample.py [--seconds 60] [--repeats 5]
"""
import argparse
import time

import numpy as np

from omni_tts.audio.encoding import create_stream_encoder
from omni_tts.audio.resample import SAMPLE_RATES, Resampler

INPUT_RATE = 24000
CHUNK = 4 * 1920  # 4 codec frames of 80 ms


def best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    t = np.arange(int(args.seconds * INPUT_RATE)) / INPUT_RATE
    audio = (0.4 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    chunks = [audio[i:i + CHUNK] for i in range(0, audio.size, CHUNK)]

    def resample(rate: int) -> None:
        resampler = Resampler(INPUT_RATE, rate)
        for chunk in chunks:
            resampler(chunk)
        resampler.flush()

    def encode(fmt: str, rate: int) -> None:
        encoder = create_stream_encoder(fmt, INPUT_RATE, rate)
        encoder.start()
        for chunk in chunks:
            encoder.encode(chunk)
        encoder.finish()

    print("| sample_rate | resampler µs per audio-second | pcm encoder µs per audio-second |")
    print("|---:|---:|---:|")
    for rate in SAMPLE_RATES:
        resampler = best_of(args.repeats, lambda: resample(rate)) / args.seconds * 1e6
        encoder = best_of(args.repeats, lambda: encode("pcm", rate)) / args.seconds * 1e6
        print(f"| {rate} | {resampler:.0f} | {encoder:.0f} |")
    ulaw = best_of(args.repeats, lambda: encode("ulaw", 8000)) / args.seconds * 1e6
    print(f"ulaw encoder (resampler + G.711), µs per audio-second: {ulaw:.0f}")


if __name__ == "__main__":
    main()
