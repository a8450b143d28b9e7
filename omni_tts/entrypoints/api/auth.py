"""The API key (--api-key): every route but openapi.OPEN_PATHS needs it, as a bearer token or, on the WebSocket
routes, where a browser cannot set headers, as a subprotocol; on ElevenLabs' WebSockets also as the `authorization`
query parameter or in the socket's first message (checked by its handler: `check_first_message_key`)."""
from __future__ import annotations

import base64
import hmac
from typing import Callable

from aiohttp import hdrs, web

from omni_tts.entrypoints.api.openapi import is_open_route
from omni_tts.entrypoints.api.schema import ApiError

SPEECH_STREAM_PATH = "/v1/audio/speech/stream"
# A browser's WebSocket cannot send headers, only subprotocols: on a WebSocket route the key may come as the
# subprotocol `omni-tts.bearer.<the key's UTF-8 in base64url, unpadded>`, offered beside `omni-tts`, the one the
# server answers (so the key never comes back, and aiohttp never logs offered protocols that do not overlap); every
# WebSocket route but OpenAI Realtime's (its clients' own way, below) lists WS_PROTOCOL among its protocols.
WS_PROTOCOL = "omni-tts"
WS_KEY_PROTOCOL_PREFIX = WS_PROTOCOL + ".bearer."
# OpenAI Realtime's browser clients offer `realtime` and `openai-insecure-api-key.<the key>`; `realtime` is answered
REALTIME_PATH = "/v1/realtime"
REALTIME_PROTOCOL = "realtime"
REALTIME_KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."
# ElevenLabs' WebSockets take the key as a query parameter or in the first message (`xi_api_key`, `authorization`)
ELEVENLABS_WS_SUFFIXES = ("/stream-input", "/multi-stream-input")
FIRST_MESSAGE_KEY = web.RequestKey("first_message_key", bytes)   # the key the first message must present


def presented_api_key(request: web.Request) -> bytes | None:
    """The key a request presents: `Authorization: Bearer <key>`, ElevenLabs' `xi-api-key` header, on ElevenLabs'
    WebSockets the `authorization` query parameter, or on a WebSocket route its key subprotocol."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return given.strip().encode("utf-8", "surrogateescape")
    if "xi-api-key" in request.headers:
        return request.headers["xi-api-key"].strip().encode("utf-8", "surrogateescape")
    if key_may_follow(request) and "authorization" in request.query:
        return bearer_key(request.query["authorization"])
    if request.headers.get(hdrs.UPGRADE, "").lower() != "websocket":
        return None
    offered = [protocol.strip() for protocol in request.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, "").split(",")]
    if request.path == REALTIME_PATH:
        return next((protocol[len(REALTIME_KEY_PROTOCOL_PREFIX):].encode("utf-8", "surrogateescape")
                     for protocol in offered if protocol.startswith(REALTIME_KEY_PROTOCOL_PREFIX)
                     and REALTIME_PROTOCOL in offered), None)
    for protocol in offered:
        if protocol.startswith(WS_KEY_PROTOCOL_PREFIX) and WS_PROTOCOL in offered:
            encoded = protocol[len(WS_KEY_PROTOCOL_PREFIX):]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            except ValueError:  # binascii.Error: not base64
                return None
    return None


def key_may_follow(request: web.BaseRequest) -> bool:
    """ElevenLabs' WebSockets, whose first message may carry the key."""
    return request.path.startswith("/v1/text-to-speech/") and request.path.endswith(ELEVENLABS_WS_SUFFIXES)


def bearer_key(value: str) -> bytes:
    """`Bearer <key>` or the bare key."""
    scheme, _, given = value.strip().partition(" ")
    return (given if scheme.lower() == "bearer" else value).strip().encode("utf-8", "surrogateescape")


def is_api_key(given: bytes | None, expected: bytes) -> bool:
    # constant-time: the comparison must not tell how much of a guessed key was right
    return given is not None and hmac.compare_digest(given, expected)


def check_first_message_key(request: web.BaseRequest, given: str | None) -> None:
    """On ElevenLabs' WebSockets opened without a key: the key of the first message (`xi_api_key` or
    `authorization`), ApiError 401 unless it is the server's."""
    if FIRST_MESSAGE_KEY in request and not is_api_key(None if given is None else bearer_key(given),
                                                       request[FIRST_MESSAGE_KEY]):
        raise ApiError(401, "a valid API key is required: send the 'xi-api-key' header, or 'xi_api_key' in the "
                            "first message", code="invalid_api_key")


def api_key_middleware(api_key: str) -> Callable:
    """401 (OpenAI envelope, code invalid_api_key) unless the request presents the key (`presented_api_key`);
    OPEN_PATHS stay open (/health for load balancers and supervisors, the /docs and playground pages for browsers,
    which cannot send the header on navigation). Runs inside error_middleware, which renders the error."""
    expected = api_key.encode("utf-8")

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if not is_open_route(request):
            given = presented_api_key(request)
            if given is None and key_may_follow(request):
                request[FIRST_MESSAGE_KEY] = expected   # the socket opens; its handler checks the first message
            elif not is_api_key(given, expected):
                raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return await handler(request)

    return check_api_key
