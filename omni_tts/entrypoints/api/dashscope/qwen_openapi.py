"""The DashScope routes in the OpenAPI document (`openapi.py` adds them): what they take is DashScope's, described in
words; their errors are DashScope's shape."""
from __future__ import annotations

from .audio_links import AUDIO_PATH, AUDIO_TTL_S, MAX_STORED_BYTES
from .qwen_generation import GENERATION_PATH
from .qwen_events import MAX_MESSAGE_BYTES, REALTIME_PATH

DASHSCOPE_ERROR = {"type": "object", "required": ["code", "message", "request_id"],
                   "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                                  "request_id": {"type": "string"}}}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": DASHSCOPE_ERROR}}}


def dashscope_paths(openai_error: dict) -> dict:
    """`openai_error`: the response of a plain GET to the WebSocket route (not an upgrade), in our envelope."""
    return {
        REALTIME_PATH: {"get": {
            "operationId": "qwenTtsRealtime",
            "summary": "Qwen-TTS Realtime (Alibaba DashScope): a WebSocket session",
            "description": (
                "Upgrade this GET to a WebSocket. DashScope's protocol: JSON text events (session.update, "
                "input_text_buffer.append / commit / clear, response.cancel, session.finish) answered by "
                "session.created, session.updated, response.* events with base64 audio in response.audio.delta, "
                "and session.finished; an error event is followed by the close. Events of at most "
                f"{MAX_MESSAGE_BYTES} bytes. The `dashscope` SDK's QwenTtsRealtime(url=...) speaks it."),
            "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                            "description": "DashScope's model name, echoed in session.created"}],
            "responses": {"101": {"description": "Switching Protocols: the session runs over the WebSocket"},
                          "400": openai_error}}},
        GENERATION_PATH: {"post": {
            "operationId": "qwenTtsGeneration",
            "summary": "Qwen-TTS over HTTP (Alibaba DashScope's MultiModalConversation.call)",
            "description": (
                'DashScope\'s body: {"model", "input": {"text", "voice", "language_type", "instructions"}, '
                '"parameters": {...}}. Whole: JSON with output.audio.url, a WAV kept for '
                f"{AUDIO_TTL_S:g} s (at most {MAX_STORED_BYTES >> 20} MiB in all). With X-DashScope-SSE: enable "
                "or Accept: text/event-stream: server-sent events, each output.audio.data a base64 piece of "
                "24 kHz 16-bit mono PCM, the last with finish_reason stop."),
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
            "responses": {
                "200": {"description": "the audio by URL (JSON), or its stream (SSE)", "content": {
                    "application/json": {"schema": {"type": "object", "required": ["output", "usage",
                                                                                   "request_id"]}},
                    "text/event-stream": {"schema": {"type": "string"}}}},
                "400": _error("invalid request"),
                "404": _error("the model is not served here"),
                "408": _error("the body did not arrive within --body-read-timeout"),
                "413": _error("the body is too large"),
                "429": _error("the server is at capacity; see Retry-After"),
                "503": _error("a stage is down and restarting; see Retry-After")}}},
        AUDIO_PATH: {"get": {
            "operationId": "qwenTtsAudio",
            "summary": "The audio of a whole Qwen-TTS HTTP response (its output.audio.url)",
            "security": [],
            "parameters": [{"name": "audio_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "WAV", "content": {"audio/wav": {"schema": {"type": "string"}}}},
                          "404": _error("no such audio, or it expired")}}},
    }
