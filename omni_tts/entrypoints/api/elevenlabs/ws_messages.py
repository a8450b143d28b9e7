"""ElevenLabs' text-to-speech WebSockets (`stream-input`, `multi-stream-input`): the query parameters, the client's
messages (one shape: a message is what its fields say) as the `elevenlabs` SDK, Pipecat and LiveKit send them, the
error message they read, and the two routes' /openapi.json operations."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from omni_tts.entrypoints.api.schema import (MAX_PRONUNCIATION_LOCATORS, ApiError, Name, PronunciationLocator,
                                           SpeechOptions, decode_json)

from .tts_request import LANGUAGES, VoiceSettings, output_format, renamed

MAX_CONTEXT_ID_CHARS = 128
# query parameters with no meaning here, accepted and named as ignored (the rest: StreamParams' own docs)
IGNORED_PARAMS = ("enable_logging", "enable_ssml_parsing", "apply_text_normalization", "auto_mode",
                  "optimize_streaming_latency")


class StreamParams(msgspec.Struct, kw_only=True):
    """The socket's query parameters, read as the REST routes read theirs (tts_request.py). model_id: a served name
    or an alias (ElevenLabs' model names; the SDK writes `Ellipsis` for none); sync_alignment: alignment always
    follows the audio it times (context_alignment.py); inactivity_timeout: seconds without a message (or audio going
    out) before the socket closes."""
    output_format: str | None = None
    language_code: Name | None = None
    inactivity_timeout: Annotated[float, msgspec.Meta(gt=0, le=180)] = 20.0
    seed: int | None = None
    sync_alignment: bool = False
    model_id: str | None = None
    enable_logging: bool = True
    enable_ssml_parsing: bool = False
    apply_text_normalization: Literal["auto", "on", "off"] = "auto"
    auto_mode: bool = False
    optimize_streaming_latency: int | None = None
    authorization: str | None = None   # the API key (auth.py)

    def speech_options(self, voice_id: str, locators: list[PronunciationLocator] | None) -> SpeechOptions:
        """The session's SpeechOptions: our voice and model by the path's voice_id and model_id (an alias, or our
        own name), the format and rate, language, seed and the init's pronunciation dictionaries; the server's
        sampling defaults otherwise (ElevenLabs has no sampling fields)."""
        response_format, sample_rate, _ = output_format(self.output_format)
        language = LANGUAGES.get(self.language_code.lower(), self.language_code) if self.language_code else None
        fields = dict(voice=voice_id, model=self.model_id, response_format=response_format, sample_rate=sample_rate,
                      language=language, seed=self.seed,
                      pronunciation_dictionary_locators=msgspec.to_builtins(locators))
        return _convert({name: value for name, value in fields.items() if value is not None}, SpeechOptions)

    def ignored(self) -> list[str]:
        """The ignored parameters the client set to other than their defaults, and an output_format's bit rate other
        than our encoder's."""
        defaults = StreamParams()
        return ([name for name in IGNORED_PARAMS if getattr(self, name) != getattr(defaults, name)]
                + output_format(self.output_format)[2])


def stream_params(query: dict[str, str]) -> StreamParams:
    """The query → StreamParams (ApiError 400 naming the parameter); parameters not listed are ignored."""
    return _convert({name: value for name, value in query.items() if name in StreamParams.__struct_fields__},
                    StreamParams)


def _convert(values: dict, type_: type) -> object:
    """Query strings into `type_`, its ranges checked (ApiError 400 naming ElevenLabs' parameter)."""
    try:
        return msgspec.convert(values, type_, strict=False)
    except msgspec.ValidationError as e:
        raise renamed(ApiError(400, f"invalid query parameter: {e}", str(e).rpartition("$.")[2].rstrip("`") or None)
                      ) from None


class GenerationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Accepted and ignored: text streams into the talker as it comes (README)."""
    chunk_length_schedule: Annotated[list[Annotated[float, msgspec.Meta(ge=50, le=500)]],
                                     msgspec.Meta(max_length=64)] | None = None


class ClientMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Every message a client sends, one shape: init (the first, or a context's first; `text` a blank, settings, the
    pronunciation dictionaries, which apply from it on, and the key), text, flush,
    close_context, close_socket, keep-alive (`text` empty in multi-stream; end of input in stream-input)."""
    text: str | None = None
    context_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CONTEXT_ID_CHARS)] | None = None
    flush: bool = False
    try_trigger_generation: bool = False
    close_context: bool = False
    close_socket: bool = False
    voice_settings: VoiceSettings | None = None
    generation_config: GenerationConfig | None = None
    generator_config: GenerationConfig | None = None   # SendText's spelling in the SDK
    pronunciation_dictionary_locators: Annotated[
        list[PronunciationLocator], msgspec.Meta(max_length=MAX_PRONUNCIATION_LOCATORS)] | None = None
    xi_api_key: str | None = None
    xi_api_key_dash: str | None = msgspec.field(default=None, name="xi-api-key")   # the SDK's spelling
    authorization: str | None = None

    @property
    def api_key(self) -> str | None:
        return self.xi_api_key or self.xi_api_key_dash or self.authorization

    @property
    def initializes(self) -> bool:
        """It carries settings or the key (an init's fields; some clients send the key alone first)."""
        return (self.api_key is not None or self.voice_settings is not None or self.generation_config is not None
                or self.pronunciation_dictionary_locators is not None)

    def ignored(self) -> list[str]:
        """The fields it set that mean nothing here (a speed other than 1 included: a streamed response keeps the
        model's pace)."""
        settings = self.voice_settings
        names = [] if settings is None else [f"voice_settings.{name}" for name in VoiceSettings.__struct_fields__
                                             if getattr(settings, name) not in (None, 1.0 if name == "speed" else None)]
        if (self.generation_config or self.generator_config) is not None:
            names.append("generation_config")
        if self.try_trigger_generation:
            names.append("try_trigger_generation")
        return names


def decode_message(data: str) -> ClientMessage:
    """ApiError 400 naming the field for what is not one of the protocol's messages."""
    message = decode_json(data, ClientMessage, "the message")
    if message.text is None and not (message.flush or message.close_context or message.close_socket
                                     or message.initializes):
        raise ApiError(400, "the message is none of the protocol's: text, flush, close_context, close_socket, or "
                            "settings and the key")
    return message


def error_message(error: ApiError, context_id: str | None = None) -> dict:
    """The error a client reads before the close: the SDK raises on `message`, LiveKit logs `error`."""
    ids = {} if context_id is None else {"contextId": context_id, "context_id": context_id}
    return {"message": error.message, "error": error.code, "code": error.status, "param": error.param} | ids


# /openapi.json: the two routes as the GETs they are before their upgrade (a plain request gets its 400, in
# ElevenLabs' error body: errors.elevenlabs_body)
_ERROR_BODY = {"type": "object", "required": ["detail"], "properties": {"detail": {
    "type": "object", "required": ["status", "message"],
    "properties": {"status": {"type": "string"}, "message": {"type": "string"}}}}}


def _socket_operation(operation_id: str, summary: str) -> dict:
    return {
        "operationId": operation_id, "summary": summary,
        "description": (
            "Upgrade this GET to a WebSocket (ElevenLabs' protocol; README, 'ElevenLabs'). The voice_id is one of "
            "our voices; the query parameters are ElevenLabs' (output_format, language_code, inactivity_timeout, "
            "seed, ...). The client sends JSON text messages (an init with text ' ' first, then text, flush, "
            "close_context, close_socket); the server sends audio messages (base64 in output_format, with "
            "character alignment where the server has a forced aligner), isFinal, and on an error a message "
            "{message, error, code} before a non-1000 close. The API key may also come as the authorization "
            "query parameter or xi_api_key in the first message."),
        "parameters": [{"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {
            "101": {"description": "Switching Protocols: the session runs over the WebSocket"},
            "400": {"description": "not a WebSocket upgrade request",
                    "content": {"application/json": {"schema": _ERROR_BODY}}}}}


def openapi_paths() -> dict:
    """The two routes' operations, made anew for each document (it adds to them: a keyed server's 401)."""
    return {
        "/v1/text-to-speech/{voice_id}/stream-input": {"get": _socket_operation(
            "elevenlabsStreamInput", "ElevenLabs' text-to-speech WebSocket, one context")},
        "/v1/text-to-speech/{voice_id}/multi-stream-input": {"get": _socket_operation(
            "elevenlabsMultiStreamInput", "ElevenLabs' multi-context text-to-speech WebSocket")},
    }
