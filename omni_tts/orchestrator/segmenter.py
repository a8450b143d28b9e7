"""Long-form narration: a long input cut into segments, each one talker request (the rule of where a sentence or a
clause ends is text_splitter.py's).

Blank lines separate paragraphs, and no segment spans two. Inside one, a line break is whitespace, except after a
line that ends without a sentence mark and is no prose wrapped by hand (a heading, a list item, a verse line: one
shorter than 60 characters not followed by a lowercase word, or one followed by a list item): it ends a sentence.
Consecutive sentences are packed into one segment while it stays within the limit; the first segment holds
the first sentence alone, so the listener hears audio soon (and a designed voice is cloned from it). A sentence over
the limit is cut at its clauses, a clause over it at whitespace, a run without any at the limit; a cut sentence
starts a segment, so that a segment ends at a sentence's end wherever it can. One pass over the text: the cost is
linear in its length.
"""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from omni_tts.config.settings import NarrationSettings
from omni_tts.orchestrator.text_splitter import CLAUSE_MARKS, CLOSERS, SENTENCE_MARKS, unit_ends

BOUNDARIES = ("paragraph", "sentence", "clause", "end")
# a line this long that ends mid-sentence was wrapped by hand; verse lines and headings are shorter
_WRAPPED_LINE_CHARS = 60
_LINE_BREAK = re.compile(r"\r\n|[\n\r\v\f\x85\u2028\u2029]")
_LIST_ITEM = re.compile(r"\s*(?:[-*•·–—]|\d{1,3}[.)])\s")
_WORD = re.compile(r"\S+")
_SENTENCE, _CLAUSE, _WORD_LEVEL = 0, 1, 2  # what a piece is; one too long is cut into pieces of the next level


@dataclass(frozen=True)
class Segment:
    index: int
    text: str  # stripped, never empty
    start: int  # text == input[start:end].strip()
    end: int
    boundary: str  # what ends it: "paragraph" | "sentence" | "clause" | "end" (the last segment)


class _Piece(NamedTuple):
    start: int  # input[start:end] is stripped
    end: int
    boundary: str


def segment_text(text: str, max_chars: int = NarrationSettings.segment_chars, first_max_chars: int | None = None,
                 fits: Callable[[str], bool] | None = None) -> list[Segment]:
    """`text` cut into segments of at most `max_chars` characters (the first: `first_max_chars`) for which `fits`
    holds; `fits` must hold for every prefix of a text it holds for (a token limit does)."""
    first_max_chars = max_chars if first_max_chars is None else first_max_chars
    if max_chars < 1 or first_max_chars < 1:
        raise ValueError(f"max_chars and first_max_chars must be at least 1, got {max_chars}, {first_max_chars}")
    sentences = _sentences(text)
    if not sentences:
        return []
    packer = _Packer(text, fits)
    first = sentences[0]
    head = list(packer.pack([first], _SENTENCE, first_max_chars))
    rest = sentences[1:] if len(head) == 1 else [_Piece(head[1].start, first.end, first.boundary), *sentences[1:]]
    pieces = [head[0], *packer.pack(rest, _SENTENCE, max_chars)]
    return [Segment(i, text[p.start:p.end], p.start, p.end, p.boundary) for i, p in enumerate(pieces)]


class _Packer:
    def __init__(self, text: str, fits: Callable[[str], bool] | None) -> None:
        self.text = text
        self.fits = fits

    def pack(self, pieces: list[_Piece], level: int, limit: int) -> Iterator[_Piece]:
        """Consecutive pieces of one paragraph merged while they stay within the limit. A piece over it alone is cut
        into pieces of the next level: it starts a segment (the one before ends where a unit does), and its last
        part may take the pieces that follow."""
        group = None
        for piece in pieces:
            if not self._within(piece, limit):
                if group is not None:
                    yield group
                *parts, group = self._cut(piece, level, limit)
                yield from parts
                continue
            if group is None:
                group = piece
                continue
            merged = _Piece(group.start, piece.end, piece.boundary)
            if group.boundary != "paragraph" and self._within(merged, limit):
                group = merged
            else:
                yield group
                group = piece
        if group is not None:
            yield group

    def _within(self, piece: _Piece, limit: int) -> bool:
        return piece.end - piece.start <= limit and (
            self.fits is None or self.fits(self.text[piece.start:piece.end]))

    def _cut(self, piece: _Piece, level: int, limit: int) -> Iterator[_Piece]:
        if level == _WORD_LEVEL:
            yield from self._cut_at_limit(piece, limit)
            return
        if level == _SENTENCE:
            cuts = (piece.start + end for end in unit_ends(self.text[piece.start:piece.end], CLAUSE_MARKS, True))
            parts = _spans(self.text, piece.start, cuts, piece.end)
        else:
            parts = [(m.start(), m.end()) for m in _WORD.finditer(self.text, piece.start, piece.end)]
        yield from self.pack(_inherit(parts, piece.boundary), level + 1, limit)

    def _cut_at_limit(self, piece: _Piece, limit: int) -> Iterator[_Piece]:
        """A run without whitespace (CJK, a long URL): the longest prefix within the limit, and so on."""
        start = piece.start
        while start < piece.end:
            end = self._edge(start, min(start + limit, piece.end))
            if self.fits is not None and not self.fits(self.text[start:end]):
                low, high = start + 1, end - 1  # one character is taken as fitting: it cannot be cut
                while low < high:
                    middle = (low + high + 1) // 2
                    low, high = (middle, high) if self.fits(self.text[start:middle]) else (low, middle - 1)
                end = self._edge(start, low)
            yield _Piece(start, end, piece.boundary if end == piece.end else "clause")
            start = end

    def _edge(self, start: int, end: int) -> int:
        """`end` moved back so that no combining mark (a Devanagari vowel sign, an accent) is cut from its letter;
        kept where the whole run is one letter's marks (no letter to keep them with: cut at the limit)."""
        edge = end
        while edge - 1 > start and edge < len(self.text) and unicodedata.category(self.text[edge])[0] == "M":
            edge -= 1
        stuck = edge < len(self.text) and unicodedata.category(self.text[edge])[0] == "M"
        return end if stuck else edge


def _sentences(text: str) -> list[_Piece]:
    """Every sentence of `text`, each with what follows it; the last one's boundary is "end"."""
    sentences: list[_Piece] = []
    for paragraph in _paragraphs(text):
        run_start = paragraph[0][0]
        for line, following in zip(paragraph, paragraph[1:] + [None]):
            if following is not None and not _line_ends_sentence(text, line, following):
                continue
            cuts = (run_start + end for end in unit_ends(text[run_start:line[1]], SENTENCE_MARKS, True))
            sentences += [_Piece(*span, "sentence") for span in _spans(text, run_start, cuts, line[1])]
            run_start = following[0] if following is not None else None
        sentences[-1] = sentences[-1]._replace(boundary="paragraph")
    if sentences:
        sentences[-1] = sentences[-1]._replace(boundary="end")
    return sentences


def _paragraphs(text: str) -> Iterator[list[tuple[int, int]]]:
    """Each paragraph's lines (start, end), line breaks left out: blank lines separate paragraphs."""
    paragraph, start = [], 0
    for line_break in [*_LINE_BREAK.finditer(text), None]:
        end = len(text) if line_break is None else line_break.start()
        if start < end and not text[start:end].isspace():
            paragraph.append((start, end))
        elif paragraph:
            yield paragraph
            paragraph = []
        start = line_break.end() if line_break is not None else end
    if paragraph:
        yield paragraph


def _line_ends_sentence(text: str, line: tuple[int, int], following: tuple[int, int]) -> bool:
    start, end = line
    while end > start and (text[end - 1].isspace() or text[end - 1] in CLOSERS):
        end -= 1
    if end == start or text[end - 1] in SENTENCE_MARKS:
        return False  # the sentence rule decides
    if _LIST_ITEM.match(text, following[0], following[1]):
        return True
    first = text[following[0]:following[1]].lstrip()[0]
    return not first.islower() and end - start < _WRAPPED_LINE_CHARS


def _spans(text: str, start: int, cuts: Iterator[int], end: int) -> list[tuple[int, int]]:
    """text[start:end] cut at `cuts`, each part stripped, empty ones left out."""
    spans = []
    for cut in [*cuts, end]:
        left, right = start, cut
        while left < right and text[left].isspace():
            left += 1
        while right > left and text[right - 1].isspace():
            right -= 1
        if left < right:
            spans.append((left, right))
        start = cut
    return spans


def _inherit(spans: list[tuple[int, int]], boundary: str) -> list[_Piece]:
    """The parts of one unit: "clause" follows each but the last, which ends where the unit did."""
    return [_Piece(start, end, boundary if i == len(spans) - 1 else "clause") for i, (start, end) in enumerate(spans)]
