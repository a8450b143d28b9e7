"""Qwen-TTS Realtime's messages: the client's events as msgspec Structs (tagged by `type`), and the server's as the
JSON objects DashScope sends (../shared/docs/protocols.md §1.4), each with its own `event_id`."""
from __future__ import annotations

import uuid

import msgspec

from omni_tts.entrypoints.api.schema import ApiError

from ..errors import dashscope_body

REALTIME_PATH = "/api-ws/v1/realtime"
MAX_MESSAGE_BYTES = 64 * 2**10   # a text piece or a session.update (instructions of MAX_TEXT_CHARS fit, escaped)


class ClientEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    event_id: str | None = None


class SessionUpdate(ClientEvent, tag="session.update"):
    session: msgspec.Raw   # read by qwen_fields.QwenSession (unknown fields ignored and named)


class TextAppend(ClientEvent, tag="input_text_buffer.append"):
    text: str


class TextCommit(ClientEvent, tag="input_text_buffer.commit"):
    pass


class TextClear(ClientEvent, tag="input_text_buffer.clear"):
    pass


class ResponseCancel(ClientEvent, tag="response.cancel"):
    pass


class SessionFinish(ClientEvent, tag="session.finish"):
    pass


ClientEvents = SessionUpdate | TextAppend | TextCommit | TextClear | ResponseCancel | SessionFinish
EVENT_TYPES = tuple(event.__struct_config__.tag for event in (SessionUpdate, TextAppend, TextCommit, TextClear,
                                                               ResponseCancel, SessionFinish))


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def event(type_: str, **fields: object) -> dict:
    return {"event_id": new_id("event"), "type": type_, **fields}


def error_event(error: ApiError) -> dict:
    """DashScope's error event: bad input is `invalid_value` (its code for it), anything else DashScope's HTTP code
    for the status (Throttling, ServiceUnavailable, InternalError)."""
    code = "invalid_value" if error.status == 400 else dashscope_body(error, "")["code"]
    return event("error", error={"code": code, "message": error.message, "type": error.type, "param": error.param})


class ResponseEvents:
    """The events of one response, in §1.5's order: created, output_item.added, content_part.added, audio.delta*,
    audio.done, content_part.done, output_item.done, done."""

    def __init__(self, voice: str | None) -> None:
        self.id, self.item_id, self.voice = new_id("resp"), new_id("item"), voice

    def _in_item(self) -> dict:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _item(self, status: str, content: list) -> dict:
        return {"id": self.item_id, "object": "realtime.item", "type": "message", "status": status,
                "role": "assistant", "content": content}

    def opening(self) -> list[dict]:
        return [
            event("response.created", response={"id": self.id, "object": "realtime.response", "conversation_id": "",
                                                "status": "in_progress", "voice": self.voice, "output": []}),
            event("response.output_item.added", response_id=self.id, output_index=0,
                  item=self._item("in_progress", [])),
            event("response.content_part.added", **self._in_item(), part={"type": "audio", "text": ""})]

    def delta(self, audio_base64: str) -> dict:
        return event("response.audio.delta", **self._in_item(), delta=audio_base64)

    def closing(self, characters: int, cancelled: bool = False) -> list[dict]:
        """completed, or (response.cancel) `incomplete` with the reason `cancelled` in OpenAI Realtime's
        `status_details`, the status DashScope's own enum allows."""
        status = "incomplete" if cancelled else "completed"
        response = {"id": self.id, "object": "realtime.response", "conversation_id": "", "status": status,
                    "modalities": ["text", "audio"], "voice": self.voice,
                    "output": [self._item(status, [{"type": "audio", "transcript": ""}])],
                    "usage": {"characters": characters}}
        if cancelled:
            response["status_details"] = {"type": "incomplete", "reason": "cancelled"}
        return [
            event("response.audio.done", **self._in_item()),
            event("response.content_part.done", **self._in_item(), part={"type": "audio", "text": ""}),
            event("response.output_item.done", response_id=self.id, output_index=0,
                  item=self._item(status, [{"type": "audio", "text": ""}])),
            event("response.done", response=response)]
