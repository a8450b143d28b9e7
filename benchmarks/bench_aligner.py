"""The forced aligner's cost on this machine (in-process, no server): time per second of audio, and where it goes.

    python benchmarks/bench_aligner.py [--preset tiny 0.6b] [--seconds 3 10 30] [--batch 1 16] [--threads 1 2]
                                       [--repeats 3] [--budget-s 60] [--out RESULT.json]

Each preset is a random-weight checkpoint in the released layout (`omni-tts make-tiny-model --variant
forced_aligner`; `0.6b` = Qwen3-ForcedAligner-0.6B's shapes), built once into $OMNI_TTS_CACHE (default
~/.cache/omni_tts) as `forced-aligner-<preset>-seed<seed>`, bf16 on disk, run in fp32. The cost depends on lengths
only, not on what is said: a clip is 24 kHz noise and tones (the TTS output rate, so the resampling to 16 kHz is
counted) with English text of `--words-per-second` words per second of audio. A call aligns `batch` such clips of one
length (`ForcedAligner.align`, as the serving stage calls it).

Per (preset, threads): one untimed warm-up call (batch 1, the shortest clip), then per (batch, clip length) timed
calls until `--repeats` or until `--budget-s` of calls have run (at least one); the median is reported. Each timed
call also gives its pieces: features (`to_16k` + `features.log_mel` of every clip, timed on their own just before
the call), the audio encoder (`model.audio_tower`, every clip) and the decoder layers (`model.model.layers` +
final norm), both timed by forward hooks inside the call; "other" is the rest of the call (words, prompt, embedding,
mask and cache set-up, head, fix-up). Process CPU time is recorded beside wall time (robust to other load).

Prints a Markdown table; `--out` writes the JSON: `machine` (bench_runner.machine()), `config` (the options),
`load_s` (checkpoint load per preset), `rows` (one per preset × threads × batch × clip length, medians in seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_runner import machine  # noqa: E402

from omni_tts.models.qwen3_forced_aligner.aligner import AlignItem, ForcedAligner  # noqa: E402
from omni_tts.models.qwen3_forced_aligner.features import log_mel, to_16k  # noqa: E402
from omni_tts.models.qwen3_forced_aligner.random_model import PRESETS, make_random_aligner  # noqa: E402

CLIP_RATE = 24000
# Plain English prose with punctuation and numbers; words are taken from it in order, wrapping around.
PROSE = (
    "The train to Edinburgh leaves platform 4 at 9:15 tomorrow morning, so please be at the station early. "
    "If the weather holds, we will walk along the river after lunch and visit the old market, which has been "
    "open every Saturday since 1872. Remember to bring a warm coat, a bottle of water and your ticket; the "
    "conductor checks them twice on the way north. Last year the journey took just over four hours, but the new "
    "timetable promises to cut that by nearly 30 minutes. When we arrive, Sarah's cousin will meet us outside "
    "the main entrance and drive us to the hotel, where dinner is served until half past eight."
).split()


def cached_aligner(preset: str, seed: int) -> str:
    """The random checkpoint of `preset` under $OMNI_TTS_CACHE, built on first use."""
    root = os.environ.get("OMNI_TTS_CACHE", os.path.expanduser("~/.cache/omni_tts"))
    path = os.path.join(root, f"forced-aligner-{preset}-seed{seed}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        print(f"building {path}", file=sys.stderr)
        make_random_aligner(path, preset, seed)
    return path


def english_text(num_words: int, offset: int) -> str:
    return " ".join(PROSE[(offset + i) % len(PROSE)] for i in range(num_words))


def clip(seconds: float, seed: int) -> np.ndarray:
    """24 kHz float32: a gliding tone under noise, in 4 Hz syllable-like bursts."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * CLIP_RATE)) / CLIP_RATE
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2
    tone = np.sin(2 * np.pi * (150.0 + 50.0 * np.sin(2 * np.pi * 0.3 * t)) * t)
    return (envelope * (0.3 * tone + 0.05 * rng.standard_normal(t.size))).astype(np.float32)


def make_items(batch: int, seconds: float, words_per_second: float) -> list[AlignItem]:
    num_words = max(1, round(words_per_second * seconds))
    return [AlignItem(clip(seconds, seed=i), CLIP_RATE, english_text(num_words, offset=7 * i), "English")
            for i in range(batch)]


class SpanTimer:
    """Wall time spent between a module's forward pre-hook (`first`) and another's forward hook (`last`)."""

    def __init__(self, first: nn.Module, last: nn.Module) -> None:
        self.total, self._start = 0.0, 0.0
        self.handles = [first.register_forward_pre_hook(self._enter), last.register_forward_hook(self._exit)]

    def _enter(self, *_) -> None:
        self._start = time.perf_counter()

    def _exit(self, *_) -> None:
        self.total += time.perf_counter() - self._start

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


def features_time(aligner: ForcedAligner, items: list[AlignItem]) -> float:
    start = time.perf_counter()
    for item in items:
        log_mel(to_16k(item.audio, item.sample_rate), aligner.cfg.audio.num_mel_bins)
    return time.perf_counter() - start


def measure(aligner: ForcedAligner, items: list[AlignItem], repeats: int, budget_s: float) -> dict:
    """Timed calls of `aligner.align(items)`: medians of the call and its pieces, in seconds."""
    model = aligner.model
    encoder = SpanTimer(model.audio_tower, model.audio_tower)
    decoder = SpanTimer(model.model.layers[0], model.model.norm)
    # the lengths the cost follows: encoder positions of a clip, and the padded prompt the decoder runs
    shapes: dict[str, int] = {}

    def audio_tokens(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
        shapes["audio_tokens"] = out.shape[0]

    def prompt_tokens(_module: nn.Module, inputs: tuple, _out: torch.Tensor) -> None:
        shapes["prompt_tokens"] = inputs[0].shape[1]

    encoder.handles.append(model.audio_tower.register_forward_hook(audio_tokens))
    decoder.handles.append(model.model.embed_tokens.register_forward_hook(prompt_tokens))
    runs: dict[str, list[float]] = {key: [] for key in ("wall_s", "cpu_s", "features_s", "encoder_s", "decoder_s")}
    try:
        while len(runs["wall_s"]) < repeats and (not runs["wall_s"] or sum(runs["wall_s"]) < budget_s):
            runs["features_s"].append(features_time(aligner, items))
            wall, cpu = time.perf_counter(), time.process_time()
            words = aligner.align(items)
            runs["wall_s"].append(time.perf_counter() - wall)
            runs["cpu_s"].append(time.process_time() - cpu)
            runs["encoder_s"].append(encoder.take())
            runs["decoder_s"].append(decoder.take())
            if any(not w for w in words):
                raise RuntimeError("a clip got no words: the benchmark would not time the whole pipeline")
    finally:
        for handle in encoder.handles + decoder.handles:
            handle.remove()
    medians = {key: statistics.median(values) for key, values in runs.items()}
    medians["other_s"] = medians["wall_s"] - medians["features_s"] - medians["encoder_s"] - medians["decoder_s"]
    return {**shapes, "runs": len(runs["wall_s"]), **medians, "samples": runs}


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    rows, load_s, where = [], {}, machine()  # the load average and time at the start
    for preset in args.preset:
        model_dir = args.model or cached_aligner(preset, args.seed)
        start = time.perf_counter()
        aligner = ForcedAligner(model_dir)
        load_s[preset] = time.perf_counter() - start
        for threads in args.threads:
            torch.set_num_threads(threads)
            aligner.align(make_items(1, min(args.seconds), args.words_per_second))  # warm-up
            for batch in args.batch:
                for seconds in args.seconds:
                    items = make_items(batch, seconds, args.words_per_second)
                    audio_s = batch * seconds
                    row = dict(preset=preset, threads=threads, batch=batch, clip_s=seconds, audio_s=audio_s,
                               words_per_clip=len(items[0].text.split()), load_average=list(os.getloadavg()))
                    row.update(measure(aligner, items, args.repeats, args.budget_s))
                    row.update(rtf=row["wall_s"] / audio_s, audio_s_per_s=audio_s / row["wall_s"],
                               cpu_s_per_audio_s=row["cpu_s"] / audio_s)
                    rows.append(row)
                    log(table_row(row))
    return {"machine": where, "config": vars(args), "load_s": load_s, "rows": rows}


HEADER = ("| preset | threads | batch | clip s | prompt tokens | runs | ms per call | RTF | audio-s per s | "
          "CPU-s per audio-s | features | encoder | decoder | other |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    """One row; the pieces as ms per second of audio."""
    pieces = " | ".join(f"{r[k] / r['audio_s'] * 1e3:.1f}" for k in ("features_s", "encoder_s", "decoder_s", "other_s"))
    return (f"| {r['preset']} | {r['threads']} | {r['batch']} | {r['clip_s']:g} | {r['prompt_tokens']} | "
            f"{r['runs']} | {r['wall_s'] * 1e3:.1f} | {r['rtf']:.4f} | {r['audio_s_per_s']:.1f} | "
            f"{r['cpu_s_per_audio_s']:.4f} | {pieces} |")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["tiny", "0.6b"], choices=PRESETS)
    ap.add_argument("--model", help="an aligner checkpoint to time instead of the preset's random one "
                                    "(with one --preset, which then only names the rows)")
    ap.add_argument("--seed", type=int, default=0, help="the random checkpoints' seed")
    ap.add_argument("--seconds", nargs="+", type=float, default=[3.0, 10.0, 30.0], help="clip lengths")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16], help="clips per align() call")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch threads")
    ap.add_argument("--words-per-second", type=float, default=2.5, help="words of text per second of audio")
    ap.add_argument("--repeats", type=int, default=3, help="most timed calls per row")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="no further timed call once a row's calls have taken this long (at least one runs)")
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args(argv)
    if args.model and len(args.preset) != 1:
        ap.error("--model takes exactly one --preset (the label of its rows)")
    print(f"torch {torch.__version__}, fp32; pieces in ms per second of audio\n")
    print(HEADER, flush=True)
    result = run(args, lambda line: print(line, flush=True))
    print("\ncheckpoint load: " + ", ".join(f"{p} {s:.1f} s" for p, s in result["load_s"].items()))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
