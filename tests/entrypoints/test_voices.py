"""Reference audio fetching (data URI, URL, allow-listed file) and the uploaded-voice store."""
import asyncio
import base64
import concurrent.futures
import io
import json
import logging
import os
import re
import struct
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from aiohttp import web

from conftest import FIXTURES
from audio_util import encode, flac_claiming, tone
from server_util import free_port
from waiting import eventually_async
import omni_tts.audio.ref_audio as ref_audio_module
from omni_tts.audio.ref_audio import URL_FAILED, RefAudioError, decode_reference, fetch_ref_audio
from omni_tts.audio.url_fetch import RemoteAudioFetcher, UrlPolicy
from omni_tts.voices.store import (CLOCK_FILE, LOCK_FILE, MAX_REF_TEXT_CHARS, ORPHAN_GRACE_S, VoiceError,
                                        VoiceRecord, VoiceStore, validate_name)
from omni_tts.models.qwen3_tts.audio import load_audio, resampled_length

FAILED = re.escape(URL_FAILED)
CLIP = (FIXTURES / "ref_voice.wav").read_bytes()          # 24 kHz, ~3.4 s
CLIP_22K = (FIXTURES / "ref_voice_22k.wav").read_bytes()  # 22.05 kHz
CLIP_WAV, _ = load_audio(CLIP)
N_22K = sf.info(io.BytesIO(CLIP_22K)).frames
POOL = concurrent.futures.ThreadPoolExecutor(2)


def fetch(value, allowed=None, fetcher=None, **kw):
    return fetch_ref_audio(value, allowed_local_path=allowed, fetcher=fetcher, executor=POOL, **kw)


def run(coro):
    return asyncio.run(coro)


def data_uri(data: bytes, mime="audio/wav") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


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
        await expect_error(fetch(data_uri(encode(tone(30.5), 24000, "WAV"))), r"too long: .*got 30.50 s")
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


def wav_claiming(data_bytes: int, present: bytes, rate=8000) -> bytes:
    """A hand-made 8-bit mono WAV whose header claims `data_bytes` of samples while `present` follows it."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)
    return (b"RIFF" + struct.pack("<I", min(36 + data_bytes, 2**32 - 1)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_bytes) + present)


def test_headers_claiming_hours_decode_nothing_big():
    # a FLAC header claiming 10 hours is refused from the header ("got 36000 s"): decoding would find 2 s
    with pytest.raises(RefAudioError, match=r"too long: it must last 1–30 s, got 36000.00 s"):
        decode_reference(flac_claiming(8000 * 3600 * 10, 2.0))
    # a WAV header claiming 149 hours (4 GiB of 8 kHz 8-bit samples) over 2 s of data: only what is there decodes
    assert decode_reference(wav_claiming(2**32 - 16, b"\x80" * 16000)).duration_s == 2.0
    # length unknown to the header (streamed FLAC): decoding stops a second past the limit
    with pytest.raises(RefAudioError, match=r"too long: it must last 1–30 s, got more than 31 s"):
        decode_reference(flac_claiming(0, 60.0))


def test_decoding_runs_in_the_executor(monkeypatch):
    threads = []
    real = ref_audio_module.load_audio

    def spy(source, **kwargs):
        threads.append(threading.get_ident())
        return real(source, **kwargs)

    monkeypatch.setattr(ref_audio_module, "load_audio", spy)

    async def main():
        await fetch(data_uri(CLIP_22K))
        return threading.get_ident()

    loop_thread = run(main())
    assert threads and loop_thread not in threads


# --- http(s) URLs --------------------------------------------------------------------------------------------
class LoopbackSite:
    """A real aiohttp server on a loopback address that counts the requests reaching it."""

    def __init__(self, host="127.0.0.1"):
        self.host, self.hits, self.stop = host, [], asyncio.Event()

    async def __aenter__(self):
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

        async def hang(request):
            await self.stop.wait()
            return web.Response(body=CLIP)

        async def trickle(request):  # headers at once, body trickles: the total timeout still applies
            response = web.StreamResponse(headers={"Content-Length": str(len(CLIP))})
            await response.prepare(request)
            await response.write(CLIP[:1000])
            await self.stop.wait()
            return response

        async def redirect(request):  # ?to=URL, or a chain of n redirects to the clip with ?n=
            n = int(request.query.get("n", 0))
            raise web.HTTPFound(request.query.get("to") or (f"/redirect?n={n - 1}" if n > 1 else "/clip.wav"))

        async def page(request):
            return web.Response(text="<html><body>not audio</body></html>", content_type="text/html")

        @web.middleware
        async def count(request, handler):
            self.hits.append(request.path_qs)
            return await handler(request)

        app = web.Application(middlewares=[count])
        app.router.add_routes([web.get("/clip.wav", clip), web.get("/big", big_chunked),
                               web.get("/declared", big_declared), web.get("/hang", hang),
                               web.get("/trickle", trickle), web.get("/redirect", redirect),
                               web.get("/page.html", page)])
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, 0).start()
        self.url = f"http://{self.host}:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        await self.runner.cleanup()


def fetcher_for(*allowed, **kw) -> RemoteAudioFetcher:
    return RemoteAudioFetcher(UrlPolicy.parse(allowed), **kw)


def test_url_fetching_with_limits():
    async def main():
        async with LoopbackSite() as site:
            fetcher = fetcher_for("127.0.0.1", timeout_s=0.5)
            try:
                np.testing.assert_array_equal(await fetch(site.url + "/clip.wav", fetcher=fetcher), CLIP_WAV)
                np.testing.assert_array_equal(await fetch(site.url + "/redirect?n=3", fetcher=fetcher), CLIP_WAV)
                await expect_error(fetch(site.url + "/redirect?n=4", fetcher=fetcher), FAILED)  # 4 hops > 3
                await expect_error(fetch(site.url + "/big", fetcher=fetcher, max_bytes=1_000_000), "larger than", 413)
                await expect_error(fetch(site.url + "/declared", fetcher=fetcher, max_bytes=1_000_000), "larger", 413)
                await expect_error(fetch(site.url + "/hang", fetcher=fetcher), FAILED)
                await expect_error(fetch(site.url + "/trickle", fetcher=fetcher), FAILED)
            finally:
                await fetcher.close()
    run(main())


def test_url_fetch_failures_all_read_the_same():
    """404, an HTML page, a closed port, a refused address, a timeout, junk: one message, no port-scanning oracle."""
    async def main():
        async with LoopbackSite() as site:
            closed = f"http://127.0.0.1:{free_port()}/clip.wav"
            allowed, default = fetcher_for("127.0.0.1", timeout_s=0.5), fetcher_for()
            try:
                for fetcher, url in [(allowed, site.url + "/missing"), (allowed, site.url + "/page.html"),
                                     (allowed, closed), (allowed, site.url + "/hang"), (allowed, "http://[::1/x.wav"),
                                     (allowed, site.url.replace("http:", "https:") + "/clip.wav"),
                                     (default, site.url + "/clip.wav")]:
                    with pytest.raises(RefAudioError) as error:
                        await fetch(url, fetcher=fetcher)
                    assert (str(error.value), error.value.status) == (URL_FAILED, 400), url
            finally:
                await allowed.close()
                await default.close()
    run(main())


def test_non_public_addresses_are_refused_before_any_request():
    async def main():
        async with LoopbackSite() as site, LoopbackSite("127.0.0.2") as other:
            port = site.url.rsplit(":", 1)[1]
            default, by_name, by_net = fetcher_for(), fetcher_for("LOCALHOST"), fetcher_for("127.0.0.2/32")
            try:
                # by address, by a name resolving to loopback, by a numeric form: refused, and nothing arrives
                for url in (site.url + "/clip.wav", f"http://localhost:{port}/clip.wav",
                            f"http://0x7f000001:{port}/clip.wav", f"http://[::ffff:127.0.0.1]:{port}/clip.wav"):
                    await expect_error(fetch(url, fetcher=default), FAILED)
                assert site.hits == []
                # an allow-listed host or network is fetched
                np.testing.assert_array_equal(await fetch(f"http://localhost:{port}/clip.wav", fetcher=by_name),
                                              CLIP_WAV)
                np.testing.assert_array_equal(await fetch(other.url + "/clip.wav", fetcher=by_net), CLIP_WAV)
                assert site.hits == ["/clip.wav"] and other.hits == ["/clip.wav"]
                # a redirect from an allowed host to one that is not: the hop is checked, the target never asked
                hop = other.url + "/redirect?to=" + urllib.parse.quote(site.url + "/clip.wav")
                await expect_error(fetch(hop, fetcher=by_net), FAILED)
                assert site.hits == ["/clip.wav"] and len(other.hits) == 2
            finally:
                for fetcher in (default, by_name, by_net):
                    await fetcher.close()
    run(main())


@pytest.mark.parametrize("address,public", [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("224.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("::", False),
    ("fd00:ec2::254", False), ("fe80::1%eth0", False), ("ff02::1", False), ("::ffff:10.0.0.1", False),
    ("64:ff9b::a00:1", False), ("2002:a00:1::", False)])
def test_address_policy(address, public):
    assert UrlPolicy().permits("example.com", address) is public
    assert UrlPolicy.parse(["0.0.0.0/0", "::/0"]).permits("example.com", address)
    assert UrlPolicy.parse(["Example.COM."]).permits("example.com", address)


def test_address_policy_rejects_junk_entries():
    with pytest.raises(ValueError, match="neither an IP address"):
        UrlPolicy.parse(["http://example.com"])


def test_urls_disabled_and_concurrent_fetches_bounded():
    async def main():
        await expect_error(fetch("http://example.com/a.wav"), "URLs are disabled on this server")
        async with LoopbackSite() as site:
            fetcher = fetcher_for("127.0.0.1", max_concurrent=2, timeout_s=1.0)
            try:
                hanging = [asyncio.create_task(fetch(site.url + "/hang", fetcher=fetcher)) for _ in range(2)]
                await eventually_async(lambda: len(site.hits) == 2, what="both hanging fetches started")
                await expect_error(fetch(site.url + "/clip.wav", fetcher=fetcher), "already in progress", 429)
                # refused while both slots were held (not after waiting for one), and without a fetch of its own
                assert not any(task.done() for task in hanging) and len(site.hits) == 2
                for task in hanging:
                    await expect_error(task, FAILED)
                assert (await fetch(site.url + "/clip.wav", fetcher=fetcher)).shape == CLIP_WAV.shape  # freed
            finally:
                await fetcher.close()
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


def record_of(store: VoiceStore, name: str) -> VoiceRecord | None:
    loaded = store.load(name)
    return loaded and loaded[0]


def files_under(path) -> list[str]:
    """The voices under a store's root, folders included (an empty folder is a leftover too), less the store's own
    bookkeeping (its lock and created_at high-water mark)."""
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*")
                  if not (p.parent == Path(path) and p.name in (LOCK_FILE, CLOCK_FILE)) and not
                  (p.is_dir() and any(p.iterdir())))


def age(*paths) -> None:
    """Make files look older than the sweep's grace period, as a crash's leftovers are by the next start."""
    old = time.time() - ORPHAN_GRACE_S - 5
    for path in paths:
        os.utime(path, (old, old))


def test_voice_store_lifecycle(tmp_path):
    store = make_store(tmp_path)
    first = store.add("Fox", CLIP, " The quick brown fox. ", "yes")
    assert isinstance(first, VoiceRecord) and first.name == "Fox" and first.ref_text == "The quick brown fox."
    assert first.to_json() == {"id": "Fox", "object": "audio.voice", "type": "audio_sample", "name": "Fox",
                               "ref_text": "The quick brown fox.", "created_at": first.created_at,
                               "file_size": len(CLIP), "mime_type": "audio/wav",
                               "duration_s": round(len(CLIP_WAV) / 24000, 3), "consent": "yes",
                               "speaker_description": None, "embedding_source": "audio", "embedding_dim": None}
    assert isinstance(first.created_at, int) and abs(first.created_at - time.time()) < 60
    assert "fox" in store and "FOX" in store and "fo" not in store
    assert record_of(store, "fox") == first and record_of(store, "FOX") == first and store.load("fo") is None
    record, samples = store.load("fox")
    np.testing.assert_array_equal(samples, CLIP_WAV)
    assert store.load("fox")[1] is samples and not samples.flags.writeable  # cached, shared, read-only
    # re-upload (any case) replaces and bumps created_at strictly, in whole seconds, even in a tight loop
    stamps = [first.created_at]
    for _ in range(3):
        stamps.append(store.add("fox", CLIP_22K, None, None).created_at)
    assert stamps == sorted(stamps) and len(set(stamps)) == 4 and all(isinstance(t, int) for t in stamps)
    latest, samples = store.load("Fox")
    assert latest.name == "fox" and latest.ref_text is None and latest.sample_rate == 22050
    assert samples.shape[0] == resampled_length(N_22K, 22050)
    # the stored file is named by the store, with the decoded container's extension
    folder = tmp_path / "voices" / "fox"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("clip-")) == ["meta.json"]
    assert os.path.basename(latest.path).endswith(".wav")
    meta = json.loads((folder / "meta.json").read_text())
    for field in ("name", "ref_text", "created_at", "mime_type", "file_size", "consent", "sample_rate",
                  "duration_s"):
        assert field in meta
    store.add("b", CLIP, "text", "consent-id-1")
    store.add("a", CLIP, None, None)
    assert [v.name for v in store.list()] == ["a", "b", "fox"] and len(store) == 3
    assert store.delete("FOX") == latest and store.delete("fox") is None and store.load("fox") is None
    assert [v.name for v in store.list()] == ["a", "b"]
    assert not store.delete("../etc") and not store.delete("")


def test_persistence_and_corrupt_entries(tmp_path, caplog):
    store = make_store(tmp_path)
    b = store.add("Bee", CLIP, "text", "ok")
    store.add("gone", CLIP, None, None)
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
    (root / "bee" / "clip-0-dead.wav").write_bytes(CLIP)  # a replaced version a crash left behind
    age(root / "bee" / ".tmp-leftover", root / "bee" / "clip-0-dead.wav")
    (root / "stray.txt").write_text("not a voice")
    with caplog.at_level(logging.WARNING, logger="omni_tts.voices.store"):
        restored = VoiceStore(str(root))
    assert [v.name for v in restored.list()] == ["Bee"]
    record, samples = restored.load("bee")
    assert record == b  # every field, created_at included
    np.testing.assert_array_equal(samples, CLIP_WAV)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in warned for name in ("broken", "noclip", "mismatch"))
    assert not (root / "gone").exists() and sorted(os.listdir(root / "bee")) == [os.path.basename(b.path),
                                                                                "meta.json"]
    # created_at keeps increasing after a restart
    assert restored.add("bee", CLIP, None, None).created_at > b.created_at


def test_fractional_created_at_of_older_stores_is_restored_rounded_up(tmp_path):
    """Stores written when created_at was a float: each voice comes back with an integer version, and new uploads
    still get later ones."""
    store = make_store(tmp_path)
    store.add("old", CLIP, None, None)
    meta_path = tmp_path / "voices" / "old" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["created_at"] = 4_000_000_000.25  # later than the clock: the next upload must still come after it
    meta_path.write_text(json.dumps(meta))
    restored = VoiceStore(store.root)
    assert record_of(restored, "old").created_at == 4_000_000_001
    assert restored.add("new", CLIP, None, None).created_at == 4_000_000_002


def test_replaced_and_deleted_clips_leave_the_disk_at_once(tmp_path):
    """The probe: 40 overwrites of a voice left 40 clips on disk, still there after DELETE."""
    store = make_store(tmp_path)
    root = tmp_path / "voices"
    for i in range(40):
        store.add("big", CLIP if i % 2 else CLIP_22K, None, None)
    record = record_of(store, "big")
    assert files_under(root) == [f"big/{os.path.basename(record.path)}", "big/meta.json"]
    assert store.delete("big") and files_under(root) == []
    assert VoiceStore(str(root)).list() == []


def test_a_clip_being_read_outlives_its_replacement_until_the_read_ends(tmp_path):
    store = make_store(tmp_path)
    old = store.add("v", CLIP, "t", None)
    cold = VoiceStore(store.root)   # nothing cached: load reads the file
    with cold._lock:                # a load that has looked the voice up and pinned its clip, as load does
        cold._pins[old.path] += 1
    cold.add("v", CLIP_22K, "t", None)
    assert os.path.exists(old.path)          # still being read
    cold._unpin(old.path)                    # the read ends
    assert not os.path.exists(old.path)
    new, samples = cold.load("v")
    assert new.created_at > old.created_at and samples.shape[0] == resampled_length(N_22K, 22050)
    with cold._lock:
        cold._pins[new.path] += 1
    assert cold.delete("v") and os.path.exists(new.path)
    cold._unpin(new.path)
    assert files_under(cold.root) == []      # the clip and its folder


@pytest.mark.parametrize("name", ["a", "A-b_c.d", "-x", "_", "x" * 64, "v1.2"])
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", ".hidden", "..", "a/b", "a\\b", "a\0b", "a b", "é", "abc\n", "x" * 65, None])
def test_invalid_names(tmp_path, name):
    with pytest.raises(ValueError, match="voice name") as error:
        validate_name(name)
    assert error.value.status == 400 and error.value.param == "name"
    store = make_store(tmp_path)
    with pytest.raises(VoiceError, match="voice name"):
        store.add(name, CLIP, None, None)
    assert store.load(name) is None and store.list() == []


@pytest.mark.parametrize("audio,ref_text,status,param,message", [
    (encode(tone(2), 24000, "AIFF"), None, 415, "audio_sample", "AIFF audio"),
    (b"not audio" * 100, None, 400, "audio_sample", "audio_sample is not a readable audio file"),
    (b"", None, 400, "audio_sample", "empty"),
    (b"\0" * (2 * 1024 * 1024), None, 413, "audio_sample", "larger than"),
    (encode(tone(0.5), 24000, "WAV"), None, 400, "audio_sample", "audio_sample is too short"),
    (encode(tone(31, 8000), 8000, "WAV"), None, 400, "audio_sample", "audio_sample is too long"),
    (CLIP, "x" * (MAX_REF_TEXT_CHARS + 1), 400, "ref_text", f"ref_text is longer than {MAX_REF_TEXT_CHARS}"),
], ids=["aiff", "not-audio", "empty", "too-large", "too-short", "too-long", "long-ref-text"])
def test_voice_store_rejects(tmp_path, audio, ref_text, status, param, message):
    store = make_store(tmp_path, max_bytes=1024 * 1024)
    with pytest.raises(VoiceError, match=message) as error:
        store.add("ok", audio, ref_text, None)
    assert (error.value.status, error.value.param) == (status, param) and store.list() == []
    assert files_under(store.root) == []
    assert store.add("ok", CLIP, "y" * MAX_REF_TEXT_CHARS, None).ref_text == "y" * MAX_REF_TEXT_CHARS


def test_voice_store_sniffs_the_container(tmp_path):
    store = make_store(tmp_path)
    for name, data, expected, extension in [
            ("w", CLIP, "audio/wav", ".wav"),
            ("f", encode(tone(2), 24000, "FLAC"), "audio/flac", ".flac"),
            ("o", encode(tone(2), 24000, "OGG", "VORBIS"), "audio/ogg", ".ogg"),
            ("m", encode(tone(2), 24000, "MP3"), "audio/mpeg", ".mp3")]:
        record = store.add(name, data, None, None)
        assert record.mime_type == expected and record.path.endswith(extension), record
        assert open(record.path, "rb").read() == data  # kept exactly as uploaded
        assert abs(store.load(name)[1].shape[0] - record.duration_s * 24000) < 2400


def test_voice_limit_quota_and_cache_bound(tmp_path):
    store = make_store(tmp_path, max_voices=2, cache_bytes=2 * len(CLIP_WAV) * 4 - 1)
    store.add("a", CLIP, None, None)
    store.add("b", CLIP, None, None)
    with pytest.raises(VoiceError, match=r"voice limit reached \(2") as error:
        store.add("c", CLIP, None, None)
    assert error.value.status == 409 and store.load("c") is None
    store.add("A", CLIP, None, None)  # overwriting at the limit is fine
    info = store.cache_info()
    assert info["entries"] == 1 and info["bytes"] <= info["limit_bytes"]
    assert store.delete("b") and store.add("c", CLIP, None, None).name == "c"
    # the quota counts the live clips; a replacement counts in place of the clip it replaces
    quota = make_store(tmp_path / "q", quota_bytes=2 * len(CLIP) + 10)
    quota.add("a", CLIP, None, None)
    quota.add("b", CLIP, None, None)
    with pytest.raises(VoiceError, match="voice store is full") as error:
        quota.add("c", CLIP_22K, None, None)
    assert error.value.status == 413 and quota.load("c") is None
    quota.add("a", CLIP_22K, None, None)
    assert quota.delete("b") and quota.add("c", CLIP, None, None).name == "c"


def test_concurrent_uploads(tmp_path):
    store = make_store(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        records = list(pool.map(lambda i: store.add(f"v{i % 4}", CLIP, str(i), None), range(16)))
        lookups = list(pool.map(lambda i: store.load(f"V{i % 4}"), range(16)))
    assert len({r.created_at for r in records}) == 16
    assert [v.name for v in store.list()] == ["v0", "v1", "v2", "v3"] and all(lookups)
    for v in store.list():  # the survivor of each name is its newest upload
        assert v.created_at == max(r.created_at for r in records if r.name == v.name)
    assert len(files_under(tmp_path / "voices")) == 8  # one clip and one meta.json per voice
    restored = VoiceStore(store.root)
    assert [v.to_json() for v in restored.list()] == [v.to_json() for v in store.list()]
