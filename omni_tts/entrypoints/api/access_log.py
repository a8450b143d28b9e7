"""Each request's id (X-Request-Id, the pipeline's request id) and its access-log lines: one per HTTP request, a
request whose handler was cancelled included (`log_cut_requests`), and for a WebSocket session one per utterance and
one at its end (`SessionLog`). Every line reads `<id> <client> "<method> <path>" <status> <seconds>s[ <details>]`."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

ACCESS_LOG = logging.getLogger("omni_tts.access")


@dataclass
class SpeechLog:
    """What the access log tells of a speech request: never its text or audio."""
    ttfp: float | None = None            # seconds from arrival to the first audio
    audio_seconds: float | None = None   # of the whole answer, once it is finished
    segments_total: int | None = None    # a narrated input: its segments (from start_segment) and those delivered
    segments_done: int = 0

    def details(self) -> str:
        details = f" audio={_seconds(self.audio_seconds)} ttfp={_seconds(self.ttfp)}"
        if self.segments_total is not None:
            details += f" segments={self.segments_done}/{self.segments_total}"
        return details


REQUEST_ID = web.RequestKey("request_id", str)
SPEECH_LOG = web.RequestKey("speech_log", SpeechLog)


def request_id(request: web.BaseRequest) -> str:
    """The request's id: in the X-Request-Id response header, the access log and the pipeline (its request id)."""
    if REQUEST_ID not in request:
        request[REQUEST_ID] = uuid.uuid4().hex
    return request[REQUEST_ID]


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Request-Id"] = request_id(request)


def _write(logger: logging.Logger, request: web.BaseRequest, status: object, seconds: float, details: str = "",
           line_id: str | None = None) -> None:
    logger.info('%s %s "%s %s" %s %.3fs%s', line_id or request_id(request), request.remote, request.method,
                request.path, status, seconds, details)


def _speech_details(request: web.BaseRequest) -> str:
    speech = request.get(SPEECH_LOG)
    return "" if speech is None else speech.details()


class AccessLogger(AbstractAccessLogger):
    """One line per answered request: id, client, method and path (no query string), status, seconds, and for speech
    the audio's length, the time to its first audio and, narrated, the segments delivered of all. A WebSocket session
    writes its own lines (`SessionLog`)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, seconds: float) -> None:
        if SESSION_LOG not in request:
            _write(self.logger, request, response.status, seconds, _speech_details(request))

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def log_cut_requests(why_cut: Callable[[], str]):
    """A middleware: a request whose handler is cancelled (aiohttp writes no line for it) gets its line, its status
    `why_cut()`: `shutdown` when the server's stop ended it, `disconnect` when its client went away."""
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        started = time.monotonic()
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if SESSION_LOG not in request:
                _write(ACCESS_LOG, request, why_cut(), time.monotonic() - started, _speech_details(request))
            raise
    return middleware


class SessionLog:
    """A WebSocket session's lines (aiohttp's own line for it is lost whenever the client's close cancels the
    handler): each utterance's as it ends, its id `<session id>#<index>`, its status 200, its error event's status
    or how the session was cut, with its audio and the time from its first text to its first audio; then, leaving the
    `with` block, the session's (status 101), with its utterances and its outcome: `closed` (by its client),
    `error:<status>` (an error event ended it), `shutdown` or `disconnect` (cut, as `log_cut_requests` says)."""

    def __init__(self, request: web.BaseRequest, ws: web.WebSocketResponse, why_cut: Callable[[], str]) -> None:
        self.request, self.ws, self.why_cut = request, ws, why_cut
        self.started = time.monotonic()
        self.num_utterances = 0
        self.utterance: SpeechLog | None = None   # the utterance in progress
        self.utterance_started = 0.0
        self.error_status: int | None = None      # of the error event that ended the session
        request[SESSION_LOG] = self

    def utterance_began(self) -> None:
        """Its first text arrived."""
        if self.utterance is None:
            self.utterance, self.utterance_started = SpeechLog(audio_seconds=0.0), time.monotonic()

    def audio(self, seconds: float) -> None:
        """Audio of the utterance in progress went out."""
        self.utterance_began()
        if self.utterance.ttfp is None:
            self.utterance.ttfp = time.monotonic() - self.utterance_started
        self.utterance.audio_seconds += seconds

    def utterance_ended(self, status: object) -> None:
        self.utterance_began()
        _write(ACCESS_LOG, self.request, status, time.monotonic() - self.utterance_started, self.utterance.details(),
               f"{request_id(self.request)}#{self.num_utterances}")
        self.num_utterances += 1
        self.utterance = None

    def failed(self, status: int) -> None:
        """The session sends its error event and closes."""
        self.error_status = status

    def __enter__(self) -> SessionLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self.error_status is not None:
            outcome = f"error:{self.error_status}"
        elif kind is not None and issubclass(kind, asyncio.CancelledError) and not self.ws.closed:
            outcome = self.why_cut()   # a session its client had closed has only its close handshake left
        else:
            outcome = "closed"
        if self.utterance is not None:
            self.utterance_ended(self.error_status or outcome)
        _write(ACCESS_LOG, self.request, 101, time.monotonic() - self.started,
               f" utterances={self.num_utterances} outcome={outcome}")


SESSION_LOG = web.RequestKey("session_log", SessionLog)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
