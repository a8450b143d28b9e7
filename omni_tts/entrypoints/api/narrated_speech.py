"""A speech request's input longer than one segment is narrated (orchestrator/narration.py): cut into segments
within the talker's limits, spoken as one stream. What the routes share: the plan, and the narration's stream
opened as a single request's would be (`open_narration`)."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from omni_tts.entrypoints.api.schema import ApiError, SpeechOptions
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.orchestrator.narration import (Narration, Pauses, designs_its_voice, plan_segments, segment_template,
                                             wait_until_serving)
from omni_tts.orchestrator.segmenter import Segment
from omni_tts.orchestrator.types import SegmentEnd, SpeechChunk

from .access_log import SpeechLog
from .admission import Admission
from .state import ServerState


async def narration_plan(state: ServerState, options: SpeechOptions, text: str) -> list[Segment]:
    """The input's segments (one, the whole input, when it is within one): 400 for a start_segment past the end."""
    prompts = state.served_model(options.model).tts.prompts
    segments = await state.run(plan_segments, prompts, text, state.config.segment_chars)
    if options.start_segment >= max(1, len(segments)):
        raise ApiError(400, f"start_segment {options.start_segment} is past the input's last segment "
                            f"({len(segments) - 1})", "start_segment")
    return segments


def is_narrated(options: SpeechOptions, segments: list[Segment]) -> bool:
    """More than one segment, or a resumed one: a narration; else one request, as any short input."""
    return len(segments) > 1 or options.start_segment > 0


@contextlib.asynccontextmanager
async def open_narration(state: ServerState, options: SpeechOptions, synthesis: SynthesisRequest,
                         voice_version: str | None, segments: list[Segment], request_id: str, admission: Admission,
                         log: SpeechLog | None = None) -> AsyncIterator[tuple[SpeechChunk, AsyncIterator[SpeechChunk]]]:
    """`open_speech` for a narrated input (`synthesis`: its voice and options, built once for all its segments):
    its first audio (an error before it is raised here) and the rest of its chunks, the segments counted in `log`.
    However the caller's block ends, every segment in flight ends."""
    if synthesis.ref_audio is not None and voice_version is None:
        voice_version = f"narration-{request_id}"   # the clip's features made once for all its segments
    config, tts = state.config, state.served_model(options.model).tts

    def generate(request: SynthesisRequest, segment_id: str, return_codes: bool = False):
        return tts.generate(request, request_id=segment_id, voice_version=voice_version,
                                     initial_codec_chunk_frames=options.initial_codec_chunk_frames,
                                     first_audio_timeout=config.first_audio_timeout, timeout=config.request_timeout,
                                     return_codes=return_codes)

    narration = Narration(generate, segment_template(synthesis), segments, request_id,
                          window=config.narration_window,
                          pauses=Pauses(options.sentence_pause_ms / 1000, options.paragraph_pause_ms / 1000),
                          start_segment=options.start_segment, design_once=designs_its_voice(tts.config),
                          ready=lambda: wait_until_serving(tts),
                          on_event=lambda name: state.metrics.narration_segments.labels(name).inc())
    log = log or SpeechLog()
    log.segments_total = len(segments) - options.start_segment
    stream = _counted(narration.chunks(), log)
    try:
        first = await anext(stream)
        admission.first_audio()
        yield first, stream
    finally:
        await stream.aclose()


async def _counted(chunks: AsyncIterator[SpeechChunk], log: SpeechLog) -> AsyncIterator[SpeechChunk]:
    try:
        async for chunk in chunks:
            if isinstance(chunk.segment, SegmentEnd):
                log.segments_done += 1
            yield chunk
    finally:
        await chunks.aclose()
