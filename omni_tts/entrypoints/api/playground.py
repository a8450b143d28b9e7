"""GET /: the playground, a page to try the server from a browser; GET /playground/{name}: its scripts and style.

The files live in static/playground/ (plain ES modules and CSS: no build step, nothing from another host) and ship
as package data. Both routes are open with --api-key (openapi.OPEN_PATHS): a browser cannot send the header when
it navigates, so the page asks its user for the key and sends it with its own requests.
"""
from __future__ import annotations

import functools
import importlib.resources
from pathlib import PurePosixPath

from aiohttp import web

from omni_tts.entrypoints.api.schema import ApiError

PAGE = "index.html"
_CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
# the browser itself holds the page to this origin: its own scripts, style and icon, requests to this server only
# (its WebSocket included: 'self' matches ws: on an http: page), no inline code, nothing framed or submitted
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                           "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")


@functools.cache
def playground_files() -> dict[str, bytes]:
    """Every file of static/playground/ by name, read once."""
    folder = importlib.resources.files("omni_tts.entrypoints.api").joinpath("static/playground")
    return {entry.name: entry.read_bytes() for entry in folder.iterdir() if entry.is_file()}


def playground_asset_names() -> list[str]:
    """What GET /playground/{name} answers: the files the page loads (scripts, style sheet, icon)."""
    return sorted(name for name in playground_files() if name != PAGE)


def playground_routes() -> list[web.RouteDef]:
    files = playground_files()

    async def serve_page(request: web.Request) -> web.Response:
        return web.Response(body=files[PAGE], content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY})

    async def serve_asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name == PAGE or name not in files:
            raise ApiError(404, f"the playground has no file '{name}'", "name")
        content_type = _CONTENT_TYPES.get(PurePosixPath(name).suffix, "application/octet-stream")
        return web.Response(body=files[name], content_type=content_type, charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    return [web.get("/", serve_page), web.get("/playground/{name}", serve_asset)]
