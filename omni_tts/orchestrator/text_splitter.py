"""Where a sentence or a clause ends, one rule for prose in any script: the WebSocket's split_granularity sentence /
clause (`TextSplitter`, text that arrives in pieces) and the narration segmenter (segmenter.py, a whole text) cut
by it.

`.!?` and `,;:` end a unit only once whitespace follows (or the text ends): they also appear in decimals, times,
URLs and abbreviations. Even then a `.` after an abbreviation (`Mr.`, `etc.`, `e.g.`, an initial as in
`J. R. R. Tolkien`, a list item's number; `No.` and `Fig.` before a number) ends nothing, nor does an ellipsis, or
a mark inside quotes, before a lowercase word (`"Stop!" she cried.`). The marks of other scripts end one at once
(in text that arrives in pieces, even when a closing quote may follow in the next), and so does a dash (never one
between two digits). Closing quotes and brackets right after a mark belong to the unit it ends (French `»` after
a no-break space too). A mark with no word before it in its unit (a dialogue dash, an opening ellipsis) ends nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

SENTENCE_MARKS = frozenset(".!?。！？…।॥؟")
CLAUSE_MARKS = SENTENCE_MARKS | frozenset(",;:，；：、،؛—–")
GRANULARITIES = ("sentence", "clause", "none")

_NEEDS_SPACE_AFTER = frozenset(".!?,;:")
CLOSERS = frozenset("\"'”’»›)]}」』）》〉】〕")
_LATIN_CLOSERS = CLOSERS | frozenset("“‘")  # German closes with them („Halt.“); Chinese opens (。“)
_SPACED_CLOSERS = frozenset("»›")  # after a no-break space, as French typography sets them
_NO_BREAK_SPACES = frozenset("\u00a0\u202f")
_OPENERS = "\"'“‘„«‹([{¿¡"
_DASHES = frozenset("—–")
# lowercased, without the final dot; dotted runs of single letters (e.g., i.e., U.S., z.B.) need no entry
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "etc", "vs", "mt", "rev", "gen", "capt", "lt", "col", "sgt",
    "cf", "approx", "hr", "fr", "ca", "vgl", "bzw", "mme", "mlle", "sra", "srta", "dra", "ud", "uds", "напр"})
_BEFORE_NUMBER = frozenset({"no", "nos", "nr", "fig", "figs", "p", "pp", "vol", "ch", "chap", "sec", "art", "eq"})


def unit_ends(text: str, marks: frozenset[str], final: bool) -> Iterator[int]:
    """The offset just past each complete unit of `text` (its mark and closing quotes / brackets). With `final`
    False, text may still follow: it stops at the first mark whose verdict needs characters not yet there."""
    n, i, content_start = len(text), 0, None  # content_start: the unit's first character that is not a mark
    while i < n:
        if text[i] not in marks:
            if content_start is None and not text[i].isspace():
                content_start = i
            i += 1
            continue
        mark_start = i
        while i < n and text[i] in marks:  # "?!", "...", "……": one mark
            i += 1
        if content_start is None:
            continue
        end = _after_closers(text, i, _LATIN_CLOSERS if text[i - 1] in _NEEDS_SPACE_AFTER else CLOSERS)
        verdict = _ends(text, content_start, mark_start, i, end, final)
        if verdict is None:
            return
        if verdict:
            yield end
            i, content_start = end, None


def _after_closers(text: str, i: int, closers: frozenset[str]) -> int:
    """Past the closers from text[i] on; past no-break spaces at the end too, as a French `»` may follow them."""
    n = len(text)
    while i < n:
        if text[i] in closers:
            i += 1
            continue
        j = i
        while j < n and text[j] in _NO_BREAK_SPACES:
            j += 1
        if j == n:
            return n
        if j == i or text[j] not in _SPACED_CLOSERS:
            return i
        i = j + 1
    return i


def _ends(text: str, content_start: int, mark_start: int, mark_end: int, end: int, final: bool) -> bool | None:
    """Whether the mark text[mark_start:mark_end] (its closers up to `end`) ends the unit that starts at
    content_start; None: not known until more text arrives."""
    n, last = len(text), text[mark_end - 1]
    if last in _DASHES:
        if not text[mark_start - 1].isdigit():
            return True
        return (True if final else None) if end == n else not text[end].isdigit()
    if last in _NEEDS_SPACE_AFTER:
        if end == n:
            return True if final else None
        if not text[end].isspace():
            return False
    if last == "." and mark_end - mark_start == 1:
        word = _word_before(text, content_start, mark_start)
        if word.lower() in _ABBREVIATIONS or _is_initials(word):
            return False
        if mark_start - content_start <= 3 and text[content_start:mark_start].isdigit():
            return False  # a list item's number ("1. Milk")
        if word.lower() in _BEFORE_NUMBER:
            return _next_char_is(text, end, final, lambda char: not char.isdigit())
    ellipsis = last == "…" or text.endswith("...", mark_start, mark_end)
    if ellipsis or (end > mark_end and last in SENTENCE_MARKS):  # '"Stop!" she cried.' is one sentence
        return _next_char_is(text, end, final, lambda char: not char.islower())
    return True


def _next_char_is(text: str, i: int, final: bool, test: Callable[[str], bool]) -> bool | None:
    """`test` of the first character from text[i] on that is not whitespace; True at the end of a final text."""
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    if i == n:
        return True if final else None
    return test(text[i])


def _word_before(text: str, unit_start: int, i: int) -> str:
    """The word of the unit that ends at text[i] (a dot), opening quotes and brackets left out; "" if longer than
    any abbreviation."""
    start = i
    while start > unit_start and not text[start - 1].isspace():
        start -= 1
        if i - start > 12:
            return ""
    return text[start:i].lstrip(_OPENERS)


def _is_initials(word: str) -> bool:
    """A capital initial ("J" of "J."; the pronoun "I" is a word) or dotted single letters ("e.g", "U.S", "z.B")."""
    if len(word) == 1:
        return word.isupper() and word != "I"
    return "." in word and all(len(part) == 1 and part.isalpha() for part in word.split("."))


class TextSplitter:
    """Feed an utterance's text as it arrives; get its complete units (stripped, never empty)."""

    def __init__(self, granularity: str) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"split granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        self.marks = {"sentence": SENTENCE_MARKS, "clause": CLAUSE_MARKS, "none": frozenset()}[granularity]
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        return self._take(final=False)

    def flush(self) -> list[str]:
        """The rest, at the end of the utterance."""
        return self._take(final=True)

    def _take(self, final: bool) -> list[str]:
        units, start, text = [], 0, self.buffer
        for end in unit_ends(text, self.marks, final):
            units.append(text[start:end].strip())
            start = end
            while start < len(text) and text[start].isspace():
                start += 1
        self.buffer = text[start:]
        if final:
            units.append(self.buffer.strip())
            self.buffer = ""
        return [unit for unit in units if unit]
