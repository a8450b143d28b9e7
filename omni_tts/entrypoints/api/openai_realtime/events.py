"""The client events of the OpenAI Realtime API (GA) that a server reading text aloud takes, as the `openai` SDK sends
them (types/realtime/*_param.py), decoded once each; their errors are `ApiError`s that the connection sends as
`error` events (`error_event`).

Fields the SDK sends that mean nothing here (tools, tracing, audio input, ...) are read as raw JSON, echoed back in
the session and named as ignored; `temperature` (the beta session's field) is an extension: 0 speaks greedily.
"""
from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

import msgspec

from omni_tts.entrypoints.api.schema import ApiError, Name, Text, VoiceId, decode_json
from omni_tts.models.qwen3_tts.sampling_params import Temperature

# OpenAI's bounds: max_output_tokens 1..4096 or "inf", speed 0.25..1.5, 16 metadata pairs
OutputTokens = Annotated[int, msgspec.Meta(ge=1, le=4096)] | Literal["inf"]
Speed = Annotated[float, msgspec.Meta(ge=0.25, le=1.5)]
MAX_CONTENT_PARTS = 64
MAX_INPUT_ITEMS = 64


class AudioFormat(msgspec.Struct):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: Literal[24000] | None = None   # audio/pcm's only rate


class AudioOutput(msgspec.Struct):
    format: AudioFormat | None = None
    voice: Name | VoiceId | None = None
    speed: Speed | None = None


class SessionAudio(msgspec.Struct):
    input: Any = None     # audio input: echoed, unused
    output: AudioOutput | None = None


class SessionFields(msgspec.Struct, kw_only=True):
    """session.update's `session`; None: unchanged. The raw fields are echoed and named as ignored."""
    type: Literal["realtime"] | None = None
    model: Name | None = None
    output_modalities: list[Literal["audio", "text"]] | None = None
    instructions: Text | None = None
    audio: SessionAudio | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: Temperature | None = None   # extension
    tools: Any = None
    tool_choice: Any = None
    tracing: Any = None
    truncation: Any = None
    prompt: Any = None
    include: Any = None


IGNORED_SESSION_FIELDS = ("tools", "tool_choice", "tracing", "truncation", "prompt", "include")


class ContentPart(msgspec.Struct, omit_defaults=True):
    type: Name   # input_text (spoken), input_audio (refused), output_text / text / output_audio (kept)
    text: Text | None = None
    transcript: Text | None = None


class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: Name | None = None
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_CONTENT_PARTS)]


class ItemReference(msgspec.Struct, tag="item_reference", tag_field="type"):
    id: Name


class ResponseAudio(msgspec.Struct):
    output: AudioOutput | None = None


class ResponseFields(msgspec.Struct, kw_only=True):
    """response.create's `response`: overrides of the session for this response, and which text it speaks."""
    conversation: Literal["auto", "none"] = "auto"   # "none": out of band, the conversation left as it is
    input: Annotated[list[MessageItem | ItemReference], msgspec.Meta(max_length=MAX_INPUT_ITEMS)] | None = None
    instructions: Text | None = None
    audio: ResponseAudio | None = None
    output_modalities: list[Literal["audio", "text"]] | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: Temperature | None = None   # extension
    metadata: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)],
                             Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=16)] | None = None


class SessionUpdate(msgspec.Struct, tag="session.update", tag_field="type"):
    session: SessionFields
    event_id: Name | None = None


class ItemCreate(msgspec.Struct, tag="conversation.item.create", tag_field="type"):
    item: MessageItem
    previous_item_id: Name | None = None
    event_id: Name | None = None


class ItemDelete(msgspec.Struct, tag="conversation.item.delete", tag_field="type"):
    item_id: Name
    event_id: Name | None = None


class ItemRetrieve(msgspec.Struct, tag="conversation.item.retrieve", tag_field="type"):
    item_id: Name
    event_id: Name | None = None


class ResponseCreate(msgspec.Struct, tag="response.create", tag_field="type"):
    response: ResponseFields | None = None
    event_id: Name | None = None


class ResponseCancel(msgspec.Struct, tag="response.cancel", tag_field="type"):
    response_id: Name | None = None
    event_id: Name | None = None


ClientEvent = SessionUpdate | ItemCreate | ItemDelete | ItemRetrieve | ResponseCreate | ResponseCancel
EVENT_TYPES = tuple(event.__struct_config__.tag for event in ClientEvent.__args__)


class EventHead(msgspec.Struct):
    """Any event's type and id, read before the event itself (for the error's event_id)."""
    type: Name = ""
    event_id: Name | None = None


def decode_event(text: str, head: EventHead) -> ClientEvent:
    """`text`, whose head is `head`, as its event: ApiError naming the field, or the type when it is not one the
    server takes (audio input is refused by name)."""
    if head.type.startswith("input_audio_buffer."):
        raise ApiError(400, "audio input not supported: this server reads text aloud; send conversation.item.create "
                            "with input_text", "type", "audio_input_not_supported")
    if head.type not in EVENT_TYPES:
        raise ApiError(400, f"unknown event type '{head.type}'; this server takes {', '.join(EVENT_TYPES)}", "type",
                       "unknown_event")
    return decode_json(text, ClientEvent, "the event")


def decode_head(text: str) -> EventHead:
    return decode_json(text, EventHead, "the event")


def session_keys(text: str) -> list[str]:
    """The top-level fields of a session.update's `session`, in their order (to name the unknown ones)."""
    raw = msgspec.json.decode(text, type=dict[str, msgspec.Raw])
    session = raw.get("session")
    return list(msgspec.json.decode(session, type=dict[str, msgspec.Raw])) if session is not None else []


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: `evt_…`, `sess_…`, `item_…`, `resp_…`."""
    return f"{prefix}_{secrets.token_hex(10)}"


def error_event(error: ApiError, client_event_id: str | None) -> dict:
    return {"type": "error", "event_id": new_id("event"),
            "error": {"type": error.type, "code": error.code, "message": error.message, "param": error.param,
                      "event_id": client_event_id}}
