"""Cutting streamed text into sentences or clauses, one speech request each (split_granularity sentence / clause /
none of WS /v1/audio/speech/stream, as vllm-omni cuts it).

`.`, `!` and `?` end a unit only once whitespace follows (or the utterance ends): they also appear in
abbreviations, decimals (never between two digits) and URLs. The marks of other scripts end one at once.
"""
from __future__ import annotations

_NEEDS_SPACE_AFTER = frozenset(".!?")
_SENTENCE_ENDS = frozenset("。！？…।॥؟")
_CLAUSE_ENDS = _SENTENCE_ENDS | frozenset(",;，；،")
GRANULARITIES = ("sentence", "clause", "none")


class TextSplitter:
    """Feed an utterance's text as it arrives; get its complete units (stripped, never empty)."""

    def __init__(self, granularity: str) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"split granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        self.ends = {"sentence": _SENTENCE_ENDS, "clause": _CLAUSE_ENDS, "none": frozenset()}[granularity]
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        return self._take(final=False)

    def flush(self) -> list[str]:
        """The rest, at the end of the utterance."""
        return self._take(final=True)

    def _take(self, final: bool) -> list[str]:
        units, start, i, text = [], 0, 0, self.buffer
        while i < len(text):
            char = text[i]
            ends = char in self.ends or (char in _NEEDS_SPACE_AFTER and self.ends and not _is_decimal_point(text, i))
            i += 1
            if not ends:
                continue
            end = i
            while end < len(text) and text[end].isspace():
                end += 1
            if char in _NEEDS_SPACE_AFTER and end == i and not (final and end == len(text)):
                continue  # no space after it (yet): an abbreviation or a number may go on
            units.append(text[start:end].strip())
            start = i = end
        self.buffer = text[start:]
        if final:
            units.append(self.buffer.strip())
            self.buffer = ""
        return [unit for unit in units if unit]


def _is_decimal_point(text: str, i: int) -> bool:
    return text[i] == "." and 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit()
