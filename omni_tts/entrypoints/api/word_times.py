"""Word timestamps of a response's audio: the forced-aligner stage asked once per finished span (the whole
audio, a sentence or a narration segment), its times made absolute and kept within the audio, and the shapes each
transport sends them in.

A span that gets no times (no aligner process, a restart, a timeout, a failure) is `words=None` with the reason:
the audio is never held back for them (vllm-omni's contract: `timestamps: null` = the aligner failed, `[]` = no
words).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from omni_tts.entrypoints.api.schema import ApiError, SpeechOptions
from omni_tts.orchestrator.text_splitter import TextSplitter
from omni_tts.models.qwen3_forced_aligner.words import split_words
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.orchestrator.aligner_client import AlignerUnavailable
from omni_tts.orchestrator.types import SegmentEnd, SpeechChunk

from .state import ServerState

HEADER = "x-word-timestamps"                 # vllm-omni's: JSON [{word, start_ms, end_ms}]
OMITTED_HEADER = "x-word-timestamps-omitted"  # ... when that JSON is over HEADER_LIMIT bytes
UNAVAILABLE_HEADER = "x-word-timestamps-unavailable"  # the aligner gave none: why
HEADER_LIMIT = 4096


@dataclass(frozen=True)
class SpanWords:
    words: list[tuple[str, int, int]] | None   # (word, start_ms, end_ms), absolute in the response
    reason: str | None = None                   # why words is None

    def ms_json(self) -> list[dict] | None:
        """vllm-omni's shape (header, WebSocket)."""
        if self.words is None:
            return None
        return [{"word": w, "start_ms": start, "end_ms": end} for w, start, end in self.words]

    def seconds_json(self) -> list[dict] | None:
        """Kokoro's / OpenAI-style shape, in seconds (JSON body, SSE)."""
        if self.words is None:
            return None
        return [{"word": w, "start": start / 1000, "end": end / 1000} for w, start, end in self.words]

    def characters_json(self) -> list[dict] | None:
        """ElevenLabs-style characters: each word's span shared evenly by its characters (the aligner times words;
        within a word this is an estimate)."""
        if self.words is None:
            return None
        out = []
        for word, start, end in self.words:
            step = (end - start) / len(word)
            out += [{"character": c, "start": round(start + i * step) / 1000,
                     "end": round(start + (i + 1) * step) / 1000} for i, c in enumerate(word)]
        return out


def check_word_timestamps(state: ServerState, options: SpeechOptions, raw_audio_stream: bool) -> None:
    """400 when the server cannot answer `word_timestamps` in this response (checked before admission)."""
    if not options.word_timestamps:
        return
    if state.aligner is None:
        raise ApiError(400, "word_timestamps needs a forced aligner: this server runs without one (omni-tts serve "
                            "--forced-aligner DIR_OR_REPO_ID)", "word_timestamps")
    if raw_audio_stream:
        raise ApiError(400, "word_timestamps cannot travel in a raw audio stream: use stream_format 'sse', a whole "
                            "response, or the WebSocket", "word_timestamps")


async def align_span(state: ServerState, request_id: str, span: int, audio: np.ndarray, text: str,
                     language: str | None, offset_ms: int = 0) -> SpanWords:
    """The words of `text` in `audio` (float32 at the model's rate, as delivered), `offset_ms` added; times past the
    audio's end are clamped to it (the aligner's classes reach 400 s whatever the clip's length)."""
    end_ms = offset_ms + round(audio.shape[0] * 1000 / SAMPLE_RATE)
    try:
        words = await state.aligner.align(request_id, span, audio, SAMPLE_RATE, text, language_hint(language))
    except AlignerUnavailable as e:
        return SpanWords(None, str(e))
    return SpanWords([(w, min(offset_ms + start, end_ms), min(offset_ms + end, end_ms))
                         for w, start, end in words])


def by_sentence(result: SpanWords, text: str, language: str | None) -> list[tuple[str, SpanWords]]:
    """A response's words cut into its sentences (each sentence's own words counted as the aligner counts them; a
    sentence without words has none to time, and no part); the whole text at once where they cannot be (Japanese,
    whose segmenter runs in the aligner only, or words that do not add up). Without words (`result` is the reason)
    each sentence gets the reason, so a failure changes no sentence's index."""
    hint = language_hint(language)
    if (hint or "").lower() == "japanese":
        return [(text, result)]
    splitter = TextSplitter("sentence")
    sentences = [*splitter.feed(text), *splitter.flush()]
    counts = [len(split_words(sentence, hint)) for sentence in sentences]
    if result.words is None:
        return [(sentence, result) for sentence, count in zip(sentences, counts) if count]
    if sum(counts) != len(result.words):
        return [(text, result)]
    cuts = [0, *itertools.accumulate(counts)]
    return [(sentence, SpanWords(result.words[start:end]))
            for sentence, start, end in zip(sentences, cuts, cuts[1:]) if end > start]


def language_hint(language: str | None) -> str | None:
    """The request's language as the word splitter reads it (Japanese and Korean have their own; Auto is none)."""
    return None if language is None or language.lower() == "auto" else language


def header_fields(result: SpanWords) -> dict[str, str]:
    """A whole file's timestamps in headers: the JSON if it fits in HEADER_LIMIT bytes, else a note to ask for
    response_format json."""
    if result.words is None:
        return {UNAVAILABLE_HEADER: _header_safe(result.reason or "unavailable")}
    encoded = json.dumps(result.ms_json(), ensure_ascii=True, separators=(",", ":"))
    if len(encoded) > HEADER_LIMIT:
        return {OMITTED_HEADER: f"{len(result.words)} words, {len(encoded)} bytes: over {HEADER_LIMIT}; "
                                "response_format 'json' returns them in the body"}
    return {HEADER: encoded}


def _header_safe(text: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)[:512]


MAX_PENDING_ALIGNMENTS = 4   # a response's segments awaiting their words: beyond, SSE gives up the oldest


class _SegmentAligner:
    """The audio of the segment in progress, fed as it goes out, and its alignment started once the segment ends."""

    def __init__(self, state: ServerState, request_id: str, language: str | None) -> None:
        self.state, self.request_id, self.language = state, request_id, language
        self.parts: list[np.ndarray] = []

    def feed(self, audio: np.ndarray) -> None:
        self.parts.append(audio)

    def _align(self, span: int, text: str, audio_offset: float) -> asyncio.Task:
        """The fed audio's words, aligned against `text` on a task of their own; times from `audio_offset`."""
        audio = np.concatenate(self.parts) if self.parts else np.zeros(0, np.float32)
        self.parts = []
        return asyncio.ensure_future(align_span(self.state, self.request_id, span, audio, text, self.language,
                                                round(audio_offset * 1000)))


class NarrationWords(_SegmentAligner):
    """A whole narration's words (a file, not a stream): each segment's audio aligned against its text as soon as the
    segment ends (`feed` its audio, then `end`), times absolute across the narration. At most
    MAX_PENDING_ALIGNMENTS segments hold their audio for the aligner: `end` waits for the oldest beyond (the file
    waits for its words anyway; the narration's window holds its generation meanwhile). `result`: every segment's
    words, or None with the first reason if a segment got none."""

    def __init__(self, state: ServerState, request_id: str, language: str | None) -> None:
        super().__init__(state, request_id, language)
        self.pending: collections.deque[asyncio.Task] = collections.deque()
        self.done: list[SpanWords] = []

    async def take(self, chunk: SpeechChunk) -> None:
        """A narration's chunk: a segment's audio is fed, its end (whose audio is the pause after it) aligns it."""
        if isinstance(chunk.segment, SegmentEnd):
            await self.end(chunk.segment)
        elif chunk.audio.size:
            self.feed(chunk.audio)

    async def end(self, segment: SegmentEnd) -> None:
        self.pending.append(self._align(segment.index, segment.text, segment.audio_offset))
        while len(self.pending) > MAX_PENDING_ALIGNMENTS:
            self.done.append(await self.pending.popleft())

    async def result(self) -> SpanWords:
        while self.pending:
            self.done.append(await self.pending.popleft())
        failed = next((r for r in self.done if r.words is None), None)
        return failed if failed is not None else SpanWords([w for r in self.done for w in r.words])

    def close(self) -> None:
        """A response that ends early: its pending alignments are cancelled."""
        for task in self.pending:
            task.cancel()


class SentenceTimestamps(_SegmentAligner):
    """SSE: a `speech.audio.timestamps` event per sentence, each segment's audio aligned as soon as it is whole
    (`end`) while the audio goes on, the events in order; a narration's times are absolute across it. The audio never
    waits for them: with more than MAX_PENDING_ALIGNMENTS segments pending the oldest is given up (its sentences'
    events carry FELL_BEHIND), so what a response holds stays bounded; only `flush`, after the last audio, waits."""

    FELL_BEHIND = (f"the aligner fell more than {MAX_PENDING_ALIGNMENTS} segments behind the audio (slow, stopped or "
                   "restarting); this segment's timestamps were given up")

    def __init__(self, state: ServerState, request_id: str, language: str | None,
                 send: Callable[[dict], Awaitable[None]]) -> None:
        super().__init__(state, request_id, language)
        self.send = send
        self.pending: collections.deque[tuple[str, asyncio.Task]] = collections.deque()
        self.num_spans = 0
        self.sentence_index = 0

    async def end(self, text: str, audio_offset: float) -> None:
        """The segment whose audio was fed since the last `end` is whole: align it, and send what is ready (and
        what is given up) without waiting."""
        self.pending.append((text, self._align(self.num_spans, text, audio_offset)))
        self.num_spans += 1
        while self.pending and (self.pending[0][1].done() or len(self.pending) > MAX_PENDING_ALIGNMENTS):
            text, task = self.pending.popleft()
            if not task.done():
                task.cancel()   # the aligner drops it (AlignerClient.align)
            await self._send(text, task.result() if task.done() else SpanWords(None, self.FELL_BEHIND))

    async def flush(self) -> None:
        while self.pending:
            text, task = self.pending[0]
            words = await task
            self.pending.popleft()
            await self._send(text, words)

    async def _send(self, text: str, words: SpanWords) -> None:
        for sentence, part in by_sentence(words, text, self.language):
            await self.send({"type": "speech.audio.timestamps", "sentence_index": self.sentence_index,
                             "text": sentence, "words": part.seconds_json()}
                            | ({"reason": words.reason} if words.reason is not None else {}))
            self.sentence_index += 1

    async def close(self) -> None:
        for _, task in self.pending:
            task.cancel()
        await asyncio.gather(*(task for _, task in self.pending), return_exceptions=True)


class TrailingTimestamps:
    """WebSocket: each request's words in a trailing `audio.chunk` once aligned (vllm-omni's event), sent in request
    order, never holding back audio; times are absolute within the utterance."""

    def __init__(self, state: ServerState, ws, session_id: str, language: str | None) -> None:
        self.state, self.ws, self.session_id, self.language = state, ws, session_id, language
        self.offset_ms = 0
        self.last: asyncio.Task | None = None
        self.tasks: list[asyncio.Task] = []

    def add(self, utterance_index: int, sentence_index: int, audio: np.ndarray, text: str) -> None:
        offset, self.offset_ms = self.offset_ms, self.offset_ms + round(audio.shape[0] * 1000 / SAMPLE_RATE)
        task = asyncio.create_task(self._send(self.last, utterance_index, sentence_index, audio, text, offset))
        self.last = task
        self.tasks.append(task)

    def add_progressive(self, progressive: "ProgressiveTimestamps", text: str) -> None:
        """A token-mode request ended: the words its progressive alignment has not confirmed, sentence by sentence."""
        task = asyncio.create_task(progressive.finish(self.last, text))
        self.last = task
        self.tasks.append(task)

    async def send_words(self, utterance_index: int, sentence_index: int, result: SpanWords) -> None:
        event = {"type": "audio.chunk", "utterance_index": utterance_index, "sentence_index": sentence_index,
                 "timestamps": result.ms_json()}
        if result.reason is not None:
            event["reason"] = result.reason
        await self.ws.send_json(event)

    async def _send(self, before: asyncio.Task | None, utterance_index: int, sentence_index: int,
                    audio: np.ndarray, text: str, offset_ms: int) -> None:
        result = await align_span(self.state, f"{self.session_id}-{utterance_index}", sentence_index, audio, text,
                                     self.language, offset_ms)
        if before is not None:
            await before
        await self.send_words(utterance_index, sentence_index, result)

    async def flush(self) -> None:
        """Every trailing event of the utterance sent (before its session.done); the next one starts at 0 ms."""
        tasks, self.tasks, self.last, self.offset_ms = self.tasks, [], None, 0
        await asyncio.gather(*tasks)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class ProgressiveTimestamps:
    """Token mode: one request speaks the whole utterance, so its sentences' words are found while it runs. Whenever a
    sentence of the text is complete beyond the confirmed ones, the audio since the last confirmed word is aligned
    against the text not yet confirmed (all of it: speech not yet made is squeezed into the audio's end), and each
    complete sentence whose last word ends CONFIRM_MARGIN_MS or more before that audio's end is confirmed and sent.
    The request's end aligns the rest (`finish`). One alignment at a time; the events go out in sentence order."""

    CONFIRM_MARGIN_MS = 1000

    def __init__(self, trailing: TrailingTimestamps, utterance_index: int) -> None:
        self.trailing, self.utterance_index = trailing, utterance_index
        self.audio: list[np.ndarray] = []   # the request's audio from sample `start` on
        self.start = 0
        self.cut = 0            # samples of the audio before the first unconfirmed word
        self.text_cut = 0       # characters of the text in confirmed sentences
        self.sentence_index = 0
        self.step: asyncio.Task | None = None

    def feed(self, audio: np.ndarray, text: str) -> None:
        self.audio.append(audio)
        if (self.step is None or self.step.done()) and _complete_sentences(text[self.text_cut:])[0]:
            self.step = asyncio.create_task(self._confirm(text))
            self.trailing.tasks.append(self.step)   # awaited before session.done, cancelled with the session

    async def _confirm(self, text: str) -> None:
        rest = text[self.text_cut:]
        window = self._window()
        offset_ms = round(self.cut * 1000 / SAMPLE_RATE)
        result = await align_span(self.trailing.state, self._request_id, self.sentence_index, window, rest,
                                     self.trailing.language, offset_ms)
        if result.words is None:
            return
        sentences, _ = _complete_sentences(rest)
        limit_ms = offset_ms + round(window.shape[0] * 1000 / SAMPLE_RATE) - self.CONFIRM_MARGIN_MS
        hint, words = language_hint(self.trailing.language), result.words
        for sentence, span in sentences:
            count = len(split_words(sentence, hint))
            if count > len(words) or (count and words[count - 1][2] > limit_ms):
                return
            await self.trailing.send_words(self.utterance_index, self.sentence_index, SpanWords(words[:count]))
            self.sentence_index += 1
            self.text_cut += span
            if count:
                self.cut = max(self.cut, words[count - 1][2] * SAMPLE_RATE // 1000)
            words = words[count:]

    async def finish(self, before: asyncio.Task | None, text: str) -> None:
        if self.step is not None:
            await self.step
        if before is not None:
            await before
        rest = text[self.text_cut:]
        if not rest.strip():
            return
        window = self._window()
        result = await align_span(self.trailing.state, self._request_id, self.sentence_index, window, rest,
                                     self.trailing.language, round(self.cut * 1000 / SAMPLE_RATE))
        for _, part in by_sentence(result, rest, self.trailing.language):
            await self.trailing.send_words(self.utterance_index, self.sentence_index, part)
            self.sentence_index += 1

    def _window(self) -> np.ndarray:
        """The audio from the first unconfirmed word on; what came before is let go (memory stays with the
        unconfirmed part, and no step copies the confirmed audio again)."""
        audio = (np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32))[self.cut - self.start:]
        self.audio, self.start = [audio], self.cut
        return audio

    @property
    def _request_id(self) -> str:
        return f"{self.trailing.session_id}-{self.utterance_index}"


def _complete_sentences(text: str) -> tuple[list[tuple[str, int]], int]:
    """The complete sentences at the start of `text`, each with the characters it spans (trailing space included),
    and the characters they span together."""
    splitter = TextSplitter("sentence")
    units = splitter.feed(text)
    consumed = len(text) - len(splitter.buffer)
    out, position = [], 0
    for unit in units:
        end = text.index(unit, position) + len(unit)
        while end < consumed and text[end].isspace():
            end += 1
        out.append((unit, end - position))
        position = end
    return out, consumed
