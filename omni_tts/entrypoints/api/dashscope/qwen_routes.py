"""The DashScope routes `api/app.py` adds: the Realtime WebSocket, the HTTP call, and the download of the HTTP call's
audio (one store per app)."""
from __future__ import annotations

from aiohttp import web

from .audio_links import AUDIO_PATH, AudioLinks
from .qwen_generation import GENERATION_PATH, QwenGeneration
from .qwen_events import REALTIME_PATH
from .qwen_realtime import qwen_realtime


def dashscope_routes() -> list[web.RouteDef]:
    links = AudioLinks()
    return [web.get(REALTIME_PATH, qwen_realtime),
            web.post(GENERATION_PATH, QwenGeneration(links).generate),
            web.get(AUDIO_PATH, links.download)]
