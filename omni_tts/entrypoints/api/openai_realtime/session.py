"""One Realtime session's effective configuration: what `session.update` set, the speech options a response gets
from it (with the response's own overrides), and the `session` object the server echoes.

`instructions` are a style prompt (Qwen3-TTS's instruct, where the checkpoint takes one): their sentences that ask
to read the text verbatim (--realtime-verbatim-pattern) are dropped first, since reading verbatim is all this server
does; on a checkpoint without instructions (Base, 0.6B CustomVoice) they are named as ignored.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import msgspec

from omni_tts.entrypoints.api.schema import ApiError, SpeechOptions, VoiceId
from omni_tts.models.qwen3_tts.sampling_params import MIN_NEW_TOKENS

from ..state import ServerState
from .events import (IGNORED_SESSION_FIELDS, AudioFormat, AudioOutput, ResponseFields, SessionAudio, SessionFields,
                     new_id)

OUR_FORMATS = {"audio/pcm": "pcm", "audio/pcmu": "ulaw", "audio/pcma": "alaw"}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def style_prompt(state: ServerState, instructions: str | None, model: str | None) -> tuple[str | None, bool]:
    """What `instructions` make of a response's style on `model`: (the style prompt, whether instructions were left
    that the checkpoint cannot take). Sentences the verbatim pattern matches are dropped; None when nothing is
    left."""
    if not instructions:
        return None, False
    verbatim = re.compile(state.config.realtime_verbatim_pattern, re.IGNORECASE)
    kept = [s for s in SENTENCE_END.split(instructions.strip()) if s and not (verbatim.pattern and verbatim.search(s))]
    style = " ".join(kept) or None
    served = state.config.served_model(model) if model else None   # an unknown model is refused with the speech
    takes = (state.models[state.config.model_of(served)] if served else state.default_model).takes_instructions
    return (style, False) if takes or style is None else (None, True)


def overlay(base: AudioOutput | None, top: AudioOutput | None) -> AudioOutput:
    """`base` with the fields `top` sets."""
    base = base or AudioOutput()
    if top is None:
        return base
    return msgspec.structs.replace(base, **{name: value for name in AudioOutput.__struct_fields__
                                            if (value := getattr(top, name)) is not None})


def format_json(format: AudioFormat) -> dict:
    return {"type": format.type, "rate": 24000} if format.type == "audio/pcm" else {"type": format.type}


def voice_json(voice: str | VoiceId | None) -> str | dict | None:
    return {"id": voice.id} if isinstance(voice, VoiceId) else voice


@dataclass(frozen=True)
class RealtimeSession:
    """What session.update set (merged over the updates), read by each response."""
    model: str
    id: str = field(default_factory=lambda: new_id("sess"))
    fields: SessionFields = field(default_factory=SessionFields)   # what the client set, merged over updates
    unknown: list[str] = field(default_factory=list)   # top-level fields this server does not know, last update's

    def updated(self, update: SessionFields, unknown: list[str]) -> RealtimeSession:
        """The session with `update` merged over it: absent fields keep their value, audio.output's each on its
        own."""
        if update.output_modalities is not None:
            check_modalities(update.output_modalities, "session.output_modalities")
        old = self.fields
        fields = msgspec.structs.replace(old, **{name: value for name in update.__struct_fields__
                                                 if (value := getattr(update, name)) is not None})
        if update.audio is not None:
            old_audio = old.audio or SessionAudio()
            fields = msgspec.structs.replace(fields, audio=SessionAudio(
                input=update.audio.input if update.audio.input is not None else old_audio.input,
                output=overlay(old_audio.output, update.audio.output)))
        return dataclasses.replace(self, fields=fields, unknown=unknown)

    def output(self, response: ResponseFields | None) -> AudioOutput:
        """A response's audio output: the session's, with the response's own fields over it (pcm by default)."""
        session = overlay(AudioOutput(format=AudioFormat("audio/pcm")), self.fields.audio.output if self.fields.audio
                          else None)
        return overlay(session, response.audio.output if response and response.audio else None)

    def speech_options(self, state: ServerState, response: ResponseFields | None) -> tuple[SpeechOptions, list[str]]:
        """A response's speech options and the fields it ignores (named in the log and the echo)."""
        output, fields = self.output(response), self.fields
        if response is not None and response.output_modalities is not None:
            check_modalities(response.output_modalities, "response.output_modalities")
        instructions = response.instructions if response and response.instructions is not None else fields.instructions
        tokens = response.max_output_tokens if response and response.max_output_tokens is not None else \
            fields.max_output_tokens
        temperature = response.temperature if response and response.temperature is not None else fields.temperature
        ignored = self.ignored(state)
        style, unused = style_prompt(state, instructions, fields.model or self.model)
        if unused and "instructions" not in ignored:
            ignored.append("instructions")
        # the model the client named (an alias, e.g. gpt-realtime-2.1-mini, stands for the served one: names.py)
        options = SpeechOptions(model=fields.model or self.model or None, voice=output.voice,
                                response_format=OUR_FORMATS[output.format.type], instructions=style,
                                temperature=temperature,
                                max_new_tokens=None if tokens in (None, "inf") else max(tokens, MIN_NEW_TOKENS))
        return options, ignored

    def ignored(self, state: ServerState) -> list[str]:
        """The session's fields that change nothing here: the unknown ones, the echoed ones, a speed (audio streams:
        time-stretching needs the whole utterance), the instructions a checkpoint cannot take."""
        fields = self.fields
        names = [*self.unknown, *(name for name in IGNORED_SESSION_FIELDS if getattr(fields, name) is not None)]
        if fields.audio is not None and fields.audio.input is not None:
            names.append("audio.input")
        speed = self.output(None).speed
        if speed is not None and speed != 1.0:
            names.append("audio.output.speed")
        if style_prompt(state, fields.instructions, fields.model or self.model)[1]:
            names.append("instructions")
        return names

    def echo(self, state: ServerState) -> dict:
        """The effective session, as session.created and session.updated carry it; `omni_tts` says what its
        instructions became and which fields change nothing."""
        fields, output = self.fields, self.output(None)
        session = {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": fields.model or self.model,
            "output_modalities": fields.output_modalities or ["audio"], "instructions": fields.instructions or "",
            "audio": {"input": fields.audio.input if fields.audio and fields.audio.input is not None else None,
                      "output": {"format": format_json(output.format),
                                 "voice": voice_json(output.voice) or state.voice_names.default,
                                 "speed": output.speed or 1.0}},
            "max_output_tokens": fields.max_output_tokens or "inf", "tools": [], "tool_choice": "auto",
            "tracing": None, "truncation": "auto", "prompt": None, "include": None,
            "omni_tts": {"style_instructions": style_prompt(state, fields.instructions, fields.model or self.model)[0],
                         "ignored_fields": self.ignored(state)}}
        if fields.temperature is not None:
            session["temperature"] = fields.temperature
        session.update({name: getattr(fields, name) for name in IGNORED_SESSION_FIELDS
                        if getattr(fields, name) is not None})
        return session


def check_modalities(modalities: list[str], param: str) -> None:
    if "audio" not in modalities:
        raise ApiError(400, "output_modalities must include 'audio': this server reads text aloud", param)
