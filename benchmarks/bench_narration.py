"""Long-form narration's costs: a 10,000-word text served as one stream, beside a one-sentence request, and the
voice drift of a VoiceDesign narration with and without its first segment cloned.

    python benchmarks/bench_narration.py serve [--preset small] [--words 10000] [--frames-per-word 5]
        [--stage-config cpu_small] [--dtype float32] [--window 3] [--out RESULT.json]
    python benchmarks/bench_narration.py drift [--sentences 12] [--frames 40] [--out RESULT.json]
    python benchmarks/bench_narration.py pace [--preset small] [--words 2000] [--out RESULT.json]

serve: `omni-tts serve` on the preset's random CustomVoice checkpoint (bench_runner.cached_model), then, streaming
pcm: three one-sentence requests (time to first audio, the median), then the long text (deterministic prose, in
paragraphs) — time to first audio, wall time and audio length (RTF = wall / audio), and the memory of the server's
processes (API + stages, RSS summed) sampled every 0.5 s. Random weights never meet the end token, so each segment
runs to its frame budget: `max_new_tokens` is set to frames-per-word × the words of an average segment (5 frames a
word ≈ 150 words a minute), which makes the audio as long as real narration's.

drift: in this process, an AsyncTTS on the VoiceDesign tiny fixture narrates a text twice, greedy: segments after
the first cloned from it (the server's way) and each designed afresh; each segment's x-vector by the Base tiny
fixture's speaker encoder, cosine similarity to segment 0's (mean, min). With random weights this measures the
pipeline (which voice each segment is made with), not a trained model's timbre.

pace: in this process, the preset's checkpoint narrates the text (the checkpoint's own sampling, seeded) in each
text-feeding layout, non-streaming (the narration's) and streaming: frames per text token of every segment (its
output frames over its text tokens), their mean and spread, the first quarter's mean against the last's, and the
segments cut at their budget.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import aiohttp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_runner import cached_model, machine, scrub_thread_env, served  # noqa: E402

WORDS = ("the quiet river ran past old mills and green fields while travellers rested under tall trees near the "
         "bridge where children played until evening came over the hills").split()


def prose(words: int) -> str:
    """Deterministic prose: sentences of 8-24 words, four or five to a paragraph."""
    out, paragraph, n = [], [], 0
    while n < words:
        length = 8 + (n * 7) % 17
        body = " ".join(WORDS[(n + i * 3) % len(WORDS)] for i in range(length))
        paragraph.append(body[0].upper() + body[1:] + ".")
        n += length
        if len(paragraph) == 4 + n % 2:
            out.append(" ".join(paragraph))
            paragraph = []
    return "\n\n".join(out + ([" ".join(paragraph)] if paragraph else []))


def rss_bytes(root_pid: int) -> int:
    """RSS of a process and its descendants."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(name))
            except OSError:
                pass
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


async def stream(url: str, body: dict) -> tuple[float, float, int]:
    """(first audio s, whole s, bytes) of a streamed pcm request."""
    started = time.monotonic()
    first, size = None, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.post(url + "/v1/audio/speech", json=body) as response:
            if response.status != 200:
                raise SystemExit(f"HTTP {response.status}: {await response.text()}")
            async for data in response.content.iter_any():
                first = first if first is not None else time.monotonic() - started
                size += len(data)
    return first, time.monotonic() - started, size


async def serve_run(url: str, server_pid: int, args: argparse.Namespace) -> dict:
    text = prose(args.words)
    per_segment = args.segment_chars / (len(text) / args.words)
    base = {"voice": "ryan", "response_format": "pcm", "stream_format": "audio", "seed": 1,
            "max_new_tokens": max(16, round(args.frames_per_word * per_segment))}
    sentence = text.split(". ")[0] + "."
    await stream(url, dict(base, input=sentence))   # warm-up
    singles = [await stream(url, dict(base, input=sentence)) for _ in range(3)]
    samples: list[int] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            samples.append(rss_bytes(server_pid))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
    sampler = asyncio.create_task(sample())
    first, wall, size = await stream(url, dict(base, input=text))
    stop.set()
    await sampler
    audio_s = size / 2 / 24000
    quarter = max(1, len(samples) // 4)
    return {"words": args.words, "characters": len(text), "max_new_tokens": base["max_new_tokens"],
            "one_sentence_first_audio_s": statistics.median(s[0] for s in singles),
            "narration_first_audio_s": first, "narration_wall_s": wall, "narration_audio_s": audio_s,
            "rtf": wall / audio_s,
            "rss_mib": {"start": samples[0] / 2**20, "max": max(samples) / 2**20,
                        "quartiles_mean": [statistics.mean(samples[i * quarter:(i + 1) * quarter]) / 2**20
                                           for i in range(4)]}}


async def drift_run(args: argparse.Namespace) -> dict:
    import torch

    from omni_tts.config.stage_config import load_stage_config
    from omni_tts.models.qwen3_tts.model import Qwen3TTS
    from omni_tts.models.qwen3_tts.speaker_encoder import extract_speaker_embedding
    from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
    from omni_tts.models.qwen3_tts.sampling_params import SamplingParams
    from omni_tts.orchestrator.async_tts import AsyncTTS
    from omni_tts.orchestrator.narration import Narration, Pauses
    from omni_tts.orchestrator.segmenter import segment_text
    from omni_tts.orchestrator.types import SegmentEnd

    fixtures = os.path.join(ROOT, "tests", "fixtures", "qwen3_tts")
    encoder = Qwen3TTS.from_pretrained(os.path.join(fixtures, "tiny-base"), with_decoder=False)
    text = " ".join(f"Chapter {i} begins where the road bends toward the sea." for i in range(args.sentences))
    segments = segment_text(text, max_chars=60)
    template = SynthesisRequest(text="", instructions="A calm, low voice with a slight rasp.",
                                non_streaming_mode=True,
                                sampling=SamplingParams(temperature=0, max_new_tokens=args.frames + 1, seed=1))
    result = {}
    async with AsyncTTS(os.path.join(fixtures, "tiny-voice-design"), load_stage_config("cpu_tiny")) as engine:
        for name, design_once in (("cloned", True), ("designed_each", False)):
            narration = Narration(engine.generate, template, segments, f"drift-{name}", pauses=Pauses(0, 0),
                                  design_once=design_once)
            audio, vectors = [], []
            async for chunk in narration.chunks():
                audio.append(chunk.audio)
                if isinstance(chunk.segment, SegmentEnd):
                    samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
                    with torch.no_grad():
                        vectors.append(extract_speaker_embedding(encoder.speaker_encoder, samples).float().numpy())
                    audio = []
            first = vectors[0] / np.linalg.norm(vectors[0])
            cosines = [float(v @ first / np.linalg.norm(v)) for v in vectors[1:]]
            result[name] = {"segments": len(vectors), "cosine_to_first_mean": statistics.mean(cosines),
                            "cosine_to_first_min": min(cosines)}
    return result


async def pace_run(args: argparse.Namespace) -> dict:
    from omni_tts.config.stage_config import load_stage_config
    from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
    from omni_tts.models.qwen3_tts.sampling_params import SamplingParams
    from omni_tts.orchestrator.async_tts import AsyncTTS
    from omni_tts.orchestrator.narration import Narration, Pauses, plan_segments
    from omni_tts.orchestrator.types import SegmentEnd

    text, result = prose(args.words), {}
    async with AsyncTTS(args.model or cached_model(args.preset, args.dtype),
                        load_stage_config(args.stage_config)) as engine:
        segments = plan_segments(engine.prompts, text, args.segment_chars)
        budget = max(16, round(args.frames_per_word * args.segment_chars / (len(text) / args.words)))
        for layout, non_streaming in (("non_streaming", True), ("streaming", False)):
            template = SynthesisRequest(text="", voice="ryan", non_streaming_mode=non_streaming,
                                        sampling=SamplingParams(max_new_tokens=budget, seed=1))
            ends = [c.segment async for c in Narration(engine.generate, template, segments, f"pace-{layout}",
                                                       window=args.window, pauses=Pauses(0, 0)).chunks()
                    if isinstance(c.segment, SegmentEnd)]
            ratios = [e.usage.output_frames / e.usage.input_tokens for e in ends]
            quarter = max(1, len(ratios) // 4)
            result[layout] = {"segments": len(ratios), "frames_per_token_mean": statistics.mean(ratios),
                              "frames_per_token_stdev": statistics.pstdev(ratios),
                              "first_quarter_mean": statistics.mean(ratios[:quarter]),
                              "last_quarter_mean": statistics.mean(ratios[-quarter:]),
                              "cut_at_budget": sum(e.usage.finish_reason == "length" for e in ends),
                              "budget_frames": budget - 1}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["serve", "drift", "pace"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", help="a checkpoint instead of the preset's random one")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--stage-config", default="cpu_small")
    ap.add_argument("--words", type=int, default=10_000)
    ap.add_argument("--frames-per-word", type=float, default=5.0)
    ap.add_argument("--segment-chars", type=int, default=300)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--sentences", type=int, default=12)
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    doc = {"machine": machine(), "mode": args.mode, "config": vars(args)}
    if args.mode == "serve":
        scrub_thread_env()
        model = args.model or cached_model(args.preset, args.dtype)
        serve_args = ["--model", model, "--stage-config", args.stage_config, "--forced-aligner", "none",
                      "--segment-chars", str(args.segment_chars), "--narration-window", str(args.window),
                      "--served-model-name", "narration"]
        log = (args.out or "/tmp/bench_narration") + ".server.log"
        with served(serve_args, log) as url:
            doc["result"] = asyncio.run(serve_run(url, _server_pid(url), args))
    elif args.mode == "pace":
        scrub_thread_env()
        doc["result"] = asyncio.run(pace_run(args))
    else:
        doc["result"] = asyncio.run(drift_run(args))
    print(json.dumps(doc["result"], indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


def _server_pid(url: str) -> int:
    """The process listening on the URL's port (the API process)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":
                    inodes.add(parts[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").strip("socket:[]") in inodes:
                    return int(pid)
        except OSError:
            pass
    raise SystemExit(f"no process listens on {url}")


if __name__ == "__main__":
    sys.exit(main())
