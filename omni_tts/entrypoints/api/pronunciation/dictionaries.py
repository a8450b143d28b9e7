"""The pronunciation dictionaries a server holds: uploaded ones, by id, each with its recent versions (a change of
rules makes a new version; a request may name an older one), bounded in number and in size, kept under
`--voices-dir` (`pronunciation-dictionaries/{id}.json`, read back at start) when the server has one, else in memory;
and the dictionaries of the command line (the whole server's, each voice's).

`lexicon_for` is the one place a request's dictionaries are decided: its locators' (in their order), then its
voice's, then the server's; at each position of the text the first rule that matches wins.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from omni_tts.entrypoints.api.schema import ApiError, PronunciationLocator
from omni_tts.models.qwen3_tts.lexicon import AliasRule, Lexicon

logger = logging.getLogger(__name__)

MAX_DICTIONARIES = 100
MAX_VERSIONS = 8               # versions kept per dictionary: a locator may name any of them
MAX_STORED_CHARS = 8 * 2**20   # graphemes and aliases of every kept version together
SUBDIRECTORY = "pronunciation-dictionaries"
LOCATORS = "pronunciation_dictionary_locators"


@dataclass(frozen=True)
class Version:
    version_id: str
    rules: tuple[AliasRule, ...]

    @property
    def chars(self) -> int:
        return sum(len(rule.grapheme) + len(rule.alias) for rule in self.rules)


@dataclass(frozen=True)
class Dictionary:
    id: str
    name: str
    description: str | None
    creation_time_unix: int
    versions: tuple[Version, ...]   # oldest first; the last is the latest

    @property
    def latest(self) -> Version:
        return self.versions[-1]

    def metadata(self) -> dict:
        """ElevenLabs' GetPronunciationDictionaryMetadataResponse."""
        return {"id": self.id, "latest_version_id": self.latest.version_id,
                "latest_version_rules_num": len(self.latest.rules), "name": self.name,
                "permission_on_resource": "admin", "created_by": "omni-tts",
                "creation_time_unix": self.creation_time_unix, "archived_time_unix": None,
                "description": self.description}

    def to_json(self) -> dict:
        return {**self.metadata(), "versions": [
            {"version_id": v.version_id, "rules": [dataclasses.asdict(r) for r in v.rules]} for v in self.versions]}

    @classmethod
    def from_json(cls, data: dict) -> Dictionary:
        versions = tuple(Version(v["version_id"], tuple(AliasRule(**r) for r in v["rules"])) for v in data["versions"])
        return cls(data["id"], data["name"], data.get("description"), data["creation_time_unix"], versions)


@dataclass(frozen=True)
class ServerLexicons:
    """The dictionaries of the command line: the whole server's (--pronunciation-dictionary) and each voice's
    (--voice-pronunciation-dictionary VOICE=FILE), by the voice's name in lower case."""
    server: Lexicon | None = None
    voices: dict[str, Lexicon] = dataclasses.field(default_factory=dict)


class PronunciationDictionaries:
    def __init__(self, folder: str | None, fixed: ServerLexicons = ServerLexicons()) -> None:
        """folder: where the uploaded ones are kept (None: in memory only)."""
        self.folder = None if folder is None else os.path.join(folder, SUBDIRECTORY)
        self.fixed = fixed
        self.dictionaries: dict[str, Dictionary] = {}
        self.lexicons: dict[str, Lexicon | None] = {}   # by version id
        if self.folder is not None:
            self._load()

    # --- requests ----------------------------------------------------------------------------------------------
    def lexicon_for(self, locators: Sequence[PronunciationLocator] | None, voice: str | None) -> Lexicon | None:
        """A request's rules (ApiError 400 naming the locator that finds no dictionary or version)."""
        found = [self.lexicons[self.version(locator).version_id] for locator in locators or ()]
        voice_lexicon = None if voice is None else self.fixed.voices.get(voice.lower())
        return Lexicon.combine([*found, voice_lexicon, self.fixed.server])

    def version(self, locator: PronunciationLocator) -> Version:
        dictionary = self.dictionaries.get(locator.pronunciation_dictionary_id)
        if dictionary is None:
            raise ApiError(400, f"pronunciation dictionary '{locator.pronunciation_dictionary_id}' does not exist "
                                "here", LOCATORS)
        if locator.version_id is None:
            return dictionary.latest
        version = next((v for v in dictionary.versions if v.version_id == locator.version_id), None)
        if version is None:
            raise ApiError(400, f"pronunciation dictionary '{dictionary.id}' has no version '{locator.version_id}' "
                                f"(the server keeps its {MAX_VERSIONS} latest)", LOCATORS)
        return version

    # --- changes (on the event loop; the file is written by the caller, `save`) ----------------------------------
    def get(self, dictionary_id: str) -> Dictionary:
        dictionary = self.dictionaries.get(dictionary_id)
        if dictionary is None:
            raise ApiError(404, f"pronunciation dictionary '{dictionary_id}' does not exist")
        return dictionary

    def create(self, name: str, description: str | None, rules: list[AliasRule]) -> Dictionary:
        if len(self.dictionaries) >= MAX_DICTIONARIES:
            raise ApiError(413, f"this server holds at most {MAX_DICTIONARIES} pronunciation dictionaries")
        dictionary = Dictionary(_new_id(), name, description, int(time.time()), ())
        return self._put(dictionary, rules)

    def change(self, dictionary_id: str, rules: list[AliasRule]) -> Dictionary:
        """A new latest version with `rules`; the oldest beyond MAX_VERSIONS goes."""
        return self._put(self.get(dictionary_id), rules)

    def _put(self, dictionary: Dictionary, rules: list[AliasRule]) -> Dictionary:
        version = Version(_new_id(), tuple(rules))
        versions = (*dictionary.versions, version)[-MAX_VERSIONS:]
        old = self.dictionaries.get(dictionary.id)
        freed = sum(v.chars for v in old.versions if v not in versions) if old is not None else 0
        if self.stored_chars - freed + version.chars > MAX_STORED_CHARS:
            raise ApiError(413, f"the pronunciation dictionaries would hold more than {MAX_STORED_CHARS} characters "
                                "of rules together")
        changed = dataclasses.replace(dictionary, versions=versions)
        self._hold(changed, old)
        return changed

    def _hold(self, dictionary: Dictionary, old: Dictionary | None) -> None:
        for version in old.versions if old is not None else ():
            self.lexicons.pop(version.version_id, None)
        self.dictionaries[dictionary.id] = dictionary
        for version in dictionary.versions:
            self.lexicons[version.version_id] = Lexicon.combine([Lexicon(version.rules)])

    @property
    def stored_chars(self) -> int:
        return sum(v.chars for d in self.dictionaries.values() for v in d.versions)

    # --- the folder ----------------------------------------------------------------------------------------------
    def save(self, dictionary: Dictionary) -> None:
        """Write `dictionary` whole (a thread's work: blocking I/O), atomically: a crash leaves the old file."""
        if self.folder is None:
            return
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"{dictionary.id}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(dictionary.to_json(), f, ensure_ascii=False)
        os.replace(path + ".tmp", path)

    def _load(self) -> None:
        if not os.path.isdir(self.folder):
            return
        for entry in sorted(os.listdir(self.folder)):
            if not entry.endswith(".json") or len(self.dictionaries) >= MAX_DICTIONARIES:
                continue
            try:
                with open(os.path.join(self.folder, entry), encoding="utf-8") as f:
                    self._hold(Dictionary.from_json(json.load(f)), None)
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("pronunciation dictionary %s skipped: cannot be read (%s)", entry, e)


def _new_id() -> str:
    return secrets.token_hex(10)   # 20 characters, as ElevenLabs' ids
