"""Reference audio fetching (data URI, URL, allow-listed file) and the uploaded-voice store."""
import asyncio
import base64
import concurrent.futures
import io
import json
import logging
import os
import threading
import urllib.parse

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from aiohttp import web

from conftest import FIXTURES
import omni_tts.audio.ref_audio as ref_audio_module
from omni_tts.audio.ref_audio import RefAudioError, fetch_ref_audio
from omni_tts.entrypoints.voices import VoiceError, VoiceRecord, VoiceStore
from omni_tts.models.qwen3_tts.audio import load_audio, resampled_length

CLIP = (FIXTURES / "ref_voice.wav").read_bytes()          # 24 kHz, ~3.4 s
CLIP_22K = (FIXTURES / "ref_voice_22k.wav").read_bytes()  # 22.05 kHz
CLIP_WAV, _ = load_audio(CLIP)
N_22K = sf.info(io.BytesIO(CLIP_22K)).frames
POOL = concurrent.futures.ThreadPoolExecutor(2)


def fetch(value, allowed=None, session=None, **kw):
    return fetch_ref_audio(value, allowed_local_path=allowed, session=session, executor=POOL, **kw)


def run(coro):
    return asyncio.run(coro)


def data_uri(data: bytes, mime="audio/wav") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def encode(samples, sr, fmt, subtype=None) -> bytes:
    buffer = io.BytesIO()
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    with sf.SoundFile(buffer, "w", sr, channels, format=fmt, subtype=subtype) as f:
        for start in range(0, samples.shape[0], sr):  # one big write crashes libsndfile's vorbis encoder
            f.write(samples[start:start + sr])
    return buffer.getvalue()


def tone(seconds, sr=24000, channels=1):
    t = np.arange(int(seconds * sr)) / sr
    wav = (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return wav if channels == 1 else np.stack([wav] * channels, axis=1)


async def expect_error(coro, match, status=400):
    with pytest.raises(RefAudioError, match=match) as error:
        await coro
    assert error.value.status == status, error.value
    assert str(error.value).startswith("ref_audio")


# --- data: URIs ----------------------------------------------------------------------------------------------
def test_data_uri_ok_and_resampled():
    async def main():
        wav = await fetch(data_uri(CLIP))
        assert wav.dtype == np.float32 and wav.ndim == 1
        np.testing.assert_array_equal(wav, CLIP_WAV)  # already 24 kHz: unchanged
        wav22 = await fetch(data_uri(CLIP_22K))
        assert wav22.shape[0] == resampled_length(N_22K, 22050)
        # line-wrapped base64 without padding, surrounding whitespace, odd media type
        wrapped = base64.encodebytes(CLIP).decode().rstrip("=\n")
        np.testing.assert_array_equal(await fetch(f"  data:application/octet-stream;base64,{wrapped}\n"), CLIP_WAV)
        for fmt, subtype in (("FLAC", None), ("OGG", "VORBIS"), ("MP3", None)):
            out = await fetch(data_uri(encode(tone(1.5, 16000, channels=2), 16000, fmt, subtype)))
            assert abs(out.shape[0] - 36000) < 2400, (fmt, out.shape)  # stereo → mono, 16 → 24 kHz
    run(main())


def test_data_uri_errors():
    async def main():
        await expect_error(fetch("data:audio/wav;base64,@@@@"), "invalid base64")
        await expect_error(fetch(data_uri(b"RIFF" + b"x" * 400)), "not a readable audio file")
        await expect_error(fetch("data:audio/wav,plain"), "must be base64 encoded")
        await expect_error(fetch("data:audio/wav;base64"), "malformed")
        await expect_error(fetch("data:audio/wav;base64,"), "holds no data")
        await expect_error(fetch(data_uri(CLIP), max_bytes=1000), "larger than", 413)
        await expect_error(fetch(data_uri(CLIP), max_bytes=len(CLIP) - 1), "larger than", 413)
        assert (await fetch(data_uri(CLIP), max_bytes=len(CLIP))).shape[0] > 24000
        await expect_error(fetch("data:audio/wav;base64," + "A" * (20 * 2**20)), "larger than", 413)
        # raw base64 is refused with a hint (it could be mistaken for a path: the alphabet has '/')
        await expect_error(fetch(base64.b64encode(CLIP).decode()), "needs the 'data:audio/wav;base64,' prefix")
        await expect_error(fetch("relative/path.wav"), "must be a data URI")
        await expect_error(fetch("   "), "non-empty")
        await expect_error(fetch("ftp://example.com/a.wav"), "must be a data URI")
    run(main())


def test_duration_and_rate_limits():
    async def main():
        await expect_error(fetch(data_uri(encode(tone(0.5), 24000, "WAV"))), r"too short: .*1–30 s, got 0.50 s")
        await expect_error(fetch(data_uri(encode(tone(31), 24000, "WAV"))), r"too long: .*got 31.00 s")
        # a small compressed file that would decode to minutes is refused from its header, before decoding
        bomb = encode(np.zeros(16000 * 300, np.float32), 16000, "OGG", "VORBIS")
        assert len(bomb) < 1_000_000
        await expect_error(fetch(data_uri(bomb)), "too long")
        await expect_error(fetch(data_uri(encode(tone(2, 4000), 4000, "WAV"))), "sample rate 4000 Hz")
        # configurable limits
        await expect_error(fetch(data_uri(CLIP), max_seconds=2.0), r"too long: it must last 1–2 s")
        await expect_error(fetch(data_uri(CLIP), min_seconds=5.0), "too short")
        assert (await fetch(data_uri(encode(tone(0.5), 24000, "WAV")), min_seconds=0.25)).shape[0] == 12000
    run(main())


def test_decoding_runs_in_the_executor(monkeypatch):
    threads = []
    real = ref_audio_module.load_audio

    def spy(source):
        threads.append(threading.get_ident())
        return real(source)

    monkeypatch.setattr(ref_audio_module, "load_audio", spy)

    async def main():
        await fetch(data_uri(CLIP_22K))
        return threading.get_ident()

    loop_thread = run(main())
    assert threads and loop_thread not in threads


# --- http(s) URLs --------------------------------------------------------------------------------------------
def test_url_fetching_with_limits():
    release = asyncio.Event

    async def main():
        stop = release()

        async def clip(request):
            return web.Response(body=CLIP, content_type="audio/wav")

        async def big_chunked(request):  # no Content-Length: the cap applies while streaming
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(40):
                await response.write(b"\0" * 65536)
            return response

        async def big_declared(request):
            return web.Response(body=b"\0" * 2_000_000)

        async def slow_headers(request):
            await stop.wait()
            return web.Response(body=CLIP)

        async def slow_body(request):  # headers at once, body trickles: the total timeout still applies
            response = web.StreamResponse(headers={"Content-Length": str(len(CLIP))})
            await response.prepare(request)
            await response.write(CLIP[:1000])
            await stop.wait()
            return response

        async def redirect(request):
            raise web.HTTPFound("/clip.wav")

        app = web.Application()
        app.router.add_routes([web.get("/clip.wav", clip), web.get("/big", big_chunked),
                               web.get("/declared", big_declared), web.get("/slow", slow_headers),
                               web.get("/trickle", slow_body), web.get("/redirect", redirect)])
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                np.testing.assert_array_equal(await fetch(base + "/clip.wav", session=session), CLIP_WAV)
                np.testing.assert_array_equal(await fetch(base + "/redirect", session=session), CLIP_WAV)
                await expect_error(fetch(base + "/missing", session=session), "answered HTTP 404 Not Found")
                await expect_error(fetch(base + "/big", session=session, max_bytes=1_000_000), "larger than", 413)
                await expect_error(fetch(base + "/declared", session=session, max_bytes=1_000_000), "larger", 413)
                await expect_error(fetch(base + "/slow", session=session, timeout_s=0.3), "within 0.3 s")
                await expect_error(fetch(base + "/trickle", session=session, timeout_s=0.3), "within 0.3 s")
            # session=None → a temporary session
            assert (await fetch(base + "/clip.wav")).shape == CLIP_WAV.shape
        finally:
            stop.set()
            await runner.cleanup()
        # nothing listens any more
        await expect_error(fetch(base + "/clip.wav", timeout_s=2), "could not be fetched")
        await expect_error(fetch("http://[::1/x.wav"), "could not be fetched")
    run(main())


# --- local files ---------------------------------------------------------------------------------------------
def test_local_files_only_inside_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "clip.wav").write_bytes(CLIP)
    (allowed / "with space.wav").write_bytes(CLIP)
    (tmp_path / "secret.wav").write_bytes(CLIP)
    (tmp_path / "media-evil").mkdir()
    (tmp_path / "media-evil" / "x.wav").write_bytes(CLIP)
    os.symlink(tmp_path / "secret.wav", allowed / "link.wav")           # escapes
    os.symlink(tmp_path, allowed / "sub" / "up")                        # escapes via a directory link
    os.symlink(allowed / "clip.wav", allowed / "sub" / "inner.wav")     # stays inside: fine
    os.mkfifo(allowed / "fifo.wav")
    (allowed / "big.wav").write_bytes(b"\0" * 5000)
    linked_root = tmp_path / "media-link"
    os.symlink(allowed, linked_root)
    a = str(allowed)

    async def main():
        for ok in ("file://" + a + "/clip.wav", a + "/clip.wav", "file://localhost" + a + "/clip.wav",
                   "file://" + urllib.parse.quote(a + "/with space.wav"), a + "/sub/inner.wav",
                   a + "/sub/../clip.wav"):
            np.testing.assert_array_equal(await fetch(ok, allowed=a), CLIP_WAV)
        np.testing.assert_array_equal(await fetch(str(linked_root / "clip.wav"), allowed=str(linked_root)), CLIP_WAV)
        for bad in (a + "/../secret.wav", a + "/link.wav", a + "/sub/up/secret.wav", "/etc/passwd",
                    "file://" + a + "/../secret.wav", str(tmp_path / "media-evil" / "x.wav")):
            await expect_error(fetch(bad, allowed=a), "outside the allowed local media directory")
        await expect_error(fetch(a + "/clip.wav"), "local files are disabled")
        await expect_error(fetch(a + "/missing.wav", allowed=a), "file not found")
        await expect_error(fetch(a + "/sub", allowed=a), "not a regular file")
        await expect_error(fetch(a + "/fifo.wav", allowed=a), "not a regular file")
        await expect_error(fetch(a + "/big.wav", allowed=a, max_bytes=4000), "larger than", 413)
        await expect_error(fetch("file://example.com" + a + "/clip.wav", allowed=a), "local absolute path")
        await expect_error(fetch("file:" + a + "/clip.wav?x=1", allowed=a), "must not contain")
        await expect_error(fetch(a + "/clip\0.wav", allowed=a), "NUL byte")
    run(main())


# --- voice store ---------------------------------------------------------------------------------------------
def make_store(tmp_path, **kw) -> VoiceStore:
    return VoiceStore(str(tmp_path / "voices"), **kw)


def test_voice_store_lifecycle(tmp_path):
    store = make_store(tmp_path)
    first = store.add("Fox", CLIP, "fox.wav", "audio/wav", " The quick brown fox. ", "yes")
    assert isinstance(first, VoiceRecord) and first.name == "Fox" and first.ref_text == "The quick brown fox."
    assert first.to_json() == {"name": "Fox", "ref_text": "The quick brown fox.", "created_at": first.created_at,
                               "file_size": len(CLIP), "mime_type": "audio/wav",
                               "duration_s": round(len(CLIP_WAV) / 24000, 3), "consent": "yes"}
    assert store.get("fox") == first and store.get("FOX") == first and store.get("fo") is None
    np.testing.assert_array_equal(store.samples(first), CLIP_WAV)
    assert store.samples(first) is store.samples(first)  # cached, shared, read-only
    assert not store.samples(first).flags.writeable
    # re-upload (any case) replaces and bumps created_at strictly, even in a tight loop
    stamps = [first.created_at]
    for _ in range(3):
        stamps.append(store.add("fox", CLIP_22K, "f.flac", "audio/x-wav", None, None).created_at)
    assert stamps == sorted(stamps) and len(set(stamps)) == 4
    latest = store.get("Fox")
    assert latest.name == "fox" and latest.ref_text is None and latest.sample_rate == 22050
    assert store.samples(latest).shape[0] == resampled_length(N_22K, 22050)
    # the stored file is named by the store, with the decoded container's extension
    folder = tmp_path / "voices" / "fox"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("clip-")) == ["meta.json"]
    assert os.path.basename(latest.path).endswith(".wav")
    meta = json.loads((folder / "meta.json").read_text())
    for field in ("name", "ref_text", "created_at", "mime_type", "file_size", "consent", "sample_rate",
                  "duration_s"):
        assert field in meta
    store.add("b", CLIP, "b.wav", "audio/wav", "text", "consent-id-1")
    store.add("a", CLIP, None, None, None, None)
    assert [v.name for v in store.list()] == ["a", "b", "fox"] and len(store) == 3
    assert store.delete("FOX") and not store.delete("fox") and store.get("fox") is None
    assert [v.name for v in store.list()] == ["a", "b"]
    assert not store.delete("../etc") and not store.delete("")


def test_persistence_and_corrupt_entries(tmp_path, caplog):
    store = make_store(tmp_path)
    b = store.add("Bee", CLIP, "b.wav", "audio/wav", "text", "ok")
    store.add("gone", CLIP, "g.wav", "audio/wav", None, None)
    store.delete("gone")
    root = tmp_path / "voices"
    (root / "broken").mkdir()
    (root / "broken" / "meta.json").write_text("{not json")
    (root / "noclip").mkdir()
    (root / "noclip" / "meta.json").write_text(json.dumps(dict(b.to_json(), name="noclip", sample_rate=24000,
                                                                file="clip-1.wav")))
    (root / "mismatch").mkdir()
    (root / "mismatch" / "meta.json").write_text((root / "bee" / "meta.json").read_text())
    (root / "bee" / ".tmp-leftover").write_bytes(b"partial")
    (root / "stray.txt").write_text("not a voice")
    with caplog.at_level(logging.WARNING, logger="omni_tts.entrypoints.voices"):
        restored = VoiceStore(str(root))
    assert [v.name for v in restored.list()] == ["Bee"]
    assert restored.get("bee") == b  # every field, created_at included
    np.testing.assert_array_equal(restored.samples(restored.get("bee")), CLIP_WAV)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in warned for name in ("broken", "noclip", "mismatch"))
    assert not (root / "gone").exists() and not (root / "bee" / ".tmp-leftover").exists()
    # created_at keeps increasing after a restart
    assert restored.add("bee", CLIP, "b.wav", "audio/wav", None, None).created_at > b.created_at


def test_snapshot_survives_delete_and_replace(tmp_path):
    store = make_store(tmp_path)
    store.add("v", CLIP, "v.wav", "audio/wav", "t", None)
    cold = VoiceStore(store.root)  # a fresh store: nothing cached
    snapshot = cold.get("v")
    assert cold.delete("v") and cold.get("v") is None
    np.testing.assert_array_equal(cold.samples(snapshot), CLIP_WAV)  # the file outlives the delete (grace period)
    cold.add("v", CLIP, "v.wav", "audio/wav", "t", None)
    old = cold.get("v")
    cold.add("v", CLIP_22K, "v.wav", "audio/wav", "t", None)
    np.testing.assert_array_equal(cold.samples(old), CLIP_WAV)  # the replaced version, not the new one
    assert cold.samples(cold.get("v")).shape[0] == resampled_length(N_22K, 22050)
    # without a grace period the files go at once; a cached snapshot still works, an uncached one is a 404
    quick = VoiceStore(str(tmp_path / "quick"), retire_grace_s=0)
    cached = quick.add("q", CLIP, "q.wav", "audio/wav", None, None)
    quick.samples(cached)
    uncached = VoiceStore(quick.root, retire_grace_s=0).get("q")
    assert quick.delete("q") and not (tmp_path / "quick" / "q").exists()
    with pytest.raises(VoiceError, match="was deleted") as error:
        quick.samples(uncached)
    assert error.value.status == 404


@pytest.mark.parametrize("name", ["a", "A-b_c.d", "-x", "_", "x" * 64, "v1.2"])
def test_valid_names(name):
    assert VoiceStore.validate_name(name) == name


@pytest.mark.parametrize("name", ["", ".hidden", "..", "a/b", "a\\b", "a\0b", "a b", "é", "abc\n", "x" * 65, None])
def test_invalid_names(tmp_path, name):
    with pytest.raises(ValueError, match="voice name") as error:
        VoiceStore.validate_name(name)
    assert error.value.status == 400 and error.value.param == "name"
    store = make_store(tmp_path)
    with pytest.raises(VoiceError, match="voice name"):
        store.add(name, CLIP, "x.wav", "audio/wav", None, None)
    assert store.get(name) is None and store.list() == []


@pytest.mark.parametrize("audio,filename,mime,status,message", [
    (CLIP, "x.exe", "application/x-msdownload", 415, "extension '.exe' and type 'application/x-msdownload'"),
    (CLIP, "notes.txt", "", 415, "not supported"),
    (CLIP, "", "text/plain", 415, "type 'text/plain'"),
    (encode(tone(2), 24000, "AIFF"), "x.wav", "audio/wav", 415, "AIFF audio"),
    (b"not audio" * 100, "x.wav", "audio/wav", 400, "audio_sample is not a readable audio file"),
    (b"", "x.wav", "audio/wav", 400, "empty"),
    (b"\0" * (2 * 1024 * 1024), "x.wav", "audio/wav", 413, "larger than"),
    (encode(tone(0.5), 24000, "WAV"), "x.wav", "audio/wav", 400, "audio_sample is too short"),
    (encode(tone(31, 8000), 8000, "WAV"), "x.wav", "audio/wav", 400, "audio_sample is too long"),
], ids=["exe", "txt", "text-mime", "aiff", "not-audio", "empty", "too-large", "too-short", "too-long"])
def test_voice_store_rejects(tmp_path, audio, filename, mime, status, message):
    store = make_store(tmp_path, max_bytes=1024 * 1024)
    with pytest.raises(VoiceError, match=message) as error:
        store.add("ok", audio, filename, mime, None, None)
    assert error.value.status == status and store.list() == []
    assert os.listdir(store.root) == []


def test_voice_store_accepts_formats(tmp_path):
    store = make_store(tmp_path)
    for name, data, filename, mime, expected, extension in [
            ("w", CLIP, "upload", "application/octet-stream", "audio/wav", ".wav"),  # nothing to go on: decoded
            ("f", encode(tone(2), 24000, "FLAC"), "a.flac", "", "audio/flac", ".flac"),
            ("o", encode(tone(2), 24000, "OGG", "VORBIS"), "", "audio/ogg", "audio/ogg", ".ogg"),
            ("m", encode(tone(2), 24000, "MP3"), "a.mp3", "audio/mpeg", "audio/mpeg", ".mp3"),
            ("x", encode(tone(2), 24000, "FLAC"), "mislabelled.wav", "audio/wav", "audio/flac", ".flac")]:
        record = store.add(name, data, filename, mime, None, None)
        assert record.mime_type == expected and record.path.endswith(extension), record
        assert open(record.path, "rb").read() == data  # kept exactly as uploaded
        assert abs(store.samples(record).shape[0] - record.duration_s * 24000) < 2400


def test_voice_limit_and_cache_bound(tmp_path):
    store = make_store(tmp_path, max_voices=2, cache_bytes=2 * len(CLIP_WAV) * 4 - 1)
    store.add("a", CLIP, "a.wav", "audio/wav", None, None)
    store.add("b", CLIP, "b.wav", "audio/wav", None, None)
    with pytest.raises(VoiceError, match=r"voice limit reached \(2") as error:
        store.add("c", CLIP, "c.wav", "audio/wav", None, None)
    assert error.value.status == 409 and store.get("c") is None
    store.add("A", CLIP, "a.wav", "audio/wav", None, None)  # overwriting at the limit is fine
    info = store.cache_info()
    assert info["entries"] == 1 and info["bytes"] <= info["limit_bytes"]
    assert store.delete("b") and store.add("c", CLIP, "c.wav", "audio/wav", None, None).name == "c"


def test_concurrent_uploads(tmp_path):
    store = make_store(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        records = list(pool.map(lambda i: store.add(f"v{i % 4}", CLIP, "v.wav", "audio/wav", str(i), None),
                                range(16)))
        lookups = list(pool.map(lambda i: store.get(f"V{i % 4}"), range(16)))
    assert len({r.created_at for r in records}) == 16
    assert [v.name for v in store.list()] == ["v0", "v1", "v2", "v3"] and all(lookups)
    for v in store.list():  # the survivor of each name is its newest upload
        assert v.created_at == max(r.created_at for r in records if r.name == v.name)
    restored = VoiceStore(store.root)
    assert [v.to_json() for v in restored.list()] == [v.to_json() for v in store.list()]
