"""Start `omni-tts serve` as a real process on a free loopback port, and call it, for the HTTP tests; or serve the
same app in the test's own event loop (`AppInProcess`), for tests that look at the server's state between its
steps."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

from waiting import eventually


MODEL = "qwen3-tts"  # the name the shared servers (conftest's cv_server and base_server) serve their model as


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url, payload=None, method=None, data=None, headers=None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP call: JSON `payload` or raw `data` is POSTed, nothing is a GET."""
    body = data if data is not None else (json.dumps(payload).encode() if payload is not None else None)
    req = urllib.request.Request(url, data=body, method=method or ("POST" if body is not None else "GET"),
                                 headers=headers or ({"Content-Type": "application/json"} if body is not None else {}))
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def environment(changes: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with `changes`: a variable set to a string, or removed by None."""
    return {name: value for name, value in dict(os.environ, **changes).items() if value is not None}


class ServerProcess:
    """`omni-tts serve` on a free loopback port, healthy once constructed. Its stdout and stderr go to a file, read by
    output(): a pipe nobody reads would fill with the access log and stall the server."""

    def __init__(self, *args: str, env: dict[str, str | None] | None = None, command: list[str] | None = None,
                 cwd: str | None = None, subcommand: str = "serve", startup_timeout: float = 300) -> None:
        """env: variables to set, or to remove (None); command: what runs `serve` (default: this interpreter's
        `-m omni_tts.entrypoints.cli`); subcommand: `serve-ray` for that one."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*(command or [sys.executable, "-m", "omni_tts.entrypoints.cli"]), subcommand, "--port", str(self.port),
               *args]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=environment(env or {}),
                                     cwd=cwd)
        eventually(self._healthy, startup_timeout, lambda: f"the server healthy; it wrote: {self.stop()}", interval=0.1)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited: {self.output()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def output(self) -> str:
        """Everything the server wrote so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> str:
        """Stop it (SIGTERM, then SIGKILL after 20 s); returns its whole output."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.output()


def stage_pids(server_pid: int) -> list[int]:
    """The stage processes a server process spawned (not its resource tracker)."""
    children = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == server_pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            children.append(int(pid))
    return children


@contextlib.asynccontextmanager
async def app_in_process(model_dir: str, engine_options: dict | None = None, **config):
    """The app `omni-tts serve` runs (real stage processes, cpu_tiny), on a free loopback port of this event loop:
    yields (url, ServerState). `engine_options`: AsyncTTS arguments; `config`: ServerConfig fields."""
    from aiohttp import web

    from omni_tts.config.stage_config import load_stage_config
    from omni_tts.entrypoints.api.app import build_app
    from omni_tts.entrypoints.api.server_config import ServerConfig
    from omni_tts.entrypoints.api.state import STATE
    from omni_tts.orchestrator.async_tts import AsyncTTS

    tts = AsyncTTS(model_dir, load_stage_config("cpu_tiny"), **(engine_options or {}))
    app = build_app(tts, ServerConfig(**{"served_model_names": ("m",), **config}))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)  # as `omni-tts serve` runs it
    await tts.start()
    try:
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            yield f"http://127.0.0.1:{port}", app[STATE]
        finally:
            await runner.cleanup()
    finally:
        await tts.shutdown()


def unclosed_codec_containers() -> list:
    """PyAV output containers alive in this process that no closed stream encoder owns: an encoder dropped unclosed
    leaves its container in a reference cycle, holding its codec context until a garbage collection (run with the
    GC off to see it)."""
    import gc

    import av

    from omni_tts.audio.encoding import AvStreamEncoder

    objects = gc.get_objects()
    closed = {id(o._container) for o in objects if type(o) is AvStreamEncoder and o._finished}
    return [o for o in objects if type(o) is av.container.OutputContainer and id(o) not in closed]


async def ws_utterance(url: str, messages: list[dict]) -> tuple[bytes, list[dict]]:
    """Send `messages` on WS /v1/audio/speech/stream of the server at `url`; the binary audio and the JSON events
    received until session.done or error."""
    import aiohttp

    audio, events = b"", []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url.replace("http", "ws", 1) + "/v1/audio/speech/stream") as ws:
            for message in messages:
                await ws.send_json(message)
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY:
                    audio += message.data
                    continue
                events.append(json.loads(message.data))
                if events[-1]["type"] in ("session.done", "error"):
                    break
    return audio, events
