"""Tokenize a target text that arrives in pieces: ids as soon as they are final, equal to the whole text's.

`IncrementalTokenizer.feed` returns the ids that no later text can change; `finish` returns the rest. Their
concatenation equals the ids `PromptBuilder.tokenize` takes from the whole text's template (role ids, then text ids),
whatever the cuts. The tokenizer runs its own pipeline on every piece it commits (special tokens split the text,
then NFC, then the Qwen2 regex, then byte-level BPE per pre-token), so a piece is committed only up to a point where
that pipeline splits the text the same way whatever follows:

- special tokens: a complete one ends everything before it; a tail that may be the start of one waits;
- NFC: only before a character that nothing can compose with or reorder across (a starter that never combines with
  what precedes it), and not the last such one, whose own class a following mark could change by composing;
- the regex: only at a pre-token boundary after a non-whitespace character. Every alternative of the pattern stops
  at the first character of another class, so the matches before such a boundary read nothing past the character
  after it; a match ending in whitespace may have scanned a whole whitespace run (`\\s*[\\r\\n]+`, `\\s+(?!\\S)`),
  which the next piece could lengthen. The last pre-token always waits (its letters or digits may continue).
"""
from __future__ import annotations

import functools
import unicodedata

from tokenizers import Tokenizer

from .text_tokenizer import TEMPLATE_HEAD, TEMPLATE_TAIL, TEMPLATE_TAIL_TOKENS, strip_leading_newlines

# Hangul vowel and trailing-consonant jamo compose with the syllable before them (algorithmically, not by table)
_HANGUL_BACKWARD = {chr(c) for c in list(range(0x1161, 0x1176)) + list(range(0x11A8, 0x11C3))}


@functools.cache
def _backward_combining_starters() -> frozenset[str]:
    """Characters of combining class 0 that NFC composes with the character before them (e.g. Tamil AU length mark)."""
    found = set(_HANGUL_BACKWARD)
    for code in range(0x30000):  # canonical decompositions end below U+2FA1E
        decomposition = unicodedata.decomposition(chr(code))
        parts = decomposition.split()
        if len(parts) != 2 or decomposition.startswith("<"):
            continue
        first, second = (chr(int(p, 16)) for p in parts)
        if unicodedata.combining(second) == 0 and unicodedata.normalize("NFC", first + second) == chr(code):
            found.add(second)
    return frozenset(found)


def _is_normalization_boundary(char: str) -> bool:
    """NFC(a + char + b) == NFC(a) + NFC(char + b) for any a, b: char decomposes to a starter that never composes
    backwards. Unassigned characters (in this Python's Unicode) are assumed not to be."""
    if char.isascii():
        return True
    if unicodedata.category(char) == "Cn":
        return False
    first = unicodedata.normalize("NFD", char)[0]
    return unicodedata.combining(first) == 0 and first not in _backward_combining_starters()


class IncrementalTokenizer:
    """Ids of TEMPLATE_HEAD + text (the role ids, then the text ids), fed in pieces. Not thread-safe; the
    tokenizer's own calls are made from the caller's thread."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.specials = [token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special]
        self.pending = TEMPLATE_HEAD   # text not yet committed
        self.started = False           # a character other than a leading newline has arrived
        self.is_blank = True           # nothing but whitespace so far (an empty input)

    def feed(self, text: str) -> list[int]:
        """Add a piece of the text; returns the ids it made final (possibly none)."""
        if not self.started:
            text = strip_leading_newlines(text)
            self.started = bool(text)
        if self.is_blank and text.strip():
            self.is_blank = False
        self.pending += text
        end = self._final_prefix(self.pending)
        if end == 0:
            return []
        committed, self.pending = self.pending[:end], self.pending[end:]
        return self._encode(committed)

    def finish(self) -> list[int]:
        """The ids of the rest of the text; the tokenizer is spent."""
        ids = self._encode(self.pending + TEMPLATE_TAIL)[:-TEMPLATE_TAIL_TOKENS]
        self.pending = ""
        return ids

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _final_prefix(self, text: str) -> int:
        """The length of the longest prefix of `text` whose ids no continuation can change."""
        known = len(text)
        for special in self.specials:
            for n in range(len(special) - 1, 0, -1):  # the longest tail that may begin a special token
                if text.endswith(special[:n]):
                    known = min(known, len(text) - n)
                    break
        # the tokenizer splits at special tokens first: a complete one ends the segment before it
        segment_start = max((text.rfind(s, 0, known) + len(s) for s in self.specials if s in text[:known]), default=0)
        return max(segment_start, self._segment_final_prefix(text, segment_start, known))

    def _segment_final_prefix(self, text: str, start: int, stop: int) -> int:
        """In text[start:stop] (no special token inside; what follows `stop` is unknown), the end of the longest
        final prefix, as an index into `text`; `start` if there is none."""
        normalize = self.tokenizer.normalizer.normalize_str
        normalized = normalize(text[start:stop])
        pretokens = self.tokenizer.pre_tokenizer.pre_tokenize_str(normalized)
        candidates = {begin for _, (begin, _) in pretokens[1:] if not normalized[begin - 1].isspace()}
        if not candidates:
            return start
        # NFC splits the text before each boundary character: (raw index, index in the normalized text) of each
        cuts, length, piece_start = [], 0, start
        for i in range(start + 1, stop):
            if _is_normalization_boundary(text[i]):
                piece = text[piece_start:i]
                length += len(piece) if piece.isascii() else len(normalize(piece))
                cuts.append((i, length))
                piece_start = i
        # the character at the last cut may still compose with marks to come (its class is then unknown): only the
        # cuts before it qualify, and the regex read nothing past them
        for raw, cut in reversed(cuts[:-1]):
            if cut in candidates:
                return raw
        return start
