"""The names clients hard-code (OpenAI, ElevenLabs and DashScope voices; vendor model names) and what they mean here:
the default table, and `omni-tts serve --aliases FILE`, which extends or overrides it. names.py applies it, in one
place per kind: `VoiceNames.choose` (voices) and `served_model` (models).

Voices: each default alias names the released CustomVoice speaker nearest it in gender and register (the dialect
speakers, dylan and eric, are left out: they turn Chinese or auto-language text into their dialect); a checkpoint
without that speaker maps the i-th alias of the table to the (i mod n)-th of its n speakers in sorted order
(`voice_alias_map`). A checkpoint speaker's own name always means that speaker (DashScope's Serena and Vivian,
ElevenLabs' Eric, ...). ElevenLabs voice ids and names are listed as its premade voices were published (ids from its
SDK's examples and public voice lists); `hpp4J3VqNfWAUOO0d1Us` is LiveKit Agents' default voice (Pipecat has none).

Models: the vendor names below all mean the primary served model; a trailing `*` matches every name it starts.
"""
from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping, Sequence

import msgspec

# OpenAI's built-in TTS voices, in the order of its API reference
OPENAI_VOICE_ALIASES = {"alloy": "vivian", "ash": "ryan", "ballad": "aiden", "coral": "serena", "echo": "aiden",
                        "fable": "ryan", "onyx": "uncle_fu", "nova": "vivian", "sage": "serena", "shimmer": "sohee",
                        "verse": "ryan", "marin": "ono_anna", "cedar": "uncle_fu"}
OPENAI_VOICES = tuple(OPENAI_VOICE_ALIASES)
# ElevenLabs' premade voices: (name, voice id, speaker)
ELEVENLABS_VOICES = (
    ("Rachel", "21m00Tcm4TlvDq8ikWAM", "serena"), ("Drew", "29vD33N1CtxCmqQRPOHJ", "ryan"),
    ("Clyde", "2EiwWnXFnvU5JabPnv8n", "uncle_fu"), ("Paul", "5Q0t7uMcjvnagumLfvZi", "ryan"),
    ("Aria", "9BWtsMINqrJLrRacOk9x", "vivian"), ("Domi", "AZnzlk1XvdvUeBnXmlld", "vivian"),
    ("Dave", "CYw3kZ02Hs0563khs1Fj", "aiden"), ("Roger", "CwhRBWXzGAHq8TQ4Fs17", "ryan"),
    ("Fin", "D38z5RcWu1voky8WS1ja", "uncle_fu"), ("Sarah", "EXAVITQu4vr4xnSDxMaL", "serena"),
    ("Antoni", "ErXwobaYiN019PkySvjV", "aiden"), ("Laura", "FGY2WhTYpPnrIDTdsKH5", "vivian"),
    ("Thomas", "GBv7mTt0atIp3Br8iCZE", "aiden"), ("Charlie", "IKne3meq5aSn9XLyUdCD", "aiden"),
    ("George", "JBFqnCBsd6RMkjVDRZzb", "uncle_fu"), ("Emily", "LcfcDJNUP1GQjkzn1xUU", "serena"),
    ("Elli", "MF3mGyEYCl7XYWbV9V6O", "sohee"), ("Callum", "N2lVS1w4EtoT3dr4eOWO", "ryan"),
    ("Patrick", "ODq5zmih8GrVes37Dizd", "ryan"), ("River", "SAz9YHcvj6GT2YYXdXww", "serena"),
    ("Harry", "SOYHLrjzK2X1ezoPC6cr", "ryan"), ("Liam", "TX3LPaxmHKxFdv7VOQHJ", "aiden"),
    ("Dorothy", "ThT5KcBeYPX3keUQqHPh", "sohee"), ("Josh", "TxGEqnHWrfWFTfGW9XjX", "uncle_fu"),
    ("Arnold", "VR6AewLTigWG4xSOukaG", "uncle_fu"), ("Charlotte", "XB0fDUnXU5powFXDhCwa", "serena"),
    ("Alice", "Xb7hH8MSUJpSbSDYk0k2", "vivian"), ("Matilda", "XrExE9yKIg1WjnnlVkGX", "serena"),
    ("James", "ZQe5CZNOzWyzPSCn5a3c", "uncle_fu"), ("Joseph", "Zlb1dXrM653N07WRdFW3", "ryan"),
    ("Will", "bIHbv24MWmeRgasZH58o", "aiden"), ("Jeremy", "bVMeCyTHy58xNoL34h3p", "aiden"),
    ("Jessica", "cgSgspJ2msm6clMCkdW9", "vivian"), ("Eric", "cjVigY5qzO86Huf0OWal", "ryan"),
    ("Michael", "flq6f7yk4E4fJM5XTYuZ", "uncle_fu"), ("Ethan", "g5CIjZEefAph4nQFvHAz", "aiden"),
    ("Chris", "iP95p4xoKVk53GoZ742B", "aiden"), ("Gigi", "jBpfuIE2acCO8z3wKNLl", "vivian"),
    ("Freya", "jsCqWAovK2LkecY7zXl4", "vivian"), ("Brian", "nPczCjzI2devNBz1zQrb", "uncle_fu"),
    ("Grace", "oWAxZDx7w5VEj9dCyTzz", "serena"), ("Daniel", "onwK4e9ZLuTAKqWW03F9", "uncle_fu"),
    ("Lily", "pFZP5JQG7iQjIQuC4Bku", "serena"), ("Serena", "pMsXgVXv3BLzUgSXRplE", "serena"),
    ("Adam", "pNInz6obpgDQGcFmaJgB", "ryan"), ("Nicole", "piTKgcLEGmPE4e6mEKli", "sohee"),
    ("Bill", "pqHfZKP75CvOlQylNhV4", "uncle_fu"), ("Jessie", "t0jbNlBVZ17f02VDIeMI", "aiden"),
    ("Sam", "yoZ06aMxZJJ28mfd3POQ", "aiden"), ("Glinda", "z9fAnlkpzviPz146aGWa", "sohee"),
    ("Giovanni", "zcAOhNBS3c14rBihAFp1", "ryan"), ("Mimi", "zrHiDhphv9ZnVXBqCLjz", "sohee"),
    ("Bella", "hpp4J3VqNfWAUOO0d1Us", "vivian"))
# DashScope's (Qwen-TTS) system voices but those named like a released speaker
DASHSCOPE_VOICE_ALIASES = {"Cherry": "vivian", "Ethan": "aiden", "Chelsie": "sohee", "Momo": "ono_anna",
                           "Moon": "ryan", "Maia": "serena", "Kai": "aiden", "Nofish": "ryan", "Bella": "vivian",
                           "Jennifer": "serena", "Katerina": "serena", "Elias": "uncle_fu", "Jada": "vivian",
                           "Sunny": "vivian", "Li": "uncle_fu", "Marcus": "uncle_fu", "Roy": "ryan", "Peter": "ryan",
                           "Rocky": "aiden", "Kiki": "sohee"}


def _in_order(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(alias, speaker) pairs → alias (lower-case) → speaker; a name given twice keeps its first place."""
    table: dict[str, str] = {}
    for alias, speaker in pairs:
        table.setdefault(alias.lower(), speaker)
    return table


# alias → its preferred speaker, in the order the fallback counts in
DEFAULT_VOICE_ALIASES = _in_order([*OPENAI_VOICE_ALIASES.items(), *((n, s) for n, _, s in ELEVENLABS_VOICES),
                                   *((i, s) for _, i, s in ELEVENLABS_VOICES), *DASHSCOPE_VOICE_ALIASES.items()])

# vendor model names that mean the primary served model (OpenAI's TTS models: names.OPENAI_TTS_MODELS)
DEFAULT_MODEL_ALIASES = (
    "eleven_multilingual_v2", "eleven_flash_v2_5", "eleven_turbo_v2_5", "eleven_v3", "eleven_flash_v2",
    "eleven_turbo_v2", "eleven_multilingual_v1", "eleven_monolingual_v1",
    "Ellipsis",   # the elevenlabs SDK's unset model_id, as its WebSocket helper writes it into the URL
    "qwen3-tts-*", "qwen-tts*",   # qwen3-tts-flash(-realtime), -instruct-, -vc-, -vd-, and the legacy qwen-tts
    "gpt-realtime*", "gpt-4o-realtime*", "gpt-4o-mini-realtime*")


def voice_alias_map(speakers: Sequence[str]) -> dict[str, str]:
    """Default alias → checkpoint speaker (names lower-case): the alias's preferred speaker when the checkpoint has
    it, else the i-th alias → the (i mod n)-th speaker in sorted order. Empty for a checkpoint without speakers; an
    alias named like a speaker is left out (the speaker's own name means it)."""
    ordered = sorted(speakers)
    if not ordered:
        return {}
    return {alias: preferred if preferred in ordered else ordered[i % len(ordered)]
            for i, (alias, preferred) in enumerate(DEFAULT_VOICE_ALIASES.items()) if alias not in ordered}


def matching_alias(name: str, aliases: Mapping[str, str] | Sequence[str]) -> str | None:
    """The alias of `aliases` that `name` is: itself, else the first `prefix*` it starts with."""
    if name in aliases:
        return name
    return next((alias for alias in aliases if alias.endswith("*") and name.startswith(alias[:-1])), None)


class AliasFile(msgspec.Struct, forbid_unknown_fields=True):
    """`--aliases FILE` (JSON or YAML): alias → voice (a speaker, or on a Base model an uploaded voice) and alias →
    served model name (a trailing `*` matches every name it starts)."""
    voices: dict[str, str] = {}
    models: dict[str, str] = {}


def load_aliases(path: str, model_type: str, speakers: Sequence[str], served: Sequence[str]) -> AliasFile:
    """The file's aliases, checked against the checkpoint (`model_type`, its `speakers`) and the served model names;
    ValueError, one line naming the file and the entry, for the first problem."""
    where = f"--aliases {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror}") from None
    decode = msgspec.yaml.decode if path.lower().endswith((".yaml", ".yml")) else msgspec.json.decode
    try:
        aliases = decode(raw, type=AliasFile)
    except msgspec.DecodeError as e:  # a YAML parser's message spans lines
        raise ValueError(f"{where}: {' '.join(str(e).split())}; expected {{\"voices\": {{alias: voice}}, "
                         f"\"models\": {{alias: served model name}}}}") from None
    lowered = [speaker.lower() for speaker in speakers]
    for kind, table, targets, taken in (("voices", aliases.voices, lowered, lowered),
                                        ("models", aliases.models, list(served), list(served))):
        for alias, target in table.items():
            label = f"{where}: {kind}[{alias!r}]"
            if not alias.strip() or any(unicodedata.category(c) == "Cc" for c in alias + target):
                raise ValueError(f"{label}: names must be non-empty and hold no control characters")
            if (alias.lower() if kind == "voices" else alias) in taken:
                raise ValueError(f"{label}: is a name of this server already (an alias cannot rename it)")
            if kind == "voices" and model_type != "custom_voice":
                continue   # a Base model's uploaded voices change while it serves: checked per request
            if (target.lower() if kind == "voices" else target) not in targets:
                what = "a speaker of this checkpoint" if kind == "voices" else "a served model name"
                raise ValueError(f"{label}: {target!r} is not {what}; available: {', '.join(targets)}")
    return aliases
