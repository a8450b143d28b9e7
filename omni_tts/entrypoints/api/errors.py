"""How an error reaches a client: `api_error` decides, once, the status and message of every error that ends a
request (the pipeline's and the API's own), for the HTTP responders and the WebSocket's error events alike;
`error_middleware` renders whatever a handler raises, in the body shape of the API the path belongs to
(`error_body`: OpenAI's envelope, ElevenLabs' `detail`, DashScope's `code`/`message`/`request_id`)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from omni_tts.entrypoints.api.schema import ApiError
from omni_tts.orchestrator.tts_client import TTSClient
from omni_tts.orchestrator.types import (PIPELINE_ERRORS, PipelineError, RequestError, RequestFailed, RequestTimedOut,
                                         StageDeadError)

from .access_log import request_id

logger = logging.getLogger(__name__)

# what ends a request with a message for its client: the pipeline's errors and the API's own
REQUEST_ERRORS = (ApiError, *PIPELINE_ERRORS)


def api_error(error: ApiError | PipelineError) -> ApiError:
    """The status and envelope of an error that ended a request: bad input 400 naming the field (found before the
    stages or inside them: a stage's bad-input failure arrives as a RequestError, `types.stage_error`), a stage
    down 503, no first audio in time 503 (overloaded: the client should retry), no end in time 504, any other failure
    (a stage's internal one) 500."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestError):
        return ApiError(400, str(error), error.param)
    if isinstance(error, StageDeadError):
        return ApiError(503, str(error))
    if isinstance(error, RequestTimedOut):
        if error.before_first_audio:
            return ApiError(503, f"the server is overloaded: {error}; retry shortly")
        return ApiError(504, str(error))
    if isinstance(error, RequestFailed):
        return ApiError(500, f"speech generation failed: {error}")
    raise TypeError(f"not a request error: {error!r}")


def unavailable_message(tts: TTSClient) -> str:
    """Why new requests are refused while the pipeline is unhealthy."""
    if tts.fatal is not None:
        return f"the pipeline failed for good ({tts.fatal}); the server is exiting"
    if tts.down is not None:
        return f"stage {tts.down} failed ({tts.down_reason}); the pipeline is restarting, retry shortly"
    return "the pipeline is not running"


def elevenlabs_body(error: ApiError, request_id: str) -> dict:
    """ElevenLabs' error body (its SDK raises ApiError(status, body) with it)."""
    return {"detail": {"status": error.code, "message": error.message, "param": error.param,
                       "request_id": request_id}}


# DashScope's error codes by status (its SDK reads `code` and `message`)
DASHSCOPE_CODES = {400: "InvalidParameter", 401: "InvalidApiKey", 404: "NotFound", 413: "InvalidParameter",
                   429: "Throttling", 503: "ServiceUnavailable"}


def dashscope_body(error: ApiError, request_id: str) -> dict:
    return {"code": DASHSCOPE_CODES.get(error.status, "InternalError" if error.status >= 500 else "InvalidParameter"),
            "message": error.message, "request_id": request_id}


# path prefix → the body of its API's errors; any other path answers OpenAI's envelope
ERROR_BODIES: tuple[tuple[str, Callable[[ApiError, str], dict]], ...] = (
    ("/v1/text-to-speech/", elevenlabs_body), ("/v1/voices", elevenlabs_body), ("/v2/voices", elevenlabs_body),
    ("/v1/pronunciation-dictionaries", elevenlabs_body), ("/api/v1/", dashscope_body))


# paths ElevenLabs' API shares with OpenAI's: its clients (is_elevenlabs_client) get its shapes there
SHARED_PATHS = ("/v1/models",)


def is_elevenlabs_client(request: web.BaseRequest) -> bool:
    """Sent by ElevenLabs' SDK (Fern-made: it names itself), or carrying ElevenLabs' key header."""
    return request.headers.get("X-Fern-SDK-Name") == "elevenlabs" or "xi-api-key" in request.headers


def error_body(error: ApiError, path: str = "", request_id: str = "") -> dict:
    """`error` as the API that serves `path` shapes its errors."""
    for prefix, body in ERROR_BODIES:
        if path.startswith(prefix):
            return body(error, request_id)
    return error.body()


def error_response(error: ApiError, request: web.BaseRequest | None = None) -> web.Response:
    """`error` as its status and body (in the shape of `request`'s API)."""
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    if request is None:
        body = error.body()
    elif request.path in SHARED_PATHS and is_elevenlabs_client(request):
        body = elevenlabs_body(error, request_id(request))
    else:
        body = error_body(error, request.path, request_id(request))
    response = web.json_response(body, status=error.status, headers=headers)
    if error.status in (408, 413):  # the body was not read to its end: the connection cannot carry another request
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Errors → the OpenAI envelope (aiohttp's own HTTP errors too); an unexpected one is logged and answered 500."""
    try:
        return await handler(request)
    except REQUEST_ERRORS as e:
        return error_response(api_error(e), request)
    except web.HTTPMethodNotAllowed as e:
        response = error_response(ApiError(405, f"{request.method} is not allowed on {request.path}; allowed: "
                                                f"{', '.join(sorted(e.allowed_methods))}", code="method_not_allowed"),
                                  request)
        response.headers["Allow"] = e.headers["Allow"]
        return response
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            return error_response(ApiError(e.status, e.reason), request)
        raise
    except ConnectionResetError:
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error; see the server log"), request)
