"""Where a serving step's time goes, per component, in-process on this machine (no sockets).

    python benchmarks/bench_breakdown.py [--preset small medium] [--batch 1 16] [--threads 1] [--repeats 20]

For each preset (a random checkpoint built by make-tiny-model in a temp dir) and batch size B, times:
  - talker step: the engine's whole step for B running rows (code predictor + talker + sampling + one D2H copy),
  - code predictor: codebooks 1..15 of B rows (15 small forwards + 15 draws), greedy,
  - talker forward: one decode forward of B rows,
  - sampling: one talker draw + 15 codebook draws for B rows, greedy and at temperature 0.9 (noise included),
  - decoder call: one streaming decode of B requests × F frames (F = 2 first packet, F = 25 steady chunk),
  - HTTP encode: one 25-frame chunk (2 s) through each response format's stream encoder (per stream).
Prints one Markdown table of median / p90 milliseconds. The connector (shared-memory ring) is measured across two
processes by bench_connector.py.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from typing import Callable

import numpy as np
import torch

from omni_tts.audio.encoding import create_stream_encoder
from omni_tts.config import set_torch_threads
from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_model
from omni_tts.models.qwen3_tts.sampling import GREEDY, SamplingParams, warp_and_sample
from omni_tts.models.qwen3_tts.sampling_params import MAX_NEW_TOKENS

FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")


def time_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return float(np.median(samples)), float(np.percentile(samples, 90))


class RunningEngine:
    """A talker engine kept at `batch` running rows: a row that ends (random weights do emit EOS) is replaced
    before the next step, so a timed step always decodes `batch` rows (a refill's prefill lands in a few steps,
    which the median ignores)."""

    def __init__(self, tts: Qwen3TTS, batch: int, temperature: float) -> None:
        self.engine = TalkerEngine(tts.talker, tts.config, batch, 1024, 1 << 16, 512)
        self.tts, self.batch, self.temperature, self.added = tts, batch, temperature, 0
        self.step()  # admits (prefills) every row

    def step(self) -> None:
        while self.engine.stats().num_running + self.engine.stats().num_waiting < self.batch:
            p = prepare(self.tts, SynthesisRequest(
                text=f"Request {self.added}: a sentence of ordinary length to speak.", voice="ryan",
                sampling=SamplingParams(temperature=self.temperature, seed=self.added, max_new_tokens=MAX_NEW_TOKENS)))
            self.engine.add_request(TalkerRequest(str(self.added), p.prefill, p.trailing, p.sampling, 100_000))
            self.added += 1
        self.engine.step()


def breakdown(tts: Qwen3TTS, batch: int, repeats: int) -> list[tuple[str, float, float]]:
    rows: list[tuple[str, float, float]] = []
    engine = RunningEngine(tts, batch, 0.0)
    runner, talker = engine.engine.runner, tts.talker
    rows.append(("talker step (greedy)", *time_ms(engine.step, repeats)))
    b = slice(0, batch)
    with torch.inference_mode():
        keys = runner.sampler.noise_keys(b)
        rows.append(("code predictor", *time_ms(lambda: runner.predict_frame(b, keys, GREEDY), repeats)))
        x = torch.randn(batch, runner.hidden.shape[1], dtype=runner.dtype)
        slots = runner.lengths[b].clone()
        num_slots = int(slots.max()) + 1
        rows.append(("talker forward", *time_ms(lambda: talker.decode_step(x, slots, runner.cache.rows(0, batch),
                                                                           num_slots), repeats)))
        for temperature in (0.0, 0.9):
            sampled = RunningEngine(tts, batch, temperature)
            sampler = sampled.engine.runner.sampler
            talker_logits = torch.randn(batch, tts.config.talker.vocab_size)
            cp_logits = torch.randn(batch, tts.config.talker.code_predictor.vocab_size)

            def draw() -> None:   # as a step draws: the keys in one pass, the code predictor's warpers sliced once
                keys, (talker_paths, codebook_paths) = sampler.noise_keys(b), sampler.paths(b)
                sampler.sample_talker(talker_logits, b, keys[:, 0], talker_paths)
                warpers = sampler.codebooks.rows(b)
                for j in range(1, 16):
                    warp_and_sample(cp_logits, warpers, keys[:, j], codebook_paths)
            rows.append((f"sampling, 16 draws (temperature {temperature})", *time_ms(draw, repeats)))
            if temperature > 0:
                rows.append((f"talker step (temperature {temperature})", *time_ms(sampled.step, repeats)))
    decoder = tts.decoder
    for frames in (2, 25):
        codes = torch.randint(0, 2048, (batch, 16, frames))

        def decode() -> None:
            with torch.inference_mode():
                decoder.decode_chunk(codes, decoder.new_stream_state(batch))
        rows.append((f"decoder call, {batch} × {frames} frames", *time_ms(decode, max(3, repeats // 4))))
    chunk = (np.random.default_rng(0).standard_normal(25 * 1920) * 0.1).astype(np.float32)
    for fmt in FORMATS:
        encoder = create_stream_encoder(fmt)
        encoder.start()
        rows.append((f"HTTP encode {fmt}, one 2 s chunk", *time_ms(lambda: encoder.encode(chunk), repeats)))
        encoder.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["small"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the stage default on 2 cores is 1)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    set_torch_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)\n")
    print("| preset | B | component | p50 ms | p90 ms |\n|---|---:|---|---:|---:|")
    for preset in args.preset:
        with tempfile.TemporaryDirectory() as tmp:
            make_random_model(tmp, "custom_voice", preset, 0, torch.float32)
            tts = Qwen3TTS(tmp)
            for batch in args.batch:
                for name, p50, p90 in breakdown(tts, batch, args.repeats):
                    print(f"| {preset} | {batch} | {name} | {p50:.2f} | {p90:.2f} |", flush=True)


if __name__ == "__main__":
    main()
