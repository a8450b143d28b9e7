"""Pronunciation alias rules: a word or phrase (a grapheme) → what to say instead, applied to a request's text before
it is tokenized (orchestrator/input_processor.py, whole or in pieces).

At each position of the text the rules are tried in their order and the first that matches is replaced; the scan
goes on after the replaced text, so an alias is never rewritten again. A rule with word boundaries matches only
where no letter or digit (or `_`) touches the grapheme on either side; a case-insensitive rule compares the text's
and the grapheme's lower case.

Text that arrives in pieces (`AliasStream`) is replaced exactly as the whole text would be: a decision at a position
reads the character before it and the grapheme's length (and one boundary character) from it, so the text from the
first position where a rule could still match, given what came so far, is held back until more text (or the end)
decides it: a word that begins like a grapheme, never more than the longest grapheme.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class AliasRule:
    grapheme: str
    alias: str
    case_sensitive: bool = True
    word_boundaries: bool = True

    def matches(self, text: str, at: int) -> bool:
        """Whether the grapheme is at `at` (its boundaries read from `text`, whose end is the text's end)."""
        end = at + len(self.grapheme)
        return self._same(text[at:end], self.grapheme) and not (self.word_boundaries and (
            at > 0 and _is_word(text[at - 1]) or end < len(text) and _is_word(text[end])))

    def is_decided(self, text: str, at: int) -> bool:
        """Whether `matches(text, at)` is final, whatever text follows: the text reaches past the grapheme (and the
        boundary character after it)."""
        return at + len(self.grapheme) + self.word_boundaries <= len(text)

    def could_match(self, text: str, at: int) -> bool:
        """Whether some continuation of `text` would make the grapheme match at `at` (text ends within it)."""
        tail = text[at:]
        return (self._same(tail, self.grapheme[:len(tail)]) and
                not (self.word_boundaries and at > 0 and _is_word(text[at - 1])))

    def _same(self, piece: str, grapheme: str) -> bool:
        return piece == grapheme or not self.case_sensitive and piece.lower() == grapheme.lower()


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


@dataclass(frozen=True)
class Lexicon:
    """Rules in priority order (pickled whole: serve-ray sends it with the request to a replica)."""
    rules: tuple[AliasRule, ...]

    @classmethod
    def combine(cls, lexicons: Iterable[Lexicon | None]) -> Lexicon | None:
        """The rules of `lexicons`, the earlier ones first (they win); None when there are none."""
        rules = tuple(rule for lexicon in lexicons if lexicon is not None for rule in lexicon.rules)
        return cls(rules) if rules else None

    @functools.cached_property
    def by_first_char(self) -> dict[str, tuple[AliasRule, ...]]:
        """The rules, in their order, that a text position may match, by its character's lower case."""
        index: dict[str, list[AliasRule]] = {}
        for rule in self.rules:
            index.setdefault(rule.grapheme[0].lower(), []).append(rule)
        return {key: tuple(rules) for key, rules in index.items()}

    def apply(self, text: str) -> str:
        """The text to speak for `text`."""
        spoken, _ = self.scan(text, 0, final=True)
        return "".join(spoken)

    def stream(self) -> AliasStream:
        return AliasStream(self)

    def scan(self, text: str, start: int, final: bool) -> tuple[list[str], int]:
        """Replace from `start` (text[start - 1], if any, is context already replaced): the pieces to speak and where
        the scan stopped. Not `final`: it stops at the first position a rule may still match there once more text
        comes (a rule before it in priority is undecided)."""
        pieces, plain, at = [], start, start
        by_first_char = self.by_first_char
        while at < len(text):
            rule = None
            for candidate in by_first_char.get(text[at].lower(), ()):
                if final or candidate.is_decided(text, at):
                    if candidate.matches(text, at):
                        rule = candidate
                        break
                elif candidate.could_match(text, at):
                    pieces.append(text[plain:at])
                    return pieces, at
            if rule is None:
                at += 1
                continue
            pieces += [text[plain:at], rule.alias]
            at = plain = at + len(rule.grapheme)
        pieces.append(text[plain:at])
        return pieces, at


class AliasStream:
    """A text fed in pieces → the text to speak, in pieces whose concatenation is `Lexicon.apply` of the whole."""

    def __init__(self, lexicon: Lexicon) -> None:
        self.lexicon = lexicon
        self.pending = ""        # the character before the undecided text (context), then that text
        self.context = 0         # 1 once pending starts with a context character

    def feed(self, text: str) -> str:
        """Add a piece; returns the text to speak that it decided (possibly none)."""
        self.pending += text
        spoken, stop = self.lexicon.scan(self.pending, self.context, final=False)
        self._keep_from(stop)
        return "".join(spoken)

    def finish(self) -> str:
        """The rest of the text to speak (the end of the text decides what was held back)."""
        spoken, _ = self.lexicon.scan(self.pending, self.context, final=True)
        self.pending, self.context = "", 0
        return "".join(spoken)

    def _keep_from(self, stop: int) -> None:
        if stop > 0:
            self.pending, self.context = self.pending[stop - 1:], 1


def spoken_text(text: str, lexicon: Lexicon | None) -> str:
    return text if lexicon is None else lexicon.apply(text)

