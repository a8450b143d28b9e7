"""Each request's id (X-Request-Id, the pipeline's request id) and its one access-log line."""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger


@dataclass
class SpeechLog:
    """What the access log tells of a speech request: never its text or audio."""
    ttfp: float | None = None            # seconds from arrival to the first audio
    audio_seconds: float | None = None   # of the whole answer, once it is finished
    segments_total: int | None = None    # a narrated input: its segments (from start_segment) and those delivered
    segments_done: int = 0


REQUEST_ID = web.RequestKey("request_id", str)
SPEECH_LOG = web.RequestKey("speech_log", SpeechLog)


def request_id(request: web.BaseRequest) -> str:
    """The request's id: in the X-Request-Id response header, the access log and the pipeline (its request id)."""
    if REQUEST_ID not in request:
        request[REQUEST_ID] = uuid.uuid4().hex
    return request[REQUEST_ID]


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Request-Id"] = request_id(request)


class AccessLogger(AbstractAccessLogger):
    """One line per request: id, client, method and path (no query string), status, seconds, and for speech the
    audio's length, the time to its first audio and, narrated, the segments delivered of all."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, seconds: float) -> None:
        speech = request.get(SPEECH_LOG)
        details = "" if speech is None else f" audio={_seconds(speech.audio_seconds)} ttfp={_seconds(speech.ttfp)}"
        if speech is not None and speech.segments_total is not None:
            details += f" segments={speech.segments_done}/{speech.segments_total}"
        self.logger.info('%s %s "%s %s" %d %.3fs%s', request_id(request), request.remote, request.method,
                         request.path, response.status, seconds, details)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
