"""Reference audio for voice cloning from a request: a `data:` base64 URI, an http(s) URL, or an allow-listed file.

Everything here is untrusted input. Accepted forms of the `ref_audio` string (serving contract §2):

- `data:[<mediatype>][;params];base64,<data>` — the media type is not trusted (the bytes are sniffed by
  libsndfile); whitespace and missing `=` padding in the base64 are tolerated, URL-safe `-`/`_` too. The encoded
  length is checked against `max_bytes` before anything is decoded. Raw base64 without the `data:` prefix is
  **refused** on purpose: the base64 alphabet contains `/`, so a bare base64 string cannot be told apart from an
  absolute path, and a typo would produce a misleading error.
- `http://…` / `https://…` — only through a `RemoteAudioFetcher` (the server has one only when started with
  `--allow-remote-ref-audio`), and only to public unicast addresses unless its `UrlPolicy` names the host or
  network: every address a host name resolves to is checked and the connection goes to a checked address (the
  check sits in the connector's resolver, so a DNS answer cannot change between check and connect); redirects are
  followed by hand, each hop checked, at most `MAX_REDIRECTS`; one time limit covers every hop and the body; the
  body is capped at `max_bytes`; at most `MAX_CONCURRENT_FETCHES` fetches run at once (beyond: 429). Every failure
  (refused address, DNS, connection, HTTP status, timeout, redirects, an answer that is not audio) gives the one
  message `URL_FAILED`, so the server is no oracle for what listens where; the detail goes to the server log.
- `file:///abs/path` (or `file://localhost/…`, percent-encoding decoded) or a bare absolute path — only when the
  server names an allowed directory, and only if the fully resolved path (symlinks and `..` resolved) lies inside
  it; the opened descriptor is checked again, so a symlink swapped in between check and open cannot escape.

Any libsndfile-readable container is accepted (wav, flac, ogg/vorbis/opus, mp3, aiff, …); the clip is averaged to
mono, resampled to 24 kHz (`omni_tts.models.qwen3_tts.audio`), and its duration must lie in [min_seconds,
max_seconds] (1–30 s by default, measured before resampling). Decompression bombs: a header claiming more than the
limit is refused before decoding, and decoding stops a second past the limit whatever the header said (compressed
formats may not know their length).

Errors: every failure raises `RefAudioError(message, status)`; `status` is 413 when the clip is larger than
`max_bytes`, 429 when too many URL fetches run, and 400 for everything else. Messages start with the field name
(`ref_audio` by default), never carry library text (libsndfile, aiohttp), and are meant to be shown to users
verbatim.

Event loop: base64 decoding, file reads, audio decoding and resampling all run in the given executor; only the
async HTTP read runs on the loop.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import ipaddress
import logging
import math
import os
import re
import socket
import stat
import urllib.parse
from dataclasses import dataclass
from typing import Iterable

import aiohttp
import numpy as np
import soundfile as sf
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE, load_audio, resample_to

logger = logging.getLogger(__name__)

MAX_BYTES = 10 * 1024 * 1024
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0
MIN_SOURCE_RATE, MAX_SOURCE_RATE = 8000, 384000   # below 8 kHz is not speech audio; above is nonsense for a voice
MAX_CHANNELS = 16
MAX_CONCURRENT_FETCHES = 8     # outbound ref_audio downloads at once; more are answered 429
MAX_REDIRECTS = 3
FETCH_TIMEOUT_S = 10.0         # every hop, headers and body together
URL_FAILED = ("ref_audio URL could not be fetched: it must be an http(s) URL of a public host that answers 200 "
              "with an audio file")
_UNKNOWN_FRAMES = 2 ** 63 - 1  # libsndfile's frame count for a stream of unknown length
_READ_BLOCK = 64 * 1024
_URL_SAFE = str.maketrans("-_", "+/")
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_HOSTNAME = re.compile(r"(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*")
# IPv6 ranges that carry an IPv4 address the stack may route to (NAT64, 6to4, IPv4-compatible): what they lead to
# is not known from the IPv6 address, so they count as non-public
_IPV4_CARRIERS = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "::/96"))


class RefAudioError(ValueError):
    """Unusable reference audio; `status` is the HTTP status to answer (400, 413 when too large, 429 when busy)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class NotAudioError(RefAudioError):
    """The bytes are not audio libsndfile can read (a fetched URL answers with `URL_FAILED` instead)."""


@dataclass(frozen=True)
class DecodedClip:
    samples: np.ndarray      # float32 mono at 24 kHz
    source_rate: int         # sample rate of the file as given
    duration_s: float        # duration before resampling
    format: str              # libsndfile major format: WAV, WAVEX, FLAC, OGG, MP3, …
    subtype: str             # libsndfile subtype: PCM_16, VORBIS, OPUS, MPEG_LAYER_III, …


def _too_large(label: str, max_bytes: int) -> RefAudioError:
    return RefAudioError(f"{label} is larger than the {max_bytes}-byte limit ({max_bytes / 2**20:g} MiB)", 413)


def _not_audio(label: str) -> NotAudioError:
    return NotAudioError(f"{label} is not a readable audio file; send wav, flac, ogg or mp3")


def _bad_duration(label: str, min_seconds: float, max_seconds: float, got: str, what: str) -> RefAudioError:
    return RefAudioError(f"{label} is too {what}: it must last {min_seconds:g}–{max_seconds:g} s, got {got}")


def decode_reference(data: bytes, *, min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS,
                     label: str = "ref_audio") -> DecodedClip:
    """Encoded audio file bytes → `DecodedClip` (24 kHz mono float32), duration checked. Blocking: run off the loop.

    The header is read first (`soundfile.info`): a file whose header claims more than `max_seconds` is refused
    before it is decoded, and decoding stops a second past `max_seconds` whatever the header said.
    """
    if not data:
        raise RefAudioError(f"{label} is empty (0 bytes)")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:  # libsndfile raises LibsndfileError / RuntimeError / TypeError for junk
        logger.info("%s: libsndfile cannot read its header: %s", label, e)
        raise _not_audio(label) from None
    if not MIN_SOURCE_RATE <= info.samplerate <= MAX_SOURCE_RATE:
        raise RefAudioError(f"{label} has sample rate {info.samplerate} Hz; supported: "
                            f"{MIN_SOURCE_RATE}–{MAX_SOURCE_RATE} Hz")
    if not 1 <= info.channels <= MAX_CHANNELS:
        raise RefAudioError(f"{label} has {info.channels} channels; at most {MAX_CHANNELS} are supported")
    # frame counts of compressed formats are estimates: refuse from the header only when clearly too long
    if 0 < info.frames < _UNKNOWN_FRAMES and info.frames / info.samplerate > max_seconds + 1.0:
        raise _bad_duration(label, min_seconds, max_seconds, f"{info.frames / info.samplerate:.2f} s", "long")
    max_frames = None if math.isinf(max_seconds) else math.ceil((max_seconds + 1.0) * info.samplerate)
    try:
        wav, sr = load_audio(data, max_frames=max_frames)
    except ValueError as e:
        logger.info("%s: libsndfile cannot decode it: %s", label, e)
        raise _not_audio(label) from None
    if max_frames is not None and wav.shape[0] >= max_frames:  # decoding stopped at the cap
        raise _bad_duration(label, min_seconds, max_seconds, f"more than {max_seconds + 1.0:g} s", "long")
    seconds = wav.shape[0] / sr
    if not min_seconds <= seconds <= max_seconds:
        raise _bad_duration(label, min_seconds, max_seconds, f"{seconds:.2f} s",
                            "short" if seconds < min_seconds else "long")
    samples = np.ascontiguousarray(resample_to(wav, sr, SAMPLE_RATE), dtype=np.float32)
    return DecodedClip(samples, int(sr), float(seconds), str(info.format), str(info.subtype))


def decode_clip(data: bytes, min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS,
                label: str = "ref_audio") -> np.ndarray:
    """Encoded audio file bytes → float32 mono at 24 kHz, with the duration checked (see `decode_reference`)."""
    return decode_reference(data, min_seconds=min_seconds, max_seconds=max_seconds, label=label).samples


# --- data: URIs --------------------------------------------------------------------------------------------------
def decode_data_uri(value: str, max_bytes: int = MAX_BYTES) -> bytes:
    """`data:[mediatype][;params];base64,<data>` → the decoded bytes. Blocking for large values: run off the loop."""
    value = value.strip()
    comma = value.find(",")
    if not value[:5].lower() == "data:" or comma < 0:
        raise RefAudioError("ref_audio data URI is malformed: expected data:audio/wav;base64,<data>")
    params = [p.strip().lower() for p in value[5:comma].split(";")]
    if "base64" not in params[1:]:
        raise RefAudioError("ref_audio data URI must be base64 encoded: data:audio/wav;base64,<data>")
    payload = value[comma + 1:]
    if any(ws in payload for ws in (" ", "\n", "\r", "\t")):
        payload = "".join(payload.split())
    if not payload:
        raise RefAudioError("ref_audio data URI holds no data")
    if (len(payload) // 4) * 3 > max_bytes + 3:
        raise _too_large("ref_audio", max_bytes)
    if "-" in payload or "_" in payload:
        payload = payload.translate(_URL_SAFE)
    payload += "=" * (-len(payload) % 4)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RefAudioError("ref_audio data URI holds invalid base64") from None
    if len(data) > max_bytes:
        raise _too_large("ref_audio", max_bytes)
    return data


# --- local files -------------------------------------------------------------------------------------------------
def _local_path(value: str) -> str:
    if value[:5].lower() == "file:":
        parsed = urllib.parse.urlsplit(value)
        if parsed.netloc not in ("", "localhost"):
            raise RefAudioError("ref_audio file URL must name a local absolute path: file:///path/to/clip.wav")
        if parsed.query or parsed.fragment:
            raise RefAudioError("ref_audio file URL must not contain '?' or '#' (percent-encode them)")
        path = urllib.parse.unquote(parsed.path)
    else:
        path = value
    if "\0" in path:
        raise RefAudioError("ref_audio path contains a NUL byte")
    if not os.path.isabs(path):
        raise RefAudioError("ref_audio file path must be absolute")
    return path


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def read_local_file(value: str, allowed_local_path: str | None, max_bytes: int = MAX_BYTES) -> bytes:
    """`file:///…` or an absolute path inside `allowed_local_path` → its bytes. Blocking: run off the loop."""
    if not allowed_local_path:
        raise RefAudioError("ref_audio local files are disabled on this server (start it with "
                            "--allowed-local-media-path); send a data: URI or an http(s) URL instead")
    path = _local_path(value)
    root = os.path.realpath(allowed_local_path)
    real = os.path.realpath(path)  # resolves every symlink and '..'
    if not _inside(real, root):
        raise RefAudioError(f"ref_audio path {path!r} is outside the allowed local media directory")
    try:
        # O_NONBLOCK: a FIFO inside the directory must not hang the worker; O_NOFOLLOW: the last component is
        # already resolved, so a symlink here means it was swapped in after the check
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise RefAudioError(f"ref_audio file not found: {path}") from None
    except OSError as e:
        raise RefAudioError(f"ref_audio file cannot be opened: {path} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefAudioError(f"ref_audio path is not a regular file: {path}")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        proc = f"/proc/self/fd/{f.fileno()}"
        if os.path.exists(proc) and not _inside(os.path.realpath(proc), root):  # an intermediate directory moved
            raise RefAudioError(f"ref_audio path {path!r} is outside the allowed local media directory")
        if st.st_size > max_bytes:
            raise _too_large("ref_audio", max_bytes)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_large("ref_audio", max_bytes)
    return data


# --- URLs --------------------------------------------------------------------------------------------------------
class _Refused(Exception):
    """A URL fetch that must not go on; the message is for the server log only."""


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global unicast address: not loopback, private (RFC 1918, ULA), link-local (cloud metadata lives there),
    shared, reserved, multicast or unspecified."""
    if isinstance(ip, ipaddress.IPv6Address) and any(ip in carrier for carrier in _IPV4_CARRIERS):
        return False
    return ip.is_global and not ip.is_multicast


@dataclass(frozen=True)
class UrlPolicy:
    """Where ref_audio URLs may lead: public unicast addresses, plus the hosts and networks the operator names."""
    allowed_hosts: frozenset[str] = frozenset()     # lower-case host names, whatever they resolve to
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> UrlPolicy:
        """`["10.0.0.0/8", "127.0.0.1", "::1", "media.internal"]` → the policy; ValueError for anything else."""
        hosts, networks = set(), []
        for entry in entries:
            entry = entry.strip().lower()
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                name = entry.rstrip(".")
                if not _HOSTNAME.fullmatch(name):
                    raise ValueError(f"{entry!r} is neither an IP address, a network (CIDR) nor a host name") from None
                hosts.add(name)
        return cls(frozenset(hosts), tuple(networks))

    def permits(self, host: str, address: str) -> bool:
        """May a request for `host` connect to `address` (an IP address string, IPv6 scope allowed)?"""
        if host.lower().rstrip(".") in self.allowed_hosts:
            return True
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self.allowed_networks) or _is_public(ip)


class _CheckedResolver(AbstractResolver):
    """The connector's resolver: a host name whose answer holds any refused address is refused as a whole, and the
    connector connects only to the addresses returned here, so a second DNS answer cannot swap in another."""

    def __init__(self, policy: UrlPolicy) -> None:
        self._policy, self._resolver = policy, aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        answers = await self._resolver.resolve(host, port, family)
        refused = [a["host"] for a in answers if not self._policy.permits(host, a["host"])]
        if refused:
            raise _Refused(f"{host} resolves to {', '.join(refused)}, which is not a public address")
        return answers

    async def close(self) -> None:
        await self._resolver.close()


def _origin(url: str) -> str:
    """What the log may say about a URL: scheme, host and port (paths and queries may carry secrets)."""
    try:
        return str(yarl.URL(url).origin())
    except ValueError:
        return "(malformed URL)"


class RemoteAudioFetcher:
    """Fetches ref_audio URLs for a server: policy-checked addresses, bounded in concurrency, hops, time and size.

    One per server (it owns an `aiohttp.ClientSession`, opened on first use inside the event loop; `close` it).
    """

    def __init__(self, policy: UrlPolicy, *, max_concurrent: int = MAX_CONCURRENT_FETCHES,
                 max_redirects: int = MAX_REDIRECTS, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.policy, self.max_concurrent, self.max_redirects, self.timeout_s = (policy, max_concurrent,
                                                                                 max_redirects, timeout_s)
        self._active = 0
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, url: str, max_bytes: int = MAX_BYTES) -> bytes:
        """GET `url` → body bytes; `RefAudioError` with `URL_FAILED` for every failure, 413 too large, 429 busy."""
        if self._active >= self.max_concurrent:
            raise RefAudioError(f"ref_audio: {self.max_concurrent} reference-audio downloads are already in "
                                "progress; retry shortly or send a data: URI", 429)
        self._active += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._follow(yarl.URL(url), max_bytes)
        except RefAudioError:
            raise
        except TimeoutError:
            logger.warning("ref_audio: fetching from %s took longer than %g s", _origin(url), self.timeout_s)
        except (_Refused, aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: yarl / IDNA junk
            logger.warning("ref_audio: fetching from %s failed: %s", _origin(url), str(e) or type(e).__name__)
        finally:
            self._active -= 1
        raise RefAudioError(URL_FAILED)

    async def _follow(self, url: yarl.URL, max_bytes: int) -> bytes:
        for hop in range(self.max_redirects + 1):
            if url.scheme not in ("http", "https") or not url.host:
                raise _Refused(f"{url.scheme}: URLs are not fetched")
            if _is_ip_literal(url.host) and not self.policy.permits(url.host, url.host):  # no resolver for these
                raise _Refused(f"{url.host} is not a public address")
            async with self._open_session().get(url, allow_redirects=False,
                                                headers={"Accept-Encoding": "identity"}) as response:
                if response.status in _REDIRECT_STATUSES and "Location" in response.headers:
                    url = response.url.join(yarl.URL(response.headers["Location"]))
                    continue
                if response.status != 200:
                    raise _Refused(f"HTTP {response.status}")
                return await _read_capped(response, max_bytes)
        raise _Refused(f"more than {self.max_redirects} redirects")

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # no cookies carried between hops or requests; no transparent decompression (a gzip bomb would
            # inflate past the size cap inside one network read)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=_CheckedResolver(self.policy), limit=self.max_concurrent),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    if response.content_length is not None and response.content_length > max_bytes:
        raise _too_large("ref_audio", max_bytes)
    data = bytearray()
    async for block in response.content.iter_chunked(_READ_BLOCK):
        data += block
        if len(data) > max_bytes:
            raise _too_large("ref_audio", max_bytes)
    return bytes(data)


# --- entry point -------------------------------------------------------------------------------------------------
def _data_uri_to_clip(value: str, max_bytes: int, min_seconds: float, max_seconds: float) -> np.ndarray:
    return decode_clip(decode_data_uri(value, max_bytes), min_seconds, max_seconds)


def _local_to_clip(value: str, allowed: str | None, max_bytes: int, min_seconds: float,
                   max_seconds: float) -> np.ndarray:
    return decode_clip(read_local_file(value, allowed, max_bytes), min_seconds, max_seconds)


async def fetch_ref_audio(value: str, *, allowed_local_path: str | None, fetcher: RemoteAudioFetcher | None,
                          executor: concurrent.futures.Executor, max_bytes: int = MAX_BYTES,
                          min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """The request's `ref_audio` string → float32 mono samples at 24 kHz; `RefAudioError` otherwise.

    `fetcher=None`: http(s) URLs are refused. Returns a fresh array the caller may keep.
    """
    if not isinstance(value, str) or not value.strip():
        raise RefAudioError("ref_audio must be a non-empty string")
    loop = asyncio.get_running_loop()
    head = value[:16].lstrip().lower()
    if head.startswith("data:"):
        # cheap bound before any copy: base64 is 4/3 of the data, plus generous room for line breaks
        if len(value) > (max_bytes * 4) // 3 * 1.1 + 4096:
            raise _too_large("ref_audio", max_bytes)
        return await loop.run_in_executor(executor, _data_uri_to_clip, value, max_bytes, min_seconds, max_seconds)
    value = value.strip()
    if head.startswith(("http://", "https://")):
        if fetcher is None:
            raise RefAudioError("ref_audio: URLs are disabled on this server; send a data: URI")
        data = await fetcher.fetch(value, max_bytes)
        try:
            return await loop.run_in_executor(executor, decode_clip, data, min_seconds, max_seconds)
        except NotAudioError:
            raise RefAudioError(URL_FAILED) from None  # an HTML page is one more failed fetch: say nothing more
    if head.startswith("file:") or os.path.isabs(value):
        return await loop.run_in_executor(executor, _local_to_clip, value, allowed_local_path, max_bytes,
                                          min_seconds, max_seconds)
    raise RefAudioError("ref_audio must be a data URI (data:audio/wav;base64,<data>), an http(s):// URL or a "
                        "file:///absolute/path; raw base64 needs the 'data:audio/wav;base64,' prefix")
