"""Reference audio fetching (data URI, URL, allow-listed file) and the uploaded-voice store."""
import asyncio
import base64
import concurrent.futures
import os

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from conftest import FIXTURES
from omni_tts.audio.ref_audio import RefAudioError, fetch_ref_audio
from omni_tts.entrypoints.voices import VoiceError, VoiceStore

CLIP = (FIXTURES / "ref_voice.wav").read_bytes()
POOL = concurrent.futures.ThreadPoolExecutor(2)


def fetch(value, allowed=None, session=None, **kw):
    return fetch_ref_audio(value, allowed_local_path=allowed, session=session, executor=POOL, **kw)


def test_data_uri_and_errors():
    async def main():
        wav = await fetch("data:audio/wav;base64," + base64.b64encode(CLIP).decode())
        assert wav.dtype == np.float32 and 3 * 24000 < wav.shape[0] < 5 * 24000
        with pytest.raises(RefAudioError, match="invalid base64"):
            await fetch("data:audio/wav;base64,@@@")
        with pytest.raises(RefAudioError, match="not a readable audio file"):
            await fetch("data:audio/wav;base64," + base64.b64encode(b"x" * 400).decode())
        with pytest.raises(RefAudioError, match="must be base64"):
            await fetch("data:audio/wav,plain")
        with pytest.raises(RefAudioError) as too_big:
            await fetch("data:audio/wav;base64," + base64.b64encode(CLIP).decode(), max_bytes=1000)
        assert too_big.value.status == 413
        with pytest.raises(RefAudioError, match="must be a data"):
            await fetch("relative/path.wav")
    asyncio.run(main())


def test_duration_limits(tmp_path):
    import soundfile as sf
    sf.write(tmp_path / "short.wav", np.zeros(12000, np.float32), 24000)
    sf.write(tmp_path / "long.wav", np.zeros(24000 * 31, np.float32), 24000)

    async def main():
        for name in ("short.wav", "long.wav"):
            with pytest.raises(RefAudioError, match="must last 1–30 s"):
                await fetch(str(tmp_path / name), allowed=str(tmp_path))
    asyncio.run(main())


def test_local_files_only_inside_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "clip.wav").write_bytes(CLIP)
    (tmp_path / "secret.wav").write_bytes(CLIP)
    os.symlink(tmp_path / "secret.wav", allowed / "link.wav")

    async def main():
        assert (await fetch("file://" + str(allowed / "clip.wav"), allowed=str(allowed))).shape[0] > 24000
        for bad in (str(allowed / ".." / "secret.wav"), str(allowed / "link.wav"), "/etc/passwd"):
            with pytest.raises(RefAudioError, match="outside the allowed"):
                await fetch(bad, allowed=str(allowed))
        with pytest.raises(RefAudioError, match="local files are disabled"):
            await fetch(str(allowed / "clip.wav"))
    asyncio.run(main())


def test_url_fetching_with_limits():
    async def clip(request):
        return web.Response(body=CLIP)

    async def big(request):
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(40):
            await response.write(b"\0" * 65536)
        return response

    async def slow(request):
        await asyncio.sleep(5)
        return web.Response(body=CLIP)

    async def main():
        app = web.Application()
        app.router.add_routes([web.get("/clip.wav", clip), web.get("/big", big), web.get("/slow", slow)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                assert (await fetch(base + "/clip.wav", session=session)).shape[0] > 24000
                with pytest.raises(RefAudioError, match="HTTP 404"):
                    await fetch(base + "/missing", session=session)
                with pytest.raises(RefAudioError) as too_big:
                    await fetch(base + "/big", session=session, max_bytes=1_000_000)
                assert too_big.value.status == 413
                with pytest.raises(RefAudioError, match="could not be fetched"):
                    await fetch(base + "/slow", session=session, timeout_s=0.3)
        finally:
            await runner.cleanup()
    asyncio.run(main())


def test_voice_store_lifecycle(tmp_path):
    store = VoiceStore(str(tmp_path))
    first = store.add("Fox", CLIP, "fox.wav", "audio/wav", "The quick brown fox.", "yes")
    again = store.add("fox", CLIP, "fox.wav", "audio/wav", None, None)  # re-upload replaces, case-insensitive
    assert again.created_at > first.created_at and store.get("FOX").ref_text is None
    snapshot = store.get("fox")
    assert store.samples(snapshot).shape[0] > 24000
    assert store.delete("fox") and not store.delete("fox") and store.get("fox") is None
    assert store.samples(snapshot).shape[0] > 24000  # a looked-up snapshot outlives the deletion (cache)
    store.add("b", CLIP, "b.wav", "audio/wav", "text", None)
    os.makedirs(tmp_path / "broken")
    (tmp_path / "broken" / "meta.json").write_text("{not json")
    restored = VoiceStore(str(tmp_path))
    assert [v.name for v in restored.list()] == ["b"] and restored.get("b").ref_text == "text"
    assert restored.samples(restored.get("b")).shape[0] > 24000


@pytest.mark.parametrize("name,audio,filename,status,message", [
    ("../etc", CLIP, "x.wav", 400, "voice name"),
    ("", CLIP, "x.wav", 400, "voice name"),
    ("ok", CLIP, "x.exe", 415, "not supported"),
    ("ok", b"not audio" * 100, "x.wav", 400, "not a readable audio file"),
    ("ok", b"\0" * (2 * 1024 * 1024), "x.wav", 413, "larger than"),
])
def test_voice_store_rejects(tmp_path, name, audio, filename, status, message):
    store = VoiceStore(str(tmp_path), max_bytes=1024 * 1024)
    with pytest.raises(VoiceError, match=message) as error:
        store.add(name, audio, filename, "audio/wav", None, None)
    assert error.value.status == status and store.list() == []


def test_voice_limit(tmp_path):
    store = VoiceStore(str(tmp_path), max_voices=1)
    store.add("a", CLIP, "a.wav", "audio/wav", None, None)
    with pytest.raises(VoiceError, match="voice limit") as error:
        store.add("b", CLIP, "b.wav", "audio/wav", None, None)
    assert error.value.status == 409
