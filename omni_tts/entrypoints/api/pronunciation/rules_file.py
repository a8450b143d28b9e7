"""Pronunciation rules as clients write them → `AliasRule`s: a W3C PLS 1.0 lexicon (XML) or ElevenLabs' JSON rules.

The XML is read by expat with no DTD at all: a DOCTYPE (and so any entity declaration, internal or external) is
refused before anything is expanded, and the file's size is bounded before it is parsed. Phoneme rules (IPA,
X-SAMPA, CMU Arpabet) mean nothing to Qwen3-TTS, which reads text only: a lexeme or rule that has no alias is
refused, naming it, so a client never believes a pronunciation is in force when it is not.
"""
from __future__ import annotations

from typing import Annotated, Literal
from xml.parsers import expat

import msgspec

from omni_tts.models.qwen3_tts.lexicon import AliasRule

MAX_FILE_BYTES = 1 * 2**20     # a PLS or JSON rules file
MAX_RULES = 2000               # rules of one dictionary (a lexeme with several graphemes counts each)
MAX_GRAPHEME_CHARS = 256       # also how much streamed text may wait for a rule to be decided
MAX_ALIAS_CHARS = 1024
PHONEME_REFUSED = ("phoneme rules (IPA, X-SAMPA, Arpabet) mean nothing to Qwen3-TTS, which reads text: give it an "
                   "alias (what to say instead)")


class RulesError(ValueError):
    """A rules file or body that cannot be used; the message names the lexeme or rule."""


Grapheme = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAPHEME_CHARS)]


class RuleBody(msgspec.Struct, kw_only=True):
    """One of ElevenLabs' rules: {type: alias, string_to_replace, alias} or {type: phoneme, ..., phoneme, alphabet}."""
    type: Literal["alias", "phoneme"]
    string_to_replace: Grapheme
    alias: Annotated[str, msgspec.Meta(max_length=MAX_ALIAS_CHARS)] | None = None
    phoneme: str | None = None
    alphabet: str | None = None
    case_sensitive: bool | None = None   # None: ElevenLabs' default, true
    word_boundaries: bool | None = None  # None: ElevenLabs' default, true


Rules = Annotated[list[RuleBody], msgspec.Meta(max_length=MAX_RULES)]


def alias_rules(bodies: list[RuleBody], where: str = "rules") -> list[AliasRule]:
    """JSON rules → alias rules; RulesError naming a phoneme rule or an alias rule without its alias."""
    rules = []
    for i, body in enumerate(bodies):
        name = f"{where}[{i}] ('{body.string_to_replace}')"
        if body.type == "phoneme":
            raise RulesError(f"{name}: {PHONEME_REFUSED}")
        if body.alias is None:
            raise RulesError(f"{name}: an alias rule needs 'alias'")
        rules.append(AliasRule(body.string_to_replace, body.alias, body.case_sensitive is not False,
                               body.word_boundaries is not False))
    return rules


def parse_json_rules(data: bytes) -> list[AliasRule]:
    """A JSON rules file: a list of rules, or an object with `rules` (the add-from-rules body)."""
    try:
        value = msgspec.json.decode(data, type=Rules | _RulesObject)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise RulesError(f"not valid JSON rules ({e}): expected a list of rules or {{\"rules\": [...]}}") from None
    return alias_rules(value if isinstance(value, list) else value.rules)


class _RulesObject(msgspec.Struct):
    rules: Rules


def parse_pls(data: bytes) -> list[AliasRule]:
    """A PLS lexicon's lexemes → alias rules, one per grapheme (case-sensitive, whole words: PLS matches graphemes
    as written). RulesError for a DOCTYPE or entity, malformed XML, or a lexeme without grapheme or alias."""
    lexemes = _Lexemes()
    parser = expat.ParserCreate(namespace_separator=" ")
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.StartDoctypeDeclHandler = _refuse_doctype
    parser.EntityDeclHandler = _refuse_doctype
    parser.StartElementHandler, parser.EndElementHandler = lexemes.start, lexemes.end
    parser.CharacterDataHandler = lexemes.text
    try:
        parser.Parse(data, True)
    except expat.ExpatError as e:
        raise RulesError(f"the PLS file is not well-formed XML: {expat.ErrorString(e.code)} at line {e.lineno}, "
                         f"column {e.offset}") from None
    if not lexemes.saw_root:
        raise RulesError("the PLS file's root element must be <lexicon>")
    return lexemes.rules


def _refuse_doctype(*_: object) -> None:
    raise RulesError("the PLS file declares a DOCTYPE or entities, which this server does not read (they could "
                     "expand without bound or read local files); remove the declaration")


class _Lexemes:
    """expat's events → rules: the graphemes, aliases and phonemes of each <lexeme>."""

    def __init__(self) -> None:
        self.rules: list[AliasRule] = []
        self.saw_root = False
        self.lexeme: dict[str, list[str]] | None = None
        self.count = 0
        self.field: str | None = None   # the lexeme's child whose text is being read
        self.chars: list[str] = []

    def start(self, name: str, _attributes: dict) -> None:
        tag = name.rpartition(" ")[2]
        if not self.saw_root:
            if tag != "lexicon":
                raise RulesError(f"the PLS file's root element must be <lexicon>, not <{tag}>")
            self.saw_root = True
        elif tag == "lexeme":
            self.lexeme, self.count = {"grapheme": [], "alias": [], "phoneme": []}, self.count + 1
        elif self.lexeme is not None and tag in self.lexeme:
            self.field, self.chars = tag, []

    def text(self, data: str) -> None:
        if self.field is not None:
            self.chars.append(data)

    def end(self, name: str) -> None:
        tag = name.rpartition(" ")[2]
        if self.field is not None and tag == self.field:
            self.lexeme[self.field].append(" ".join("".join(self.chars).split()))
            self.field = None
        elif tag == "lexeme" and self.lexeme is not None:
            self._add(self.lexeme)
            self.lexeme = None

    def _add(self, lexeme: dict[str, list[str]]) -> None:
        graphemes = [g for g in lexeme["grapheme"] if g]
        name = f"lexeme {self.count}" + (f" ('{graphemes[0]}')" if graphemes else "")
        if not graphemes:
            raise RulesError(f"{name} has no <grapheme>")
        if not lexeme["alias"]:
            raise RulesError(f"{name}: {PHONEME_REFUSED}" if lexeme["phoneme"] else f"{name} has no <alias>")
        alias = lexeme["alias"][0]
        for grapheme in graphemes:
            if len(grapheme) > MAX_GRAPHEME_CHARS or len(alias) > MAX_ALIAS_CHARS:
                raise RulesError(f"{name}: a grapheme may have at most {MAX_GRAPHEME_CHARS} characters and an alias "
                                 f"{MAX_ALIAS_CHARS}")
            if len(self.rules) == MAX_RULES:
                raise RulesError(f"{name}: a dictionary may hold at most {MAX_RULES} rules")
            self.rules.append(AliasRule(grapheme, alias))


def parse_rules_file(data: bytes) -> list[AliasRule]:
    """A PLS (XML) or JSON rules file, told apart by its first character; RulesError if it is neither or bad."""
    if len(data) > MAX_FILE_BYTES:
        raise RulesError(f"the file is {len(data)} bytes; a pronunciation dictionary may have at most "
                         f"{MAX_FILE_BYTES} bytes")
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if head == b"<":
        return parse_pls(data)
    if head in (b"[", b"{"):
        return parse_json_rules(data)
    raise RulesError("not a pronunciation dictionary: expected a PLS lexicon (XML) or JSON rules")


def read_rules_file(path: str) -> list[AliasRule]:
    """`omni-tts serve --pronunciation-dictionary FILE`'s rules; ValueError (one line, naming the file) if bad."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    try:
        return parse_rules_file(data)
    except RulesError as e:
        raise ValueError(f"{path}: {e}") from None
