"""The audio a whole DashScope HTTP response returns by URL (DashScope hosts it on OSS for 24 hours): kept in memory,
at most MAX_STORED_BYTES in all and each for AUDIO_TTL_S, then dropped (the oldest first when a new file needs the
room). `GET /api/v1/audio/{audio_id}` serves it; the id is random (128 bits), so the URL itself is the permission,
as DashScope's signed URLs are: the route is open under --api-key (`openapi.OPEN_PATHS`)."""
from __future__ import annotations

import secrets
import time
from collections import OrderedDict

from aiohttp import web

from omni_tts.entrypoints.api.schema import ApiError

AUDIO_PATH = "/api/v1/audio/{audio_id}"
MAX_STORED_BYTES = 256 * 2**20
AUDIO_TTL_S = 600.0


class AudioLinks:
    def __init__(self, max_bytes: int = MAX_STORED_BYTES, ttl: float = AUDIO_TTL_S) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self.files: OrderedDict[str, tuple[bytes, float]] = OrderedDict()   # id → (wav, expiry), oldest first
        self.stored_bytes = 0

    def add(self, data: bytes) -> tuple[str, float]:
        """Keep `data`: its id and its expiry (Unix seconds). ApiError 413 for a file larger than the store."""
        if len(data) > self.max_bytes:
            raise ApiError(413, f"the audio ({len(data)} bytes) is larger than the server keeps for download "
                                f"({self.max_bytes}); ask for a stream instead")
        self._drop(time.time(), len(data))
        audio_id = "audio_" + secrets.token_hex(16)
        expires_at = time.time() + self.ttl
        self.files[audio_id] = (data, expires_at)
        self.stored_bytes += len(data)
        return audio_id, expires_at

    def _drop(self, now: float, room: int) -> None:
        """The expired files, then the oldest until `room` bytes fit."""
        while self.files:
            audio_id, (data, expires_at) = next(iter(self.files.items()))
            if expires_at > now and self.stored_bytes + room <= self.max_bytes:
                return
            del self.files[audio_id]
            self.stored_bytes -= len(data)

    async def download(self, request: web.Request) -> web.Response:
        self._drop(time.time(), 0)
        stored = self.files.get(request.match_info["audio_id"])
        if stored is None:
            raise ApiError(404, "no such audio: it expired (audio is kept for "
                                f"{self.ttl:g} s) or was never made here")
        return web.Response(body=stored[0], content_type="audio/wav")
