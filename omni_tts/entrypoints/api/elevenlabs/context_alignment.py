"""ElevenLabs' character alignment on its WebSockets, from the forced aligner: a turn's sentences are aligned while
its audio goes out (word_times.ProgressiveTimestamps: a sentence once its last word ends a second before the audio
so far, the rest after the turn's last audio), and each aligned span goes out as a message of its own, `audio` empty,
`alignment` and `normalizedAlignment` its characters (the text as sent: no normalization happens here).

The characters spell the text the client sent, spaces and punctuation included: a word's characters share its span
(`SpanWords.characters_json`), those between two words the gap between them, those after a turn's last word the
time to its audio's end. Times are in ms, each message's relative to the end of the previous message's last
character (its "chunk"): what Pipecat and other clients add up (`start[-1] + duration[-1]`) to make them absolute
within the context's audio.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from omni_tts.entrypoints.api.speech_turn import SpeechTurn
from omni_tts.entrypoints.api.state import ServerState
from omni_tts.entrypoints.api.word_times import SpanWords, TrailingTimestamps

TimedChars = list[tuple[str, int, int]]   # (character, start_ms, end_ms), absolute in the context's audio


class ContextAlignment(TrailingTimestamps):
    """One context's alignment messages, turn after turn (`begin` each, `end` it after its audio and its
    ProgressiveTimestamps are done): the vllm-omni events of TrailingTimestamps, sent in ElevenLabs' shape."""

    def __init__(self, state: ServerState, session_id: str, language: str | None,
                 send: Callable[[dict], Awaitable[None]]) -> None:
        super().__init__(state, None, session_id, language)
        self.send = send
        self.turn: SpeechTurn | None = None
        self.turn_offset_ms = 0   # where the turn's audio starts in the context's
        self.spelled = 0          # characters of the turn's text sent
        self.aligned_ms = 0       # the end of the last character sent

    def begin(self, turn: SpeechTurn, offset_ms: int) -> None:
        self.turn, self.turn_offset_ms, self.spelled = turn, offset_ms, 0

    async def send_words(self, utterance_index: int, sentence_index: int, result: SpanWords) -> None:
        """A span's words (times within the turn): its characters up to its last word go out (none without times:
        the next span's gap covers them)."""
        if result.words is None:
            return
        offset = self.turn_offset_ms
        timed = [(c["character"], round(c["start"] * 1000) + offset, round(c["end"] * 1000) + offset)
                 for c in result.characters_json()]
        await self._send_chars(self._spell(timed))

    async def end(self, end_ms: int) -> None:
        """The turn's audio ended at `end_ms`: its characters not yet sent, up to that end."""
        text = self.turn.text
        rest, self.spelled = text[self.spelled:], len(text)
        await self._send_chars(_spread(rest, self.aligned_ms, max(end_ms, self.aligned_ms)))

    def _spell(self, timed: TimedChars) -> TimedChars:
        """The turn's text from the last character sent to the last of `timed` found in it, each timed."""
        text, position, out = self.turn.text, self.spelled, []
        for char, start, end in timed:
            found = text.find(char, position)
            if found < 0:
                break
            before = out[-1][2] if out else self.aligned_ms
            start = max(start, before)
            out += _spread(text[position:found], before, start)
            out.append((char, start, max(end, start)))
            position = found + 1
        self.spelled = position
        return out

    async def _send_chars(self, chars: TimedChars) -> None:
        if not chars:
            return
        base, self.aligned_ms = self.aligned_ms, chars[-1][2]
        alignment = {"chars": [c for c, _, _ in chars], "charStartTimesMs": [start - base for _, start, _ in chars],
                     "charDurationsMs": [end - start for _, start, end in chars]}
        await self.send({"audio": "", "isFinal": None, "alignment": alignment, "normalizedAlignment": alignment})


def _spread(chars: str, start_ms: int, end_ms: int) -> TimedChars:
    """`chars` sharing [start_ms, end_ms] evenly."""
    step = (end_ms - start_ms) / max(len(chars), 1)
    return [(c, start_ms + round(i * step), start_ms + round((i + 1) * step)) for i, c in enumerate(chars)]
