"""`omni-tts narrate FILE.txt --out book.mp3`: a text of any length narrated offline into one audio file.

The server's pipeline in this process: `AsyncTTS` with its stage processes, the input cut once
(`narration.plan_segments`) and spoken by a `Narration` (a window of segments in flight, one voice throughout),
its chunks encoded by one stream encoder into the file as they come, so memory stays bounded whatever the length.
The file and its sidecar (narration_file.py) make a cut run resumable: the same command again continues from the
last segment written whole. Without --seed the seed comes from the input's hash, so a resumed narration goes on
with the same audio.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import os
import signal
import sys
import uuid

import msgspec
import numpy as np
from tqdm import tqdm

from omni_tts.entrypoints.api.names import VoiceNames
from omni_tts.entrypoints.cli.narration_file import NarrationFile
from omni_tts.config.options import check_bounds, from_options
from omni_tts.config.settings import NarrationSettings
from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.entrypoints.cli.serve import load_pipeline, print_error
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling_params import MAX_SEED, SamplingParams
from omni_tts.orchestrator.async_tts import AsyncTTS
from omni_tts.orchestrator.narration import (Narration, Pauses, designs_its_voice, plan_segments, segment_template,
                                             wait_until_serving)
from omni_tts.orchestrator.segmenter import Segment
from omni_tts.orchestrator.types import PIPELINE_ERRORS, RequestError, SegmentEnd, StageDeadError

FORMATS = ("mp3", "wav", "flac", "opus", "pcm")
EXTENSIONS = {".mp3": "mp3", ".wav": "wav", ".flac": "flac", ".opus": "opus", ".ogg": "opus", ".pcm": "pcm",
              ".raw": "pcm"}
COMMAND = "narrate"


class PipelineNotStarted(Exception):
    """A stage did not start (its own error in the message)."""


def output_format(out: str, fmt: str | None) -> str:
    """--format, else the one --out's extension names."""
    if fmt is not None:
        return fmt
    extension = os.path.splitext(out)[1].lower()
    if extension not in EXTENSIONS:
        raise ValueError(f"--out {out!r}: cannot tell the format from its extension ({', '.join(EXTENSIONS)}); "
                         f"give --format")
    return EXTENSIONS[extension]


def read_text(path: str) -> str:
    """FILE's text (UTF-8), or stdin's for `-`; ValueError for a file that cannot be read or holds no text."""
    try:
        if path == "-":
            text = sys.stdin.buffer.read().decode("utf-8")
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as UTF-8 text ({e})") from None
    if not text.strip():
        raise ValueError(f"{'stdin' if path == '-' else path} holds no text to narrate")
    return text


def check_options(args: argparse.Namespace) -> SamplingParams:
    """ValueError (one line) for an option out of its range; the sampling asked for."""
    check_bounds(from_options(NarrationSettings, args))
    if args.ref_text and not args.ref_audio:
        raise ValueError("--ref-text is the transcript of --ref-audio, which is missing")
    sampling = SamplingParams.of(args)
    sampling.validate()
    return sampling


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run(args: argparse.Namespace) -> int:
    """The command: 0 once the file is whole; 130 (143 on SIGTERM) when interrupted, 1 when the pipeline fails
    (the file resumable either way); ValueError for bad input or options."""
    fmt = output_format(args.out, args.format)
    sampling = check_options(args)
    text = read_text(args.file)
    text_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if sampling.seed is None:   # the same input narrates the same way, resumed or not
        sampling = msgspec.structs.replace(sampling, seed=int(text_sha256[:16], 16) % (MAX_SEED + 1))
    ref_audio = None
    if args.ref_audio:
        from omni_tts.models.qwen3_tts.model import reference_audio_24k

        if not os.path.isfile(args.ref_audio):
            raise ValueError(f"--ref-audio {args.ref_audio!r}: file not found")
        ref_audio = reference_audio_24k(args.ref_audio)   # decoded once, for every segment
    model_dir, stage_config, pipeline = load_pipeline(args)
    tts = AsyncTTS(model_dir, pipeline)
    try:
        template, segments = _plan(tts, args, sampling, text, ref_audio)
        identity = {"text_sha256": text_sha256, "model": os.path.abspath(model_dir), "stage_config": stage_config,
                    "voice": template.voice, "language": args.language, "instructions": args.instructions,
                    "ref_audio_sha256": file_digest(args.ref_audio) if args.ref_audio else None,
                    "ref_text": args.ref_text, **{name: getattr(sampling, name) for name in sampling.__struct_fields__},
                    "sentence_pause_ms": args.sentence_pause_ms, "paragraph_pause_ms": args.paragraph_pause_ms,
                    "segment_chars": args.segment_chars, "format": fmt, "segments": len(segments)}
        try:
            output = NarrationFile(args.out, fmt, identity, args.restart)
        except OSError as e:
            raise ValueError(f"--out {args.out!r}: {e.strerror or e}") from None
    except BaseException:
        tts.processor.close()
        raise
    return _narrate_to(tts, template, segments, output, args)


def _plan(tts: AsyncTTS, args: argparse.Namespace, sampling: SamplingParams, text: str,
          ref_audio: np.ndarray | None) -> tuple[SynthesisRequest, list[Segment]]:
    """Every segment's request (but its text) and the segments, before any stage starts."""
    config = tts.config
    try:
        voice = VoiceNames(config.tts_model_type, tts.prompts.speakers).choose(
            args.voice, "ref_audio" if ref_audio is not None else None, lambda name: False)
    except ApiError as e:
        raise ValueError(f"--{(e.param or 'voice').replace('_', '-')}: {e.message}") from None
    template = segment_template(SynthesisRequest(
        text="", voice=voice.speaker, language=args.language, instructions=args.instructions, ref_audio=ref_audio,
        ref_text=args.ref_text, x_vector_only=ref_audio is not None and not args.ref_text, sampling=sampling))
    segments = plan_segments(tts.prompts, text, args.segment_chars)
    try:   # the request's checks, before the stages start and the file is touched
        tts.prompts.tokenize(dataclasses.replace(template, text=segments[0].text))
    except RequestError as e:
        raise ValueError(option_error(e)) from None
    return template, segments


def option_error(error: RequestError) -> str:
    """A request's error named by the option that gave the field."""
    return f"--{error.param.replace('_', '-')}: {error}"


def _narrate_to(tts: AsyncTTS, template: SynthesisRequest, segments: list[Segment], output: NarrationFile,
                args: argparse.Namespace) -> int:
    done = len(output.delivered)
    try:
        if done < len(segments):
            asyncio.run(_narrate(tts, template, segments, output, args))
        else:   # a run that ended between its last segment and the end of the file
            tts.processor.close()
        output.finish()
    except (KeyboardInterrupt, asyncio.CancelledError) as e:
        output.close()
        print(f"omni-tts {COMMAND}: interrupted after {len(output.delivered)} of {len(segments)} segments; the same "
              "command again resumes it", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 128 + signal.SIGTERM
    except PipelineNotStarted as e:
        output.close()
        print_error(COMMAND, f"the pipeline did not start: {e}")
        return 1
    except PIPELINE_ERRORS as e:
        output.close()
        where = f"at segment {len(output.delivered)} of {len(segments)}"
        if isinstance(e, RequestError):
            print_error(COMMAND, option_error(e) if e.param != "input" else f"{where}: {e}")
            return 2
        print_error(COMMAND, f"the narration stopped {where}: {e}; the same command again resumes it")
        return 1
    except BaseException:
        output.close()
        raise
    last = output.delivered[-1]
    print(f"wrote {args.out}: {last.audio_offset + last.duration:.2f} s, {len(segments)} segments"
          + (f" ({done} of them from before)" if done else ""), file=sys.stderr)
    return 0


async def _narrate(tts: AsyncTTS, template: SynthesisRequest, segments: list[Segment], output: NarrationFile,
                   args: argparse.Namespace) -> None:
    """Start the stages, narrate the segments not yet in `output` into it, stop the stages."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    pauses = Pauses(args.sentence_pause_ms / 1000, args.paragraph_pause_ms / 1000)
    start, base = output.next_segment, 0.0
    if output.delivered:   # the offsets of this run's narration count from its first segment
        last = output.delivered[-1]
        base = last.audio_offset + last.duration + pauses.after(segments[last.index])
    request_id = uuid.uuid4().hex
    voice_version = f"narration-{request_id}" if template.ref_audio is not None else None

    def generate(request: SynthesisRequest, segment_id: str, return_codes: bool = False):
        return tts.generate(request, request_id=segment_id, voice_version=voice_version,
                               return_codes=return_codes)

    try:
        await tts.start()
    except StageDeadError as e:
        raise PipelineNotStarted(str(e)) from None
    try:
        narration = Narration(generate, template, segments, request_id, window=args.window, pauses=pauses,
                              start_segment=start, design_once=designs_its_voice(tts.config),
                              ready=lambda: wait_until_serving(tts))
        with tqdm(total=len(segments), initial=start, unit="segment", disable=args.no_progress,
                  file=sys.stderr, dynamic_ncols=True) as bar:
            async for chunk in narration.chunks():
                if chunk.audio.size:
                    output.write(chunk.audio)
                await asyncio.sleep(0)   # where Ctrl-C lands: a narration whose audio is queued never suspends
                if isinstance(chunk.segment, SegmentEnd):
                    end = chunk.segment
                    output.commit(end.index, base + end.audio_offset, end.duration,
                                  last=end.index == len(segments) - 1)
                    bar.update(1)
    finally:
        await tts.shutdown()
