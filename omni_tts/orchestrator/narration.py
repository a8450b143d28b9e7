"""Long-form narration: a text of any length spoken as one continuous stream, a request per segment, pipelined.

The input is cut once (`segmenter.segment_text`). The first segment asked for starts at once; while its audio is
made the next ones start, each once the one before it has its first audio (their prefills never delay the first
audio) and never more than `window` ahead of the segment being delivered, so memory is bounded and a reader that
stops stops the narration. Each segment is a request of its own: its token limit bounds it (a segment without an
end token is cut at its budget, its finish reason kept, and the narration goes on); one that fails (a stage that
died, an internal failure) is tried once more: with another seed if none of its audio was delivered, else with
the same seed from where the listener is (`_Run`); a second failure ends the narration (the caller resumes it with
`start_segment`). Bad input (a RequestError, found before the stages or inside them) is never tried again, nor is a
segment the engine's shutdown failed (`EngineShutDown`: nothing would serve a retry): either ends the narration at
once.

One voice throughout: a CustomVoice speaker or a Base clone prompt is the same in every request. A VoiceDesign
voice is designed once, by segment 0, and every later segment is an ICL clone of it (segment 0's own codes and
text as the reference, the description kept), so the timbre does not drift; a narration resumed past segment 0
makes segment 0 again (unheard) for its codes.

The chunks (`chunks`) are the segments' audio in order with, between them, silence for the boundary (`Pauses`);
`SpeechChunk.segment` marks each segment's first audio (`SegmentStart`) and the chunk after its last
(`SegmentEnd`, holding the pause). The last chunk carries the narration's `Usage`. Offsets count the delivered audio
from the start of this narration (from `start_segment`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from omni_tts.config.settings import NarrationSettings
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.lexicon import spoken_text
from omni_tts.models.qwen3_tts.prompt import PromptBuilder, SynthesisRequest
from omni_tts.models.qwen3_tts.sampling_params import MAX_SEED

from .tts_client import TTSClient
from .segmenter import Segment, segment_text
from .types import EngineShutDown, RequestFailed, SegmentEnd, SegmentStart, SpeechChunk, StageDeadError, Usage

RETRY_SEED_STEP = 1_000_003   # another seed for a segment's second try: far from the next segments' own seeds
RESTART_WAIT_S = 60.0         # a segment's retry after a stage failure waits this long for the pipeline to be back
# what a second try may get past; a RequestError (bad input, the stages' too: types.stage_error) fails the same way
RETRIED = (RequestFailed, StageDeadError)
Generate = Callable[..., AsyncIterator[SpeechChunk]]   # (request, request_id, return_codes=False): the pipeline's


@dataclass(frozen=True)
class Pauses:
    """Silence after a segment, by what ends it (a clause cut adds none: the sentence goes on)."""
    sentence_s: float = NarrationSettings.sentence_pause_ms / 1000
    paragraph_s: float = NarrationSettings.paragraph_pause_ms / 1000

    def after(self, segment: Segment) -> float:
        return {"sentence": self.sentence_s, "paragraph": self.paragraph_s}.get(segment.boundary, 0.0)


def plan_segments(prompts: PromptBuilder, text: str, max_chars: int) -> list[Segment]:
    """The input's segments, each within `max_chars` and the talker's text-token limit: one, the whole input, when
    it is within them (CPU work: the tokenizer runs over every candidate segment)."""
    limit = prompts.limits.max_text_tokens if prompts.limits is not None else None

    def fits(segment: str) -> bool:
        # a byte-level BPE token covers one byte or more: a text of at most `limit` bytes fits untokenized (the
        # tokenizer over every candidate would cost a long input's first audio tens of milliseconds)
        return limit is None or len(segment.encode()) <= limit or len(prompts.text_ids(segment)) <= limit
    whole = text.strip()
    if whole and len(whole) <= max_chars and fits(whole):
        start = text.index(whole)
        return [Segment(0, whole, start, start + len(whole), "end")]
    return segment_text(text, max_chars=max_chars, fits=fits)


def segment_template(synthesis: SynthesisRequest) -> SynthesisRequest:
    """Every segment is a whole text given at once: the non-streaming layout unless the request names one (the
    streaming layout feeds one text token per frame, so a long text's track runs ahead of its speech)."""
    if synthesis.non_streaming_mode is not None:
        return synthesis
    return dataclasses.replace(synthesis, non_streaming_mode=True)


def designs_its_voice(config: Qwen3TTSConfig) -> bool:
    """A VoiceDesign checkpoint designs the voice once, by segment 0 (`Narration(design_once=True)`)."""
    return config.tts_model_type == "voice_design"


async def wait_until_serving(tts: TTSClient) -> None:
    """Returns once the pipeline serves again, or after RESTART_WAIT_S (the retry then fails as it would): a
    narration's `ready`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RESTART_WAIT_S
    while not tts.is_healthy and loop.time() < deadline and tts.fatal is None:
        await asyncio.sleep(0.1)


def segment_seed(seed: int, index: int, attempt: int) -> int:
    """Segment `index`'s seed: the narration's plus the index (so a resumed narration makes the same audio), moved far
    off for a retry that must not make the same audio again (`attempt` 1)."""
    return (seed + index + attempt * RETRY_SEED_STEP) % (MAX_SEED + 1)


def narration_usage(ends: list[SegmentEnd], audio_seconds: float) -> Usage:
    """The segments' usage summed; finish_reason "length" when any segment was cut at its token limit."""
    usages = [end.usage for end in ends]
    return Usage(input_tokens=sum(u.input_tokens for u in usages), prompt_rows=sum(u.prompt_rows for u in usages),
                 reference_frames=sum(u.reference_frames for u in usages),
                 output_frames=sum(u.output_frames for u in usages), audio_seconds=audio_seconds,
                 finish_reason="length" if any(u.finish_reason == "length" for u in usages) else "stop")


class _Run:
    """One segment's request (or two, with the retry), read eagerly into `queue` — bounded by the segment's token
    limit — so the stage client never takes it for a slow reader while it waits its turn.

    A try that fails is made once more: with another seed when none of its audio has gone out (a segment that went
    wrong is not made the same way again); else with the same seed, its first `taken_samples` dropped, so the
    listener hears the segment go on (the same audio for greedy and seeded requests, every segment's seed being
    fixed: `Narration.template`)."""

    def __init__(self, narration: Narration, segment: Segment, anchor: bool = False) -> None:
        self.narration, self.segment, self.anchor = narration, segment, anchor
        self.queue: asyncio.Queue = asyncio.Queue()   # arrays, then the usage, or the error that ended it
        self.taken_samples = 0   # of this segment's audio, taken by the consumer
        self.attempts = 0
        self.has_audio = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        narration, skip, reseed = self.narration, 0, False
        while True:
            self.attempts += 1
            narration.on_event("started" if self.attempts == 1 else "retried")
            try:
                request = await narration.request_for(self.segment, int(reseed))
                suffix = f"-s{self.segment.index}" + (f"-r{self.attempts - 1}" if self.attempts > 1 else "")
                stream = narration.generate(request, narration.request_id + suffix, return_codes=self.anchor)
                try:
                    async for chunk in stream:
                        audio = chunk.audio[skip:]
                        skip -= chunk.audio.shape[0] - audio.shape[0]
                        if audio.size:
                            self.queue.put_nowait(audio)
                            self._started()
                        if chunk.usage is not None:
                            if self.anchor:
                                narration.set_anchor(request, chunk.codes)
                            self.queue.put_nowait(chunk.usage)
                finally:
                    await stream.aclose()
                return
            except RETRIED as error:
                if self.attempts > 1 or not narration.retry or isinstance(error, EngineShutDown):
                    self._end(error)
                    return
                while not self.queue.empty():   # what the consumer has not taken comes again from the retry
                    self.queue.get_nowait()
                skip, reseed = self.taken_samples, self.taken_samples == 0
                if isinstance(error, StageDeadError) and narration.ready is not None:
                    await narration.ready()     # a restarting pipeline takes seconds to come back
            except Exception as error:   # bad input, or a bug: the narration ends with it
                self._end(error)
                return

    def _started(self) -> None:
        if not self.has_audio.is_set():
            self.has_audio.set()
            self.narration.fill()

    def _end(self, error: Exception) -> None:
        if self.anchor:
            self.narration.anchor_failed(error)
        self.queue.put_nowait(error)
        self._started()

    async def take(self) -> np.ndarray | Usage:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, np.ndarray):
            self.taken_samples += item.shape[0]
        return item

    async def cancel(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class Narration:
    """`segments` (all of the input's; the narration starts at `start_segment`) spoken with `template`'s voice and
    options; `generate(request, request_id, return_codes=...)` is the pipeline's. `design_once`: the template designs
    its voice (VoiceDesign): later segments clone segment 0's. `ready()`, when given, returns once the pipeline serves
    again (awaited before a retry after a stage failure). `on_event(name)` is told of each segment "started",
    "retried" and "delivered" (whole)."""

    def __init__(self, generate: Generate, template: SynthesisRequest, segments: list[Segment], request_id: str,
                 window: int = NarrationSettings.window, pauses: Pauses = Pauses(), start_segment: int = 0,
                 design_once: bool = False,
                 retry: bool = True, ready: Callable[[], Awaitable[None]] | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        if not 0 <= start_segment < len(segments):
            raise ValueError(f"start_segment must lie in 0..{len(segments) - 1}")
        if template.sampling.seed is None:   # every segment's seed fixed: a retry can make the same audio again
            template = dataclasses.replace(template, sampling=msgspec.structs.replace(
                template.sampling, seed=secrets.randbits(63)))
        self.generate, self.template, self.segments = generate, template, segments
        self.request_id, self.window, self.pauses, self.retry = request_id, max(1, window), pauses, retry
        self.start_segment, self.ready = start_segment, ready
        self.on_event = on_event or (lambda name: None)
        self.runs: dict[int, _Run] = {}
        self.current = start_segment        # the segment being delivered
        self.next_index = start_segment     # the next segment to start
        self.ends: list[SegmentEnd] = []    # the segments delivered whole
        # design_once: the request every segment after 0 makes, once segment 0 has made its codes
        self.cloned: asyncio.Future[SynthesisRequest] | None = None
        self.hidden: _Run | None = None     # segment 0 made again, unheard, for a narration resumed past it
        if design_once and len(segments) > 1:
            self.cloned = asyncio.get_running_loop().create_future()

    async def request_for(self, segment: Segment, attempt: int) -> SynthesisRequest:
        template = self.template
        if self.cloned is not None and segment.index > 0:
            template = await asyncio.shield(self.cloned)
        seed = segment_seed(template.sampling.seed, segment.index, attempt)
        return dataclasses.replace(template, text=segment.text,
                                   sampling=msgspec.structs.replace(template.sampling, seed=seed))

    def set_anchor(self, request: SynthesisRequest, codes: np.ndarray | None) -> None:
        """Segment 0 is whole: the later segments clone its voice (its codes and text are their ICL reference)."""
        if self.cloned is None or self.cloned.done():
            return
        if codes is None or codes.shape[0] == 0:
            self.cloned.set_exception(RequestFailed("the first segment made no audio to keep its voice from"))
            return
        self.cloned.set_result(dataclasses.replace(self.template, ref_codes=codes,
                                                   ref_text=spoken_text(request.text, request.lexicon)))

    def anchor_failed(self, error: Exception) -> None:
        if self.cloned is not None and not self.cloned.done():
            self.cloned.set_exception(error)
            self.cloned.exception()   # retrieved here: the segments waiting on it raise it themselves

    def fill(self) -> None:
        """Start the segments the window allows: each once the one before it has audio."""
        while self.next_index < len(self.segments) and self.next_index < self.current + self.window:
            before = self.runs.get(self.next_index - 1)
            if self.next_index > self.current and (before is None or not before.has_audio.is_set()):
                return
            index = self.next_index
            self.runs[index] = _Run(self, self.segments[index], anchor=self.cloned is not None and index == 0)
            self.next_index += 1

    async def chunks(self) -> AsyncIterator[SpeechChunk]:
        """The narration's audio in order (see the module); a pipeline error ends it. Closing the iterator ends
        every request in flight."""
        delivered = 0   # samples
        try:
            if self.cloned is not None and self.start_segment > 0:
                self.hidden = _Run(self, self.segments[0], anchor=True)
            self.fill()
            for index in range(self.start_segment, len(self.segments)):
                self.current = index
                self.fill()
                run, segment = self.runs[index], self.segments[index]
                start = SegmentStart(index, segment.text, delivered / SAMPLE_RATE, len(self.segments))
                samples = 0
                while not isinstance(item := await run.take(), Usage):
                    samples += item.shape[0]
                    yield SpeechChunk(item, segment=start if samples == item.shape[0] else None)
                del self.runs[index]
                if samples == 0:
                    yield SpeechChunk(np.zeros(0, np.float32), segment=start)
                last = index == len(self.segments) - 1
                pause = np.zeros(0 if last else round(self.pauses.after(segment) * SAMPLE_RATE), np.float32)
                end = SegmentEnd(index, segment.text, start.audio_offset, samples / SAMPLE_RATE, item, run.attempts)
                self.ends.append(end)
                self.on_event("delivered")
                delivered += samples + pause.shape[0]
                yield SpeechChunk(pause, segment=end)
            yield SpeechChunk(np.zeros(0, np.float32), usage=narration_usage(self.ends, delivered / SAMPLE_RATE))
        finally:
            await self.close()

    async def close(self) -> None:
        """End every segment still running (each aborts its request in the stages)."""
        runs = list(self.runs.values()) + ([self.hidden] if self.hidden is not None else [])
        self.runs, self.hidden = {}, None
        self.next_index = len(self.segments)   # a late first audio starts nothing more
        with contextlib.suppress(Exception):
            await asyncio.gather(*(run.cancel() for run in runs))
