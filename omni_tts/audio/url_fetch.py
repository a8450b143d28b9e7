"""http(s) reference audio: where a `ref_audio` URL may lead (`UrlPolicy`) and the fetcher that follows it
(`RemoteAudioFetcher`), one per server started with `--allow-remote-ref-audio`.

Only public unicast addresses are reached unless the policy names the host or network: every address a host name
resolves to is checked and the connection goes to a checked address (the check sits in the connector's resolver, so
a DNS answer cannot change between check and connect); redirects are followed by hand, each hop checked, at most
`MAX_REDIRECTS`; one time limit covers every hop and the body; the body is capped at `max_bytes`; at most
`MAX_CONCURRENT_FETCHES` fetches run at once (beyond: 429). Every failure (refused address, DNS, connection, HTTP
status, timeout, redirects) gives the one message `URL_FAILED`, so the server is no oracle for what listens where;
the detail goes to the server log.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import socket
from dataclasses import dataclass
from typing import Iterable

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from omni_tts.audio.ref_audio import MAX_BYTES, URL_FAILED, RefAudioError, too_large

logger = logging.getLogger(__name__)

MAX_CONCURRENT_FETCHES = 8     # outbound ref_audio downloads at once; more are answered 429
MAX_REDIRECTS = 3
FETCH_TIMEOUT_S = 10.0         # every hop, headers and body together
_READ_BLOCK = 64 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_HOSTNAME = re.compile(r"(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*")
# IPv6 ranges that carry an IPv4 address the stack may route to (NAT64, 6to4, IPv4-compatible): what they lead to
# is not known from the IPv6 address, so they count as non-public
_IPV4_CARRIERS = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "::/96"))


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
        raise too_large("ref_audio", max_bytes)
    data = bytearray()
    async for block in response.content.iter_chunked(_READ_BLOCK):
        data += block
        if len(data) > max_bytes:
            raise too_large("ref_audio", max_bytes)
    return bytes(data)

