"""Admission: the slots of --max-queue, taken before any expensive work a request causes."""
from __future__ import annotations

from omni_tts.entrypoints.api.schema import ApiError

from .errors import unavailable_message
from .in_flight import STOPPING
from .state import ServerState


class Admission:
    """An admitted speech request's slot among --max-queue, and the gauges that count it (with: raises 429 when
    the server is at capacity, 503 while a stage is down or the server shuts down)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.waiting = True   # for its first audio

    def __enter__(self) -> "Admission":
        state = self.state
        if state.admitted >= state.config.max_queue:
            raise ApiError(429, f"the server is at capacity ({state.config.max_queue} requests); retry shortly")
        if state.in_flight.closed:
            raise ApiError(503, STOPPING)
        if not state.tts.is_healthy:
            raise ApiError(503, unavailable_message(state.tts))
        state.admitted += 1
        state.metrics.in_flight.inc()
        state.metrics.queue_depth.inc()
        return self

    def first_audio(self) -> None:
        if self.waiting:
            self.waiting = False
            self.state.metrics.queue_depth.dec()

    def __exit__(self, *exc: object) -> None:
        self.state.admitted -= 1
        self.state.metrics.in_flight.dec()
        self.first_audio()
