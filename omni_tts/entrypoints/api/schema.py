"""The HTTP API's request schemas (OpenAI `CreateSpeechRequest` + Qwen3-TTS extensions; the voice routes' are in
voice_schema.py), their decoding, and the error envelope.

Wrong types and out-of-range values are `ApiError`s (HTTP 400) naming the field, before anything is admitted. A
speech request's fields are read the way vLLM reads extra fields: `speaker` is another name for `voice` (vllm-omni's),
and a field we do not know is ignored and named back to the client (`decode_speech_options`), unless the server
runs with --strict-fields, where it is a 400 as in OpenAI's schema.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal, get_args, get_origin

import msgspec

from omni_tts.audio.pcm import FORMATS
from omni_tts.audio.resample import SAMPLE_RATES
from omni_tts.audio.speed import MAX_SPEED, MIN_SPEED
from omni_tts.config.settings import MAX_INPUT_CHARS, MAX_PAUSE_MS, NarrationSettings
from omni_tts.config.stage_config import InitialChunkFrames
from omni_tts.voices.store import MAX_EMBEDDING_VALUES, MAX_REF_TEXT_CHARS
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams

# OpenAI's input limit, for every text field but a speech request's input: it also bounds the tokenizer's time per
# request (one thread serves all requests); the talker's limits in tokens are checked when the request is tokenized
MAX_TEXT_CHARS = 4096
MAX_NAME_CHARS = 256  # model, voice and language names: error messages quote them
ResponseFormat = Literal[FORMATS]
JSON_RESPONSE = "json"
SampleRate = Literal[SAMPLE_RATES]  # which rates each format takes: audio/encoding.output_sample_rate
REPLICA_HEADER = "x-omni-tts-replica"   # serve-ray: the replica that served a speech request


class ApiError(Exception):
    """An error answered with the OpenAI envelope {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request", 404: "not_found", 408: "request_timeout",
                             413: "payload_too_large", 415: "unsupported_media_type", 422: "unprocessable",
                             429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "server_error")
        self.type = type_ or ("invalid_request_error" if status < 500 and status != 429 else
                              "rate_limit_error" if status == 429 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
RefText = Annotated[str, msgspec.Meta(max_length=MAX_REF_TEXT_CHARS)]  # a clip's transcript, uploaded or sent
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
# a speaker encoder's x-vector; its length and values are checked against the served checkpoint
# (models/qwen3_tts/prompt.check_speaker_embedding)
Embedding = Annotated[list[float], msgspec.Meta(max_length=MAX_EMBEDDING_VALUES)]


class VoiceId(msgspec.Struct, forbid_unknown_fields=True):
    id: Name


MAX_PRONUNCIATION_LOCATORS = 3   # ElevenLabs' limit per request


class PronunciationLocator(msgspec.Struct, forbid_unknown_fields=True):
    """An uploaded pronunciation dictionary (api/pronunciation/), at a version (None: its latest)."""
    pronunciation_dictionary_id: Name
    version_id: Name | None = None


class SpeechOptions(SamplingParams, forbid_unknown_fields=True, kw_only=True):
    """Everything of a speech request but its text and how the HTTP response streams: what a WebSocket session
    configures once for all its utterances. The sampling fields (max_new_tokens, seed, temperature, ...) and their
    ranges are SamplingParams', so the schema states them and they fail before admission."""
    # OpenAI (model is required there; absent here it means the served model, as in vllm-omni)
    model: Name | None = None
    voice: Name | VoiceId | None = None
    instructions: Text | None = None
    response_format: ResponseFormat = "mp3"
    sample_rate: SampleRate | None = None   # None: the model's 24000 (G.711: 8000)
    speed: Annotated[float, msgspec.Meta(ge=MIN_SPEED, le=MAX_SPEED)] = 1.0
    # Qwen3-TTS extensions
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    language: Name | None = None
    ref_audio: str | None = None
    ref_text: RefText | None = None
    x_vector_only_mode: bool = False
    speaker_embedding: Embedding | None = None   # the voice as an x-vector (Base; x-vector-only mode)
    non_streaming_mode: bool | None = None
    initial_codec_chunk_frames: InitialChunkFrames | None = None
    word_timestamps: bool = False   # each word's start and end (the forced aligner: --forced-aligner)
    # a narrated input (longer than one segment): silence between its segments, and the segment it starts from (a
    # cut narration resumed: the tail of the same audio)
    sentence_pause_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_PAUSE_MS)] = NarrationSettings.sentence_pause_ms
    paragraph_pause_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_PAUSE_MS)] = NarrationSettings.paragraph_pause_ms
    start_segment: Annotated[int, msgspec.Meta(ge=0)] = 0
    # ElevenLabs': uploaded dictionaries whose alias rules apply to the text, before the voice's and the server's
    pronunciation_dictionary_locators: Annotated[
        list[PronunciationLocator], msgspec.Meta(max_length=MAX_PRONUNCIATION_LOCATORS)] | None = None

    @property
    def voice_name(self) -> str | None:
        name = self.voice.id if isinstance(self.voice, VoiceId) else self.voice
        return name.strip() if name and name.strip() else None


class SpeechRequest(SpeechOptions, kw_only=True):
    """POST /v1/audio/speech. response_format `json`: one JSON body with the audio (WAV, base64) and, with
    word_timestamps, its words' times. An input longer than one segment is narrated (api/narrated_speech.py)."""
    input: Annotated[str, msgspec.Meta(max_length=MAX_INPUT_CHARS)]
    response_format: Literal[(*FORMATS, JSON_RESPONSE)] = "mp3"
    stream_format: Literal["audio", "sse"] | None = None
    stream: bool = False          # vllm-omni's switch: alone it means SSE; stream_format "audio" streams raw audio

    @property
    def streaming(self) -> bool:
        return self.stream or self.stream_format is not None


MAX_BATCH_ITEMS = 32
MAX_BATCH_AUDIO_BYTES = 64 * 2**20   # a batch's files together, before base64; each item gets an equal share


class SpeechBatchRequest(SpeechOptions, kw_only=True):
    """POST /v1/audio/speech/batch: `items`, each a /v1/audio/speech body that asks for a whole file; the other
    fields are defaults that an item's own fields override; response_format is wav by default, as vllm-omni's batch
    route has it (OpenAI has none)."""
    response_format: ResponseFormat = "wav"
    items: Annotated[list[dict[str, msgspec.Raw]], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


# --- WS /v1/audio/speech/stream: client messages (vllm-omni's protocol) ---------------------------------------
class SessionConfig(SpeechOptions, tag="session.config", tag_field="type"):
    """The first message (and again between utterances): the speech fields but `input`, plus how text is cut
    into requests. token: one request per utterance, its text growing while it runs (audio equal to the whole
    text's in the streaming layout); sentence / clause: one request per sentence or clause; none: the utterance,
    of any length, narrated when it ends (a request per segment, pipelined)."""
    response_format: ResponseFormat = "wav"
    split_granularity: Literal["token", "sentence", "clause", "none"] = "token"
    stream_audio: bool = False                # audio in binary frames as it is made, else whole per request
    # vllm-omni's names for token mode: token_level (text joins the request as it arrives) and sentence_commit (text
    # joins it at each input.commit, acknowledged by input.committed)
    streaming_mode: Literal["token_level", "sentence_commit"] | None = None
    # how the audio travels: binary frames, or vllm-omni's audio.chunk events (base64 in JSON, each request's words in
    # its last one); None: vllm-omni's rule, audio.chunk events for word_timestamps over streamed pcm
    audio_frames: Literal["binary", "json"] | None = None

    @property
    def audio_in_json(self) -> bool:
        if self.audio_frames is not None:
            return self.audio_frames == "json"
        return self.word_timestamps and self.stream_audio and self.response_format == "pcm"


class InputText(msgspec.Struct, forbid_unknown_fields=True, tag="input.text", tag_field="type"):
    text: str


class InputCommit(msgspec.Struct, forbid_unknown_fields=True, tag="input.commit", tag_field="type"):
    """streaming_mode sentence_commit: the text sent since the last commit joins the utterance's request; in the
    other modes the text has joined already. Either way answered by input.committed, which echoes `commit_id`
    (vllm-omni's: the client's name for the commit)."""
    commit_id: str | None = None


class InputDone(msgspec.Struct, forbid_unknown_fields=True, tag="input.done", tag_field="type"):
    """Ends the utterance; the session stays open for the next."""


class SessionClose(msgspec.Struct, forbid_unknown_fields=True, tag="session.close", tag_field="type"):
    pass


class InputCancel(msgspec.Struct, forbid_unknown_fields=True, tag="input.cancel", tag_field="type"):
    """Barge-in: the utterance in progress stops at once (its requests aborted, its slot freed) and what was sent
    before this message and not yet handled is dropped; answered by input.cancelled. The session stays open."""


ClientMessage = SessionConfig | InputText | InputCommit | InputDone | SessionClose | InputCancel


class MessageType(msgspec.Struct):
    """A client message's type alone (its other fields are read by its own Struct)."""
    type: str = ""


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def _invalid(error: msgspec.ValidationError, what: str, type_: type) -> ApiError:
    """A msgspec validation error in `what` → ApiError(400) naming the field."""
    text = str(error)
    match = _PATH.search(text)
    param = match.group(1).split(".")[0].split("[")[0] if match and match.group(1) else None
    if param is None and text.startswith("Expected `object`"):
        return ApiError(400, f"{what} must be a JSON object")
    if text.startswith("Object contains unknown field"):
        field = re.search(r"field `([^`]*)`", text)
        param = field.group(1) if field else param
        return ApiError(400, f"unknown field '{param}'", param)
    if text.startswith("Object missing required field"):
        field = re.search(r"field `([^`]*)`", text)
        param = field.group(1) if field else param
        return ApiError(400, f"missing required field '{param}'", param)
    message = _PATH.sub("", text).strip().rstrip("-").strip()
    accepted = _literal_values(type_, param) if text.startswith("Invalid enum value") else None
    if accepted:
        message += f"; expected one of {', '.join(map(str, accepted))}"
    return ApiError(400, f"invalid '{param}': {message}" if param else message, param)


def _literal_values(type_: type, field: str | None) -> tuple | None:
    """The values, in their declared order, that a Literal field of `type_` (a Struct or a union of them) takes."""
    for struct in get_args(type_) or (type_,):
        for f in msgspec.structs.fields(struct):
            if f.encode_name == field:
                literal = next((t for t in (f.type, *get_args(f.type)) if get_origin(t) is Literal), None)
                return get_args(literal) if literal is not None else None
    return None


FIELD_ALIASES = {"speaker": "voice"}   # vllm-omni's names for our fields
IGNORED_FIELDS_HEADER = "x-omni-tts-ignored-fields"
MAX_NAMED_FIELDS, MAX_FIELD_NAME_CHARS = 16, 64


def describe_fields(names: list[str]) -> str:
    """Field names a client sent, for a header and a log line: ASCII with escapes (a name may hold control
    characters), each cut to MAX_FIELD_NAME_CHARS, at most MAX_NAMED_FIELDS of them."""
    shown = [json.dumps(name[:MAX_FIELD_NAME_CHARS])[1:-1] for name in names[:MAX_NAMED_FIELDS]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", and {more} more" if more else "")


def decode_speech_request(body: bytes, strict: bool = False) -> tuple[SpeechRequest, list[str]]:
    """JSON body → (SpeechRequest, the fields ignored), or ApiError(400) naming the field."""
    return decode_speech_options(body, SpeechRequest, strict)


def decode_speech_options(body: bytes | str, type_: type, strict: bool,
                          what: str = "request body") -> tuple[SpeechOptions, list[str]]:
    """A JSON object → (`type_`, a SpeechOptions, and the names of the fields ignored, in their order): aliases
    renamed (a field given under both names, differently, is a 400), unknown fields dropped, or a 400 when
    `strict`. The values are decoded once, by `type_`, so a bad value's error is the same whatever else was sent."""
    fields = set(type_.__struct_fields__)
    if type_.__struct_config__.tag:
        fields.add(type_.__struct_config__.tag_field)
    raw = decode_json(body, dict[str, msgspec.Raw], what)
    renamed = False
    for alias, name in FIELD_ALIASES.items():
        if alias in raw:
            if name in raw and bytes(raw[name]) != bytes(raw[alias]):
                raise ApiError(400, f"'{alias}' is another name for '{name}': give one of them", alias)
            raw[name] = raw.pop(alias)
            renamed = True
    ignored = [key for key in raw if key not in fields]
    if ignored and strict:
        name = describe_fields(ignored[:1])
        raise ApiError(400, f"unknown field '{name}' (the server runs with --strict-fields)", name)
    if ignored or renamed:
        body = b"{" + b",".join(msgspec.json.encode(key) + b":" + bytes(value)
                                for key, value in raw.items() if key in fields) + b"}"
    return decode_json(body, type_, what), ignored


def convert_fields(fields: dict[str, object], type_: type, what: str = "the form") -> object:
    """A form's fields (already read) → `type_`, or ApiError(400) naming the field."""
    try:
        return msgspec.convert(fields, type_)
    except msgspec.ValidationError as e:
        raise _invalid(e, what, type_) from None


def decode_json(body: bytes | str, type_: type, what: str = "request body") -> object:
    """A JSON object → `type_` (a Struct or a tagged union of them), or ApiError(400) naming the field."""
    if not body.strip():
        raise ApiError(400, f"{what} is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except UnicodeDecodeError:  # msgspec validates UTF-8 inside strings only
        raise ApiError(400, f"{what} is not valid UTF-8") from None
    except RecursionError:  # msgspec reads nested arrays and objects recursively, on this thread's stack
        raise ApiError(400, f"{what} is nested too deeply (arrays and objects within each other)") from None
    except msgspec.ValidationError as e:
        raise _invalid(e, what, type_) from None
    except msgspec.DecodeError as e:
        raise _not_json(body, what, e) from None


_ERROR_BYTE = re.compile(r"\(byte (\d+)\)$")   # where msgspec stopped, in a DecodeError's message
# a top-level member's start: the object's `{` or the `,` after the previous value, then its quoted name and `:`
_MEMBER = re.compile(rb'\s*[{,]\s*("(?:[^"\\]|\\.)*")\s*:\s*')
MAX_MEMBERS_WALKED = 64   # more than a speech request has fields: a longer walk is a hostile body's, not worth naming
NON_FINITE = "NaN and Infinity are not numbers in JSON; every value must be finite"


def _not_json(body: bytes | str, what: str, error: msgspec.DecodeError) -> ApiError:
    """A body that is not JSON. NaN or Infinity where msgspec stopped is what `json.dumps` writes for a non-finite
    float (a speaker embedding gone wrong, say): the error says so and names the field that holds it. Decided from
    msgspec's reading alone: this runs on the event loop, for bodies of up to 32 MB, and Python's own parser would
    hold the loop for seconds (a thread would not help: it parses holding the GIL)."""
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    at = _error_byte(error)
    if at is None or not data.startswith((b"NaN", b"Infinity"), at):
        return ApiError(400, f"{what} is not valid JSON: {error}")
    field = _field_at(data, at)
    return ApiError(400, f"invalid '{field}': {NON_FINITE}" if field else f"{what} is not valid JSON: {NON_FINITE}",
                    field)


def _error_byte(error: msgspec.DecodeError) -> int | None:
    match = _ERROR_BYTE.search(str(error))
    return int(match.group(1)) if match else None


def _field_at(body: bytes, at: int) -> str | None:
    """The top-level field of the JSON object `body` whose value holds byte `at`, up to which msgspec read it: each
    value before is valid JSON, which msgspec, reading it alone, ends at the `,` after it ("trailing characters")."""
    view, position = memoryview(body), 0
    for _ in range(MAX_MEMBERS_WALKED):
        member = _MEMBER.match(body, position)
        if member is None:
            return None
        try:
            msgspec.json.decode(view[member.end():], type=msgspec.Raw)
            return None  # the value ran to the body's end: no NaN in it
        except (msgspec.DecodeError, RecursionError) as e:
            end = _error_byte(e) if isinstance(e, msgspec.DecodeError) else None
            if end is None:
                return None
            if member.end() + end == at:
                return msgspec.json.decode(member.group(1), type=str)
            if not str(e).startswith("JSON is malformed: trailing characters"):
                return None
            position = member.end() + end - 1   # msgspec counts the trailing character read
    return None
