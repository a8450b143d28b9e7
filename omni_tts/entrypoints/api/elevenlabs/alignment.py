"""ElevenLabs' character alignment (`characters`, `character_start_times_seconds`, `character_end_times_seconds`)
of a request's text, from the forced aligner's words: every character of the text once, in order, whatever the
aligner times (it times words; a word's span is shared evenly by its characters, an estimate; a character between
words, a space or a mark, takes the time the word before it ended)."""
from __future__ import annotations

from collections.abc import Iterable


class TextAlignment:
    """The text spelled out as spans of it get their words (a sentence, a narration's segment, or the whole): `span`
    gives the characters up to the last of its words, `rest` those after the last word timed."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.position = 0    # characters given so far
        self.time = 0.0      # where the last word given ended, seconds

    def span(self, words: Iterable[tuple[str, float, float]]) -> dict | None:
        """Characters from where the last call stopped to the end of the last of `words` (word, start s, end s,
        absolute in the audio) found in the text; a word the text does not hold from there on is skipped."""
        characters, starts, ends = [], [], []
        for word, start, end in words:
            at = self.text.find(word, self.position) if word else -1
            if at < 0:
                continue
            self._gap(at, characters, starts, ends)
            start, end = max(start, self.time), max(end, start, self.time)
            step = (end - start) / len(word)
            for i, character in enumerate(word):
                characters.append(character)
                starts.append(round(start + i * step, 3))
                ends.append(round(start + (i + 1) * step, 3))
            self.position, self.time = at + len(word), end
        return _alignment(characters, starts, ends)

    def rest(self) -> dict | None:
        """The characters after the last word timed (a final mark, trailing spaces), at its end."""
        characters, starts, ends = [], [], []
        self._gap(len(self.text), characters, starts, ends)
        return _alignment(characters, starts, ends)

    def _gap(self, until: int, characters: list, starts: list, ends: list) -> None:
        time = round(self.time, 3)
        for character in self.text[self.position:until]:
            characters.append(character)
            starts.append(time)
            ends.append(time)
        self.position = max(self.position, until)


def _alignment(characters: list[str], starts: list[float], ends: list[float]) -> dict | None:
    if not characters:
        return None
    return {"characters": characters, "character_start_times_seconds": starts, "character_end_times_seconds": ends}


def joined(*alignments: dict | None) -> dict | None:
    """Alignments of consecutive spans as one."""
    parts = [a for a in alignments if a is not None]
    return _alignment([c for a in parts for c in a["characters"]],
                      [t for a in parts for t in a["character_start_times_seconds"]],
                      [t for a in parts for t in a["character_end_times_seconds"]])
